"""Source: a file list, a folder or a glob -> indexed image paths -> encoded bytes, checked.

Each input gets a stable `index` (its position in the list, or in sorted order for folders and
globs) that every result and error record carries, so outputs always map back to inputs.
Reading happens a bounded number of batches ahead of the consumer, on a thread pool or in worker
processes (`processes`): a thread waits for the interpreter after every open and read, up to
Python's switch interval (5 ms) when another thread is running Python.
"""

from __future__ import annotations

import array
import contextlib
import glob as globlib
import json
import logging
import mmap
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger("gpudet")

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
    """Stable code: missing, not_a_file, unreadable, empty, unknown_format, bad_header, too_large,
    decode_failed (README, "When things go wrong")."""
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
                 lookahead: int = 2, processes: int = 0, readers: ProcessReaders | None = None
                 ) -> Iterator[list[EncodedImage | ImageError]]:
    """Yield batches of read-and-checked images in order, reading `lookahead` batches ahead.

    processes=0: num_threads threads of this process read each batch, one task per thread's share
    of consecutive files, not one per file (fewer hand-offs: on a 2-core machine one thread read
    twice as fast this way). processes>0: that many worker processes, one batch each in turn
    (`ProcessReaders`, started here and ended with the last batch, or `readers`, already started
    and kept); `lookahead` is then at least their count."""
    if readers is not None or (processes > 0 and ProcessReaders.available()):
        with contextlib.ExitStack() as stack:
            if readers is None:
                readers = stack.enter_context(ProcessReaders(processes))
            yield from _read_in_processes(readers.start(refs, batch_size=batch_size, max_pixels=max_pixels),
                                          count=-(-len(refs) // batch_size), lookahead=max(lookahead, readers.count))
        return
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


def _read_in_processes(readers: ProcessReaders, *, count: int, lookahead: int
                       ) -> Iterator[list[EncodedImage | ImageError]]:
    if count == 0:
        return
    with ThreadPoolExecutor(1, thread_name_prefix="gpudet-read") as receiver:
        def receive(k: int) -> list[EncodedImage | ImageError]:
            # On a thread of its own: the socket calls give up the interpreter, and taking it back
            # can wait a switch interval; the loop that takes the batches should not.
            items = readers.result(k)
            if k + lookahead < count:
                readers.submit(k + lookahead)
            return items

        for k in range(min(lookahead, count)):
            readers.submit(k)
        pending = deque(receiver.submit(receive, k) for k in range(min(lookahead, count)))
        try:
            for k in range(count):
                items = pending.popleft().result()
                if k + lookahead < count:
                    pending.append(receiver.submit(receive, k + lookahead))
                yield items
        finally:  # a consumer that stops early waits for one batch at most, not the whole lookahead;
            # the answers still owed are taken by the readers' next start (or dropped with them)
            receiver.shutdown(cancel_futures=True)


class ProcessReaders:
    """Worker processes that read and check files (`read_all`): after `start(refs, ...)`, batch k
    (refs k * batch_size onwards) on worker k % count. Started once, they serve any number of
    lists in turn (a worker takes ~0.1-0.3 s to start: an interpreter, numpy), one at a time.

    Per list each worker is handed the paths once, in an anonymous memory file (memfd). Per batch
    this process sends 16 bytes and takes back one memfd: the batch's checks, pickled, then its
    files' bytes. Each image's `data` is a view of that mapping, which lives as long as any of
    them: four system calls per batch instead of three or more per file, and no copy of a file's
    bytes here. A worker that dies (or fails on a batch) costs no image: its batches are read
    here, in order, from then on.

    Workers are fresh interpreters on this process's sys.path that import this module only (not
    multiprocessing's children, which re-run the caller's main script); they end when this object
    is closed or collected, or when this process ends. Linux only."""

    @staticmethod
    def available() -> bool:
        return hasattr(os, "memfd_create")

    def __init__(self, count: int):
        self.count = count
        self.refs: Sequence[ImageRef] = ()
        self.batch_size, self.max_pixels = 1, 0
        # The workers import exactly what this process imports: its sys.path, not the one `python -c`
        # would make (that puts the working directory first, where any folder named `pipeline` wins).
        env = dict(os.environ, GPUDET_SYS_PATH=json.dumps(sys.path))
        self._sockets: list[socket.socket] = []
        self._workers: list[subprocess.Popen] = []
        self.alive: list[bool] = []  # per worker: False once it died (its batches are read here)
        self._owed: list[int] = []  # per worker: batches asked of it and not yet answered
        self._close = weakref.finalize(self, _end_workers, self._sockets, self._workers)
        try:
            for _ in range(count):
                here, there = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                code = ("import json, os, sys; sys.path[:] = json.loads(os.environ['GPUDET_SYS_PATH']); "
                        f"from {__name__} import _read_worker; _read_worker({there.fileno()})")
                self._workers.append(subprocess.Popen([sys.executable, "-c", code], pass_fds=[there.fileno()],
                                                      env=env, stdin=subprocess.DEVNULL))
                there.close()
                self._sockets.append(here)
                self.alive.append(True)
                self._owed.append(0)
        except BaseException:
            self.close()  # the workers already started
            raise

    def start(self, refs: Sequence[ImageRef], *, batch_size: int, max_pixels: int = 0) -> ProcessReaders:
        """Serve `refs` from now on: answers still owed for the last list (a consumer that stopped
        early) are taken and dropped, then each worker is handed the paths."""
        for w in range(self.count):
            while self.alive[w] and self._owed[w]:
                answer = self._receive(w)
                for fd in _fds(answer[2] if answer else []):
                    os.close(fd)
        self.refs, self.batch_size, self.max_pixels = refs, batch_size, max_pixels
        table = _memfd(_pack_refs(refs, max_pixels))
        try:
            for w, conn in enumerate(self._sockets):
                if self.alive[w]:
                    try:
                        conn.sendmsg([struct.pack("qq", -1, 0)], _passing(table))
                    except OSError:
                        self._lost(w)
        finally:
            os.close(table)
        return self

    def working(self) -> bool:
        """Whether any worker is alive (one that died is noticed here, or when it does not answer)."""
        for w, worker in enumerate(self._workers):
            if self.alive[w] and worker.poll() is not None:
                self._lost(w)
        return any(self.alive)

    def _chunk(self, k: int) -> Sequence[ImageRef]:
        return self.refs[k * self.batch_size:(k + 1) * self.batch_size]

    def submit(self, k: int) -> None:
        """Ask worker k % count for batch k (a dead worker's batches are read in `result`)."""
        w = k % self.count
        if self.alive[w]:
            try:
                self._sockets[w].send(struct.pack("qq", k * self.batch_size, len(self._chunk(k))))
                self._owed[w] += 1
            except OSError:
                self._lost(w)

    def result(self, k: int) -> list[EncodedImage | ImageError]:
        """Batch k, which must be the oldest submitted."""
        w = k % self.count
        if self.alive[w]:
            answer = self._receive(w)
            if answer is not None:
                checks_size, total, ancillary = answer
                if checks_size >= 0:  # -1: the worker failed on this batch: read it here
                    return _unpack(self._chunk(k), ancillary, checks_size, total)
        return read_all(self._chunk(k), self.max_pixels)

    def _receive(self, w: int) -> tuple[int, int, list] | None:
        """Worker w's next answer: (checks size, total size, the memfd's ancillary data), or None
        if the worker is gone (then marked lost). The caller owns the memfd (_unpack closes it)."""
        try:
            message, ancillary, _, _ = self._sockets[w].recvmsg(16, socket.CMSG_SPACE(4))
        except OSError:
            message = b""
        if len(message) != 16:
            self._lost(w)
            return None
        self._owed[w] -= 1
        checks_size, total = struct.unpack("qq", message)
        return checks_size, total, ancillary

    def _lost(self, w: int) -> None:
        """Worker w died: its batches are read here from now on (slower, never lost)."""
        self.alive[w] = False
        self._owed[w] = 0
        log.warning("file reader process %d (pid %d) ended with code %s; its batches are read in this process",
                    w, self._workers[w].pid, self._workers[w].poll())

    def close(self) -> None:
        self._close()

    def __enter__(self) -> ProcessReaders:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _end_workers(sockets: list[socket.socket], workers: list[subprocess.Popen]) -> None:
    for s in sockets:
        s.close()  # the worker's recv ends: it exits
    for worker in workers:
        try:
            worker.wait(timeout=5)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()


def _pack_refs(refs: Sequence[ImageRef], max_pixels: int) -> bytes:
    """int64 [count, max_pixels], [count + 1] path offsets, [count] indices, then the paths' bytes:
    the workers map it and decode a path when they read it, so a list of millions costs each of
    them no copy of its own."""
    paths = [os.fsencode(r.path) for r in refs]
    offsets = np.zeros(len(paths) + 1, dtype=np.int64)
    np.cumsum([len(p) for p in paths], out=offsets[1:])
    return b"".join([np.array([len(refs), max_pixels], dtype=np.int64).tobytes(), offsets.tobytes(),
                     np.array([r.index for r in refs], dtype=np.int64).tobytes(), *paths])


class _PackedRefs:
    """The worker's side of _pack_refs."""

    def __init__(self, table: mmap.mmap):
        self.table = table
        count, self.max_pixels = (int(v) for v in np.frombuffer(table, dtype=np.int64, count=2))
        self.offsets = np.frombuffer(table, dtype=np.int64, count=count + 1, offset=16)
        self.indices = np.frombuffer(table, dtype=np.int64, count=count, offset=16 + 8 * (count + 1))
        self.start = 16 + 8 * (2 * count + 1)

    def __getitem__(self, i: int) -> ImageRef:
        begin, end = self.start + int(self.offsets[i]), self.start + int(self.offsets[i + 1])
        return ImageRef(int(self.indices[i]), os.fsdecode(self.table[begin:end]))


def _memfd(data: bytes) -> int:
    fd = os.memfd_create("gpudet-read")  # close-on-exec; it reaches the workers over their sockets
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    return fd


def _unpack(refs: Sequence[ImageRef], ancillary: list, checks_size: int, total: int
            ) -> list[EncodedImage | ImageError]:
    """A worker's batch of `refs`: its memfd (in `ancillary`) holds the pickled checks, per image
    an ImageError or the size of its bytes, then those bytes in order."""
    fd, = _fds(ancillary)
    try:
        data = np.frombuffer(mmap.mmap(fd, total, prot=mmap.PROT_READ), dtype=np.uint8)
    finally:
        os.close(fd)
    items, offset = [], checks_size
    for ref, check in zip(refs, pickle.loads(data[:checks_size]), strict=True):
        if isinstance(check, ImageError):
            items.append(check)
        else:
            items.append(EncodedImage(ref, data[offset:offset + check]))
            offset += check
    return items


def _passing(fd: int) -> list:
    """sendmsg's ancillary data that passes `fd` to the other end (SCM_RIGHTS); _fds takes it back."""
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]


def _fds(ancillary: list) -> list[int]:
    """The file descriptors of recvmsg's ancillary data (SCM_RIGHTS)."""
    return [fd for level, kind, data in ancillary if (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS)
            for fd in array.array("i", data[:len(data) - len(data) % 4])]


def _read_worker(fd: int) -> None:
    """A ProcessReaders worker on SOCK_SEQPACKET socket `fd`. Request (-1, 0) with a memfd of
    _pack_refs: the list to serve from now on. Request (first, count): read_all of those refs of
    the list, answered (checks size, total size) with a memfd of both (see _unpack), or (-1, 0) if
    that failed. Returns when the parent closes the socket."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it closes us
    conn = socket.socket(fileno=fd)
    refs: _PackedRefs | None = None
    while True:
        try:
            request, ancillary, _, _ = conn.recvmsg(16, socket.CMSG_SPACE(4))
        except OSError:  # reset: the parent closed the socket with answers of ours unread
            return
        if len(request) != 16:
            return
        first, count = struct.unpack("qq", request)
        if first < 0:
            table, = _fds(ancillary)
            refs = _PackedRefs(mmap.mmap(table, 0, prot=mmap.PROT_READ))  # mapped, not read: shared by the workers
            os.close(table)
            continue
        reply = -1
        try:
            if refs is None:
                raise RuntimeError("a batch asked before any list")
            items = read_all([refs[i] for i in range(first, first + count)], refs.max_pixels)
            # The parent has the refs: per image only the size of its bytes, or its error
            checks = pickle.dumps([len(i.data) if isinstance(i, EncodedImage) else i for i in items], protocol=5)
            total = len(checks) + sum(len(i.data) for i in items if isinstance(i, EncodedImage))
            reply = os.memfd_create("gpudet-read")
            os.ftruncate(reply, total)
            with mmap.mmap(reply, total) as buffer:
                buffer[:len(checks)] = checks
                offset = len(checks)
                for item in items:
                    if isinstance(item, EncodedImage):
                        buffer[offset:offset + len(item.data)] = item.data
                        offset += len(item.data)
            answer = struct.pack("qq", len(checks), total), _passing(reply)
        except Exception:  # noqa: BLE001 - the parent reads this batch itself and meets the error there
            answer = struct.pack("qq", -1, 0), []
        try:
            conn.sendmsg([answer[0]], answer[1])
        except OSError:  # the parent closed the socket with answers owed (it stopped early, or ended)
            return
        finally:
            if reply >= 0:
                os.close(reply)
