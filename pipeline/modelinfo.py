"""`gpudet inspect MODEL`: what a model looks like to gpudet, and where ORT places its nodes on a GPU."""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

from .contracts import recognise
from .contracts.retinanet_heads import RETINANET_METADATA
from .device import cuda_problem
from .engine import ORT_TO_TORCH, TORCH_TO_NUMPY
from .errors import ModelError
from .session import declared, find_image_input, not_a_model


def cuda_placement(model_path: Path, size_hw: tuple[int, int] | None, *, device_index: int = 0,
                   cuda_options: dict[str, str] | None = None) -> dict:
    """Where ORT runs the model's nodes with the CUDA EP, from its profile of one run on a black
    image: {"nodes": {provider: count}, "cpu_ops": {op: count}, "memcpy": ["MemcpyToHost (node)",
    ...]}. Nodes on the CPU are shape arithmetic ORT keeps on the host (each a device/host round
    trip when its input lives on the GPU). ORT 1.31 names them neither in its saved optimized
    model nor in its log. Symbolic image height/width become size_hw, as in the pipeline; other
    symbolic dims 1."""
    image = find_image_input(declared(model_path).inputs, model_path)
    hw_axes = (2, 3) if image.layout == "NCHW" else (1, 2)
    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.enable_profiling = True
        options.profile_file_prefix = f"{tmp}/profile"
        ort.preload_dlls()
        session = ort.InferenceSession(str(model_path), options, providers=[
            ("CUDAExecutionProvider", {"device_id": str(device_index), **(cuda_options or {})})])
        feeds = {}
        for arg in session.get_inputs():
            shape = [d if isinstance(d, int) else
                     (size_hw[hw_axes.index(axis)] if arg.name == image.name and size_hw and axis in hw_axes else 1)
                     for axis, d in enumerate(arg.shape)]
            fill = np.zeros if arg.name == image.name else np.ones  # thresholds, counts: 1
            feeds[arg.name] = fill(shape, TORCH_TO_NUMPY[ORT_TO_TORCH.get(arg.type, torch.float32)])
        session.run(None, feeds)
        events = json.loads(Path(session.end_profiling()).read_text())
    nodes = {e["name"].removesuffix("_kernel_time"): e["args"] for e in events
             if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and "provider" in e.get("args", {})}
    return {"nodes": dict(Counter(a["provider"] for a in nodes.values())),
            "cpu_ops": dict(Counter(a.get("op_name", "?") for a in nodes.values()
                                    if a["provider"] == "CPUExecutionProvider").most_common()),
            "memcpy": sorted(f"{a.get('op_name')} ({name})" for name, a in nodes.items()
                             if str(a.get("op_name", "")).startswith("Memcpy"))}


def inspect_model(path: str | Path, *, size_hw: tuple[int, int] | None = (640, 640)) -> dict:
    path = Path(path)
    if not path.is_file():
        what = "a folder" if path.is_dir() else "no such file"
        raise ModelError(f"{path}: {what}; give the path of an ONNX model file")
    io = declared(path)
    inputs, outputs = io.inputs, io.outputs
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # declared() read it: only a file that changed since
        raise not_a_model(path, e) from None
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
        metadata = {p.key: p.value for p in model.metadata_props}
        contract = recognise(outputs, "auto", path, metadata)
        info["contract"] = contract.name
        info["recognised_by"] = contract.why(outputs, metadata)
    except ModelError as e:
        info["contract"] = f"none: {e}"
    if cuda_problem(0) is None and isinstance(info["image_input"], dict):
        info["cuda_placement"] = cuda_placement(path, image.size_hw or size_hw)
    else:
        info["cuda_placement"] = "not checked: no usable GPU here"
    return info


def format_info(info: dict) -> str:
    lines = [f"model      {info['path']}", f"ir/opset   {info['ir_version']} / " +
             ", ".join(f"{k} {v}" for k, v in info["opset"].items()),
             f"producer   {info['producer'] or '-'}", f"nodes      {info['nodes']} ({', '.join(info['ops'])})"]
    lines += [f"input      {s}" for s in info["inputs"]] + [f"output     {s}" for s in info["outputs"]]
    image = info["image_input"]  # a dict, or why the model has no image input
    lines.append("image      " + (", ".join(f"{k} {v}" for k, v in image.items()) if isinstance(image, dict) else image))
    lines.append(f"contract   {info['contract']}" + (f", recognised by {info['recognised_by']}"
                                                    if "recognised_by" in info else ""))
    if "retinanet" in info:
        r = info["retinanet"]
        lines.append(f"anchors    {len(r['grids'])} levels, grids {r['grids']}, strides {r['strides']}, "
                     f"{r['anchors_per_cell']} per cell; {r['classes']} classes; top {r['topk_per_level']} per level")
    placement = info["cuda_placement"]
    if isinstance(placement, str):
        lines.append(f"cuda EP    {placement}")
    else:
        counts = placement["nodes"]
        lines.append(f"cuda EP    {counts.get('CUDAExecutionProvider', 0)} nodes on the GPU, "
                     f"{counts.get('CPUExecutionProvider', 0)} on the CPU"
                     + (" (" + ", ".join(f"{op} {n}" for op, n in placement["cpu_ops"].items()) + ")"
                        if placement["cpu_ops"] else "")
                     + f"; Memcpy nodes: {', '.join(placement['memcpy']) or 'none'}")
    return "\n".join(lines)
