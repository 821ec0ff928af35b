"""Batched, exact greedy NMS in torch (the suppressor matrix by a Triton kernel on a GPU:
kernels.suppressor_words), with no host synchronisation.

Greedy NMS keeps a box unless a kept box of higher score (same image, same class) overlaps it by
more than the IoU threshold. With S[i, j] = "i ranks above j and suppresses it", the kept set is
the fixed point of

    keep[j] = not any_i (keep[i] and S[i, j])

S is strictly upper-triangular in score order, so that fixed point is unique: whatever reaches
it has the greedy answer. Iterating the map from keep = all ones gets there after at most as many
steps as the longest chain of suppressions (each step fixes at least the next box of every chain: by
induction, after t steps the first t boxes in score order are final). Real detections converge
in a handful of steps; `max_iterations` bounds the work and `converged` says per image whether the
bound was enough, as a device tensor, so the caller can check it with the copy it makes anyway. This
is the "Cluster-NMS" formulation (Zheng et al., 2020) of the greedy algorithm, batched over images.
"""

from __future__ import annotations

import torch

from . import kernels
from .kernels import suppressor_words


# Fixed-point steps run without a host check (inside a CUDA graph). On torchvision's RetinaNet at
# score 0 (5,000 candidates per image, the worst case) the first 1,024 candidates of the sample
# photos converged in 5-10 steps; an image that has not is told so and finished exactly.
NMS_STEPS = 16


def box_iou_batched(boxes: torch.Tensor) -> torch.Tensor:
    """boxes: [B, K, 4] x1 y1 x2 y2 -> IoU [B, K, K] (float32 boxes give float32 IoU)."""
    x1, y1, x2, y2 = boxes.unbind(-1)  # [B, K] each: [B, K, K] temporaries only where needed
    area = (x2 - x1).clamp(min=0) * (y2 - y1).clamp(min=0)
    inter = (torch.minimum(x2[:, :, None], x2[:, None]) - torch.maximum(x1[:, :, None], x1[:, None])).clamp_(min=0)
    inter *= (torch.minimum(y2[:, :, None], y2[:, None]) - torch.maximum(y1[:, :, None], y1[:, None])).clamp_(min=0)
    union = (area[:, :, None] + area[:, None]).sub_(inter).clamp_(min=1e-9)
    return inter.div_(union)


def suppressors(boxes: torch.Tensor, classes: torch.Tensor, *, iou_threshold: float) -> torch.Tensor:
    """[B, K, K] bool, by[b, j, i]: candidate i ranks above j (i < j), same class, and IoU >
    threshold, so i suppresses j if i is kept. Row j lists j's suppressors. Validity is the fixed
    point's: an invalid i is never kept, so it suppresses nothing."""
    k = boxes.shape[1]
    below = torch.ones(k, k, dtype=torch.bool, device=boxes.device).tril_(diagonal=-1)  # [j, i]: i < j
    by = box_iou_batched(boxes.float()) > iou_threshold
    by &= classes[:, :, None] == classes[:, None, :]
    by &= below
    return by


def suppressor_rows(boxes: torch.Tensor, classes: torch.Tensor, *, iou_threshold: float) -> torch.Tensor:
    """packed_bits(suppressors(...)), int64 [B, K, ceil(K / 64)]: by a Triton kernel on a GPU
    (kernels.suppressor_words, the same bits), by these torch ops elsewhere."""
    rows = suppressor_words(boxes, classes, iou_threshold=iou_threshold)
    return rows if rows is not None else packed_bits(suppressors(boxes, classes, iou_threshold=iou_threshold))


def packed_bits(mask: torch.Tensor) -> torch.Tensor:
    """bool [..., K] -> int64 [..., ceil(K / 64)], 64 entries of the last axis to a word (False
    past K): 8 entries to a byte, then 8 bytes to a word, each a sum of distinct powers of two (no
    carry, so each sum is an OR). Plain arithmetic, no reinterpreting view: it runs the same in
    eager torch, in a CUDA graph and under torch.compile."""
    pad = -mask.shape[-1] % 64
    if pad:
        mask = torch.cat([mask, mask.new_zeros(*mask.shape[:-1], pad)], dim=-1)
    *lead, k = mask.shape
    device = mask.device
    ones = torch.ones(8, dtype=torch.uint8, device=device)  # made on the device: a CUDA graph can hold it
    octets = (mask.reshape(*lead, k // 8, 8) * (ones << torch.arange(8, dtype=torch.uint8, device=device))).sum(
        dim=-1, dtype=torch.uint8)  # [..., K / 8]
    shifts = torch.arange(0, 64, 8, dtype=torch.int64, device=device)
    return (octets.reshape(*lead, k // 64, 8).to(torch.int64) << shifts).sum(dim=-1)  # [..., K / 64]


def fixed_point(rows: torch.Tensor, valid: torch.Tensor, *, max_iterations: int,
                sync_every: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Iterate keep[j] = valid[j] and no kept i suppresses j from keep = valid, on the suppressor
    matrix packed to bits (rows: int64 [B, K, ceil(K / 64)], packed_bits(suppressors(...))).
    Returns keep [B, K] and converged [B] (the last step changed nothing for that image), both on
    the device. On the CPU it stops as soon as every image converged; on a GPU that check is a host
    sync, made only every `sync_every` steps when asked (0: never, run max_iterations steps).

    Rows and keep go as bits, 64 to an int64 word: a step reads 1/8 of the bytes of the bool
    matrix (a [16, 1024, 1024] step: 2 MB instead of 16 MB, twice). Candidates are padded to
    whole words once (padding: not valid, suppressed by none), so a step is five kernels: pack
    keep, AND, any, and the update. On a GPU without a host check, a step is one Triton kernel
    instead (kernels.fixed_point), with the same answer."""
    batch, k = valid.shape
    check_every = 0 if torch.compiler.is_compiling() else sync_every if rows.is_cuda else 1
    if not check_every:  # every step without a host check: one kernel a step on a GPU
        done = kernels.fixed_point(rows, valid, max_iterations)
        if done is not None:
            return done
    pad = -k % 64
    if pad:
        rows = torch.cat([rows, rows.new_zeros(batch, pad, rows.shape[2])], dim=1)
        valid = torch.cat([valid, valid.new_zeros(batch, pad)], dim=1)
    words = rows.shape[2]
    bit = torch.ones(64, dtype=torch.int64, device=rows.device) << torch.arange(64, device=rows.device)  # 2^63: sign
    keep = previous = valid
    for step in range(1, max_iterations + 1):
        # keep as words: distinct powers of two summed, an OR without carries (2^63 makes the word
        # negative and cannot overflow: the other terms are positive and sum below 2^63)
        kept = (keep.reshape(batch, words, 64) * bit).sum(dim=2)  # [B, W]
        suppressed = (rows & kept[:, None, :]).any(dim=2)  # some kept i suppresses j
        previous, keep = keep, torch.gt(valid, suppressed)  # valid and not suppressed
        if check_every and step % check_every == 0 and torch.equal(keep, previous):
            break
    return keep[:, :k], (keep == previous).all(dim=1)


def batched_nms(boxes: torch.Tensor, scores: torch.Tensor, classes: torch.Tensor, valid: torch.Tensor, *,
                iou_threshold: float, max_iterations: int = NMS_STEPS,
                sync_every: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy per-class NMS for every image of a batch at once.

    boxes [B, K, 4] x1y1x2y2, scores [B, K], classes [B, K] int, valid [B, K] bool (candidates
    that passed the score threshold). Candidates must be sorted by score, descending, per image
    (top-k output is). Returns keep [B, K] bool and converged [B] bool on the device: False for an
    image whose suppression chains need more than max_iterations steps (its keep is not final).
    """
    rows = suppressor_rows(boxes, classes, iou_threshold=iou_threshold)
    return fixed_point(rows, valid, max_iterations=max_iterations, sync_every=sync_every)


def top_nms(boxes: torch.Tensor, scores: torch.Tensor, classes: torch.Tensor, valid: torch.Tensor, *,
            iou_threshold: float, max_kept: int, prefix: int = 1024,
            max_iterations: int = NMS_STEPS) -> tuple[torch.Tensor, torch.Tensor]:
    """The best `max_kept` boxes per image that greedy per-class NMS keeps, looking at as few
    candidates as the answer allows.

    Greedy NMS decides a box from higher-ranked boxes only, so what it keeps among the first m
    candidates does not depend on the others. An image that keeps `max_kept` of its first
    `prefix` candidates, or has no valid candidate after them, is settled by those alone: IoU over
    [B, prefix, prefix] instead of [B, K, K] (K = 5,000 for RetinaNet: 25x less work).

    Arguments as batched_nms (sorted by score, valid a prefix of each row). Returns keep [B, K]
    bool (at most max_kept per image) and settled [B] bool on the device: False for an image that
    needs the candidates after the prefix, or whose NMS did not converge in max_iterations steps;
    give those to exact_nms.
    """
    k = boxes.shape[1]
    m = min(prefix, k)
    head, converged = batched_nms(boxes[:, :m], scores[:, :m], classes[:, :m], valid[:, :m],
                                  iou_threshold=iou_threshold, max_iterations=max_iterations)
    head &= torch.cumsum(head, dim=1) <= max_kept  # best first, so this caps per image
    settled = converged & ((head.sum(dim=1) >= max_kept) | ~valid[:, m:].any(dim=1))
    keep = torch.cat([head, torch.zeros_like(valid[:, m:])], dim=1)
    return keep, settled


def exact_nms(boxes: torch.Tensor, scores: torch.Tensor, classes: torch.Tensor, valid: torch.Tensor, *,
              iou_threshold: float, max_kept: int, images: list[int] | None = None, keep: torch.Tensor | None = None,
              first_prefix: int = 2048, check_every: int = 8) -> torch.Tensor:
    """top_nms's slow path, exact whatever the data, for `images` (default all; the other rows of
    `keep` are kept): those images at once, on a prefix of the candidates that doubles for the
    images it does not settle, iterating to the fixed point with a host check every `check_every`
    steps. It syncs with the host; top_nms does not."""
    keep = torch.zeros_like(valid) if keep is None else keep.clone()
    counts = valid.sum(dim=1).tolist()  # valid is a prefix of each row
    todo = list(range(len(valid))) if images is None else list(images)
    prefix = first_prefix
    while todo:
        width = min(prefix, max(counts[b] for b in todo))
        rows = torch.tensor(todo, device=valid.device)
        keep[rows] = False
        if width == 0:  # nothing valid left in any of them
            break
        found, _ = batched_nms(boxes[rows, :width], scores[rows, :width], classes[rows, :width], valid[rows, :width],
                               iou_threshold=iou_threshold, max_iterations=width, sync_every=check_every)
        found &= torch.cumsum(found, dim=1) <= max_kept
        kept = found.sum(dim=1).tolist()
        keep[rows, :width] = found
        # settled: every valid candidate looked at, or max_kept kept before the ones not looked at
        todo = [b for b, n in zip(todo, kept) if width < counts[b] and n < max_kept]
        prefix = 2 * width
    return keep
