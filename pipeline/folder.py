"""The output folder: what --resume and --overwrite mean, its lock, its shards and their merge,
the summary and the exit code. One type every runner writes through (one process, each --devices
worker's shard and their merge, the --ray driver, bench).

gpudet removes and replaces only what it wrote (layout.py): a folder that holds a name gpudet
writes without being a gpudet output folder is refused, --overwrite removes gpudet's files only,
and shards are removed file by file, never as a tree. summary.json and settings.json are replaced
atomically. Every input ends in exactly one of the detections and errors files.
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
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from . import layout
from ._version import __version__
from .errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_SOME_FAILED, ConfigError, OutputError, OutputWriteError
from .layout import ERRORS, SHARDS, SUMMARY
from .results import Detections, ImageError, ImageRef
from .formats import FORMATS, RecordFormat, record_format
from .sinks import FLUSH_S, BatchRecords, ErrorsWriter, Row, merge_lines, open_for_writing, read_complete_records, \
    write_all

log = logging.getLogger("gpudet")


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
                 overwrite: bool = False, retry_failed: bool = False, flush_s: float = FLUSH_S, shard: bool = False):
        """output_format: how processed images are written, "jsonl" or "parquet" (FORMATS; errors
        are JSONL in both); resume: continue, skipping what is recorded; retry_failed (with
        resume): also process again the images recorded as failed; overwrite: start again;
        flush_s: Parquet's longest wait before held rows are written. shard: a --devices worker's
        or a Ray actor's folder inside .gpudet-shards/ of an output folder its run holds (and
        checked): gpudet's by its place, with no settings.json of its own."""
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
        self.kind: RecordFormat = record_format(output_format)
        self.kind.load()  # its library, now: not in the loop's first write
        if retry_failed and not resume:
            raise OutputError("--retry-failed goes with --resume: it processes again what an earlier run into "
                              f"{self.path} recorded as failed")
        self.format, self.flush_s = output_format, flush_s
        self.resume, self.overwrite, self.retry_failed = resume, overwrite, retry_failed
        self.tally = Tally()
        self._writers: tuple[Any, ErrorsWriter] | None = None
        self._changes: list[Callable[[], None]] = []
        """What `begin` accepted and `started` does to the folder's files (a run refused or stopped
        before it starts leaves them as they were)."""
        if not shard:
            check_not_foreign(self.path)
        self._made = make_folder(self.path)
        try:
            linked = [self.path / name for name in sorted(layout.NAMES) if (self.path / name).is_symlink()]
            if linked:
                raise OutputError(f"{linked[0]} is a symbolic link; gpudet never writes through one: remove it")
            self._lock_made = not os.path.lexists(self.path / self.LOCK)
            self._lock = hold_lock(self.path / self.LOCK, self.path)
            if not shard:
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
        if changes:
            blocked = [p for p in (self.path, *self._cleared_folders()) if p.is_dir() and not os.access(p, os.W_OK)]
            if blocked:  # before any change: a half-cleared folder would be neither the old run's nor this one's
                raise OutputError(f"{blocked[0]}: gpudet may not write in this folder; give it write access, or "
                                  "write into another --out (nothing in it changed)")
        try:
            for change in changes:
                change()
        except OSError as e:
            raise OutputWriteError(e.filename or self.path, e) from None

    def _cleared_folders(self) -> list[Path]:
        """The folders --overwrite removes files from, besides --out: the shards, the Parquet folders."""
        if not self.overwrite:
            return []
        folders = [self.path / SHARDS, *shard_folders(self.path)]
        return folders + [f / k.file for f in [self.path, *folders] for k in map(record_format, FORMATS)]

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
        """This folder's detections file (or Parquet folder) and errors.jsonl."""
        return result_paths(self.path, self.kind)

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
        if kept.is_file() and not os.access(kept, os.R_OK):
            raise OutputError(f"{kept}: gpudet may not read it; give it read access, or write into another --out")
        marked = None if settings is None else layout.with_marker(settings, __version__)
        if self.overwrite:  # nothing recorded counts
            self._changes = [self._clear]
            if marked is not None:
                self._changes.insert(0, functools.partial(write_json_atomic, kept, marked))
            return list(refs)
        folders = [self.path, *self.shards]
        for other in (record_format(name) for name in FORMATS if name != self.format):
            written = [f / other.file for f in folders if other.holds_results(f / other.file)]
            if written:
                raise OutputError(f"{written[0]} holds results in {other.name}; give --format {other.name} to continue "
                                  "that run, or --overwrite to start again")
        existing = [p for f in folders for p in result_paths(f, self.kind) if holds(p, self.kind)]
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
        processed, failed = recorded(existing, refs, self.kind)
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
            log.warning("--overwrite: removed gpudet's %s from %s; nothing else there changed", ", ".join(removed),
                        self.path)

    @contextmanager
    def writing(self) -> Iterator[OutputFolder]:
        """The detections and errors files open for this run: appended to with --resume, else
        started anew. Call `begin` first (a --devices worker's shard: its parent removes the
        shard's summary)."""
        self.started()  # what the run leaves stays, for --resume to read
        detections = self.kind.writer(self.files[0], append=self.resume, flush_s=self.flush_s)
        with detections as results, ErrorsWriter(self.files[1], append=self.resume) as errors:
            self._writers = (results, errors)
            try:
                yield self
            finally:
                self._writers = None

    def record(self, batch, found: Detections, labels: list[str]) -> list[Row]:
        """A batch's records (one per image: its ref, original size and detections), one write
        (Parquet: held until the writer's next file); returns what the tally counted of them."""
        self._writers[0].append(BatchRecords(batch.refs, batch.orig_hw, found, labels))
        per_image = np.bincount(found.batch_index, minlength=len(batch.refs)).tolist()
        rows = [Row(ref.index, True, n) for ref, n in zip(batch.refs, per_image)]
        for row in rows:
            self.tally.count(row)
        return rows

    def fail(self, errors: list[ImageError]) -> list[Row]:
        """Images that could not be processed, one write; returns what the tally counted of them."""
        self._writers[1].append(errors)
        rows = [Row(e.index, False, reason=e.reason) for e in errors]
        for row in rows:
            self.tally.count(row)
        return rows

    def flush(self) -> None:
        """Every record so far written out (the Parquet writer holds rows until its next file)."""
        self._writers[0].flush()

    def merge(self, count: Callable[[Row], None] = lambda row: None) -> None:
        """Rewrite this folder's files as the union, by image index, of what they hold and what
        every shard holds, each image once (an image recorded as processed anywhere is not also
        kept as failed); streamed, each file replaced atomically. `count` sees each record kept."""
        seen: set[int] = set()
        shards = self.shards
        self.kind.merge(self.path, shards, seen, count)
        merge_lines(ERRORS, self.path, shards, seen, lambda r: count(Row(r["index"], False, reason=r.get("reason"))))

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


def result_paths(folder: Path, kind: RecordFormat) -> list[Path]:
    """The detections and errors files of an output folder or of one of its shards."""
    return [folder / kind.file, folder / ERRORS]


def holds(path: Path, kind: RecordFormat) -> bool:
    """Whether a detections file (of `kind`) or an errors.jsonl holds any record."""
    return kind.holds_results(path) if path.name == kind.file else path.is_file() and path.stat().st_size > 0


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
    """Remove the files of records gpudet writes in `folder` (an output folder or a shard), in
    every format (RecordFormat.remove), errors.jsonl, summary.json and what their atomic writes
    leave. Nothing else is touched. Returns what was removed, by name."""
    removed = [name for name in FORMATS for name in record_format(name).remove(folder)]
    for name in (ERRORS, SUMMARY, *layout.TEMPORARY):
        path = folder / name
        if path.is_file() or path.is_symlink():
            path.unlink()
            removed.append(name)
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
    try:
        folders = [Path(folder), *shard_folders(Path(folder))]
    except OSError:  # a folder gpudet may not read: OutputFolder says so
        return None
    kinds = [record_format(name) for name in FORMATS]
    held = {k.name for k in kinds for f in folders if k.holds_results(f / k.file)} or \
        {k.name for k in kinds for f in folders if (f / k.file).exists()}
    return held.pop() if len(held) == 1 else None


def check_not_foreign(path: Path) -> None:
    """OutputError when --out `path` holds a name gpudet writes but is not a gpudet output folder:
    those files are someone else's, and gpudet would replace or remove them."""
    try:
        if not path.is_dir() or layout.is_output_folder(path):
            return
        foreign = layout.foreign_names(path)
    except OSError:  # what cannot be looked at is refused where the folder is made or locked
        return
    others = [name for name in foreign if name != layout.SETTINGS]
    if layout.SETTINGS in foreign and others:  # gpudet's names beside it: an edited settings.json?
        raise OutputError(f"{path / layout.SETTINGS} is not the settings file gpudet wrote (edited, or another "
                          f"program's), so gpudet cannot tell whether {', '.join(others[:3])} there are its own; "
                          "restore it, move those files, or give --out a new folder")
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


def recorded(paths: Iterable[Path], refs: list[ImageRef], kind: RecordFormat) -> tuple[set[int], set[int]]:
    """The indices recorded as processed and as failed in result files of earlier runs (detections
    files of `kind`, errors.jsonl), each checked to belong to `refs`."""
    by_index = {r.index: r.path for r in refs}
    by_path: dict[str, int] = {}
    processed: set[int] = set()
    failed: set[int] = set()
    for path in paths:
        done = failed if path.name == ERRORS else processed
        read = kind.indexed(path) if path.name == kind.file else \
            ((r["index"], r["path"]) for r in read_complete_records(path))
        for index, image in read:
            expected = by_index.get(index)
            if expected is None or image != expected:
                if not by_path:
                    by_path = {r.path: r.index for r in reversed(refs)}
                if image in by_path:  # the same file at another place: files came or went since
                    raise OutputError(moved(path, index, image, by_path[image], expected))
                this = f"which has no image {index}" if expected is None else f"whose image {index} is {expected}"
                raise OutputError(
                    f"{path}: record {index} ({image}) is not of this source, {this}; resume with the source "
                    "as the first run was given it, from the folder that run ran in (a relative path is recorded "
                    "as it resolved from there), with the same --root; or use --overwrite")
            done.add(index)
    return processed, failed


def moved(path: Path, index: int, image: str, now: int, there: str | None) -> str:
    """Why records of a source whose files came or went since cannot be resumed, and what to do."""
    change = (f"{there} is image {index} now, a file new since then or one that sorts before it" if now > index
              else "files listed before it then are gone")
    return (f"{path}: the source changed since the run that wrote it: {image} was image {index} then and is image "
            f"{now} now ({change}). A resume goes on with the same images in the same order (each record's index is "
            "its place in the source): detect the new files into another --out (a folder or a list of them), or "
            "start again with --overwrite")


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
