"""The detector: the data path from image files to detections, one batch at a time.

    source -> preprocess (DALI) -> engine (ORT IOBinding) -> postprocess (torch) -> results

`Detector` owns one engine and one DALI pipeline on one device; `Detector.stream` is the loop.
The CLI's runner writes what it yields to files; the Python API hands it to the caller.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import sys
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .config import Config, load_config, option_overrides, resolve_model_path
from .device import Device, resolve_device
from .engine import Engine, ImageInput
from .postprocess import (DeviceDetections, Detections, PackedDetections, RetinaNetHeads, SsdHeads, detect_contract,
                          end_to_end_device, image_meta)
from .preprocess import PreprocessedBatch, PreprocessFailure, Preprocessor
from .source import EncodedImage, ImageError, ImageRef, ProcessReaders, list_images, read_batches

_END = object()
log = logging.getLogger("gpudet")


class StageClock:
    """Main-thread wall time per stage, exclusive: time inside a nested stage (the source read
    while preprocessing asks for the next batch) counts only for the inner one. Stages overlap on
    the device (DALI decodes ahead on its own threads), so these are the times the loop waited
    on each stage; they add up to the loop's time. `add` counts time spent on another thread
    (the engine's): it overlaps the loop's stages."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self._stack: list[str] = []
        self._since = 0.0
        self._lock = threading.Lock()

    def add(self, stage: str, seconds: float) -> None:
        with self._lock:
            self.seconds[stage] += seconds

    def _charge(self) -> None:
        now = time.perf_counter()
        if self._stack:
            self.add(self._stack[-1], now - self._since)
        self._since = now

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
    cuda_options = {"prefer_nhwc": "1"} if config.run.prefer_nhwc else {}
    if config.run.fuse_conv_bias:
        cuda_options["fuse_conv_bias"] = "1"
    if not config.run.tf32:
        cuda_options["use_tf32"] = "0"
    if config.run.gpu_mem_limit_mb:
        # The arena grows only by what is asked, so the cap is reached late and exactly.
        cuda_options.update(gpu_mem_limit=str(config.run.gpu_mem_limit_mb << 20),
                            arena_extend_strategy="kSameAsRequested")
    return dict(scalars={"score_threshold": p.score_threshold, "iou_threshold": p.iou_threshold,
                         "max_detections": p.max_detections},
                input_size_hw=tuple(config.preprocess.size), cuda_options=cuda_options,
                batch_size=config.run.batch_size if config.run.cuda_graph else None, cuda_graph=config.run.cuda_graph,
                slots=config.run.pipeline_depth)


def preprocessor_args(config: Config, image_input: ImageInput, device: Device) -> dict:
    p = config.preprocess
    height, width = image_input.size_hw or tuple(p.size)
    return dict(batch_size=config.run.batch_size, num_threads=config.run.num_threads, height=height, width=width,
                resize=p.resize, channel_order=p.channel_order, mean=p.mean, std=p.std, pad_value=p.pad_value,
                dtype=image_input.dtype, layout=image_input.layout, decoder=p.decoder,
                hw_decoder_load=p.hw_decoder_load,
                # On the GPU a new batch shape costs a cuDNN search; a static-batch model takes no other.
                pad_partial_batches=device.is_cuda or image_input.batch is not None)


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
    """Retry a group of two or more that failed together in halves, one at a time, down to single
    images; report those that fail alone."""
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

    A consumer that stops early leaves no batch in DALI: those in flight are taken and dropped
    here (the preprocessor's next stream would otherwise get them first).
    """
    retry: deque[list[EncodedImage]] = deque()
    source = iter(batches)
    try:
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
    finally:
        while preprocessor.in_flight:
            try:
                preprocessor.result()
            except PreprocessFailure:  # DALI is rebuilt: nothing left in flight
                pass


class GpuOutOfMemory(RuntimeError):
    """The model ran out of GPU memory even on one image, or retrying in halves is off."""


def is_out_of_memory(error: Exception) -> bool:
    text = str(error).lower()
    # torch; CUDA ("out of memory"); ORT's CUDA EP and its capped arena (bfc_arena.cc: "Available
    # memory of N is smaller than requested bytes of M", seen on the H200 under gpu_mem_limit).
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in text or \
        "failed to allocate memory" in text or "is smaller than requested bytes" in text


def infer(engine: Engine, batch: PreprocessedBatch, *, chunk: int, postprocess, slot: int = 0):
    """Engine over the batch, `chunk` images per model run; returns a function that postprocesses,
    and the model run it waits for (None when the batch ran in parts).

    chunk >= the batch: one run on DALI's own buffer into the engine's output buffers `slot`,
    queued on the GPU without a host wait (Engine.launch); the postprocess, left to the caller,
    makes its stream wait for it (it may run on another thread while the engine queues the next
    batch into the other slot). Smaller (after a GPU out-of-memory): zero-copy torch views of that
    buffer, run and postprocessed one after the other, here."""
    total = batch.orig_hw.shape[0]
    if chunk >= total:
        launched = engine.launch(batch.images, slot=slot)

        def after_the_engine():
            launched.wait()
            return postprocess(launched.outputs, batch.scale_yx, batch.pad_yx, batch.orig_hw, len(batch.refs))
        return after_the_engine, launched
    images = torch.from_dlpack(batch.images)
    parts = []
    for start in range(0, len(batch.refs), chunk):
        stop = min(start + chunk, total)
        part = postprocess(engine.run(images[start:stop]), batch.scale_yx[start:stop], batch.pad_yx[start:stop],
                           batch.orig_hw[start:stop], min(stop, len(batch.refs)) - start)
        part.batch_index += start
        parts.append(part)
    found = type(parts[0]).concatenate(parts)
    return lambda: found, None


@contextmanager
def switch_interval(ms: float | None):
    """sys.setswitchinterval(ms / 1000) inside the block, the previous interval after; None: no change."""
    if ms is None:
        yield
        return
    previous = sys.getswitchinterval()
    sys.setswitchinterval(ms / 1000)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


class Inline:
    """An executor that runs each task when it is submitted, here (the CPU path: ORT's threads
    already use every core). Errors are kept in the future and raised where the result is taken,
    in order, as a thread's would be."""

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args))
        except Exception as e:
            future.set_exception(e)
        return future

    def __enter__(self) -> Inline:
        return self

    def __exit__(self, *exc) -> None:
        pass


def out_of_memory(device: Device, chunk: int, batch_size: int, error: Exception,
                  fixed: bool = False) -> GpuOutOfMemory:
    lower = "export the model with a smaller batch (its batch size is fixed)" if fixed else \
        f"lower --batch-size (now {batch_size})"
    return GpuOutOfMemory(f"GPU out of memory running the model on {chunk} image(s) at once on {device}: {lower}, "
                          f"raise run.gpu_mem_limit_mb, or free the GPU ({error})")


class Detector:
    """One model on one device, ready to run: build it once, stream any number of sources.

    >>> detector = Detector.from_config(device="cpu")
    >>> for result in detector.run("samples"):
    ...     print(result.path, len(result.scores))
    """

    def __init__(self, config: Config):
        self.config = config
        self.device: Device = resolve_device(config.run.device)
        self.model_path = resolve_model_path(config)
        self.engine = Engine(self.model_path, device=self.device, **engine_args(config))
        fixed_batch = self.engine.declared_batch
        if fixed_batch is not None and fixed_batch != config.run.batch_size:
            log.info("%s takes batches of exactly %d images: run.batch_size %d -> %d", self.model_path.name,
                     fixed_batch, config.run.batch_size, fixed_batch)
            config = dataclasses.replace(config, run=dataclasses.replace(config.run, batch_size=fixed_batch))
            self.config = config
        self.contract = detect_contract(self.engine.outputs, config.model.contract, self.model_path)
        self.preprocessor = Preprocessor(device=self.device,
                                         **preprocessor_args(config, self.engine.image_input, self.device))
        self.num_landmarks = config.model.landmarks if "landmarks" in {s.name for s in self.engine.outputs} else 0
        m = config.model
        self.ssd_heads = SsdHeads(strides=m.anchor_strides, sizes=m.anchor_sizes, variances=m.box_variances,
                                  pre_nms_top_k=config.postprocess.pre_nms_top_k, device=self.device.torch,
                                  compile=config.postprocess.compile)
        self.retinanet_heads = RetinaNetHeads.from_metadata(
            self.engine.metadata, self.model_path, self.device.torch, compile=config.postprocess.compile) \
            if self.contract == "retinanet_heads" else None
        self.model_batch = config.run.batch_size
        """Images per model run: run.batch_size, or less after a GPU out-of-memory."""
        self.overlap = self.device.is_cuda
        """Engine and postprocess on threads of their own (stream); on the CPU they run inline."""
        self._readers: ProcessReaders | None = None  # run.read_processes, started by the first stream
        self._streaming = False
        self._warm_up()

    @classmethod
    def from_config(cls, config: str | Path | None = None, *, model: str | None = None, device: str | None = None,
                    batch_size: int | None = None, overrides: Iterable[str] = ()) -> Detector:
        """Load a YAML config (default: the embedded RetinaFace) with optional overrides."""
        return cls(load_config(config, list(overrides) + option_overrides(model=model, device=device,
                                                                            batch_size=batch_size)))

    def close(self) -> None:
        """End the file reader processes (run.read_processes) now, not when the detector is collected."""
        if self._readers is not None:
            self._readers.close()
            self._readers = None

    def __enter__(self) -> Detector:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _reader_processes(self) -> ProcessReaders | None:
        """The detector's reader processes (run.read_processes): started by the first stream and
        kept for the next (a worker takes 0.1-0.3 s to start), so that a bench's timed pass or a
        service calling run() per request does not pay it again. Once every one of them has died,
        the next stream starts new ones."""
        if self._readers is not None and not self._readers.working():
            self.close()
        if self._readers is None and self.config.run.read_processes > 0 and ProcessReaders.available():
            self._readers = ProcessReaders(self.config.run.read_processes)
        return self._readers

    def _postprocess(self, on_device: bool):
        p = self.config.postprocess
        input_hw = self.engine.image_input.size_hw or tuple(self.config.preprocess.size)

        def decode(outputs, meta, num_images) -> DeviceDetections | PackedDetections:
            if self.contract == "end_to_end":  # the model did decode + NMS
                return end_to_end_device(outputs, meta, score_threshold=p.score_threshold,
                                         max_detections=p.max_detections, num_landmarks=self.num_landmarks,
                                         num_images=num_images)
            if self.contract == "retinanet_heads":
                return self.retinanet_heads(outputs, meta, score_threshold=p.score_threshold,
                                            iou_threshold=p.iou_threshold, max_detections=p.max_detections,
                                            num_images=num_images)
            return self.ssd_heads(outputs, meta, input_hw=input_hw, score_threshold=p.score_threshold,
                                  iou_threshold=p.iou_threshold, max_detections=p.max_detections,
                                  num_landmarks=self.num_landmarks, num_images=num_images)

        def postprocess(outputs, scale_yx, pad_yx, orig_hw, num_images):
            # torch on the device; one copy of the final detections to the host
            found = decode(outputs, image_meta(scale_yx, pad_yx, orig_hw), num_images)
            if not on_device:
                return found.to_host()
            found = found.on_device()
            if self.device.is_cuda:  # done reading the engine's output buffers before they are reused
                torch.cuda.current_stream(self.device.torch).synchronize()
            return found
        return postprocess

    def _shrink_model_batch(self, error: Exception, images: int) -> None:
        """After a failed model run on `images` images: halve the model batch if the failure was a
        GPU out-of-memory and run.oom_retry allows it; otherwise raise."""
        if not (self.device.is_cuda and is_out_of_memory(error)):
            raise error
        if self.engine.declared_batch is not None:
            raise out_of_memory(self.device, self.model_batch, self.config.run.batch_size, error,
                                fixed=True) from error
        if not self.config.run.oom_retry or self.model_batch == 1 or self.engine.cuda_graph:
            raise out_of_memory(self.device, self.model_batch, self.config.run.batch_size, error) from error
        self.model_batch = max(1, min(self.model_batch, images) // 2)
        log.warning("GPU out of memory: running the model on %d images at a time from now on", self.model_batch)
        torch.cuda.empty_cache()

    def _warm_up(self) -> None:
        """Run the model once at setup (cuDNN's algorithm search happens here, not on batch 1); on a
        GPU, then the postprocess once per output slot."""
        size_hw = self.engine.image_input.size_hw or tuple(self.config.preprocess.size)
        while True:
            try:
                self.engine.warm_up(self.model_batch, size_hw)
                break
            except Exception as e:
                self._shrink_model_batch(e, self.model_batch)
        if self.overlap and self.contract != "end_to_end":
            self._warm_up_postprocess(size_hw)

    def _warm_up_postprocess(self, size_hw: tuple[int, int]) -> None:
        """The heads postprocess on each output slot's buffers, as for a batch of no real images
        (nothing is kept, the row reader stays as it is), so that its compile and its CUDA graphs
        (one per slot) happen now, while nothing else runs on the GPU. Captured mid-pipeline
        instead, a graph meets the engine's work queued on its own stream (a capture there failed
        on the H200, cudaErrorStreamCaptureInvalidated, and the postprocess fell back to
        launching its kernels one by one)."""
        n = self.model_batch
        postprocess = self._postprocess(on_device=False)
        for slot in range(self.engine.slots):
            outputs = self.engine.run(self.engine.zero_batch(n, size_hw), slot=slot)
            postprocess(outputs, np.ones((n, 2), np.float32), np.zeros((n, 2), np.float32),
                        np.tile(np.array(size_hw, np.int64), (n, 1)), 0)

    def _infer(self, batch: PreprocessedBatch, postprocess, clock: StageClock, slot: int,
               reader: Future | None = None):
        """The engine on one batch into the output buffers `slot`, halving the model batch on GPU
        out-of-memory; returns the function that postprocesses it. reader: the postprocess still
        reading that slot's buffers (run.pipeline_depth batches back), waited for first (its errors
        are raised where its own result is taken). Clock: "engine" is this thread's time (queueing the
        model), "engine_gpu" the span of the run's events on the engine's stream (its kernels, and any
        wait there for the host to queue the rest), counted once the postprocess is done."""
        if reader is not None:
            wait([reader])
        start = time.perf_counter()
        try:
            while True:
                try:  # ORT: DALI's buffer bound via DLPack, outputs stay on the device
                    post, launched = infer(self.engine, batch, chunk=self.model_batch, postprocess=postprocess,
                                           slot=slot)
                    break
                except Exception as e:
                    self._shrink_model_batch(e, batch.orig_hw.shape[0])
        finally:
            clock.add("engine", time.perf_counter() - start)

        def postprocess_and_count():
            found = post()  # synchronizes: the model's events are complete after it
            seconds = launched.seconds() if launched is not None else None
            if seconds is not None:
                clock.add("engine_gpu", seconds)
            return found
        return postprocess_and_count

    def stream(self, refs: list[ImageRef], on_error: Callable[[list[ImageError]], None], *,
               clock: StageClock | None = None, on_device: bool = False
               ) -> Iterator[tuple[PreprocessedBatch, Detections | DeviceDetections]]:
        """The data path over `refs`: yields each batch with its detections, in submission order
        (a batch retried after a decode failure comes back in parts). Every image ends either in
        a yielded batch or in `on_error`, exactly once. on_device=True yields DeviceDetections
        (torch tensors on the device, no host copy); they are the caller's to keep.

        One stream at a time per detector (its DALI pipeline, output buffers and reader processes
        serve one): a second, started before the first is finished or closed, raises."""
        if self._streaming:
            raise RuntimeError("this Detector is already running a stream (a run() or stream() not yet finished): "
                               "finish or close that one first, or build a second Detector")
        self._streaming = True
        try:
            yield from self._stream(refs, on_error, clock or StageClock(), on_device)
        finally:
            self._streaming = False

    def _stream(self, refs: list[ImageRef], on_error: Callable[[list[ImageError]], None], clock: StageClock,
                on_device: bool) -> Iterator[tuple[PreprocessedBatch, Detections | DeviceDetections]]:
        config = self.config
        postprocess = self._postprocess(on_device)

        def checked_batches() -> Iterator[list[EncodedImage]]:
            for items in clock.timed(read_batches(refs, batch_size=config.run.batch_size,
                                                  num_threads=config.run.num_threads,
                                                  readers=self._reader_processes(),
                                                  max_pixels=config.preprocess.max_pixels), "read"):
                on_error([i for i in items if isinstance(i, ImageError)])
                yield [i for i in items if isinstance(i, EncodedImage)]

        def finished(batch: PreprocessedBatch, future: Future):
            with clock("postprocess"):  # waits for the batch's engine run and postprocess
                return batch, future.result()

        # On a GPU three threads overlap: this one takes batches from DALI and hands finished ones
        # to the caller (who writes them), the engine thread runs the model (ORT releases the GIL
        # for the whole run), the postprocess thread decodes and NMS's (torch, CUDA graphs). The
        # engine fills run.pipeline_depth sets of output buffers in turn (slots): before it writes a
        # slot it waits for the postprocess still reading it, that many batches back; this thread
        # hands a batch on once that many are in flight. On the CPU each task runs inline, in
        # order: ORT's threads already use every core.
        pending: deque[tuple[PreprocessedBatch, Future]] = deque()
        reading: dict[int, Future] = {}  # slot -> the postprocess reading its buffers
        engine = self.engine if self.overlap else Inline()  # the engine's own thread (Engine.submit)
        post = ThreadPoolExecutor(1, thread_name_prefix="gpudet-postprocess") if self.overlap else Inline()
        with switch_interval(config.run.gil_switch_interval_ms), post:
            # source: bytes read ahead on threads, cheap checks -> preprocess: DALI, run.prefetch_batches in flight
            batches = clock.timed(preprocess_stream(self.preprocessor, checked_batches(), on_error,
                                                    depth=config.run.prefetch_batches), "preprocess")
            for i, batch in enumerate(batches):
                slot = i % self.engine.slots
                ran = engine.submit(self._infer, batch, postprocess, clock, slot, reading.get(slot))  # engine
                reading[slot] = post.submit(lambda ran=ran: ran.result()())  # postprocess, after its engine run
                pending.append((batch, reading[slot]))
                if len(pending) == self.engine.slots:
                    yield finished(*pending.popleft())
            while pending:
                yield finished(*pending.popleft())

    def run(self, source: str | Path | list[str], *, root: str | None = None) -> Iterator[ImageResult | ImageError]:
        """Per-image results for a source (file list, folder, glob, or a list of paths), in batch
        order; images that cannot be processed come as ImageError, never as an exception."""
        if isinstance(source, (list, tuple)):
            refs = [ImageRef(i, str(p)) for i, p in enumerate(source)]
        else:
            refs = list_images(source, root=root)
        failed: deque[ImageError] = deque()
        for batch, found in self.stream(refs, failed.extend):
            yield from failed
            failed.clear()
            for i, ref in enumerate(batch.refs):
                yield ImageResult.from_batch(ref, batch, found, i, self.config.model.labels)
        yield from failed


@dataclass
class ImageResult:
    """Detections of one image, on the host, in original pixels (after EXIF orientation)."""

    index: int
    path: str
    width: int
    height: int
    boxes_xyxy: np.ndarray  # float32 [K, 4]
    scores: np.ndarray  # float32 [K], best first
    labels: np.ndarray  # int64 [K]
    names: list[str]
    landmarks: np.ndarray | None  # float32 [K, L, 2]

    @classmethod
    def from_batch(cls, ref: ImageRef, batch: PreprocessedBatch, found: Detections, i: int,
                   label_names: list[str]) -> ImageResult:
        rows = found.rows_of(i)
        labels = found.labels[rows]
        height, width = (int(v) for v in batch.orig_hw[i])
        return cls(index=ref.index, path=ref.path, width=width, height=height, boxes_xyxy=found.boxes_xyxy[rows],
                   scores=found.scores[rows], labels=labels,
                   names=[label_names[k] if k < len(label_names) else str(k) for k in labels.tolist()],
                   landmarks=None if found.landmarks is None else found.landmarks[rows])
