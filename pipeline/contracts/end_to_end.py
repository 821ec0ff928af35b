"""end_to_end: a model that decodes and NMS's in its graph (the embedded RetinaFace).

    boxes        [N, 4]   x1 y1 x2 y2, model-input pixels
    scores       [N]
    batch_index  [N]      the detection's image in the batch
    labels       [N]      optional (0 where there is none)
    landmarks    [N, 2K]  optional
"""

from __future__ import annotations

import torch

from ..errors import ModelError
from ..postprocess import BadModelOutput, DeviceDetections, Thresholds, to_original
from . import Contract, landmark_points


def check_lengths(outputs: dict[str, torch.Tensor], widths: dict[str, int]) -> None:
    """An end-to-end model's outputs, one row per detection: each as long as `scores`, and as wide
    as `widths` says (boxes 4; landmarks 2 a point). ModelError naming the output otherwise: a
    model that breaks its contract's shapes stops the run."""
    count = outputs["scores"].shape[0]
    for name in ("boxes", "scores", "batch_index", "labels", "landmarks"):
        value = outputs.get(name)
        if value is None:
            continue
        if value.shape[0] != count or (name in widths and tuple(value.shape[1:]) != (widths[name],)):
            expected = f"[{count}" + (f", {widths[name]}]" if name in widths else "]")
            raise ModelError(f"the model's output {name} is {list(value.shape)}, where its contract (end_to_end) "
                             f"needs {expected}: one row per detection, as many as scores; check the model's export")


class EndToEnd(Contract):
    """Threshold, cap per image, undo the resize/letterbox and clip, on the outputs' device. The
    outputs' count N is data-dependent, so this syncs with the host once (a boolean mask)."""

    name = "end_to_end"
    outputs = {"boxes": 2, "scores": 1, "batch_index": 1}
    optional = {"labels": 1, "landmarks": 2}
    order = 10
    own_nms = True

    def __init__(self, *, num_landmarks: int):
        self.num_landmarks = num_landmarks

    @classmethod
    def from_config(cls, model, config, *, device, input_hw) -> EndToEnd:
        return cls(num_landmarks=landmark_points(model.outputs, config.model.landmarks, model.path))

    def __call__(self, outputs: dict[str, torch.Tensor], meta: torch.Tensor, *, num_images: int,
                 thresholds: Thresholds) -> DeviceDetections:
        """num_images: rows of the batch that are real images (the rest pad the batch)."""
        check_lengths(outputs, {"boxes": 4, **({"landmarks": 2 * self.num_landmarks} if self.num_landmarks else {})})
        scores = outputs["scores"].float()
        meta = meta.to(scores.device)
        batch = meta.shape[0]
        image = outputs["batch_index"].long()
        inside = (image >= 0) & (image < batch)
        image = torch.where(inside, image, batch)  # a row outside the batch: counted apart, never kept or indexed
        labels = outputs["labels"].long() if "labels" in outputs else torch.zeros_like(image)
        # Order by (image, score desc); rank within each image; keep score >= threshold and rank < cap.
        # Rows below the threshold sort after those above it, so the rank counts kept rows first.
        order = torch.argsort(scores, descending=True, stable=True)
        order = order[torch.argsort(image[order], stable=True)]
        counts = torch.bincount(image, minlength=batch + 1)
        first_row = torch.cumsum(counts, 0) - counts
        rank = torch.arange(len(order), device=scores.device) - first_row[image[order]]
        keep = (scores[order] >= thresholds.score_threshold) & (rank < thresholds.max_detections)
        keep &= image[order] < num_images
        rows = order[keep]  # a boolean mask: one sync for the count
        outside = int(counts[batch])  # its count came with that sync
        if outside:
            raise BadModelOutput(f"the model's batch_index output holds {outside} values outside 0..{batch - 1} (this "
                                 f"batch's images)")
        landmarks = None
        if self.num_landmarks:
            landmarks = to_original(outputs["landmarks"][rows].reshape(-1, self.num_landmarks, 2), image[rows], meta)
        boxes = to_original(outputs["boxes"][rows].reshape(-1, 2, 2), image[rows], meta).reshape(-1, 4)
        return DeviceDetections(batch_index=image[rows], boxes_xyxy=boxes, scores=scores[rows], labels=labels[rows],
                                landmarks=landmarks)
