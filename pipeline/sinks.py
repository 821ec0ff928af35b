"""Sinks: what a run writes into its output folder, streamed as results come.

    detections.jsonl    one record per input image that was processed, also with no detections
      or
    detections.parquet/ the same, one row per image (--format parquet): a folder of Parquet files
                        that pandas, DuckDB, Spark and pyarrow read as one table
    errors.jsonl        one record per input image that could not be processed, with the reason
    summary.json        counts, per-stage time, throughput, device, model, resolved config

`OutputFolder` is the one type every runner writes through (one process, each --devices worker
and their merge, the --ray driver, bench): what --resume and --overwrite mean, the records, the
summary and the exit code. Each batch's lines are one write of whole lines, flushed, so a kill
leaves at most a torn last line (cut off by the next --resume); Parquet rows are written a
file at a time under a temporary name, so a kill loses at most the rows not yet written (their
images are not recorded: --resume processes them) and never leaves a torn file; summary.json is
replaced atomically. Every input ends in exactly one of the detections and errors files.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import json
import logging
import os
import re
import socket
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import orjson

from . import layout
from ._version import __version__
from .errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_SOME_FAILED, ConfigError, OutputError, OutputWriteError
from .layout import DETECTIONS, ERRORS, SHARDS, SUMMARY
from .results import Detections, ImageError, ImageRef, detection_records, label_name, record_columns

FORMATS = tuple(DETECTIONS)

log = logging.getLogger("gpudet")


def result_paths(folder: Path, output_format: str) -> list[Path]:
    """The detections and errors files of an output folder or of one of its shards."""
    return [folder / DETECTIONS[output_format], folder / ERRORS]


class Row(NamedTuple):
    """What a run's tally counts of one record."""

    index: int
    processed: bool
    detections: int = 0
    reason: str | None = None


def jsonl(records: list[dict]) -> bytes:
    """The records as JSON lines, UTF-8, compact (no spaces), one per line (orjson: several times
    cheaper than the json module, which matters when a batch holds thousands of detections).

    A file name that is not UTF-8 (Linux allows any bytes; Python decodes them to lone surrogates)
    cannot be written as UTF-8: that batch's lines escape every non-ASCII character instead, so
    json.loads then os.fsencode give back the file's bytes."""
    try:
        return b"".join(orjson.dumps(r, option=orjson.OPT_APPEND_NEWLINE) for r in records)
    except TypeError:  # orjson's "surrogates not allowed"
        return "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records).encode()


def read_complete_records(path: Path) -> Iterator[dict]:
    """The complete records of a JSONL file left by an earlier run, killed or not, read as a stream.

    A kill can only leave an unterminated last line (each batch is one write of whole lines);
    that tail is cut off the file first, so appending continues on a record boundary."""
    cut_torn_tail(path)
    for number, line in iter_complete_lines(path):
        yield parse_record(line, path, number)


def cut_torn_tail(path: Path) -> None:
    """Truncate the file after its last newline, if anything follows it (read from the end)."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return
    with f:
        end = size = f.seek(0, os.SEEK_END)
        while end:
            start = max(0, end - (1 << 16))
            f.seek(start)
            at = f.read(end - start).rfind(b"\n")
            if at >= 0:
                end = start + at + 1
                break
            end = start
    if end < size:
        with open(path, "r+b") as f:
            f.truncate(end)


def parse_record(line: bytes, path: Path, number: int) -> dict:
    """One JSON line of ours, line `number` of `path`; a file name that is not UTF-8 was written
    with \\udcXX escapes (`jsonl`), which orjson refuses and the json module reads back. A line
    that is no JSON object (edited, or what a crash of the machine left) is an OutputError naming it."""
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError:
        try:
            record = json.loads(line)
        except ValueError:  # not JSON; UnicodeDecodeError for NUL bytes
            record = None
    index = record.get("index") if isinstance(record, dict) else None
    if not isinstance(index, int) or isinstance(index, bool) or not isinstance(record.get("path"), str):
        raise OutputError(f"{path}: line {number} is not a record gpudet wrote ({line[:60]!r}); remove that line "
                          "(its image is then detected again by --resume), or use --overwrite")
    return record


def iter_complete_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of the complete lines of a JSONL file, read as a stream (an unterminated
    last line, a kill's torn write, is left out; so are blank lines)."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return
    with f:
        for number, line in enumerate(f, 1):
            if line.endswith(b"\n") and line.strip():
                yield number, line


class JsonlWriter:
    """Append-only JSONL file; use as a context manager, `append(records)` once per batch, each
    batch one unbuffered write of whole lines. append=True continues an existing file (resume);
    otherwise the file starts empty. Never written through a symbolic link."""

    def __init__(self, path: Path, *, append: bool = False):
        self.path = path
        self.append_mode = append
        self.count = 0
        self._fd = -1

    def __enter__(self) -> JsonlWriter:
        self._fd = open_for_writing(self.path, os.O_APPEND if self.append_mode else os.O_TRUNC)
        return self

    def append(self, records: list[dict]) -> None:
        self.write(jsonl(records), len(records))

    def write(self, lines: bytes, count: int) -> None:
        """`count` records' whole lines, one write. A write that fails part way (the disk full, a
        file size limit) is cut off again: the file ends on its last whole record."""
        if lines:
            end = os.lseek(self._fd, 0, os.SEEK_END)
            try:
                write_all(self._fd, lines, self.path)
            except OutputWriteError:
                with suppress(OSError):  # the write's own error is what the user sees
                    os.ftruncate(self._fd, end)
                raise
            self.count += count

    def __exit__(self, *exc) -> None:
        os.close(self._fd)

    def flush(self) -> None:
        """Nothing to do: each batch was written whole when appended."""


def pyarrow_parquet():
    """pyarrow.parquet, or a ConfigError saying how to install it. Loaded with what pyarrow loads
    on its first array from numpy (pandas, where installed: a quarter of a second), so that an
    output folder pays it as it opens, not in the loop's first file."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("Parquet (--format parquet, a detections.parquet folder) needs pyarrow: pip install "
                          "'gpudet[parquet]' (or pyarrow)") from None
    pa.array(np.zeros(1))  # microseconds once loaded
    return pq


class ParquetWriter:
    """detections.parquet/: a folder of Parquet files, one row per image (Spark's layout: pandas,
    DuckDB, Spark and pyarrow read the folder as one table). Use as a context manager,
    `append(refs, orig_hw, found, label_names)` once per batch. Batches are held as they came
    (the host arrays of `Detections`) and written as one file, its rows built in one step
    (`detection_table`: the per-batch cost is a list append), named in writing order, every
    FLUSH_ROWS images, FLUSH_DETECTIONS detections or `flush_s` seconds, on `flush()` and at the
    end; each file is written under a temporary name and renamed, never through a symbolic link.
    Files of earlier runs stay (resume adds to them)."""

    FLUSH_ROWS = 65_536
    FLUSH_DETECTIONS = 1_000_000
    """About 60 MB of held detections: the memory bound when images have hundreds."""
    FLUSH_S = 10.0
    """A kill loses at most this long of work (those images are not recorded: --resume processes
    them); larger files are better for readers, and a file's cost is paid once per flush."""

    def __init__(self, path: Path, *, flush_s: float = FLUSH_S):
        self.path = path
        self.flush_s = flush_s
        self.count = 0
        self._held: list[tuple[list[ImageRef], np.ndarray, Detections]] = []
        self._label_names: list[str] = []
        self._rows = self._detections = 0
        self._flushed = time.monotonic()

    def __enter__(self) -> ParquetWriter:
        make_parquet_folder(self.path)
        return self

    def append(self, refs: list[ImageRef], orig_hw: np.ndarray, found: Detections, label_names: list[str]) -> None:
        """A batch's images (orig_hw: [B, 2], its first len(refs) rows theirs) and their detections
        (host arrays the writer may keep: `to_host` makes them fresh)."""
        self._held.append((list(refs), np.array(orig_hw[:len(refs)], np.int64), found))
        self._label_names = label_names
        self._rows += len(refs)
        self._detections += len(found.scores)
        self.count += len(refs)
        if self._rows >= self.FLUSH_ROWS or self._detections >= self.FLUSH_DETECTIONS or \
                time.monotonic() - self._flushed >= self.flush_s:
            self.flush()

    def flush(self) -> None:
        """Write the rows held, as one file."""
        self._flushed = time.monotonic()
        if not self._rows:
            return
        held, self._held, self._rows, self._detections = self._held, [], 0, 0
        refs = [ref for batch_refs, _, _ in held for ref in batch_refs]
        starts = np.cumsum([0] + [len(batch_refs) for batch_refs, _, _ in held[:-1]])
        found = [f for _, _, f in held]
        joined = Detections(
            batch_index=np.concatenate([f.batch_index + start for f, start in zip(found, starts)]),
            boxes_xyxy=np.concatenate([f.boxes_xyxy for f in found]), scores=np.concatenate([f.scores for f in found]),
            labels=np.concatenate([f.labels for f in found]),
            landmarks=None if found[0].landmarks is None else np.concatenate([f.landmarks for f in found]))
        table = detection_table(refs, np.concatenate([hw for _, hw, _ in held]), joined, self._label_names)
        write_parquet(table, self.path / f"part-{time.time_ns()}-{uuid.uuid4().hex[:8]}.parquet")

    def __exit__(self, *exc) -> None:
        self.flush()


def make_parquet_folder(path: Path) -> None:
    """The detections.parquet folder, made if missing, without a writer's leftovers (a kill's
    temporary file)."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise OutputError(f"{path} is not a folder gpudet wrote; remove it, or write into another folder")
    try:
        path.mkdir(exist_ok=True)
    except OSError as e:
        raise OutputWriteError(path, e) from None
    for tmp in path.glob(".part-*.parquet.tmp"):
        if layout.PARQUET_TEMPORARY.fullmatch(tmp.name):
            tmp.unlink()


def write_parquet(table, path: Path) -> None:
    """`table` written to `path` whole or not at all: a temporary file, on the disk (fsync) before
    it is renamed over `path`. Its name starts with a dot, which readers of the folder (pyarrow,
    pandas, Spark; DuckDB's *.parquet) pass over, should a kill leave it."""
    pq = pyarrow_parquet()
    tmp = path.with_name(f".{path.name}.tmp")
    fd = open_for_writing(tmp, os.O_EXCL)
    try:
        with os.fdopen(fd, "wb") as f:  # buffered: its last write may come as it closes
            pq.write_table(table, f)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:  # disk full, a file size limit: the temporary file goes, nothing else changes
        tmp.unlink(missing_ok=True)
        raise OutputWriteError(path, e) from None
    os.replace(tmp, path)


def parquet_files(folder: Path) -> list[Path]:
    """A detections.parquet folder's files, in writing order (none if it does not exist): what
    readers of the folder read as its table (pandas, DuckDB's *.parquet). gpudet removes only the
    ones it names (layout.PARQUET_PART)."""
    return sorted(p for p in folder.glob("*.parquet") if p.is_file()) if folder.is_dir() else []


RESUME_FIX = "remove it (its images are then detected again by --resume), or use --overwrite"


def read_parquet_file(path: Path, columns: list[str] | None = None, *, fix: str = RESUME_FIX):
    """A detections.parquet folder, or one of its files, as a pyarrow Table (only `columns`, if
    given); OutputError naming it, and saying `fix`, if it is not Parquet gpudet wrote (empty, cut
    short, other columns)."""
    pq = pyarrow_parquet()
    try:
        return pq.read_table(path, columns=columns)
    except (OSError, ValueError, KeyError) as e:  # pyarrow's ArrowIOError, ArrowInvalid
        raise OutputError(f"{path}: not Parquet that gpudet detect wrote ({' '.join(str(e).split())[:200]}); "
                          f"{fix}") from None


def text_path(path: str) -> str:
    """The path as Parquet's UTF-8 text holds it: itself, or, for a file name that is not UTF-8
    (Python's lone surrogates), its bytes with the ones that are not UTF-8 written as \\xNN."""
    return path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def exact_path(path: str) -> bytes | None:
    """The `path_bytes` column: None for a path that is UTF-8 text, else the file name's bytes
    (`os.fsdecode` gives the path back), which `path`'s text alone does not hold."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return os.fsencode(path)
    return None


def path_of(text: str, exact: bytes | None) -> str:
    """A Parquet row's path as Python names the file (the inverse of text_path and exact_path)."""
    return text if exact is None else os.fsdecode(exact)


COLUMNS_FROM = {"boxes": 256, "landmarks": 96}
"""The detections in a batch from which `detection_lines` builds them a column at a time, without
and with landmarks. Below, one Python dict per detection costs no more than the columns' fixed
cost (about twenty numpy calls): where the two cross on the development machine
(docs/BENCHMARKS.md)."""


def detection_lines(refs: list[ImageRef], orig_hw: np.ndarray, detections: Detections, label_names: list[str]) -> bytes:
    """A batch's lines of detections.jsonl: the bytes of `jsonl(detection_records(...))`, built
    without a Python object per detection from COLUMNS_FROM detections in the batch. orjson writes
    each column (boxes, scores, labels, landmarks) in one call over its numpy array, the same
    numbers as for Python floats; the text is cut at the row boundaries, and an image's detections
    are one join of those pieces between the fixed keys. Text that is not UTF-8 (a file name or
    a class name with Python's lone surrogates) takes `jsonl`'s escaped lines instead."""
    marks = detections.landmarks
    few = len(detections.scores) < COLUMNS_FROM["boxes" if marks is None else "landmarks"]
    if not (few or (marks is not None and marks.shape[1] == 0)):  # (no landmarks: no points to cut the text at)
        try:
            return column_lines(refs, orig_hw, detections, label_names)
        except TypeError:  # orjson's "surrogates not allowed"
            pass
    return jsonl(detection_records(refs, orig_hw, detections, label_names))


def column_lines(refs: list[ImageRef], orig_hw: np.ndarray, detections: Detections, label_names: list[str]) -> bytes:
    """`detection_lines` a column at a time; TypeError for text that is not UTF-8."""
    columns = record_columns(detections, len(refs))
    counts = columns.per_image
    ends = np.cumsum(counts)
    m = len(columns.scores)
    close = b"}" if columns.landmarks is None else b"]]}"
    pieces = np.empty((m, 9 if columns.landmarks is None else 11), dtype=object)  # [detection, piece]
    if m:
        pieces[:, 0] = b'{"box":['
        pieces[:, 1] = numpy_json(columns.boxes)[2:-2].split(b"],[")
        pieces[:, 2] = b'],"score":'
        pieces[:, 3] = numpy_json(columns.scores)[1:-1].split(b",")
        pieces[:, 4] = b',"label":'
        pieces[:, 5] = numpy_json(columns.labels)[1:-1].split(b",")
        pieces[:, 6] = b',"name":'
        pieces[:, 7] = names_json(tuple(label_names), columns.labels)
        if columns.landmarks is not None:
            pieces[:, 8] = b',"landmarks":[['
            pieces[:, 9] = numpy_json(columns.landmarks)[3:-3].split(b"]],[[")
        pieces[:, -1] = close + b","
        pieces[ends[counts > 0] - 1, -1] = close + b"]"  # each image's last detection
        pieces[ends[counts > 0] - counts[counts > 0], 0] = b'[{"box":['  # and its first
    flat = pieces.ravel().tolist()
    bounds = (np.concatenate([[0], ends]) * pieces.shape[1]).tolist()
    return b"".join([orjson.dumps({"index": ref.index, "path": ref.path, "width": width, "height": height,
                                   "detections": orjson.Fragment(b"".join(flat[a:b])) if b > a else NONE_FOUND},
                                  option=orjson.OPT_APPEND_NEWLINE)
                     for ref, (height, width), a, b in zip(refs, np.asarray(orig_hw)[:, :2].tolist(), bounds,
                                                           bounds[1:])])


NONE_FOUND = orjson.Fragment(b"[]")


@functools.lru_cache(maxsize=16)
def label_names_json(label_names: tuple[str, ...]) -> np.ndarray:
    """Each class name as JSON text, an object array indexed by label."""
    return np.array([orjson.dumps(name) for name in label_names], dtype=object)


def names_json(label_names: tuple[str, ...], labels: np.ndarray) -> np.ndarray:
    """The JSON text of each label's name (`label_name`: its number where the config names no class)."""
    table = label_names_json(label_names)
    if len(labels) and (labels.min() < 0 or labels.max() >= len(table)):
        return np.array([orjson.dumps(name) for name in label_name(list(label_names), labels.tolist())], dtype=object)
    return table[labels]


def numpy_json(values: np.ndarray) -> bytes:
    """A numpy array as JSON (nested lists), in one orjson call."""
    return orjson.dumps(np.ascontiguousarray(values), option=orjson.OPT_SERIALIZE_NUMPY)


def detection_table(refs: list[ImageRef], orig_hw: np.ndarray, detections: Detections, label_names: list[str]):
    """A batch's rows for detections.parquet, built from the arrays without a Python object per
    detection: the fields and values of `detection_records` (`record_columns`), the detections of
    an image as a list of structs, best first."""
    import pyarrow as pa

    columns = record_columns(detections, len(refs))
    label_values, label_rows = np.unique(columns.labels, return_inverse=True)
    names = pa.array(label_name(label_names, label_values.tolist()), pa.string()).take(pa.array(label_rows.ravel()))
    fields = {"box": pairs_of(columns.boxes, 4), "score": pa.array(columns.scores), "label": pa.array(columns.labels),
              "name": names}
    if columns.landmarks is not None:
        points = columns.landmarks  # [M, K, 2]
        fields["landmarks"] = nested_list(pairs_of(points.reshape(-1, 2), 2), len(points), points.shape[1])
    items = pa.StructArray.from_arrays(list(fields.values()), names=list(fields))
    offsets = np.concatenate([[0], np.cumsum(columns.per_image)]).astype(np.int32)
    hw = np.asarray(orig_hw, np.int64)[:len(refs)]  # [B, 2] (height, width); a batch may hold more rows
    return pa.table({"index": pa.array([r.index for r in refs], pa.int64()),
                     "path": pa.array([text_path(r.path) for r in refs], pa.string()),
                     "path_bytes": pa.array([exact_path(r.path) for r in refs], pa.binary()),
                     "width": pa.array(hw[:, 1]), "height": pa.array(hw[:, 0]),
                     "detections": pa.ListArray.from_arrays(pa.array(offsets), items)})


def pairs_of(values: np.ndarray, size: int):
    """Rows of `size` numbers ([N, size] float64) as a list<double> array of N lists."""
    import pyarrow as pa

    return nested_list(pa.array(values.ravel()), len(values), size)


def nested_list(values, count: int, size: int):
    """`count` lists of `size` consecutive items of `values`."""
    import pyarrow as pa

    return pa.ListArray.from_arrays(pa.array(np.arange(0, count * size + 1, size, dtype=np.int32)), values)


def records_in(path: Path) -> int:
    """How many records a detections or errors file holds, for progress: JSONL lines counted, a
    Parquet folder's rows read from its files' footers."""
    if path.suffix == ".parquet":
        pq = pyarrow_parquet()
        rows = 0
        for part in parquet_files(path):
            try:
                rows += pq.read_metadata(part).num_rows
            except (OSError, ValueError):  # moved by a merge since it was listed, or not Parquet (resume says so)
                pass
        return rows
    try:
        with open(path, "rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    except FileNotFoundError:
        return 0


def shard_folders(folder: Path) -> list[Path]:
    """An output folder's shard folders (`.gpudet-shards/K/`, `.gpudet-shards/ray-ID/`), where
    --devices workers and Ray actors write their records before they are merged into its files;
    a symbolic link, or a folder of another name, is none."""
    shards = folder / SHARDS
    if not shards.is_dir() or shards.is_symlink():
        return []
    return sorted(p for p in shards.iterdir()
                  if layout.SHARD_NAME.fullmatch(p.name) and p.is_dir() and not p.is_symlink())


def remove_records(folder: Path) -> list[str]:
    """Remove the files of records gpudet writes in `folder` (an output folder or a shard):
    detections.jsonl, errors.jsonl, summary.json, the parts of detections.parquet/ and what their
    atomic writes leave; the Parquet folder goes once empty. Nothing else is touched. Returns
    what was removed, by name."""
    removed = []
    for name in (*layout.RECORD_FILES, *layout.TEMPORARY):
        path = folder / name
        if path.is_file() or path.is_symlink():
            path.unlink()
            removed.append(name)
    parquet = folder / DETECTIONS["parquet"]
    if parquet.is_dir() and not parquet.is_symlink():
        parts = [p for p in parquet.iterdir()
                 if layout.PARQUET_PART.fullmatch(p.name) or layout.PARQUET_TEMPORARY.fullmatch(p.name)]
        for part in parts:
            part.unlink()
        if parts:
            removed.append(f"{DETECTIONS['parquet']}/ ({len(parts)} files)")
        with suppress(OSError):  # not empty: a file that is not gpudet's stays, and its folder
            parquet.rmdir()
    return removed


def remove_shards(folder: Path) -> list[str]:
    """Remove the shard folders of an output folder (their records merged, or --overwrite): the
    files of records in each, then each shard folder and .gpudet-shards/ once empty. A file in
    them that gpudet did not write stays, with the folders that hold it. Returns what was
    removed, by name."""
    shards = shard_folders(folder)
    for shard in shards:
        remove_records(shard)
        if layout.is_lock_file(shard / layout.LOCK):  # the worker's, ended: the output folder's lock holds the run
            (shard / layout.LOCK).unlink()
        with suppress(OSError):
            shard.rmdir()
    with suppress(OSError):
        (folder / SHARDS).rmdir()
    kept = [p for p in shards if p.exists()]
    if kept:
        log.warning("%s: kept, as it holds files gpudet did not write", kept[0])
    return [f"{SHARDS}/ ({len(shards)} shard{'s' if len(shards) != 1 else ''})"] if shards else []


def written_format(folder: str | Path) -> str | None:
    """The format (FORMATS) whose detections an output folder, or one of its shards, holds; where
    none holds a record yet (a run stopped before its first Parquet file, with only errors.jsonl
    written), the format whose detections file or folder a run made there; None if neither tells
    (or both do, which OutputFolder refuses to continue without --format)."""
    folders = [Path(folder), *shard_folders(Path(folder))]
    held = {name for name in FORMATS for f in folders if holds_results(f / DETECTIONS[name])} or \
        {name for name in FORMATS for f in folders if (f / DETECTIONS[name]).exists()}
    return held.pop() if len(held) == 1 else None


def holds_results(path: Path) -> bool:
    """Whether a detections or errors file (or Parquet folder) holds any record."""
    if path.suffix == ".parquet":
        return bool(parquet_files(path))
    return path.is_file() and path.stat().st_size > 0


def indexed_paths(path: Path) -> Iterator[tuple[int, str]]:
    """(index, path) of every record a result file of an earlier run holds (a JSONL file's torn
    last line cut off; a Parquet folder's two columns read, not its detections)."""
    if path.suffix == ".parquet":
        for part in parquet_files(path):
            table = read_parquet_file(part, columns=["index", "path", "path_bytes"])
            for index, text, exact in zip(*(table[name].to_pylist() for name in ("index", "path", "path_bytes"))):
                yield index, path_of(text, exact)
    else:
        for record in read_complete_records(path):
            yield record.get("index"), record.get("path")


def open_for_writing(path: Path, mode: int) -> int:
    """A file descriptor to write `path`, never through a symbolic link (a link planted in the
    output folder would make gpudet overwrite its target). mode: os.O_APPEND, O_TRUNC or O_EXCL."""
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | mode, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OutputError(f"{path} is a symbolic link; gpudet never writes through one: remove it") from None
        raise OutputWriteError(path, e) from None


def write_all(fd: int, data: bytes, path: Path) -> None:
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view):]
    except OSError as e:  # disk full, a file size limit, an I/O error: what was written before stays whole
        raise OutputWriteError(path, e) from None


def fsync_folder(path: Path) -> None:
    """The folder's entries (files renamed or moved into it) on the disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def setting_changes(before: dict, now: dict) -> list[str]:
    """Each key of two result_settings that differs: "section.key: was X, now Y"."""
    def keys(settings: dict) -> dict:
        return {f"{section}.{key}": value for section, values in settings.items() for key, value in values.items()}

    old, new = keys(before), keys(now)
    changed = [f"{key}: was {json.dumps(value)}, now {json.dumps(new.get(key))}" for key, value in old.items()
               if new.get(key) != value]
    return changed + [f"{key}: new, {json.dumps(value)}" for key, value in new.items() if key not in old]


def empty_file(path: Path) -> None:
    """Truncate a records file to nothing (never through a symbolic link)."""
    os.close(open_for_writing(path, os.O_TRUNC))


def write_json_atomic(path: Path, value: Any) -> None:
    """Written beside `path`, then renamed over it: a reader sees the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)  # a stale one, or a link: removed, not followed
    fd = open_for_writing(tmp, os.O_EXCL)
    try:
        write_all(fd, (json.dumps(value, indent=2, ensure_ascii=False) + "\n").encode(), tmp)
    finally:
        os.close(fd)
    os.replace(tmp, path)


@dataclass
class RunResult:
    summary: dict
    exit_code: int  # errors.py: 0, 3 (some images failed), 130 (interrupted), 1 (a worker failed)


@dataclass
class Tally:
    """What one run recorded, for the summary and the exit code."""

    processed: int = 0
    failed: int = 0
    detections: int = 0
    interrupted: bool = False
    failed_before: int = 0
    """Images an earlier run into the folder recorded as failed (a --resume's)."""
    failed_by_reason: Counter = field(default_factory=Counter)

    def count(self, row: Row) -> None:
        if row.processed:
            self.processed += 1
            self.detections += row.detections
        else:
            self.failed += 1
            self.failed_by_reason[row.reason or "unknown"] += 1

    @property
    def exit_code(self) -> int:
        """0: every image processed; 3: finished, some failed (in this run or an earlier one into the
        folder: errors.jsonl is not empty); 130: interrupted."""
        return EXIT_INTERRUPTED if self.interrupted else \
            EXIT_SOME_FAILED if self.failed or self.failed_before else EXIT_OK


class OutputFolder:
    """A run's output folder, held by one run at a time (a lock file, released when the folder is
    closed or the process ends; a second run is refused, naming the holder). `begin` says which
    images the run must process (all; with --resume those not yet recorded; results there without
    either flag are an error); inside `writing()`, `record` and `fail` stream each batch's records
    and count them in `tally`. Use as a context manager.

    gpudet removes and replaces only what it wrote (layout): a folder that holds a name gpudet
    writes without being a gpudet output folder is refused, --overwrite removes gpudet's files
    only, and the shards are removed file by file, never as a tree."""

    LOCK = layout.LOCK
    SETTINGS = layout.SETTINGS
    """The settings that decide this folder's records (Config.result_settings), as its first run
    had them, with gpudet's key (layout.MARKER_KEY): --resume with others is refused."""

    def __init__(self, path: str | Path, *, output_format: str = "jsonl", resume: bool = False,
                 overwrite: bool = False, retry_failed: bool = False, flush_s: float = ParquetWriter.FLUSH_S):
        """output_format: how processed images are written, "jsonl" or "parquet" (FORMATS; errors
        are JSONL in both); resume: continue, skipping what is recorded; retry_failed (with
        resume): also process again the images recorded as failed; overwrite: start again;
        flush_s: Parquet's longest wait before held rows are written."""
        self._lock = -1
        self._made: list[Path] = []
        """The folders this run made (--out and the parents it lacked): if it ends before it started
        (refused, or its model does not load), close() removes them again, so that no empty --out
        is left behind."""
        self._lock_made = False
        """The lock file is this run's: a run that never starts removes it again."""
        self.path = Path(path)
        if output_format not in FORMATS:
            raise ConfigError(f"--format {output_format}: give one of {', '.join(FORMATS)}")
        if output_format == "parquet":
            pyarrow_parquet()
        if retry_failed and not resume:
            raise OutputError("--retry-failed goes with --resume: it processes again what an earlier run into "
                              f"{self.path} recorded as failed")
        self.format, self.flush_s = output_format, flush_s
        self.resume, self.overwrite, self.retry_failed = resume, overwrite, retry_failed
        self.tally = Tally()
        self._writers: tuple[JsonlWriter | ParquetWriter, JsonlWriter] | None = None
        self._changes: list[Callable[[], None]] = []
        """What `begin` accepted and `started` does to the folder's files (a run refused or stopped
        before it starts leaves them as they were)."""
        check_not_foreign(self.path)
        self._made = make_folder(self.path)
        try:
            linked = [self.path / name for name in sorted(layout.NAMES) if (self.path / name).is_symlink()]
            if linked:
                raise OutputError(f"{linked[0]} is a symbolic link; gpudet never writes through one: remove it")
            self._lock_made = not os.path.lexists(self.path / self.LOCK)
            self._lock = hold_lock(self.path / self.LOCK, self.path)
            check_not_foreign(self.path)  # again, holding the folder: nothing changed since the first look
        except BaseException:
            self.close()
            raise

    def started(self) -> None:
        """From here on the folder stays, whatever stops the run: its records are being written
        (writing() calls this), or workers write into its shards (--devices, --ray). What `begin`
        accepted is done to the folder's files now: --overwrite's removal, --retry-failed's
        emptied errors.jsonl, the earlier summary gone, settings.json written (gpudet's mark on the
        folder, before any record)."""
        self._made, self._lock_made = [], False
        changes, self._changes = self._changes, []
        for change in changes:
            change()

    def close(self) -> None:
        """Release the folder for another run. A folder this run made and never started (started())
        goes again, with the lock and the parents this run made; so does a lock file this run made
        in a folder that was there. A file anyone else put there keeps it."""
        try:
            if self._lock_made and self._lock >= 0:
                with suppress(OSError):  # the run's own error, not this, is what the user sees
                    (self.path / self.LOCK).unlink()
            if self._made:
                with suppress(OSError):
                    for name in (self.LOCK, self.SETTINGS, self.SETTINGS + ".tmp"):
                        (self.path / name).unlink(missing_ok=True)
        finally:
            if self._lock >= 0:
                os.close(self._lock)
                self._lock = -1
            self._lock_made = False
        with suppress(OSError):  # not empty: someone else's file is there
            for folder in self._made:
                folder.rmdir()
        self._made = []

    def __enter__(self) -> OutputFolder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        self.close()

    @property
    def lock_fd(self) -> int:
        """The lock file's descriptor: a process that inherits it (a --devices worker) holds the
        folder with this one, until the last of them has ended."""
        return self._lock

    @property
    def files(self) -> list[Path]:
        """This folder's detections file (DETECTIONS[format]) and errors.jsonl."""
        return result_paths(self.path, self.format)

    @property
    def shards(self) -> list[Path]:
        """This folder's shard folders (shard_folders)."""
        return shard_folders(self.path)

    def begin(self, refs: list[ImageRef], settings: dict | None = None) -> list[ImageRef]:
        """Start a run over `refs`: the images it must process. A run refused here (results without
        --resume, another format, another source, other `settings`: Config.result_settings, kept
        in settings.json by the run that started the folder's records) changes nothing, and
        neither does one accepted here that stops before `started` (its detector cannot be built,
        an interrupt during setup): what it would change is done there, before anything is
        written, so that a summary always describes the run that wrote it.
        Records in the shards count as this folder's; --overwrite removes them with the files (of
        either format); retry_failed empties every errors.jsonl, so that those images are
        processed again. The images recorded as failed before count in `tally.failed_before`
        (and in the exit code)."""
        kept = self.path / self.SETTINGS
        marked = None if settings is None else layout.with_marker(settings, __version__)
        if self.overwrite:  # nothing recorded counts
            self._changes = [self._clear]
            if marked is not None:
                self._changes.insert(0, functools.partial(write_json_atomic, kept, marked))
            return list(refs)
        parquet = self.path / DETECTIONS["parquet"]
        if parquet.exists() and not parquet.is_dir():
            raise OutputError(f"{parquet} is not a folder gpudet wrote; remove it, or use --overwrite")
        folders = [self.path, *self.shards]
        other = next((name for name in FORMATS if name != self.format), None)
        written = [f / DETECTIONS[other] for f in folders if holds_results(f / DETECTIONS[other])]
        if written:
            raise OutputError(f"{written[0]} holds results in {other}; give --format {other} to continue that run, "
                              "or --overwrite to start again")
        existing = [p for f in folders for p in result_paths(f, self.format) if holds_results(p)]
        if existing and not self.resume:
            raise OutputError(f"{existing[0]} already holds results; pass --resume to process only the images "
                              "not yet recorded there, or --overwrite to start again")
        if existing and settings is not None and kept.is_file():
            before = layout.marked_settings(kept)
            try:
                changed = None if before is None else setting_changes(before, settings)
            except AttributeError:  # not sections of keys
                changed = None
            if changed is None:
                raise OutputError(f"{kept} is not the settings file gpudet wrote; remove it to resume without "
                                  "checking the settings, or --overwrite to start again")
            if changed:
                raise OutputError(f"--resume: the records in {self.path} were made with other settings "
                                  f"({'; '.join(changed[:3])}{'; ...' if len(changed) > 3 else ''}); give the same "
                                  "--config, --model and --set to continue them, or --overwrite to start again")
        processed, failed = recorded(existing, refs)
        failed -= processed
        # accepted: the old summary is no longer this folder's
        self._changes = []
        if marked is not None and not (existing and kept.is_file()):  # the folder's mark, before anything else
            self._changes.append(functools.partial(write_json_atomic, kept, marked))
        self._changes.append(functools.partial((self.path / SUMMARY).unlink, missing_ok=True))
        if self.retry_failed:  # checked to be this source's above; processed again from here
            self._changes += [functools.partial(empty_file, path) for path in existing if path.name == ERRORS]
            failed = set()
        self.tally.failed_before = len(failed)
        return [r for r in refs if r.index not in processed and r.index not in failed]

    def _clear(self) -> None:
        """--overwrite: every record of the folder and its shards gone, in either format; gpudet's
        files only, and it says which."""
        removed = remove_shards(self.path) + remove_records(self.path)
        if removed:
            log.warning("--overwrite: removed gpudet's %s from %s (nothing else there)", ", ".join(removed), self.path)

    @contextmanager
    def writing(self) -> Iterator[OutputFolder]:
        """The detections and errors files open for this run: appended to with --resume, else
        started anew. Call `begin` first (a --devices worker's shard: its parent removes the
        shard's summary)."""
        self.started()  # what the run leaves stays, for --resume to read
        detections = JsonlWriter(self.files[0], append=self.resume) if self.format == "jsonl" else \
            ParquetWriter(self.files[0], flush_s=self.flush_s)
        with detections as results, JsonlWriter(self.files[1], append=self.resume) as errors:
            self._writers = (results, errors)
            try:
                yield self
            finally:
                self._writers = None

    def record(self, batch, found: Detections, labels: list[str]) -> list[Row]:
        """A batch's records (one per image: its ref, original size and detections), one write
        (Parquet: held until the writer's next file); returns what the tally counted of them."""
        if self.format == "jsonl":
            self._writers[0].write(detection_lines(batch.refs, batch.orig_hw, found, labels), len(batch.refs))
        else:
            self._writers[0].append(batch.refs, batch.orig_hw, found, labels)
        per_image = np.bincount(found.batch_index, minlength=len(batch.refs)).tolist()
        rows = [Row(ref.index, True, n) for ref, n in zip(batch.refs, per_image)]
        for row in rows:
            self.tally.count(row)
        return rows

    def fail(self, errors: list[ImageError]) -> None:
        """Images that could not be processed, one write."""
        self._writers[1].append([e.to_record() for e in errors])
        for e in errors:
            self.tally.count(Row(e.index, False, reason=e.reason))

    def flush(self) -> None:
        """Every record so far written out (the Parquet writer holds rows until its next file)."""
        self._writers[0].flush()

    def merge(self, count: Callable[[Row], None] = lambda row: None) -> None:
        """Rewrite this folder's files as the union, by image index, of what they hold and what
        every shard holds, each image once (an image recorded as processed anywhere is not also
        kept as failed); streamed, each file replaced atomically (Parquet: each shard's files
        moved in, those with an image already seen rewritten without it). `count` sees each
        record kept."""
        seen: set[int] = set()
        shards = self.shards
        if self.format == "parquet":
            self._merge_parquet(seen, count)
        else:
            self._merge_jsonl(DETECTIONS["jsonl"], shards, seen, lambda r: count(Row(r["index"], True,
                                                                                     len(r["detections"]))))
        self._merge_jsonl(ERRORS, shards, seen, lambda r: count(Row(r["index"], False, reason=r.get("reason"))))

    def _merge_jsonl(self, name: str, shards: list[Path], seen: set[int], count: Callable[[dict], None]) -> None:
        tmp = self.path / (name + ".tmp")
        tmp.unlink(missing_ok=True)
        fd = open_for_writing(tmp, os.O_EXCL)
        try:
            block: list[bytes] = []
            for path in [self.path / name] + [shard / name for shard in shards]:
                for number, line in iter_complete_lines(path):
                    record = parse_record(line, path, number)
                    if record["index"] not in seen:
                        seen.add(record["index"])
                        count(record)
                        block.append(line)
                        if len(block) == 4096:
                            write_all(fd, b"".join(block), tmp)
                            block.clear()
            write_all(fd, b"".join(block), tmp)
            os.fsync(fd)  # on the disk before the shards it holds can be removed (drop_shards)
        finally:
            os.close(fd)
        os.replace(tmp, self.path / name)
        fsync_folder(self.path)

    def _merge_parquet(self, seen: set[int], count: Callable[[Row], None]) -> None:
        import pyarrow.compute as pc

        target = self.path / DETECTIONS["parquet"]
        make_parquet_folder(target)
        for folder in [target] + [shard / DETECTIONS["parquet"] for shard in self.shards]:
            for part in parquet_files(folder):
                table = read_parquet_file(part)
                found = pc.list_value_length(table["detections"]).to_pylist()
                keep = []
                for index, detections in zip(table["index"].to_pylist(), found):
                    keep.append(index not in seen)
                    if keep[-1]:
                        seen.add(index)
                        count(Row(index, True, detections))
                if all(keep):
                    if folder != target:
                        os.replace(part, target / part.name)
                    continue
                if any(keep):  # an image recorded twice (a Ray batch run again): this file without it
                    write_parquet(table.filter(keep), target / part.name)
                if part.parent != target or not any(keep):
                    part.unlink()
        fsync_folder(target)  # the files moved in: their new names on the disk

    def drop_shards(self) -> None:
        """Remove the shards, merged into this folder's files (on the disk: `merge` syncs them), so
        that a finished run's folder holds each record once. A runner calls it only once every
        image of its run is recorded and nothing writes to the shards any more; otherwise they stay,
        for --resume to merge."""
        remove_shards(self.path)

    def write_summary(self, *, source: str, images: int, todo: int, device: str, seconds: dict[str, float],
                      loop_seconds: float, started: datetime, model: dict | None = None, config: dict | None = None,
                      extra: dict | None = None) -> dict:
        """summary.json: this run's tally and times (seconds: total, setup and the stages), with
        what ran it and where (cwd: the folder relative paths in the records resolve against).
        images_per_s counts the images recorded per second of the loop (after setup)."""
        t = self.tally
        summary = {
            "gpudet": __version__, "source": source, "cwd": os.getcwd(), "out": str(self.path),
            "results": str(self.files[0]),
            "format": self.format, "images": images,
            "already_done": images - todo, "already_failed": t.failed_before, "processed": t.processed,
            "failed": t.failed,
            "failed_by_reason": dict(t.failed_by_reason), "detections": t.detections, "interrupted": t.interrupted,
            "seconds": {k: round(v, 4) for k, v in seconds.items()},
            "images_per_s": round((t.processed + t.failed) / max(loop_seconds, 1e-9), 2),
            "device": device, **({"model": model} if model else {}), **({"config": config} if config else {}),
            **(extra or {}),
            "started": started.isoformat(timespec="seconds"),
            "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        write_json_atomic(self.path / SUMMARY, summary)
        return summary


def check_not_foreign(path: Path) -> None:
    """OutputError when --out `path` holds a name gpudet writes but is not a gpudet output folder:
    those files are someone else's, and gpudet would replace or remove them."""
    try:
        if not path.is_dir() or layout.is_output_folder(path):
            return
        foreign = layout.foreign_names(path)
    except OSError:  # what cannot be looked at is refused where the folder is made or locked
        return
    if foreign:
        raise OutputError(f"--out {path} holds {', '.join(foreign[:4])}, which gpudet did not write (it holds no "
                          f"{layout.SETTINGS} of gpudet's): gpudet never replaces or removes a file it did not write; "
                          "give --out a new or empty folder, or move those files")


def make_folder(path: Path) -> list[Path]:
    """Make the --out folder `path` (and its parents) if it is not there; the folders this call
    made, `path` first, then the parents it made (none: `path` was there). OutputError if it is a
    file or cannot be made."""
    missing, at = [], path
    try:
        while not os.path.lexists(at) and at != at.parent:
            missing.append(at)
            at = at.parent
        path.mkdir(parents=True)
        return missing
    except FileExistsError:
        if not path.is_dir():
            raise OutputError(f"--out {path} is a file, not a folder; give a folder gpudet may create and "
                              "write") from None
        return []
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise OutputWriteError(path, e, "nothing was written; make room, then run again") from None
        raise OutputError(f"--out {path} cannot be made: {e.strerror or e}; give a folder gpudet may create "
                          "and write") from None


LOCK_WAIT_S = 5.0
"""How long a run waits for a folder held by processes of a run that ended (the --devices workers
of a parent that was killed die with it, within a second)."""


def hold_lock(path: Path, folder: Path) -> int:
    """An exclusive lock on `path` (flock), with who holds it written inside; OutputError naming
    the holder if another run has it. A folder whose holder (the pid in the file, on this host)
    has ended is waited for, up to LOCK_WAIT_S: its workers are ending."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise OutputWriteError(path, e, "nothing was written; make room, then run again") from None
        raise OutputError(f"{path}: cannot open the output folder's lock file ({e.strerror or e}); check the "
                          "folder's permissions") from None
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError:
            holder = " ".join(os.pread(fd, 4096, 0).decode("utf-8", "replace").split())
            if time.monotonic() < deadline and holder_ended(holder):
                time.sleep(0.1)
                continue
            os.close(fd)
            raise OutputError(f"--out {folder} is in use by another gpudet run ({holder or 'another process'}); wait "
                              "for it to end, or write into another folder") from None
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    line = f"pid {os.getpid()} on {socket.gethostname()}, started {started}\n".encode()
    try:
        os.ftruncate(fd, 0)
        if os.pwrite(fd, line, 0) != len(line):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError as e:  # the disk full already: one line, before anything else is written
        os.close(fd)
        raise OutputWriteError(path, e, "nothing was written; make room, then run again") from None
    return fd


def holder_ended(holder: str) -> bool:
    """Whether the process a lock file names ("pid N on HOST, ...") was on this host and has ended."""
    match = re.match(r"pid (\d+) on (\S*),", holder)
    if match is None or match.group(2) != socket.gethostname():
        return False
    try:
        os.kill(int(match.group(1)), 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    return False


def recorded(paths: Iterable[Path], refs: list[ImageRef]) -> tuple[set[int], set[int]]:
    """The indices recorded as processed and as failed in result files of earlier runs (detections
    files, errors.jsonl), each checked to belong to `refs`."""
    by_index = {r.index: r.path for r in refs}
    processed: set[int] = set()
    failed: set[int] = set()
    for path in paths:
        done = failed if path.name == ERRORS else processed
        for index, image in indexed_paths(path):
            expected = by_index.get(index)
            if expected is None or image != expected:
                this = f"which has no image {index}" if expected is None else f"whose image {index} is {expected}"
                raise OutputError(
                    f"{path}: record {index} ({image}) is not of this source, {this}; resume with the source "
                    "as the first run was given it, from the folder that run ran in (a relative path is recorded "
                    "as it resolved from there), with the same --root; or use --overwrite")
            done.add(index)
    return processed, failed
