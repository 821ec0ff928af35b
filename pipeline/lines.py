"""A file list's entries: the line rules a local list (listing.read_list) and a list stored at a
URL (storage.list_lines) both follow."""

from __future__ import annotations

import codecs
import os


def list_lines(data: bytes) -> list[str]:
    """A file list's entries: only the line ending (\\n or \\r\\n) is not part of a line; an
    empty or whitespace-only line and a line starting with `#` are skipped; a UTF-8 byte-order mark
    at the start is ignored; bytes that are not UTF-8 are kept (os.fsdecode)."""
    lines = []
    for line in data.removeprefix(codecs.BOM_UTF8).split(b"\n"):
        line = line.removesuffix(b"\r")
        if line.strip() and not line.startswith(b"#"):
            lines.append(os.fsdecode(line))
    return lines
