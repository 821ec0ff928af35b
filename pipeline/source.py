"""Source: listed images (listing.py) -> encoded bytes, checked, or pixels given in memory.

Files are read a bounded number of batches ahead of the consumer, on a pool of threads, and
checked cheaply (exists, non-empty, an image signature, a sane declared size, a PNG's end) so that
a bad file never reaches the decoder.
"""

from __future__ import annotations

import io
import logging
import os
import stat
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

import numpy as np

from . import storage
from .imagefile import DALI_JPEG, JPEG_KINDS, END_WITHIN, PNG_END, exif_orientation, image_size, jpeg_frame, \
    jpeg_ends, least_bits, sniff_format
from .results import ImageError, ImageRef

log = logging.getLogger("gpudet")

@dataclass(frozen=True)
class EncodedImage:
    ref: ImageRef
    data: np.ndarray = field(repr=False)
    """uint8 [num_bytes], the file's bytes."""
    pixels: int = 0
    """width x height its header declares (0: not known)."""
    scaled: ScaledDecode | None = None
    """A large JPEG to decode at a reduced scale before DALI (read_all hands it to the decoding
    threads)."""


class NotAFile(OSError):
    """The path is not a regular file (a directory, a FIFO, a device, a socket)."""


def read_file(path: str, max_bytes: int = 0) -> bytes:
    """The whole of a regular file, in four system calls (open, fstat, read, close: each gives up
    the interpreter, which a reading thread may then wait for). Opened without blocking, so that a
    FIFO in the list is refused rather than waited on. max_bytes: refuse (FileTooLarge) a file
    over this size (0: no limit)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotAFile(_FILE_KINDS.get(stat.S_IFMT(info.st_mode), "not a regular file"))
        if max_bytes and info.st_size > max_bytes:
            raise FileTooLarge(info.st_size)
        data = os.read(fd, info.st_size + 1)  # a regular file comes whole: its size, then the end
        if len(data) != info.st_size:  # it changed since fstat, or a short read: read to the end
            chunks = [data]
            while (chunk := os.read(fd, 1 << 20)) and (not max_bytes or sum(map(len, chunks)) <= max_bytes):
                chunks.append(chunk)
            data = b"".join(chunks)
            if max_bytes and len(data) > max_bytes:
                raise FileTooLarge(len(data))
        return data
    finally:
        os.close(fd)


class FileTooLarge(OSError):
    """The file is over the size cap (preprocess.max_file_mb)."""

    def __init__(self, size: int):
        super().__init__(f"{size:,} bytes")
        self.size = size


def file_kind(path: str) -> str | None:
    """What a path that is no regular file is ("a socket", ...); None for a regular file or none."""
    try:
        return _FILE_KINDS.get(stat.S_IFMT(os.stat(path).st_mode))
    except (OSError, ValueError):
        return None


_FILE_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFCHR: "a character device",
               stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}


def read_checked(ref: ImageRef, max_pixels: int = 0, max_bytes: int = 0,
                 scaled: ScaledDecode | None = None) -> EncodedImage | PixelImage | ImageError:
    """Read one file and reject what cannot be an image, cheaply, before it reaches the decoder.

    max_pixels: refuse images whose header declares more pixels (0: no limit): a small file can
    declare a huge image (a decompression bomb) that would decode to gigabytes. max_bytes: refuse
    files over this size (0: no limit)."""
    try:
        data = read_file(ref.path, max_bytes)
    except FileNotFoundError:
        if os.path.islink(ref.path):
            return ImageError(ref.index, ref.path, "missing", f"a symbolic link to {os.readlink(ref.path)}, which does "
                                                              "not exist; fix or remove the link")
        spaces = any(part != part.strip() for part in Path(ref.path).parts)
        return ImageError(ref.index, ref.path, "missing", "file not found; check its path" +
                          (" (a name in it starts or ends with a space, which the list keeps as written)"
                           if spaces else ""))
    except (NotAFile, IsADirectoryError) as e:
        kind = "a directory" if isinstance(e, IsADirectoryError) else str(e)
        return ImageError(ref.index, ref.path, "not_a_file", f"is {kind}, not an image file: only regular files "
                                                             "are read; list the image file itself")
    except FileTooLarge as e:
        return over_cap(ref, e.size, max_bytes)
    except OSError as e:
        kind = file_kind(ref.path)
        if kind is not None:  # a socket cannot even be opened (ENXIO)
            return ImageError(ref.index, ref.path, "not_a_file", f"is {kind}, not an image file: only regular files "
                                                                 "are read; list the image file itself")
        return ImageError(ref.index, ref.path, "unreadable", f"cannot read: {e.strerror or e}; check the file's "
                                                         "permissions and the disk it is on")
    except ValueError:  # no file name holds a NUL byte (a binary file given as the list, say)
        return ImageError(ref.index, ref.path, "unreadable",
                          "the path holds a NUL byte, which no file name can; check the list")
    return checked_bytes(EncodedImage(ref, np.frombuffer(data, dtype=np.uint8)), max_pixels, scaled)


def over_cap(ref: ImageRef, size: int, max_bytes: int) -> ImageError:
    return ImageError(ref.index, ref.path, "too_large", f"{size:,} bytes, over the cap of {max_bytes:,} (raise "
                                                        "preprocess.max_file_mb if the image is genuine)")


@dataclass(frozen=True)
class ScaledDecode:
    """Decode a large JPEG at a reduced scale, on the reading thread, where the model sees it
    smaller: libjpeg-turbo decodes at 1/2, 1/4 or 1/8 in the DCT itself (Pillow's draft), which
    skips most of the inverse transform and the colour work of the pixels the letterbox would
    throw away. An image at least twice as large as the letterbox makes it is decoded at the
    strongest of those reductions that leaves it at least that large; DALI then letterboxes the
    pixels as it does a decoded file, and the records keep the original image's size and pixels
    (PixelImage.original_hw)."""

    height: int
    width: int
    """The model input the letterbox (or stretch) fills."""
    resize: str = "letterbox"

    def factor(self, width: int, height: int) -> int:
        """The reduction (1, 2, 4 or 8) for an image of width x height, as it is displayed (after
        its EXIF orientation)."""
        if self.resize == "letterbox":
            scale = min(self.height / height, self.width / width)
            need_w, need_h = width * scale, height * scale
        else:
            need_w, need_h = self.width, self.height
        for k in (8, 4, 2):
            if -(-width // k) >= need_w and -(-height // k) >= need_h:
                return k
        return 1

    def reduces(self, width: int, height: int) -> bool:
        """Whether an image of width x height as stored reduces in some orientation (EXIF's is known
        once the file is opened)."""
        return self.factor(width, height) > 1 or self.factor(height, width) > 1


def checked_bytes(item: EncodedImage, max_pixels: int = 0,
                  scaled: ScaledDecode | None = None) -> EncodedImage | PixelImage | ImageError:
    """An encoded image (a file's bytes, or bytes given in memory) with the size its header
    declares, or why it cannot be one; `scaled`: a large JPEG decoded here at a reduced scale."""
    ref, data = item.ref, item.data
    if not len(data):
        return ImageError(ref.index, ref.path, "empty", "file is empty (0 bytes); copy or fetch it again, or "
                                                  "remove it from the source")
    head = data[:16].tobytes()
    kind = sniff_format(head)
    if kind is None:
        return ImageError(ref.index, ref.path, "unknown_format",
                          "not a JPEG, PNG, BMP, TIFF, WebP, JPEG 2000 or PNM file (by its first bytes, not its name); "
                          "convert it to one, or remove it from the source")
    frame = None
    if kind == "jpeg":  # its frame header once: the size, and what decodes it
        frame = jpeg_frame(data[:65536].tobytes())
        if frame is None and len(data) > 65536:  # a frame header after large metadata
            frame = jpeg_frame(data.tobytes())
        size = None if frame is None else (frame.width, frame.height)
    else:
        size = image_size(data.tobytes() if kind in ("jpeg2000", "tiff") else data[:65536].tobytes(), kind)
    if size is None or min(size) <= 0:
        return ImageError(ref.index, ref.path, "bad_header",
                          f"{kind} header does not give a valid image size (truncated or corrupt file); copy or "
                          "fetch it again")
    if max_pixels and size[0] * size[1] > max_pixels:
        return ImageError(ref.index, ref.path, "too_large",
                          f"{kind} declares {size[0]}x{size[1]} = {size[0] * size[1]:,} pixels, over the limit of "
                          f"{max_pixels:,} (raise preprocess.max_pixels if this image is genuine)")
    if kind == "png" and PNG_END not in data[-END_WITHIN:].tobytes():
        return ImageError(ref.index, ref.path, "truncated",
                          "png ends before its last chunk (IEND): the file was cut short, e.g. by an interrupted "
                          "download or copy; fetch or copy it again")
    item = EncodedImage(ref, data, size[0] * size[1])
    if kind == "jpeg":
        if len(data) * 8 < least_bits(frame):
            return ImageError(ref.index, ref.path, "truncated",
                              f"jpeg declares {frame.width}x{frame.height} pixels, more than its {len(data):,} bytes can "
                              "hold: its header is corrupt, or the file was cut short; fetch or copy it again")
        if not jpeg_ends(data, frame):
            return ImageError(ref.index, ref.path, "truncated",
                              "jpeg ends before its end-of-image marker (EOI): the file was cut short, e.g. by an "
                              "interrupted download or copy; fetch or copy it again")
        if frame.marker not in DALI_JPEG or frame.precision != 8:
            return decoded_here(item, f"jpeg ({JPEG_KINDS.get(frame.marker, 'hierarchical')}, "
                                      f"{frame.precision}-bit)")
        # CMYK and YCCK (4 components) stay DALI's: libjpeg-turbo does not turn them into RGB.
        if scaled is not None and frame.components in (1, 3) and scaled.reduces(frame.width, frame.height):
            return EncodedImage(ref, data, item.pixels, scaled=scaled)
    if kind == "jpeg2000":
        return decoded_here(item, "jpeg2000")
    return item


def decoded_scaled(item: EncodedImage, scaled: ScaledDecode) -> PixelImage | ImageError:
    """A large JPEG decoded at the reduction ScaledDecode chooses for its displayed size, its EXIF
    orientation applied; the PixelImage carries the original (displayed) size. simplejpeg
    (libjpeg-turbo) decodes with the GIL released for the whole call, so that many threads decode
    at once beside the loop (Pillow holds the GIL for its conversions: ~440 images/s from 16
    threads on the H200's host, docs/BENCHMARKS.md)."""
    import simplejpeg

    data = item.data.tobytes() if hasattr(item.data, "tobytes") else item.data
    frame = jpeg_frame(data[:65536]) or jpeg_frame(data)
    orientation = exif_orientation(data[:65536])
    turned = orientation in (5, 6, 7, 8)
    width, height = (frame.height, frame.width) if turned else (frame.width, frame.height)
    k = scaled.factor(width, height)
    try:
        pixels = simplejpeg.decode_jpeg(data, colorspace="RGB", min_width=-(-frame.width // k),
                                        min_height=-(-frame.height // k))
    except Exception as e:  # the file's own fault (simplejpeg raises ValueError)
        return undecodable(item.ref, str(e) or type(e).__name__, by="jpeg")
    return PixelImage(item.ref, oriented(pixels, orientation), original_hw=(height, width))


def oriented(pixels: np.ndarray, orientation: int) -> np.ndarray:
    """Stored pixels [H, W, 3] as displayed under an EXIF orientation (1-8), contiguous."""
    if orientation in (5, 6, 7, 8):
        pixels = pixels.transpose(1, 0, 2)  # 5: the transpose; 6, 7, 8 flip it below
    flips = {2: (False, True), 3: (True, True), 4: (True, False), 5: (False, False), 6: (False, True),
             7: (True, True), 8: (True, False)}.get(orientation, (False, False))
    if flips[0]:
        pixels = pixels[::-1]
    if flips[1]:
        pixels = pixels[:, ::-1]
    return np.ascontiguousarray(pixels)


def decoded_here(item: EncodedImage, what: str) -> PixelImage | ImageError:
    """An image DALI does not decode (or not safely), decoded here by Pillow, on the reading
    thread; DALI gets its pixels. JPEG 2000: DALI's own decoding (OpenCV's OpenJPEG on the CPU,
    its fallback on a GPU) can crash the process (SIGSEGV) on a corrupt file after another corrupt
    one, which no error record could then report; Pillow raises an error instead. Lossless and
    arithmetic-coded JPEGs: DALI's decoders reject most; libjpeg-turbo reads the 8-bit ones. What
    Pillow cannot open at all is `unsupported`."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(item.data)) as image:
            return PixelImage(item.ref, pil_pixels(image))
    except Image.DecompressionBombError as e:  # Pillow's own limit, beyond preprocess.max_pixels
        return ImageError(item.ref.index, item.ref.path, "too_large",
                          f"{what}: {e}; Pillow decodes these for gpudet and refuses images this large")
    except UnidentifiedImageError:
        return ImageError(item.ref.index, item.ref.path, "unsupported",
                          f"{what}: neither DALI nor Pillow decodes this kind of image; convert it to PNG or an 8-bit "
                          "JPEG (e.g. with ImageMagick or dcmj2pnm)")
    except Exception as e:  # the file's own fault, whatever Pillow's decoder raises (OSError, ValueError, ...)
        return undecodable(item.ref, str(e) or type(e).__name__, by=what.split(" ")[0])


def undecodable(ref: ImageRef, what: str, *, by: str | None = None) -> ImageError:
    """The decode_failed record of an image its decoder (`by`: DALI's operator, or Pillow's format)
    rejected, saying `what` it said."""
    where = f" ({by})" if by else ""
    return ImageError(ref.index, ref.path, "decode_failed", f"cannot decode{where}: {what[:300]}; the file is corrupt "
                                                           "or truncated: copy or fetch it again, or re-encode it")


SIXTEEN_TO_EIGHT_BITS = ((np.arange(65536, dtype=np.int64) * 255 + 32767) // 65535).astype(np.uint8)
"""A 16-bit value's 8-bit one, rounded: v * 255 / 65535."""


ORIENTATION_TAG = 0x0112
"""EXIF's Orientation."""


def pil_pixels(image) -> np.ndarray:
    """A PIL image's pixels as uint8 RGB [H, W, 3], loaded now (a lazily opened image raises here,
    OSError or ValueError, when its data cannot be read). 16-bit ones (modes "I;16", "I") are
    scaled to 8 bits as DALI's decoder scales a 16-bit file: PIL's own convert("RGB") clips them,
    turning an image almost white. Grey, palette, CMYK and alpha go through convert("RGB") (alpha
    dropped, as the decoder drops it). Its EXIF orientation is applied, as it is to a file's pixels:
    the same photo as a path, as bytes or opened with PIL gives the same detections."""
    image.load()
    if image.getexif().get(ORIENTATION_TAG, 1) != 1:
        from PIL import ImageOps

        image = ImageOps.exif_transpose(image)
    if image.mode == "I" or image.mode.startswith("I;16"):
        values = np.asarray(image)
        if values.dtype != np.uint16:  # mode "I": int32
            values = np.clip(values, 0, 65535).astype(np.uint16)
        return np.repeat(SIXTEEN_TO_EIGHT_BITS[values][:, :, None], 3, axis=2)
    return np.asarray(image.convert("RGB"))


@dataclass(frozen=True)
class PixelImage:
    """An image given already decoded, RGB: uint8 [H, W, 3] on the host (numpy) or on a GPU (a
    torch tensor, handed to DALI there without a host copy)."""

    ref: ImageRef
    data: object = field(repr=False)
    """numpy.ndarray or torch.Tensor, uint8 [H, W, 3], contiguous."""
    on_device: bool = False
    original_hw: tuple[int, int] | None = None
    """The image's (height, width) where `data` is a reduced decode of it (ScaledDecode): what its
    records say and what boxes map back to."""

    @property
    def pixels(self) -> int:
        return int(self.data.shape[0]) * int(self.data.shape[1])


Item = ImageRef | EncodedImage | PixelImage
"""What a stream takes: a file to read, or an image given in memory (encoded, or decoded)."""


def as_item(value: object, index: int) -> Item | ImageError:
    """A value a caller passed as an image: a path (str, os.PathLike), encoded bytes (bytes,
    bytearray, memoryview, or a 1-D uint8 numpy array or CPU tensor, as torchvision.io.read_file
    gives), a decoded RGB image (a PIL image, a numpy uint8 [H, W, 3] array or grey [H, W], a torch
    uint8 tensor [H, W, 3] or [3, H, W] on the CPU or a GPU). Its record's path is the path, or a
    label such as "<array 3>"; never the data.

    What is read from the caller's memory is copied (bytes are immutable and taken as they are):
    the stream reads ahead, and a caller may reuse a buffer for the next image."""
    if isinstance(value, (str, os.PathLike)):
        return ImageRef(index, os.fspath(value))
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = value if isinstance(value, bytes) else bytes(value)
        return EncodedImage(ImageRef(index, f"<bytes {index}>"), np.frombuffer(data, dtype=np.uint8))
    module = type(value).__module__.split(".")[0]
    if module == "PIL":
        ref = ImageRef(index, f"<PIL image {index}>")
        try:
            pixels = pil_pixels(value)
        except Exception as e:  # a lazily opened image whose file is truncated, corrupt or closed
            what = str(e)[:300] or type(e).__name__
            return ImageError(index, ref.path, "decode_failed", f"PIL cannot load this image: {what}; pass its "
                                                                "file's path or bytes instead, or fix the file")
        return _pixels(ref, pixels, True, on_device=False)
    if isinstance(value, np.ndarray):
        ref = ImageRef(index, f"<array {index}>")
        if value.dtype == np.uint8 and value.ndim == 1:
            return EncodedImage(ref, np.array(value, order="C"))
        if value.dtype == np.uint8 and value.ndim == 2:  # grey [H, W], as PIL's mode "L" gives it
            value = np.repeat(value[:, :, None], 3, axis=2)
        return _pixels(ref, value, value.ndim == 3 and value.shape[-1] == 3, on_device=False)
    if module == "torch":
        ref = ImageRef(index, f"<tensor {index}>")
        if value.dtype.is_floating_point or str(value.dtype) != "torch.uint8":
            return ImageError(index, ref.path, "bad_array", f"a {value.dtype} tensor: pass uint8 pixels (RGB) or "
                                                            "encoded bytes")
        if value.ndim == 1 and value.device.type == "cpu":
            return EncodedImage(ref, np.array(value.numpy(), order="C"))
        if value.ndim == 3 and value.shape[0] == 3:  # [3, H, W], as torchvision.io decodes
            value = value.permute(1, 2, 0)
        if value.device.type == "cpu":
            return _pixels(ref, value.numpy(), value.ndim == 3 and value.shape[-1] == 3, on_device=False)
        return _pixels(ref, value, value.ndim == 3 and value.shape[-1] == 3, on_device=True)
    return ImageError(index, f"<{type(value).__name__} {index}>", "bad_array",
                      f"a {type(value).__name__} is not an image: pass a path, encoded bytes, a PIL image, or uint8 "
                      "RGB pixels as a numpy array [H, W, 3] or a torch tensor")


def _pixels(ref: ImageRef, value, rgb: bool, *, on_device: bool) -> PixelImage | ImageError:
    if rgb and 0 in value.shape[:2]:
        return ImageError(ref.index, ref.path, "bad_array", f"an empty image ({value.shape[0]}x{value.shape[1]} "
                                                            "pixels): pass an image at least 1x1")
    if not rgb or str(value.dtype) not in ("uint8", "torch.uint8") or 0 in value.shape:
        return ImageError(ref.index, ref.path, "bad_array", f"{tuple(value.shape)} {value.dtype} pixels: pass uint8 "
                                                            "RGB as [H, W, 3] (a torch tensor also [3, H, W])")
    if on_device:  # a copy on the device, in the caller's stream order
        import torch

        return PixelImage(ref, value.clone(memory_format=torch.contiguous_format), on_device=True)
    return PixelImage(ref, np.array(value, order="C"), on_device=False)


def checked(item: Item | ImageError, max_pixels: int = 0, max_bytes: int = 0,
            scaled: ScaledDecode | None = None) -> EncodedImage | PixelImage | ImageError:
    """A file read and checked, encoded bytes checked (a large JPEG decoded at a reduced scale
    where `scaled` says), decoded pixels checked for size (an ImageError, a value that was no
    image, passes through)."""
    if isinstance(item, ImageError):
        return item
    if isinstance(item, ImageRef):
        return read_checked(item, max_pixels, max_bytes, scaled)
    if isinstance(item, EncodedImage):
        if max_bytes and len(item.data) > max_bytes:
            return over_cap(item.ref, len(item.data), max_bytes)
        return checked_bytes(item, max_pixels, scaled)
    if max_pixels and item.pixels > max_pixels:
        return ImageError(item.ref.index, item.ref.path, "too_large", f"{item.pixels:,} pixels, over the limit of "
                                                                      f"{max_pixels:,}")
    return item


def read_all(items: Sequence[Item], max_pixels: int = 0, max_bytes: int = 0, scaled: ScaledDecode | None = None,
             decoders: ThreadPoolExecutor | None = None, fetch: Callable[[list[str]], dict] | None = None
             ) -> list[EncodedImage | PixelImage | ImageError | Future]:
    """`checked` of each item; a large JPEG to decode at a reduced scale is handed to `decoders`
    (its Future in its place), or decoded here without them. URLs are fetched by `fetch`
    (default storage.fetch: in this process)."""
    done = []
    urls = [i.path for i in items if isinstance(i, ImageRef) and storage.is_url(i.path)]
    fetched = (fetch or storage.fetch)(urls) if urls else {}  # concurrently, with retries
    for item in items:
        if isinstance(item, ImageRef) and item.path in fetched:
            data = fetched[item.path]
            item = ImageError(item.index, item.path, data.reason, str(data)) if isinstance(data, storage.Unreadable) \
                else EncodedImage(item, np.frombuffer(data, dtype=np.uint8))
        item = checked(item, max_pixels, max_bytes, scaled)
        if isinstance(item, EncodedImage) and item.scaled is not None:
            item = decoders.submit(decoded_scaled, item, item.scaled) if decoders else decoded_scaled(item, item.scaled)
        done.append(item)
    return done


FLUSH = None
"""A batch that says: nothing more for now. A stream fed by requests (the Ray actor's) sends it
when none is waiting; each stage hands on what it holds, then the mark."""


REMOTE_SLACK = 4
"""URL batches taken ahead per batch in flight: those answered wait there for an earlier one."""


def remote_batches(requests: int, batch_size: int) -> int:
    """URL batches read_chunks has in flight: about `requests` requests."""
    return -(-requests // batch_size)


def fetch_processes(processes: int, requests: int, batch_size: int) -> int:
    """The fetching processes read_chunks asks for (fetching.started): `processes`, at most one a
    batch in flight."""
    return min(processes, remote_batches(requests, batch_size))


def read_chunks(chunks: Iterable[list[Item] | None], *, batch_size: int, num_threads: int, max_pixels: int = 0,
                max_bytes: int = 0, scaled: ScaledDecode | None = None, scaled_share: float = 1.0,
                decode_threads: int = 1, lookahead: int = 2, remote_requests: int = 128,
                remote_ahead_bytes: int = 512 << 20, remote_processes: int = 0
                ) -> Iterator[list[EncodedImage | PixelImage | ImageError] | None]:
    """Each batch (at most batch_size items, or FLUSH) read and checked, in order, `lookahead`
    batches read ahead on num_threads threads; `chunks` is taken as it is needed, so it may be a
    generator. One task per thread's share of a batch's consecutive files, not one per file
    (fewer hand-offs: on a 2-core machine one thread read twice as fast this way).

    A batch that holds URLs is one task on threads of its own: its objects are requested all at
    once, on as many threads as keep about `remote_requests` requests in flight (an object store
    answers each after milliseconds to tens of them, a local disk at once). Batches are taken
    REMOTE_SLACK times further ahead than that, as far as `remote_ahead_bytes` allows at the mean
    object size read so far, so that a batch whose answer comes late holds back only itself: the
    threads go on to the next batches while this one waits for it in order. With remote_processes,
    the objects are fetched in that many processes of their own (fetching.py): those
    fetching.start_early started, else ones started at the first URL; so that the GIL this
    process's threads hold does not hold them back.

    scaled: the large JPEGs of `scaled_share` of the batches (spread evenly: batch k when
    floor((k + 1) * share) > floor(k * share)) are decoded at a reduced scale on decode_threads
    threads of their own, one image a task, as soon as they are read; the other batches' go to
    DALI whole (on a GPU, its hardware decoder), so both work at once."""
    step = -(-batch_size // max(1, num_threads))
    pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="gpudet-read")
    decoders = ThreadPoolExecutor(max_workers=decode_threads, thread_name_prefix="gpudet-decode") if scaled else None
    in_flight = remote_batches(remote_requests, batch_size)
    most_ahead = max(lookahead, REMOTE_SLACK * in_flight)
    # a batch's requests a thread (threads start as needed)
    fetchers = ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix="gpudet-fetch")
    processes = None
    count = objects = object_bytes = 0
    try:
        def submit(chunk: list[Item]) -> tuple[list[Future], bool]:
            nonlocal count, processes
            here = scaled if int((count + 1) * scaled_share) > int(count * scaled_share) else None
            count += 1
            if any(isinstance(i, ImageRef) and storage.is_url(i.path) for i in chunk):
                if remote_processes and processes is None:
                    from .fetching import started

                    processes = started(fetch_processes(remote_processes, remote_requests, batch_size))
                fetch = processes.fetch if processes else None
                return [fetchers.submit(read_all, chunk, max_pixels, max_bytes, here, decoders, fetch)], True
            return [pool.submit(read_all, chunk[i:i + step], max_pixels, max_bytes, here, decoders)
                    for i in range(0, len(chunk), step)], False

        def result(futures: list[Future], remote: bool) -> list[EncodedImage | PixelImage | ImageError]:
            nonlocal objects, object_bytes
            done = [item.result() if isinstance(item, Future) else item for f in futures for item in f.result()]
            if remote:
                read = [item.data.nbytes for item in done if isinstance(item, EncodedImage)]
                objects, object_bytes = objects + len(read), object_bytes + sum(read)
            return done

        def ahead(remote: bool) -> int:
            if not remote:
                return lookahead
            if not object_bytes:
                return most_ahead
            return max(lookahead, min(most_ahead, remote_ahead_bytes * objects // (object_bytes * batch_size)))

        pending: deque[tuple[list[Future], bool]] = deque()  # read ahead, oldest first
        for chunk in chunks:
            if chunk is FLUSH:
                while pending:
                    yield result(*pending.popleft())
                yield FLUSH
                continue
            pending.append(submit(chunk))
            while len(pending) > ahead(pending[-1][1]):
                yield result(*pending.popleft())
        while pending:
            yield result(*pending.popleft())
    finally:
        # A consumer that stops early (Ctrl-C, an error, a stream closed) does not wait for the
        # batches read ahead: those not started are dropped, one being read ends on its own.
        for threads in (pool, fetchers, decoders):
            if threads is not None:
                threads.shutdown(wait=False, cancel_futures=True)
        if processes is not None:
            processes.close()


def batched(items: Iterable, size: int) -> Iterator[list]:
    """Consecutive lists of `size` items (the last may be shorter), taken as they are needed."""
    iterator = iter(items)
    while chunk := list(islice(iterator, size)):
        yield chunk


def within_pixels(batch: list[EncodedImage | PixelImage], max_pixels: int
                  ) -> Iterator[list[EncodedImage | PixelImage]]:
    """The batch in consecutive parts whose declared pixels add up to at most `max_pixels` (an
    image over it alone makes a part of one): what one DALI batch may decode is bounded. 0: the
    batch whole."""
    part, total = [], 0
    for item in batch:
        if part and max_pixels and total + item.pixels > max_pixels:
            yield part
            part, total = [], 0
        part.append(item)
        total += item.pixels
    if part:
        yield part
