"""Postprocess, on the device: model outputs -> final detections in original image pixels.

One call shape for every output contract (engine.CONTRACTS); what to keep is an argument of the
call, not of the constructor, so thresholds can change between streams without a new session:

    found = postprocess(outputs, meta, num_images=n, thresholds=Thresholds(...))
    found.to_host()      # the batch's one device-to-host copy -> results.Detections
    found.on_device()    # or: DeviceDetections, torch tensors on the device, no host copy

    EndToEnd        a model with in-graph NMS: boxes [N, 4], scores [N], batch_index [N],
                    optional labels [N], landmarks [N, 2K] (the embedded RetinaFace)
    SsdHeads        raw SSD heads: loc [B, A, 4], conf [B, A, 2], optional landmarks [B, A, 2K]
    RetinaNetHeads  torchvision-style heads: cls_logits [B, A, K], bbox_regression [B, A, 4]

meta is `image_meta`, [B, 6]: what maps model-input pixels back to each original image. The
heads postprocesses have static shapes and no host sync up to their final rows, so on a GPU they
run as one CUDA graph per set of engine output buffers (GraphCache), and the host reads their
rows, packed per image, in one copy (BlockReader).
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .errors import ModelError
from .kernels import compile_ahead, row_max
from .nms import NMS_STEPS, batched_nms, exact_nms, top_nms
from .results import Detections

log = logging.getLogger("gpudet")


@dataclass(frozen=True)
class Thresholds:
    """What the postprocess keeps, per image: detections scoring at least `score_threshold`
    (the heads contracts: above it, as their references do), after NMS at `iou_threshold`, at
    most `max_detections`, best first."""

    score_threshold: float
    iou_threshold: float
    max_detections: int


def image_meta(scale_yx: np.ndarray, pad_yx: np.ndarray, orig_hw: np.ndarray,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """[B, 6] float32 (scale_y, scale_x, pad_y, pad_x, height, width) on `device`: what maps
    model-input pixels back to each original image (PreprocessedBatch's arrays)."""
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

    def on_device(self) -> DeviceDetections:
        return self

    def bad_images(self) -> list[int]:
        """As Detections.bad_images (one host sync)."""
        finite = torch.isfinite(self.boxes_xyxy).all(dim=1) & torch.isfinite(self.scores)
        if self.landmarks is not None:
            finite &= torch.isfinite(self.landmarks).flatten(1).all(dim=1)
        return torch.unique(self.batch_index[~finite]).tolist()

    def without(self, images: list[int], count: int) -> DeviceDetections:
        """As Detections.without."""
        dropped = torch.tensor(images, dtype=torch.int64, device=self.batch_index.device)
        renumbered = torch.cumsum(~torch.isin(torch.arange(count, device=dropped.device), dropped), 0) - 1
        rows = ~torch.isin(self.batch_index, dropped)
        return DeviceDetections(batch_index=renumbered[self.batch_index[rows]], boxes_xyxy=self.boxes_xyxy[rows],
                                scores=self.scores[rows], labels=self.labels[rows],
                                landmarks=None if self.landmarks is None else self.landmarks[rows])

    def per_image(self, count: int) -> list[DeviceDetections]:
        """The rows of images 0..count-1 (rows are grouped by image), each as its own
        DeviceDetections, views of these tensors; the counts cost one host sync."""
        counts = torch.bincount(self.batch_index, minlength=count)[:count].tolist()
        columns = [c.split(counts) for c in (self.boxes_xyxy, self.scores, self.labels)]
        marks = self.landmarks.split(counts) if self.landmarks is not None else [None] * count
        return [DeviceDetections(batch_index=torch.zeros_like(scores, dtype=torch.int64), boxes_xyxy=boxes,
                                 scores=scores, labels=labels, landmarks=landmarks)
                for boxes, scores, labels, landmarks in zip(*columns, marks)]

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


class BadModelOutput(Exception):
    """A batch's model outputs hold values the contract rules out (a batch_index outside the
    batch): its images are recorded as bad_model_output, and the run goes on."""


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


class EndToEnd:
    """Postprocess for a model that decodes and NMS's in its graph: threshold, cap per image, undo
    the resize/letterbox and clip, on the outputs' device. The outputs' count N is data-dependent,
    so this syncs with the host once (a boolean mask)."""

    def __init__(self, *, num_landmarks: int):
        self.num_landmarks = num_landmarks

    def compile_ahead(self, outputs: dict[str, tuple[torch.dtype, tuple]]) -> None:
        """Nothing to compile: the model's graph did the work."""

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


def to_original(points_xy: torch.Tensor, image: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """[M, P, 2] model-input pixels of the images `image` [M] -> original pixels, clipped."""
    per_row = meta[image]  # [M, 6]
    # (y, x) pairs flipped by slicing: a list index would copy from the host (not in a CUDA graph)
    scale_xy, pad_xy, size_wh = per_row[:, 0:2].flip(1), per_row[:, 2:4].flip(1), per_row[:, 4:6].flip(1)
    xy = (points_xy.float() - pad_xy[:, None]) / scale_xy[:, None]
    return torch.minimum(xy.clamp(min=0), size_wh[:, None])


def kept_slots(keep: torch.Tensor, max_detections: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each image's kept candidates are, packed to the front: keep [B, K] bool (at most
    max_detections per image, best first) -> index [B, D] (candidate of the image's d-th kept one;
    clamped where there is none; D = min(max_detections, K)), count [B], present [B, D] (d < count).
    Static shapes, no sync."""
    batch, k = keep.shape
    max_detections = min(max_detections, k)  # D: no more slots than candidates
    kept_so_far = torch.cumsum(keep, dim=1)  # [B, K], non-decreasing
    wanted = torch.arange(1, max_detections + 1, device=keep.device).expand(batch, -1).contiguous()
    index = torch.searchsorted(kept_so_far, wanted).clamp_(max=k - 1)  # first candidate with that many kept
    count = kept_so_far[:, -1]
    return index, count, wanted <= count[:, None]


def pack_rows(columns: torch.Tensor, count: torch.Tensor, present: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
    """columns [B, D, C] float32 (each image's kept detections, packed to the front) -> the block
    the host reads, [1 + D, B, C]: row 0 holds each image's (count, flag, 0, ...), row 1 + d each
    image's d-th detection (zeros past its count). Slot-major, so the first 1 + P rows are one
    contiguous copy that holds every image's first P detections."""
    batch, _, width = columns.shape
    header = torch.cat([count.float()[:, None], flag.float()[:, None], columns.new_zeros(batch, width - 2)], dim=1)
    return torch.cat([header[None], (columns * present[..., None]).transpose(0, 1)], dim=0)


def rows_to_original(points_xy: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """to_original for rows laid out per image: [B, D, P, 2] model-input pixels (row b: image b)
    -> [B, D, 2P] original pixels, clipped."""
    batch, rows = points_xy.shape[:2]
    image = torch.arange(batch, device=points_xy.device)[:, None].expand(-1, rows).reshape(-1)
    return to_original(points_xy.reshape(batch * rows, -1, 2), image, meta).reshape(batch, rows, -1)


def box_columns(labels: torch.Tensor, scores: torch.Tensor, boxes: torch.Tensor, meta: torch.Tensor) -> list:
    """Columns label, score, x1 y1 x2 y2 (original pixels) of rows [B, D] of a batch."""
    batch, rows = scores.shape
    return [labels.float()[..., None], scores.float()[..., None],
            rows_to_original(boxes.reshape(batch, rows, 2, 2), meta)]


@dataclass
class PackedDetections:
    """A batch's final detections as the heads postprocess leaves them: one block on the device,
    read by the host in one copy when asked (`to_host`, `on_device`: the counts are needed).

    block: [1 + D, B, C] float32 on the device (pack_rows): row 0 per image (count, flag), row
    1 + d image b's d-th detection, columns label, score, x1 y1 x2 y2 (original pixels), then
    (x, y) per landmark. flag 0: the in-graph NMS did not settle that image; `settle` gives the
    block again with those images done exactly (rare). Images past num_images pad the batch and
    are dropped. The block belongs to the postprocess's CUDA graph: read it before the next batch
    of the same engine output buffers."""

    block: torch.Tensor
    num_landmarks: int
    num_images: int
    reader: BlockReader
    settle: Callable[[list[int]], torch.Tensor]
    _host: np.ndarray | None = None

    @property
    def host(self) -> np.ndarray:
        """The block's first 1 + P rows on the host, P >= every image's count: the one copy."""
        if self._host is None:
            host = self.reader(self.block)
            unsettled = [b for b in range(self.num_images) if not host[0, b, 1]]
            if unsettled:
                self.block = self.settle(unsettled)
                host = self.block.cpu().numpy()
            self._host = host
        return self._host

    @property
    def counts(self) -> np.ndarray:
        return self.host[0, :self.num_images, 0].astype(np.int64)

    def to_host(self) -> Detections:
        counts, host = self.counts, self.host
        rows = np.concatenate([host[1:1 + n, b] for b, n in enumerate(counts)]) if len(counts) else \
            np.zeros((0, host.shape[2]), np.float32)
        return Detections(batch_index=np.repeat(np.arange(len(counts)), counts), labels=rows[:, 0].astype(np.int64),
                          scores=rows[:, 1].copy(), boxes_xyxy=rows[:, 2:6].copy(),
                          landmarks=rows[:, 6:].reshape(len(rows), self.num_landmarks, 2).copy()
                          if self.num_landmarks else None)

    def on_device(self) -> DeviceDetections:
        """The same rows as torch tensors on the device (fresh: the block is reused next batch)."""
        counts = self.counts
        rows = torch.cat([self.block[1:1 + n, b] for b, n in enumerate(counts.tolist())]) if len(counts) else \
            self.block.new_zeros(0, self.block.shape[2])
        image = torch.repeat_interleave(torch.arange(len(counts), device=rows.device),
                                        torch.from_numpy(counts).to(rows.device), output_size=len(rows))
        return DeviceDetections(batch_index=image, labels=rows[:, 0].long(), scores=rows[:, 1].contiguous(),
                                boxes_xyxy=rows[:, 2:6].contiguous(),
                                landmarks=rows[:, 6:].reshape(len(rows), self.num_landmarks, 2)
                                if self.num_landmarks else None)


class BlockReader:
    """Reads a packed block's first 1 + P rows to the host: one copy, one sync per batch. P is
    the smallest power of two that held every image's detections so far (at least 16), so the
    copy is as small as the batches need: RetinaFace's block has room for 750 faces per image, a
    batch of photos uses a few. A batch with more reads the rest in a second copy and raises P."""

    def __init__(self, first: int = 16):
        self.rows = first

    def __call__(self, block: torch.Tensor) -> np.ndarray:
        rows = min(self.rows, block.shape[0] - 1)
        host = block[:1 + rows].cpu().numpy()
        most = int(host[0, :, 0].max()) if host.shape[1] else 0
        if most > rows:
            host = np.concatenate([host, block[1 + rows:1 + most].cpu().numpy()])
            self.rows = min(1 << (most - 1).bit_length(), block.shape[0] - 1)
        return host


class GraphCache:
    """Runs a function with static shapes and no host sync from CUDA graphs, captured once per set
    of input buffers (the engine's output buffers, the same every batch) and replayed: the ~200
    small kernels of a heads postprocess become one launch, with no host time between them.

    fn(*buffers, *staged, **options): `buffers` are read in place (a new buffer is a new graph);
    `staged` are small tensors that change every batch (the image count, the letterbox meta),
    copied into the graph's own before each replay. Outputs are the graph's own tensors: valid
    until its next replay. On the CPU, or if a capture fails (logged once), fn simply runs.

    Options (the thresholds among them) are part of a graph's key: the graphs of the last
    MAX_GRAPHS keys are kept, the least recently used one goes first."""

    MAX_GRAPHS = 16

    def __init__(self, device: torch.device):
        self.device = device
        self.enabled = device.type == "cuda"
        self._graphs: OrderedDict[tuple, tuple] = OrderedDict()

    def __call__(self, fn, buffers: tuple[torch.Tensor, ...], staged: tuple[torch.Tensor, ...], **options):
        if self.enabled:
            try:
                return self._replay(fn, buffers, staged, options)
            except RuntimeError as e:  # a capture this torch/driver refuses: run the kernels one by one
                log.warning("postprocess: CUDA graph capture failed, running without (%s)", e)
                self.enabled = False
        return fn(*buffers, *(t.to(self.device) for t in staged), **options)

    def _replay(self, fn, buffers, staged, options: dict):
        key = (fn.__qualname__, tuple((t.data_ptr(), t.shape, t.dtype) for t in buffers),
               tuple((t.shape, t.dtype) for t in staged), tuple(sorted(options.items())))
        if key not in self._graphs:
            inputs = tuple(t.to(self.device, copy=True) for t in staged)
            pinned = tuple(torch.empty_like(t, device="cpu").pin_memory() for t in staged)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up outside the capture (allocations, library handles)
                for _ in range(2):
                    fn(*buffers, *inputs, **options)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: ORT and DALI keep working on their own threads and streams meanwhile.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                outputs = fn(*buffers, *inputs, **options)
            self._graphs[key] = (graph, inputs, pinned, outputs)
            while len(self._graphs) > self.MAX_GRAPHS:
                self._graphs.popitem(last=False)
        self._graphs.move_to_end(key)
        graph, inputs, pinned, outputs = self._graphs[key]
        # A few bytes from the host, ordered before the replay, without a sync. The pinned copy is
        # not rewritten before the copy ran: the caller reads this graph's outputs (a sync) first.
        for target, page, value in zip(inputs, pinned, staged):
            target.copy_(page.copy_(value), non_blocking=True)
        graph.replay()
        return outputs


class Compiled:
    """torch.compile(fn) (static shapes, one graph) for use inside GraphCache: compiles on its first
    call, which GraphCache makes outside the capture; where compiling fails, logs why once and runs
    fn as it is from then on."""

    def __init__(self, fn):
        self.fn, self.__qualname__ = fn, f"{fn.__qualname__}[compiled]"
        # Coordinate-descent tuning of each Triton kernel's launch shape (block sizes, warps) at
        # compile time: the best-class amax over [16, 120087, 91] float16 is a reduction over an
        # odd, short row, where inductor's default shape is far from the memory's bandwidth.
        self.compiled = torch.compile(fn, fullgraph=True, dynamic=False, options={"coordinate_descent_tuning": True})

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

    The anchors are made once on the device. Only the top `pre_nms_top_k` candidates per image
    are decoded. NMS (nms.top_nms: exact greedy, no host sync) looks at each image's best
    `nms_prefix` candidates, NMS_STEPS fixed-point steps: that settles an image with no more
    candidates above the threshold, whose suppression chains are that short (nearly every photo:
    a face gives a handful of candidates). An image it does not settle is done again exactly, on
    all its candidates, to the fixed point.
    """

    def __init__(self, *, strides: list[int], sizes: list[list[float]], variances: list[float],
                 pre_nms_top_k: int, input_hw: tuple[int, int], num_landmarks: int, device: torch.device,
                 nms_prefix: int = 256, compile: bool = False):
        self.strides, self.sizes, self.variances = strides, sizes, variances
        self.pre_nms_top_k = pre_nms_top_k
        self.nms_prefix = min(nms_prefix, pre_nms_top_k)
        self.input_hw = tuple(input_hw)
        self.num_landmarks = num_landmarks
        self.device = device
        self._anchors: dict[tuple[int, int], torch.Tensor] = {}
        self.graphs = GraphCache(device)
        self.reader = BlockReader()
        self._packed = maybe_compiled(self.packed, device, compile)

    def compile_ahead(self, outputs: dict[str, tuple[torch.dtype, tuple]]) -> None:
        """Start compiling the Triton kernel NMS launches on a GPU (kernels.compile_ahead).
        outputs: the model's outputs by name, (dtype, shape). Not under postprocess.compile,
        whose inductor writes kernels of its own."""
        if not isinstance(self._packed, Compiled):
            compile_ahead(self.device)

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
             score_threshold: float, iou_threshold: float, max_detections: int, prefix: int, max_iterations: int,
             sync_every: int = 0):
        """The static-shape part: top-k, decode, NMS on the best `prefix` candidates (all of them:
        the exact path, checked for convergence every `sync_every` steps). num_images: [] int64
        tensor. Returns scores [B, k], index [B, k] (anchors), boxes [B, k, 4] x1y1x2y2 input
        pixels, keep [B, k] (capped at max_detections per image) and settled [B], on the device."""
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
        classes = torch.zeros_like(index)
        if prefix < len(index[0]):
            keep, settled = top_nms(boxes, scores, classes, valid, iou_threshold=iou_threshold,
                                    max_kept=max_detections, prefix=prefix, max_iterations=max_iterations)
            return scores, index, boxes, keep, settled
        keep, settled = batched_nms(boxes, scores, classes, valid, iou_threshold=iou_threshold,
                                    max_iterations=max_iterations, sync_every=sync_every)
        keep &= torch.cumsum(keep, dim=1) <= max_detections  # best first, so this caps per image
        return scores, index, boxes, keep, settled

    def packed(self, *tensors: torch.Tensor, num_landmarks: int, **options) -> torch.Tensor:
        """kept, then the final rows packed for the host (pack_rows; flag: NMS settled).
        tensors: loc, conf, [landmarks if num_landmarks,] num_images [] int64, meta [B, 6]."""
        loc, conf, *landmarks, num_images, meta = tensors
        scores, index, boxes, keep, converged = self.kept(loc, conf, num_images, **options)
        slot, count, present = kept_slots(keep, options["max_detections"])
        anchor = index.gather(1, slot)  # [B, D]
        columns = box_columns(torch.zeros_like(anchor), scores.gather(1, slot),
                              boxes.gather(1, slot[..., None].expand(-1, -1, 4)), meta)
        if num_landmarks:
            prior = self.anchors(*options["input_hw"])[anchor]  # [B, D, 4]
            coded = landmarks[0].float().gather(1, anchor[..., None].expand(-1, -1, 2 * num_landmarks))
            points = prior[..., None, :2] + coded.reshape(*anchor.shape, num_landmarks, 2) * self.variances[0] * \
                prior[..., None, 2:]
            columns.append(rows_to_original(points, meta))
        return pack_rows(torch.cat(columns, dim=-1), count, present, converged)

    def __call__(self, outputs: dict[str, torch.Tensor], meta: torch.Tensor, *, num_images: int,
                 thresholds: Thresholds) -> PackedDetections:
        options = dict(input_hw=self.input_hw, score_threshold=thresholds.score_threshold,
                       iou_threshold=thresholds.iou_threshold, max_detections=thresholds.max_detections,
                       num_landmarks=self.num_landmarks)
        buffers = (outputs["loc"], outputs["conf"]) + ((outputs["landmarks"],) if self.num_landmarks else ())
        block = self.graphs(self._packed, buffers, (torch.tensor(num_images), meta), prefix=self.nms_prefix,
                            max_iterations=NMS_STEPS, **options)

        def settle(images: list[int]) -> torch.Tensor:
            """The block with `images` done exactly: up to pre_nms_top_k steps, checked every 8."""
            rows = torch.tensor(images, device=block.device)
            again = self.packed(*(t[rows] for t in buffers), torch.tensor(len(images), device=block.device),
                                meta[images].to(block.device), prefix=self.pre_nms_top_k,
                                max_iterations=self.pre_nms_top_k, sync_every=8, **options)
            settled = block.clone()
            settled[:, rows] = again
            return settled

        return PackedDetections(block=block, num_landmarks=self.num_landmarks, num_images=num_images,
                                reader=self.reader, settle=settle)


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


class RetinaNetHeads:
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
    def from_metadata(cls, metadata: dict[str, str], model_path: Path, device: torch.device,
                      compile: bool = False) -> RetinaNetHeads:
        if RETINANET_METADATA not in metadata:
            raise ModelError(f"{model_path}: a retinanet_heads model needs its anchor layout in the metadata key "
                             f"{RETINANET_METADATA!r}; export it with scripts/export_retinanet.py")
        return cls(layout=json.loads(metadata[RETINANET_METADATA]), device=device, compile=compile)

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
        valid &= torch.arange(len(valid), device=valid.device)[:, None] < num_images
        keep, settled = top_nms(boxes, scores, labels, valid, iou_threshold=iou_threshold, max_kept=max_detections,
                                prefix=self.nms_prefix)
        return scores, labels, boxes, valid, keep, settled

    def packed(self, logits: torch.Tensor, regression: torch.Tensor, num_images: torch.Tensor, meta: torch.Tensor, *,
               max_detections: int, **options):
        """kept, then the final rows packed for the host (pack_rows; flag: settled). Returns the
        block and kept's tensors (for the exact path of an unsettled image)."""
        scores, labels, boxes, valid, keep, settled = self.kept(logits, regression, num_images,
                                                                max_detections=max_detections, **options)
        block = self.pack(scores, labels, boxes, keep, settled, meta, max_detections)
        return block, (scores, labels, boxes, valid, keep)

    @staticmethod
    def pack(scores, labels, boxes, keep, flag, meta, max_detections: int) -> torch.Tensor:
        slot, count, present = kept_slots(keep, max_detections)
        columns = box_columns(labels.gather(1, slot), scores.gather(1, slot),
                              boxes.gather(1, slot[..., None].expand(-1, -1, 4)), meta)
        return pack_rows(torch.cat(columns, dim=-1), count, present, flag)

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
            return self.pack(scores, labels, boxes, exact, torch.ones_like(valid[:, 0]), meta.to(block.device),
                             max_detections)

        return PackedDetections(block=block, num_landmarks=0, num_images=num_images, reader=self.reader,
                                settle=settle)
