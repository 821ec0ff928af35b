"""What gpudet writes into a folder, by name, and how its folders are known: the one place that
says which files are gpudet's, so that it never removes, replaces or reads as input a file it did
not write.

    OUT/settings.json           written first: carries {"gpudet": VERSION} (MARKER_KEY); a folder
                                holding it is a gpudet output folder
    OUT/.gpudet.lock            the run's hold on the folder (its pid inside)
    OUT/detections.jsonl, OUT/detections.parquet/part-*.parquet, OUT/errors.jsonl, OUT/summary.json
    OUT/.gpudet-shards/K/, OUT/.gpudet-shards/ray-ID/   the --devices workers' and Ray actors'
                                records before their merge (the same record files)
    DRAWINGS/.gpudet-drawings   marks a folder `gpudet draw` writes into
    FILE.csv, FILE.json         what export, export-coco, eval --out and bench --json write: known
                                by how they begin (OWN_FILE_STARTS), the only files they replace

A folder source skips gpudet's output and drawing folders inside it, and gpudet's own entries in
a source that is itself an output folder.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

MARKER_KEY = "gpudet"
"""settings.json's key that says gpudet wrote it (its value: the version)."""
SETTINGS = "settings.json"
LOCK = ".gpudet.lock"
SHARDS = ".gpudet-shards"
DRAWINGS_MARKER = ".gpudet-drawings"
EXPORT_MARKER = ".gpudet-labels"
"""The mark of a folder of YOLO label files gpudet export wrote: it writes again only there."""
DETECTIONS = {"jsonl": "detections.jsonl", "parquet": "detections.parquet"}
"""The processed images' file in each output format (--format); JSONL is the default."""
ERRORS = "errors.jsonl"
SUMMARY = "summary.json"
RECORD_FILES = (DETECTIONS["jsonl"], ERRORS, SUMMARY)
"""The files of records (and the summary) in an output folder or a shard, beside detections.parquet/."""
TEMPORARY = tuple(f"{name}.tmp" for name in (*RECORD_FILES, SETTINGS))
"""What an atomic write leaves for a moment (a kill may leave it): NAME.tmp."""
NAMES = frozenset({*RECORD_FILES, DETECTIONS["parquet"], SETTINGS, LOCK, SHARDS, *TEMPORARY})
"""Every name gpudet writes at the top of an output folder."""
SHARD_NAME = re.compile(r"\d+|ray-[0-9a-f]{12}")
"""A shard folder's name: a --devices worker's number, or ray- and an actor's id."""
PARQUET_PART = re.compile(r"part-\d+-[0-9a-f]{8}\.parquet")
PARQUET_TEMPORARY = re.compile(r"\.part-\d+-[0-9a-f]{8}\.parquet\.tmp")
LOCK_TEXT = re.compile(rb"pid \d+ on \S*, started \S+\n?")


def marked_settings(path: Path) -> dict | None:
    """The settings a gpudet settings.json holds (its sections), or None when `path` is not one:
    missing, not JSON, or without gpudet's key. A settings.json from a gpudet version before the key
    (exactly the sections model, preprocess and postprocess) counts as gpudet's too."""
    try:
        if not path.is_file() or path.is_symlink() or path.stat().st_size > 1 << 20:
            return None
        value = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(value, dict):
        return None
    sections = {k: v for k, v in value.items() if k != MARKER_KEY}
    if MARKER_KEY in value or set(value) == {"model", "preprocess", "postprocess"}:
        return sections
    return None


def records_folder(detections: Path) -> Path:
    """The output folder that holds `detections` (the folder, its detections.jsonl or
    detections.parquet, or a file inside that)."""
    folder = detections if detections.is_dir() and detections.suffix != ".parquet" else detections.parent
    return folder.parent if folder.suffix == ".parquet" else folder


def with_marker(settings: dict, version: str) -> dict:
    """settings.json's content: gpudet's key first, then the settings' sections."""
    return {MARKER_KEY: version, **settings}


def is_lock_file(path: Path) -> bool:
    """Whether `path` is a lock file a gpudet run wrote (its one line: pid, host, start)."""
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > 4096:
            return False
        return LOCK_TEXT.fullmatch(path.read_bytes()) is not None
    except OSError:
        return False


def is_output_folder(path: Path) -> bool:
    """A folder a gpudet run wrote into: its settings.json, which a run writes before any record,
    is gpudet's (a lock file alone is not enough: a run killed during its setup leaves one in a
    folder it never wrote)."""
    return marked_settings(path / SETTINGS) is not None


def foreign_names(path: Path) -> list[str]:
    """The names gpudet writes that `path` (a folder that is not a gpudet output folder) holds:
    files gpudet did not write, which it must never replace or remove. A lock file of gpudet's
    (left by a run that never started) is gpudet's own."""
    names = []
    for name in sorted(NAMES):
        if os.path.lexists(path / name) and not (name == LOCK and is_lock_file(path / name)):
            names.append(name)
    return names


CSV_HEADER = "index,path,width,height,x1,y1,x2,y2,score,label,name"
"""The first row of the CSV gpudet export writes."""
OWN_FILE_STARTS = {
    "csv": re.compile(re.escape(CSV_HEADER.encode()) + rb"\r\n"),
    "coco": re.compile(rb'\[\]\Z|\[\{"image_id":\d'),  # compact: export-coco's own separators
    "metrics": re.compile(rb'\{\n  "metrics": \{\n    "AP": '),
    "bench": re.compile(rb'\{\n  "(images": \d+,\n  "(latency_batch_1|skipped|output_format)"|latency_batch_1": \{)'),
}
"""How a file gpudet wrote begins (its first 64 bytes): export's CSV, export-coco's COCO results,
eval --out's metrics, bench --json's report."""


def is_own_file(path: Path, kind: str) -> bool:
    """Whether `path` is a regular file (not a link) gpudet may replace: empty (nothing of anyone's
    to lose: a `mktemp` file, say), or beginning as gpudet's files of `kind` (OWN_FILE_STARTS) do."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        info = os.fstat(fd)
        return stat.S_ISREG(info.st_mode) and (
            info.st_size == 0 or OWN_FILE_STARTS[kind].match(os.pread(fd, 64, 0)) is not None)
    except OSError:
        return False
    finally:
        os.close(fd)


DRAWING = re.compile(r"\d{8}_[\w.-]{1,64}\.(jpg|png|webp)")
"""A drawing's name, as gpudet draw writes it: 00000042_street.jpg."""


def skipped_in_walk(top: Path, dirs: list[str], files: list[str]) -> tuple[list[str], list[str]]:
    """What a folder walk lists of one folder `top` (os.walk's dirs and files): everything but
    gpudet's own entries: in an output folder, the names gpudet writes (before its settings, its
    lock); in a folder `gpudet draw` wrote into, its mark and the drawings. The user's own files
    there stay listed (an output folder may be the source folder, or hold photos). Returns (dirs,
    files) to keep."""
    if SETTINGS in files and is_output_folder(top):
        dirs = [d for d in dirs if d not in NAMES]
        files = [f for f in files if f not in NAMES]
    elif LOCK in files and is_lock_file(top / LOCK):  # a run's first, into a folder it is also reading
        files = [f for f in files if f != LOCK]
    if DRAWINGS_MARKER in files:
        files = [f for f in files if f != DRAWINGS_MARKER and not DRAWING.fullmatch(f)]
    return dirs, files
