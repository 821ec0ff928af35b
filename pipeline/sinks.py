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
from typing import Any, TextIO

from .postprocess import Detections
from .preprocess import PreprocessedBatch
from .source import ImageError


def detection_records(batch: PreprocessedBatch, detections: Detections, label_names: list[str]) -> list[dict]:
    """One JSON-ready record per image of the batch, in batch order."""
    records = []
    for i, ref in enumerate(batch.refs):
        items = []
        for row in detections.rows_of(i):
            label = int(detections.labels[row])
            item: dict[str, Any] = {
                "box": [round(float(v), 2) for v in detections.boxes_xyxy[row]],
                "score": round(float(detections.scores[row]), 5),
                "label": label,
                "name": label_names[label] if label < len(label_names) else str(label),
            }
            if detections.landmarks is not None:
                item["landmarks"] = [[round(float(x), 2), round(float(y), 2)] for x, y in detections.landmarks[row]]
            items.append(item)
        height, width = (int(v) for v in batch.orig_hw[i])
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


class JsonlWriter:
    """Append-only JSONL file; use as a context manager, `append(records)` once per batch.
    append=True continues an existing file (resume); otherwise the file starts empty."""

    def __init__(self, path: Path, *, append: bool = False):
        self.path = path
        self.append_mode = append
        self.count = 0
        self._file: TextIO | None = None

    def __enter__(self) -> JsonlWriter:
        self._file = open(self.path, "a" if self.append_mode else "w", encoding="utf-8")
        return self

    def append(self, records: list[dict]) -> None:
        if not records:
            return
        # One write of whole lines per batch, flushed: a kill leaves at most a torn last line,
        # which read_complete_records removes on --resume.
        self._file.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
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
