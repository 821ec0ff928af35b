"""padded_end_to_end: NMS in the model's graph, each image's detections padded to M rows
(Ultralytics' `export(nms=True)`, YOLOv10's and YOLO26's end-to-end heads, TensorRT's EfficientNMS
layout):

    one output   [B, M, 6]    x1 y1 x2 y2 score class, model-input pixels
 or
    boxes        [B, M, 4]    x1 y1 x2 y2, model-input pixels
    scores       [B, M]
    labels       [B, M]       (or classes)
    num_dets     [B] or [B, 1]  optional: each image's rows that are detections

The padding is dropped on the device: the rows past num_dets, or, without it, those of score 0.
Static shapes and no host sync up to the packed rows: on a GPU, one CUDA graph per output buffer
where the export's shapes are static.
"""

from __future__ import annotations

import torch

from ..postprocess import BlockReader, GraphCache, PackedDetections, Thresholds, pack_detections, real_images
from ..session import TensorSpec
from . import Contract, static_outputs
from .set_prediction import ultralytics_rtdetr

MAX_PADDED_ROWS = 1000
"""A [B, M, 6] output with more rows than this is no padded list of detections but a dense head
(a single-class YOLOv5's [B, 25200, 6]): anchor_free's."""

LABELS = ("labels", "classes", "det_classes")
SCORES = ("scores", "det_scores")
BOXES = ("boxes", "det_boxes")
COUNTS = ("num_dets", "num_detections")


def named(outputs, names: tuple[str, ...]):
    """The first output (a TensorSpec, or a tensor in a dict) of one of these names, or None."""
    if isinstance(outputs, dict):
        return next((outputs[n] for n in names if n in outputs), None)
    return next((s for n in names for s in outputs if s.name == n), None)


class PaddedEndToEnd(Contract):
    """Drop the padding, threshold, cap per image (best first), undo the resize/letterbox and
    clip, on the outputs' device; one host sync (the rows' copy)."""

    name = "padded_end_to_end"
    outputs = {}
    order = 50
    own_nms = True
    captured = True

    def __init__(self, *, device: torch.device, cuda_graphs: bool = True):
        self.graphs = GraphCache(device)
        self.graphs.enabled &= cuda_graphs
        self.reader = BlockReader()

    @classmethod
    def fits(cls, outputs: list[TensorSpec], metadata: dict[str, str] | None = None) -> bool:
        return cls.layout(outputs) is not None and not ultralytics_rtdetr(metadata or {})  # its rows: set_prediction

    @classmethod
    def why(cls, outputs: list[TensorSpec], metadata: dict[str, str] | None = None) -> str:
        return ("its one output " + outputs[0].describe() if cls.layout(outputs) == "rows" else
                "its outputs " + ", ".join(s.describe() for s in outputs)) + ", detections padded per image"

    @classmethod
    def layout(cls, outputs: list[TensorSpec]) -> str | None:
        """"rows" for one [B, M, 6] output, "columns" for boxes, scores and labels; None otherwise."""
        if len(outputs) == 1:
            shape = outputs[0].shape
            rows = shape[1] if len(shape) == 3 else None
            if len(shape) == 3 and shape[2] == 6 and (not isinstance(rows, int) or rows <= MAX_PADDED_ROWS):
                return "rows"
            return None
        boxes, scores, labels = named(outputs, BOXES), named(outputs, SCORES), named(outputs, LABELS)
        if boxes is not None and scores is not None and labels is not None and len(boxes.shape) == 3 \
                and len(scores.shape) == 2 and len(labels.shape) == 2:
            return "columns"
        return None

    @classmethod
    def expected(cls) -> str:
        return (f"{cls.name}: one output [B, M, 6] (x1 y1 x2 y2 score class; M at most {MAX_PADDED_ROWS}), or boxes "
                "[B, M, 4], scores [B, M] and labels [B, M] (optional num_dets [B])")

    @classmethod
    def from_config(cls, model, config, *, device, input_hw) -> PaddedEndToEnd:
        return cls(device=device, cuda_graphs=static_outputs(model))

    def columns(self, outputs: dict[str, torch.Tensor]):
        """(boxes [B, M, 4], scores [B, M], labels [B, M], count [B] or None)."""
        if len(outputs) == 1:
            (rows,) = outputs.values()
            return rows[..., :4], rows[..., 4], rows[..., 5], None
        count = named(outputs, COUNTS)
        return (named(outputs, BOXES), named(outputs, SCORES), named(outputs, LABELS),
                None if count is None else count.reshape(-1))

    def packed(self, *tensors: torch.Tensor, score_threshold: float, max_detections: int) -> torch.Tensor:
        """The rows packed for the host (pack_detections). tensors: boxes, scores, labels, [count,]
        num_images [] int64, meta [B, 6]."""
        boxes, scores, labels, *count, num_images, meta = tensors
        scores = scores.float()
        batch, rows = scores.shape
        slot = torch.arange(rows, device=scores.device)
        present = slot[None] < count[0].to(scores.device).reshape(-1, 1).long() if count else scores > 0
        keep = present & (scores >= score_threshold) & real_images(batch, num_images, scores.device)
        order = torch.argsort(torch.where(keep, scores, float("-inf")), dim=1, descending=True, stable=True)
        return pack_detections(scores.gather(1, order), labels.gather(1, order),
                               boxes.float().gather(1, order[..., None].expand(-1, -1, 4)), keep.gather(1, order),
                               torch.ones_like(keep[:, 0]), meta, max_detections)

    def __call__(self, outputs: dict[str, torch.Tensor], meta: torch.Tensor, *, num_images: int,
                 thresholds: Thresholds) -> PackedDetections:
        buffers = tuple(t for t in self.columns(outputs) if t is not None)
        block = self.graphs(self.packed, buffers, (torch.tensor(num_images), meta),
                            score_threshold=thresholds.score_threshold, max_detections=thresholds.max_detections)
        return PackedDetections(block=block, num_landmarks=0, num_images=num_images, reader=self.reader,
                                settle=lambda images: block)  # NMS in the model: every image is settled
