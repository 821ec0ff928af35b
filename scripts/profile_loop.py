"""Where the GPU idles in gpudet's loop: a CUPTI timeline of `gpudet detect`'s loop, summarised.

The loop (Detector.stream_batches into an output folder, as `gpudet detect` runs it) runs once to
warm up, then once under torch.profiler, which sees the CUDA work of every library in the process
(DALI's and nvJPEG's, ONNX Runtime's, torch's and Triton's kernels and copies) and the CUDA calls
of every host thread. gpudet's stages on the loop's thread are marked on the timeline. Writes
trace.json (open it in Perfetto; --trace puts it elsewhere) and profile.json: the GPU's busy share over the loop (any
stream), each stream's, the kernels' time by name, and the idle gaps: how long, and what each host
thread was doing during them (the CUDA call it sat in; the loop's stage).

    python scripts/profile_loop.py LIST --out DIR [--config NAME] [--limit 4000] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
import tempfile
from collections import defaultdict
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pipeline.bench import code_version, machine  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.detector import Detector  # noqa: E402
from pipeline.folder import OutputFolder  # noqa: E402
from pipeline.job import record_stream  # noqa: E402
from pipeline.listing import list_images  # noqa: E402
from pipeline.source import batched  # noqa: E402
from pipeline.timing import StageClock  # noqa: E402

GPU_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_KINDS = ("cuda_runtime", "cuda_driver")


class MarkedClock(StageClock):
    """gpudet's stage clock, each stage also a range on the profiler's timeline."""

    @contextmanager
    def __call__(self, stage: str):
        with super().__call__(stage), torch.profiler.record_function(f"stage: {stage}"):
            yield


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def overlap_with(gaps: list[tuple[float, float]], starts: list[float], start: float, end: float) -> float:
    """Microseconds of [start, end) inside the gaps (sorted, disjoint; `starts`: their starts)."""
    total, i = 0.0, max(0, bisect.bisect_right(starts, start) - 1)
    while i < len(gaps) and gaps[i][0] < end:
        total += max(0.0, min(end, gaps[i][1]) - max(start, gaps[i][0]))
        i += 1
    return total


def summarise(trace: dict, min_gap_us: float = 20.0) -> dict:
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    loop = max((e for e in events if e.get("name") == "gpudet loop"), key=lambda e: e["dur"])
    lo, hi = loop["ts"], loop["ts"] + loop["dur"]
    inside = [e for e in events if e["ts"] < hi and e["ts"] + e["dur"] > lo]
    gpu = [e for e in inside if e.get("cat") in GPU_KINDS]
    busy = union([(max(lo, e["ts"]), min(hi, e["ts"] + e["dur"])) for e in gpu])
    busy_us = sum(b - a for a, b in busy)
    gaps = [(a, b) for a, b in zip([lo] + [b for _, b in busy], [a for a, _ in busy] + [hi]) if b - a >= min_gap_us]
    starts = [g[0] for g in gaps]
    by_stream: dict[str, list] = defaultdict(list)
    by_name: dict[str, float] = defaultdict(float)
    for e in gpu:
        by_stream[str(e.get("args", {}).get("stream", "?"))].append((e["ts"], e["ts"] + e["dur"]))
        by_name[f"{e['cat']}: {e['name'][:90]}"] += e["dur"]
    host: dict[str, float] = defaultdict(float)  # (thread, what) -> microseconds inside the gaps
    for e in inside:
        if e.get("cat") in HOST_KINDS or str(e.get("name", "")).startswith("stage: "):
            idle = overlap_with(gaps, starts, e["ts"], e["ts"] + e["dur"])
            if idle:
                host[f"thread {e.get('tid')}: {e['name']}"] += idle
    idle_us = sum(b - a for a, b in gaps)
    lengths = sorted(b - a for a, b in gaps)
    return {
        "loop_s": round((hi - lo) / 1e6, 3),
        "gpu_busy_percent": round(100 * busy_us / (hi - lo), 1),
        "streams_busy_percent": {s: round(100 * sum(b - a for a, b in union(v)) / (hi - lo), 1)
                                 for s, v in sorted(by_stream.items(), key=lambda kv: -len(kv[1]))},
        "idle_gaps": {"count": len(gaps), "seconds": round(idle_us / 1e6, 4),
                      "median_us": round(lengths[len(lengths) // 2], 1) if lengths else 0,
                      "longest_us": round(lengths[-1], 1) if lengths else 0, "at_least_us": min_gap_us},
        "during_idle_ms": {k: round(v / 1e3, 1) for k, v in sorted(host.items(), key=lambda kv: -kv[1])[:30]},
        "gpu_time_by_name_ms": {k: round(v / 1e3, 1) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:30]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("images", help="an image list or folder")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--config", default=None, help="a config name or file (default: the embedded default)")
    parser.add_argument("--limit", type=int, default=4000)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--trace", type=Path, help="where trace.json goes (default: --out; it is large)")
    a = parser.parse_args()
    trace = a.trace or a.out / "trace.json"
    a.out.mkdir(parents=True, exist_ok=True)
    config = load_config(a.config, ["run.device=cuda", *a.set])
    detector = Detector.from_config(config)
    refs = list_images(a.images)[:a.limit]

    def loop(clock: StageClock) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            with OutputFolder(tmp) as folder, folder.writing():
                record_stream(detector, batched(refs, detector.batch_size), folder, clock=clock)

    loop(StageClock())  # warm-up: every graph captured, every cache filled
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        with torch.profiler.record_function("gpudet loop"):
            loop(MarkedClock())
        torch.cuda.synchronize()
    profiler.export_chrome_trace(str(trace))
    summary = {"images": len(refs), "config": a.config or "default", "set": a.set,
               "gpudet": code_version(), "machine": machine(), "date": datetime.now(timezone.utc).isoformat(),
               "command": " ".join(sys.argv), **summarise(json.loads(trace.read_text()))}
    (a.out / "profile.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
