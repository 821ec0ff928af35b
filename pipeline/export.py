"""Records (detections.jsonl, detections.parquet) as the files other tools read: CSV, one row per
detection (an image with none: one row, its detection's columns empty), and YOLO label files, one
per image (`class cx cy w h score`, over the image's size, as Ultralytics' save_txt with save_conf
writes them)."""

from __future__ import annotations

import csv
from collections.abc import Iterable
from pathlib import Path

from .errors import OutputError
from .layout import CSV_HEADER, EXPORT_MARKER
from .sinks import replacing
from .storage import named_path


def write_csv(records: Iterable[dict], path: Path) -> tuple[int, int]:
    """One row per detection; an image with none, one row with its detection's columns empty (so
    that every processed image is there). UTF-8; a file name that is not is written as its bytes.
    `path` appears whole once written (a failure leaves what was there). Returns (images,
    detections)."""
    images = found = 0
    with replacing(path) as f:
        writer = csv.writer(f)
        writer.writerow(CSV_HEADER.split(","))
        for record in records:
            images += 1
            head = [record["index"], record["path"], record.get("width", ""), record.get("height", "")]
            for det in record["detections"]:
                writer.writerow([*head, *det["box"], det["score"], det["label"], det["name"]])
                found += 1
            if not record["detections"]:
                writer.writerow(head + [""] * 7)
    return images, found


def write_yolo(records: Iterable[dict], folder: Path) -> tuple[int, int]:
    """A `<stem>.txt` per image (`<stem>_<index>.txt` where two images share a stem), a line per
    detection: label, then the box's centre x, centre y, width and height over the image's width
    and height, then its score; an image with no detection gets an empty file. Into a folder that
    is new, empty, or one this wrote (its mark): never over another's files. Returns (images,
    detections)."""
    folder.mkdir(parents=True, exist_ok=True)
    ours = (folder / EXPORT_MARKER).is_file()
    if not ours and any(folder.iterdir()):
        raise OutputError(f"{folder} holds files gpudet did not write; give --out a new or empty folder (or one "
                          "gpudet export --format yolo wrote)")
    (folder / EXPORT_MARKER).touch()
    images = found = 0
    stems: set[str] = set()
    for record in records:
        if "width" not in record:
            raise OutputError(f"{record['path']}: its record has no image size; YOLO labels need it (records of "
                              "gpudet detect have it)")
        w, h = record["width"], record["height"]
        stem = Path(named_path(record["path"])).stem or "image"
        name = stem if stem not in stems else f"{stem}_{record['index']}"
        stems.add(name)
        lines = []
        for det in record["detections"]:
            x1, y1, x2, y2 = det["box"]
            lines.append(f"{det['label']} {(x1 + x2) / 2 / w:.6f} {(y1 + y2) / 2 / h:.6f} {(x2 - x1) / w:.6f} "
                         f"{(y2 - y1) / h:.6f} {det['score']:.5f}\n")
        target = folder / f"{name}.txt"
        if target.is_symlink():
            raise OutputError(f"{target} is a symbolic link; gpudet never writes through one: remove it")
        with open(target, "w", encoding="utf-8") as f:
            f.writelines(lines)
        images, found = images + 1, found + len(lines)
    return images, found
