"""Three Triton kernels for the heads postprocess on a GPU, each in place of a few torch ops whose
memory traffic or launches it avoids, with the same answer (tests/test_kernels.py):

    row_max(x)              x.amax(dim=-1). RetinaNet's best class per anchor: a reduction over
                            91 float16 values per row, an odd, unaligned row that torch's reduction
                            reads at a fraction of the memory's bandwidth.
    suppressor_words(...)   nms.packed_bits(nms.suppressors(...)): every pair's IoU test, packed
                            64 to an int64 word in registers, instead of some twenty passes over
                            [B, K, K] float32 temporaries. None where it cannot run: nms has the
                            torch ops (nms.suppressor_rows).
    fixed_point(...)        nms.fixed_point's steps without a host check: a step is one kernel,
                            a program for each 64 rows of an image, which ANDs them with the kept
                            words, ORs each row, and packs the 64 answers into the next kept
                            word, in place of five torch kernels a step (an int64 AND and an
                            any() over rows of a few words, a reduction torch runs slowly).

Triton compiles a kernel on its first call (a second or two; later processes read it from
Triton's cache, ~/.triton/cache or TRITON_CACHE_DIR). `compile_ahead` starts that compile on a
thread of its own while the rest of the detector is built (DALI's pipeline, ORT's warm-up); the
first call waits for it, then loads the kernel, while the postprocess warms up, before its CUDA
graph is captured. Where Triton is missing or a kernel cannot be built, the torch ops run
instead, with a warning. Off the GPU the torch ops run, unless TRITON_INTERPRET=1
(Triton's interpreter: how the CPU tests check these kernels), and under torch.compile too.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from contextlib import nullcontext

import torch

log = logging.getLogger("gpudet")

try:
    import triton
    import triton.language as tl
except ImportError:  # torch without Triton (not Linux x86/aarch64): the torch ops run
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Launch shapes: the fastest measured on an H200 (docs/BENCHMARKS.md), (rows a program, warps).
ROW_MAX_LAUNCH = (16, 1)
SUPPRESSOR_LAUNCH = (16, 1)
FIXED_POINT_WARPS = 2
_failed: set[str] = set()
_ahead: dict[torch.device, list[threading.Thread]] = {}
_ahead_lock = threading.Lock()


def _usable(name: str, *tensors: torch.Tensor) -> bool:
    """Not under torch.compile (postprocess.compile: inductor writes its own kernels for the torch
    ops; asked first, so that the compiled graph does not depend on what failed), Triton there,
    the kernel not failed, the tensors on a GPU."""
    return not torch.compiler.is_compiling() and triton is not None and name not in _failed and \
        all(t.is_cuda or INTERPRET for t in tensors)


def _on(device: torch.device):
    """The tensors' GPU as the current device while a kernel launches: Triton launches on the
    current device and its current stream (torch's ops follow their tensors; the warm-up runs the
    postprocess on the caller's thread, whose current device may be another GPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def _give_up(name: str, error: Exception) -> None:
    if isinstance(error, torch.OutOfMemoryError):  # the torch ops need more memory, not less: not a reason
        raise error
    _failed.add(name)
    log.warning("postprocess: the Triton kernel %s failed, running torch's ops instead (%s: %s)", name,
                type(error).__name__, str(error).splitlines()[0][:300] if str(error) else "")


def compile_ahead(device: torch.device, *, row_max_inputs: Iterable[tuple[torch.dtype, int]] = ()) -> None:
    """Compile, on a thread of its own, the kernels a postprocess on `device` will launch:
    suppressor_words, fixed_point, and row_max for each (dtype, C) of its input's [..., C].
    Compiling launches nothing and loads nothing onto the GPU, so it can run beside ORT's warm-up
    and the CUDA graph ORT captures there. A kernel's first call waits for this thread. A compile
    that fails here is left for that first call to meet and report."""
    if triton is None or INTERPRET or device.type != "cuda":
        return
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    torch.cuda.get_device_capability(device)  # torch's CUDA state and device properties: here, not on the thread
    # Each launch's specialisation as the calls make it: dtypes; data pointers aligned (MockTensor's
    # 0), as torch allocates tensors and as every call but one passes them (exact_nms's slice of an
    # odd image of an odd number of candidates starts off 16 bytes and compiles its own variant);
    # sizes and strides in int32, as any batch gives them.
    jobs = [("row_max", _row_max_kernel, (dtype, dtype, 1 << 20), _row_max_constants(columns))
            for dtype, columns in row_max_inputs]
    jobs.append(("suppressor_words", _suppressor_words_kernel,
                 (torch.float32, torch.int64, torch.int64, 1024, 16, 4096, 1024, 0.5), _suppressor_words_constants()))
    # top_nms's steps on its prefix of 1,024 candidates: 16 words a row
    jobs.append(("fixed_point", _fixed_point_kernel, (torch.int64, torch.int8, torch.int64, torch.int64, 1024, 16),
                 _fixed_point_constants(16)))

    def compile_all():
        with torch.cuda.device(device):
            for name, kernel, args, constants in jobs:
                try:
                    kernel.warmup(*args, grid=(1,), **constants)
                except Exception as e:  # the first call compiles again and reports it (_give_up)
                    log.debug("postprocess: compiling %s ahead failed (%s: %s)", name, type(e).__name__, e)

    _in_background(device, compile_all)


def _in_background(device: torch.device, work: Callable[[], None]) -> None:
    """work() on a thread that the first kernel call on `device` waits for. Not a daemon thread:
    Triton's compiler lets go of the GIL, and a daemon thread that takes it back while the
    interpreter exits (a setup that failed, a Ctrl-C) aborts the process; an exit waits for the
    compile instead, seconds at most."""
    thread = threading.Thread(target=work, name="gpudet-kernels")
    with _ahead_lock:
        _ahead.setdefault(device, []).append(thread)
    thread.start()


def _compiled_ahead(device: torch.device) -> None:
    """Wait for compile_ahead's threads for `device`, if any run."""
    if _ahead:
        with _ahead_lock:
            threads = _ahead.pop(device, [])
        for thread in threads:
            thread.join()


def _launched(name: str, device: torch.device, launch: Callable, *args):
    """launch(*args) on `device`, once compile_ahead's compile for it is done; None where it
    fails, the kernel `name` given up (_give_up)."""
    try:
        _compiled_ahead(device)
        with _on(device):
            return launch(*args)
    except Exception as e:  # no C compiler for Triton's launcher, a GPU it does not know
        _give_up(name, e)
    return None


def row_max(x: torch.Tensor) -> torch.Tensor:
    """x.amax(dim=-1), for a contiguous x of any shape [..., C]."""
    if _usable("row_max", x) and x.is_contiguous() and x.numel():
        found = _launched("row_max", x.device, _row_max, x)
        if found is not None:
            return found
    return x.amax(dim=-1)


def suppressor_words(boxes: torch.Tensor, classes: torch.Tensor, *, iou_threshold: float) -> torch.Tensor | None:
    """nms.packed_bits(nms.suppressors(boxes, classes, iou_threshold=...)): int64 [B, K, ceil(K / 64)],
    bit i % 64 of word i // 64 of row j set where candidate i ranks above j (i < j), has its class
    and overlaps it by IoU > iou_threshold. boxes [B, K, 4] x1y1x2y2, classes [B, K] int. None
    where the kernel cannot run (the caller runs the torch ops)."""
    if _usable("suppressor_words", boxes, classes) and boxes.numel():
        return _launched("suppressor_words", boxes.device, _suppressor_words, boxes.float(), classes, iou_threshold)
    return None


def fixed_point(rows: torch.Tensor, valid: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """nms.fixed_point(rows, valid, max_iterations=steps) with no host check: keep [B, K] bool and
    converged [B] bool (the last step changed nothing). rows: int64 [B, K, ceil(K / 64)]. None
    where the kernel cannot run (the caller runs the torch ops)."""
    if _usable("fixed_point", rows, valid) and valid.numel() and steps > 0:
        return _launched("fixed_point", rows.device, _fixed_point, rows.contiguous(), valid, steps)
    return None


if triton is not None:
    @triton.jit
    def _max(a, b):
        return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def _min(a, b):
        return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit(do_not_specialize=["rows"])
    def _row_max_kernel(x_ptr, out_ptr, rows, C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        # A [BLOCK_R, C] tile of whole rows: one contiguous stretch of memory, read once. A row
        # holding NaN gives NaN, as torch's amax (tl.max skips NaN).
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.arange(0, BLOCK_C)
        inside = r < rows
        x = tl.load(x_ptr + r[:, None].to(tl.int64) * C + c[None, :], mask=inside[:, None] & (c[None, :] < C),
                    other=float("-inf"))
        nan = tl.max((x != x).to(tl.int32), axis=1) > 0
        tl.store(out_ptr + r, tl.where(nan, float("nan"), tl.max(x, axis=1)), mask=inside)

    @triton.jit(do_not_specialize=["K", "W", "box_batch_stride", "class_batch_stride"])
    def _suppressor_words_kernel(boxes_ptr, classes_ptr, out_ptr, K, W, box_batch_stride, class_batch_stride,
                                 threshold, BLOCK_J: tl.constexpr):
        # Rows j of one image against the 64 candidates i of one word: the IoU in float32 as
        # nms.box_iou_batched computes it, op for op (no fused multiply-add: see the launch), NaN
        # carried through as torch's clamp, minimum and maximum carry it (so it suppresses nothing).
        b = tl.program_id(0)
        j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
        i = tl.program_id(2) * 64 + tl.arange(0, 64)
        row, col = j < K, i < K
        box = boxes_ptr + b.to(tl.int64) * box_batch_stride
        x1j, y1j = tl.load(box + j * 4, mask=row, other=0.0), tl.load(box + j * 4 + 1, mask=row, other=0.0)
        x2j, y2j = tl.load(box + j * 4 + 2, mask=row, other=0.0), tl.load(box + j * 4 + 3, mask=row, other=0.0)
        x1i, y1i = tl.load(box + i * 4, mask=col, other=0.0), tl.load(box + i * 4 + 1, mask=col, other=0.0)
        x2i, y2i = tl.load(box + i * 4 + 2, mask=col, other=0.0), tl.load(box + i * 4 + 3, mask=col, other=0.0)
        area_j = _max(x2j - x1j, 0.0) * _max(y2j - y1j, 0.0)
        area_i = _max(x2i - x1i, 0.0) * _max(y2i - y1i, 0.0)
        inter = _max(_min(x2j[:, None], x2i[None, :]) - _max(x1j[:, None], x1i[None, :]), 0.0)
        inter = inter * _max(_min(y2j[:, None], y2i[None, :]) - _max(y1j[:, None], y1i[None, :]), 0.0)
        union = _max(area_j[:, None] + area_i[None, :] - inter, 1e-9)
        iou = tl.math.div_rn(inter, union)  # correctly rounded, as torch's division
        cls = classes_ptr + b.to(tl.int64) * class_batch_stride
        same = tl.load(cls + j, mask=row, other=-1)[:, None] == tl.load(cls + i, mask=col, other=-2)[None, :]
        hit = (iou > threshold) & same & (i[None, :] < j[:, None])
        word = tl.sum(hit.to(tl.int64) << tl.arange(0, 64).to(tl.int64)[None, :], axis=1)  # distinct bits: an OR
        tl.store(out_ptr + (b.to(tl.int64) * K + j) * W + tl.program_id(2), word, mask=row)


    @triton.jit(do_not_specialize=["K", "W"])
    def _fixed_point_kernel(rows_ptr, valid_ptr, kept_ptr, out_ptr, K, W, WORDS: tl.constexpr):
        # Rows j = 64 w .. 64 w + 63 of image b: keep[j] = valid[j] and no kept i suppresses j
        # (row j's words AND the kept words, all zero), packed as bits into word w of the next
        # kept words (bit t: candidate 64 w + t).
        b = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1) * 64 + tl.arange(0, 64)
        u = tl.arange(0, WORDS)
        inside = j < K
        kept = tl.load(kept_ptr + b * W + u, mask=u < W, other=0)
        row = tl.load(rows_ptr + (b * K + j[:, None]) * W + u[None, :], mask=inside[:, None] & (u[None, :] < W),
                      other=0)
        suppressed = tl.sum(((row & kept[None, :]) != 0).to(tl.int32), axis=1)
        keep = (tl.load(valid_ptr + b * K + j, mask=inside, other=0) != 0) & (suppressed == 0)
        word = tl.sum(keep.to(tl.int64) << tl.arange(0, 64).to(tl.int64), axis=0)  # distinct bits: an OR
        tl.store(out_ptr + b * W + tl.program_id(1), word)


def _fixed_point_constants(words: int) -> dict:
    return dict(WORDS=triton.next_power_of_2(words), num_warps=FIXED_POINT_WARPS)


def _fixed_point(rows: torch.Tensor, valid: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    batch, k = valid.shape
    words = rows.shape[2]
    flags = valid.to(torch.int8, memory_format=torch.contiguous_format)  # read as [B, K] rows
    # Two sets of kept words, each step reading one and writing the other. From none kept (nothing
    # suppresses), the first launch gives valid's words: the torch steps' start; `steps` more follow.
    start = torch.zeros(batch, words, dtype=torch.int64, device=rows.device)
    kept = [start, torch.empty_like(start)]
    constants = _fixed_point_constants(words)
    for step in range(steps + 1):
        _fixed_point_kernel[(batch, words)](rows, flags, kept[step % 2], kept[(step + 1) % 2], k, words, **constants)
    last, before = kept[(steps + 1) % 2], kept[steps % 2]
    bits = (last[:, :, None] >> torch.arange(64, device=rows.device)) & 1  # [B, W, 64]: bit t of word w
    return bits.reshape(batch, -1)[:, :k].bool(), (last == before).all(dim=1)


def _row_max_constants(columns: int) -> dict:
    block, warps = ROW_MAX_LAUNCH
    return dict(C=columns, BLOCK_R=block, BLOCK_C=triton.next_power_of_2(columns), num_warps=warps)


def _row_max(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape[:-1], dtype=x.dtype, device=x.device)
    rows = out.numel()
    _row_max_kernel[(triton.cdiv(rows, ROW_MAX_LAUNCH[0]),)](x, out, rows, **_row_max_constants(x.shape[-1]))
    return out


def _suppressor_words_constants() -> dict:
    block, warps = SUPPRESSOR_LAUNCH
    # enable_fp_fusion=False: inter * ... then area + area - inter stay separate roundings, as in
    # torch's kernels (a fused multiply-add would round once and could flip a pair at the threshold)
    return dict(BLOCK_J=block, num_warps=warps, enable_fp_fusion=False)


def _suppressor_words(boxes: torch.Tensor, classes: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    batch, k = boxes.shape[:2]
    if boxes.stride(1) != 4 or boxes.stride(2) != 1:
        boxes = boxes.contiguous()
    if classes.stride(1) != 1:
        classes = classes.contiguous()
    words = -(-k // 64)
    out = torch.empty(batch, k, words, dtype=torch.int64, device=boxes.device)
    _suppressor_words_kernel[(batch, triton.cdiv(k, SUPPRESSOR_LAUNCH[0]), words)](
        boxes, classes, out, k, words, boxes.stride(0), classes.stride(0), float(iou_threshold),
        **_suppressor_words_constants())
    return out
