"""Sinks: stream results to disk as they come; nothing is accumulated for the end of the job.

    detections.jsonl  one record per input image that was processed, also with no detections
    errors.jsonl      one record per input image that could not be processed, with the reason
    summary.json      counts, per-stage time, throughput, device, model, resolved config

Each JSONL line is written whole and flushed per batch, so a reader never sees a torn line.
summary.json is replaced atomically (written beside, then renamed).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

try:  # a batch's records + lines: 0.19-0.35 against 1.08-1.96 ms with the json module (scripts/probe_write.py)
    import orjson
except ImportError:  # a dependency; without it (a hand-made environment) the same records, written slower
    orjson = None

from .postprocess import Detections
from .preprocess import PreprocessedBatch
from .source import ImageError


def detection_records(batch: PreprocessedBatch, detections: Detections, label_names: list[str]) -> list[dict]:
    """One JSON-ready record per image of the batch, in batch order. Columns go to Python numbers
    once per batch (`tolist`), not element by element: this runs on the main loop for every batch
    (RetinaFace on the H200: ~1.2 ms per batch of 32 before, the loop's third-largest wait)."""
    order = np.argsort(detections.batch_index, kind="stable")  # grouped by image, best first within
    starts = np.searchsorted(detections.batch_index[order], np.arange(len(batch.refs) + 1)).tolist()
    # 0.01 px, 1e-5 in score: np.round (k / 100 for the nearest integer k; JSON prints it short)
    boxes = np.round(detections.boxes_xyxy[order].astype(np.float64), 2).tolist()
    scores = np.round(detections.scores[order].astype(np.float64), 5).tolist()
    labels = detections.labels[order].tolist()
    names = [label_names[k] if k < len(label_names) else str(k) for k in labels]
    landmarks = None if detections.landmarks is None else \
        np.round(detections.landmarks[order].astype(np.float64), 2).tolist()
    orig_hw = batch.orig_hw.tolist()
    records = []
    for i, ref in enumerate(batch.refs):
        items = []
        for row in range(starts[i], starts[i + 1]):
            item: dict[str, Any] = {"box": boxes[row], "score": scores[row], "label": labels[row], "name": names[row]}
            if landmarks is not None:
                item["landmarks"] = landmarks[row]
            items.append(item)
        height, width = orig_hw[i][:2]
        records.append({"index": ref.index, "path": ref.path, "width": width, "height": height, "detections": items})
    return records


def read_complete_records(path: Path) -> list[dict]:
    """The complete records of a JSONL file left by an earlier run, killed or not.

    A kill can only leave an unterminated last line (each batch is one write of whole lines);
    that tail is cut off the file, so appending continues on a record boundary."""
    if not path.exists():
        return []
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
    return [json.loads(line) for line in data[:end].decode("utf-8").splitlines() if line.strip()]


def jsonl(records: list[dict]) -> bytes:
    """The records as JSON lines, UTF-8, compact (no spaces), one per line. This runs on the main
    loop for every batch: the json module's float formatting was most of the loop's writing time.

    A file name that is not UTF-8 (Linux allows any bytes; Python decodes them to lone surrogates)
    cannot be written as UTF-8: that batch's lines escape every non-ASCII character instead, so
    json.loads then os.fsencode give back the file's bytes."""
    try:
        if orjson is not None:
            return b"".join(orjson.dumps(r, option=orjson.OPT_APPEND_NEWLINE) for r in records)
        return "".join(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n" for r in records).encode()
    except (TypeError, UnicodeEncodeError):  # orjson's "surrogates not allowed" is a TypeError
        return "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records).encode()


class JsonlWriter:
    """Append-only JSONL file; use as a context manager, `append(records)` once per batch.
    append=True continues an existing file (resume); otherwise the file starts empty."""

    def __init__(self, path: Path, *, append: bool = False):
        self.path = path
        self.append_mode = append
        self.count = 0
        self._file: BinaryIO | None = None

    def __enter__(self) -> JsonlWriter:
        self._file = open(self.path, "ab" if self.append_mode else "wb")
        return self

    def append(self, records: list[dict]) -> None:
        if not records:
            return
        # One write of whole lines per batch, flushed: a kill leaves at most a torn last line,
        # which read_complete_records removes on --resume.
        self._file.write(jsonl(records))
        self._file.flush()
        self.count += len(records)

    def __exit__(self, *exc) -> None:
        self._file.close()


def errors_records(errors: list[ImageError]) -> list[dict]:
    return [e.to_record() for e in errors]


def write_json_atomic(path: Path, value: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)
