"""The detector: the data path from image files to detections, one batch at a time.

    source -> preprocess (DALI) -> engine (ORT IOBinding) -> postprocess (torch) -> host

`Detector.from_config` is the one place where configuration becomes the stages' arguments;
`Detector.stream` is the loop. The CLI's runners write what it yields to files; the Python API
hands it to the caller.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from itertools import groupby
from pathlib import Path

import numpy as np
import torch

from .config import Config, check_thresholds, class_numbers, load_config, option_overrides
from .device import Device, free_bytes, resolve_device
from .contracts import Contract, Renamed, recognise, renamed
from .engine import ORT_TO_TORCH, Engine, Launched
from .errors import ConfigError
from .listing import list_images
from .postprocess import BadModelOutput, DeviceDetections, GraphCache, Thresholds, image_meta
from .preprocess import ByKind, PreprocessedBatch, Preprocessor, preprocess_stream
from .results import Detections, ImageError, ImageRef, ImageResult
from .session import drop_started, engine_arguments
from .source import FLUSH, EncodedImage, Item, PixelImage, ScaledDecode, as_item, batched, read_chunks, within_pixels
from .timing import StageClock

log = logging.getLogger("gpudet")

POSTPROCESS_PRIORITY = -1
"""The postprocess stream's priority (lower is higher; the engine's and DALI's streams have 0)."""


class Detector:
    """One model on one device, ready to run: build it once, stream any number of sources.

    >>> detector = Detector.from_config(device="cpu")
    >>> for result in detector.run("samples"):
    ...     print(result.path, len(result.scores))
    """

    def __init__(self, *, engine: Engine, preprocessor: Preprocessor, postprocess: Contract | Renamed,
                 thresholds: Thresholds, labels: list[str], contract: str, num_threads: int = 4,
                 max_pixels: int = 0, max_file_bytes: int = 0, max_batch_pixels: int = 0, prefetch_batches: int = 2,
                 scaled: ScaledDecode | None = None, scaled_share: float = 1.0, decode_threads: int = 1,
                 storage_requests: int = 128, storage_read_ahead_mb: int = 512, storage_processes: int = 0,
                 config: Config | None = None):
        """The stages, built (`from_config` builds them from a config). thresholds: what the
        postprocess keeps unless a stream says otherwise. max_pixels, max_file_bytes: the
        source's checks (0: none); max_batch_pixels: what one DALI batch may decode (0: no bound).
        num_threads: the threads that read and check files; decode_threads: those that decode large
        JPEGs at a reduced scale (`scaled`, for `scaled_share` of the batches). storage_requests,
        storage_read_ahead_mb: how far an object-storage source is read ahead; storage_processes:
        how many processes fetch its objects (0: this one's threads). config: what built
        them, for reports."""
        self.engine, self.preprocessor, self.postprocess = engine, preprocessor, postprocess
        self.thresholds, self.labels, self.contract = thresholds, labels, contract
        self.num_threads, self.prefetch_batches = num_threads, prefetch_batches
        self.scaled, self.scaled_share, self.decode_threads = scaled, scaled_share, decode_threads
        self.max_pixels, self.max_file_bytes, self.max_batch_pixels = max_pixels, max_file_bytes, max_batch_pixels
        self.storage_requests, self.storage_read_ahead_mb = storage_requests, storage_read_ahead_mb
        self.storage_processes = storage_processes
        self.config = config
        self.device = engine.device
        self.model_path = engine.model_path
        self.batch_size = preprocessor.batch_size
        self.overlap = self.device.is_cuda
        """Engine and postprocess on threads of their own (GPU); on the CPU they run inline."""
        self._post_stream = torch.cuda.Stream(self.device.torch, priority=POSTPROCESS_PRIORITY) \
            if self.device.is_cuda else None
        self._streaming = False
        self._preprocessors = {preprocessor.source: preprocessor}
        self._captured: list[Thresholds] = []
        """Thresholds whose CUDA graphs the postprocess holds (GPU, heads), least recently used first."""
        self._warm_up()

    @classmethod
    def from_config(cls, config: str | Path | Config | None = None, *, model: str | None = None,
                    device: str | None = None, batch_size: int | None = None,
                    overrides: Iterable[str] = ()) -> Detector:
        """A detector from a YAML config (default: the embedded one), or a loaded Config, with
        `--set`-style overrides and the CLI's --model, --device, --batch-size."""
        if isinstance(overrides, str):
            raise ConfigError(f"overrides={overrides!r}: give a list of 'section.key=value' strings, e.g. "
                              "['postprocess.score_threshold=0.5']")
        extra = list(overrides) + option_overrides(model=model, device=device, batch_size=batch_size)
        if not isinstance(config, Config):
            config = load_config(config, extra)
        elif extra:
            raise ValueError("overrides apply to a config file; change a loaded Config with dataclasses.replace")
        target = resolve_device(config.run.device)
        if not target.is_cuda and config.run.cpu_batch_size != config.run.batch_size:
            config = dataclasses.replace(config, run=dataclasses.replace(config.run,
                                                                         batch_size=config.run.cpu_batch_size))
        m, p, q, r = config.model, config.preprocess, config.postprocess, config.run
        engine = Engine(device=target, slots=r.pipeline_depth, oom_retry=r.oom_retry,
                        **engine_arguments(config, on_gpu=target.is_cuda))
        drop_started()  # a session start_early opened for another device or options, if any
        if engine.declared_batch not in (None, r.batch_size):
            log.info("%s takes batches of exactly %d images: run.batch_size %d -> %d", engine.model_path.name,
                     engine.declared_batch, r.batch_size, engine.declared_batch)
            config = dataclasses.replace(config, run=dataclasses.replace(r, batch_size=engine.declared_batch))
        model = renamed(engine.model, m.outputs)
        contract = recognise(model.outputs, m.contract, engine.model_path, model.metadata)
        image = engine.image_input
        if image.size_hw is not None and tuple(image.size_hw) != tuple(p.size):  # the records would name p.size
            h, w = image.size_hw
            raise ConfigError(f"preprocess.size {list(p.size)}: {engine.model_path.name} takes {h}x{w} images only "
                              f"(its input size is fixed); set preprocess.size=[{h},{w}] (--set "
                              f"preprocess.size=[{h},{w}]), or export the model for the size you want")
        height, width = image.size_hw or tuple(p.size)
        check_memory(target, batch_size=config.run.batch_size, height=height, width=width,
                     value_bytes=2 if image.dtype == "float16" else 4, batches=r.prefetch_batches + r.pipeline_depth)
        postprocess = contract.from_config(model, config, device=target.torch, input_hw=(height, width))
        if m.outputs:
            postprocess = Renamed(postprocess, m.outputs)
        # its GPU kernels compile on a thread while DALI builds its pipeline and ORT warms up
        postprocess.compile_ahead({o.name: (ORT_TO_TORCH.get(o.dtype), o.shape) for o in model.outputs})
        preprocessor = Preprocessor(
            device=target, batch_size=config.run.batch_size, num_threads=r.num_threads, height=height, width=width,
            resize=p.resize, channel_order=p.channel_order, mean=p.mean, std=p.std, pad_value=p.pad_value,
            dtype=image.dtype, layout=image.layout, decoder=p.decoder, hw_decoder_load=p.hw_decoder_load,
            # On the GPU a new batch shape costs a cuDNN search; a static-batch model takes no other.
            pad_partial_batches=target.is_cuda or image.batch is not None)
        return cls(engine=engine, preprocessor=preprocessor, postprocess=postprocess, contract=contract.name,
                   thresholds=Thresholds(q.score_threshold, q.iou_threshold, q.max_detections,
                                         class_numbers(q.classes, m.labels)), labels=m.labels,
                   num_threads=r.num_threads, decode_threads=r.decode_threads or os.cpu_count() or 4,
                   max_pixels=p.max_pixels,
                   max_file_bytes=p.max_file_mb << 20, max_batch_pixels=p.max_batch_pixels,
                   prefetch_batches=r.prefetch_batches, storage_requests=r.storage_requests,
                   storage_read_ahead_mb=r.storage_read_ahead_mb, storage_processes=r.storage_processes,
                   scaled=ScaledDecode(height, width, p.resize) if p.scaled_decode else None,
                   scaled_share=p.scaled_share if target.is_cuda else 1.0, config=config)

    def describe(self) -> dict:
        """What runs: the model file (path, sha256), its contract, inputs and outputs, ORT's providers."""
        engine = self.engine
        return {**engine.model.record(self.contract),
                "providers": engine.session.get_providers()}

    def stream(self, items: Iterable[object], on_error: Callable[[list[ImageError]], None], *,
               clock: StageClock | None = None, on_device: bool = False, thresholds: Thresholds | None = None
               ) -> Iterator[tuple[PreprocessedBatch, Detections | DeviceDetections]]:
        """The data path over `items`, taken as they are needed, in batches of batch_size: yields
        each batch with its detections, in submission order (a batch retried after a decode failure
        comes back in parts). Every image ends either in a yielded batch or in `on_error`, exactly
        once. on_device=True yields DeviceDetections (torch tensors on the device, no host copy);
        they are the caller's to keep. thresholds: what the postprocess keeps in this stream
        (default: the config's).

        items: what `run` takes as its source (a file list, folder or glob; images in memory; any
        iterable of paths and images, each indexed by its position), or the stream's own items
        (ImageRef, source.as_item's), which carry their index (one or the other in a stream: a
        position and a carried index are never reconciled).

        One stream at a time per detector (its DALI pipeline and output buffers serve one): a
        second, started before the first is finished or closed, raises.

        An error raised by `items` (a generator's own) ends the stream: the batches of the items
        it gave before come out first, then the error is raised."""
        raised: list[Exception] = []
        yield from self.stream_batches(batches=batched(until_raised(inputs(items), raised), self.batch_size),
                                       on_error=on_error, clock=clock, on_device=on_device, thresholds=thresholds)
        if raised:
            raise raised[0]

    def stream_batches(self, batches: Iterable[list[Item]], on_error: Callable[[list[ImageError]], None], *,
                       clock: StageClock | None = None, on_device: bool = False,
                       thresholds: Thresholds | None = None
                       ) -> Iterator[tuple[PreprocessedBatch, Detections | DeviceDetections]]:
        """`stream` over batches the caller forms (each at most batch_size), each going through as
        it comes, none waiting to be filled: for a stream fed by requests (the Ray actor's)."""
        if self._streaming:
            raise RuntimeError("this Detector is already running a stream (a run() or stream() not yet finished): "
                               "finish or close that one first, or build a second Detector")
        self._streaming = True
        try:
            keep = self._keep(thresholds or self.thresholds)
            yield from self._stream(batches, on_error, clock or StageClock(), on_device, keep)
        finally:
            self._streaming = False

    def _stream(self, batches: Iterable[list[Item]], on_error: Callable[[list[ImageError]], None], clock: StageClock,
                on_device: bool, thresholds: Thresholds) -> Iterator[tuple[PreprocessedBatch, Detections | DeviceDetections]]:
        # On a GPU three threads overlap: this one feeds DALI and hands finished batches to the
        # caller; the engine's thread runs the model (ORT releases the GIL for the whole run); the
        # postprocess thread decodes, NMS's and copies the final rows to the host. The engine fills
        # `depth` sets of output buffers (slots) in turn; before it writes a slot again it waits for
        # the postprocess still reading it. On the CPU each step runs inline, in order.
        depth, count = self.engine.slots, 0
        pending: deque[tuple[PreprocessedBatch, Future]] = deque()  # past DALI, oldest first
        reading: dict[int, Future] = {}  # slot -> the postprocess reading its buffers
        files = clock.timed(read_chunks(batches, batch_size=self.batch_size, num_threads=self.num_threads,
                                        max_pixels=self.max_pixels, max_bytes=self.max_file_bytes, scaled=self.scaled,
                                        scaled_share=self.scaled_share, decode_threads=self.decode_threads,
                                        lookahead=self.prefetch_batches,
                                        remote_requests=self.storage_requests,
                                        remote_ahead_bytes=self.storage_read_ahead_mb << 20,
                                        remote_processes=self.storage_processes), "read")
        batches = clock.timed(self._preprocessed(readable(files, on_error, self.max_batch_pixels, self.device.torch),
                                                 on_error),
                              "preprocess")
        with self._threads() as (engine, post):
            for batch in batches:  # source: files read ahead, checked -> preprocess: DALI
                if batch is FLUSH:  # nothing more for now (a stream fed by requests): every batch on
                    while pending:
                        yield from self._finished(*pending.popleft(), clock, on_error)
                    continue
                slot, count = count % depth, count + 1
                ran = engine.submit(self._model, batch, slot, reading.get(slot), clock)  # engine: ORT on DALI's buffer
                reading[slot] = post.submit(self._postprocess, batch, ran, on_device, thresholds, clock)  # -> host
                pending.append((batch, reading[slot]))
                if len(pending) == depth:
                    yield from self._finished(*pending.popleft(), clock, on_error)
            while pending:
                yield from self._finished(*pending.popleft(), clock, on_error)

    def _keep(self, thresholds: Thresholds) -> Thresholds:
        """A stream's thresholds, checked and put in place before any batch flows: bound to a model
        that takes them as inputs, and, for the heads postprocess on a GPU, its CUDA graphs for them
        captured now, while nothing else runs on the GPU (as at setup)."""
        check_thresholds(thresholds.score_threshold, thresholds.iou_threshold, thresholds.max_detections)
        if self.postprocess.own_nms and thresholds.iou_threshold != self.thresholds.iou_threshold \
                and "iou_threshold" not in {s.name for s in self.engine.inputs}:
            raise ConfigError(f"iou_threshold: {self.model_path.name} runs its own NMS at an IoU of its own (it has "
                              "no iou_threshold input); leave iou_threshold unset for this model")
        self.engine.submit(self.engine.bind_scalars, dataclasses.asdict(thresholds)).result()
        captured = thresholds.captured()
        if captured in self._captured:  # most recently used last, as GraphCache orders them
            self._captured.remove(captured)
            self._captured.append(captured)
        else:
            self._warm_up_postprocess(captured)
        return thresholds

    def _model(self, batch: PreprocessedBatch, slot: int, reader: Future | None, clock: StageClock) -> Launched:
        """The engine on one batch, into the output buffers `slot`, once the postprocess still
        reading them (`depth` batches back) is done. Queued on the GPU without a host wait where
        the model allows (Engine.launch). Clock: "engine" is this thread's time."""
        if reader is not None:
            wait([reader])  # its errors are raised where its own result is taken
        start = time.perf_counter()
        try:
            return self.engine.launch(batch.images, slot)
        finally:
            clock.add("engine", time.perf_counter() - start)

    def _preprocessed(self, batches: Iterable[list[EncodedImage | PixelImage]],
                      on_error: Callable[[list[ImageError]], None]) -> Iterator[PreprocessedBatch]:
        """Each batch through DALI, run.prefetch_batches in flight: files and encoded bytes through
        the decoding pipeline, decoded pixels (a large JPEG decoded at a reduced scale, an image
        given in memory) through one of their own (built when first needed), both kinds in flight
        at once, in order."""
        pipelines = ByKind(self._preprocessors, source_of, self.preprocessor.for_source)
        yield from preprocess_stream(pipelines, batches, on_error, depth=self.prefetch_batches)

    def _postprocess(self, batch: PreprocessedBatch, ran: Future, on_device: bool, thresholds: Thresholds,
                     clock: StageClock) -> Detections | DeviceDetections:
        """The batch's postprocess on the device, then its one copy to the host (or, on_device,
        none). Clock: "engine_gpu" is the span of the model's kernels on the engine's stream."""
        launched: Launched = ran.result()
        launched.wait()  # this thread's stream waits for the model, on the device
        meta = image_meta(batch.scale_yx, batch.pad_yx, batch.orig_hw)
        found = self.postprocess(launched.outputs, meta, num_images=len(batch.refs), thresholds=thresholds)
        found = found.on_device() if on_device else found.to_host()  # to_host: the batch's one device-to-host copy
        if thresholds.classes:
            found = found.of_classes(thresholds.classes)
        if on_device and self.device.is_cuda:  # the rows made, and the engine's output buffers read, before the
            torch.cuda.current_stream(self.device.torch).synchronize()  # caller takes them and the engine reuses those
        seconds = launched.seconds()
        if seconds is not None:
            clock.add("engine_gpu", seconds)
        return found

    def _finished(self, batch: PreprocessedBatch, postprocessed: Future, clock: StageClock,
                  on_error: Callable[[list[ImageError]], None]) -> Iterator[tuple[PreprocessedBatch, Detections]]:
        """The batch with its detections, once its postprocess is done: without the images whose
        model outputs no record may hold (NaN or infinite values; a batch_index outside the batch:
        BadModelOutput), which go to on_error as bad_model_output."""
        with clock("postprocess"):  # waits for the batch's engine run and postprocess
            try:
                found = postprocessed.result()
            except BadModelOutput as e:
                on_error([bad_output(ref, str(e)) for ref in batch.refs])
                return
        if isinstance(found, DeviceDetections) and self._post_stream is not None:
            # made (and finished: _postprocess synchronized) on the postprocess's stream: the
            # caller's stream holds their memory from here
            found.record_stream(torch.cuda.current_stream(self.device.torch))
        bad = found.bad_images()
        if bad:
            on_error([bad_output(batch.refs[i], "the model's boxes, scores or landmarks for this image hold NaN or "
                                                "infinite values") for i in bad])
            batch, found = without_images(batch, bad), found.without(bad, len(batch.refs))
        if batch.refs:
            yield batch, found

    @contextmanager
    def _threads(self):
        """(engine, postprocess) executors: the engine's own thread and one for the postprocess on
        a GPU; inline on the CPU, where ORT's threads already use every core."""
        if not self.overlap:
            yield Inline(), Inline()
            return
        with ThreadPoolExecutor(1, thread_name_prefix="gpudet-postprocess", initializer=self._on_post_stream) as post:
            yield self.engine, post

    def _on_post_stream(self) -> None:
        """The postprocess thread's CUDA work goes on a stream of its own at a higher priority than
        the model's: its few hundred short kernels a batch run between the next batch's model
        kernels as soon as an SM is free, instead of queueing behind them (the next engine run
        waits for this one's reads of its buffers), and it waits for no stream but the engine's."""
        if self._post_stream is not None:
            torch.cuda.set_device(self.device.torch)
            torch.cuda.set_stream(self._post_stream)

    def _warm_up(self) -> None:
        """Run the model once at setup (cuDNN's algorithm search happens here, not on batch 1); on
        a GPU, then the heads postprocess once per output slot, so that its compile and its CUDA
        graphs happen now, while nothing else runs on the GPU (a graph captured mid-pipeline
        meets the engine's work queued on its own stream, and the capture fails)."""
        self.engine.warm_up(self.batch_size, (self.preprocessor.height, self.preprocessor.width))
        self._warm_up_postprocess(self.thresholds)

    def _warm_up_postprocess(self, thresholds: Thresholds) -> None:
        """The heads postprocess on a GPU once per output slot with `thresholds`: its compile and its
        CUDA graphs for them happen now (GraphCache keeps those of the last few thresholds)."""
        if not self.overlap or not self.postprocess.captured:
            return
        n, size_hw = self.batch_size, (self.preprocessor.height, self.preprocessor.width)
        for slot in range(self.engine.slots):
            outputs = self.engine.run(self.engine.zero_batch(n, size_hw), slot=slot)
            meta = image_meta(np.ones((n, 2), np.float32), np.zeros((n, 2), np.float32),
                              np.tile(np.array(size_hw, np.int64), (n, 1)))
            self.postprocess(outputs, meta, num_images=0, thresholds=thresholds).to_host()
        self._captured.append(thresholds)
        del self._captured[:-(GraphCache.MAX_GRAPHS // self.engine.slots)]  # those GraphCache still holds

    def run(self, source, *, root: str | None = None, score_threshold: float | None = None,
            iou_threshold: float | None = None, max_detections: int | None = None,
            classes: Iterable[str | int] | None = None, on_device: bool = False) -> Iterator[ImageResult | ImageError]:
        """Per-image results, in input order; an image that cannot be processed comes as an
        ImageError in its place, never as an exception.

        source: a file list (.txt), a folder, a glob or an image file (str or Path); one image in
        memory; or any iterable (a generator too, read as it is needed) of paths and images in
        memory. An image in memory: encoded bytes (bytes, or a 1-D uint8 numpy array or CPU
        tensor), a PIL image, uint8 RGB pixels as a numpy array [H, W, 3] or a torch tensor
        [H, W, 3] or [3, H, W], on the CPU or on the detector's GPU (handed to DALI there, with no
        host copy). score_threshold, iou_threshold, max_detections: this run's, instead of the
        config's (no new session). classes: keep only these classes (names of model.labels, or label
        numbers), instead of the config's postprocess.classes. on_device: the results' arrays as
        torch tensors on the device."""
        keep = dataclasses.replace(self.thresholds, **{k: v for k, v in (
            ("score_threshold", score_threshold), ("iou_threshold", iou_threshold),
            ("max_detections", max_detections)) if v is not None})
        if classes is not None:
            given = (classes,) if isinstance(classes, (str, int)) else tuple(classes)  # one class, or several
            keep = dataclasses.replace(keep, classes=class_numbers(given, self.labels, where="classes="))
        failed: list[tuple[int, ImageError]] = []  # a heap by index: the checks run ahead of the results

        def on_error(errors: list[ImageError]) -> None:
            for error in errors:
                heapq.heappush(failed, (error.index, error))

        for batch, found in self.stream(inputs(source, root), on_error, on_device=on_device, thresholds=keep):
            per_image = found.per_image(len(batch.refs))
            for ref, (height, width), found_here in zip(batch.refs, batch.orig_hw.tolist(), per_image):
                while failed and failed[0][0] < ref.index:
                    yield heapq.heappop(failed)[1]
                yield ImageResult.of(ref, height, width, found_here, self.labels)
        while failed:
            yield heapq.heappop(failed)[1]


def inputs(source, root: str | None = None) -> Iterator[Item]:
    """What Detector.run takes, as the stream's items (which pass as they are); values that are
    no image come out as ImageErrors, which the source check passes on."""
    if isinstance(source, (str, os.PathLike)):
        yield from list_images(source, root=root)
        return
    if not isinstance(source, Iterable) or isinstance(source, (bytes, bytearray, memoryview)) or \
            type(source).__module__.split(".")[0] in ("numpy", "torch", "PIL"):
        source = [source]  # one image in memory
    own = (ImageRef, EncodedImage, PixelImage, ImageError)
    for index, value in enumerate(source):
        yield value if isinstance(value, own) else as_item(value, index)


def until_raised(items: Iterable, raised: list[Exception]) -> Iterator:
    """`items`, ending where they raise an Exception, which is put in `raised` instead."""
    try:
        yield from items
    except Exception as e:
        raised.append(e)


def readable(batches: Iterable[list[EncodedImage | PixelImage | ImageError]],
             on_error: Callable[[list[ImageError]], None], max_batch_pixels: int,
             device: torch.device) -> Iterator[list[EncodedImage | PixelImage]]:
    """The images of each batch that passed the source's checks, in parts of one kind (files and
    encoded bytes, or decoded pixels) that decode to at most max_batch_pixels; the others go to
    on_error, with the pixels on a GPU that is not the detector's `device`."""
    for items in batches:
        if items is FLUSH:
            yield FLUSH
            continue
        items = [elsewhere(i, device) if isinstance(i, PixelImage) and i.on_device and i.data.device != device
                 else i for i in items]
        errors = [i for i in items if isinstance(i, ImageError)]
        if errors:
            on_error(errors)
        for _, part in groupby((i for i in items if not isinstance(i, ImageError)), key=source_of):
            yield from within_pixels(list(part), max_batch_pixels)


def elsewhere(item: PixelImage, device: torch.device) -> ImageError:
    return ImageError(item.ref.index, item.ref.path, "bad_array",
                      f"a tensor on {item.data.device}, and the detector runs on {device}: move it there "
                      f"(.to('{device}'))")


def source_of(item_or_batch) -> str:
    """The Preprocessor source a decodable image (or a batch of one kind) goes through."""
    item = item_or_batch[0] if isinstance(item_or_batch, list) else item_or_batch
    if isinstance(item, EncodedImage):
        return "encoded"
    return "device_pixels" if item.on_device else "host_pixels"


def check_memory(device: Device, *, batch_size: int, height: int, width: int, value_bytes: int, batches: int) -> None:
    """Refuse, before anything runs, a batch size and input size whose model inputs alone (`batches`
    of them in flight) would not fit in the device's free memory."""
    need = batch_size * height * width * 3 * value_bytes * batches
    free = free_bytes(device)
    if need > 0.8 * free:
        raise ConfigError(f"run.batch_size {batch_size} x a {height}x{width} model input: {batches} batches in "
                          f"flight (run.prefetch_batches + run.pipeline_depth) need {need / 2**30:.1f} GiB for the "
                          f"model's input alone, and {device} has {free / 2**30:.1f} GiB free; lower run.batch_size "
                          "or preprocess.size")


def bad_output(ref: ImageRef, what: str) -> ImageError:
    return ImageError(ref.index, ref.path, "bad_model_output", f"{what}; the model, not the image, is at fault: "
                                                               "check its export (gpudet inspect MODEL)")


def without_images(batch: PreprocessedBatch, images: list[int]) -> PreprocessedBatch:
    """The batch without the images at rows `images` (and without its padding rows)."""
    keep = [i for i in range(len(batch.refs)) if i not in set(images)]
    return dataclasses.replace(batch, refs=[batch.refs[i] for i in keep], orig_hw=batch.orig_hw[keep],
                               scale_yx=batch.scale_yx[keep], pad_yx=batch.pad_yx[keep])


class Inline:
    """An executor that runs each task when it is submitted, here (the CPU path). Errors are kept
    in the future and raised where the result is taken, in order, as a thread's would be."""

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args))
        except Exception as e:
            future.set_exception(e)
        return future
