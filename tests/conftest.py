"""Shared fixtures. GPU tests carry the `cuda` marker and are skipped where no GPU can run them."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "samples"
# Faces the reference RetinaFace finds in each bundled photo (samples/ATTRIBUTION.md).
EXPECTED_FACES = {"astronaut.png": 1, "camera.png": 1, "grace_hopper.jpg": 1, "chelsea.png": 0, "coffee.png": 0,
                  "china.jpg": 0}


def cuda_usable() -> bool:
    from pipeline.device import cuda_problem

    return cuda_problem(0) is None


def pytest_collection_modifyitems(config, items):
    if cuda_usable():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU with torch CUDA and onnxruntime-gpu's CUDA EP")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def cpu_and_cuda():
    """Parametrize a test over both devices; the cuda case is skipped without a GPU."""
    return pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def read_results(folder: Path) -> list[dict]:
    """The processed images' records of an output folder in either format, by image index
    (a Parquet folder read with pyarrow, as users read it)."""
    if (folder / "detections.parquet").is_dir():
        import pyarrow.parquet as pq

        records = pq.read_table(folder / "detections.parquet").to_pylist()
    else:
        records = read_jsonl(folder / "detections.jsonl")
    return sorted(records, key=lambda r: r["index"])


PHOTOS = sorted(p for p in SAMPLES.iterdir() if p.suffix in (".png", ".jpg"))
"""The six bundled photos."""


def detect(*args) -> int:
    """`gpudet detect ARGS --no-progress` in this process; its exit code."""
    from pipeline.cli import main

    return main(["detect", *map(str, args), "--no-progress"])


def gpudet(*args, cwd=ROOT, timeout=300, **kwargs) -> subprocess.CompletedProcess:
    """`gpudet ARGS` as a process of its own (`python -m pipeline`), its output captured."""
    return subprocess.run([sys.executable, "-m", "pipeline", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, **kwargs)


def one_clear_line(run: subprocess.CompletedProcess, code: int, *words: str) -> None:
    """The documented exit code, no traceback, and an error line that says what is wrong."""
    assert run.returncode == code, (run.returncode, run.stderr[-2000:])
    assert "Traceback" not in run.stderr and "internal error" not in run.stderr, run.stderr[-2000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("gpudet: ERROR")]
    assert errors, run.stderr[-2000:]
    for word in words:
        assert word in errors[0], (word, errors[0])


def wait_for_lines(path: Path, count: int, process: subprocess.Popen | None = None, timeout: float = 120) -> None:
    """Until `path` holds `count` lines (records); fails if `process` ends first, or after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_bytes().count(b"\n") >= count:
            return
        assert process is None or process.poll() is None, process.communicate()
        time.sleep(0.05)
    raise AssertionError(f"no {count} lines in {path} after {timeout}s")


def encode(image, fmt: str = "PNG", **kwargs) -> bytes:
    """A PIL image's file bytes in `fmt` (Pillow's save options: quality=, exif=, ...)."""
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def random_boxes(generator, batch: int, k: int, grid: bool = False):
    """torch float32 [batch, k, 4] x1y1x2y2 boxes; grid: integer corners on a 10 px grid, so that
    many pairs meet at IoU exactly 1/2, 1/3, ... (ties at a threshold)."""
    import torch

    if grid:
        xy = torch.randint(0, 12, (batch, k, 2), generator=generator).float() * 10
        wh = torch.randint(1, 5, (batch, k, 2), generator=generator).float() * 10
    else:
        xy = torch.rand(batch, k, 2, generator=generator) * 200
        wh = torch.rand(batch, k, 2, generator=generator) * 80 + 1
    return torch.cat([xy, xy + wh], dim=-1)


def constant_model(path: Path, outputs: dict, *, metadata: dict[str, str] | None = None,
                   input_shape: list | None = None) -> Path:
    """An end_to_end ONNX model whose outputs are these constants, whatever the images; with these
    metadata_props, and an image input of this shape (default ["b", 3, "h", "w"])."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    image = helper.make_tensor_value_info("images", onnx.TensorProto.FLOAT, input_shape or ["b", 3, "h", "w"])
    nodes, declared = [], []
    for name, value in outputs.items():
        value = np.asarray(value)
        nodes.append(helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value, name)))
        kind = onnx.TensorProto.INT64 if value.dtype == np.int64 else onnx.TensorProto.FLOAT
        declared.append(helper.make_tensor_value_info(name, kind, ["n"] + [None] * (value.ndim - 1)))
    graph = helper.make_graph(nodes, "constant", [image], declared)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    for key, value in (metadata or {}).items():
        model.metadata_props.add(key=key, value=value)
    onnx.save(model, str(path))
    return path


def batched_constant_model(path: Path, outputs: dict, *, input_shape: list | None = None,
                           metadata: dict[str, str] | None = None) -> Path:
    """An ONNX model whose outputs are these constants (given without the batch dimension) for each
    image of the batch: output [B, *value.shape]."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    image = helper.make_tensor_value_info("images", onnx.TensorProto.FLOAT, input_shape or ["b", 3, "h", "w"])
    nodes = [helper.make_node("Shape", ["images"], ["shape"]),
             helper.make_node("Slice", ["shape", "zero", "one"], ["batch"])]
    initializers = [numpy_helper.from_array(np.array([0], np.int64), "zero"),
                    numpy_helper.from_array(np.array([1], np.int64), "one")]
    declared = []
    for name, value in outputs.items():
        value = np.asarray(value)
        kind = onnx.TensorProto.INT64 if value.dtype == np.int64 else onnx.TensorProto.FLOAT
        initializers += [numpy_helper.from_array(value[None], f"{name}_value"),
                         numpy_helper.from_array(np.array(value.shape, np.int64), f"{name}_dims")]
        nodes += [helper.make_node("Concat", ["batch", f"{name}_dims"], [f"{name}_shape"], axis=0),
                  helper.make_node("Expand", [f"{name}_value", f"{name}_shape"], [name])]
        declared.append(helper.make_tensor_value_info(name, kind, ["b", *value.shape]))
    graph = helper.make_graph(nodes, "batched_constant", [image], declared, initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    for key, value in (metadata or {}).items():
        model.metadata_props.add(key=key, value=value)
    onnx.save(model, str(path))
    return path
