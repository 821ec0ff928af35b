"""Drawing: boxes, `name score` labels and landmarks from detections onto the images, with Pillow.

Output files are named by the record's index and the image's file name, reduced to letters, digits,
`.`, `_` and `-` (`00000042_street.jpg`): never a path, so nothing a file list says can place a
file outside the output folder, and two images of one name do not overwrite each other. The folder
holds a mark (layout.DRAWINGS_MARKER) that keeps a folder source from taking the drawings as images. Lines and
labels scale with the image (a label stays readable on a 3,000 px photo), and a label that would
leave the image at the top is drawn inside its box.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont, ImageOps

from . import storage
from .errors import OutputError
from .layout import DRAWINGS_MARKER, records_folder

PALETTE = ((230, 25, 75), (60, 180, 75), (255, 225, 25), (0, 130, 200), (245, 130, 48), (145, 30, 180),
           (70, 240, 240), (240, 50, 230))
FORMATS = {"jpg": "JPEG", "png": "PNG", "webp": "WEBP"}


def draw_detections(record: dict, image=None, *, min_score: float = 0.0) -> Image.Image:
    """A record of detections.jsonl (or ImageResult.to_dict()) drawn onto `image`: a path or URL,
    an encoded file's bytes, a PIL image or uint8 RGB pixels [H, W, 3]; default the file at the
    record's path, in display orientation (EXIF applied), as the boxes are."""
    if image is None or isinstance(image, (str, Path, bytes)):
        where = image if isinstance(image, bytes) else os.fspath(image or record["path"])
        if isinstance(where, str) and storage.is_url(where):
            where = storage.read_url(where)
        image = ImageOps.exif_transpose(Image.open(io.BytesIO(where) if isinstance(where, bytes) else where))
    elif isinstance(image, np.ndarray):
        image = Image.fromarray(image)
    image = image.convert("RGB")
    if "width" in record and image.size != (record["width"], record["height"]):
        raise ValueError(f"the image is {image.width}x{image.height} and {record['path']}'s detections are in "
                         f"{record['width']}x{record['height']} pixels: draw them on the image they were found on, "
                         "upright as its EXIF orientation says")
    canvas = ImageDraw.Draw(image)
    line = max(2, round(max(image.size) / 400))
    font = ImageFont.load_default(size=max(12, round(max(image.size) / 50)))
    for det in record["detections"]:
        if det["score"] < min_score:
            continue
        color = PALETTE[det["label"] % len(PALETTE)]
        x1, y1, x2, y2 = det["box"]
        canvas.rectangle([x1, y1, x2, y2], outline=color, width=line)
        text = f"{det['name']} {det['score']:.2f}"
        left, top, right, bottom = canvas.textbbox((0, 0), text, font=font)
        width, height = right - left + 2 * line, bottom - top + 2 * line
        label_y = y1 - height if y1 - height >= 0 else y1  # above the box, or inside it at the top edge
        label_x = min(max(0, x1), max(0, image.width - width))
        canvas.rectangle([label_x, label_y, label_x + width, label_y + height], fill=color)
        canvas.text((label_x + line - left, label_y + line - top), text, fill=(0, 0, 0), font=font)
        for x, y in det.get("landmarks", []):
            canvas.ellipse([x - line, y - line, x + line, y + line], fill=color)
    return image


def draw_records(records: Iterable[dict], out_dir: str | Path, *, root: str | Path | None = None,
                 limit: int | None = None, min_score: float = 0.0, image_format: str = "jpg"
                 ) -> tuple[list[Path], list[str]]:
    """Write one annotated image per record (the first `limit`) into out_dir. A record's relative
    path resolves against `root` (default: the working directory). Returns the files written and
    one line per image that could not be drawn (missing, unreadable): those are skipped. A file
    of the drawing's name is replaced only in a folder gpudet draw wrote (its mark), never
    through a symbolic link: anything else there is someone else's (OutputError)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ours = (out / DRAWINGS_MARKER).is_file()
    (out / DRAWINGS_MARKER).touch()  # a folder source that holds this folder leaves the drawings out
    written, skipped = [], []
    for record, fetched in with_fetched(itertools.islice(records, limit)):
        source = record["path"] if storage.is_url(record["path"]) else Path(record["path"])
        if root is not None and isinstance(source, Path) and not source.is_absolute():
            source = Path(root) / source
        try:
            if isinstance(fetched, storage.Unreadable):
                raise fetched
            image = draw_detections(record, source if fetched is None else fetched, min_score=min_score)
        except (OSError, ValueError) as e:  # gone since the run, unreadable, no longer an image
            skipped.append(f"{source} (index {record['index']}): "
                           f"{e.strerror if isinstance(e, OSError) and e.strerror else e}")
            continue
        name = Path(storage.named_path(source) if isinstance(source, str) else source)
        path = out / f"{int(record['index']):08d}_{safe_stem(name)}.{image_format}"
        if path.is_symlink() or (os.path.lexists(path) and not ours):
            raise OutputError(f"{path} is there already, and not a drawing gpudet made; gpudet never replaces a file "
                              "it did not write: give --out a new or empty folder, or one gpudet draw wrote")
        image.save(path, FORMATS[image_format], **({"quality": 90} if image_format != "png" else {}))
        written.append(path)
    return written, skipped


FETCHED_AT_ONCE = 32
"""URL records whose images draw_records fetches at once (storage.fetch: concurrently, with retries)."""


def with_fetched(records: Iterable[dict]) -> Iterator[tuple[dict, bytes | storage.Unreadable | None]]:
    """Each record with its image's bytes where its path is a URL (None where it is a file), the
    URLs of FETCHED_AT_ONCE records fetched at once: a store that answers slowly, or not at all,
    costs one wait per chunk, not one per image (and a store that serves none is one SourceError)."""
    records = iter(records)
    while chunk := list(itertools.islice(records, FETCHED_AT_ONCE)):
        urls = [r["path"] for r in chunk if storage.is_url(r["path"])]
        fetched = storage.fetch(urls) if urls else {}
        for record in chunk:
            data = fetched.get(record["path"])
            yield record, data if data is None or isinstance(data, storage.Unreadable) else bytes(data)


def recorded_root(detections: str | Path) -> str | None:
    """The folder the run that wrote `detections` (its output folder, detections.jsonl,
    detections.parquet or one of its files) ran in, from the output folder's summary.json: the
    records' relative paths resolve against it. None if there is no summary to say."""
    folder = records_folder(Path(detections))
    try:
        cwd = json.loads((folder / "summary.json").read_text()).get("cwd")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return cwd if isinstance(cwd, str) else None


def safe_stem(path: Path) -> str:
    """A file name part for the drawing of `path`: its stem with anything but letters and digits (of
    any script: `café` stays `café`), `.`, `_` and `-` replaced by `_`, at most 64 characters and
    200 bytes of UTF-8."""
    stem = re.sub(r"[^\w.-]", "_", path.stem)[:64]
    while len(stem.encode()) > 200:  # (a byte that is not UTF-8, surrogate-escaped, is no \w: it is `_`)
        stem = stem[:-1]
    return stem or "image"
