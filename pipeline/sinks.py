"""Sinks: the record formats, streamed to disk as results come.

    detections.jsonl    one record per input image that was processed, also with no detections
      or
    detections.parquet/ the same, one row per image (--format parquet): a folder of Parquet files
                        that pandas, DuckDB, Spark and pyarrow read as one table
    errors.jsonl        one record per input image that could not be processed, with the reason

Each format is a `RecordFormat` (formats.record_format(name); JSONL here, Parquet in parquet.py): its
writer, a context manager with one `append` per batch (`BatchRecords`), its reader, its record
count and its merge of shards. The output folder (folder.OutputFolder) holds one and never
branches on which. Each JSONL batch is one write of
whole lines, so a kill leaves at most a torn last line (cut off by the next --resume); Parquet
rows are written a file at a time under a temporary name, so a kill loses at most the rows not
yet written (their images are not recorded: --resume processes them) and never leaves a torn
file.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, TextIO

import numpy as np
import orjson

from .errors import OutputError, OutputWriteError
from .layout import DETECTIONS
from .results import Detections, ImageError, ImageRef, detection_records, label_name, record_columns

FORMATS = tuple(DETECTIONS)
"""--format's names; JSONL is the default."""
FLUSH_S = 10.0
"""How long a writer may hold records before it writes them (Parquet's, a file at a time): a kill
loses at most this long of work (those images are not recorded: --resume processes them)."""


@dataclass(frozen=True)
class BatchRecords:
    """One batch's processed images as every detections writer takes them."""

    refs: list[ImageRef]
    orig_hw: np.ndarray
    """int [B, 2]: each image's (height, width); the first len(refs) rows are the images'."""
    detections: Detections
    """Host arrays a writer may keep (`to_host` makes them fresh)."""
    label_names: list[str]


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
    """Truncate the file after its last newline, if anything follows it (read from the end).
    Never through a symbolic link; OutputError naming a file that cannot be opened."""
    try:
        f = os.fdopen(os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW), "r+b")
    except FileNotFoundError:
        return
    except OSError as e:
        what = "is a symbolic link; gpudet never reads or writes records through one" if e.errno == errno.ELOOP else \
            f"cannot be opened ({e.strerror or e})"
        raise OutputError(f"{path} {what}: remove it, or give gpudet access to it") from None
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
            f.truncate(end)


RESUME_FIX = "remove it (its images are then detected again by --resume), or use --overwrite"


LINE_FIX = "remove that line (its image is then detected again by --resume), or use --overwrite"


def parse_record(line: bytes, path: Path, number: int, *, fix: str = LINE_FIX,
                 fields: tuple[str, ...] = ("path",)) -> dict:
    """One JSON line of ours, line `number` of `path`; a file name that is not UTF-8 was written
    with \\udcXX escapes (`jsonl`), which orjson refuses and the json module reads back. A line
    that is no JSON object with an integer index and `fields` (edited, or what a crash of the
    machine left) is an OutputError naming it and saying `fix`."""
    try:
        record = orjson.loads(line)
    except (orjson.JSONDecodeError, RecursionError):
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # not JSON; UnicodeDecodeError for NUL bytes; nested too deep
            record = None
    index = record.get("index") if isinstance(record, dict) else None
    if not isinstance(index, int) or isinstance(index, bool) or not isinstance(record.get("path"), str) or \
            not all(name in record for name in fields):
        raise OutputError(f"{path}: line {number} is not a record gpudet wrote ({line[:60]!r}); {fix}")
    return record


def iter_complete_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of the complete lines of a JSONL file, read as a stream (an unterminated
    last line, a kill's torn write, is left out; so are blank lines)."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return
    except OSError as e:  # a folder of that name, a file gpudet may not read
        raise OutputError(f"{path}: cannot read it as records ({e.strerror or e}); move it, or give gpudet access "
                          "to it") from None
    with f:
        for number, line in enumerate(f, 1):
            if line.endswith(b"\n") and line.strip():
                yield number, line


class JsonlWriter:
    """Append-only JSONL file; use as a context manager, `append(...)` once per batch, each batch
    one unbuffered write of whole lines. append=True continues an existing file (resume);
    otherwise the file starts empty. Never written through a symbolic link."""

    def __init__(self, path: Path, *, append: bool = False, flush_s: float = 0.0):
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


class JsonlDetections(JsonlWriter):
    """detections.jsonl's writer: a batch's records (`detection_lines`), one write."""

    def append(self, batch: BatchRecords) -> None:
        self.write(detection_lines(batch.refs, batch.orig_hw, batch.detections, batch.label_names), len(batch.refs))


class ErrorsWriter(JsonlWriter):
    """errors.jsonl's writer: a batch's failed images, one write."""

    def append(self, errors: list[ImageError]) -> None:
        self.write(jsonl([e.to_record() for e in errors]), len(errors))


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


class RecordFormat:
    """A detections format (--format): its file or folder's name in an output folder or a shard,
    its writer, and how its records are read, counted and merged. The output folder uses these,
    never the format's name."""

    name: str
    file: str

    def writer(self, path: Path, *, append: bool, flush_s: float):
        """A context manager with `append(BatchRecords)` and `flush()`."""
        raise NotImplementedError

    def holds_results(self, path: Path) -> bool:
        raise NotImplementedError

    def count(self, path: Path) -> int:
        """Records held, for progress (cheap: lines, or footers)."""
        raise NotImplementedError

    def indexed(self, path: Path) -> Iterator[tuple[int, str]]:
        """(index, path) of every record (a JSONL file's torn last line cut off)."""
        raise NotImplementedError

    def read(self, path: Path, fix: str) -> Iterator[dict]:
        """Every record, as detections.jsonl's lines hold them; OutputError naming what is not a
        record gpudet wrote, and saying `fix`."""
        raise NotImplementedError

    def load(self) -> None:
        """Import what the format's writer and readers need, now (not in the loop's first write)."""

    def remove(self, folder: Path) -> list[str]:
        """Remove this format's records from `folder` (files gpudet wrote only); what was removed, by name."""
        raise NotImplementedError

    def merge(self, folder: Path, shards: list[Path], seen: set[int], count: Callable[[Row], None]) -> None:
        """Make `folder`'s records the union, by image index, of what it and every shard hold, each
        image once (`seen`: the indices kept so far, updated); `count` sees each record kept."""
        raise NotImplementedError


class JsonlRecords(RecordFormat):
    name, file = "jsonl", DETECTIONS["jsonl"]

    def writer(self, path: Path, *, append: bool, flush_s: float) -> JsonlDetections:
        return JsonlDetections(path, append=append)

    def holds_results(self, path: Path) -> bool:
        return path.is_file() and path.stat().st_size > 0

    def count(self, path: Path) -> int:
        return lines_in(path)

    def indexed(self, path: Path) -> Iterator[tuple[int, str]]:
        for record in read_complete_records(path):
            yield record["index"], record["path"]

    def remove(self, folder: Path) -> list[str]:
        names = [name for name in (self.file, self.file + ".tmp") if os.path.lexists(folder / name)]
        for name in names:
            (folder / name).unlink()
        return names

    def read(self, path: Path, fix: str) -> Iterator[dict]:
        for number, line in iter_complete_lines(path):
            yield parse_record(line, path, number, fix=fix, fields=("path", "detections"))

    def merge(self, folder: Path, shards: list[Path], seen: set[int], count: Callable[[Row], None]) -> None:
        merge_lines(self.file, folder, shards, seen, lambda r: count(Row(r["index"], True, len(r["detections"]))))


def merge_lines(name: str, folder: Path, shards: list[Path], seen: set[int], count: Callable[[dict], None]) -> None:
    """`folder/name` (a JSONL file of records) rewritten as the union, by index, of itself and each
    shard's file of that name, each image once: streamed, on the disk (fsync) before it replaces
    the file atomically, so that the shards it holds can then be removed."""
    tmp = folder / (name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = open_for_writing(tmp, os.O_EXCL)
    try:
        block: list[bytes] = []
        for path in [folder / name] + [shard / name for shard in shards]:
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
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, folder / name)
    fsync_folder(folder)


def lines_in(path: Path) -> int:
    """How many lines a file holds (0 if it does not exist)."""
    try:
        with open(path, "rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    except FileNotFoundError:
        return 0


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


def is_device(path: Path) -> bool:
    """Whether `path` is there and neither a regular file nor a folder: a device or a pipe
    (/dev/stdout, a FIFO), written as it is, as it holds nothing to replace."""
    return os.path.exists(path) and not os.path.isfile(path) and not os.path.isdir(path)


@contextmanager
def replacing(path: Path) -> Iterator[TextIO]:
    """A text file (UTF-8; a file name that is not, as its bytes) that becomes `path` when the
    block ends: written beside it under a name of gpudet's own, with the mode `path` has (a new
    file's: the umask's), then renamed over it. On an error it is removed, and `path` stays as it
    was. A device or a pipe (/dev/stdout, a FIFO) is written as it is: it holds nothing to replace."""
    def text(fd_or_path) -> TextIO:
        return open(fd_or_path, "w", encoding="utf-8", errors="surrogateescape", newline="")

    if is_device(path):
        with text(path) as f:
            yield f
        return
    name = os.fsdecode(os.fsencode(path.name)[:64])  # under the longest name a folder takes, as `path` is
    tmp = path.with_name(f".{name}.gpudet-{os.getpid()}.tmp")
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode) if os.path.lexists(path) else None
        tmp.unlink(missing_ok=True)  # a stale one of this process's pid, or a link: removed, not followed
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        if mode is not None:
            os.fchmod(fd, mode)
    except OSError as e:  # named as the file the caller writes
        raise OSError(e.errno, e.strerror, str(path)) from None
    try:
        with text(fd) as f:
            yield f
        try:
            os.replace(tmp, path)
        except OSError as e:
            raise OSError(e.errno, e.strerror, str(path)) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def fsync_folder(path: Path) -> None:
    """The folder's entries (files renamed or moved into it) on the disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
