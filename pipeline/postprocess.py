"""Postprocess, on the device: model outputs -> final detections in original image pixels.

The end-to-end contract (the default RetinaFace model, any model with in-graph NMS):
    boxes        [N, 4]  x1 y1 x2 y2 in model-input pixels
    scores       [N]
    batch_index  [N]     int, which image of the batch
    labels       [N]     int, optional (label 0 when absent)
    landmarks    [N, 2K] (x, y) pairs in model-input pixels, optional
N counts the detections of the whole batch. Everything below runs in torch on the outputs'
device; the one device-to-host copy is of the final, thresholded detections, once per batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .engine import ModelError, TensorSpec, describe_io
from .nms import batched_nms

# name -> rank. Ranks are what contract detection checks; names are how outputs are found.
CONTRACTS = {
    "end_to_end": ({"boxes": 2, "scores": 1, "batch_index": 1}, {"labels": 1, "landmarks": 2}),
    "ssd_heads": ({"loc": 3, "conf": 3}, {"landmarks": 3}),
}


def detect_contract(outputs: list[TensorSpec], requested: str, model_path: Path) -> str:
    """Which output contract the model follows; `requested` is the config's model.contract."""
    by_name = {s.name: s for s in outputs}

    def fits(required: dict, optional: dict) -> bool:
        return all(n in by_name and len(by_name[n].shape) == r for n, r in required.items()) and all(
            len(by_name[n].shape) == r for n, r in optional.items() if n in by_name)

    for name, (required, optional) in CONTRACTS.items():
        if requested in ("auto", name) and fits(required, optional):
            return name
    expected = "; ".join(
        f"{name}: " + ", ".join(f"{n} (rank {r})" for n, r in required.items()) +
        (", optional " + ", ".join(f"{n} (rank {r})" for n, r in optional.items()) if optional else "")
        for name, (required, optional) in CONTRACTS.items() if requested in ("auto", name))
    raise ModelError(f"{model_path}: outputs do not fit the {requested} contract. Found: {describe_io(outputs)}. "
                     f"Expected {expected}.")


@dataclass
class Detections:
    """Final detections of one batch, on the host. Rows are grouped by image, best score first."""

    batch_index: np.ndarray  # int64 [M]
    boxes_xyxy: np.ndarray  # float32 [M, 4], original pixels (after EXIF orientation), clipped
    scores: np.ndarray  # float32 [M]
    labels: np.ndarray  # int64 [M]
    landmarks: np.ndarray | None  # float32 [M, K, 2], original pixels, or None

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


def to_device_meta(scale_yx: np.ndarray, pad_yx: np.ndarray, orig_hw: np.ndarray,
                   device: torch.device) -> torch.Tensor:
    """[B, 6] float32 (scale_y, scale_x, pad_y, pad_x, height, width) on the device."""
    meta = np.concatenate([scale_yx, pad_yx, orig_hw.astype(np.float32)], axis=1).astype(np.float32)
    return torch.from_numpy(meta).to(device)


@dataclass
class DeviceDetections:
    """Final detections of one batch, still on the device (torch tensors). Rows grouped by image,
    best score first; boxes and landmarks in original pixels."""

    batch_index: torch.Tensor  # int64 [M]
    boxes_xyxy: torch.Tensor  # float32 [M, 4]
    scores: torch.Tensor  # float32 [M]
    labels: torch.Tensor  # int64 [M]
    landmarks: torch.Tensor | None  # float32 [M, K, 2]

    @staticmethod
    def concatenate(parts: list[DeviceDetections]) -> DeviceDetections:
        return DeviceDetections(
            batch_index=torch.cat([p.batch_index for p in parts]), boxes_xyxy=torch.cat([p.boxes_xyxy for p in parts]),
            scores=torch.cat([p.scores for p in parts]), labels=torch.cat([p.labels for p in parts]),
            landmarks=None if parts[0].landmarks is None else torch.cat([p.landmarks for p in parts]))

    def to_host(self) -> Detections:
        """One device-to-host copy of all columns, packed."""
        columns = [self.batch_index.float()[:, None], self.labels.float()[:, None], self.scores[:, None],
                   self.boxes_xyxy]
        if self.landmarks is not None:
            columns.append(self.landmarks.flatten(1))
        rows = torch.cat(columns, dim=1).cpu().numpy()
        return Detections(
            batch_index=rows[:, 0].astype(np.int64), labels=rows[:, 1].astype(np.int64), scores=rows[:, 2].copy(),
            boxes_xyxy=rows[:, 3:7].copy(),
            landmarks=rows[:, 7:].reshape(len(rows), self.landmarks.shape[1], 2).copy()
            if self.landmarks is not None else None)


def end_to_end_device(outputs: dict[str, torch.Tensor], meta: torch.Tensor, *, score_threshold: float,
                      max_detections: int, num_landmarks: int, num_images: int | None = None) -> DeviceDetections:
    """Threshold, cap per image, undo the resize/letterbox and clip, all on the outputs' device.

    outputs: the end-to-end contract's tensors. meta: [B, 6] from to_device_meta.
    num_images: rows of the batch that are real images (the rest pad the batch); default all.
    """
    scores = outputs["scores"].float()
    image = outputs["batch_index"].long()
    labels = outputs["labels"].long() if "labels" in outputs else torch.zeros_like(image)

    # Order by (image, score desc); rank within each image; keep score >= threshold and rank < cap.
    # Rows below the threshold sort after those above it, so the rank counts kept rows first.
    order = torch.argsort(scores, descending=True, stable=True)
    order = order[torch.argsort(image[order], stable=True)]
    counts = torch.bincount(image, minlength=meta.shape[0])
    first_row = torch.cumsum(counts, 0) - counts
    rank = torch.arange(len(order), device=scores.device) - first_row[image[order]]
    keep = (scores[order] >= score_threshold) & (rank < max_detections)
    if num_images is not None:
        keep &= image[order] < num_images
    rows = order[keep]  # a boolean mask: one sync for the count
    landmarks = None
    if num_landmarks:
        landmarks = to_original(outputs["landmarks"][rows].reshape(-1, num_landmarks, 2), image[rows], meta)
    boxes = to_original(outputs["boxes"][rows].reshape(-1, 2, 2), image[rows], meta).reshape(-1, 4)
    return DeviceDetections(batch_index=image[rows], boxes_xyxy=boxes, scores=scores[rows], labels=labels[rows],
                            landmarks=landmarks)


def to_original(points_xy: torch.Tensor, image: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """[M, P, 2] model-input pixels of the images `image` [M] -> original pixels, clipped."""
    per_row = meta[image]  # [M, 6]
    scale_xy, pad_xy, size_wh = per_row[:, [1, 0]], per_row[:, [3, 2]], per_row[:, [5, 4]]
    xy = (points_xy.float() - pad_xy[:, None]) / scale_xy[:, None]
    return torch.minimum(xy.clamp(min=0), size_wh[:, None])


def end_to_end(outputs: dict[str, torch.Tensor], meta: torch.Tensor, *, score_threshold: float,
               max_detections: int, num_landmarks: int, num_images: int | None = None) -> Detections:
    """end_to_end_device, then the one device-to-host copy."""
    return end_to_end_device(outputs, meta, score_threshold=score_threshold, max_detections=max_detections,
                             num_landmarks=num_landmarks, num_images=num_images).to_host()


class SsdHeads:
    """Postprocess for raw SSD-style heads (RetinaFace): decode, top-k, NMS, all batched on the device.

        loc        [B, A, 4]   SSD box coding against anchors (cx, cy, w, h in input pixels)
        conf       [B, A, 2]   softmax scores; class 1 is the object
        landmarks  [B, A, 2K]  optional, coded like the box centers

    The anchors are made once per input size on the device. Only the top `pre_nms_top_k`
    candidates per image are decoded; NMS is batched_nms (exact greedy, no host sync).
    """

    def __init__(self, *, strides: list[int], sizes: list[list[float]], variances: list[float],
                 pre_nms_top_k: int, device: torch.device):
        self.strides, self.sizes, self.variances = strides, sizes, variances
        self.pre_nms_top_k = pre_nms_top_k
        self.device = device
        self._anchors: dict[tuple[int, int], torch.Tensor] = {}

    def anchors(self, height: int, width: int) -> torch.Tensor:
        """[A, 4] (cx, cy, w, h) in input pixels, in the heads' order: per stride, row, column, size."""
        key = (height, width)
        if key not in self._anchors:
            parts = []
            for stride, sizes in zip(self.strides, self.sizes):
                rows, cols = -(-height // stride), -(-width // stride)
                cy, cx = torch.meshgrid((torch.arange(rows, device=self.device) + 0.5) * stride,
                                        (torch.arange(cols, device=self.device) + 0.5) * stride, indexing="ij")
                size = torch.tensor(sizes, dtype=torch.float32, device=self.device)
                n = len(sizes)
                parts.append(torch.stack([cx[..., None].expand(-1, -1, n), cy[..., None].expand(-1, -1, n),
                                          size.expand(rows, cols, n), size.expand(rows, cols, n)], -1).reshape(-1, 4))
            self._anchors[key] = torch.cat(parts).float()
        return self._anchors[key]

    def __call__(self, outputs: dict[str, torch.Tensor], meta: torch.Tensor, *, input_hw: tuple[int, int],
                 score_threshold: float, iou_threshold: float, max_detections: int, num_landmarks: int,
                 num_images: int | None = None, max_iterations: int = 32) -> tuple[DeviceDetections, torch.Tensor]:
        """Final detections on the device, and whether NMS converged within max_iterations."""
        anchors = self.anchors(*input_hw)
        scores_all = outputs["conf"][..., 1].float()  # [B, A]
        k = min(self.pre_nms_top_k, scores_all.shape[1])
        scores, index = scores_all.topk(k, dim=1)  # sorted, best first
        valid = scores > score_threshold  # the reference keeps score > threshold
        if num_images is not None:
            valid &= torch.arange(len(valid), device=valid.device)[:, None] < num_images
        prior = anchors[index]  # [B, k, 4]
        center_var, size_var = self.variances
        loc = outputs["loc"].float().gather(1, index[..., None].expand(-1, -1, 4))
        centers = prior[..., :2] + loc[..., :2] * center_var * prior[..., 2:]
        wh = prior[..., 2:] * torch.exp(loc[..., 2:] * size_var)
        boxes = torch.cat([centers - wh / 2, centers + wh / 2], dim=-1)
        keep, converged = batched_nms(boxes, scores, torch.zeros_like(index), valid, iou_threshold=iou_threshold,
                                      max_iterations=max_iterations)
        keep &= torch.cumsum(keep, dim=1) <= max_detections  # best first, so this caps per image
        image, slot = keep.nonzero(as_tuple=True)  # one sync for the count; rows by image, then score
        landmarks = None
        if num_landmarks:
            coded = outputs["landmarks"].float().gather(1, index[..., None].expand(-1, -1, 2 * num_landmarks))
            coded = coded[image, slot].reshape(-1, num_landmarks, 2)
            p = prior[image, slot]
            landmarks = to_original(p[:, None, :2] + coded * center_var * p[:, None, 2:], image, meta)
        found = DeviceDetections(batch_index=image, boxes_xyxy=to_original(boxes[image, slot].reshape(-1, 2, 2), image,
                                                                           meta).reshape(-1, 4),
                                 scores=scores[image, slot], labels=torch.zeros_like(image), landmarks=landmarks)
        return found, converged
