"""Postprocess, on the device: model outputs -> final detections in original image pixels.

The end-to-end contract (the default RetinaFace model, any model with in-graph NMS):
    boxes        [N, 4]  x1 y1 x2 y2 in model-input pixels
    scores       [N]
    batch_index  [N]     int, which image of the batch
    labels       [N]     int, optional (label 0 when absent)
    landmarks    [N, 2K] (x, y) pairs in model-input pixels, optional
N counts the detections of the whole batch. Raw-heads models are decoded and NMS'd here instead:
SsdHeads (loc/conf, RetinaFace) and RetinaNetHeads (cls_logits/bbox_regression, torchvision's
RetinaNet). Everything below runs in torch on the outputs' device; the one device-to-host copy
is of the final, thresholded detections, once per batch.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .engine import ModelError, TensorSpec, describe_io
from .nms import NMS_STEPS, batched_nms, exact_nms, top_nms

log = logging.getLogger("gpudet")

# name -> rank. Ranks are what contract detection checks; names are how outputs are found.
CONTRACTS = {
    "end_to_end": ({"boxes": 2, "scores": 1, "batch_index": 1}, {"labels": 1, "landmarks": 2}),
    "ssd_heads": ({"loc": 3, "conf": 3}, {"landmarks": 3}),
    "retinanet_heads": ({"cls_logits": 3, "bbox_regression": 3}, {}),
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


class GraphCache:
    """Runs a function with static shapes and no host sync from CUDA graphs, captured once per set
    of input buffers (the engine's output buffers, the same every batch) and replayed: the ~200
    small kernels of a heads postprocess become one launch (H200, RetinaNet batch 16: 5.6 ms per
    batch launched one by one, 3.6 ms replayed). The function's last positional argument is the
    number of real images, a [] int64 device tensor filled before each replay. Outputs are the
    graph's own tensors: valid until its next replay. On the CPU, or if a capture fails (logged
    once), the function simply runs."""

    def __init__(self, device: torch.device):
        self.device = device
        self.enabled = device.type == "cuda"
        self._graphs: dict[tuple, tuple] = {}

    def __call__(self, fn, tensors: tuple[torch.Tensor, ...], num_images: int, **options):
        if self.enabled:
            try:
                return self._replay(fn, tensors, num_images, options)
            except RuntimeError as e:  # a capture this torch/driver refuses: run the kernels one by one
                log.warning("postprocess: CUDA graph capture failed, running without (%s)", e)
                self.enabled = False
        return fn(*tensors, torch.tensor(num_images, device=self.device), **options)

    def _replay(self, fn, tensors, num_images: int, options: dict):
        buffers = tuple((t.data_ptr(), t.shape, t.dtype) for t in tensors)
        key = (fn.__qualname__, buffers, tuple(sorted(options.items())))
        if key not in self._graphs:
            count = torch.zeros((), dtype=torch.int64, device=self.device)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up outside the capture (allocations, library handles)
                for _ in range(2):
                    fn(*tensors, count, **options)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: ORT and DALI keep working on their own threads and streams meanwhile.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                outputs = fn(*tensors, count, **options)
            self._graphs[key] = (graph, count, outputs)
        graph, count, outputs = self._graphs[key]
        count.fill_(num_images)
        graph.replay()
        return outputs


class Compiled:
    """torch.compile(fn) (static shapes, one graph) for use inside GraphCache: compiles on its first
    call, which GraphCache makes outside the capture; where compiling fails, logs why once and runs
    fn as it is from then on."""

    def __init__(self, fn):
        self.fn, self.__qualname__ = fn, f"{fn.__qualname__}[compiled]"
        self.compiled = torch.compile(fn, fullgraph=True, dynamic=False)

    def __call__(self, *args, **kwargs):
        if self.compiled is not None:
            try:
                return self.compiled(*args, **kwargs)
            except Exception as e:  # no Triton, no C compiler for its launcher, an op it cannot trace
                log.warning("postprocess: torch.compile failed, running the plain kernels (%s: %s)",
                            type(e).__name__, str(e).splitlines()[0][:300] if str(e) else "")
                self.compiled = None
        return self.fn(*args, **kwargs)


def maybe_compiled(fn, device: torch.device, compile: bool):
    return Compiled(fn) if compile and device.type == "cuda" else fn


class SsdHeads:
    """Postprocess for raw SSD-style heads (RetinaFace): decode, top-k, NMS, all batched on the device.

        loc        [B, A, 4]   SSD box coding against anchors (cx, cy, w, h in input pixels)
        conf       [B, A, 2]   softmax scores; class 1 is the object
        landmarks  [B, A, 2K]  optional, coded like the box centers

    The anchors are made once per input size on the device. Only the top `pre_nms_top_k`
    candidates per image are decoded; NMS is batched_nms (exact greedy, no host sync).
    """

    def __init__(self, *, strides: list[int], sizes: list[list[float]], variances: list[float],
                 pre_nms_top_k: int, device: torch.device, compile: bool = False):
        self.strides, self.sizes, self.variances = strides, sizes, variances
        self.pre_nms_top_k = pre_nms_top_k
        self.device = device
        self._anchors: dict[tuple[int, int], torch.Tensor] = {}
        self.graphs = GraphCache(device)
        self._kept = maybe_compiled(self.kept, device, compile)

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

    def kept(self, loc: torch.Tensor, conf: torch.Tensor, num_images: torch.Tensor, *, input_hw: tuple[int, int],
             score_threshold: float, iou_threshold: float, max_detections: int, max_iterations: int):
        """The static-shape part: top-k, decode, NMS. num_images: [] int64 tensor. Returns scores
        [B, k], index [B, k] (anchors), boxes [B, k, 4] x1y1x2y2 input pixels, keep [B, k] (capped
        at max_detections per image) and converged [B], all on the device."""
        anchors = self.anchors(*input_hw)
        scores_all = conf[..., 1].float()  # [B, A]
        scores, index = scores_all.topk(min(self.pre_nms_top_k, scores_all.shape[1]), dim=1)  # best first
        valid = scores > score_threshold  # the reference keeps score > threshold
        valid &= torch.arange(len(valid), device=valid.device)[:, None] < num_images
        prior = anchors[index]  # [B, k, 4]
        center_var, size_var = self.variances
        coded = loc.float().gather(1, index[..., None].expand(-1, -1, 4))
        centers = prior[..., :2] + coded[..., :2] * center_var * prior[..., 2:]
        wh = prior[..., 2:] * torch.exp(coded[..., 2:] * size_var)
        boxes = torch.cat([centers - wh / 2, centers + wh / 2], dim=-1)
        keep, converged = batched_nms(boxes, scores, torch.zeros_like(index), valid, iou_threshold=iou_threshold,
                                      max_iterations=max_iterations)
        keep &= torch.cumsum(keep, dim=1) <= max_detections  # best first, so this caps per image
        return scores, index, boxes, keep, converged

    def __call__(self, outputs: dict[str, torch.Tensor], meta: torch.Tensor, *, input_hw: tuple[int, int],
                 score_threshold: float, iou_threshold: float, max_detections: int, num_landmarks: int,
                 num_images: int | None = None,
                 max_iterations: int = NMS_STEPS) -> tuple[DeviceDetections, torch.Tensor]:
        """Final detections on the device, and per image whether NMS converged within max_iterations."""
        options = dict(input_hw=tuple(input_hw), score_threshold=score_threshold, iou_threshold=iou_threshold,
                       max_detections=max_detections, max_iterations=max_iterations)
        num_images = len(outputs["loc"]) if num_images is None else num_images
        if max_iterations > NMS_STEPS:  # the rare exact rerun (detector): not worth a graph of its own
            count = torch.tensor(num_images, device=self.device)
            scores, index, boxes, keep, converged = self.kept(outputs["loc"], outputs["conf"], count, **options)
        else:
            scores, index, boxes, keep, converged = self.graphs(self._kept, (outputs["loc"], outputs["conf"]),
                                                                num_images, **options)
        image, slot = keep.nonzero(as_tuple=True)  # one sync for the count; rows by image, then score
        landmarks = None
        if num_landmarks:
            center_var = self.variances[0]
            coded = outputs["landmarks"][image, index[image, slot]].float().reshape(-1, num_landmarks, 2)
            p = self.anchors(*input_hw)[index[image, slot]]
            landmarks = to_original(p[:, None, :2] + coded * center_var * p[:, None, 2:], image, meta)
        found = DeviceDetections(batch_index=image, boxes_xyxy=to_original(boxes[image, slot].reshape(-1, 2, 2), image,
                                                                           meta).reshape(-1, 4),
                                 scores=scores[image, slot], labels=torch.zeros_like(image), landmarks=landmarks)
        return found, converged


RETINANET_METADATA = "gpudet.retinanet"


def decode_box_deltas(deltas: torch.Tensor, anchors: torch.Tensor, weights: tuple[float, float, float, float],
                      clip: float) -> torch.Tensor:
    """torchvision's BoxCoder.decode_single on [..., 4] (any leading dims): deltas (dx, dy, dw, dh)
    against anchors x1y1x2y2 -> boxes x1y1x2y2. dw, dh are clamped at `clip` (log(1000/16)).
    Weights are Python floats, so the same code runs eagerly, in a CUDA graph and in an ONNX trace
    (scripts/export_retinanet.py) on any device."""
    widths, heights = anchors[..., 2] - anchors[..., 0], anchors[..., 3] - anchors[..., 1]
    ctr_x, ctr_y = anchors[..., 0] + 0.5 * widths, anchors[..., 1] + 0.5 * heights
    wx, wy, ww, wh = weights
    dx, dy = deltas[..., 0] / wx, deltas[..., 1] / wy
    dw, dh = (deltas[..., 2] / ww).clamp(max=clip), (deltas[..., 3] / wh).clamp(max=clip)
    pred_ctr_x, pred_ctr_y = dx * widths + ctr_x, dy * heights + ctr_y
    half_w, half_h = 0.5 * torch.exp(dw) * widths, 0.5 * torch.exp(dh) * heights
    return torch.stack([pred_ctr_x - half_w, pred_ctr_y - half_h, pred_ctr_x + half_w, pred_ctr_y + half_h], dim=-1)


class RetinaNetHeads:
    """Postprocess for torchvision-style RetinaNet heads, batched over the images on the device.

        cls_logits       [B, A, K]  per anchor and class, before the sigmoid
        bbox_regression  [B, A, 4]  BoxCoder deltas (dx, dy, dw, dh) against the anchors

    The same steps as torchvision's `RetinaNet.postprocess_detections`, with no per-image loop:
    per level, the top `topk_candidates` logits of each image (sigmoid only on the winners) ->
    score > threshold -> decode (dw, dh clamped at log(1000/16)) -> clip to the input -> greedy
    per-class NMS (nms.top_nms: exact, no host sync unless the first 1,024 candidates of some image
    do not settle it) -> best `max_detections` per image.

    Everything up to the kept mask has static shapes and no host sync, so on a GPU it runs as a
    CUDA graph (GraphCache).

    The anchor layout comes from the model's metadata (`gpudet.retinanet`, written by
    scripts/export_retinanet.py); the anchors are built once, on the device.
    """

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
        self._kept = maybe_compiled(self.kept, device, compile)

    @classmethod
    def from_metadata(cls, metadata: dict[str, str], model_path: Path, device: torch.device,
                      compile: bool = False) -> RetinaNetHeads:
        if RETINANET_METADATA not in metadata:
            raise ModelError(f"{model_path}: a retinanet_heads model needs its anchor layout in the metadata key "
                             f"{RETINANET_METADATA!r}; export it with scripts/export_retinanet.py")
        return cls(layout=json.loads(metadata[RETINANET_METADATA]), device=device, compile=compile)

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
        best_class = logits.amax(dim=2)  # [B, A]
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
        valid &= torch.arange(len(valid), device=valid.device)[:, None] < num_images
        keep, settled = top_nms(boxes, scores, labels, valid, iou_threshold=iou_threshold, max_kept=max_detections,
                                prefix=self.nms_prefix)
        return scores, labels, boxes, valid, keep, settled

    def __call__(self, outputs: dict[str, torch.Tensor], meta: torch.Tensor, *, score_threshold: float,
                 iou_threshold: float, max_detections: int, num_images: int | None = None) -> DeviceDetections:
        logits, regression = outputs["cls_logits"], outputs["bbox_regression"]
        num_images = len(logits) if num_images is None else num_images
        scores, labels, boxes, valid, keep, settled = self.graphs(
            self._kept, (logits, regression), num_images, score_threshold=score_threshold, iou_threshold=iou_threshold,
            max_detections=max_detections)
        if not settled.all():  # one host check; the nonzero below syncs anyway
            unsettled = (~settled).nonzero()[:, 0].tolist()
            keep = exact_nms(boxes, scores, labels, valid, iou_threshold=iou_threshold, max_kept=max_detections,
                             images=unsettled, keep=keep)
        image, slot = keep.nonzero(as_tuple=True)  # rows by image, then score
        return DeviceDetections(batch_index=image, boxes_xyxy=to_original(boxes[image, slot].reshape(-1, 2, 2), image,
                                                                          meta).reshape(-1, 4),
                                scores=scores[image, slot], labels=labels[image, slot], landmarks=None)
