"""Where ORT's time goes, per operator type and per node: ONNX Runtime's own profiler on the CUDA EP.

    python scripts/profile_ort.py MODEL.onnx [--nhwc] [--iterations 20]

Runs the model with IOBinding on a random device tensor, `--iterations` times after warm-up,
and prints the kernel time per op type and the slowest nodes (from ORT's JSON profile).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pipeline.engine import ORT_TO_TORCH, SCALAR_INPUTS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--nhwc", action="store_true")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--score-threshold", type=float, default=0.05, help="end-to-end models' score_threshold")
    a = parser.parse_args()
    ort.preload_dlls()
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = "/tmp/ort_profile"
    cuda = {"prefer_nhwc": "1"} if a.nhwc else {}
    session = ort.InferenceSession(a.model, options,
                                   providers=[("CUDAExecutionProvider", cuda), "CPUExecutionProvider"])
    binding = session.io_binding()
    keep = []
    for spec in session.get_inputs():
        if spec.name in SCALAR_INPUTS:
            value = a.score_threshold if "score" in spec.name else 0.5 if "iou" in spec.name else 300
            binding.bind_cpu_input(spec.name, np.array([value], SCALAR_INPUTS[spec.name]))
            continue
        x = torch.randn(*spec.shape, device="cuda").to(ORT_TO_TORCH[spec.type])
        keep.append(x)
        binding.bind_ortvalue_input(spec.name, ort.OrtValue.from_dlpack(x))
    for spec in session.get_outputs():
        binding.bind_output(spec.name, "cuda")
    for _ in range(3 + a.iterations):
        session.run_with_iobinding(binding)
    events = json.loads(Path(session.end_profiling()).read_text())
    by_type, by_node, runs = collections.Counter(), collections.Counter(), []
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            by_type[e["args"]["op_name"]] += e["dur"]
            by_node[(e["args"]["op_name"], e["name"][:-len("_kernel_time")], e["args"].get("provider", ""))] += e["dur"]
        if e.get("cat") == "Session" and e["name"] == "model_run":
            runs.append(e["dur"])
    steady = runs[3:] or runs
    total = sum(by_type.values())
    print(f"{Path(a.model).name}: model_run median {np.median(steady) / 1e3:.2f} ms over {len(steady)} runs; "
          f"kernel time summed over all runs {total / 1e3:.1f} ms")
    for op, us in by_type.most_common(a.top):
        print(f"  {op:<28} {100 * us / total:5.1f}%  {us / 1e3 / len(runs):8.3f} ms/run")
    print("slowest nodes:")
    for (op, name, provider), us in by_node.most_common(a.top):
        print(f"  {op:<20} {provider:<24} {us / 1e3 / len(runs):8.3f} ms/run  {name[:70]}")


if __name__ == "__main__":
    main()
