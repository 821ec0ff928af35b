"""Source: a file list, a folder or a glob -> indexed image paths -> encoded bytes, checked.

Each input gets a stable `index` (its position in the list, or in sorted order for folders and
globs) that every result and error record carries, so outputs always map back to inputs.
Reading happens on a thread pool, a bounded number of batches ahead of the consumer.
"""

from __future__ import annotations

import glob as globlib
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp", ".jp2", ".pnm", ".ppm",
                              ".pgm"})
# Magic numbers of the formats DALI's decoder reads; anything else never reaches DALI.
SIGNATURES = (
    (b"\xff\xd8\xff", "jpeg"),
    (b"\x89PNG\r\n\x1a\n", "png"),
    (b"BM", "bmp"),
    (b"II*\x00", "tiff"),
    (b"MM\x00*", "tiff"),
    (b"\x00\x00\x00\x0cjP  \r\n\x87\n", "jpeg2000"),
    (b"P5", "pnm"),
    (b"P6", "pnm"),
)


class SourceError(ValueError):
    """The source itself (list file, folder, glob) cannot be used; names the path."""


@dataclass(frozen=True)
class ImageRef:
    index: int
    path: str
    """As given in the list (resolved against its folder or --root), or as found in the folder."""


@dataclass(frozen=True)
class ImageError:
    index: int
    path: str
    reason: str
    """Stable code: missing, not_a_file, unreadable, empty, unknown_format, decode_failed, ..."""
    message: str

    def to_record(self) -> dict:
        return {"index": self.index, "path": self.path, "reason": self.reason, "message": self.message}


@dataclass(frozen=True)
class EncodedImage:
    ref: ImageRef
    data: np.ndarray
    """uint8 [num_bytes], the file's bytes."""


def list_images(source: str | os.PathLike, *, root: str | os.PathLike | None = None) -> list[ImageRef]:
    """Expand SOURCE into indexed image paths.

    A `.txt` file is a list, one path per line (blank lines and lines starting with # skipped);
    relative paths resolve against `root`, else the list's folder. A folder is searched
    recursively for image extensions, sorted. Anything else with * ? [ is a glob, sorted.
    Listed paths are kept even if missing: they fail later with an error record, not silently.
    """
    text = str(source)
    path = Path(text)
    if path.is_dir():
        found = sorted(p for p in path.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
        return [ImageRef(i, str(p)) for i, p in enumerate(found)]
    if path.is_file() and path.suffix.lower() == ".txt":
        base = Path(root) if root is not None else path.parent
        refs = []
        for line in path.read_text(encoding="utf-8").splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            item = Path(line).expanduser()
            refs.append(ImageRef(len(refs), str(item if item.is_absolute() else base / item)))
        return refs
    if path.is_file():
        return [ImageRef(0, text)]
    if any(c in text for c in "*?["):
        found = sorted(p for p in globlib.glob(text, recursive=True) if os.path.isfile(p))
        return [ImageRef(i, p) for i, p in enumerate(found)]
    raise SourceError(f"source {text} is not a folder, a .txt file list, an image file or a glob; "
                      "check the path")


def sniff_format(head: bytes) -> str | None:
    for magic, name in SIGNATURES:
        if head.startswith(magic):
            return name
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    return None


def read_checked(ref: ImageRef) -> EncodedImage | ImageError:
    """Read one file and reject what cannot be an image, cheaply, before it reaches the decoder."""
    try:
        with open(ref.path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return ImageError(ref.index, ref.path, "missing", "file not found; check the path in the list")
    except IsADirectoryError:
        return ImageError(ref.index, ref.path, "not_a_file", "is a directory, not an image file")
    except OSError as e:
        return ImageError(ref.index, ref.path, "unreadable", f"cannot read: {e.strerror or e}")
    if not data:
        return ImageError(ref.index, ref.path, "empty", "file is empty (0 bytes)")
    if sniff_format(data[:16]) is None:
        return ImageError(ref.index, ref.path, "unknown_format",
                          f"not a JPEG/PNG/BMP/TIFF/WebP/JPEG 2000/PNM file (starts with {data[:8]!r})")
    return EncodedImage(ref, np.frombuffer(data, dtype=np.uint8))


def read_batches(refs: Sequence[ImageRef], *, batch_size: int, num_threads: int,
                 lookahead: int = 2) -> Iterator[list[EncodedImage | ImageError]]:
    """Yield batches of read-and-checked images in order, reading `lookahead` batches ahead."""
    chunks = [refs[i:i + batch_size] for i in range(0, len(refs), batch_size)]
    with ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="gpudet-read") as pool:
        pending: list[list[Future]] = []
        for chunk in chunks[:lookahead]:
            pending.append([pool.submit(read_checked, r) for r in chunk])
        for next_chunk in chunks[lookahead:] + [None] * min(lookahead, len(chunks)):
            futures = pending.pop(0)
            if next_chunk is not None:
                pending.append([pool.submit(read_checked, r) for r in next_chunk])
            yield [f.result() for f in futures]
