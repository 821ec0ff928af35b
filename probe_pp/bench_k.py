"""Probe: the Triton kernels' launch shapes, and the whole heads postprocess with and without them."""
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from pipeline import kernels, nms
from pipeline.postprocess import RetinaNetHeads, SsdHeads, Thresholds, image_meta

HERE = Path(__file__).parent
OUT = Path(os.environ.get("OUT", "/tmp")) / "k.json"
dev = torch.device("cuda", 0)
layout = json.load(open(HERE / "layout.json"))
B, C = 16, 91
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


say("versions", {"torch": torch.__version__, "triton": kernels.triton.__version__, "gpu": torch.cuda.get_device_name()})
heads = RetinaNetHeads(layout=layout, device=dev)
A = len(heads.anchors)
g = torch.Generator(device=dev).manual_seed(0)
logits = (torch.randn(B, A, C, device=dev, generator=g) * 1.5 - 7).half()
regression = (torch.randn(B, A, 4, device=dev, generator=g) * 0.1).half()
meta = image_meta(np.ones((B, 2), np.float32), np.zeros((B, 2), np.float32), np.array([[800, 800]] * B), dev)
outputs = {"cls_logits": logits, "bbox_regression": regression}
th = Thresholds(0.05, 0.5, 300)

t0 = time.perf_counter()
kernels.row_max(logits)
torch.cuda.synchronize()
say("row_max_first_call_s", round(time.perf_counter() - t0, 3))
say("amax_torch_ms", graph_ms(lambda: logits.amax(dim=2)))
best = None
for launch in ((8, 1), (16, 1), (32, 1), (64, 1), (16, 2), (32, 2), (64, 2), (32, 4)):
    kernels.ROW_MAX_LAUNCH = launch
    assert torch.equal(kernels.row_max(logits), logits.amax(dim=2))
    ms = graph_ms(lambda: kernels.row_max(logits))
    say(f"row_max_{launch}_ms", ms)
    best = min(best or (ms, launch), (ms, launch))
say("row_max_best", best)
kernels.ROW_MAX_LAUNCH = best[1]

scores, labels, boxes = heads.candidates(logits, regression)
bx, cl = boxes[:, :1024], labels[:, :1024]
t0 = time.perf_counter()
kernels.suppressor_words(bx, cl, iou_threshold=0.5)
torch.cuda.synchronize()
say("suppressor_first_call_s", round(time.perf_counter() - t0, 3))
reference = nms.packed_bits(nms.suppressors(bx, cl, iou_threshold=0.5))
say("suppressors_torch_ms", graph_ms(lambda: nms.packed_bits(nms.suppressors(bx, cl, iou_threshold=0.5))))
best = None
for launch in ((16, 1), (32, 1), (32, 2), (64, 2), (64, 4), (128, 4), (128, 8)):
    kernels.SUPPRESSOR_LAUNCH = launch
    assert torch.equal(kernels.suppressor_words(bx, cl, iou_threshold=0.5), reference)
    ms = graph_ms(lambda: kernels.suppressor_words(bx, cl, iou_threshold=0.5))
    say(f"suppressor_{launch}_ms", ms)
    best = min(best or (ms, launch), (ms, launch))
say("suppressor_best", best)
kernels.SUPPRESSOR_LAUNCH = best[1]
valid = scores[:, :1024] > 0.05
rows = kernels.suppressor_words(bx, cl, iou_threshold=0.5)
say("fixed_point_ms", graph_ms(lambda: nms.fixed_point(rows, valid, max_iterations=16)))
say("candidates_ms", graph_ms(lambda: heads.candidates(logits, regression)))


def run(h):
    return h(outputs, meta, num_images=B, thresholds=th)


say("post_triton_ms", calls_ms(lambda: run(heads)))
with_triton = run(heads).to_host()
saved = kernels.triton
kernels.triton = None
plain = RetinaNetHeads(layout=layout, device=dev)
say("post_torch_ms", calls_ms(lambda: run(plain)))
without = run(plain).to_host()
kernels.triton = saved
say("post_same", bool(np.array_equal(with_triton.scores, without.scores)
                      and np.array_equal(with_triton.boxes_xyxy, without.boxes_xyxy)
                      and np.array_equal(with_triton.labels, without.labels)))
say("detections", len(with_triton.scores))
print(json.dumps(results))
