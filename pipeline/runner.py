"""The runner: wires the stages together and streams results. Its loop is the data path.

    source -> preprocess (DALI) -> engine (ORT IOBinding) -> postprocess (torch) -> sinks
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from . import __version__
from .config import Config, resolve_model_path
from .device import Device, resolve_device
from .engine import Engine, ImageInput
from .postprocess import detect_contract, end_to_end, to_device_meta
from .preprocess import PreprocessedBatch, Preprocessor
from .sinks import JsonlWriter, detection_records, errors_records, write_json_atomic
from .source import EncodedImage, ImageError, ImageRef, list_images, read_batches


_END = object()


@dataclass
class StageClock:
    """Wall time per stage. Stages end in a host sync (DALI run, ORT run, the D2H copy), so host
    clocks measure them."""

    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    @contextmanager
    def __call__(self, stage: str):
        start = time.perf_counter()
        yield
        self.seconds[stage] += time.perf_counter() - start

    def timed(self, iterable: Iterable, stage: str) -> Iterator:
        """Iterate `iterable`, counting the time spent producing each item under `stage`."""
        iterator = iter(iterable)
        while True:
            with self(stage):
                item = next(iterator, _END)
            if item is _END:
                return
            yield item


def engine_args(config: Config) -> dict:
    p = config.postprocess
    return dict(scalars={"score_threshold": p.score_threshold, "iou_threshold": p.iou_threshold,
                         "max_detections": p.max_detections})


def preprocessor_args(config: Config, image_input: ImageInput) -> dict:
    p = config.preprocess
    height, width = image_input.size_hw or tuple(p.size)
    return dict(batch_size=config.run.batch_size, num_threads=config.run.num_threads, height=height, width=width,
                resize=p.resize, channel_order=p.channel_order, mean=p.mean, std=p.std, pad_value=p.pad_value,
                dtype=image_input.dtype, layout=image_input.layout)


def preprocess_isolating(preprocessor: Preprocessor, items: list[EncodedImage],
                         on_error: Callable[[list[ImageError]], None]) -> Iterator[PreprocessedBatch]:
    """Preprocess `items`; if DALI fails, rebuild it and retry in halves down to single images.

    Yields the batches that succeeded (each must be consumed before the next is produced: DALI
    reuses its buffers); reports the images that fail alone as `decode_failed`.
    """
    if not items:
        return
    try:
        batch = preprocessor.run(items)
    except Exception as e:  # DALI raises RuntimeError/IndexError/...; any of them fails this group
        preprocessor.rebuild()
        if len(items) == 1:
            ref = items[0].ref
            message = str(e).strip().splitlines()
            detail = next((line for line in message if "rror" in line and "pipeline" not in line.lower()),
                          message[-1] if message else type(e).__name__)
            on_error([ImageError(ref.index, ref.path, "decode_failed", f"cannot decode: {detail.strip()[:300]}")])
            return
        half = len(items) // 2
        yield from preprocess_isolating(preprocessor, items[:half], on_error)
        yield from preprocess_isolating(preprocessor, items[half:], on_error)
        return
    yield batch


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass
class RunResult:
    summary: dict
    exit_code: int  # 0: every image processed; 3: finished, some images failed


def run_detect(source: str, out_dir: str | Path, config: Config, *, root: str | None = None,
               progress: bool | None = None) -> RunResult:
    """Detect on every image of `source`, streaming results into `out_dir`."""
    started = datetime.now(timezone.utc)
    t0 = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    refs: list[ImageRef] = list_images(source, root=root)
    device: Device = resolve_device(config.run.device)
    model_path = resolve_model_path(config)
    engine = Engine(model_path, device=device, **engine_args(config))
    contract = detect_contract(engine.outputs, config.model.contract, model_path)
    preprocessor = Preprocessor(device=device, **preprocessor_args(config, engine.image_input))
    num_landmarks = config.model.landmarks if "landmarks" in {s.name for s in engine.outputs} else 0
    clock = StageClock()
    reasons: dict[str, int] = defaultdict(int)
    num_detections = 0
    show = sys.stderr.isatty() if progress is None else progress
    from tqdm import tqdm

    setup_s = time.perf_counter() - t0
    with JsonlWriter(out / "detections.jsonl") as results, JsonlWriter(out / "errors.jsonl") as errors, \
            tqdm(total=len(refs), unit="img", disable=not show, dynamic_ncols=True) as bar:

        def record_errors(failed: list[ImageError]) -> None:
            for e in failed:
                reasons[e.reason] += 1
            errors.append(errors_records(failed))
            bar.update(len(failed))

        batches = read_batches(refs, batch_size=config.run.batch_size, num_threads=config.run.num_threads)
        for items in clock.timed(batches, "read"):  # source: bytes + cheap checks, read ahead on threads
            record_errors([i for i in items if isinstance(i, ImageError)])
            good = [i for i in items if isinstance(i, EncodedImage)]
            for batch in clock.timed(preprocess_isolating(preprocessor, good, record_errors), "preprocess"):  # DALI
                with clock("engine"):  # ORT: DALI's buffer bound via DLPack, outputs stay on the device
                    outputs = engine.run(batch.images)
                with clock("postprocess"):  # torch on the device; one copy of final detections to the host
                    meta = to_device_meta(batch.scale_yx, batch.pad_yx, batch.orig_hw, device.torch)
                    detections = end_to_end(outputs, meta, score_threshold=config.postprocess.score_threshold,
                                            max_detections=config.postprocess.max_detections,
                                            num_landmarks=num_landmarks)
                with clock("write"):  # sinks: one JSONL record per image
                    results.append(detection_records(batch, detections, config.model.labels))
                num_detections += len(detections.scores)
                bar.update(len(batch.refs))

    elapsed = time.perf_counter() - t0
    processed = results.count
    summary = {
        "gpudet": __version__,
        "source": str(source),
        "out": str(out),
        "images": len(refs),
        "processed": processed,
        "failed": errors.count,
        "failed_by_reason": dict(reasons),
        "detections": num_detections,
        "seconds": {"total": round(elapsed, 4), "setup": round(setup_s, 4),
                    **{k: round(v, 4) for k, v in clock.seconds.items()}},
        "images_per_s": round(processed / max(elapsed - setup_s, 1e-9), 2),
        "device": device.describe(),
        "model": {"path": str(model_path), "sha256": file_sha256(model_path), "contract": contract,
                  "inputs": [s.describe() for s in engine.inputs], "outputs": [s.describe() for s in engine.outputs],
                  "providers": engine.session.get_providers()},
        "config": config.to_dict(),
        "started": started.isoformat(timespec="seconds"),
        "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    write_json_atomic(out / "summary.json", summary)
    return RunResult(summary=summary, exit_code=0 if errors.count == 0 else 3)
