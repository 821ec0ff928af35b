"""COCO: detections.jsonl (or .parquet) -> a COCO results file mapped onto an annotation file's ids, and COCO metrics.

Images are matched by file name: a record's path must end with an image's `file_name` (its
relative path in the annotation file), or, failing that, have the same base name as exactly one
image; a web URL by its path without the query, percent-decoded (storage.named_path). Categories
are matched by name (case-insensitive) between the model's labels and the annotation file's
categories.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from .errors import ConfigError, OutputError
from .storage import named_path

log = logging.getLogger("gpudet")

METRICS = ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "ARs", "ARm", "ARl")


ENTRY_FIELDS = {"images": ("id", "file_name"), "categories": ("id", "name"),
                "annotations": ("id", "image_id", "category_id", "bbox")}
"""What gpudet and COCO's evaluation read of each entry of an annotation file's lists."""


def bad_field(entry: dict) -> str | None:
    """What is wrong with an entry's file_name, name or bbox (all present), if anything."""
    for name in ("file_name", "name"):
        if name in entry and not isinstance(entry[name], str):
            return f"has a {name} that is not a string"
    box = entry.get("bbox")
    if "bbox" in entry and not (isinstance(box, list) and len(box) == 4 and
                                all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in box)):
        return f"has a bbox that is not [x, y, width, height]: {json.dumps(box)[:60]}"
    return None


def load_annotations(path: str | Path, *, for_eval: bool = False) -> dict:
    """A COCO annotation file: its images and categories (and, for_eval, its annotations)."""
    path = Path(path)
    try:
        gt = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"--annotations {path}: cannot read a COCO annotation file: {e}") from None
    for key in ("images", "categories") + (("annotations",) if for_eval else ()):
        if not isinstance(gt, dict) or not isinstance(gt.get(key), list):
            raise ConfigError(f"--annotations {path}: no '{key}' list; is this a COCO annotation file"
                              + (" with ground truth (eval needs it)?" if key == "annotations" else "?"))
        fields = ENTRY_FIELDS[key]
        for k, entry in enumerate(gt[key]):
            missing = [f for f in fields if not isinstance(entry, dict) or f not in entry]
            problem = f"has no '{missing[0]}'" if missing else bad_field(entry)
            if problem:
                raise ConfigError(f"--annotations {path}: {key}[{k}] {problem}; each of its {key} needs "
                                  + ", ".join(f"'{f}'" for f in fields))
    return gt


class ImageMatcher:
    """Record path -> COCO image id, by trailing file_name, else by unique base name."""

    def __init__(self, images: list[dict]):
        self.by_file_name = {img["file_name"].replace("\\", "/"): img["id"] for img in images}
        self.by_base: dict[str, int | None] = {}
        for name, image_id in self.by_file_name.items():
            base = name.rsplit("/", 1)[-1]
            self.by_base[base] = None if base in self.by_base else image_id  # None: ambiguous

    def __call__(self, path: str) -> int | None:
        path = named_path(path).replace("\\", "/")
        parts = path.split("/")
        for k in range(len(parts)):  # the longest trailing part that is a file_name
            image_id = self.by_file_name.get("/".join(parts[k:]))
            if image_id is not None:
                return image_id
        return self.by_base.get(parts[-1])


def to_coco_results(records: Iterable[dict], gt: dict, matched: set[int] | None = None) -> tuple[list[dict], int]:
    """COCO results [{image_id, category_id, bbox: [x, y, w, h], score}] and the number of records
    whose image is not in the annotation file (skipped). matched: filled with the ids of the
    annotated images that have a record. A record whose image an earlier record already matched
    (the same file listed twice, or two folders' files of one name) is left out, with a warning:
    scored twice, its detections would count as false positives."""
    match_image = ImageMatcher(gt["images"])
    sizes = {img["id"]: (img.get("width"), img.get("height")) for img in gt["images"]}
    categories = {c["name"].lower(): c["id"] for c in gt["categories"]}
    results, unmatched, resized = [], 0, []
    first: dict[int, str] = {}  # image id -> the path of the record kept for it
    repeated, example = 0, ("", "")  # records left out; the first of them (kept path, its path)
    for record in records:
        image_id = match_image(record["path"])
        if image_id is None:
            unmatched += 1
            continue
        if image_id in first:
            repeated += 1
            if repeated == 1:
                example = (first[image_id], record["path"])
            continue
        first[image_id] = record["path"]
        known = sizes[image_id]
        if "width" in record and None not in known and known != (record["width"], record["height"]):
            resized.append((record["path"], (record["width"], record["height"]), known))
        if matched is not None:
            matched.add(image_id)
        for det in record["detections"]:
            category_id = categories.get(str(det["name"]).lower())
            if category_id is None:
                raise ConfigError(f"label {det['name']!r} (from {record['path']}) is not a category of the annotation "
                                  f"file ({', '.join(sorted(categories))}); set model.labels to those names")
            x1, y1, x2, y2 = det["box"]
            results.append({"image_id": image_id, "category_id": category_id,
                            "bbox": [round(x1, 2), round(y1, 2), round(x2 - x1, 2), round(y2 - y1, 2)],
                            "score": det["score"]})
    if resized:
        raise ConfigError(different_sizes(resized, len(first)))
    if repeated:
        kept, left_out = example
        many = "1 record matches" if repeated == 1 else f"{repeated} records match"
        log.warning("%s an image an earlier record matched (first: %s, kept, and %s); only the first of each is "
                    "used", many, kept, left_out)
    return results, unmatched


def different_sizes(resized: list[tuple[str, tuple, tuple]], matched: int) -> str:
    """Why records and annotations of images of other sizes cannot be scored together."""
    path, (w, h), (gw, gh) = resized[0]
    turned = (w, h) == (gh, gw)
    return (f"{len(resized)} of the {matched} annotated images with a record differ in size from it (first: {path}, "
            f"{w}x{h} in the records, {gw}x{gh} in the annotations): boxes of different pixels cannot be scored. "
            + ("gpudet's boxes are in the image as displayed, its EXIF orientation applied; annotate the images "
               "upright, or evaluate against annotations of the displayed images" if turned else
               "evaluate against the annotation file of the images that were detected"))


def evaluate(gt: dict, results: list[dict]) -> dict[str, float]:
    """The 12 standard COCO bbox metrics (faster-coco-eval), and `AP_per_class`: each annotated
    category's AP (IoU 0.50:0.95, all areas, 100 detections), by name. No detections: every
    metric is 0."""
    try:
        from faster_coco_eval import COCO, COCOeval_faster
    except ImportError:
        raise ConfigError("gpudet eval needs faster-coco-eval: pip install 'gpudet[eval]'") from None

    annotated = sorted({a["category_id"] for a in gt["annotations"]})
    names = {c["id"]: c["name"] for c in gt["categories"]}
    if not results:
        return {**dict.fromkeys(METRICS, 0.0), "AP_per_class": {names[c]: 0.0 for c in annotated}}
    coco_gt = COCO(gt)
    coco_eval = COCOeval_faster(coco_gt, coco_gt.loadRes(results), iouType="bbox", print_function=lambda *a: None)
    coco_eval.evaluate()
    coco_eval.accumulate()
    coco_eval.summarize()
    metrics = {name: round(float(value), 6) for name, value in zip(METRICS, coco_eval.stats)}
    precision = np.asarray(coco_eval.eval["precision"])  # [IoU thresholds, recalls, categories, areas, max dets]
    per_class = {}
    for k, category in enumerate(coco_eval.params.catIds):
        if category in annotated:
            p = precision[:, :, k, 0, -1]
            per_class[names[category]] = round(float(p[p > -1].mean()) if (p > -1).any() else 0.0, 6)
    return {**metrics, "AP_per_class": per_class}


def unfinished(detections: Path) -> None:
    """A warning where the run that wrote `detections` says (its summary.json) that it was stopped:
    its records are some of its images only."""
    from .layout import SUMMARY, is_output_folder, records_folder

    folder = records_folder(detections)
    try:
        summary = json.loads((folder / SUMMARY).read_text(encoding="utf-8")) if is_output_folder(folder) else {}
    except (OSError, ValueError, RecursionError):
        return
    if isinstance(summary, dict) and summary.get("interrupted") is True:
        counts = [summary.get(key) for key in ("already_done", "processed", "failed", "images")]  # done: failed too
        known = all(isinstance(n, int) for n in counts)
        if known and sum(counts[:3]) >= counts[3]:  # stopped after its last image
            return
        count = f" after {sum(counts[:3]):,} of its {counts[3]:,} images" if known else ""
        log.warning("%s: its run was stopped%s, so these records are not all of its images; `gpudet detect SOURCE "
                    "--out %s --resume` finishes it", folder, count, folder)


def read_detections(path: str | Path) -> list[dict]:
    """The records gpudet detect wrote: a detections.jsonl, a detections.parquet folder (or one of
    its files), or the output folder that holds either. Anything else is an error naming the file
    (and, for JSONL, its first bad line)."""
    from .layout import DETECTIONS, is_output_folder
    from .formats import format_of

    path = Path(path)
    if path.is_dir() and path.suffix != ".parquet":  # an output folder
        folder = path
        path = next((path / name for name in DETECTIONS.values() if (path / name).exists()), path / DETECTIONS["jsonl"])
        if not path.exists() and is_output_folder(folder):
            raise ConfigError(f"{folder} is a gpudet output folder that holds no records yet: its run is still going, "
                              "or stopped before writing them (with --devices or --ray, before merging them); "
                              f"finish it with `gpudet detect SOURCE --out {folder} --resume`")
    kind = format_of(path)
    if kind is None or not path.exists():
        what = "does not exist" if not path.exists() else "is not detections.jsonl, detections.parquet or an output folder"
        raise ConfigError(f"{path} {what}; pass the detections.jsonl (or detections.parquet) that gpudet detect wrote, "
                          "or its output folder")
    unfinished(path)
    try:  # the input of this command, not its output: a bad one is a usage error
        return list(kind.read(path, fix="remove it; `gpudet detect --resume` into its output folder then detects its "
                                        "images again"))
    except OutputError as e:
        raise ConfigError(str(e)) from None
