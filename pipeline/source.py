"""Source: a file list, a folder or a glob -> indexed image paths -> encoded bytes, checked.

Each input gets a stable `index` (its position in the list, or in sorted order for folders and
globs) that every result and error record carries, so outputs always map back to inputs.
Files are read a bounded number of batches ahead of the consumer, on a pool of threads, and
checked cheaply (exists, non-empty, an image signature, a sane declared size) so that a bad file
never reaches the decoder.
"""

from __future__ import annotations

import glob as globlib
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import SourceError
from .results import ImageError, ImageRef

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


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from the first SOF marker; None if the header ends before one."""
    i = 2
    while i + 4 <= len(data):
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:  # standalone markers
            i += 2
            continue
        if marker in (0xD9, 0xDA):  # end of image / start of scan before any frame header
            return None
        length = int.from_bytes(data[i + 2:i + 4], "big")
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC) and i + 9 <= len(data):
            return int.from_bytes(data[i + 7:i + 9], "big"), int.from_bytes(data[i + 5:i + 7], "big")
        i += 2 + length
    return None


def _tiff_size(data: bytes) -> tuple[int, int] | None:
    order = "little" if data[:2] == b"II" else "big"
    offset = int.from_bytes(data[4:8], order)
    if offset + 2 > len(data):
        return None
    count = int.from_bytes(data[offset:offset + 2], order)
    dims = {}
    for k in range(count):
        entry = data[offset + 2 + 12 * k: offset + 14 + 12 * k]
        if len(entry) < 12:
            return None
        tag, kind = int.from_bytes(entry[0:2], order), int.from_bytes(entry[2:4], order)
        if tag in (256, 257):
            dims[tag] = int.from_bytes(entry[8:10] if kind == 3 else entry[8:12], order)
    return (dims[256], dims[257]) if len(dims) == 2 else None


def _pnm_size(data: bytes) -> tuple[int, int] | None:
    fields = []
    for line in data[2:512].split(b"\n"):
        fields += line.split(b"#")[0].split()
        if len(fields) >= 2:
            return int(fields[0]), int(fields[1])
    return None


def image_size(data: bytes, kind: str) -> tuple[int, int] | None:
    """(width, height) declared by the file's header, or None if it cannot be read."""
    try:
        if kind == "jpeg":
            return _jpeg_size(data)
        if kind == "png":
            return (int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")) \
                if data[12:16] == b"IHDR" and len(data) >= 24 else None
        if kind == "bmp":
            if int.from_bytes(data[14:18], "little") == 12:
                return int.from_bytes(data[18:20], "little"), int.from_bytes(data[20:22], "little")
            return (abs(int.from_bytes(data[18:22], "little", signed=True)),
                    abs(int.from_bytes(data[22:26], "little", signed=True)))
        if kind == "tiff":
            return _tiff_size(data)
        if kind == "webp":
            chunk = data[12:16]
            if chunk == b"VP8 ":
                return int.from_bytes(data[26:28], "little") & 0x3FFF, int.from_bytes(data[28:30], "little") & 0x3FFF
            if chunk == b"VP8L":
                bits = int.from_bytes(data[21:25], "little")
                return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
            if chunk == b"VP8X":
                return int.from_bytes(data[24:27], "little") + 1, int.from_bytes(data[27:30], "little") + 1
            return None
        if kind == "jpeg2000":
            at = data.find(b"ihdr", 0, 4096)
            return (int.from_bytes(data[at + 8:at + 12], "big"), int.from_bytes(data[at + 4:at + 8], "big")) \
                if at >= 0 else None
        if kind == "pnm":
            return _pnm_size(data)
    except (ValueError, IndexError):
        return None
    return None


def read_file(path: str) -> bytes:
    """The whole file in four system calls: open, fstat, read, close. Each gives up the interpreter,
    and a reading thread may then wait up to the switch interval to take it back while another
    thread runs Python; `open(path, "rb").read()` makes nine (an isatty ioctl, two lseeks, a second
    fstat, a read to see the end)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        data = os.read(fd, size + 1)  # a regular file comes whole: its size, then the end
        if len(data) != size:  # it changed since fstat, a short read, or not a regular file: read to the end
            chunks = [data]
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
            data = b"".join(chunks)
        return data
    finally:
        os.close(fd)


def read_checked(ref: ImageRef, max_pixels: int = 0) -> EncodedImage | ImageError:
    """Read one file and reject what cannot be an image, cheaply, before it reaches the decoder.

    max_pixels: refuse images whose header declares more pixels (0: no limit). A small file can
    declare a huge image (a decompression bomb) that would decode to gigabytes."""
    try:
        data = read_file(ref.path)
    except FileNotFoundError:
        return ImageError(ref.index, ref.path, "missing", "file not found; check the path in the list")
    except IsADirectoryError:
        return ImageError(ref.index, ref.path, "not_a_file", "is a directory, not an image file")
    except OSError as e:
        return ImageError(ref.index, ref.path, "unreadable", f"cannot read: {e.strerror or e}")
    if not data:
        return ImageError(ref.index, ref.path, "empty", "file is empty (0 bytes)")
    kind = sniff_format(data[:16])
    if kind is None:
        return ImageError(ref.index, ref.path, "unknown_format",
                          f"not a JPEG/PNG/BMP/TIFF/WebP/JPEG 2000/PNM file (starts with {data[:8]!r})")
    size = image_size(data, kind)
    if size is None or min(size) <= 0:
        return ImageError(ref.index, ref.path, "bad_header",
                          f"{kind} header does not give a valid image size (truncated or corrupt file)")
    if max_pixels and size[0] * size[1] > max_pixels:
        return ImageError(ref.index, ref.path, "too_large",
                          f"{kind} declares {size[0]}x{size[1]} = {size[0] * size[1]:,} pixels, over the limit of "
                          f"{max_pixels:,} (raise preprocess.max_pixels if this image is genuine)")
    return EncodedImage(ref, np.frombuffer(data, dtype=np.uint8))


def read_all(refs: Sequence[ImageRef], max_pixels: int = 0) -> list[EncodedImage | ImageError]:
    return [read_checked(r, max_pixels) for r in refs]


def read_batches(refs: Sequence[ImageRef], *, batch_size: int, num_threads: int, max_pixels: int = 0,
                 lookahead: int = 2) -> Iterator[list[EncodedImage | ImageError]]:
    """Yield batches of read-and-checked images in order, reading `lookahead` batches ahead on
    num_threads threads: one task per thread's share of a batch's consecutive files, not one per
    file (fewer hand-offs: on a 2-core machine one thread read twice as fast this way)."""
    chunks = [refs[i:i + batch_size] for i in range(0, len(refs), batch_size)]
    step = -(-batch_size // max(1, num_threads))
    with ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="gpudet-read") as pool:
        def submit(chunk: Sequence[ImageRef]) -> list[Future]:
            return [pool.submit(read_all, chunk[i:i + step], max_pixels) for i in range(0, len(chunk), step)]

        pending = [submit(chunk) for chunk in chunks[:lookahead]]
        for next_chunk in chunks[lookahead:] + [None] * min(lookahead, len(chunks)):
            futures = pending.pop(0)
            if next_chunk is not None:
                pending.append(submit(next_chunk))
            yield [item for f in futures for item in f.result()]
