"""Preprocess: a DALI graph that decodes, orients, resizes/letterboxes and normalizes a batch.

On a GPU the decoder runs as `device="mixed"` (nvJPEG, with the hardware decoder where there is
one) and every later operator on the GPU; without one the same graph runs on DALI's CPU backend.

Batches are submitted ahead (`submit`) and collected in order (`result`), so DALI decodes the
next batches on its own threads while the caller runs the model on this one.

Hand-off rules, where the batch leaves DALI (read before touching `PreprocessedBatch.images`):
- `result()` may return images DALI's kernels are still writing on DALI's stream: a reader on
  the GPU takes them through DLPack naming its own stream (`__dlpack__(stream=...)`, as the
  engine does), which DALI then makes wait for its writes.
- DALI's default (dynamic) executor hands out reference-counted buffers: the images stay valid
  while `PreprocessedBatch` holds them, also while later batches run (a test checks this). The
  engine binds that buffer itself through DLPack; nothing is copied.
- A failed batch invalidates the pipeline and every batch submitted after it: `result()` then
  raises PreprocessFailure with all of them, after rebuilding the pipeline. DALI cannot skip a
  bad image, so `preprocess_stream` resubmits the others and retries the failed batch in halves
  until only the images that fail alone are left (decode_failed).
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from nvidia.dali import fn, pipeline_def, types

from .device import Device
from .errors import GpudetError, one_line
from .results import ImageError, ImageRef
from .source import FLUSH, EncodedImage, PixelImage, undecodable

_END = object()


@dataclass
class PreprocessedBatch:
    images: Any
    """DALI TensorGPU/TensorCPU, [B, 3, H, W] (or [B, H, W, 3]), float32/float16, on the engine's
    device. Exposes __dlpack__. B may exceed len(refs): padding rows repeat the last image."""
    refs: list[ImageRef]
    """The images of the batch, in order; the first len(refs) rows of every array here."""
    orig_hw: np.ndarray
    """int64 [B, 2]: (height, width) of each decoded image, after EXIF orientation."""
    scale_yx: np.ndarray
    """float32 [B, 2]: model-input pixels per original pixel, per axis."""
    pad_yx: np.ndarray
    """float32 [B, 2]: offset of the image inside the model input (0: padding is right/bottom)."""


def decode(encoded, *, decode_device: str, channel_order: str, hw_decoder_load: float):
    """Encoded images -> uint8 HWC in channel_order. decode_device: DALI's "mixed" (nvJPEG, the
    hardware decoder's share: hw_decoder_load) or "cpu". Grayscale and CMYK come out as 3
    channels; EXIF orientation is applied."""
    decoder_args = {"hw_decoder_load": hw_decoder_load} if decode_device == "mixed" else {}
    output_type = types.BGR if channel_order == "BGR" else types.RGB
    return fn.decoders.image(encoded, device=decode_device, output_type=output_type, **decoder_args)


def letterbox_graph(images, *, height: int, width: int, resize: str, mean: list[float], std: list[float],
                    pad_value: float | None, dtype: types.DALIDataType, layout: str):
    """uint8 HWC images (any device) -> the model's input: (images, resized HWC shape). The
    padding is the pixel value pad_value (0..255) in every channel, normalised as the image is;
    None: the mean colour, 0 once normalised."""
    if resize == "letterbox":
        # not_larger keeps the aspect ratio inside height x width. subpixel_scale=False makes the
        # scale exactly (resized size / original size) per axis, which is what maps boxes back.
        images = fn.resize(images, size=[height, width], mode="not_larger", subpixel_scale=False, antialias=True)
    else:
        images = fn.resize(images, size=[height, width], subpixel_scale=False, antialias=True)
    resized_shape = images.shape()
    # The crop window larger than the image, anchored top-left, pads right/bottom. Its fill_values
    # are written into the output, after normalisation: a pixel value is normalised here.
    fill = [0.0] * 3 if pad_value is None else [(pad_value - m) / s for m, s in zip(mean, std)]
    images = fn.crop_mirror_normalize(images, crop=[height, width], crop_pos_x=0.0, crop_pos_y=0.0,
                                      out_of_bounds_policy="pad", fill_values=fill,
                                      mean=mean, std=std, dtype=dtype, output_layout=layout)
    return images, resized_shape


@pipeline_def
def _pipeline(source: str, decode_device: str, on_gpu: bool, channel_order: str, hw_decoder_load: float,
              graph_args: dict):
    """Images and each one's index fed from Python; the index comes back with the batch.

    source: "encoded" (a file's bytes, decoded here), "host_pixels" (uint8 RGB HWC arrays) or
    "device_pixels" (the same on the GPU: DALI reads them there, no host copy)."""
    # no_copy: DALI reads what it is fed where it is (a copy costs the feeding thread, which is the
    # loop's, about 3x the time), so Preprocessor keeps each batch (its in_flight) until the
    # outputs of its run are taken.
    index = fn.external_source(name="index", dtype=types.INT64, ndim=0)
    if source == "encoded":
        encoded = fn.external_source(name="images", dtype=types.UINT8, ndim=1, no_copy=True)
        images = decode(encoded, decode_device=decode_device, channel_order=channel_order,
                        hw_decoder_load=hw_decoder_load)
        on_host = decode_device == "cpu"
    else:
        on_host = source == "host_pixels"
        images = fn.external_source(name="images", device="cpu" if on_host else "gpu", dtype=types.UINT8, ndim=3,
                                    layout="HWC", no_copy=True)
        if channel_order == "BGR":
            images = fn.color_space_conversion(images, image_type=types.RGB, output_type=types.BGR)
    original_shape = images.shape()
    if on_gpu and on_host:
        images = images.gpu()
    images, resized_shape = letterbox_graph(images, **graph_args)
    return images, original_shape, resized_shape, index


class DecoderError(GpudetError, RuntimeError):
    """DALI failed for a reason that is not an image's own (memory, the GPU)."""


class PreprocessFailure(RuntimeError):
    """DALI failed on `failed`; `unfinished` were submitted after it and must be submitted again.
    The pipeline has been rebuilt and is empty."""

    def __init__(self, failed: list[EncodedImage], unfinished: list[list[EncodedImage]], cause: Exception):
        super().__init__(str(cause))
        self.failed, self.unfinished, self.cause = failed, unfinished, cause


class Preprocessor:
    """Runs the DALI graph on batches of images, several in flight: encoded bytes, or decoded
    pixels on the host or on the GPU (`source`, one pipeline each)."""

    def __init__(self, *, device: Device, batch_size: int, num_threads: int, height: int, width: int,
                 resize: Literal["letterbox", "stretch"], channel_order: Literal["RGB", "BGR"],
                 mean: list[float], std: list[float], pad_value: float | None,
                 dtype: Literal["float32", "float16"], layout: Literal["NCHW", "NHWC"], hw_decoder_load: float,
                 pad_partial_batches: bool = False, decoder: Literal["auto", "cpu"] = "auto",
                 source: Literal["encoded", "host_pixels", "device_pixels"] = "encoded"):
        """pad_partial_batches: fill a short batch up to batch_size by repeating its last image, so
        the model always sees one input shape (a new shape costs ORT's CUDA EP a cuDNN algorithm
        search, seconds on a GPU). The extra rows are not in `refs`. source: what batches hold
        (_pipeline); `for_source` makes the same preprocessing for another."""
        self._arguments = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        self.device = device
        self.source = source
        self.pad_partial_batches = pad_partial_batches
        self.batch_size = batch_size
        self.height, self.width = height, width
        self.num_threads = num_threads
        self.graph_args = dict(
            height=height, width=width, resize=resize, mean=list(mean), std=list(std), pad_value=pad_value,
            layout="CHW" if layout == "NCHW" else "HWC", dtype=types.FLOAT16 if dtype == "float16" else types.FLOAT)
        self.channel_order, self.hw_decoder_load = channel_order, hw_decoder_load
        self.decode_device = "mixed" if device.is_cuda and decoder == "auto" else "cpu"
        self.in_flight: deque[list[EncodedImage | PixelImage]] = deque()
        self.pipe = self._build()

    def for_source(self, source: Literal["encoded", "host_pixels", "device_pixels"]) -> Preprocessor:
        """The same preprocessing, for batches of another kind (a pipeline of its own)."""
        return Preprocessor(**{**self._arguments, "source": source})

    def _build(self):
        pipe = _pipeline(
            batch_size=self.batch_size, num_threads=self.num_threads,
            device_id=self.device.index if self.device.is_cuda else None,
            # Depth 1 and explicit schedule_run() per fed batch: the pipeline never asks for a
            # batch that was not fed (a deeper prefetch would, at the end of the data).
            prefetch_queue_depth=1, source=self.source, decode_device=self.decode_device,
            on_gpu=self.device.is_cuda, channel_order=self.channel_order, hw_decoder_load=self.hw_decoder_load,
            graph_args=self.graph_args)
        pipe.build()
        return pipe

    def rebuild(self) -> None:
        """A fresh pipeline: DALI cannot continue one whose run failed."""
        self.in_flight.clear()
        self.pipe = self._build()

    def submit(self, batch: list[EncodedImage | PixelImage]) -> None:
        """Start preprocessing `batch` (1..batch_size images) without waiting for it."""
        assert 0 < len(batch) <= self.batch_size
        fed = batch + batch[-1:] * (self.batch_size - len(batch)) if self.pad_partial_batches else batch
        if self.source == "device_pixels":  # DALI orders its reads after the work queued on torch's stream
            import torch

            self.pipe.feed_input("images", [item.data for item in fed],
                                 cuda_stream=torch.cuda.current_stream(self.device.torch).cuda_stream)
        else:
            self.pipe.feed_input("images", [item.data for item in fed])
        # One [B] array of B scalar samples: DALI checks a list of B 0-d arrays sample by sample, on
        # the loop's thread, several times slower.
        self.pipe.feed_input("index", np.array([item.ref.index for item in fed], dtype=np.int64))
        self.pipe.schedule_run()
        self.in_flight.append(batch)

    def result(self) -> PreprocessedBatch:
        """The oldest submitted batch, preprocessed. Raises PreprocessFailure if DALI failed on it."""
        batch = self.in_flight.popleft()
        try:
            images, original_shape, resized_shape, index = self.pipe.outputs()
        except Exception as e:  # DALI raises RuntimeError/IndexError/...; the pipeline is dead
            unfinished = list(self.in_flight)
            self.rebuild()
            raise PreprocessFailure(batch, unfinished, e) from e
        returned = np.array(index.as_tensor()).reshape(-1)[:len(batch)]
        expected = [item.ref.index for item in batch]
        assert returned.tolist() == expected, f"DALI returned batch {returned.tolist()}, fed {expected}"
        orig_hw = np.array(original_shape.as_tensor())[:, :2].astype(np.int64)
        for row, item in enumerate(batch):  # a reduced decode (ScaledDecode): the image's own size
            if getattr(item, "original_hw", None) is not None:
                orig_hw[row] = item.original_hw
        resized_hw = np.array(resized_shape.as_tensor())[:, :2].astype(np.float32)
        return PreprocessedBatch(
            images=images.as_tensor(), refs=[item.ref for item in batch], orig_hw=orig_hw,
            scale_yx=resized_hw / orig_hw.astype(np.float32), pad_yx=np.zeros_like(resized_hw))

    def run(self, batch: list[EncodedImage | PixelImage]) -> PreprocessedBatch:
        """Preprocess one batch and wait for it (nothing else may be in flight)."""
        assert not self.in_flight
        self.submit(batch)
        return self.result()


class ByKind:
    """Preprocessors for each kind of batch (encoded files, host pixels, device pixels: source_of)
    as one, for preprocess_stream: each batch goes to its kind's pipeline as it comes, several in
    flight across them, and comes back in the order it was submitted. A batch that fails sends
    every batch submitted after it back (PreprocessFailure.unfinished), those of the other
    pipelines too (their results dropped: they are preprocessed again), so the order holds."""

    def __init__(self, preprocessors: dict[str, Preprocessor], kind_of: Callable[[list], str],
                 make: Callable[[str], Preprocessor]):
        self.preprocessors, self._kind_of, self._make = preprocessors, kind_of, make
        self.in_flight: deque[tuple[str, list]] = deque()
        """(kind, batch), oldest first."""

    def submit(self, batch: list[EncodedImage | PixelImage]) -> None:
        kind = self._kind_of(batch)
        if kind not in self.preprocessors:
            self.preprocessors[kind] = self._make(kind)
        self.preprocessors[kind].submit(batch)
        self.in_flight.append((kind, batch))

    def result(self) -> PreprocessedBatch:
        kind, _ = self.in_flight.popleft()
        try:
            return self.preprocessors[kind].result()
        except PreprocessFailure as failure:  # its pipeline is rebuilt and empty; drop the others' later batches
            later = [batch for _, batch in self.in_flight]
            for other, _ in self.in_flight:
                if other != kind:
                    try:
                        self.preprocessors[other].result()
                    except PreprocessFailure:  # rebuilt: nothing left in flight there
                        pass
            self.in_flight.clear()
            raise PreprocessFailure(failure.failed, later, failure.cause) from failure.cause

    def run(self, batch: list[EncodedImage | PixelImage]) -> PreprocessedBatch:
        assert not self.in_flight
        self.submit(batch)
        return self.result()


def decode_failed(item: EncodedImage, cause: Exception) -> ImageError:
    """The error record of an image the decoder rejected, with the useful part of DALI's message."""
    text = str(cause)
    # DALI's message: "Critical error in pipeline: ... Error in <operator> ... encountered: <what>".
    operator = re.search(r"Error in \w+ operator `([^`]+)`", text)
    what = text.split("encountered:", 1)[1].strip().splitlines()[0] if "encountered:" in text else text.strip()
    what = re.sub(r"\s*sample #\d+\s*:?\s*$", "", what).strip() or "rejected"
    return undecodable(item.ref, what, by=operator.group(1) if operator else None)


def failed_alone(item: EncodedImage, cause: Exception) -> ImageError:
    """The record of an image DALI failed on by itself; raises when the failure is not the image's
    own (memory, a CUDA error: every image would fail the same way, and none should be recorded)."""
    text = str(cause).lower()
    if any(s in text for s in ("out of memory", "bad_alloc", "cudaerror", "cuda error", "cannot allocate")):
        what = one_line(cause)
        raise DecoderError(f"DALI failed on {item.ref.path} for a reason that is not the image's own ({what}); lower "
                           "run.batch_size or preprocess.size, or free memory, then continue with --resume")
    return decode_failed(item, cause)


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
                on_error([failed_alone(part[0], failure.cause)])
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
    here (the preprocessor's next stream would otherwise get them first). A FLUSH batch (source.py)
    is handed on once every batch before it is out of DALI.
    """
    retry: deque[list[EncodedImage]] = deque()
    source = iter(batches)
    draining = False  # a FLUSH came: every batch in flight first, then the mark
    try:
        while True:
            while len(preprocessor.in_flight) < depth:  # batches to submit again go first, also before a FLUSH
                if retry:
                    batch = retry.popleft()
                elif draining:
                    break
                else:
                    batch = next(source, _END)
                    if batch is _END:
                        break
                    if batch is FLUSH:
                        draining = True
                        continue
                if batch:
                    preprocessor.submit(batch)
            if not preprocessor.in_flight:
                if not draining:
                    return
                draining = False
                yield FLUSH
                continue
            try:
                yield preprocessor.result()
            except PreprocessFailure as failure:
                retry.extendleft(reversed(failure.unfinished))
                if len(failure.failed) == 1:
                    on_error([failed_alone(failure.failed[0], failure.cause)])
                else:
                    yield from isolate(preprocessor, failure.failed, on_error)
    finally:
        while preprocessor.in_flight:
            try:
                preprocessor.result()
            except PreprocessFailure:  # DALI is rebuilt: nothing left in flight
                pass
