"""Records (detections.jsonl, detections.parquet) as the files other tools read: CSV, one row per
detection (an image with none: one row, its detection's columns empty), and YOLO label files, one
per image (`class cx cy w h score`, over the image's size, as Ultralytics' save_txt with save_conf
writes them); and how a command's one output file (export's CSV, export-coco's, eval's and bench's
JSON) is checked and written: never over a file gpudet did not write."""

from __future__ import annotations

import csv
import os
from collections.abc import Iterable
from pathlib import Path

from .errors import OutputError, OutputWriteError
from .layout import CSV_HEADER, EXPORT_MARKER, is_own_file
from .sinks import is_device, replacing
from .storage import named_path

OWN_FILES = {"csv": "CSV gpudet export", "coco": "COCO results file gpudet export-coco",
             "metrics": "metrics file gpudet eval", "bench": "report gpudet bench"}


def output_file(path: str, option: str, kind: str) -> Path:
    """The file a command writes at its end (`kind`: layout.OWN_FILE_STARTS), checked before its
    work: its folder is there, and it is new or a file of that kind gpudet wrote (never a link, a
    folder or another's file, which gpudet must not replace)."""
    out = Path(path)
    if out.is_dir():
        raise OutputError(f"{option} {out} is a folder; give the path of a file to write")
    if is_device(out):
        return out
    if out.is_symlink():
        raise OutputError(f"{option} {out} is a symbolic link; gpudet never writes through one: give another path")
    if not out.parent.is_dir():
        raise OutputError(f"{option} {out}: its folder {out.parent} does not exist; create it or give another path")
    if os.path.lexists(out) and not is_own_file(out, kind):
        raise OutputError(f"{option} {out} exists and is not a {OWN_FILES[kind]} wrote, so gpudet leaves it as it "
                          "is; give a new path (or remove the file yourself)")
    return out


def write_output(path: Path, option: str, text: str) -> None:
    """Write a command's output file whole (output_file checked it); a failure is one line naming
    it (exit 4), and leaves what was there."""
    try:
        with replacing(path) as f:
            f.write(text)
    except OSError as e:
        raise OutputWriteError(path, e, f"give {option} a file gpudet may write, or make room") from None


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
