"""The small types that travel with each image: where it came from, what was found, what failed.

    ImageRef     an input: its index in the source and its path
    ImageError   an input that could not be processed, with a stable reason
    Detections   a batch's final detections on the host (numpy), rows grouped by image
    ImageResult  one image's detections, what `Detector.run` yields
    RecordColumns  a batch's detections as every output format records them (grouped, rounded)

Every input ends as exactly one ImageResult (or detections record) or one ImageError.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


@dataclass(frozen=True)
class ImageRef:
    index: int
    """Position in the source (the list's line order, or sorted order for folders and globs)."""
    path: str
    """As given in the list (resolved against its folder or --root), or as found in the folder."""


@dataclass(frozen=True)
class ImageError:
    index: int
    path: str
    reason: str
    """Stable code: missing, forbidden, not_a_file, unreadable, empty, unknown_format, bad_header,
    truncated, too_large, decode_failed, unsupported, bad_array, bad_model_output (docs/OUTPUT.md, "When things
    go wrong")."""
    message: str

    def to_record(self) -> dict:
        return {"index": self.index, "path": self.path, "reason": self.reason, "message": self.message}


@dataclass
class Detections:
    """A batch's final detections on the host. Rows are grouped by image, best score first;
    boxes and landmarks in original pixels (after EXIF orientation), clipped to the image."""

    batch_index: np.ndarray  # int64 [M]: the image's row in its batch
    boxes_xyxy: np.ndarray  # float32 [M, 4]
    scores: np.ndarray  # float32 [M]
    labels: np.ndarray  # int64 [M]
    landmarks: np.ndarray | None  # float32 [M, K, 2], or None

    def __post_init__(self):
        m = len(self.batch_index)
        assert self.boxes_xyxy.shape == (m, 4) and self.scores.shape == (m,) and self.labels.shape == (m,)
        assert self.landmarks is None or (self.landmarks.shape[0] == m and self.landmarks.shape[2] == 2)

    def bad_images(self) -> list[int]:
        """The images (batch rows) with a box, score or landmark that is NaN or infinite: what no
        record may hold (a model's fault, not the image's)."""
        finite = np.isfinite(self.boxes_xyxy).all(axis=1) & np.isfinite(self.scores)
        if self.landmarks is not None:
            finite &= np.isfinite(self.landmarks).all(axis=(1, 2))
        return np.unique(self.batch_index[~finite]).tolist()

    def without(self, images: list[int], count: int) -> Detections:
        """These detections without the rows of `images` (batch rows of a batch of `count`), the
        images after them moved up (batch_index renumbered)."""
        renumbered = np.cumsum(~np.isin(np.arange(count), images)) - 1
        kept = self.rows(~np.isin(self.batch_index, images))
        return dataclasses.replace(kept, batch_index=renumbered[kept.batch_index])

    def of_classes(self, classes: tuple[int, ...]) -> Detections:
        """The rows of these labels only."""
        return self.rows(np.isin(self.labels, classes))

    def rows(self, mask: np.ndarray) -> Detections:
        """The rows where `mask` is True, every column."""
        return Detections(batch_index=self.batch_index[mask], boxes_xyxy=self.boxes_xyxy[mask],
                          scores=self.scores[mask], labels=self.labels[mask],
                          landmarks=None if self.landmarks is None else self.landmarks[mask])

    def per_image(self, count: int) -> list[Detections]:
        """The rows of images 0..count-1, each as its own Detections (batch_index 0)."""
        ends = np.searchsorted(self.batch_index, np.arange(1, count + 1), side="left").tolist()
        parts, start = [], 0
        for end in ends:
            rows = slice(start, end)
            parts.append(Detections(batch_index=np.zeros(end - start, np.int64), boxes_xyxy=self.boxes_xyxy[rows],
                                    scores=self.scores[rows], labels=self.labels[rows],
                                    landmarks=None if self.landmarks is None else self.landmarks[rows]))
            start = end
        return parts


@dataclass
class ImageResult:
    """One image's detections, in original pixels (after EXIF orientation): numpy arrays on the
    host, or torch tensors on the detector's device (Detector.run(..., on_device=True))."""

    index: int
    path: str
    width: int
    height: int
    boxes_xyxy: np.ndarray  # float32 [K, 4] x1 y1 x2 y2
    scores: np.ndarray  # float32 [K], best first
    labels: np.ndarray  # int64 [K]
    names: list[str]
    landmarks: np.ndarray | None  # float32 [K, L, 2], or None

    @classmethod
    def of(cls, ref: ImageRef, height: int, width: int, found, label_names: list[str]) -> ImageResult:
        """The detections of one image (Detections, or postprocess.DeviceDetections)."""
        return cls(index=ref.index, path=ref.path, width=width, height=height, boxes_xyxy=found.boxes_xyxy,
                   scores=found.scores, labels=found.labels, names=label_name(label_names, found.labels.tolist()),
                   landmarks=found.landmarks)

    def to_dict(self) -> dict:
        """The image's record, as detections.jsonl holds it (json.dumps takes it)."""
        def host(a):
            return a.cpu().numpy() if hasattr(a, "cpu") else a

        found = Detections(batch_index=np.zeros(len(self.scores), np.int64), boxes_xyxy=host(self.boxes_xyxy),
                           scores=host(self.scores), labels=host(self.labels),
                           landmarks=None if self.landmarks is None else host(self.landmarks))
        names = dict(zip(found.labels.tolist(), self.names))
        label_names = [names.get(k, str(k)) for k in range(int(found.labels.max()) + 1)] if len(found.labels) else []
        return detection_records([ImageRef(self.index, self.path)], np.array([[self.height, self.width]]), found,
                                 label_names)[0]

    @property
    def orig_shape(self) -> tuple[int, int]:
        """(height, width) of the image as displayed: the pixels the boxes are in."""
        return self.height, self.width

    @property
    def xywh(self):
        """Boxes as centre x, centre y, width, height [K, 4], in pixels."""
        return xyxy_to_xywh(self.boxes_xyxy)

    @property
    def xyxyn(self):
        """Boxes as x1 y1 x2 y2 [K, 4] over the image's width and height (0..1)."""
        return self.boxes_xyxy / self._size()

    @property
    def xywhn(self):
        """Boxes as centre x, centre y, width, height [K, 4] over the image's width and height
        (0..1): YOLO's label format."""
        return self.xywh / self._size()

    def _size(self):
        size = [self.width, self.height, self.width, self.height]
        if hasattr(self.boxes_xyxy, "new_tensor"):  # a torch tensor on the device
            return self.boxes_xyxy.new_tensor(size)
        return np.asarray(size, dtype=self.boxes_xyxy.dtype)

    def to_json(self) -> str:
        """The image's record as one JSON line, as detections.jsonl holds it."""
        import orjson

        return orjson.dumps(self.to_dict()).decode()

    def to_pandas(self):
        """One row per detection (pandas.DataFrame): index, path, x1, y1, x2, y2, score, label,
        name; landmarks as a column of [[x, y], ...] where the model finds them."""
        try:
            import pandas
        except ImportError:
            raise ImportError("result.to_pandas() needs pandas: pip install pandas") from None
        return detection_frame([self.to_dict()], pandas)

    def to_supervision(self):
        """The detections as supervision's `sv.Detections` (xyxy, confidence, class_id, and the
        class names in data["class_name"]), for its annotators, trackers and zones."""
        try:
            import supervision
        except ImportError:
            raise ImportError("result.to_supervision() needs supervision: pip install supervision") from None

        def host(a):
            return a.cpu().numpy() if hasattr(a, "cpu") else a

        return supervision.Detections(xyxy=host(self.boxes_xyxy).astype(np.float32),
                                      confidence=host(self.scores).astype(np.float32),
                                      class_id=host(self.labels).astype(int),
                                      data={"class_name": np.array(self.names, dtype=str)})

    def draw(self, image=None, *, min_score: float = 0.0):
        """A PIL image of the detections drawn onto `image` (a path, a PIL image or RGB pixels;
        default: the file at `path`), in display orientation, as the boxes are. An image given to
        Detector.run in memory has no file: pass it here."""
        from .draw import draw_detections

        if image is None and self.path.startswith("<") and self.path.endswith(">"):
            raise ValueError(f"{self.path} was given in memory and has no file to draw on: pass the image, "
                             "result.draw(image)")
        return draw_detections(self.to_dict(), image, min_score=min_score)


def xyxy_to_xywh(boxes):
    """x1 y1 x2 y2 -> centre x, centre y, width, height (numpy or torch, [K, 4])."""
    wh = boxes[:, 2:] - boxes[:, :2]
    centre = boxes[:, :2] + wh / 2
    if hasattr(boxes, "new_tensor"):
        import torch

        return torch.cat([centre, wh], dim=1)
    return np.concatenate([centre, wh], axis=1)


DETECTION_COLUMNS = ["index", "path", "x1", "y1", "x2", "y2", "score", "label", "name"]


def detection_frame(records, pandas):
    """Records (detections.jsonl's dicts) as a DataFrame of one row per detection."""
    rows = []
    for record in records:
        for det in record["detections"]:
            row = [record["index"], record["path"], *det["box"], det["score"], det["label"], det["name"]]
            if "landmarks" in det:
                row.append(det["landmarks"])
            rows.append(row)
    columns = DETECTION_COLUMNS + (["landmarks"] if rows and len(rows[0]) > len(DETECTION_COLUMNS) else [])
    return pandas.DataFrame(rows, columns=columns)


def label_name(names: list[str], labels: list[int]) -> list[str]:
    """The class name of each label (its number as text where the config names no class)."""
    return [names[k] if 0 <= k < len(names) else str(k) for k in labels]


class RecordColumns(NamedTuple):
    """A batch's detections as its records hold them (every output format): the rows of its images
    grouped by image, best first within; boxes and landmarks to 0.01 px, scores to 1e-5 (np.round:
    k / 100 for the nearest integer k; JSON prints it short)."""

    per_image: np.ndarray  # int64 [B]: each image's rows, in order
    boxes: np.ndarray  # float64 [M, 4]
    scores: np.ndarray  # float64 [M]
    labels: np.ndarray  # int64 [M]
    landmarks: np.ndarray | None  # float64 [M, K, 2]


def record_columns(detections: Detections, count: int) -> RecordColumns:
    """The records' columns of images 0..count-1 (rows of images past them are not recorded)."""
    order = np.argsort(detections.batch_index, kind="stable")  # grouped by image, best first within
    per_image = np.bincount(detections.batch_index, minlength=count)[:count]
    order = order[:int(per_image.sum())]
    return RecordColumns(
        per_image=per_image, boxes=np.round(detections.boxes_xyxy[order].astype(np.float64), 2),
        scores=np.round(detections.scores[order].astype(np.float64), 5),
        labels=detections.labels[order].astype(np.int64),
        landmarks=None if detections.landmarks is None else np.round(detections.landmarks[order].astype(np.float64), 2))


def detection_records(refs: list[ImageRef], orig_hw: np.ndarray, detections: Detections,
                      label_names: list[str]) -> list[dict]:
    """One JSON-ready record per image of a batch, in batch order: what detections.jsonl holds.
    orig_hw: int [B, 2], each image's (height, width). Columns go to Python numbers once per
    batch (`tolist`), not element by element: this runs for every batch."""
    columns = record_columns(detections, len(refs))
    starts = np.concatenate([[0], np.cumsum(columns.per_image)]).tolist()
    boxes, scores, labels = columns.boxes.tolist(), columns.scores.tolist(), columns.labels.tolist()
    names = label_name(label_names, labels)
    landmarks = None if columns.landmarks is None else columns.landmarks.tolist()
    orig_hw = np.asarray(orig_hw).tolist()
    records = []
    for i, ref in enumerate(refs):
        items = []
        for row in range(starts[i], starts[i + 1]):
            item: dict = {"box": boxes[row], "score": scores[row], "label": labels[row], "name": names[row]}
            if landmarks is not None:
                item["landmarks"] = landmarks[row]
            items.append(item)
        height, width = orig_hw[i][:2]
        records.append({"index": ref.index, "path": ref.path, "width": width, "height": height, "detections": items})
    return records
