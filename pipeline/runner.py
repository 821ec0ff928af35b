"""The runner: `gpudet detect` over a source into an output folder, resumable.

It drives `Detector.stream` (the data path) and writes what comes out: detections.jsonl,
errors.jsonl and summary.json. Every input ends in exactly one of the two JSONL files.
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from . import __version__
from .config import Config
from .detector import Detector, StageClock
from .sinks import JsonlWriter, detection_records, errors_records, read_complete_records, write_json_atomic
from .source import ImageError, ImageRef, list_images


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class OutputExistsError(ValueError):
    """--out already holds results and neither --resume nor --overwrite was given."""


@dataclass
class Tally:
    """What one run did, for the summary and the exit code."""

    processed: int = 0
    failed: int = 0
    detections: int = 0
    interrupted: bool = False
    model_batch: int = 0  # images per model run at the end (below batch_size after an out-of-memory)
    failed_by_reason: dict[str, int] = field(default_factory=lambda: defaultdict(int))


@dataclass
class RunResult:
    summary: dict
    exit_code: int  # 0: every image processed; 3: finished, some images failed; 130: interrupted


RESULT_FILES = ("detections.jsonl", "errors.jsonl")


def recorded(paths: list[Path], refs: list[ImageRef]) -> set[int]:
    """Indices recorded in result files of earlier runs, each checked to belong to `refs`."""
    by_index = {r.index: r.path for r in refs}
    done: set[int] = set()
    for path in paths:
        for record in read_complete_records(path):
            index = record.get("index")
            if by_index.get(index) != record.get("path"):
                raise OutputExistsError(
                    f"{path}: record {index} ({record.get('path')}) is not image {index} of this source; resume with "
                    "the same source (and --root), or use --overwrite")
            done.add(index)
    return done


def images_to_do(out: Path, refs: list[ImageRef], *, resume: bool, overwrite: bool,
                 also: list[Path] = ()) -> list[ImageRef]:
    """The images this run must process: all, or with --resume those not recorded in `out` (and in
    `also`, result files of parallel workers). Results there without either flag are an error."""
    existing = [p for p in [out / name for name in RESULT_FILES] + list(also) if p.exists() and p.stat().st_size]
    if not existing or overwrite:
        return refs
    if not resume:
        raise OutputExistsError(f"{existing[0]} already holds results; pass --resume to process only the images "
                                "not yet recorded there, or --overwrite to start again")
    done = recorded(existing, refs)
    return [r for r in refs if r.index not in done]


def run_detect(source: str, out_dir: str | Path, config: Config, *, root: str | None = None,
               progress: bool | None = None, resume: bool = False, overwrite: bool = False) -> RunResult:
    """Detect on every image of `source`, streaming results into `out_dir` (one process, one device)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    refs: list[ImageRef] = list_images(source, root=root)
    todo = images_to_do(out, refs, resume=resume, overwrite=overwrite)
    return process(todo, out, config, append=resume, progress=progress, source=str(source), images=len(refs))


def process(todo: list[ImageRef], out: Path, config: Config, *, append: bool, progress: bool | None, source: str,
            images: int) -> RunResult:
    """Run the detector over `todo` and write its records into `out` (appending, or starting anew)."""
    started = datetime.now(timezone.utc)
    t0 = time.perf_counter()
    detector = Detector(config)
    clock = StageClock()
    tally = Tally()
    show = sys.stderr.isatty() if progress is None else progress
    from tqdm import tqdm

    setup_s = time.perf_counter() - t0
    with JsonlWriter(out / RESULT_FILES[0], append=append) as results, \
            JsonlWriter(out / RESULT_FILES[1], append=append) as errors, \
            tqdm(total=len(todo), unit="img", disable=not show, dynamic_ncols=True) as bar:

        def record_errors(failed: list[ImageError]) -> None:
            for e in failed:
                tally.failed_by_reason[e.reason] += 1
            tally.failed += len(failed)
            errors.append(errors_records(failed))
            bar.update(len(failed))

        try:
            for batch, detections in detector.stream(todo, record_errors, clock=clock):  # the data path
                with clock("write"):  # sinks: one JSONL record per image
                    results.append(detection_records(batch, detections, config.model.labels))
                tally.processed += len(batch.refs)
                tally.detections += len(detections.scores)
                bar.update(len(batch.refs))
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: what was written stays; --resume continues
            tally.interrupted = True
    tally.model_batch = detector.model_batch
    summary = make_summary(source, out, images, len(todo), tally, detector, clock, setup_s,
                           time.perf_counter() - t0, started)
    write_json_atomic(out / "summary.json", summary)
    return RunResult(summary=summary, exit_code=exit_code_of(tally))


def exit_code_of(tally: Tally) -> int:
    return 130 if tally.interrupted else 3 if tally.failed else 0


def make_summary(source: str, out: Path, images: int, todo: int, tally: Tally, detector: Detector,
                 clock: StageClock, setup_s: float, elapsed: float, started: datetime) -> dict:
    engine = detector.engine
    return {
        "gpudet": __version__,
        "source": source,
        "out": str(out),
        "images": images,
        "already_done": images - todo,
        "processed": tally.processed,
        "failed": tally.failed,
        "failed_by_reason": dict(tally.failed_by_reason),
        "detections": tally.detections,
        "interrupted": tally.interrupted,
        "model_batch": tally.model_batch,
        "seconds": {"total": round(elapsed, 4), "setup": round(setup_s, 4),
                    **{k: round(v, 4) for k, v in clock.seconds.items()}},
        "images_per_s": round((tally.processed + tally.failed) / max(elapsed - setup_s, 1e-9), 2),
        "device": detector.device.describe(),
        "model": {"path": str(detector.model_path), "sha256": file_sha256(detector.model_path),
                  "contract": detector.contract, "inputs": [s.describe() for s in engine.inputs],
                  "outputs": [s.describe() for s in engine.outputs], "providers": engine.session.get_providers()},
        "config": detector.config.to_dict(),
        "started": started.isoformat(timespec="seconds"),
        "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
