"""retinanet_heads: torchvision RetinaNet's heads, its postprocess batched over the images on the
device; the anchor layout comes from the model's metadata (scripts/export_retinanet.py writes it)."""

from __future__ import annotations

import json

import torch

from ..errors import ModelError
from ..kernels import compile_ahead, row_max
from ..nms import exact_nms, top_nms
from ..postprocess import BlockReader, Compiled, GraphCache, PackedDetections, Thresholds, maybe_compiled, \
    pack_detections, real_images
from . import Contract


RETINANET_METADATA = "gpudet.retinanet"


def decode_box_deltas(deltas: torch.Tensor, anchors: torch.Tensor, weights: tuple[float, float, float, float],
                      clip: float) -> torch.Tensor:
    """torchvision's BoxCoder.decode_single on [..., 4] (any leading dims): deltas (dx, dy, dw, dh)
    against anchors x1y1x2y2 -> boxes x1y1x2y2. dw, dh are clamped at `clip` (log(1000/16)).
    Weights are Python floats, so the same code runs eagerly, in a CUDA graph and in an ONNX trace
    (scripts/export_retinanet.py) on any device."""
    # x and y side by side ([..., 2] pairs): the same arithmetic as torchvision's, per coordinate,
    # in about half the ops (each op is a kernel launch in ORT and in eager torch).
    wx, wy, ww, wh = weights
    size = anchors[..., 2:] - anchors[..., :2]
    center = anchors[..., :2] + 0.5 * size
    shift = per_axis(deltas[..., :2], wx, wy)
    scale = per_axis(deltas[..., 2:], ww, wh).clamp(max=clip)
    pred_center, half = shift * size + center, 0.5 * torch.exp(scale) * size
    return torch.cat([pred_center - half, pred_center + half], dim=-1)


def per_axis(pairs: torch.Tensor, x: float, y: float) -> torch.Tensor:
    """pairs [..., 2] divided by (x, y), Python floats (no tensor to copy to the device, which a
    CUDA graph capture would refuse): one op when they are equal, as in torchvision's RetinaNet."""
    if x == y:
        return pairs / x
    return torch.stack([pairs[..., 0] / x, pairs[..., 1] / y], dim=-1)


class RetinaNetHeads(Contract):
    """Postprocess for torchvision-style RetinaNet heads, batched over the images on the device.

        cls_logits       [B, A, K]  per anchor and class, before the sigmoid
        bbox_regression  [B, A, 4]  BoxCoder deltas (dx, dy, dw, dh) against the anchors

    The same steps as torchvision's `RetinaNet.postprocess_detections`, with no per-image loop:
    per level, the top `topk_candidates` logits of each image (sigmoid only on the winners) ->
    score > threshold -> decode (dw, dh clamped at log(1000/16)) -> clip to the input -> greedy
    per-class NMS (nms.top_nms: exact, no host sync unless the first 1,024 candidates of some image
    do not settle it) -> best `max_detections` per image.

    Everything up to the final rows, packed per image in original pixels, has static shapes and no
    host sync, so on a GPU it runs as one CUDA graph (GraphCache); the host reads the rows once.

    The anchor layout comes from the model's metadata (`gpudet.retinanet`, written by
    scripts/export_retinanet.py); the anchors are built once, on the device.
    """

    name = "retinanet_heads"
    outputs = {"cls_logits": 3, "bbox_regression": 3}
    order = 30
    captured = True

    def __init__(self, *, layout: dict, device: torch.device, nms_prefix: int = 1024, cuda_graphs: bool = True,
                 compile: bool = False):
        self.device = device
        self.topk = int(layout["topk_candidates"])
        self.box_clip = float(layout["box_clip"])
        self.input_hw = tuple(layout["input_hw"])
        self.level_sizes = [g[0] * g[1] * len(c) for g, c in zip(layout["grids"], layout["cell_anchors"])]
        self.nms_prefix = nms_prefix
        parts = []
        for (rows, cols), (stride_h, stride_w), cell in zip(layout["grids"], layout["strides"],
                                                             layout["cell_anchors"]):
            ys, xs = torch.meshgrid(torch.arange(rows, device=device) * stride_h,
                                    torch.arange(cols, device=device) * stride_w, indexing="ij")
            shifts = torch.stack([xs.reshape(-1), ys.reshape(-1), xs.reshape(-1), ys.reshape(-1)], dim=1).float()
            cell = torch.tensor(cell, dtype=torch.float32, device=device)
            parts.append((shifts[:, None, :] + cell[None]).reshape(-1, 4))
        self.anchors = torch.cat(parts)  # [A, 4] x1y1x2y2, torchvision's AnchorGenerator order
        # Level l's anchors as row l of a [L, W] grid (W: the largest level), padded with index A.
        grid, start = torch.full((len(self.level_sizes), max(self.level_sizes)), len(self.anchors)), 0
        for row, n in enumerate(self.level_sizes):
            grid[row, :n] = torch.arange(start, start + n)
            start += n
        self.level_grid = grid.to(device)
        self.box_weights = tuple(float(w) for w in layout["box_weights"])  # wx wy ww wh
        height, width = self.input_hw
        self.box_limits = torch.tensor([width, height, width, height], dtype=torch.float32, device=device)
        self.graphs = GraphCache(device)
        self.graphs.enabled &= cuda_graphs
        self.reader = BlockReader()
        self._packed = maybe_compiled(self.packed, device, compile)

    @classmethod
    def from_config(cls, model, config, *, device, input_hw) -> RetinaNetHeads:
        if RETINANET_METADATA not in model.metadata:
            raise ModelError(f"{model.path}: a retinanet_heads model needs its anchor layout in the metadata key "
                             f"{RETINANET_METADATA!r}; export it with scripts/export_retinanet.py")
        return cls(layout=json.loads(model.metadata[RETINANET_METADATA]), device=device,
                   compile=config.postprocess.compile)

    def compile_ahead(self, outputs: dict[str, tuple[torch.dtype, tuple]]) -> None:
        """Start compiling the Triton kernels this postprocess launches on a GPU (the best class
        per anchor over cls_logits' classes, NMS; kernels.compile_ahead). outputs: the model's
        outputs by name, (dtype, shape). Not under postprocess.compile, whose inductor writes
        kernels of its own."""
        if isinstance(self._packed, Compiled):
            return
        dtype, shape = outputs["cls_logits"]
        compile_ahead(self.device, row_max_inputs=[(dtype, shape[-1])] if isinstance(shape[-1], int) else [])

    def candidates(self, logits: torch.Tensor, regression: torch.Tensor):
        """Per image, the top-k of every level, best first: scores [B, C], labels [B, C],
        boxes [B, C, 4] x1y1x2y2 clipped to the input (C = levels x min(topk, W x K), W the
        largest level's anchors). A level with fewer than topk (anchor, class) pairs fills its
        share with score 0, which no threshold keeps."""
        batch, anchors, num_classes = logits.shape
        if anchors != len(self.anchors):
            raise ModelError(f"cls_logits has {anchors} anchors; the metadata's layout makes {len(self.anchors)}")
        levels, width = self.level_grid.shape
        # The top k (anchor, class) pairs of a level lie on its k anchors of highest best-class
        # score (an anchor outside those has its best score below k others', so all its pairs
        # rank below k pairs): top-k over anchors, then over their k x K pairs, instead of one
        # top-k over 8.2 M pairs per image at P3 (800 px). All levels in one call each: level l
        # is row l of the [L, W] grid, padded with a sentinel anchor (index A) scored -inf.
        best_class = row_max(logits)  # [B, A]: amax(dim=2), a Triton kernel on a GPU
        best_class = torch.cat([best_class, best_class.new_full((batch, 1), float("-inf"))], dim=1)
        k = min(self.topk, width)
        _, at = best_class[:, self.level_grid].topk(k, dim=2, sorted=False)  # [B, L, k] grid columns
        anchor = self.level_grid.expand(batch, -1, -1).gather(2, at)  # [B, L, k] anchors (A: padding)
        real = anchor.clamp(max=anchors - 1).reshape(batch, -1)
        pairs = logits.gather(1, real[..., None].expand(-1, -1, num_classes)).reshape(batch, levels, k, num_classes)
        pairs = pairs.masked_fill((anchor == anchors)[..., None], float("-inf"))
        top, at = pairs.reshape(batch, levels, k * num_classes).topk(min(self.topk, k * num_classes), dim=2,
                                                                     sorted=False)
        anchor = anchor.gather(2, at // num_classes).reshape(batch, -1).clamp(max=anchors - 1)
        scores, order = top.reshape(batch, -1).float().sigmoid().sort(dim=1, descending=True)
        anchor, labels = anchor.gather(1, order), (at % num_classes).reshape(batch, -1).gather(1, order)
        deltas = regression.gather(1, anchor[..., None].expand(-1, -1, 4)).float()
        boxes = decode_box_deltas(deltas, self.anchors[anchor], self.box_weights, self.box_clip)
        return scores, labels, torch.minimum(boxes.clamp(min=0), self.box_limits)

    def kept(self, logits: torch.Tensor, regression: torch.Tensor, num_images: torch.Tensor, *,
             score_threshold: float, iou_threshold: float, max_detections: int):
        """The static-shape part: candidates and top_nms's kept mask; num_images: [] int64 tensor.
        Returns (scores, labels, boxes, valid, keep, settled), all on the device."""
        scores, labels, boxes = self.candidates(logits, regression)
        valid = scores > score_threshold  # torchvision keeps score > threshold
        valid &= real_images(len(valid), num_images, valid.device)
        keep, settled = top_nms(boxes, scores, labels, valid, iou_threshold=iou_threshold, max_kept=max_detections,
                                prefix=self.nms_prefix)
        return scores, labels, boxes, valid, keep, settled

    def packed(self, logits: torch.Tensor, regression: torch.Tensor, num_images: torch.Tensor, meta: torch.Tensor, *,
               max_detections: int, **options):
        """kept, then the final rows packed for the host (pack_rows; flag: settled). Returns the
        block and kept's tensors (for the exact path of an unsettled image)."""
        scores, labels, boxes, valid, keep, settled = self.kept(logits, regression, num_images,
                                                                max_detections=max_detections, **options)
        block = pack_detections(scores, labels, boxes, keep, settled, meta, max_detections)
        return block, (scores, labels, boxes, valid, keep)

    def __call__(self, outputs: dict[str, torch.Tensor], meta: torch.Tensor, *, num_images: int,
                 thresholds: Thresholds) -> PackedDetections:
        logits, regression = outputs["cls_logits"], outputs["bbox_regression"]
        max_detections = thresholds.max_detections
        block, (scores, labels, boxes, valid, keep) = self.graphs(
            self._packed, (logits, regression), (torch.tensor(num_images), meta),
            score_threshold=thresholds.score_threshold, iou_threshold=thresholds.iou_threshold,
            max_detections=max_detections)

        def settle(images: list[int]) -> torch.Tensor:
            """The block with `images` done exactly: they need more than the graph's prefix or steps."""
            exact = exact_nms(boxes, scores, labels, valid, iou_threshold=thresholds.iou_threshold,
                              max_kept=max_detections, images=images, keep=keep)
            return pack_detections(scores, labels, boxes, exact, torch.ones_like(valid[:, 0]), meta.to(block.device),
                                   max_detections)

        return PackedDetections(block=block, num_landmarks=0, num_images=num_images, reader=self.reader,
                                settle=settle)
