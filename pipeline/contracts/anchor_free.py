"""anchor_free: YOLO-family detect heads as `yolo export format=onnx` writes them, decoded, no NMS
in the graph:

    one output  [B, 4+K, N]   YOLOv8/11 (and YOLOv5u): centre x, centre y, width, height in
                              model-input pixels, then K class scores, for each of N positions
 or             [B, N, 5+K]   YOLOv5/v7: the same per row, with an objectness score after the box

model.objectness says which (auto: [B, N, C] has it, [B, C, N] has not). Each position's best
class, the best postprocess.pre_nms_top_k positions per image over the threshold, then greedy
per-class NMS on the device (nms.top_nms; exact_nms for an image it does not settle), at most
max_detections per image.
"""

from __future__ import annotations

import torch

from ..nms import exact_nms, top_nms
from ..postprocess import DeviceDetections, Thresholds, to_original
from ..session import TensorSpec
from . import Contract


def channels_first(shape: tuple) -> bool | None:
    """[B, C, N] (True) or [B, N, C] (False) for a head's output shape, by which of its sizes is the
    smaller (a dynamic one is N); None for a shape no head has."""
    if len(shape) != 3:
        return None
    c1, c2 = shape[1], shape[2]
    if isinstance(c1, int) and (not isinstance(c2, int) or c1 < c2):
        return True if c1 >= 5 else None
    if isinstance(c2, int) and c2 >= 5:
        return False
    return None


def ultralytics_head(metadata: dict[str, str]) -> bool:
    """An Ultralytics export of a detect head with no NMS in its graph (its metadata_props say so),
    whose output's sizes may all be symbolic."""
    return metadata.get("task") == "detect" and metadata.get("end2end", "False") != "True" and \
        "'nms': True" not in metadata.get("args", "")


class AnchorFree(Contract):
    """Decode, top-k, per-class NMS and the cap, on the outputs' device; host syncs: the images
    top_nms did not settle (rare), and the count of rows kept."""

    name = "anchor_free"
    outputs = {}
    order = 70

    def __init__(self, *, first: bool, objectness: bool, pre_nms_top_k: int):
        self.first, self.objectness, self.pre_nms_top_k = first, objectness, pre_nms_top_k

    @classmethod
    def fits(cls, outputs: list[TensorSpec], metadata: dict[str, str] | None = None) -> bool:
        return len(outputs) == 1 and len(outputs[0].shape) == 3 and (
            channels_first(outputs[0].shape) is not None or ultralytics_head(metadata or {}))

    @classmethod
    def why(cls, outputs: list[TensorSpec], metadata: dict[str, str] | None = None) -> str:
        (head,) = outputs
        if channels_first(head.shape) is None:
            return f"its one output {head.describe()} and its metadata (Ultralytics' task detect, not end-to-end)"
        return f"its one output {head.describe()}, a head's [B, C, N] or [B, N, C]"

    @classmethod
    def expected(cls) -> str:
        return f"{cls.name}: one output [B, 4+K, N] (YOLOv8/11) or [B, N, 5+K] (YOLOv5/v7)"

    @classmethod
    def from_config(cls, model, config, *, device, input_hw) -> AnchorFree:
        first = channels_first(model.outputs[0].shape)
        if first is None:  # its sizes are not declared: an Ultralytics export's head, [B, 4+K, N]
            first = True
        objectness = config.model.objectness
        return cls(first=first, objectness=(not first) if objectness == "auto" else bool(objectness),
                   pre_nms_top_k=config.postprocess.pre_nms_top_k)

    def candidates(self, head: torch.Tensor, num_images: int, score_threshold: float):
        """Each image's best positions, best first: boxes [B, k, 4] x1y1x2y2, scores, labels,
        valid [B, k] (over the threshold, a real image)."""
        rows = head.float().transpose(1, 2) if self.first else head.float()  # [B, N, C]
        scores = rows[..., 5:] * rows[..., 4:5] if self.objectness else rows[..., 4:]
        best, labels = scores.max(dim=-1)
        top, index = best.topk(min(self.pre_nms_top_k, best.shape[1]), dim=1)
        cxcywh = torch.gather(rows[..., :4], 1, index[..., None].expand(-1, -1, 4))
        centre, size = cxcywh.split(2, dim=-1)
        boxes = torch.cat([centre - size / 2, centre + size / 2], dim=-1)
        valid = top >= score_threshold
        valid[num_images:] = False
        return boxes, top, torch.gather(labels, 1, index), valid

    def __call__(self, outputs: dict[str, torch.Tensor], meta: torch.Tensor, *, num_images: int,
                 thresholds: Thresholds) -> DeviceDetections:
        (head,) = outputs.values()
        meta = meta.to(head.device)
        boxes, scores, labels, valid = self.candidates(head, num_images, thresholds.score_threshold)
        keep, settled = top_nms(boxes, scores, labels, valid, iou_threshold=thresholds.iou_threshold,
                                max_kept=thresholds.max_detections)
        unsettled = (~settled[:num_images]).nonzero().flatten().tolist()
        if unsettled:
            keep = exact_nms(boxes, scores, labels, valid, iou_threshold=thresholds.iou_threshold,
                             max_kept=thresholds.max_detections, images=unsettled, keep=keep)
        image, column = keep.nonzero(as_tuple=True)  # one sync: the count
        found = to_original(boxes[image, column].reshape(-1, 2, 2), image, meta).reshape(-1, 4)
        return DeviceDetections(batch_index=image, boxes_xyxy=found, scores=scores[image, column],
                                labels=labels[image, column].long(), landmarks=None)
