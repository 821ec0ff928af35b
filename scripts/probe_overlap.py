"""Probe: does ORT's first run of the default model overlap the torch import when it runs on a
thread started before it? One JSON line."""
import sys

if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
    print("usage: probe_overlap.py thread|serial|boot|serial_boot")
    raise SystemExit(0)

import json
import sys
import threading
import time

t0 = time.perf_counter()
import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402

mode = sys.argv[1]
marks = {"ort_import": time.perf_counter() - t0}
options = {"device_id": "0", "prefer_nhwc": "1", "fuse_conv_bias": "1"}
session = ort.InferenceSession("models/retinaface_mnet025_heads_640_fp16_nhwc.onnx",
                               providers=[("CUDAExecutionProvider", options)])
marks["session"] = time.perf_counter() - t0
x = np.zeros((32, 640, 640, 3), np.float16)


def first_run():
    s = time.perf_counter()
    session.run(None, {session.get_inputs()[0].name: x})
    marks["first_run"] = [s - t0, time.perf_counter() - t0]


if mode in ("thread", "boot"):
    thread = threading.Thread(target=first_run)
    thread.start()
s = time.perf_counter()
import torch  # noqa: E402
import pipeline.detector  # noqa: E402,F401
marks["imports"] = [s - t0, time.perf_counter() - t0]
if mode in ("thread", "boot"):
    thread.join()
elif mode != "boot":
    first_run()
if mode in ("boot", "serial_boot"):
    import pipeline.engine as engine
    runs = []
    inner = engine.Engine._run_once

    def run_once(self, images, slot, synchronize, *args, **kwargs):
        s = time.perf_counter()
        out = inner(self, images, slot, synchronize, *args, **kwargs)
        self.stream.synchronize()
        runs.append(time.perf_counter() - s)
        return out
    engine.Engine._run_once = run_once
    s = time.perf_counter()
    pipeline.detector.Detector.from_config(device="cuda")
    marks["detector"] = [s - t0, time.perf_counter() - t0]
    marks["detector_first_run"] = runs[0]
marks["total"] = time.perf_counter() - t0
print(json.dumps({"mode": mode, **{k: (round(v, 3) if isinstance(v, float) else [round(a, 3) for a in v])
                                    for k, v in marks.items()}}))
