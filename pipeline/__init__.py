"""gpudet: batch object detection on NVIDIA GPUs, DALI -> DLPack -> ONNX Runtime -> torch, zero-copy."""

__version__ = "0.1.0"
