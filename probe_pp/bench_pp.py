"""Probe: GPU time of RetinaNet's heads postprocess and its parts, variants side by side."""
import importlib.util
import inspect
import json
import os
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import pipeline.nms as nms
import pipeline.postprocess as pp
from pipeline.postprocess import RetinaNetHeads, Thresholds, image_meta

HERE = Path(__file__).parent
OUT = Path(os.environ.get("OUT", "/tmp")) / "pp.json"
CUDA = torch.cuda.is_available()
dev = torch.device("cuda", 0) if CUDA else torch.device("cpu")
layout = json.load(open(HERE / "layout.json"))
B, C = (16 if CUDA else 2), 91
results = {}


def say(key, value):
    results[key] = value
    print(key, value, flush=True)
    OUT.write_text(json.dumps(results, indent=1))


def graph_ms(fn, n=50):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = 1e9
    for _ in range(3):
        a.record()
        for _ in range(n):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) / n)
    return round(best, 4)


def calls_ms(fn, n=50):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = 1e9
    for _ in range(3):
        a.record()
        for _ in range(n):
            fn()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) / n)
    return round(best, 4)


if not CUDA:  # a dry run of the probe's code on the CPU
    def graph_ms(fn, n=2):
        fn()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return round((time.perf_counter() - t0) / n * 1e3, 2)
    calls_ms = graph_ms
    torch.cuda.get_device_name = lambda: "cpu"
    torch.cuda.synchronize = lambda: None


pp_layout = RetinaNetHeads(layout=layout, device=dev)
A = len(pp_layout.anchors)
g = torch.Generator(device=dev).manual_seed(0)
logits = (torch.randn(B, A, C, device=dev, generator=g) * 1.5 - 7).half()
regression = (torch.randn(B, A, 4, device=dev, generator=g) * 0.1).half()
meta = image_meta(np.ones((B, 2), np.float32), np.zeros((B, 2), np.float32), np.array([[800, 800]] * B), dev)
outputs = {"cls_logits": logits, "bbox_regression": regression}
th = Thresholds(0.05, 0.5, 300)
say("versions", {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()})

# --- the best-class maximum over [B, A, 91] ---
ref = logits.amax(dim=2)
say("amax_torch_ms", graph_ms(lambda: logits.amax(dim=2)))
mp = lambda: F.max_pool1d(logits.view(B, 1, A * C), C, C).view(B, A)
assert torch.equal(mp(), ref)
say("amax_maxpool1d_ms", graph_ms(mp))

try:
    if not CUDA:
        raise RuntimeError("no GPU")
    import triton
    import triton.language as tl

    @triton.jit
    def _rowmax(x_ptr, out_ptr, n_rows, C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_C)
        inside = rows < n_rows
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * C + cols[None, :],
                    mask=inside[:, None] & (cols[None, :] < C), other=float("-inf"))
        tl.store(out_ptr + rows, tl.max(x, axis=1), mask=inside)

    def triton_amax(x, block_r=64, warps=4):
        b, a, c = x.shape
        out = torch.empty(b, a, dtype=x.dtype, device=x.device)
        _rowmax[(triton.cdiv(b * a, block_r),)](x, out, b * a, C=c, BLOCK_R=block_r,
                                                BLOCK_C=triton.next_power_of_2(c), num_warps=warps)
        return out

    t0 = time.perf_counter()
    got = triton_amax(logits)
    torch.cuda.synchronize()
    say("triton_first_call_s", round(time.perf_counter() - t0, 3))
    assert torch.equal(got, ref)
    best = None
    for block_r in (16, 32, 64, 128):
        for warps in (2, 4, 8):
            ms = graph_ms(lambda: triton_amax(logits, block_r, warps))
            say(f"amax_triton_r{block_r}_w{warps}_ms", ms)
            if best is None or ms < best[0]:
                best = (ms, block_r, warps)
    say("amax_triton_best", best)
    TRITON_AMAX = lambda x: triton_amax(x, best[1], best[2])
except Exception as e:
    say("triton_error", repr(e)[:300])
    TRITON_AMAX = None

try:
    if not CUDA:
        raise RuntimeError("no GPU")
    t0 = time.perf_counter()
    camax = torch.compile(lambda x: x.amax(dim=2), fullgraph=True, dynamic=False,
                          options={"coordinate_descent_tuning": True})
    assert torch.equal(camax(logits), ref)
    say("compile_amax_s", round(time.perf_counter() - t0, 2))
    say("amax_compiled_ms", graph_ms(lambda: camax(logits)))
except Exception as e:
    say("compile_amax_error", repr(e)[:300])

# --- candidates: current selection against a direct per-level top-k over pairs ---
say("candidates_ms", graph_ms(lambda: pp_layout.candidates(logits, regression)))


def direct_topk(x):
    start, tops = 0, []
    for n in pp_layout.level_sizes:
        flat = x[:, start:start + n].reshape(B, n * C)
        tops.append(flat.topk(min(1000, n * C), dim=1, sorted=False))
        start += n
    return tops


say("direct_pairs_topk_only_ms", graph_ms(lambda: direct_topk(logits)))


def with_best(fn):
    """RetinaNetHeads.candidates with its best-class maximum done by fn."""
    src = textwrap.dedent(inspect.getsource(pp.RetinaNetHeads.candidates)).replace("logits.amax(dim=2)", "BEST(logits)")
    ns = dict(vars(pp), BEST=fn)
    exec(src, ns)
    return ns["candidates"]


def post_ms(heads):
    return calls_ms(lambda: heads(outputs, meta, num_images=B, thresholds=th))


def check_same(a, b):
    ha, hb = a(outputs, meta, num_images=B, thresholds=th).to_host(), b(outputs, meta, num_images=B, thresholds=th).to_host()
    return bool(np.array_equal(ha.scores, hb.scores) and np.array_equal(ha.boxes_xyxy, hb.boxes_xyxy)
                and np.array_equal(ha.labels, hb.labels))


# --- the whole postprocess (CUDA graph, as the detector runs it) ---
new = RetinaNetHeads(layout=layout, device=dev)
say("post_new_nms_ms", post_ms(new))
spec = importlib.util.spec_from_file_location("old_nms", HERE / "old_nms.py")
old_nms = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old_nms)
saved = nms.fixed_point
nms.fixed_point = old_nms.fixed_point
old = RetinaNetHeads(layout=layout, device=dev)
say("post_old_nms_ms", post_ms(old))
nms.fixed_point = saved
say("old_equals_new", check_same(old, new))
say("top_nms_new_ms", graph_ms(lambda: nms.top_nms(*(lambda s, l, b: (b, s, l, s > 0.05))(
    *pp_layout.candidates(logits, regression)), iou_threshold=0.5, max_kept=300, prefix=1024)))
nms.fixed_point = old_nms.fixed_point
say("top_nms_old_ms", graph_ms(lambda: nms.top_nms(*(lambda s, l, b: (b, s, l, s > 0.05))(
    *pp_layout.candidates(logits, regression)), iou_threshold=0.5, max_kept=300, prefix=1024)))
nms.fixed_point = saved
scores_c, labels_c, boxes_c = pp_layout.candidates(logits, regression)
bx, cl, va = boxes_c[:, :1024].contiguous(), labels_c[:, :1024].contiguous(), (scores_c[:, :1024] > 0.05).contiguous()
say("suppressors_ms", graph_ms(lambda: nms.suppressors(bx, cl, iou_threshold=0.5)))
by = nms.suppressors(bx, cl, iou_threshold=0.5)
say("packed_bits_ms", graph_ms(lambda: nms.packed_bits(by)))
say("fixed_point_new_ms", graph_ms(lambda: nms.fixed_point(by, va, max_iterations=16)))
say("fixed_point_old_ms", graph_ms(lambda: old_nms.fixed_point(by, va, max_iterations=16)))
say("iou_only_ms", graph_ms(lambda: nms.box_iou_batched(bx)))


def suppressors_pairs(boxes, classes, *, iou_threshold):
    k = boxes.shape[1]
    b = boxes.float()
    lo = torch.maximum(b[:, :, None, :2], b[:, None, :, :2])
    wh = torch.minimum(b[:, :, None, 2:], b[:, None, :, 2:]).sub_(lo).clamp_(min=0)
    inter = wh[..., 0] * wh[..., 1]
    area = (b[..., 2:] - b[..., :2]).clamp(min=0).prod(-1)
    union = (area[:, :, None] + area[:, None]).sub_(inter).clamp_(min=1e-9)
    out = inter.div_(union) > iou_threshold
    out &= classes[:, :, None] == classes[:, None, :]
    out &= torch.ones(k, k, dtype=torch.bool, device=boxes.device).tril_(diagonal=-1)
    return out


say("suppressors_pairs_ms", graph_ms(lambda: suppressors_pairs(bx, cl, iou_threshold=0.5)))
say("suppressors_pairs_same", bool(torch.equal(suppressors_pairs(bx, cl, iou_threshold=0.5), by)))
say("candidates_again_ms", graph_ms(lambda: pp_layout.candidates(logits, regression)))

for name, fn in (("maxpool", lambda x: F.max_pool1d(x.view(x.shape[0], 1, -1), x.shape[2], x.shape[2]).view(x.shape[:2])),
                 ("triton", TRITON_AMAX)):
    if fn is None:
        continue
    heads = RetinaNetHeads(layout=layout, device=dev)
    heads.candidates = with_best(fn).__get__(heads)
    heads._packed = heads.packed
    say(f"post_{name}_amax_ms", post_ms(heads))
    say(f"{name}_equals_new", check_same(heads, new))

if CUDA and os.environ.get("COMPILE", "1") == "1":
    t0 = time.perf_counter()
    compiled = RetinaNetHeads(layout=layout, device=dev, compile=True)
    compiled(outputs, meta, num_images=B, thresholds=th).to_host()
    say("compile_post_first_call_s", round(time.perf_counter() - t0, 1))
    say("compiled_ok", compiled._packed.compiled is not None)
    say("post_compiled_ms", post_ms(compiled))
    say("compiled_equals_new", check_same(compiled, new))
print(json.dumps(results))
