"""Postprocess, on the device: model outputs -> final detections in original image pixels.

One call shape for every output contract (pipeline/contracts/: one module each); what to keep is
an argument of the call, not of the constructor, so thresholds can change between streams
without a new session:

    found = postprocess(outputs, meta, num_images=n, thresholds=Thresholds(...))
    found.to_host()      # the batch's one device-to-host copy -> results.Detections
    found.on_device()    # or: DeviceDetections, torch tensors on the device, no host copy

This module holds what the contracts share. meta is `image_meta`, [B, 6]: what maps model-input
pixels back to each original image. The heads postprocesses have static shapes and no host sync
up to their final rows, so on a GPU they run as one CUDA graph per set of engine output buffers
(GraphCache), and the host reads their rows, packed per image, in one copy (BlockReader).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from .results import Detections

log = logging.getLogger("gpudet")


@dataclass(frozen=True)
class Thresholds:
    """What the postprocess keeps, per image: detections scoring at least `score_threshold`
    (the heads contracts: above it, as their references do), after NMS at `iou_threshold`, at
    most `max_detections`, best first; of those, the `classes` (label numbers) only, where given."""

    score_threshold: float
    iou_threshold: float
    max_detections: int
    classes: tuple[int, ...] = ()
    """Label numbers to keep (empty: every class): the final detections of other classes are
    dropped, after NMS and max_detections."""

    def captured(self) -> Thresholds:
        """What the postprocess's captured CUDA graphs depend on (the class filter runs after them)."""
        return dataclasses.replace(self, classes=())


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

    def of_classes(self, classes: tuple[int, ...]) -> DeviceDetections:
        """The rows of these labels only."""
        return self.rows(torch.isin(self.labels, torch.tensor(classes, dtype=self.labels.dtype,
                                                              device=self.labels.device)))

    def rows(self, mask: torch.Tensor) -> DeviceDetections:
        """The rows where `mask` is True, every column."""
        return DeviceDetections(batch_index=self.batch_index[mask], boxes_xyxy=self.boxes_xyxy[mask],
                                scores=self.scores[mask], labels=self.labels[mask],
                                landmarks=None if self.landmarks is None else self.landmarks[mask])

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Tell the allocator that `stream` uses these tensors (they were made on another): their
        memory is not reused before the work queued there by the time they are freed is done."""
        for tensor in (self.batch_index, self.boxes_xyxy, self.scores, self.labels, self.landmarks):
            if tensor is not None:
                tensor.record_stream(stream)

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
        kept = self.rows(~torch.isin(self.batch_index, dropped))
        return dataclasses.replace(kept, batch_index=renumbered[kept.batch_index])

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


def to_original(points_xy: torch.Tensor, image: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """[M, P, 2] model-input pixels of the images `image` [M] -> original pixels, clipped."""
    per_row = meta[image]  # [M, 6]
    # (y, x) pairs flipped by slicing: a list index would copy from the host (not in a CUDA graph)
    scale_xy, pad_xy, size_wh = per_row[:, 0:2].flip(1), per_row[:, 2:4].flip(1), per_row[:, 4:6].flip(1)
    xy = (points_xy.float() - pad_xy[:, None]) / scale_xy[:, None]
    return torch.minimum(xy.clamp(min=0), size_wh[:, None])


def real_images(batch: int, num_images: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[B, 1] bool: the rows of a batch that are images, not its padding (num_images: [] int64
    tensor, so that a CUDA graph takes each batch's count)."""
    return torch.arange(batch, device=device)[:, None] < num_images


def kept_slots(keep: torch.Tensor, max_detections: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each image's first max_detections kept candidates are, packed to the front: keep
    [B, K] bool (best first) -> index [B, D] (candidate of the image's d-th kept one; clamped where
    there is none; D = min(max_detections, K)), count [B] (at most D), present [B, D] (d < count).
    Static shapes, no sync."""
    batch, k = keep.shape
    max_detections = min(max_detections, k)  # D: no more slots than candidates
    kept_so_far = torch.cumsum(keep, dim=1)  # [B, K], non-decreasing
    wanted = torch.arange(1, max_detections + 1, device=keep.device).expand(batch, -1).contiguous()
    index = torch.searchsorted(kept_so_far, wanted).clamp_(max=k - 1)  # first candidate with that many kept
    count = kept_so_far[:, -1].clamp(max=max_detections)
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


def pack_detections(scores: torch.Tensor, labels: torch.Tensor, boxes: torch.Tensor, keep: torch.Tensor,
                    flag: torch.Tensor, meta: torch.Tensor, max_detections: int) -> torch.Tensor:
    """The block the host reads (pack_rows) from a batch's candidates, best first: scores [B, K],
    labels [B, K], boxes [B, K, 4] x1y1x2y2 model-input pixels, keep [B, K] (the first
    max_detections kept of each image are packed, in original pixels), flag [B] (settled).
    Static shapes, no sync."""
    slot, count, present = kept_slots(keep, max_detections)
    columns = box_columns(labels.gather(1, slot), scores.gather(1, slot),
                          boxes.gather(1, slot[..., None].expand(-1, -1, 4)), meta)
    return pack_rows(torch.cat(columns, dim=-1), count, present, flag)


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
