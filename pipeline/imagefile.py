"""Image files' headers: the format by its first bytes, the size a header declares, a JPEG's frame.
Read from the first bytes of a file on the reading threads, before anything is decoded: what
cannot be an image never reaches a decoder."""

from __future__ import annotations

from typing import NamedTuple

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


PNG_END = b"IEND\xaeB`\x82"
"""A PNG's last chunk, IEND, with its CRC: a PNG cut short lacks it, and DALI's CPU PNG decoder can
crash the process on one (SIGSEGV)."""
END_WITHIN = 65536
"""How far from a file's end its end marker (a PNG's IEND, a JPEG's EOI) is looked for: bytes
appended after it (rare) are allowed."""
JPEG_END = b"\xff\xd9"
"""A JPEG's end-of-image marker (EOI)."""


def sniff_format(head: bytes) -> str | None:
    for magic, name in SIGNATURES:
        if head.startswith(magic):
            return name
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    return None


class JpegFrame(NamedTuple):
    """A JPEG's frame header (its first SOF marker)."""

    marker: int
    """0xC0 baseline, 0xC1 extended, 0xC2 progressive (Huffman-coded DCT); 0xC3 lossless; 0xC9-0xCB
    arithmetic-coded; 0xC5-0xC7, 0xCD-0xCF hierarchical."""
    precision: int
    """Bits per sample."""
    width: int
    height: int
    components: int = 3
    """1 grey, 3 YCbCr (or RGB), 4 CMYK or YCCK."""
    offset: int = 0
    """Where the frame header starts in the file."""


DALI_JPEG = frozenset({0xC0, 0xC1, 0xC2})
"""The frames DALI's decoders take (8-bit samples): JPEGs of any other frame are decoded by Pillow
(libjpeg-turbo: lossless and arithmetic-coded ones), as they are read."""


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from the first SOF marker; None if the header ends before one."""
    frame = jpeg_frame(data)
    return None if frame is None else (frame.width, frame.height)


def jpeg_frame(data: bytes) -> JpegFrame | None:
    """The first frame header of a JPEG's bytes; None if the header ends before one."""
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
            return JpegFrame(marker, data[i + 4], int.from_bytes(data[i + 7:i + 9], "big"),
                             int.from_bytes(data[i + 5:i + 7], "big"), data[i + 9] if i + 9 < len(data) else 3, i)
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


JPEG_KINDS = {0xC0: "baseline", 0xC1: "extended", 0xC2: "progressive", 0xC3: "lossless", 0xC9: "arithmetic",
              0xCA: "arithmetic progressive", 0xCB: "arithmetic lossless"}


def jpeg_ends(data, frame: JpegFrame) -> bool:
    """Whether a JPEG's end-of-image marker (EOI) follows its frame header (`data`: its bytes as a
    numpy array). A file cut short has none, and the GPU's decoder turns such a file into an
    image without an error. Entropy-coded data never holds 0xFF 0xD9 (an 0xFF there is followed
    by 0x00 or a restart marker), and an EXIF thumbnail's EOI comes before the main frame header.
    Data after the EOI (a phone's motion-photo video, a maker's trailer) is allowed: the file's
    last two bytes are looked at first (most JPEGs end there), then its last END_WITHIN bytes,
    the rest only when they hold no EOI."""
    if len(data) >= 2 and data[-2] == JPEG_END[0] and data[-1] == JPEG_END[1]:
        return True
    tail = data[max(frame.offset, len(data) - END_WITHIN):].tobytes()
    return JPEG_END in tail or JPEG_END in data[frame.offset:].tobytes()


def least_bits(frame: JpegFrame) -> int:
    """The fewest bits a JPEG of this frame can code its pixels in: with Huffman codes (at least
    one bit each), one bit per 8x8 block of its largest component for DCT frames (the DC scan
    codes every block), one per pixel for lossless ones; arithmetic coding goes below a bit (0:
    no bound). A header that declares more pixels than its file can hold was corrupted, or the
    file cut short: decoders fill what is missing with grey, and say nothing."""
    if frame.marker in DALI_JPEG:
        return -(-frame.width // 8) * -(-frame.height // 8)
    if frame.marker == 0xC3:
        return frame.width * frame.height
    return 0


def exif_orientation(data: bytes) -> int:
    """A JPEG's EXIF orientation (1-8; 1 where it has none), from its APP1 segment: how the stored
    pixels are turned to be displayed."""
    i = 2
    while i + 4 <= len(data) and data[i] == 0xFF:
        marker, length = data[i + 1], int.from_bytes(data[i + 2:i + 4], "big")
        if marker in (0xDA, 0xD9) or 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            return 1  # the frame or the scan: no APP1 before it
        if marker == 0xE1 and data[i + 4:i + 10] == b"Exif\x00\x00":
            tiff = data[i + 10:i + 2 + length]
            order = "little" if tiff[:2] == b"II" else "big"
            ifd = int.from_bytes(tiff[4:8], order)
            for k in range(int.from_bytes(tiff[ifd:ifd + 2], order)):
                entry = tiff[ifd + 2 + 12 * k:ifd + 14 + 12 * k]
                if len(entry) == 12 and int.from_bytes(entry[:2], order) == 0x0112:
                    value = int.from_bytes(entry[8:10], order)
                    return value if 1 <= value <= 8 else 1
            return 1
        i += 2 + length
    return 1
