"""Visualisation: draw boxes, labels, scores and landmarks from detections.jsonl onto the images.

Output files are named by the record's index (`00000042.jpg`), never by the input path, so
nothing a file list says can place a file outside the output folder.
"""

from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageDraw, ImageOps

PALETTE = ((230, 25, 75), (60, 180, 75), (255, 225, 25), (0, 130, 200), (245, 130, 48), (145, 30, 180),
           (70, 240, 240), (240, 50, 230))


def draw_record(record: dict, *, min_score: float = 0.0) -> Image.Image:
    """The record's image in display orientation (as its boxes are), with its detections drawn."""
    image = ImageOps.exif_transpose(Image.open(record["path"])).convert("RGB")
    canvas = ImageDraw.Draw(image)
    width = max(2, round(max(image.size) / 400))
    for det in record["detections"]:
        if det["score"] < min_score:
            continue
        color = PALETTE[det["label"] % len(PALETTE)]
        x1, y1, x2, y2 = det["box"]
        canvas.rectangle([x1, y1, x2, y2], outline=color, width=width)
        text = f"{det['name']} {det['score']:.2f}"
        left, top, right, bottom = canvas.textbbox((x1, y1), text)
        canvas.rectangle([left, top - (bottom - top) - 2, right + 2, top], fill=color)
        canvas.text((x1 + 1, top - (bottom - top) - 2), text, fill=(0, 0, 0))
        for x, y in det.get("landmarks", []):
            canvas.ellipse([x - width, y - width, x + width, y + width], fill=color)
    return image


def draw_records(records: list[dict], out_dir: str | Path, *, limit: int | None = None,
                 min_score: float = 0.0) -> list[Path]:
    """Write one annotated JPEG per record (the first `limit`); returns the files written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for record in records[:limit]:
        path = out / f"{int(record['index']):08d}.jpg"
        draw_record(record, min_score=min_score).save(path, quality=90)
        written.append(path)
    return written
