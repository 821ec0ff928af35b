"""set_prediction: DETR-family models (RT-DETR, DETR, D-FINE, ...), which predict a set of
queries and need no NMS:

    logits      [B, Q, K]   per query and class (DETR: K includes its last, "no object" class)
    pred_boxes  [B, Q, 4]   centre x, centre y, width, height over the model input's width and height

Recognised by those names (transformers' exports), or as the two rank-3 outputs of one Q whose
last sizes are 4 and K. Ultralytics' RT-DETR export (its metadata names the RTDETRDecoder head)
writes one output instead, its queries' boxes as above, then

    [B, Q, 6]     score, class: the decoder's best (query, class) pairs (Ultralytics 8.4 on)
 or [B, Q, 4+K]   each class's probability: a query's best class is its (Ultralytics 8.3)

and is scored as Ultralytics' RTDETRPredictor does. The two outputs' scores are as
model.score_activation says: sigmoid (RT-DETR and its focal-loss kin: the best `Q` (query, class)
pairs over all classes, as transformers' RT-DETR postprocess takes them) or softmax (DETR: each
query's best class but the last). Static shapes and no host sync up
to the packed rows: on a GPU, one CUDA graph per output buffer where the export's shapes are static.
"""

from __future__ import annotations

import torch

from ..postprocess import BlockReader, GraphCache, PackedDetections, Thresholds, pack_detections, real_images
from ..session import TensorSpec
from . import Contract, static_outputs


MAX_QUERIES = 1000
"""Two unnamed outputs [B, Q, K] and [B, Q, 4] with more rows than this are a dense detector's
heads (RetinaNet's 120,087 anchors), not a set of queries (DETR's 100, RT-DETR's 300)."""


def ultralytics_rtdetr(metadata: dict[str, str]) -> bool:
    """An Ultralytics RT-DETR export (its one output: queries' boxes and scores), by its metadata."""
    return metadata.get("head") == "RTDETRDecoder" or \
        "rtdetr" in metadata.get("description", "").lower().replace("-", "")


def pair(outputs) -> tuple | None:
    """(logits, boxes) of `outputs` (TensorSpecs, or a dict of tensors), by name, or by shape with
    at most MAX_QUERIES queries."""
    items = list(outputs.items()) if isinstance(outputs, dict) else [(s.name, s) for s in outputs]
    by_name = dict(items)
    if "logits" in by_name and "pred_boxes" in by_name:
        return by_name["logits"], by_name["pred_boxes"]
    if len(items) != 2:
        return None
    (_, a), (_, b) = items
    if len(a.shape) != 3 or len(b.shape) != 3 or a.shape[1] != b.shape[1] or not isinstance(a.shape[1], int) \
            or a.shape[1] > MAX_QUERIES:
        return None
    if b.shape[2] == 4 and a.shape[2] != 4:
        return a, b
    if a.shape[2] == 4 and b.shape[2] != 4:
        return b, a
    return None


class SetPrediction(Contract):
    """Scores from the logits, the best pairs per image, boxes to model-input pixels, packed with
    the resize/letterbox undone and clipped, on the outputs' device; one host sync (the rows' copy)."""

    name = "set_prediction"
    outputs = {}
    order = 60
    own_nms = True
    captured = True

    def __init__(self, *, activation: str, input_hw: tuple[int, int], device: torch.device,
                 cuda_graphs: bool = True, rows: bool = False):
        self.activation, self.rows_layout = activation, rows
        height, width = input_hw
        self.box_scale = torch.tensor([width, height, width, height], dtype=torch.float32, device=device)
        self.graphs = GraphCache(device)
        self.graphs.enabled &= cuda_graphs
        self.reader = BlockReader()

    @classmethod
    def why(cls, outputs: list[TensorSpec], metadata: dict[str, str] | None = None) -> str:
        if cls.rows(outputs, metadata or {}):
            return f"its one output {outputs[0].describe()} and its metadata (Ultralytics' RT-DETR decoder)"
        logits, boxes = pair(outputs)
        return f"its outputs {logits.describe()} (logits) and {boxes.describe()} (boxes), a set of queries"

    @classmethod
    def rows(cls, outputs: list[TensorSpec], metadata: dict[str, str]) -> bool:
        """Ultralytics' layout: one output [B, Q, 6] or [B, Q, 4+K]."""
        return len(outputs) == 1 and len(outputs[0].shape) == 3 and ultralytics_rtdetr(metadata)

    @classmethod
    def fits(cls, outputs: list[TensorSpec], metadata: dict[str, str] | None = None) -> bool:
        if cls.rows(outputs, metadata or {}):
            return True
        found = pair(outputs)
        return found is not None and len(found[0].shape) == 3 and len(found[1].shape) == 3 and found[1].shape[2] == 4

    @classmethod
    def expected(cls) -> str:
        return (f"{cls.name}: logits [B, Q, K] and pred_boxes [B, Q, 4] (normalised centre x, y, width, height), or "
                "Ultralytics' RT-DETR export (one output [B, Q, 6], its metadata naming RTDETRDecoder)")

    @classmethod
    def from_config(cls, model, config, *, device, input_hw) -> SetPrediction:
        return cls(activation=config.model.score_activation, input_hw=input_hw, device=device,
                   cuda_graphs=static_outputs(model), rows=cls.rows(model.outputs, model.metadata))

    def packed(self, logits: torch.Tensor, cxcywh: torch.Tensor, num_images: torch.Tensor, meta: torch.Tensor, *,
               score_threshold: float, max_detections: int) -> torch.Tensor:
        """The rows packed for the host (pack_detections); num_images: [] int64 tensor."""
        logits = logits.float()
        batch, queries, classes = logits.shape
        if self.rows_layout:  # Ultralytics' RT-DETR: probabilities, each query its best class
            scores, labels = (logits[..., 0], logits[..., 1].long()) if classes == 2 else logits.max(dim=-1)
            query = torch.arange(queries, device=logits.device).expand(batch, queries)
        elif self.activation == "softmax":  # DETR: the last class is "no object"
            scores, labels = logits.softmax(dim=-1)[..., :-1].max(dim=-1)
            query = torch.arange(queries, device=logits.device).expand(batch, queries)
        else:  # the best Q (query, class) pairs of the image, over every class
            top, flat = logits.sigmoid().flatten(1).topk(queries, dim=1)
            scores, labels, query = top, flat % classes, flat // classes
        order = torch.argsort(scores, dim=1, descending=True, stable=True)
        scores, labels, query = (torch.gather(t, 1, order) for t in (scores, labels, query))
        keep = (scores >= score_threshold) & real_images(batch, num_images, logits.device)
        centre, size = cxcywh.float().gather(1, query[..., None].expand(-1, -1, 4)).split(2, dim=-1)
        corners = torch.cat([centre - size / 2, centre + size / 2], dim=-1) * self.box_scale  # [B, Q, 4]
        return pack_detections(scores, labels, corners, keep, torch.ones_like(keep[:, 0]), meta, max_detections)

    def __call__(self, outputs: dict[str, torch.Tensor], meta: torch.Tensor, *, num_images: int,
                 thresholds: Thresholds) -> PackedDetections:
        if self.rows_layout:
            (rows,) = outputs.values()
            buffers = (rows[..., 4:], rows[..., :4])  # (scores, boxes)
        else:
            buffers = pair(outputs)
        block = self.graphs(self.packed, buffers, (torch.tensor(num_images), meta),
                            score_threshold=thresholds.score_threshold, max_detections=thresholds.max_detections)
        return PackedDetections(block=block, num_landmarks=0, num_images=num_images, reader=self.reader,
                                settle=lambda images: block)  # no NMS: every image is settled
