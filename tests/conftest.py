"""Shared fixtures. GPU tests carry the `cuda` marker and are skipped where no GPU can run them."""

from __future__ import annotations

import json
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
