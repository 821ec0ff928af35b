"""`gpudet inspect MODEL`: what a model looks like to gpudet, and where ORT would copy to the host."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

import onnx
import onnxruntime as ort

from .device import _cuda_problem
from .engine import ModelError, TensorSpec, check_external_data, find_image_input
from .postprocess import RETINANET_METADATA, detect_contract


def declared_io(model_path: Path) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The model's inputs and outputs as declared (symbolic dims kept), from an unoptimized CPU session."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
    return ([TensorSpec(a.name, a.type, tuple(a.shape)) for a in session.get_inputs()],
            [TensorSpec(a.name, a.type, tuple(a.shape)) for a in session.get_outputs()])


@contextlib.contextmanager
def native_stderr():
    """Captures what native code (ORT's logger) writes to file descriptor 2; yields a list that
    holds the text once the block ends."""
    text: list[str] = []
    with tempfile.TemporaryFile() as capture:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(capture.fileno(), 2)
        try:
            yield text
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            text.append(capture.read().decode(errors="replace"))


MEMCPY_LOG = re.compile(r"(\d+) Memcpy nodes are added to the graph (\S+) for (\w+)")


def memcpy_nodes(model_path: Path, size_hw: tuple[int, int] | None, *, device_index: int = 0,
                 cuda_options: dict[str, str] | None = None) -> dict:
    """Memcpy nodes ORT inserts on the CUDA EP (host round trips per run): {"count": N, "where":
    [...]}. ORT reports them in its log while it builds the session ("N Memcpy nodes are added to
    the graph G"), with the copies themselves at INFO level; the saved optimized model does not
    always hold them. size_hw fixes a symbolic input height/width as the pipeline does."""
    inputs, _ = declared_io(model_path)
    image = find_image_input(inputs, model_path)
    spec = next(s for s in inputs if s.name == image.name)
    dims = spec.shape[2:4] if image.layout == "NCHW" else spec.shape[1:3]
    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.log_severity_level = 1  # INFO: the copies ORT adds, and the count as a warning
        options.optimized_model_filepath = f"{tmp}/optimized.onnx"
        for dim, value in zip(dims, size_hw or ()):
            if isinstance(dim, str):
                options.add_free_dimension_override_by_name(dim, value)
        ort.preload_dlls()
        with native_stderr() as log_text:
            ort.InferenceSession(str(model_path), options, providers=[
                ("CUDAExecutionProvider", {"device_id": str(device_index), **(cuda_options or {})})])
        graph = onnx.load(f"{tmp}/optimized.onnx").graph
    consumers = {i: n.name or n.op_type for n in graph.node for i in n.input}
    saved = [f"{n.op_type} -> {consumers.get(n.output[0], '?')}" for n in graph.node if n.op_type.startswith("Memcpy")]
    logged = MEMCPY_LOG.findall(log_text[0])
    count = max(len(saved), sum(int(n) for n, _, _ in logged))
    detail = [line.split("] ", 1)[-1].strip() for line in log_text[0].splitlines()
              if "Memcpy" in line and not MEMCPY_LOG.search(line)]
    return {"count": count, "where": saved or detail[:50] or
            [f"{n} in graph {g} for {ep} (ORT's log)" for n, g, ep in logged]}


def inspect_model(path: str | Path, *, size_hw: tuple[int, int] | None = (640, 640)) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"{path} does not exist")
    check_external_data(path)
    model = onnx.load(str(path), load_external_data=False)
    inputs, outputs = declared_io(path)
    info = {
        "path": str(path), "ir_version": model.ir_version,
        "opset": {d.domain or "ai.onnx": d.version for d in model.opset_import},
        "producer": model.producer_name + (f" (version field: {model.producer_version})"
                                           if model.producer_version else ""),
        "nodes": len(model.graph.node),
        "ops": dict(Counter(n.op_type for n in model.graph.node).most_common(12)),
        "inputs": [s.describe() for s in inputs], "outputs": [s.describe() for s in outputs],
    }
    try:
        image = find_image_input(inputs, path)
        info["image_input"] = {"name": image.name, "layout": image.layout, "dtype": image.dtype,
                               "size_hw": image.size_hw or "any (preprocess.size)"}
    except ModelError as e:
        info["image_input"] = f"none: {e}"
    layout = next((p.value for p in model.metadata_props if p.key == RETINANET_METADATA), None)
    if layout is not None:
        layout = json.loads(layout)
        info["retinanet"] = {"grids": layout["grids"], "strides": layout["strides"],
                             "anchors_per_cell": len(layout["cell_anchors"][0]),
                             "classes": layout["num_classes"], "topk_per_level": layout["topk_candidates"]}
    try:
        info["contract"] = detect_contract(outputs, "auto", path)
    except ModelError as e:
        info["contract"] = f"none: {e}"
    if _cuda_problem(0) is None and isinstance(info["image_input"], dict):
        info["cuda_memcpy"] = memcpy_nodes(path, image.size_hw or size_hw)
    else:
        info["cuda_memcpy"] = "not checked: no usable GPU here"
    return info


def format_info(info: dict) -> str:
    lines = [f"model      {info['path']}", f"ir/opset   {info['ir_version']} / " +
             ", ".join(f"{k} {v}" for k, v in info["opset"].items()),
             f"producer   {info['producer'] or '-'}", f"nodes      {info['nodes']} ({', '.join(info['ops'])})"]
    lines += [f"input      {s}" for s in info["inputs"]] + [f"output     {s}" for s in info["outputs"]]
    lines.append(f"image      {info['image_input']}")
    lines.append(f"contract   {info['contract']}")
    if "retinanet" in info:
        r = info["retinanet"]
        lines.append(f"anchors    {len(r['grids'])} levels, grids {r['grids']}, strides {r['strides']}, "
                     f"{r['anchors_per_cell']} per cell; {r['classes']} classes; top {r['topk_per_level']} per level")
    memcpy = info["cuda_memcpy"]
    lines.append(f"memcpy     {memcpy}" if isinstance(memcpy, str) else
                 f"memcpy     {memcpy['count']} on the CUDA EP" + "".join(f"\n             {m}" for m in memcpy["where"]))
    return "\n".join(lines)
