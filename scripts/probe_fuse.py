"""Which convolutions does ORT's `fuse_conv_bias` get wrong? Each Conv's output, fused and not.

    python scripts/probe_fuse.py MODEL.onnx [--batch 1 4 8 32] [--nhwc] [--whole] [--json FILE]

On the H200 the CUDA EP option `fuse_conv_bias` (cuDNN's runtime-fused conv + bias) made the
RetinaFace model find hundreds of faces in a one-face photo, with results that changed with the
batch size, while RetinaNet's detections stayed the CPU's (docs/BENCHMARKS.md). This runs the
model with every Conv's output exposed, on two CUDA EP sessions (ORT's default, and
`fuse_conv_bias=1`; `--nhwc` adds `prefer_nhwc` to both) and one random input per batch size,
and prints, per batch size, the convolutions whose outputs differ (max |fused - plain| over the
max |plain|), with what distinguishes a convolution: group, kernel, stride, dilation, padding,
channels. `--whole` instead compares the model's own outputs, nothing exposed (exposing a Conv's
output stops ORT fusing it with the activation or Add after it), under all graph optimisations,
without ConvActivationFusion, without ConvAddActivationFusion, and with basic ones only, and names
the fused convolution nodes ORT made. On a machine without a GPU both sessions run on the CPU EP
and agree (a dry run).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
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


def session(model: bytes, options: dict[str, str], *, basic: bool = False, disabled: list[str] | None = None,
            save: Path | None = None) -> ort.InferenceSession:
    if torch.cuda.is_available():
        ort.preload_dlls()
        providers = [("CUDAExecutionProvider", options), "CPUExecutionProvider"]
    else:
        providers = ["CPUExecutionProvider"]
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if basic:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    if save is not None:
        so.optimized_model_filepath = str(save)
    return ort.InferenceSession(model, so, providers=providers, disabled_optimizers=disabled or None)


# The whole model (nothing exposed: exposing a Conv's output stops ORT fusing it with the
# activation or Add after it), fused against plain, under each of these graph optimisations.
WHOLE = {"all optimisations": {},
         "without ConvActivationFusion": {"disabled": ["ConvActivationFusion"]},
         "without ConvAddActivationFusion": {"disabled": ["ConvAddActivationFusion"]},
         "basic optimisations only": {"basic": True}}


def fused_nodes(path: Path) -> str:
    """What ORT made of the convolutions: op types with Conv in their name, with activations."""
    counts: dict[str, int] = {}
    for node in onnx.load(str(path)).graph.node:
        if "Conv" in node.op_type:
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            act = attrs.get("activation", b"")
            key = node.op_type + (f"+{act.decode() if isinstance(act, bytes) else act}" if act else "") \
                + ("+Z" if len(node.input) > 3 and node.input[3] else "")
            counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))


def whole(path: Path, base: dict[str, str], batches: list[int], rng) -> dict:
    model = path.read_bytes()
    report = {}
    for label, how in WHOLE.items():
        with tempfile.TemporaryDirectory() as folder:
            saved = Path(folder) / "optimised.onnx"
            plain = session(model, base, **how)
            fused = session(model, {**base, "fuse_conv_bias": "1"}, **how, save=saved)
            nodes = fused_nodes(saved)
        image, scalars = inputs(plain)
        names = [o.name for o in plain.get_outputs()]
        rows = {}
        for batch in batches:
            feeds = {image.name: random_input(image, batch, path, rng), **scalars}
            want, got = plain.run(names, feeds), fused.run(names, feeds)
            # an end-to-end model's outputs (detections) may differ in count: then the shapes say it
            rows[batch] = {n: relative(w, g) if w.shape == g.shape else f"shape {list(w.shape)} vs {list(g.shape)}"
                           for n, w, g in zip(names, want, got)}
        report[label] = {"nodes": nodes, "relative_error": rows}
        print(f"{label}: {report[label]['nodes']}")
        for batch, errors in rows.items():
            print(f"  batch {batch}: " + ", ".join(f"{n} {e if isinstance(e, str) else f'{e:.3g}'}"
                                                   for n, e in errors.items()))
    return report


def relative(want: np.ndarray, got: np.ndarray) -> float:
    """max |want - got| over max |want|."""
    want, got = want.astype(np.float32), got.astype(np.float32)
    return float(np.abs(want - got).max() / max(float(np.abs(want).max()), 1e-6)) if want.size else 0.0


def inputs(sess: ort.InferenceSession):
    """The image input, and an end-to-end model's thresholds at torchvision's defaults."""
    image = next(i for i in sess.get_inputs() if i.name not in SCALAR_INPUTS)
    scalars = {i.name: np.array([{"score_threshold": 0.05, "iou_threshold": 0.5, "max_detections": 300}[i.name]],
                                SCALAR_INPUTS[i.name]) for i in sess.get_inputs() if i.name in SCALAR_INPUTS}
    return image, scalars


def random_input(image, batch: int, path: Path, rng) -> np.ndarray:
    """A random image batch (x 50: the magnitudes of normalised pixels and beyond) in the input's dtype."""
    shape = [batch if not isinstance(d, int) or i == 0 else d for i, d in enumerate(image.shape)]
    if any(not isinstance(d, int) for d in shape):
        sys.exit(f"{path}: input {image.name} {image.shape} has free dimensions other than the batch")
    return (rng.standard_normal(shape) * 50).astype(np.float16 if "float16" in image.type else np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8, 32])
    parser.add_argument("--nhwc", action="store_true", help="prefer_nhwc on both sessions")
    parser.add_argument("--whole", action="store_true",
                        help="instead: the model's own outputs, fused against plain, under several graph optimisations")
    parser.add_argument("--json", type=Path)
    a = parser.parse_args()
    base = {"prefer_nhwc": "1"} if a.nhwc else {}
    rng = np.random.default_rng(0)
    if a.whole:
        print(f"{a.model}: the whole model, options {base}")
        report = whole(a.model, base, a.batch, rng)
        if a.json:
            a.json.write_text(json.dumps(report, indent=1) + "\n")
        return
    model, convs = exposed(a.model)
    plain, fused = session(model, base), session(model, {**base, "fuse_conv_bias": "1"})
    image, scalars = inputs(plain)  # an end-to-end model's NMS outputs are not compared
    outputs = [o.name for o in plain.get_outputs()]
    report = {"model": str(a.model), "providers": plain.get_providers(), "options": base, "batches": {}}
    print(f"{a.model}: {len(convs)} Conv nodes ({sum(c['group'] > 1 for c in convs)} grouped), "
          f"providers {plain.get_providers()[0]}, options {base}")
    for batch in a.batch:
        feeds = {image.name: random_input(image, batch, a.model, rng), **scalars}
        want = dict(zip(outputs, plain.run(outputs, feeds)))
        got = dict(zip(outputs, fused.run(outputs, feeds)))
        rows = [{**c, "relative_error": relative(want[c["output"]], got[c["output"]])} for c in convs]
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
