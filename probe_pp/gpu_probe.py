"""One-off probe (kept in git history for its command): setup by phase, loop rate and the GPU kernel timeline of gpudet's loop."""
import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path

T0 = time.perf_counter()
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import pipeline.detector as D  # noqa: E402
from pipeline.bench import gpudet_passes, model_images_per_s  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.detector import Detector  # noqa: E402
from pipeline.source import EncodedImage, list_images, read_checked  # noqa: E402

IMPORTS_S = time.perf_counter() - T0
OUT = Path(os.environ.get("OUT", "/tmp/probe"))


def union(ivs):
    total, end = 0.0, -1e30
    for a, b in sorted(ivs):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def classify(name):
    low = name.lower()
    if "dali" in low or "nvjpeg" in low:
        return "dali"
    if "at::" in name or "c10::" in name or "triton" in low or "at_cuda" in low:
        return "torch"
    return "ort"


def gpu_stats(trace_path, batches):
    ev = [e for e in json.load(open(trace_path))["traceEvents"]
          if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not ev:
        return {"events": 0}
    t0 = min(e["ts"] for e in ev)
    t1 = max(e["ts"] + e["dur"] for e in ev)
    streams, cats, names = defaultdict(list), defaultdict(list), defaultdict(lambda: [0.0, 0])
    for e in ev:
        iv = (e["ts"], e["ts"] + e["dur"])
        s = str(e["args"].get("stream"))
        c = e["cat"] if e["cat"] != "kernel" else classify(e["name"])
        streams[s].append((iv, c))
        cats[c].append(iv)
        names[(s, c, e["name"][:100])][0] += e["dur"]
        names[(s, c, e["name"][:100])][1] += 1
    allv = [iv for ivs in cats.values() for iv in ivs]
    out = {"events": len(ev), "span_ms": round((t1 - t0) / 1e3, 1), "busy_union_ms": round(union(allv) / 1e3, 1),
           "batches": batches, "categories": {}, "streams": {}, "top": []}
    for c, ivs in cats.items():
        others = [iv for k, v in cats.items() if k != c for iv in v]
        u, uo = union(ivs), union(others)
        out["categories"][c] = {"sum_ms": round(sum(b - a for a, b in ivs) / 1e3, 1), "union_ms": round(u / 1e3, 1),
                                "overlapped_by_others_ms": round((u + uo - union(ivs + others)) / 1e3, 1),
                                "per_batch_ms": round(u / 1e3 / max(batches, 1), 3), "count": len(ivs)}
    for s, items in streams.items():
        ivs = [iv for iv, _ in items]
        kinds = defaultdict(float)
        for (a, b), c in items:
            kinds[c] += b - a
        out["streams"][s] = {"union_ms": round(union(ivs) / 1e3, 1), "count": len(ivs),
                             "by_category_ms": {k: round(v / 1e3, 1) for k, v in kinds.items()}}
    for (s, c, n), (d, k) in sorted(names.items(), key=lambda x: -x[1][0])[:45]:
        out["top"].append({"stream": s, "cat": c, "ms": round(d / 1e3, 1), "n": k, "name": n})
    return out


def profiled(fn, tag, batches):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    path = f"/tmp/trace_{tag}.json"
    prof.export_chrome_trace(path)
    stats = gpu_stats(path, batches)
    stats["wall_ms_under_profiler"] = round(wall * 1e3, 1)
    return stats


def main():
    p = argparse.ArgumentParser()
    p.add_argument("images")
    p.add_argument("--tag", required=True)
    p.add_argument("--config")
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--limit", type=int, default=4000)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--priority", type=int)
    p.add_argument("--cudnn-search")
    p.add_argument("--setup-profile", action="store_true")
    p.add_argument("--gpu-profile", action="store_true")
    p.add_argument("--ort-alone", action="store_true")
    a = p.parse_args()
    report = {"tag": a.tag, "argv": sys.argv[1:], "imports_s": round(IMPORTS_S, 2)}
    if a.cudnn_search:
        base = D.cuda_ep_options
        D.cuda_ep_options = lambda run: {**base(run), "cudnn_conv_algo_search": a.cudnn_search}
    if a.priority is not None:
        orig = torch.cuda.Stream

        class Prio(orig):
            def __new__(cls, device=None, priority=0, **kw):
                return orig.__new__(cls, device, priority=a.priority, **kw)
        torch.cuda.Stream = Prio
    phases = {}

    def timed(owner, name, label):
        fn = getattr(owner, name)

        def wrapper(*args, **kw):
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                phases[label] = round(phases.get(label, 0) + time.perf_counter() - t, 3)
        setattr(owner, name, wrapper)
    import pipeline.engine as E
    timed(E.Engine, "__init__", "engine_init")
    timed(E.Engine, "_session", "ort_session")
    timed(E.Engine, "warm_up", "engine_warm_up")
    timed(D.Detector, "_warm_up_postprocess", "postprocess_warm_up")
    timed(D, "Preprocessor", "dali_pipeline")
    config = load_config(a.config, [*a.set, "run.device=cuda"])
    refs = list_images(a.images)[:a.limit]
    torch.cuda.init()
    start = time.perf_counter()
    if a.setup_profile:
        prof = cProfile.Profile()
        prof.enable()
    detector = Detector.from_config(config)
    if a.setup_profile:
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(70)
        (OUT / f"setup_{a.tag}.txt").write_text(s.getvalue())
    built = time.perf_counter() - start
    list(detector.stream(refs[:detector.batch_size], lambda errors: None))
    report["setup_s"] = {"from_config": round(built, 2), "with_first_batch": round(time.perf_counter() - start, 2),
                         **phases}
    if a.priority is not None:
        torch.cuda.Stream = orig
        report["engine_stream_priority"] = detector.engine.stream.priority
    report["cuda_options"] = detector.engine.cuda_options
    runs = gpudet_passes(refs, detector, passes=a.passes, warm_up=False)
    report["passes"] = [{"images_per_s": round(r.images_per_s, 1), "seconds": round(r.seconds, 3),
                         "detections_per_image": round(r.detections_per_image, 2), "stages": r.stages} for r in runs]
    batches = -(-len(refs) // detector.batch_size)
    if a.gpu_profile:
        report["gpu_loop"] = profiled(lambda: gpudet_passes(refs, detector, passes=1, warm_up=False), a.tag, batches)
    if a.ort_alone:
        items = [i for i in map(read_checked, refs[:detector.batch_size]) if isinstance(i, EncodedImage)]
        report["ort_alone_img_s"] = [round(model_images_per_s(items, detector, iterations=50), 1) for _ in range(2)]
        best = max(r.images_per_s for r in runs)
        report["gpudet_over_ort_alone"] = round(best / max(report["ort_alone_img_s"]), 3)
        if a.gpu_profile:
            report["gpu_ort_alone"] = profiled(lambda: model_images_per_s(items, detector, iterations=50),
                                               a.tag + "_ort", 53)
    (OUT / f"probe_{a.tag}.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k not in ("gpu_loop", "gpu_ort_alone")}))
    for k in ("gpu_loop", "gpu_ort_alone"):
        if k in report:
            g = report[k]
            print(k, {x: g[x] for x in ("span_ms", "busy_union_ms", "wall_ms_under_profiler")}, g["categories"])


if __name__ == "__main__":
    main()
