"""The detections formats by name (--format) and by file: the one place that knows both."""

from __future__ import annotations

import functools
from pathlib import Path

from .layout import DETECTIONS
from .parquet import ParquetRecords
from .sinks import FORMATS, JsonlRecords, RecordFormat

__all__ = ["FORMATS", "RecordFormat", "format_of", "record_format"]


@functools.cache
def record_format(name: str) -> RecordFormat:
    """The detections format of --format `name` (FORMATS)."""
    return {kind.name: kind for kind in (JsonlRecords(), ParquetRecords())}[name]


def format_of(path: Path) -> RecordFormat | None:
    """The format whose detections `path` is (detections.jsonl, detections.parquet/ or one of its
    files), by its name; None for another name."""
    if path.name == DETECTIONS["jsonl"] or (path.suffix == ".jsonl" and path.is_file()):
        return record_format("jsonl")
    if path.suffix == ".parquet":
        return record_format("parquet")
    return None
