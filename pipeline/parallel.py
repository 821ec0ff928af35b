"""Several devices of one host: one worker process per device, each with its own DALI pipeline
and ORT session on its share of the images, merged into the usual output files.

    out/shards/K/{detections,errors}.jsonl, summary.json   what worker K wrote (append-only)
    out/{detections,errors}.jsonl                          the merge: every input exactly once
    out/summary.json                                       totals and one entry per worker

The parent lists the images, takes out those already recorded (--resume), deals the rest
round-robin to the workers (`todo[k::n]`, so every input goes to exactly one), starts them
(spawn: CUDA cannot be forked), shows one progress bar from the shard files, and merges when all
have stopped. A worker that fails is reported with its device and exit code; what it wrote stays
in its shard and a --resume picks up the rest.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import shutil
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

from . import __version__
from .config import Config
from .device import DeviceError
from .runner import RESULT_FILES, RunResult, images_to_do, process, read_complete_records, write_json_atomic
from .source import ImageRef, list_images


def parse_devices(text: str) -> list[str]:
    """'0,1' -> cuda:0, cuda:1; 'all' -> every visible GPU; 'cpu,cpu' -> two CPU workers."""
    if text == "all":
        import torch

        count = torch.cuda.device_count()
        if count == 0:
            raise DeviceError("--devices all: no CUDA GPU is visible; use --device cpu or --devices cpu,cpu")
        return [f"cuda:{i}" for i in range(count)]
    devices = []
    for item in text.split(","):
        item = item.strip()
        if re.fullmatch(r"\d+", item):
            item = f"cuda:{item}"
        if not re.fullmatch(r"cpu|cuda:\d+", item):
            raise DeviceError(f"--devices {text}: {item!r} is not a GPU index, cuda:N or cpu")
        devices.append(item)
    if len(devices) < 1:
        raise DeviceError(f"--devices {text}: no device")
    return devices


def _worker(todo: list[ImageRef], out: str, config: Config, source: str, images: int) -> None:
    """One worker process: the single-device run over its share, exit code as `gpudet detect`'s."""
    from .cli import guarded, setup_logging

    setup_logging("WARNING", False, False)
    Path(out).mkdir(parents=True, exist_ok=True)
    code = guarded(lambda: process(todo, Path(out), config, append=True, progress=False, source=source,
                                   images=images).exit_code)
    sys.exit(code)


def _lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    except FileNotFoundError:
        return 0


def merge_results(out: Path, shards: list[Path]) -> dict[str, int]:
    """Rewrite out/{detections,errors}.jsonl as the union, by image index, of what they held and
    what the shards hold; streamed, replaced atomically. Returns records per file."""
    counts = {}
    for name in RESULT_FILES:
        seen: set[int] = set()
        tmp = out / (name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as merged:
            for path in [out / name] + [shard / name for shard in shards]:
                for record in read_complete_records(path):
                    if record["index"] not in seen:
                        seen.add(record["index"])
                        merged.write(json.dumps(record, ensure_ascii=False) + "\n")
        os.replace(tmp, out / name)
        counts[name] = len(seen)
    return counts


def run_on_devices(source: str, out_dir: str | Path, config: Config, devices: list[str], *, root: str | None = None,
                   progress: bool | None = None, resume: bool = False, overwrite: bool = False) -> RunResult:
    """`gpudet detect --devices ...`: one worker per device, results merged into out_dir."""
    started = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards = [out / "shards" / str(k) for k in range(len(devices))]
    if overwrite:
        shutil.rmtree(out / "shards", ignore_errors=True)
    refs = list_images(source, root=root)
    earlier = sorted((out / "shards").glob("*/*.jsonl")) if (out / "shards").is_dir() else []
    todo = images_to_do(out, refs, resume=resume, overwrite=overwrite, also=earlier)
    if overwrite:
        for name in RESULT_FILES:
            (out / name).unlink(missing_ok=True)
    context = multiprocessing.get_context("spawn")
    workers = []
    for k, device in enumerate(devices):
        worker_config = replace(config, run=replace(config.run, device=device))
        process_ = context.Process(target=_worker, args=(todo[k::len(devices)], str(shards[k]), worker_config,
                                                         str(source), len(refs)), name=f"gpudet-{device}")
        process_.start()
        workers.append(process_)
    _wait_with_progress(workers, shards, len(todo), progress)
    counts = merge_results(out, [s for s in shards if s.is_dir()])
    return _summarise(source, out, refs, todo, devices, workers, shards, counts, started)


def _wait_with_progress(workers: list, shards: list[Path], total: int, progress: bool | None) -> None:
    from tqdm import tqdm

    show = sys.stderr.isatty() if progress is None else progress
    baseline = sum(_lines(s / name) for s in shards for name in RESULT_FILES)
    with tqdm(total=total, unit="img", disable=not show, dynamic_ncols=True) as bar:
        try:
            while any(w.is_alive() for w in workers):
                time.sleep(0.5)
                bar.n = sum(_lines(s / name) for s in shards for name in RESULT_FILES) - baseline
                bar.refresh()
        except KeyboardInterrupt:  # the workers got the same SIGINT; let them finish their batch
            for w in workers:
                w.join()
            raise
        for w in workers:
            w.join()


def _summarise(source, out: Path, refs, todo, devices, workers, shards, counts, started) -> RunResult:
    per_worker, failed_by_reason, failed_workers = [], Counter(), []
    for device, worker, shard in zip(devices, workers, shards, strict=True):
        summary_path = shard / "summary.json"
        s = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        per_worker.append({"device": device, "exit_code": worker.exitcode, "processed": s.get("processed", 0),
                           "failed": s.get("failed", 0), "detections": s.get("detections", 0),
                           "images_per_s": s.get("images_per_s")})
        failed_by_reason.update(s.get("failed_by_reason", {}))
        if worker.exitcode not in (0, 3):
            failed_workers.append(f"worker {shard.name} on {device} exited with code {worker.exitcode}")
    elapsed = time.perf_counter() - started
    processed = sum(w["processed"] for w in per_worker)
    failed = sum(w["failed"] for w in per_worker)
    summary = {
        "gpudet": __version__, "source": str(source), "out": str(out), "devices": devices,
        "device": ", ".join(devices), "detections": sum(w["detections"] for w in per_worker),
        "images": len(refs), "already_done": len(refs) - len(todo), "processed": processed, "failed": failed,
        "failed_by_reason": dict(failed_by_reason), "recorded": counts, "workers": per_worker,
        "failed_workers": failed_workers, "seconds": {"total": round(elapsed, 4)},
        "images_per_s": round((processed + failed) / max(elapsed, 1e-9), 2),
        "interrupted": any(w.exitcode == 130 for w in workers),
    }
    write_json_atomic(out / "summary.json", summary)
    if failed_workers:
        code = 1
    elif summary["interrupted"]:
        code = 130
    else:
        code = 3 if failed else 0
    return RunResult(summary=summary, exit_code=code)
