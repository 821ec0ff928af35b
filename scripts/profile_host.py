"""Where the host's time goes while gpudet's pipeline runs (issue 4): py-spy samples of every
Python thread, during the timed pass only.

    python scripts/profile_host.py LIST --config configs/retinaface_mnet025_heads_fp16.yaml \
        [--limit 4000] [--repeat 3] [--set KEY=VALUE ...] [--rate 500] [--raw DIR] [--json FILE]

On the H200 RetinaFace's model stream stands idle 43-46% of the pass (scripts/profile_pipeline.py,
docs/BENCHMARKS.md): the pipeline waits on the host. This builds the detector, warms it up, then
runs `gpudet bench`'s own pass (Detector.stream, JSONL records written) twice, each under
`py-spy record --pid` attached to this process (nonblocking: py-spy reads the process's memory
while it runs, so the pass's images/s here are lower than gpudet bench's):

- `--gil`: only the thread holding the GIL, at each sample. Samples / (rate x seconds) is the share
  of the pass in which some thread held it: near 1, Python itself is the bound, and the threads
  that hold it longest are where to cut;
- `--idle`: every Python thread at every sample, whether it runs or waits (for the GIL, a lock, the
  GPU): where each thread spends its time.

Per thread (a pool's threads together: gpudet-read_0..3 -> gpudet-read) it reports the samples,
the innermost frames (where the time is spent) and the innermost frames in gpudet's own code (which
of gpudet's lines leads there). Needs py-spy (`pip install py-spy`) and leave to attach: the same
user, and Yama's ptrace_scope at most 1 (this process allows it with prctl(PR_SET_PTRACER)).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

OWN_CODE = "(pipeline/"  # py-spy writes frames as "function (path/relative/to/sys.path.py:line)"


def thread_group(name: str) -> str:
    """A ThreadPoolExecutor numbers its threads (gpudet-read_3): one group per pool."""
    return re.sub(r"_\d+$", "", name)


def parse_raw(text: str) -> list[tuple[str, list[str], int]]:
    """py-spy's raw output with --threads, one stack per line: "thread (TID): NAME;outer frame;...;
    inner frame COUNT" -> (thread name, frames outermost first, samples)."""
    samples = []
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        head, *frames = stack.split(";")
        name = head.split(": ", 1)[1] if head.startswith("thread (") and ": " in head else head
        samples.append((name, frames, int(count)))
    return samples


def summarize(samples: list[tuple[str, list[str], int]], *, rate: float, seconds: float, top: int = 6) -> dict:
    """Samples per thread group and its heaviest innermost frames, overall and in gpudet's code.
    share_of_pass: samples / (rate x seconds), the threads sampled per moment of the pass (with
    --gil: the share of the pass in which some thread held the GIL)."""
    per_group: collections.Counter = collections.Counter()
    inner: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    own: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for name, frames, count in samples:
        group = thread_group(name)
        per_group[group] += count
        inner[group][frames[-1] if frames else "(no Python frame)"] += count
        ours = [f for f in frames if OWN_CODE in f]
        own[group][ours[-1] if ours else "(outside gpudet's code)"] += count
    total = sum(per_group.values())
    expected = rate * seconds
    return {
        "samples": total, "seconds": round(seconds, 3), "rate_hz": rate,
        "share_of_pass": round(total / expected, 3) if expected else None,
        "threads": {group: {"samples": n, "share_of_samples": round(n / total, 3),
                            "innermost": dict(inner[group].most_common(top)),
                            "innermost_in_gpudet": dict(own[group].most_common(top))}
                    for group, n in per_group.most_common()},
    }


def format_summary(mode: str, report: dict) -> str:
    lines = [f"== py-spy --{mode}: {report['samples']} samples over {report['seconds']:.2f} s at "
             f"{report['rate_hz']:.0f} Hz (share of the pass: {report['share_of_pass']})"]
    for group, t in report["threads"].items():
        lines.append(f"  {group}: {t['samples']} samples ({t['share_of_samples']:.0%})")
        lines += [f"      {n:6d}  {frame}" for frame, n in t["innermost"].items()]
        lines.append("    in gpudet's code:")
        lines += [f"      {n:6d}  {frame}" for frame, n in t["innermost_in_gpudet"].items()]
    return "\n".join(lines)


def allow_tracing_by_children() -> None:
    """Yama (ptrace_scope 1) lets a process be traced only by its ancestors: allow any (py-spy,
    our child). Nothing to do, and a harmless failure, where Yama is absent."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(0x59616D61, ctypes.c_ulong(2**64 - 1), 0, 0, 0)  # PR_SET_PTRACER, _ANY


def sampled(py_spy: str, mode: str, rate: int, raw: Path, run) -> tuple[object, float, str]:
    """run() with py-spy attached to this process; returns run's result, its seconds, py-spy's raw text."""
    process = subprocess.Popen([py_spy, "record", "--pid", str(os.getpid()), "--threads", "--nonblocking",
                                f"--{mode}", "-r", str(rate), "-f", "raw", "-o", str(raw)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = process.stdout.readline()  # "py-spy> Sampling process ..." once attached, else its error
    if "Sampling" not in first:
        process.wait(timeout=30)
        sys.exit(f"py-spy could not attach to this process: {(first + process.stdout.read()).strip()}")
    start = time.perf_counter()
    result = run()
    seconds = time.perf_counter() - start
    process.send_signal(signal.SIGINT)  # py-spy writes its file when interrupted
    process.communicate(timeout=60)
    if not raw.is_file():
        sys.exit(f"py-spy wrote no samples to {raw} (exit status {process.returncode})")
    return result, seconds, raw.read_text()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("images", help="file list (scripts/make_image_set.py writes one)")
    parser.add_argument("--config", default=None, help="gpudet config (default: the embedded RetinaFace)")
    parser.add_argument("--limit", type=int, default=4000, help="images from the list (default 4000)")
    parser.add_argument("--repeat", type=int, default=3, help="passes over them per sampled run (default 3)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--rate", type=int, default=500, help="py-spy samples per second (default 500)")
    parser.add_argument("--top", type=int, default=6, help="frames listed per thread")
    parser.add_argument("--raw", type=Path, help="keep py-spy's raw files in this folder")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args()

    py_spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if py_spy is None:
        sys.exit("profile_host.py needs py-spy on PATH: pip install py-spy")

    from pipeline.bench import gpudet_passes
    from pipeline.config import load_config
    from pipeline.detector import Detector
    from pipeline.source import ImageRef, list_images

    detector = Detector(load_config(args.config, args.overrides))
    listed = list_images(args.images)[:args.limit]
    refs = [ImageRef(i, r.path) for i, r in enumerate(listed * args.repeat)]
    gpudet_passes(refs[:4 * detector.config.run.batch_size], detector)  # warm-up: compile, caches
    allow_tracing_by_children()
    report = {"config": args.config, "overrides": args.overrides, "images": len(refs),
              "device": detector.device.describe()}
    with tempfile.TemporaryDirectory() as scratch:  # py-spy's files, unless --raw keeps them
        folder = args.raw or Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        for mode in ("gil", "idle"):
            (rate, stages), seconds, raw = sampled(py_spy, mode, args.rate, folder / f"pyspy_{mode}.txt",
                                                   lambda: gpudet_passes(refs, detector)[0])
            report[mode] = {"images_per_s": round(rate, 1), "stages_s": stages,
                            **summarize(parse_raw(raw), rate=args.rate, seconds=seconds, top=args.top)}
            print(f"images/s while sampled: {rate:.1f}; stages (s the loop waited): {stages}")
            print(format_summary(mode, report[mode]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
