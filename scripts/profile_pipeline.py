"""What the GPU does while gpudet's pipeline runs: every kernel of the process, per CUDA stream (issue 4).

    python scripts/profile_pipeline.py LIST --config configs/retinaface_mnet025_heads_fp16.yaml \
        [--limit 640] [--set KEY=VALUE ...] [--json FILE]

`gpudet bench` says how fast the pipeline runs and how long its loop waited on each stage; this
says what the device did meanwhile. Under torch's profiler (CUPTI records the kernels, copies and
memsets of the whole process: ORT's, DALI's and torch's alike) it runs `Detector.stream` over the
images once, after a warm-up pass over two batches, and reports:

- per stream: kernels, busy ms (the union of their intervals), the share of the run, the heaviest
  kernels;
- the device: busy ms over all streams together;
- the model's stream (the busiest one): how much of its busy time ran beside each other stream's
  work, and its idle gaps (between its first and last kernel; in the pipeline the model runs
  back to back, so these are the times it waited for a batch).

Nothing is written but the report. Needs a GPU; `--help` works anywhere.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, overlapping or touching (start, end) intervals joined."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two merged interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, end - start)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarize(events: list[dict], *, top: int = 5, min_gap_us: float = 20.0) -> dict:
    """events: {"name", "ts", "dur" (us), "stream"} per kernel/copy/memset -> the report (ms)."""
    if not events:
        return {"streams": {}, "device_busy_ms": 0.0, "span_ms": 0.0}
    span = (min(e["ts"] for e in events), max(e["ts"] + e["dur"] for e in events))
    per_stream: dict[int, list[dict]] = collections.defaultdict(list)
    for e in events:
        per_stream[e["stream"]].append(e)
    busy = {s: merged([(e["ts"], e["ts"] + e["dur"]) for e in es]) for s, es in per_stream.items()}
    busy_us = {s: length(ivs) for s, ivs in busy.items()}
    order = sorted(busy, key=lambda s: -busy_us[s])  # the busiest first: the model's
    streams = {}
    for s in order:
        by_name = collections.Counter()
        for e in per_stream[s]:
            by_name[e["name"]] += e["dur"]
        streams[str(s)] = {
            "kernels": len(per_stream[s]), "busy_ms": round(busy_us[s] / 1e3, 3),
            "share_of_span": round(busy_us[s] / (span[1] - span[0]), 4),
            "heaviest_ms": {name[:90]: round(us / 1e3, 3) for name, us in by_name.most_common(top)}}
    model = order[0]
    own = busy[model]
    gaps = [b[0] - a[1] for a, b in zip(own, own[1:]) if b[0] - a[1] >= min_gap_us]
    return {
        "span_ms": round((span[1] - span[0]) / 1e3, 3),
        "device_busy_ms": round(length(merged([iv for ivs in busy.values() for iv in ivs])) / 1e3, 3),
        "streams": streams,
        "model_stream": str(model),
        "model_stream_beside_ms": {str(s): round(overlap(own, ivs) / 1e3, 3) for s, ivs in busy.items() if s != model},
        "model_stream_gaps": {"count": len(gaps), "total_ms": round(sum(gaps) / 1e3, 3),
                              "longest_ms": round(max(gaps, default=0) / 1e3, 3), "min_gap_us": min_gap_us},
    }


def device_events(trace_path: Path) -> list[dict]:
    """Kernels, copies and memsets from a chrome trace torch's profiler wrote."""
    trace = json.loads(trace_path.read_text())
    return [{"name": e["name"], "ts": float(e["ts"]), "dur": float(e["dur"]), "stream": e["args"]["stream"]}
            for e in trace.get("traceEvents", []) if e.get("cat") in DEVICE_WORK and "stream" in e.get("args", {})]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("images", help="file list (scripts/make_image_set.py writes one)")
    parser.add_argument("--config", default=None, help="gpudet config (default: the embedded RetinaFace)")
    parser.add_argument("--limit", type=int, default=640, help="images profiled (default 640)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--top", type=int, default=5, help="heaviest kernels listed per stream")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from pipeline.config import load_config
    from pipeline.detector import Detector, StageClock
    from pipeline.source import list_images

    if not torch.cuda.is_available():
        sys.exit("profile_pipeline.py profiles the GPU path: no CUDA device here")
    detector = Detector(load_config(args.config, args.overrides + ["run.device=cuda"]))
    refs = list_images(args.images)[:args.limit]
    list(detector.stream(refs[:2 * detector.config.run.batch_size], lambda errors: None))  # warm-up
    clock = StageClock()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        images = sum(len(batch.refs) for batch, _ in detector.stream(refs, lambda errors: None, clock=clock))
        wall = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        report = summarize(device_events(trace), top=args.top)
    report = {"config": args.config, "overrides": args.overrides, "images": images,
              "images_per_s_under_the_profiler": round(images / wall, 1),
              "stages_s": {k: round(v, 4) for k, v in clock.seconds.items()}, **report}
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)


if __name__ == "__main__":
    main()
