"""gpudet: batch object detection on NVIDIA GPUs, DALI -> DLPack -> ONNX Runtime -> torch, zero-copy.

    from pipeline import Detector
    detector = Detector.from_config(device="cuda")        # the embedded RetinaFace by default
    for result in detector.run("photos/list.txt"):        # ImageResult, or ImageError for a bad file
        print(result.path, result.boxes_xyxy, result.scores)
"""

import os

from ._version import __version__ as __version__

# ONNX Runtime's telemetry writes a device id and an event database under ~/.cache/Microsoft when it
# is imported, outside anything a user gave gpudet: off before onnxruntime loads (session.py turns
# it off too, where onnxruntime was imported first). ORT_DISABLE_TELEMETRY=0 keeps it on.
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")

__all__ = ["Detector", "ImageResult", "ImageError", "DeviceDetections", "load_config"]


def __getattr__(name: str):
    # Lazy: `import pipeline` (and `gpudet --help`) stays fast; torch/DALI/ORT load on first use.
    if name == "Detector":
        from .detector import Detector

        return Detector
    if name in ("ImageResult", "ImageError"):
        from . import results

        return getattr(results, name)
    if name == "DeviceDetections":
        from .postprocess import DeviceDetections

        return DeviceDetections
    if name == "load_config":
        from .config import load_config

        return load_config
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
