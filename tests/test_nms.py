"""The batched matrix NMS against a plain greedy NMS, on random and adversarial boxes."""

import numpy as np
import pytest
import torch

from pipeline.nms import batched_nms, box_iou_batched, exact_nms, fixed_point, packed_bits, top_nms

from conftest import cpu_and_cuda, random_boxes


def greedy_nms(boxes: np.ndarray, scores: np.ndarray, classes: np.ndarray, iou_threshold: float) -> np.ndarray:
    """The textbook algorithm, one box at a time (float64)."""
    order = np.argsort(-scores, kind="stable")
    keep = np.zeros(len(boxes), bool)
    for idx, i in enumerate(order):
        ok = True
        for j in order[:idx]:
            if keep[j] and classes[j] == classes[i]:
                inter_wh = np.clip(np.minimum(boxes[i, 2:], boxes[j, 2:]) - np.maximum(boxes[i, :2], boxes[j, :2]), 0,
                                   None)
                inter = inter_wh.prod()
                union = np.prod(boxes[i, 2:] - boxes[i, :2]) + np.prod(boxes[j, 2:] - boxes[j, :2]) - inter
                if inter / union > iou_threshold:
                    ok = False
                    break
        keep[i] = ok
    return keep


@cpu_and_cuda()
@pytest.mark.parametrize("seed", range(8))
def test_matches_greedy_nms_batched_over_images_and_classes(device, seed):
    rng = np.random.default_rng(seed)
    batch, k = 3, 120
    boxes = random_boxes(torch.Generator().manual_seed(int(rng.integers(1 << 31))), batch, k).numpy()
    scores = rng.uniform(0, 1, (batch, k)).astype(np.float32)
    classes = rng.integers(0, 3, (batch, k))
    valid = scores > 0.2
    order = np.argsort(-scores, axis=1, kind="stable")  # the function wants candidates sorted per image
    take = lambda a: np.take_along_axis(a, order[..., None] if a.ndim == 3 else order, axis=1)  # noqa: E731
    boxes, scores, classes, valid = take(boxes), take(scores), take(classes), take(valid)
    t = lambda a: torch.as_tensor(a, device=device)  # noqa: E731
    keep, converged = batched_nms(t(boxes), t(scores), t(classes), t(valid), iou_threshold=0.4, max_iterations=k)
    assert bool(converged.all())
    for b in range(batch):
        expected = np.zeros(k, bool)
        expected[valid[b]] = greedy_nms(boxes[b][valid[b]], scores[b][valid[b]], classes[b][valid[b]], 0.4)
        assert keep[b].cpu().numpy().tolist() == expected.tolist()


def test_a_long_suppression_chain_needs_as_many_iterations():
    # Boxes sliding by a small step: each overlaps its neighbours only, so greedy keeps every other
    # one, and each decision waits for the previous: the worst case for the fixed point.
    k = 40
    x = np.arange(k, dtype=np.float32) * 3  # neighbours: IoU 7/13; next but one: 4/16
    boxes = np.stack([x, np.zeros(k), x + 10, np.full(k, 10)], 1)[None].astype(np.float32)
    scores = np.linspace(1, 0.5, k, dtype=np.float32)[None]
    args = (torch.as_tensor(boxes), torch.as_tensor(scores), torch.zeros(1, k, dtype=torch.long),
            torch.ones(1, k, dtype=torch.bool))
    keep, converged = batched_nms(*args, iou_threshold=0.3, max_iterations=4)
    assert not bool(converged.any())  # the bound was too small, and the caller is told so
    keep, converged = batched_nms(*args, iou_threshold=0.3, max_iterations=k)
    assert bool(converged.all()) and keep[0].tolist() == [i % 2 == 0 for i in range(k)]



def test_an_image_that_does_not_converge_is_the_only_one_sent_to_the_exact_path():
    # Image 0: the sliding chain (needs ~k steps); image 1: two far-apart boxes (one step).
    k = 40
    x = np.arange(k, dtype=np.float32) * 3
    chain = np.stack([x, np.zeros(k), x + 10, np.full(k, 10)], 1)
    easy = np.zeros((k, 4), np.float32)
    easy[:, 2:] = 1
    easy[0], easy[1] = [0, 0, 10, 10], [50, 50, 60, 60]
    boxes = torch.as_tensor(np.stack([chain, easy]))
    scores = torch.as_tensor(np.tile(np.linspace(1, 0.5, k, dtype=np.float32), (2, 1)))
    valid = torch.ones(2, k, dtype=torch.bool)
    valid[1, 2:] = False
    classes = torch.zeros(2, k, dtype=torch.long)
    keep, converged = batched_nms(boxes, scores, classes, valid, iou_threshold=0.3, max_iterations=4)
    assert converged.tolist() == [False, True]
    keep, settled = top_nms(boxes, scores, classes, valid, iou_threshold=0.3, max_kept=100, max_iterations=4)
    assert settled.tolist() == [False, True] and keep[1].tolist() == [True, True] + [False] * (k - 2)
    finished = exact_nms(boxes, scores, classes, valid, iou_threshold=0.3, max_kept=100, images=[0], keep=keep)
    assert finished[0].tolist() == [i % 2 == 0 for i in range(k)] and finished[1].tolist() == keep[1].tolist()


@cpu_and_cuda()
@pytest.mark.parametrize("k", [1, 7, 8, 63, 64, 65, 130])
def test_packed_bits_hold_each_entry_of_the_last_axis_once(device, k):
    mask = torch.rand(3, 5, k, generator=torch.Generator().manual_seed(k)).to(device) > 0.5
    packed = packed_bits(mask)
    assert packed.shape == (3, 5, -(-k // 64)) and packed.dtype == torch.int64
    bits = (packed[..., None] >> torch.arange(64, device=device)) & 1
    assert torch.equal(bits.bool().reshape(3, 5, -1)[..., :k], mask)
    assert not bits.reshape(3, 5, -1)[..., k:].any()  # what pads the last byte is False


@cpu_and_cuda()
def test_no_candidate_and_no_image_are_empty_answers(device):
    for batch, k in ((2, 0), (0, 5)):
        boxes, scores = torch.zeros(batch, k, 4, device=device), torch.zeros(batch, k, device=device)
        classes, valid = torch.zeros(batch, k, dtype=torch.long, device=device), torch.ones(batch, k, dtype=torch.bool,
                                                                                          device=device)
        keep, converged = batched_nms(boxes, scores, classes, valid, iou_threshold=0.5, max_iterations=4)
        assert keep.shape == (batch, k) and converged.tolist() == [True] * batch


@cpu_and_cuda()
@pytest.mark.parametrize("k", [5, 64, 100])
def test_the_packed_fixed_point_is_the_boolean_one(device, k):
    """fixed_point on bits against the same iteration on the [B, K, K] bool matrix, after as many
    steps, including those that stop before the fixed point."""
    generator = torch.Generator().manual_seed(k)
    by = (torch.rand(4, k, k, generator=generator) > 0.95) & torch.ones(k, k, dtype=torch.bool).tril(-1)
    valid = torch.rand(4, k, generator=generator) > 0.2
    by, valid = by.to(device), valid.to(device)
    for steps in (1, 2, 3, k):
        keep = previous = valid
        for _ in range(steps):
            previous, keep = keep, valid & ~(by & keep[:, None, :]).any(dim=2)
        # (on the CPU fixed_point stops once nothing changes)
        got, converged = fixed_point(packed_bits(by), valid, max_iterations=steps)
        assert torch.equal(got, keep) and torch.equal(converged, (keep == previous).all(dim=1))


def test_box_iou():
    boxes = torch.tensor([[[0, 0, 10, 10], [5, 0, 15, 10], [20, 20, 30, 30]]], dtype=torch.float32)
    iou = box_iou_batched(boxes)[0]
    assert torch.allclose(iou, torch.tensor([[1, 1 / 3, 0], [1 / 3, 1, 0], [0, 0, 1]]), atol=1e-6)


@cpu_and_cuda()
@pytest.mark.parametrize("prefix", [16, 64, 1024])
def test_top_nms_keeps_the_best_of_greedy_and_says_which_images_the_prefix_did_not_settle(device, prefix):
    """top_nms looks at the first `prefix` candidates only and says per image whether that
    settled it; exact_nms finishes the others (prefix doubling from first_prefix). All match the
    textbook greedy NMS capped at max_kept."""
    rng = np.random.default_rng(prefix)
    batch, k, max_kept = 3, 300, 40
    boxes = random_boxes(torch.Generator().manual_seed(int(rng.integers(1 << 31))), batch, k).numpy()
    scores = -np.sort(-rng.uniform(0, 1, (batch, k)).astype(np.float32), axis=1)
    classes = rng.integers(0, 4, (batch, k))
    valid = scores > 0.05
    valid[2] = False  # an image with no candidate
    t = lambda a: torch.as_tensor(a, device=device)  # noqa: E731
    args = (t(boxes), t(scores), t(classes), t(valid))
    expected = np.zeros((batch, k), bool)
    for b in range(batch):
        expected[b, valid[b]] = greedy_nms(boxes[b][valid[b]], scores[b][valid[b]], classes[b][valid[b]], 0.4)
        expected[b] &= np.cumsum(expected[b]) <= max_kept
    keep, settled = top_nms(*args, iou_threshold=0.4, max_kept=max_kept, prefix=prefix)
    settled = settled.cpu().numpy()
    for b in range(batch):
        by_prefix = expected[b, :prefix].sum() >= max_kept or not valid[b, prefix:].any()
        assert settled[b] == by_prefix
        if settled[b]:
            assert keep[b].cpu().numpy().tolist() == expected[b].tolist()
    assert settled.tolist() == [prefix >= 64, prefix >= 64, True]  # 16 candidates cannot hold 40 kept boxes
    finished = exact_nms(*args, iou_threshold=0.4, max_kept=max_kept, images=np.flatnonzero(~settled).tolist(),
                         keep=keep)
    assert finished.cpu().numpy().tolist() == expected.tolist()
    for first_prefix in (8, 2048):  # doubling from a small prefix, or all candidates at once
        exact = exact_nms(*args, iou_threshold=0.4, max_kept=max_kept, first_prefix=first_prefix)
        assert exact.cpu().numpy().tolist() == expected.tolist()
