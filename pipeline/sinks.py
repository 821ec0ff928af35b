"""Sinks: what a run writes into its output folder, streamed as results come.

    detections.jsonl  one record per input image that was processed, also with no detections
    errors.jsonl      one record per input image that could not be processed, with the reason
    summary.json      counts, per-stage time, throughput, device, model, resolved config

`OutputFolder` is the one type every runner writes through (one process, each --devices worker
and their merge, the --ray driver, bench): what --resume and --overwrite mean, the records, the
summary and the exit code. Each batch's lines are one write of whole lines, flushed, so a kill
leaves at most a torn last line (cut off by the next --resume); summary.json is replaced
atomically. Every input ends in exactly one of the two JSONL files.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import orjson

from ._version import __version__
from .errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_SOME_FAILED, OutputError, OutputWriteError
from .results import Detections, ImageError, ImageRef, detection_records

RESULT_FILES = ("detections.jsonl", "errors.jsonl")
SHARDS = "shards"


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
    for line in iter_complete_lines(path):
        yield parse_record(line)


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


def parse_record(line: bytes) -> dict:
    """One JSON line of ours; a file name that is not UTF-8 was written with \\udcXX escapes
    (`jsonl`), which orjson refuses and the json module reads back."""
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError:
        return json.loads(line)


def iter_complete_lines(path: Path) -> Iterator[bytes]:
    """The complete lines of a JSONL file, read as a stream (an unterminated last line, a kill's
    torn write, is left out)."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return
    with f:
        for line in f:
            if line.endswith(b"\n") and line.strip():
                yield line


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
        if records:
            write_all(self._fd, jsonl(records), self.path)
            self.count += len(records)

    def __exit__(self, *exc) -> None:
        os.close(self._fd)


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

    def count(self, name: str, record: dict) -> None:
        """One record of RESULT_FILES[0] (a processed image) or [1] (a failed one)."""
        if name == RESULT_FILES[0]:
            self.processed += 1
            self.detections += len(record.get("detections") or [])
        else:
            self.failed += 1
            self.failed_by_reason[record.get("reason", "unknown")] += 1

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
    and count them in `tally`. Use as a context manager."""

    LOCK = ".gpudet.lock"
    FILES = RESULT_FILES + ("summary.json", "summary.json.tmp") + tuple(name + ".tmp" for name in RESULT_FILES)

    def __init__(self, path: str | Path, *, resume: bool = False, overwrite: bool = False,
                 retry_failed: bool = False):
        """resume: continue, skipping what is recorded; retry_failed (with resume): also process
        again the images recorded as failed; overwrite: start again."""
        self._lock = -1
        self.path = Path(path)
        if retry_failed and not resume:
            raise OutputError("--retry-failed goes with --resume: it processes again what an earlier run into "
                              f"{self.path} recorded as failed")
        self.resume, self.overwrite, self.retry_failed = resume, overwrite, retry_failed
        self.tally = Tally()
        self._writers: tuple[JsonlWriter, JsonlWriter] | None = None
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            kind = "is a file, not a folder" if isinstance(e, FileExistsError) else \
                f"cannot be made: {e.strerror or e}"
            raise OutputError(f"--out {self.path} {kind}; give a folder gpudet may create and write") from None
        linked = [self.path / name for name in self.FILES if (self.path / name).is_symlink()]
        if linked:
            raise OutputError(f"{linked[0]} is a symbolic link; gpudet never writes through one: remove it")
        self._lock = hold_lock(self.path / self.LOCK, self.path)

    def close(self) -> None:
        """Release the folder for another run."""
        if self._lock >= 0:
            os.close(self._lock)
            self._lock = -1

    def __enter__(self) -> OutputFolder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        self.close()

    @property
    def files(self) -> list[Path]:
        return [self.path / name for name in RESULT_FILES]

    @property
    def shards(self) -> list[Path]:
        """The shard folders (`shards/*/`), where --devices workers and Ray actors write their
        records before they are merged into this folder's files."""
        folder = self.path / SHARDS
        return sorted(p for p in folder.iterdir() if p.is_dir() and not p.is_symlink()) if folder.is_dir() else []

    def begin(self, refs: list[ImageRef]) -> list[ImageRef]:
        """Start a run over `refs`: the images it must process. An earlier run's summary.json goes
        first, so that a summary always describes the run that wrote it, whatever stops this one.
        Records in the shards count as this folder's; --overwrite removes them with the files;
        retry_failed empties every errors.jsonl, so that those images are processed again. The
        images recorded as failed before count in `tally.failed_before` (and in the exit code)."""
        if self.overwrite:
            shutil.rmtree(self.path / SHARDS, ignore_errors=True)
            for path in self.files:
                if path.exists():
                    os.close(open_for_writing(path, os.O_TRUNC))
        (self.path / "summary.json").unlink(missing_ok=True)
        existing = [p for p in self.files + [s / name for s in self.shards for name in RESULT_FILES]
                    if p.exists() and p.stat().st_size]
        if existing and not self.resume:
            raise OutputError(f"{existing[0]} already holds results; pass --resume to process only the images "
                              "not yet recorded there, or --overwrite to start again")
        found = recorded(existing, refs)
        processed = found[RESULT_FILES[0]]
        failed = found[RESULT_FILES[1]] - processed
        if self.retry_failed:  # checked to be this source's above; processed again from here
            for path in existing:
                if path.name == RESULT_FILES[1]:
                    os.close(open_for_writing(path, os.O_TRUNC))
            failed = set()
        self.tally.failed_before = len(failed)
        return [r for r in refs if r.index not in processed and r.index not in failed]

    @contextmanager
    def writing(self) -> Iterator[OutputFolder]:
        """The two JSONL files open for this run: appended to with --resume, else started anew.
        Call `begin` first (a --devices worker's shard: its parent removes the shard's summary)."""
        with JsonlWriter(self.files[0], append=self.resume) as results, \
                JsonlWriter(self.files[1], append=self.resume) as errors:
            self._writers = (results, errors)
            try:
                yield self
            finally:
                self._writers = None

    def record(self, batch, found: Detections, labels: list[str]) -> list[dict]:
        """A batch's records (one per image: detection_records of its refs, original sizes and
        detections), one write; returns them."""
        records = detection_records(batch.refs, batch.orig_hw, found, labels)
        self._writers[0].append(records)
        for record in records:
            self.tally.count(RESULT_FILES[0], record)
        return records

    def fail(self, errors: list[ImageError]) -> None:
        """Images that could not be processed, one write."""
        records = [e.to_record() for e in errors]
        self._writers[1].append(records)
        for record in records:
            self.tally.count(RESULT_FILES[1], record)

    def merge(self, count: Callable[[str, dict], None] = lambda name, record: None) -> None:
        """Rewrite this folder's JSONL files as the union, by image index, of what they hold and what
        every shard holds, each image once (an image recorded as processed anywhere is not also
        kept as failed); streamed, written in large blocks, each file replaced atomically. `count`
        sees each record kept."""
        seen: set[int] = set()
        shards = self.shards
        for name in RESULT_FILES:
            tmp = self.path / (name + ".tmp")
            tmp.unlink(missing_ok=True)
            fd = open_for_writing(tmp, os.O_EXCL)
            try:
                block: list[bytes] = []
                for path in [self.path / name] + [shard / name for shard in shards]:
                    for line in iter_complete_lines(path):
                        record = parse_record(line)
                        if record["index"] not in seen:
                            seen.add(record["index"])
                            count(name, record)
                            block.append(line)
                            if len(block) == 4096:
                                write_all(fd, b"".join(block), tmp)
                                block.clear()
                write_all(fd, b"".join(block), tmp)
            finally:
                os.close(fd)
            os.replace(tmp, self.path / name)

    def write_summary(self, *, source: str, images: int, todo: int, device: str, seconds: dict[str, float],
                      loop_seconds: float, started: datetime, model: dict | None = None, config: dict | None = None,
                      extra: dict | None = None) -> dict:
        """summary.json: this run's tally and times (seconds: total, setup and the stages), with
        what ran it. images_per_s counts the images recorded per second of the loop (after setup)."""
        t = self.tally
        summary = {
            "gpudet": __version__, "source": source, "out": str(self.path), "images": images,
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
        write_json_atomic(self.path / "summary.json", summary)
        return summary


def hold_lock(path: Path, folder: Path) -> int:
    """An exclusive lock on `path` (flock), with who holds it written inside; OutputError naming
    the holder if another process has it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        raise OutputError(f"{path}: cannot open the output folder's lock file ({e.strerror or e}); check the "
                          "folder's permissions") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = " ".join(os.pread(fd, 4096, 0).decode("utf-8", "replace").split()) or "another process"
        os.close(fd)
        raise OutputError(f"--out {folder} is in use by another gpudet run ({holder}); wait for it to end, or write "
                          "into another folder") from None
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, started {started}\n".encode(), 0)
    return fd


def recorded(paths: Iterable[Path], refs: list[ImageRef]) -> dict[str, set[int]]:
    """Indices recorded in result files of earlier runs, by file name (RESULT_FILES), each checked
    to belong to `refs`."""
    by_index = {r.index: r.path for r in refs}
    found: dict[str, set[int]] = {name: set() for name in RESULT_FILES}
    for path in paths:
        done = found[path.name]
        for record in read_complete_records(path):
            index = record.get("index")
            if by_index.get(index) != record.get("path"):
                raise OutputError(
                    f"{path}: record {index} ({record.get('path')}) is not image {index} of this source; resume with "
                    "the same source (and --root), or use --overwrite")
            done.add(index)
    return found
