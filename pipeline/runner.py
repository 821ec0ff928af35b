"""The runner: wires the stages together and streams results. Its loop is the data path.

    source -> preprocess (DALI) -> engine (ORT IOBinding) -> postprocess (torch) -> sinks
"""

from __future__ import annotations

import hashlib
import logging
import re
import sys
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch

from . import __version__
from .config import Config, resolve_model_path
from .device import Device, resolve_device
from .engine import Engine, ImageInput
from .postprocess import Detections, detect_contract, end_to_end, to_device_meta
from .preprocess import PreprocessedBatch, PreprocessFailure, Preprocessor
from .sinks import JsonlWriter, detection_records, errors_records, read_complete_records, write_json_atomic
from .source import EncodedImage, ImageError, ImageRef, list_images, read_batches


_END = object()
log = logging.getLogger("gpudet")


class StageClock:
    """Main-thread wall time per stage, exclusive: time inside a nested stage (the source read
    while preprocessing asks for the next batch) counts only for the inner one. Stages overlap on
    the device (DALI decodes ahead on its own threads), so these are the times the loop waited
    on each stage; they add up to the loop's time."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self._stack: list[str] = []
        self._since = 0.0

    def _charge(self) -> float:
        now = time.perf_counter()
        if self._stack:
            self.seconds[self._stack[-1]] += now - self._since
        self._since = now
        return now

    @contextmanager
    def __call__(self, stage: str):
        self._charge()
        self._stack.append(stage)
        try:
            yield
        finally:
            self._charge()
            self._stack.pop()

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
    cuda_options = {}
    if config.run.gpu_mem_limit_mb:
        # The arena grows only by what is asked, so the cap is reached late and exactly.
        cuda_options = {"gpu_mem_limit": str(config.run.gpu_mem_limit_mb << 20),
                        "arena_extend_strategy": "kSameAsRequested"}
    return dict(scalars={"score_threshold": p.score_threshold, "iou_threshold": p.iou_threshold,
                         "max_detections": p.max_detections},
                input_size_hw=tuple(config.preprocess.size), cuda_options=cuda_options)


def preprocessor_args(config: Config, image_input: ImageInput, device: Device) -> dict:
    p = config.preprocess
    height, width = image_input.size_hw or tuple(p.size)
    return dict(batch_size=config.run.batch_size, num_threads=config.run.num_threads, height=height, width=width,
                resize=p.resize, channel_order=p.channel_order, mean=p.mean, std=p.std, pad_value=p.pad_value,
                dtype=image_input.dtype, layout=image_input.layout, pad_partial_batches=device.is_cuda)


def decode_failed(item: EncodedImage, cause: Exception) -> ImageError:
    """The error record of an image the decoder rejected, with the useful part of DALI's message."""
    text = str(cause)
    # DALI's message: "Critical error in pipeline: ... Error in <operator> ... encountered: <what>".
    operator = re.search(r"Error in \w+ operator `([^`]+)`", text)
    what = text.split("encountered:", 1)[1].strip().splitlines()[0] if "encountered:" in text else text.strip()
    what = re.sub(r"\s*sample #\d+\s*:?\s*$", "", what).strip() or "rejected"
    where = f" ({operator.group(1)})" if operator else ""
    return ImageError(item.ref.index, item.ref.path, "decode_failed",
                      f"cannot decode{where}: {what[:300]}; the file is corrupt or truncated")


def isolate(preprocessor: Preprocessor, items: list[EncodedImage],
            on_error: Callable[[list[ImageError]], None]) -> Iterator[PreprocessedBatch]:
    """Retry a failed group in halves, one at a time, down to single images; report those."""
    if len(items) == 1:
        on_error([decode_failed(items[0], RuntimeError("the decoder rejected this image"))])
        return
    half = len(items) // 2
    for part in (items[:half], items[half:]):
        try:
            yield preprocessor.run(part)
        except PreprocessFailure as failure:
            if len(part) == 1:
                on_error([decode_failed(part[0], failure.cause)])
            else:
                yield from isolate(preprocessor, part, on_error)


def preprocess_stream(preprocessor: Preprocessor, batches: Iterable[list[EncodedImage]],
                      on_error: Callable[[list[ImageError]], None], *, depth: int = 2
                      ) -> Iterator[PreprocessedBatch]:
    """Preprocessed batches, in order, with `depth` batches in flight in DALI.

    When DALI fails on a batch, the batches submitted after it are submitted again and the
    failed one is retried in halves until only the images that fail alone are left; those are
    reported as decode_failed. Every good image comes out exactly once.
    """
    retry: deque[list[EncodedImage]] = deque()
    source = iter(batches)
    while True:
        while len(preprocessor.in_flight) < depth:
            batch = retry.popleft() if retry else next(source, None)
            if batch is None:
                break
            if batch:
                preprocessor.submit(batch)
        if not preprocessor.in_flight:
            return
        try:
            yield preprocessor.result()
        except PreprocessFailure as failure:
            retry.extendleft(reversed(failure.unfinished))
            if len(failure.failed) == 1:
                on_error([decode_failed(failure.failed[0], failure.cause)])
            else:
                yield from isolate(preprocessor, failure.failed, on_error)


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


def images_to_do(out: Path, refs: list[ImageRef], *, resume: bool, overwrite: bool) -> list[ImageRef]:
    """The images this run must process: all, or with --resume those not yet recorded in `out`."""
    existing = [out / name for name in RESULT_FILES if (out / name).exists() and (out / name).stat().st_size]
    if not existing or overwrite:
        return refs
    if not resume:
        raise OutputExistsError(f"{existing[0]} already holds results; pass --resume to process only the images "
                                "not yet recorded there, or --overwrite to start again")
    done: set[int] = set()
    for path in existing:
        for record in read_complete_records(path):
            index = record.get("index")
            if not isinstance(index, int) or index >= len(refs) or refs[index].path != record.get("path"):
                raise OutputExistsError(
                    f"{path}: record {record.get('index')} ({record.get('path')}) does not match this source's "
                    f"image {index}; resume with the same source (and --root), or use --overwrite")
            done.add(index)
    return [r for r in refs if r.index not in done]


class GpuOutOfMemory(RuntimeError):
    """The model ran out of GPU memory even on one image, or retrying in halves is off."""


def is_out_of_memory(error: Exception) -> bool:
    text = str(error).lower()
    # torch; CUDA ("out of memory"); ORT's CUDA EP and its capped arena (bfc_arena.cc: "Available
    # memory of N is smaller than requested bytes of M", seen on the H200 under gpu_mem_limit).
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in text or \
        "failed to allocate memory" in text or "is smaller than requested bytes" in text


def infer(engine: Engine, batch: PreprocessedBatch, *, chunk: int, postprocess) -> Detections:
    """Engine + postprocess over the batch, `chunk` images per model run.

    chunk >= the batch: one run on DALI's own buffer. Smaller (after a GPU out-of-memory):
    zero-copy torch views of that buffer, run one after the other."""
    total = batch.orig_hw.shape[0]
    if chunk >= total:
        return postprocess(engine.run(batch.images), batch.scale_yx, batch.pad_yx, batch.orig_hw, len(batch.refs))
    images = torch.from_dlpack(batch.images)
    parts = []
    for start in range(0, len(batch.refs), chunk):
        stop = min(start + chunk, total)
        part = postprocess(engine.run(images[start:stop]), batch.scale_yx[start:stop], batch.pad_yx[start:stop],
                           batch.orig_hw[start:stop], min(stop, len(batch.refs)) - start)
        part.batch_index += start
        parts.append(part)
    return Detections.concatenate(parts)


def out_of_memory(device: Device, chunk: int, batch_size: int, error: Exception) -> GpuOutOfMemory:
    return GpuOutOfMemory(f"GPU out of memory running the model on {chunk} image(s) at once on {device}: lower "
                          f"--batch-size (now {batch_size}), raise run.gpu_mem_limit_mb, or free the GPU ({error})")


def warm_up(engine: Engine, config: Config, device: Device) -> int:
    """Run the model once at setup; return how many images it can run at once (halving on OOM)."""
    chunk = config.run.batch_size
    size_hw = engine.image_input.size_hw or tuple(config.preprocess.size)
    while True:
        try:
            engine.warm_up(chunk, size_hw)
            return chunk
        except Exception as e:
            if not (device.is_cuda and is_out_of_memory(e)):
                raise
            if not config.run.oom_retry or chunk == 1:
                raise out_of_memory(device, chunk, config.run.batch_size, e) from e
            chunk //= 2
            log.warning("GPU out of memory at warm-up: running the model on %d images at a time", chunk)
            torch.cuda.empty_cache()


def detect_loop(todo: list[ImageRef], *, config: Config, device: Device, engine: Engine, preprocessor: Preprocessor,
                results: JsonlWriter, errors: JsonlWriter, clock: StageClock, bar, chunk: int) -> Tally:
    """The data path, batch by batch; every image ends in exactly one of the two files.
    chunk: images per model run, halved on GPU out-of-memory (run.oom_retry)."""
    tally = Tally(model_batch=chunk)
    num_landmarks = config.model.landmarks if "landmarks" in {s.name for s in engine.outputs} else 0

    def postprocess(outputs, scale_yx, pad_yx, orig_hw, num_images) -> Detections:
        with clock("postprocess"):  # torch on the device; one copy of final detections to the host
            meta = to_device_meta(scale_yx, pad_yx, orig_hw, device.torch)
            return end_to_end(outputs, meta, score_threshold=config.postprocess.score_threshold,
                              max_detections=config.postprocess.max_detections, num_landmarks=num_landmarks,
                              num_images=num_images)

    def record_errors(failed: list[ImageError]) -> None:
        for e in failed:
            tally.failed_by_reason[e.reason] += 1
        tally.failed += len(failed)
        errors.append(errors_records(failed))
        bar.update(len(failed))

    def checked_batches() -> Iterator[list[EncodedImage]]:
        for items in clock.timed(read_batches(todo, batch_size=config.run.batch_size, num_threads=config.run.num_threads,
                                              max_pixels=config.preprocess.max_pixels), "read"):
            record_errors([i for i in items if isinstance(i, ImageError)])
            yield [i for i in items if isinstance(i, EncodedImage)]

    try:
        # source: bytes read ahead on threads, cheap checks -> preprocess: DALI, 2 batches in flight
        for batch in clock.timed(preprocess_stream(preprocessor, checked_batches(), record_errors), "preprocess"):
            while True:
                try:
                    with clock("engine"):  # ORT: DALI's buffer bound via DLPack, outputs stay on the device
                        detections = infer(engine, batch, chunk=chunk, postprocess=postprocess)
                    break
                except Exception as e:
                    if not (device.is_cuda and is_out_of_memory(e)):
                        raise
                    if not config.run.oom_retry or chunk == 1:
                        raise out_of_memory(device, chunk, config.run.batch_size, e) from e
                    chunk = tally.model_batch = max(1, min(chunk, batch.orig_hw.shape[0]) // 2)
                    log.warning("GPU out of memory: running the model on %d images at a time from now on", chunk)
                    torch.cuda.empty_cache()
            with clock("write"):  # sinks: one JSONL record per image
                results.append(detection_records(batch, detections, config.model.labels))
            tally.processed += len(batch.refs)
            tally.detections += len(detections.scores)
            bar.update(len(batch.refs))
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: what was written stays; --resume continues
        tally.interrupted = True
    return tally


def run_detect(source: str, out_dir: str | Path, config: Config, *, root: str | None = None,
               progress: bool | None = None, resume: bool = False, overwrite: bool = False) -> RunResult:
    """Detect on every image of `source`, streaming results into `out_dir`."""
    started = datetime.now(timezone.utc)
    t0 = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    refs: list[ImageRef] = list_images(source, root=root)
    todo = images_to_do(out, refs, resume=resume, overwrite=overwrite)
    device: Device = resolve_device(config.run.device)
    model_path = resolve_model_path(config)
    engine = Engine(model_path, device=device, **engine_args(config))
    contract = detect_contract(engine.outputs, config.model.contract, model_path)
    preprocessor = Preprocessor(device=device, **preprocessor_args(config, engine.image_input, device))
    chunk = warm_up(engine, config, device)
    clock = StageClock()
    show = sys.stderr.isatty() if progress is None else progress
    from tqdm import tqdm

    setup_s = time.perf_counter() - t0
    with JsonlWriter(out / RESULT_FILES[0], append=resume) as results, \
            JsonlWriter(out / RESULT_FILES[1], append=resume) as errors, \
            tqdm(total=len(todo), unit="img", disable=not show, dynamic_ncols=True) as bar:
        tally = detect_loop(todo, config=config, device=device, engine=engine, preprocessor=preprocessor,
                            results=results, errors=errors, clock=clock, bar=bar, chunk=chunk)
    elapsed = time.perf_counter() - t0
    summary = {
        "gpudet": __version__,
        "source": str(source),
        "out": str(out),
        "images": len(refs),
        "already_done": len(refs) - len(todo),
        "processed": tally.processed,
        "failed": tally.failed,
        "failed_by_reason": dict(tally.failed_by_reason),
        "detections": tally.detections,
        "interrupted": tally.interrupted,
        "model_batch": tally.model_batch,
        "seconds": {"total": round(elapsed, 4), "setup": round(setup_s, 4),
                    **{k: round(v, 4) for k, v in clock.seconds.items()}},
        "images_per_s": round((tally.processed + tally.failed) / max(elapsed - setup_s, 1e-9), 2),
        "device": device.describe(),
        "model": {"path": str(model_path), "sha256": file_sha256(model_path), "contract": contract,
                  "inputs": [s.describe() for s in engine.inputs], "outputs": [s.describe() for s in engine.outputs],
                  "providers": engine.session.get_providers()},
        "config": config.to_dict(),
        "started": started.isoformat(timespec="seconds"),
        "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    write_json_atomic(out / "summary.json", summary)
    exit_code = 130 if tally.interrupted else 3 if tally.failed else 0
    return RunResult(summary=summary, exit_code=exit_code)
