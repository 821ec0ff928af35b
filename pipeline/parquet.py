"""Parquet: detections.parquet/, a folder of Parquet files, one row per image, that pandas, DuckDB,
Spark and pyarrow read as one table (--format parquet, `gpudet[parquet]`). pyarrow is imported
when a Parquet folder is first used."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import suppress
from pathlib import Path

import numpy as np

from . import layout
from .errors import ConfigError, OutputError, OutputWriteError, one_line
from .layout import DETECTIONS
from .results import Detections, ImageRef, label_name, record_columns
from .sinks import FLUSH_S, RESUME_FIX, BatchRecords, RecordFormat, Row, fsync_folder, open_for_writing

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
    `append(batch)` once per batch. Batches are held as they came
    (the host arrays of `Detections`) and written as one file, its rows built in one step
    (`detection_table`: the per-batch cost is a list append), named in writing order, every
    FLUSH_ROWS images, FLUSH_DETECTIONS detections or `flush_s` seconds, on `flush()` and at the
    end; each file is written under a temporary name and renamed, never through a symbolic link.
    Files of earlier runs stay (resume adds to them)."""

    FLUSH_ROWS = 65_536
    FLUSH_DETECTIONS = 1_000_000
    """About 60 MB of held detections: the memory bound when images have hundreds."""
    FLUSH_S = FLUSH_S
    """sinks.FLUSH_S: larger files are better for readers, and a file's cost is paid once per flush."""

    def __init__(self, path: Path, *, append: bool = True, flush_s: float = FLUSH_S):
        """append: the folder's files stay either way (a run that starts again removed them)."""
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

    def append(self, batch: BatchRecords) -> None:
        refs, found = batch.refs, batch.detections
        self._held.append((list(refs), np.array(batch.orig_hw[:len(refs)], np.int64), found))
        self._label_names = batch.label_names
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
    """The files of a detections.parquet folder that gpudet wrote (layout.PARQUET_PART), in
    writing order; none if it does not exist. Any other file there is not gpudet's: it is never
    read as records, moved, rewritten or removed (pandas and DuckDB would read it as part of the
    table: keep your own files elsewhere)."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.glob("part-*.parquet")
                  if layout.PARQUET_PART.fullmatch(p.name) and p.is_file() and not p.is_symlink())


def read_parquet_file(path: Path, columns: list[str] | None = None, *, fix: str = RESUME_FIX):
    """A detections.parquet folder, or one of its files, as a pyarrow Table (only `columns`, if
    given); OutputError naming it, and saying `fix`, if it is not Parquet gpudet wrote (empty, cut
    short, other columns)."""
    pq = pyarrow_parquet()
    try:
        return pq.read_table(path, columns=columns)
    except (OSError, ValueError, KeyError) as e:  # pyarrow's ArrowIOError, ArrowInvalid
        raise OutputError(f"{path}: not Parquet that gpudet detect wrote ({one_line(e, 200)}); "
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




class ParquetRecords(RecordFormat):
    name, file = "parquet", DETECTIONS["parquet"]

    def writer(self, path: Path, *, append: bool, flush_s: float) -> ParquetWriter:
        return ParquetWriter(path, flush_s=flush_s)

    def holds_results(self, path: Path) -> bool:
        return bool(parquet_files(path))

    def count(self, path: Path) -> int:
        pq = pyarrow_parquet()
        rows = 0
        for part in parquet_files(path):
            try:
                rows += pq.read_metadata(part).num_rows
            except (OSError, ValueError):  # moved by a merge since it was listed, or not Parquet (resume says so)
                pass
        return rows

    def indexed(self, path: Path) -> Iterator[tuple[int, str]]:
        for part in parquet_files(path):
            table = read_parquet_file(part, columns=["index", "path", "path_bytes"])
            for index, text, exact in zip(*(table[name].to_pylist() for name in ("index", "path", "path_bytes"))):
                yield index, path_of(text, exact)

    def load(self) -> None:
        pyarrow_parquet()

    def remove(self, folder: Path) -> list[str]:
        """The part files gpudet named (layout.PARQUET_PART) and a kill's temporary ones; the folder
        goes once empty (a file that is not gpudet's stays, and its folder)."""
        path = folder / self.file
        if not path.is_dir() or path.is_symlink():
            return []
        parts = [p for p in path.iterdir()
                 if layout.PARQUET_PART.fullmatch(p.name) or layout.PARQUET_TEMPORARY.fullmatch(p.name)]
        for part in parts:
            part.unlink()
        with suppress(OSError):
            path.rmdir()
        return [f"{self.file}/ ({len(parts)} files)"] if parts else []

    def read(self, path: Path, fix: str) -> Iterator[dict]:
        for part in parquet_files(path) if path.is_dir() else [path]:  # none: a run where every image failed
            table = read_parquet_file(part, fix=fix)
            if not {"index", "path", "path_bytes", "detections"} <= set(table.column_names):
                raise OutputError(f"{part}: no 'index', 'path', 'path_bytes' and 'detections' columns: not "
                                  f"Parquet that gpudet detect wrote; {fix}")
            for row in table.to_pylist():
                row["path"] = path_of(row["path"], row.pop("path_bytes", None))
                yield row

    def merge(self, folder: Path, shards: list[Path], seen: set[int], count: Callable[[Row], None]) -> None:
        """Each shard's files moved in; a file with an image seen before (a Ray batch run again)
        rewritten without it."""
        import pyarrow.compute as pc

        target = folder / self.file
        make_parquet_folder(target)
        for source in [target] + [shard / self.file for shard in shards]:
            for part in parquet_files(source):
                table = read_parquet_file(part)
                found = pc.list_value_length(table["detections"]).to_pylist()
                keep = []
                for index, detections in zip(table["index"].to_pylist(), found):
                    keep.append(index not in seen)
                    if keep[-1]:
                        seen.add(index)
                        count(Row(index, True, detections))
                if all(keep):
                    if source != target:
                        os.replace(part, target / part.name)
                    continue
                if any(keep):  # an image recorded twice: this file without it
                    write_parquet(table.filter(keep), target / part.name)
                if part.parent != target or not any(keep):
                    part.unlink()
        fsync_folder(target)  # the files moved in: their new names on the disk
