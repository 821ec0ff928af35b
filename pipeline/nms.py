"""Batched, exact greedy NMS in plain torch, with no host synchronisation.

Greedy NMS keeps a box unless a kept box of higher score (same image, same class) overlaps it by
more than the IoU threshold. With S[i, j] = "i ranks above j and suppresses it", the kept set is
the fixed point of

    keep[j] = not any_i (keep[i] and S[i, j])

S is strictly upper-triangular in score order, so that fixed point is unique: whatever reaches
it has the greedy answer. Iterating the map from keep = all ones gets there after at most as many
steps as the longest chain of suppressions (each step fixes at least the next box of every chain: by
induction, after t steps the first t boxes in score order are final). Real detections converge
in a handful of steps; `max_iterations` bounds the work and `converged` says whether the bound
was enough, as a device tensor, so the caller can check it with the copy it makes anyway. This
is the "Cluster-NMS" formulation (Zheng et al., 2020) of the greedy algorithm, batched over images.
"""

from __future__ import annotations

import torch


def box_iou_batched(boxes: torch.Tensor) -> torch.Tensor:
    """boxes: [B, K, 4] x1 y1 x2 y2 -> IoU [B, K, K]."""
    area = (boxes[..., 2] - boxes[..., 0]).clamp(min=0) * (boxes[..., 3] - boxes[..., 1]).clamp(min=0)
    top_left = torch.maximum(boxes[:, :, None, :2], boxes[:, None, :, :2])
    bottom_right = torch.minimum(boxes[:, :, None, 2:], boxes[:, None, :, 2:])
    inter = (bottom_right - top_left).clamp(min=0).prod(dim=-1)
    return inter / (area[:, :, None] + area[:, None, :] - inter).clamp(min=1e-9)


def batched_nms(boxes: torch.Tensor, scores: torch.Tensor, classes: torch.Tensor, valid: torch.Tensor, *,
                iou_threshold: float, max_iterations: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy per-class NMS for every image of a batch at once.

    boxes [B, K, 4] x1y1x2y2, scores [B, K], classes [B, K] int, valid [B, K] bool (candidates
    that passed the score threshold). Candidates must be sorted by score, descending, per image
    (top-k output is). Returns keep [B, K] bool and converged: bool tensor [] on the device.
    """
    same_class = classes[:, :, None] == classes[:, None, :]
    k = boxes.shape[1]
    above = torch.ones(k, k, dtype=torch.bool, device=boxes.device).triu(diagonal=1)  # i ranks above j
    suppresses = (box_iou_batched(boxes.float()) > iou_threshold) & same_class & above
    suppresses &= valid[:, :, None] & valid[:, None, :]
    s = suppresses.float()
    keep = valid.clone()
    converged = torch.zeros((), dtype=torch.bool, device=boxes.device)
    for _ in range(max_iterations):
        # keep_next[j] = valid[j] and no kept i suppresses j: one batched matrix-vector product.
        keep_next = valid & ~(torch.bmm(keep.float()[:, None, :], s)[:, 0, :] > 0)
        converged = (keep_next == keep).all()
        keep = keep_next
        if not keep.is_cuda and converged:  # on the CPU the check is free: stop early
            break
    return keep, converged
