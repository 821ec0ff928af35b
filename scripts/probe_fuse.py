"""Which convolutions does ORT's `fuse_conv_bias` get wrong? Each Conv's output, fused and not.

    python scripts/probe_fuse.py MODEL.onnx [--batch 1 4 8 32] [--nhwc] [--fp16-input] [--json FILE]

On the H200 the CUDA EP option `fuse_conv_bias` (cuDNN's runtime-fused conv + bias) made the
RetinaFace model find hundreds of faces in a one-face photo, with results that changed with the
batch size, while RetinaNet's detections stayed the CPU's (docs/BENCHMARKS.md). This runs the
model with every Conv's output exposed, on two CUDA EP sessions (ORT's default, and
`fuse_conv_bias=1`; `--nhwc` adds `prefer_nhwc` to both) and one random input per batch size,
and prints, per batch size, the convolutions whose outputs differ (max |fused - plain| over the
max |plain|), with what distinguishes a convolution: group, kernel, stride, dilation, padding,
channels. On a machine without a GPU both sessions run on the CPU EP and agree (a dry run).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pipeline.engine import SCALAR_INPUTS  # noqa: E402

TOLERANCE = 1e-2  # relative to the layer's largest plain output: fp16 rounding stays far below


def exposed(path: Path) -> tuple[bytes, list[dict]]:
    """The model with every Conv output a graph output, and each Conv's attributes."""
    proto = onnx.load(str(path))
    weights = {i.name: numpy_helper.to_array(i).shape for i in proto.graph.initializer}
    convs, names = [], {o.name for o in proto.graph.output}
    for node in proto.graph.node:
        if node.op_type != "Conv":
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        w = weights.get(node.input[1])
        convs.append({"name": node.name or node.output[0], "output": node.output[0], "group": attrs.get("group", 1),
                      "kernel": list(attrs.get("kernel_shape", w[2:] if w else [])),
                      "stride": list(attrs.get("strides", [])),
                      "dilation": list(attrs.get("dilations", [])), "pads": list(attrs.get("pads", [])),
                      "out_channels": w[0] if w else None, "in_channels_per_group": w[1] if w else None,
                      "bias": len(node.input) > 2 and bool(node.input[2])})
        if node.output[0] not in names:
            proto.graph.output.append(onnx.helper.make_empty_tensor_value_info(node.output[0]))
    return proto.SerializeToString(), convs


def session(model: bytes, options: dict[str, str]) -> ort.InferenceSession:
    if torch.cuda.is_available():
        ort.preload_dlls()
        providers = [("CUDAExecutionProvider", options), "CPUExecutionProvider"]
    else:
        providers = ["CPUExecutionProvider"]
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model, so, providers=providers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8, 32])
    parser.add_argument("--nhwc", action="store_true", help="prefer_nhwc on both sessions")
    parser.add_argument("--json", type=Path)
    a = parser.parse_args()
    model, convs = exposed(a.model)
    base = {"prefer_nhwc": "1"} if a.nhwc else {}
    plain, fused = session(model, base), session(model, {**base, "fuse_conv_bias": "1"})
    image = next(i for i in plain.get_inputs() if i.name not in SCALAR_INPUTS)
    # an end-to-end model's thresholds: torchvision's defaults (its NMS outputs are not compared)
    scalars = {i.name: np.array([{"score_threshold": 0.05, "iou_threshold": 0.5, "max_detections": 300}[i.name]],
                                SCALAR_INPUTS[i.name]) for i in plain.get_inputs() if i.name in SCALAR_INPUTS}
    dtype = np.float16 if "float16" in image.type else np.float32
    outputs = [o.name for o in plain.get_outputs()]
    rng = np.random.default_rng(0)
    report = {"model": str(a.model), "providers": plain.get_providers(), "options": base, "batches": {}}
    print(f"{a.model}: {len(convs)} Conv nodes ({sum(c['group'] > 1 for c in convs)} grouped), "
          f"providers {plain.get_providers()[0]}, options {base}")
    for batch in a.batch:
        shape = [batch if not isinstance(d, int) or i == 0 else d for i, d in enumerate(image.shape)]
        if any(not isinstance(d, int) for d in shape):
            sys.exit(f"{a.model}: input {image.name} {image.shape} has free dimensions other than the batch")
        x = (rng.standard_normal(shape) * 50).astype(dtype)
        feeds = {image.name: x, **scalars}
        want = dict(zip(outputs, plain.run(outputs, feeds)))
        got = dict(zip(outputs, fused.run(outputs, feeds)))
        rows = []
        for c in convs:
            p, f = want[c["output"]].astype(np.float32), got[c["output"]].astype(np.float32)
            error = float(np.abs(p - f).max() / max(float(np.abs(p).max()), 1e-6))
            rows.append({**c, "relative_error": error})
        wrong = [r for r in rows if r["relative_error"] > TOLERANCE]
        report["batches"][batch] = rows
        print(f"batch {batch}: {len(wrong)} of {len(rows)} convolutions differ by more than {TOLERANCE:g}")
        for r in wrong[:25]:
            print(f"  {r['relative_error']:9.3g}  {r['name']}: group {r['group']}, kernel {r['kernel']}, stride "
                  f"{r['stride']}, dilation {r['dilation']}, pads {r['pads']}, {r['in_channels_per_group']}->"
                  f"{r['out_channels']} channels, bias {r['bias']}")
    if a.json:
        a.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
