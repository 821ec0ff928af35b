"""A contract of one's own, in one file: a toy model whose outputs are dense, boxes [B, M, 4]
(x1 y1 x2 y2, model-input pixels) and scores [B, M], every row a detection, no NMS. It plugs in
as model.contract: toy_contract:DenseBoxes (this folder on PYTHONPATH)."""

from __future__ import annotations

import torch

from pipeline.contracts import Contract
from pipeline.postprocess import DeviceDetections, to_original


class DenseBoxes(Contract):
    name = "dense_boxes"
    outputs = {"boxes": 3, "scores": 2}

    @classmethod
    def from_config(cls, model, config, *, device, input_hw) -> DenseBoxes:
        return cls()

    def __call__(self, outputs, meta, *, num_images, thresholds) -> DeviceDetections:
        boxes, scores = outputs["boxes"].float(), outputs["scores"].float()
        rank = scores.argsort(dim=1, descending=True).argsort(dim=1)  # each row's place in its image, best first
        keep = (scores >= thresholds.score_threshold) & (rank < thresholds.max_detections)
        keep[num_images:] = False
        image, row = keep.nonzero(as_tuple=True)  # one sync: the count
        order = torch.argsort(image * scores.shape[1] + rank[image, row])  # grouped by image, best first
        image, row = image[order], row[order]
        kept = to_original(boxes[image, row].reshape(-1, 2, 2), image, meta.to(boxes.device)).reshape(-1, 4)
        return DeviceDetections(batch_index=image, boxes_xyxy=kept, scores=scores[image, row],
                                labels=torch.zeros_like(image), landmarks=None)
