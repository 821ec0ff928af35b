"""Time each ONNX Runtime op of the end-to-end RetinaNet postprocess alone, at its real shapes.

    python scripts/probe_e2e_ops.py [--device cuda] [--batch 16] [--iters 30] [--json FILE]

The end-to-end graph (scripts/export_retinanet.py, EndToEnd) takes cls_logits [B, A, K] float16
(A = 120,087 anchors at 800x800, K = 91) and, per FPN level, slices the level's logits, takes the
best class per anchor (ReduceMax), the top 1,000 anchors (TopK), their logits (GatherElements), the
top 1,000 (anchor, class) pairs (TopK over 1,000 x 91), then decodes and runs one
NonMaxSuppression (scripts/probe_nms.py). This probe runs each of those ops as a graph of its own,
inputs bound on the device, so the sum shows where the in-graph postprocess's time goes; and
times alternatives for the per-anchor best class that give the same values (one ReduceMax over
all levels instead of five sliced ones, TopK k=1, MaxPool, GlobalMaxPool with the anchors as
channels, ReduceMax on float32, and for P3 ReduceMax in the head's own layout before torchvision's
permute, where the classes are an outer axis: on the H200 ORT's ReduceMax, which goes through
cuDNN after a fp16 -> fp32 conversion, read the logits at ~270 GB/s). Each graph ends in ORT's stream
synchronisation, as a model run does: "floor" (a 16-element Identity) is that fixed cost.
Medians of --iters runs, ms.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from scripts.probe_stages import timed  # noqa: E402

LEVELS = [90000, 22500, 5625, 1521, 441]  # anchors per level at 800x800 (grids 100..7, 9 cell anchors)
CLASSES, TOP_K = 91, 1000
HALF = TensorProto.FLOAT16


def model(nodes, inputs, outputs, initializers=()) -> bytes:
    graph = helper.make_graph(nodes, "probe", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


def value(name: str, elem: int, shape) -> object:
    return helper.make_tensor_value_info(name, elem, shape)


def time_bound(onnx_bytes: bytes, inputs: dict[str, np.ndarray], device: str, iters: int,
               host_inputs: dict[str, np.ndarray] | None = None) -> tuple[float, ort.IOBinding]:
    """Median seconds of one run of the model with `inputs` bound on `device` (`host_inputs` on
    the host, as ORT reads scalar inputs) and every output left on the device; and the binding,
    whose outputs the last run left."""
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
    session = ort.InferenceSession(onnx_bytes, providers=providers)
    binding = session.io_binding()
    for key, array in inputs.items():
        binding.bind_ortvalue_input(key, ort.OrtValue.ortvalue_from_numpy(array, device, 0))
    for key, array in (host_inputs or {}).items():
        binding.bind_cpu_input(key, array)
    for spec in session.get_outputs():
        binding.bind_output(spec.name, device)
    return timed(lambda: session.run_with_iobinding(binding), iters), binding


def const(name: str, array: np.ndarray):
    return numpy_helper.from_array(array, name)


def cases(batch: int) -> dict[str, tuple[bytes, dict[str, np.ndarray]]]:
    """name -> (model, inputs): each op as the end-to-end graph runs it, and the alternatives."""
    rng = np.random.default_rng(0)
    anchors = sum(LEVELS)
    logits = rng.normal(-4.6, 1.0, (batch, anchors, CLASSES)).astype(np.float16)
    p3 = logits[:, :LEVELS[0]]
    best = np.argsort(-p3.max(2), axis=1)[:, :TOP_K].astype(np.int64)
    gather_index = np.broadcast_to(best[..., None], (batch, TOP_K, CLASSES)).copy()
    pairs = np.take_along_axis(p3, gather_index, 1).reshape(batch, -1)
    out = {}
    out["floor (Identity, 16 elements)"] = (
        model([helper.make_node("Identity", ["x"], ["y"])], [value("x", HALF, [16])], [value("y", HALF, [16])]),
        {"x": np.zeros(16, np.float16)})
    nodes = [helper.make_node("Constant", [], ["ax"], value=const("ax_c", np.array([1], np.int64)))]
    outs, start = [], 0
    for i, n in enumerate(LEVELS):  # as exported: a Slice per level, then ReduceMax on it
        for name, v in ((f"s{i}", [start]), (f"e{i}", [start + n])):
            nodes.append(helper.make_node("Constant", [], [name], value=const(name + "_c", np.array(v, np.int64))))
        nodes += [helper.make_node("Slice", ["x", f"s{i}", f"e{i}", "ax"], [f"l{i}"]),
                  helper.make_node("ReduceMax", [f"l{i}"], [f"m{i}"], axes=[2], keepdims=0)]
        outs.append(value(f"m{i}", HALF, [batch, n]))
        start += n
    out["best class: Slice + ReduceMax per level (as exported)"] = (
        model(nodes, [value("x", HALF, [batch, anchors, CLASSES])], outs), {"x": logits})
    out["best class: one ReduceMax over all levels"] = (
        model([helper.make_node("ReduceMax", ["x"], ["m"], axes=[2], keepdims=0)],
              [value("x", HALF, [batch, anchors, CLASSES])], [value("m", HALF, [batch, anchors])]), {"x": logits})
    k1 = const("k1", np.array([1], np.int64))
    out["best class: TopK k=1 over all levels"] = (
        model([helper.make_node("TopK", ["x", "k1"], ["m", "i"], axis=2)],
              [value("x", HALF, [batch, anchors, CLASSES])],
              [value("m", HALF, [batch, anchors, 1]), value("i", TensorProto.INT64, [batch, anchors, 1])], [k1]),
        {"x": logits})
    out["best class: MaxPool (1 x 91) over all levels"] = (
        model([helper.make_node("MaxPool", ["x"], ["m"], kernel_shape=[1, CLASSES])],
              [value("x", HALF, [batch, 1, anchors, CLASSES])], [value("m", HALF, [batch, 1, anchors, 1])]),
        {"x": logits[:, None]})
    out["best class: GlobalMaxPool, anchors as channels [B, A, 91, 1]"] = (
        model([helper.make_node("GlobalMaxPool", ["x"], ["m"])],
              [value("x", HALF, [batch, anchors, CLASSES, 1])], [value("m", HALF, [batch, anchors, 1, 1])]),
        {"x": logits[..., None]})
    out["best class: one ReduceMax over all levels, float32 input"] = (
        model([helper.make_node("ReduceMax", ["x"], ["m"], axes=[2], keepdims=0)],
              [value("x", TensorProto.FLOAT, [batch, anchors, CLASSES])],
              [value("m", TensorProto.FLOAT, [batch, anchors])]), {"x": logits.astype(np.float32)})
    # P3 alone, in the head's layout before torchvision's permute: [B, 9 cell anchors, 91, 100, 100],
    # the classes an outer axis (contiguous grid positions under each), against the innermost axis
    side = int(round((LEVELS[0] // 9) ** 0.5))
    head = np.ascontiguousarray(p3.reshape(batch, side, side, 9, CLASSES).transpose(0, 3, 4, 1, 2))
    out["P3 best class: ReduceMax over the innermost classes [B, 90000, 91]"] = (
        model([helper.make_node("ReduceMax", ["x"], ["m"], axes=[2], keepdims=0)],
              [value("x", HALF, [batch, LEVELS[0], CLASSES])], [value("m", HALF, [batch, LEVELS[0]])]),
        {"x": np.ascontiguousarray(p3)})
    out["P3 best class: ReduceMax over the classes in the head's layout [B, 9, 91, 100, 100]"] = (
        model([helper.make_node("ReduceMax", ["x"], ["m"], axes=[2], keepdims=0)],
              [value("x", HALF, [batch, 9, CLASSES, side, side])], [value("m", HALF, [batch, 9, side, side])]),
        {"x": head})
    kk = const("kk", np.array([TOP_K], np.int64))
    out["TopK 1,000 of P3's 90,000 anchors"] = (
        model([helper.make_node("TopK", ["x", "kk"], ["v", "i"], axis=1)], [value("x", HALF, [batch, LEVELS[0]])],
              [value("v", HALF, [batch, TOP_K]), value("i", TensorProto.INT64, [batch, TOP_K])], [kk]),
        {"x": p3.max(2)})
    out["GatherElements: P3's 1,000 anchors x 91 logits"] = (
        model([helper.make_node("GatherElements", ["x", "i"], ["y"], axis=1)],
              [value("x", HALF, [batch, LEVELS[0], CLASSES]), value("i", TensorProto.INT64, [batch, TOP_K, CLASSES])],
              [value("y", HALF, [batch, TOP_K, CLASSES])]), {"x": np.ascontiguousarray(p3), "i": gather_index})
    out["TopK 1,000 of P3's 91,000 (anchor, class) pairs"] = (
        model([helper.make_node("TopK", ["x", "kk"], ["v", "i"], axis=1)],
              [value("x", HALF, [batch, TOP_K * CLASSES])],
              [value("v", HALF, [batch, TOP_K]), value("i", TensorProto.INT64, [batch, TOP_K])], [kk]),
        {"x": np.ascontiguousarray(pairs)})
    return out


def same_maxima(x: np.ndarray, binding: ort.IOBinding) -> bool:
    """Whether a best-class case's float outputs (in order) are the maxima over the class axis
    of its input: the one of size 91 (MaxPool's last, GlobalMaxPool's third, else the third)."""
    axis = next(i for i in (2, 3) if x.shape[i] == CLASSES)
    want = x.astype(np.float32).max(axis=axis).reshape(len(x), -1)
    got = [o.reshape(len(x), -1) for o in binding.copy_outputs_to_cpu() if o.dtype.kind == "f"]
    return np.array_equal(np.concatenate(got, axis=1).astype(np.float32), want)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--json", type=Path)
    a = parser.parse_args(argv)
    rows = []
    for name, (onnx_bytes, inputs) in cases(a.batch).items():
        seconds, binding = time_bound(onnx_bytes, inputs, a.device, a.iters)
        rows.append({"op": name, "ms": round(seconds * 1e3, 3)})
        print(f"{seconds * 1e3:8.3f} ms  {name}")
        if "best class" in name and not same_maxima(inputs["x"], binding):
            sys.exit(f"{name}: its outputs are not the per-anchor maxima")
    if a.json:
        a.json.write_text(json.dumps({"device": a.device, "batch": a.batch, "ort": ort.__version__, "rows": rows},
                                     indent=1))


if __name__ == "__main__":
    main()
