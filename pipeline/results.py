"""The small types that travel with each image: where it came from, what was found, what failed.

    ImageRef     an input: its index in the source and its path
    ImageError   an input that could not be processed, with a stable reason
    Detections   a batch's final detections on the host (numpy), rows grouped by image
    ImageResult  one image's detections, what `Detector.run` yields

Every input ends as exactly one ImageResult (or detections record) or one ImageError.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    """Stable code: missing, not_a_file, unreadable, empty, unknown_format, bad_header, too_large,
    decode_failed (README, "When things go wrong")."""
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

    @staticmethod
    def concatenate(parts: list[Detections]) -> Detections:
        return Detections(
            batch_index=np.concatenate([p.batch_index for p in parts]),
            boxes_xyxy=np.concatenate([p.boxes_xyxy for p in parts]),
            scores=np.concatenate([p.scores for p in parts]),
            labels=np.concatenate([p.labels for p in parts]),
            landmarks=None if parts[0].landmarks is None else np.concatenate([p.landmarks for p in parts]))

    def rows_of(self, image: int) -> np.ndarray:
        return np.flatnonzero(self.batch_index == image)


@dataclass
class ImageResult:
    """One image's detections, on the host, in original pixels (after EXIF orientation)."""

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
    def of(cls, ref: ImageRef, height: int, width: int, found: Detections, row: int,
           label_names: list[str]) -> ImageResult:
        """Image `row` of a batch's detections."""
        rows = found.rows_of(row)
        labels = found.labels[rows]
        return cls(index=ref.index, path=ref.path, width=width, height=height, boxes_xyxy=found.boxes_xyxy[rows],
                   scores=found.scores[rows], labels=labels, names=label_name(label_names, labels.tolist()),
                   landmarks=None if found.landmarks is None else found.landmarks[rows])


def label_name(names: list[str], labels: list[int]) -> list[str]:
    """The class name of each label (its number as text where the config names no class)."""
    return [names[k] if 0 <= k < len(names) else str(k) for k in labels]
