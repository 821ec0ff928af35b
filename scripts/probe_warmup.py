"""Probe (deleted once its finding is in docs/BENCHMARKS.md): Detector.from_config's setup on a
GPU, each ORT run of the warm-up timed on its own (synchronized), in a fresh process.

    python scripts/probe_warmup.py TAG [--set section.key=value ...]   -> one JSON line
"""
import sys

if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
    print("usage: probe_warmup.py TAG [--preload] [--heuristic] [--tiny] [--set section.key=value ...]")
    raise SystemExit(0)

import json
import sys
import time

t0 = time.perf_counter()
import torch  # noqa: E402

t_torch = time.perf_counter()
import pipeline.detector as detector  # noqa: E402
import pipeline.engine as engine  # noqa: E402
import pipeline.preprocess as preprocess  # noqa: E402

t_pipeline = time.perf_counter()
base = None
phases, runs = {}, []


def timed(cls, name):
    inner = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(self, *args, **kwargs)
        finally:
            phases.setdefault(f"{cls.__name__}.{name}", []).append(
                [round(start - base, 3), round(time.perf_counter() - base, 3)])
    setattr(cls, name, wrapper)


timed(engine.Engine, "__init__")
timed(preprocess.Preprocessor, "__init__")
timed(engine.Engine, "warm_up")
timed(detector.Detector, "_warm_up_postprocess")
inner_run = engine.Engine._run_once


def run_once(self, images, slot, synchronize, *args, **kwargs):
    start = time.perf_counter()
    out = inner_run(self, images, slot, synchronize, *args, **kwargs)
    self.stream.synchronize()
    runs.append({"slot": slot, "start": round(start - base, 3), "s": round(time.perf_counter() - start, 4)})
    return out


engine.Engine._run_once = run_once
args = sys.argv[2:]
loads = {}
if "--preload" in args:  # dlopen cuDNN's and cuBLAS's libraries first, each timed
    import ctypes
    import glob
    import os
    import nvidia
    for lib in ("cublas", "cudnn"):
        for path in sorted({q for root in nvidia.__path__ for q in glob.glob(os.path.join(root, lib, "lib", "lib*.so*"))}):
            start = time.perf_counter()
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            loads[os.path.basename(path)] = round(time.perf_counter() - start, 3)
if "--heuristic" in args:
    inner_options = detector.cuda_ep_options
    detector.cuda_ep_options = lambda run: {**inner_options(run), "cudnn_conv_algo_search": "HEURISTIC"}
if "--tiny" in args:  # a fresh session of a one-conv model, its first run timed, before the detector
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper
    w = helper.make_tensor("w", TensorProto.FLOAT, [8, 3, 3, 3], np.ones(216, np.float32))
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    start = time.perf_counter()
    session = ort.InferenceSession(model.SerializeToString(), providers=["CUDAExecutionProvider"])
    loads["tiny_session"] = round(time.perf_counter() - start, 3)
    for i in range(2):
        start = time.perf_counter()
        session.run(None, {"x": np.ones((1, 3, 16, 16), np.float32)})
        loads[f"tiny_run{i}"] = round(time.perf_counter() - start, 3)
overrides = [a for a in args if a not in ("--set", "--preload", "--heuristic", "--tiny")]
base = time.perf_counter()
d = detector.Detector.from_config(device=__import__("os").environ.get("DEVICE", "cuda"), overrides=overrides)
ready = time.perf_counter() - base
print(json.dumps({"tag": sys.argv[1], "overrides": overrides, "torch_import": round(t_torch - t0, 3),
                  "pipeline_import": round(t_pipeline - t_torch, 3), "loads": loads, "from_config": round(ready, 3),
                  "phases": phases, "runs": runs}))
