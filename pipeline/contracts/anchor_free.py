"""anchor_free: YOLO-family detect heads as `yolo export format=onnx` writes them, decoded, no NMS
in the graph:

    one output  [B, 4+K, N]   YOLOv8/11 (and YOLOv5u): centre x, centre y, width, height in
                              model-input pixels, then K class scores, for each of N positions
 or             [B, N, 5+K]   YOLOv5/v7: the same per row, with an objectness score after the box

model.objectness says which (auto: [B, N, C] has it, [B, C, N] has not). Each position's best
class, the best postprocess.pre_nms_top_k positions per image over the threshold, then greedy
per-class NMS on the device (nms.top_nms; exact_nms for an image it does not settle), at most
max_detections per image, packed for the host. Static shapes and no host sync up to the packed
rows: on a GPU, one CUDA graph per output buffer where the export's shapes are static
(`yolo export ... batch=16`, not `dynamic=True`, whose output ORT allocates anew each batch).
"""

from __future__ import annotations

import torch

from ..kernels import compile_ahead
from ..nms import exact_nms, top_nms
from ..postprocess import BlockReader, GraphCache, PackedDetections, Thresholds, pack_detections, real_images
from ..session import TensorSpec
from . import Contract, static_outputs
from .set_prediction import ultralytics_rtdetr


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
        "'nms': True" not in metadata.get("args", "") and not ultralytics_rtdetr(metadata)


class AnchorFree(Contract):
    """Decode, top-k, per-class NMS and the cap, on the outputs' device; host syncs: the copy of
    the packed rows, and the images top_nms did not settle (rare)."""

    name = "anchor_free"
    outputs = {}
    order = 70
    captured = True

    def __init__(self, *, first: bool, objectness: bool, pre_nms_top_k: int, device: torch.device,
                 cuda_graphs: bool = True, nms_prefix: int = 1024):
        self.first, self.objectness, self.pre_nms_top_k = first, objectness, pre_nms_top_k
        self.device, self.nms_prefix = device, nms_prefix
        self.graphs = GraphCache(device)
        self.graphs.enabled &= cuda_graphs
        self.reader = BlockReader()

    @classmethod
    def fits(cls, outputs: list[TensorSpec], metadata: dict[str, str] | None = None) -> bool:
        return len(outputs) == 1 and len(outputs[0].shape) == 3 and not ultralytics_rtdetr(metadata or {}) and (
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
                   pre_nms_top_k=config.postprocess.pre_nms_top_k, device=device, cuda_graphs=static_outputs(model))

    def compile_ahead(self, outputs: dict[str, tuple]) -> None:
        """Start compiling the Triton kernel NMS launches on a GPU (kernels.compile_ahead)."""
        compile_ahead(self.device)

    def candidates(self, head: torch.Tensor, num_images: torch.Tensor, score_threshold: float):
        """Each image's best positions, best first: boxes [B, k, 4] x1y1x2y2, scores, labels,
        valid [B, k] (over the threshold, a real image; num_images: [] int64 tensor)."""
        rows = head.float().transpose(1, 2) if self.first else head.float()  # [B, N, C]
        scores = rows[..., 5:] * rows[..., 4:5] if self.objectness else rows[..., 4:]
        best, labels = scores.max(dim=-1)
        top, index = best.topk(min(self.pre_nms_top_k, best.shape[1]), dim=1)
        cxcywh = torch.gather(rows[..., :4], 1, index[..., None].expand(-1, -1, 4))
        centre, size = cxcywh.split(2, dim=-1)
        boxes = torch.cat([centre - size / 2, centre + size / 2], dim=-1)
        valid = (top >= score_threshold) & real_images(len(top), num_images, top.device)
        return boxes, top, torch.gather(labels, 1, index), valid

    def packed(self, head: torch.Tensor, num_images: torch.Tensor, meta: torch.Tensor, *, score_threshold: float,
               iou_threshold: float, max_detections: int):
        """The static-shape part: candidates, top_nms, the rows packed (flag: settled). Returns the
        block and what exact_nms needs for an image it did not settle."""
        boxes, scores, labels, valid = self.candidates(head, num_images, score_threshold)
        keep, settled = top_nms(boxes, scores, labels, valid, iou_threshold=iou_threshold, max_kept=max_detections,
                                prefix=self.nms_prefix)
        return pack_detections(scores, labels, boxes, keep, settled, meta, max_detections), \
            (boxes, scores, labels, valid, keep)

    def __call__(self, outputs: dict[str, torch.Tensor], meta: torch.Tensor, *, num_images: int,
                 thresholds: Thresholds) -> PackedDetections:
        (head,) = outputs.values()
        block, (boxes, scores, labels, valid, keep) = self.graphs(
            self.packed, (head,), (torch.tensor(num_images), meta), score_threshold=thresholds.score_threshold,
            iou_threshold=thresholds.iou_threshold, max_detections=thresholds.max_detections)

        def settle(images: list[int]) -> torch.Tensor:
            """The block with `images` done exactly: they need more than top_nms's prefix or steps."""
            exact = exact_nms(boxes, scores, labels, valid, iou_threshold=thresholds.iou_threshold,
                              max_kept=thresholds.max_detections, images=images, keep=keep)
            return pack_detections(scores, labels, boxes, exact, torch.ones_like(valid[:, 0]), meta.to(block.device),
                                   thresholds.max_detections)

        return PackedDetections(block=block, num_landmarks=0, num_images=num_images, reader=self.reader,
                                settle=settle)
