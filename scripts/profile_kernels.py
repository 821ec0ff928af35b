"""Device time per kernel: the RetinaNet heads on ONNX Runtime against torch eager (issue 4).

    python scripts/profile_kernels.py [--model HEADS_FP16.onnx] [--batch 16] [--iters 20] [--json FILE]
    python scripts/profile_kernels.py --model E2E_FP16.onnx --score-threshold 0   (ORT only)

ORT's own profiler times nodes on the host (its node times sum to more than the run), so it
cannot say whether ORT loses to torch eager in the kernels themselves or between them. Here
torch's profiler (CUPTI) records every CUDA kernel the process launches, ORT's cuDNN kernels
included, for `--iters` runs of each: ORT with IOBinding (fp16, NHWC, the heads-only model
scripts/export_retinanet.py writes) and the same heads in torch eager (fp16, channels_last).
Per side: wall ms per run, device ms per run (the kernels' summed durations), the idle share
(1 - device / wall: launch gaps and host syncs), the kernel count, and the heaviest kernels by
device time. Needs torchvision (builds the model; random weights, seed 0). Any other model (an
end-to-end RetinaNet, whose kernels beyond the heads' are the in-graph postprocess, or RetinaFace:
`--model models/retinaface_mnet025_heads_640_fp16.onnx --batch 32 --size 640 640`) is profiled
on ORT alone.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import export_retinanet as exporter  # noqa: E402

from pipeline.device import resolve_device  # noqa: E402
from pipeline.engine import Engine  # noqa: E402


def kernel_profile(fn, *, iters: int, device: str, top: int) -> dict:
    """Run fn `iters` times under the profiler (after warm-up); device time per kernel name."""
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(5):
        fn()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        wall = (time.perf_counter() - start) / iters
    kernels, counts = collections.Counter(), collections.Counter()
    for event in prof.events():  # none on the CPU, where this script only dry-runs
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] += event.device_time
            counts[event.name] += 1
    device_ms = sum(kernels.values()) / 1e3 / iters
    return {"wall_ms": round(1e3 * wall, 3), "device_ms": round(device_ms, 3),
            "idle_share": round(1 - device_ms / (1e3 * wall), 4) if cuda else None,
            "kernels_per_run": sum(counts.values()) / iters,
            "top": [{"kernel": name[:120], "ms_per_run": round(us / 1e3 / iters, 3),
                     "calls_per_run": counts[name] / iters}
                    for name, us in kernels.most_common(top)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path("/tmp/rn/retinanet_heads_fp16.onnx"),
                        help="a heads-only fp16 export (written here if missing)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--size", type=int, nargs=2, default=[800, 800])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--cuda-option", action="append", default=[], metavar="KEY=VALUE",
                        help="an extra ORT CUDA EP option (repeatable), e.g. fuse_conv_bias=1")
    parser.add_argument("--score-threshold", type=float, default=0.05, help="an end-to-end model's threshold")
    parser.add_argument("--json", type=Path)
    a = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    size_hw = tuple(a.size)
    # torchvision's RetinaNet, random weights with seed 0: built once, only if exported or run eagerly
    retinanet = functools.cache(lambda: exporter.build_model("retinanet_resnet50_fpn", None, 91, 0))
    if not a.model.exists():
        a.model.parent.mkdir(parents=True, exist_ok=True)
        exporter.export(retinanet(), "retinanet_heads", a.model, size_hw=size_hw, batch_size=a.batch,
                        dynamic_batch=False, fp16=True)
    options = {"prefer_nhwc": "1", **dict(o.split("=", 1) for o in a.cuda_option)}
    engine = Engine(a.model, device=resolve_device(device), cuda_options=options if device == "cuda" else {},
                    scalars={"score_threshold": a.score_threshold, "iou_threshold": 0.5, "max_detections": 300})
    x = torch.randn(a.batch, 3, *size_hw, device=device).half()
    x_ort = x if engine.image_input.dtype == "float16" else x.float()  # a float32 export takes float32
    report = {"model": str(a.model), "batch": a.batch, "size_hw": list(size_hw), "device": device,
              "cuda_options": options, "torch": torch.__version__}
    with torch.no_grad():
        sides = {"ort": lambda: engine.run(x_ort)}
        if {o.name for o in engine.outputs} == {"cls_logits", "bbox_regression"}:  # torch eager runs the same
            heads = exporter.Heads(retinanet()).to(device).half().eval().to(memory_format=torch.channels_last)
            x_cl = x.contiguous(memory_format=torch.channels_last)
            sides["torch eager"] = lambda: heads(x_cl)
        for name, fn in sides.items():
            report[name] = kernel_profile(fn, iters=a.iters, device=device, top=a.top)
    for name in sides:
        r = report[name]
        print(f"== {name}: wall {r['wall_ms']} ms/run, device {r['device_ms']} ms/run, idle share {r['idle_share']}, "
              f"{r['kernels_per_run']:.0f} kernels/run")
        for k in r["top"]:
            print(f"   {k['ms_per_run']:8.3f} ms  x{k['calls_per_run']:<5g} {k['kernel']}")
    if a.json:
        a.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
