"""Engine: one ONNX Runtime session and its IOBinding; tensors cross in and out through DLPack.

Inputs: the preprocessed batch is bound with `OrtValue.from_dlpack` on DALI's own buffer (no host
copy, no device copy). Scalar postprocess inputs some models declare (`score_threshold`,
`iou_threshold`, `max_detections`) are bound on the host, where ORT's kernels read them, when a
stream starts (each stream may bring its own thresholds).

Outputs: an output whose shape is known once the batch size is known is bound to a preallocated
torch buffer on the device, `slots` per batch size (two by default: the caller postprocesses one
while the engine fills the other), reused across batches. Any other output (for
example the dynamic N of in-graph NMS) is bound by device only; ORT allocates it on the device
and `torch.from_dlpack` reads it there. `OrtValue.numpy()` is never called on this path: on a
CUDA OrtValue it is a device-to-host copy.

Threads: every ORT run goes through the engine's own thread (`Engine.submit`; `run` called from
another thread waits for it there). ORT keeps a CUDA graph, and cuDNN/cuBLAS handles, per calling
thread (the CUDA EP's per-thread context): a graph captured at warm-up on one thread is not
replayed by runs from another, which would capture again, in the middle of the pipeline, beside
the postprocess thread's work, where the capture fails. ORT releases the GIL for a whole run, so
the caller's thread does Python work meanwhile.

Stream ordering: ORT's CUDA EP computes on the engine's own stream (`Engine.stream`, handed to
ORT as `user_compute_stream`). `run` synchronizes it before returning (ORT's default): the
outputs are complete for any stream, and ORT is done with the input buffer. `launch` does not
(the run option `disable_synchronize_execution_providers`) when every output has a preallocated
buffer: it returns once ORT has queued the model's kernels, with an event the reader makes its
own stream wait for (`Launched.wait`). The engine's thread can then queue the next batch while
the GPU still runs this one, so the model's kernels follow each other with no host round trip
between them. The caller keeps the input alive, and does not let the engine write a slot again,
until its reader has synchronized after reading (Detector.stream).

The input is taken through DLPack with the engine's stream named as its reader (`__dlpack__(stream=
...)`): the producer makes that stream wait for its own pending writes (DALI hands out a batch
while its kernels may still be running on DALI's stream). Taken on another stream, as torch's
`from_dlpack` does on the caller's current stream, the model (or the CUDA-graph input copy) on the
engine's stream would not wait for them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from .device import Device
from .errors import GpuOutOfMemory, ModelError
from .session import (SCALAR_INPUTS, TensorSpec, bind_scalars, open_session, session_key,
                      take_started)

ORT_TO_TORCH = {
    "tensor(float)": torch.float32, "tensor(float16)": torch.float16, "tensor(int64)": torch.int64,
    "tensor(int32)": torch.int32, "tensor(bool)": torch.bool, "tensor(uint8)": torch.uint8,
    "tensor(double)": torch.float64,
}
TORCH_TO_NUMPY = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64,
                  torch.int32: np.int32, torch.bool: np.bool_, torch.uint8: np.uint8, torch.float64: np.float64}

KDL_CUDA = 2  # DLPack's device type for CUDA memory (DLDeviceType.kDLCUDA)

log = logging.getLogger("gpudet")


class Engine:
    """An ORT session on one device with a reusable IOBinding. The session is the one
    session.start_early opened for the same arguments, if there is one, else a new one."""

    def __init__(self, model_path: str | Path, *, device: Device, scalars: dict[str, float | int],
                 input_size_hw: tuple[int, int] | None = None, batch_size: int | None = None,
                 cuda_options: dict[str, str] | None = None, cuda_graph: bool = False, slots: int = 2,
                 oom_retry: bool = True):
        """input_size_hw: for a model whose image input has symbolic height/width, fix them (ORT
        free-dimension overrides) so shape arithmetic folds into constants at load time instead of
        running on the host each batch (Memcpy nodes on the CUDA EP). batch_size: the same for a
        symbolic batch dimension (the model then takes only that batch size).

        cuda_graph (CUDA only): ORT captures the model's kernels once per output slot and replays
        them (`enable_cuda_graph`, one `gpu_graph_id` per slot). A graph replays on the addresses
        it was captured with, so each slot also gets its own input buffer, and run() copies the
        batch into it (one device-to-device copy). Needs static shapes: batch_size (or a static
        batch in the model) and outputs whose shape the batch size decides.

        slots: the sets of output buffers the caller fills in turn (run.pipeline_depth); with
        cuda_graph each is captured at warm-up.

        oom_retry: on GPU out-of-memory, run each batch in parts of half as many images (down to
        one) from then on (`run_batch`); not with a fixed batch size or a CUDA graph."""
        self.model_path = Path(model_path)
        self.device = device
        self.cuda_options = cuda_options or {}
        started = device.is_cuda and take_started(session_key(
            self.model_path, device.index, input_size_hw=input_size_hw, batch_size=batch_size,
            cuda_options=self.cuda_options, cuda_graph=cuda_graph))
        try:
            early = started.opening.result() if started else None  # the opening, before the first run it started
        except BaseException:  # interrupted while waiting: the run is stopped, as drop_started would stop it
            started.run_options.terminate = True
            started.executor.shutdown(wait=False)
            raise
        if started and early is None:  # it could not open: this engine opens its own and meets the reason
            started.executor.shutdown(wait=True)
        # self.stream: ORT's compute stream on a GPU (module docstring); the CUDA-graph input copy goes on it too.
        if early:  # opened by session.start_early, its first run under way on what becomes this engine's thread
            # This thread works on the engine's GPU from here, as opening the session on it would
            # have made it: the postprocess's graph captures take the current device's streams.
            torch.cuda.set_device(device.torch)
            self.stream = torch.cuda.ExternalStream(early.stream, device=device.torch)
            self._executor, self._thread = started.executor, started.thread
            opened, self._first_run = early.opened, started.first_run
            log.debug("%s on %s: the session opened early is taken over, its first run under way",
                      self.model_path.name, device)
        else:
            self.stream = torch.cuda.Stream(device.torch) if device.is_cuda else None
            # Every ORT run on this one thread (module docstring); it ends when the engine is collected.
            self._executor, self._first_run = ThreadPoolExecutor(1, thread_name_prefix="gpudet-engine"), None
            self._thread = self._executor.submit(threading.current_thread).result()
            opened = open_session(self.model_path, cuda_index=device.index if device.is_cuda else None,
                                  stream=self.stream.cuda_stream if device.is_cuda else None,
                                  input_size_hw=input_size_hw, batch_size=batch_size, cuda_options=self.cuda_options,
                                  cuda_graph=cuda_graph)
        self.slots = slots
        self.oom_retry = oom_retry
        self.run_batch: int | None = None
        """Images per ORT run after a GPU out-of-memory; None: the whole batch in one run."""
        self.session, self.cuda_options, self.cuda_graph = opened.session, opened.cuda_options, opened.cuda_graph
        self.declared_batch = opened.declared_batch
        """The batch size the model itself fixes (None: any); image_input.batch also counts batch_size."""
        self.model = opened.model
        """What the model declares as opened: inputs, outputs, metadata."""
        self.inputs, self.outputs, self.image_input = opened.model.inputs, opened.model.outputs, opened.image_input
        self._batch_dim = next(s.shape[0] for s in self.inputs if s.name == self.image_input.name)
        self.binding = self.session.io_binding()
        self._static_buffers: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._graph_inputs: dict[int, torch.Tensor] = {}  # cuda_graph: per slot, the input buffer
        self._run_options: dict[tuple[int, bool], ort.RunOptions] = {}  # (slot, synchronize) -> options
        missing = [s.name for s in self.inputs if s.name in SCALAR_INPUTS and s.name not in scalars]
        if missing:
            raise ModelError(f"{self.model_path}: input {missing[0]} needs a value")
        self.bind_scalars(scalars)

    def bind_scalars(self, values: dict[str, float | int]) -> None:
        """The postprocess inputs the model declares (score_threshold, iou_threshold,
        max_detections), bound from `values` on the host, where ORT's kernels read them."""
        bind_scalars(self.binding, self.inputs, values)

    def _graph_input(self, images, slot: int) -> torch.Tensor:
        """The batch copied into the slot's own input buffer, on ORT's stream: the model's kernels
        follow it there, with no host wait (and it does not wait for the postprocess of the other
        slot, on a stream of its own)."""
        with torch.cuda.stream(self.stream):
            source = torch.from_dlpack(images)  # names this stream as the reader (module docstring)
            if slot not in self._graph_inputs:
                self._graph_inputs[slot] = torch.empty_like(source)
            target = self._graph_inputs[slot]
            target.copy_(source)
        return target

    def _dlpack(self, images):
        """`images` for `OrtValue.from_dlpack`: on a GPU, its capsule taken with the engine's stream
        as the reader, so the producer orders its pending writes before ORT's kernels, with no host
        wait (module docstring). `OrtValue.from_dlpack(images)` would ask with no stream: DALI then
        waits on the host, torch assumes the legacy default stream."""
        if self.stream is None or not hasattr(images, "__dlpack_device__") or \
                int(images.__dlpack_device__()[0]) != KDL_CUDA:  # host memory: no stream to name
            return images
        return images.__dlpack__(stream=self.stream.cuda_stream)

    @property
    def device_type(self) -> str:
        return "cuda" if self.device.is_cuda else "cpu"

    def output_shape(self, spec: TensorSpec, batch_size: int) -> tuple[int, ...] | None:
        """The output's shape for this batch size, or None when it depends on the data."""
        dims = []
        for i, d in enumerate(spec.shape):
            if isinstance(d, int):
                dims.append(d)
            elif i == 0 and d is not None and d == self._batch_dim:
                dims.append(batch_size)
            else:
                return None
        return tuple(dims)

    def static_buffers(self, batch_size: int, slot: int = 0) -> dict[str, torch.Tensor]:
        """Preallocated device buffers for the outputs whose shape is known, per batch size and
        slot (two slots let one batch be postprocessed while the next is computed, a third lets the
        model run one batch further ahead)."""
        key = (batch_size, slot)
        if key not in self._static_buffers:
            buffers = {}
            for spec in self.outputs:
                shape = self.output_shape(spec, batch_size)
                if shape is not None:
                    buffers[spec.name] = torch.empty(shape, dtype=ORT_TO_TORCH[spec.dtype], device=self.device.torch)
            self._static_buffers[key] = buffers
        return self._static_buffers[key]

    def submit(self, fn: Callable, *args) -> Future:
        """fn(*args) on the engine's thread, after the tasks submitted before it."""
        return self._executor.submit(fn, *args)

    def warm_up(self, batch_size: int, size_hw: tuple[int, int]) -> None:
        """Run once on a zero batch of the input's shape, so the CUDA EP's one-time work (cuDNN's
        algorithm search, seconds) happens at setup, not on the first batch."""
        if not self.device.is_cuda:
            return
        if self._first_run is not None:  # start_early's run: that work is done once it ends
            first, self._first_run = self._first_run, None
            try:
                first.result()
            except Exception as e:  # the runs below meet it again and report it
                log.debug("the session's early first run failed: %s", e)
        zeros = self.zero_batch(batch_size, size_hw)
        # With cuda_graph, ORT runs a few times before it captures: capture every slot's graph here,
        # while nothing else runs on the GPU (a capture in the middle of the pipeline would meet
        # the postprocess thread's CUDA calls).
        for slot in range(self.slots) if self.cuda_graph else (0,):
            for _ in range(4 if self.cuda_graph else 1):
                self.run(zeros, slot=slot)

    def zero_batch(self, batch_size: int, size_hw: tuple[int, int]) -> torch.Tensor:
        """A batch of zeros shaped and typed as the model's image input, on its device."""
        dtype = torch.float16 if self.image_input.dtype == "float16" else torch.float32
        return torch.zeros(self.image_input.batch_shape(batch_size, size_hw), dtype=dtype, device=self.device.torch)

    def run(self, images, slot: int = 0) -> dict[str, torch.Tensor]:
        """Run on `images` (any DLPack tensor on this device, shaped as the model's image input),
        on the engine's thread (module docstring), and wait for the outputs.

        Returns every output as a torch tensor on the device: static ones are the preallocated
        buffers of `slot` (overwritten by the next run into that slot), dynamic ones ORT's own
        allocations.
        """
        return self.launch(images, slot, synchronize=True).outputs

    def launch(self, images, slot: int = 0, *, synchronize: bool = False) -> Launched:
        """As `run`, but on a GPU, when every output has a preallocated buffer, return as soon as
        ORT has queued the model: the outputs are ready once `Launched.wait` has made the
        reader's stream wait for them. `images` must stay alive until then. Otherwise (a dynamic
        output, whose size ORT learns on the host; the CPU) the outputs are complete."""
        if threading.current_thread() is not self._thread:
            return self.submit(self._launch, images, slot, synchronize).result()
        return self._launch(images, slot, synchronize)

    def _options(self, slot: int, synchronize: bool) -> ort.RunOptions:
        key = (slot, synchronize)
        if key not in self._run_options:
            options = self._run_options[key] = ort.RunOptions()
            if self.cuda_graph:
                options.add_run_config_entry("gpu_graph_id", str(slot + 1))  # 0 is ORT's own
            if not synchronize:
                options.add_run_config_entry("disable_synchronize_execution_providers", "1")
        return self._run_options[key]

    def _launch(self, images, slot: int, synchronize: bool) -> Launched:
        """The batch in one run; after a GPU out-of-memory, in parts (the out-of-memory policy)."""
        while True:
            try:
                if self.run_batch is None:
                    return self._run_once(images, slot, synchronize)
                return self._run_in_parts(images, slot)
            except Exception as e:
                if not (self.device.is_cuda and is_out_of_memory(e)):
                    raise
                self._shrink(e, rows=_rows(images))

    def _shrink(self, error: Exception, *, rows: int) -> None:
        """After a GPU out-of-memory on `rows` images: halve the images per run (run.oom_retry),
        down to one, or say what would help."""
        now = min(self.run_batch or rows, rows)
        fixed = self.image_input.batch is not None
        if fixed or self.cuda_graph or not self.oom_retry or now == 1:
            why = "export the model with a smaller batch (its batch size is fixed)" if fixed else \
                "lower --batch-size" + (" (run.cuda_graph runs whole batches only)" if self.cuda_graph else "")
            raise GpuOutOfMemory(f"GPU out of memory running the model on {now} image(s) at once on {self.device}: "
                                 f"{why}, raise run.gpu_mem_limit_mb, or free the GPU ({error})") from error
        self.run_batch = max(1, now // 2)
        log.warning("GPU out of memory: running the model on %d images at a time from now on", self.run_batch)
        torch.cuda.empty_cache()

    def _run_in_parts(self, images, slot: int) -> Launched:
        """The batch in runs of run_batch images (zero-copy views of it), waited for one by one.
        Static outputs land in their rows of the slot's whole-batch buffers; dynamic ones are
        joined, an output named batch_index (the end_to_end contract) offset by each part's first row."""
        whole = torch.from_dlpack(self._dlpack(images))
        buffers = self.static_buffers(len(whole), slot)
        dynamic: dict[str, list[torch.Tensor]] = {}
        for start in range(0, len(whole), self.run_batch):
            part = whole[start:start + self.run_batch]
            rows = {name: buffer[start:start + len(part)] for name, buffer in buffers.items()}
            for name, value in self._run_once(part, slot, True, into=rows).outputs.items():
                if name not in buffers:
                    dynamic.setdefault(name, []).append(value + start if name == "batch_index" else value)
        outputs = {**buffers, **{name: torch.cat(parts) for name, parts in dynamic.items()}}
        return Launched(outputs, None, None, complete=True, device=self.device.torch)

    def _run_once(self, images, slot: int, synchronize: bool,
                  into: dict[str, torch.Tensor] | None = None) -> Launched:
        """One ORT run; static outputs into `into`, or the slot's buffers for this batch size."""
        started = None
        if self.device.is_cuda:
            started = torch.cuda.Event(enable_timing=True)
            started.record(self.stream)
        value = ort.OrtValue.from_dlpack(self._graph_input(images, slot) if self.cuda_graph else self._dlpack(images))
        batch_size = value.shape()[0]
        if self.image_input.batch not in (None, batch_size):
            raise ModelError(f"{self.model_path}: the model takes batches of exactly {self.image_input.batch} images, "
                             f"not {batch_size}")
        self.binding.bind_ortvalue_input(self.image_input.name, value)
        buffers = into if into is not None else self.static_buffers(batch_size, slot)
        for spec in self.outputs:
            if spec.name in buffers:
                buf = buffers[spec.name]
                self.binding.bind_output(spec.name, self.device_type, self.device.index, TORCH_TO_NUMPY[buf.dtype],
                                         list(buf.shape), buf.data_ptr())
            else:
                # Rebound every run: a dynamic output keeps the previous run's shape otherwise.
                self.binding.bind_output(spec.name, self.device_type, self.device.index)
        synchronize = synchronize or not self.device.is_cuda or len(buffers) < len(self.outputs)
        self.session.run_with_iobinding(self.binding, self._options(slot, synchronize))
        results = {}
        for spec, value in zip(self.outputs, self.binding.get_outputs()):
            results[spec.name] = buffers[spec.name] if spec.name in buffers else torch.from_dlpack(value)
        finished = None
        if started is not None:
            finished = torch.cuda.Event(enable_timing=True)
            finished.record(self.stream)
        return Launched(results, started, finished, complete=synchronize, device=self.device.torch)


def _rows(images) -> int:
    """The batch size of a DALI tensor (shape() is a method), a torch tensor or a numpy array."""
    shape = images.shape
    return int((shape() if callable(shape) else shape)[0])


@dataclass
class Launched:
    """A model run's outputs (torch tensors on the engine's device) and the events around its
    kernels on the engine's stream (None on the CPU)."""

    outputs: dict[str, torch.Tensor]
    started: torch.cuda.Event | None
    finished: torch.cuda.Event | None
    complete: bool
    """The outputs were complete when launch returned (ORT synchronized its stream)."""
    device: torch.device

    def wait(self) -> None:
        """Make the device's current stream wait (on the device, not the host) for the outputs."""
        if not self.complete:
            torch.cuda.current_stream(self.device).wait_event(self.finished)

    def seconds(self) -> float | None:
        """Seconds between the run's events on the engine's stream (from its input copy to its last
        kernel, with any wait there for the host to queue the rest); only once the run has
        finished (after the reader synchronized), else None."""
        if self.started is None or not self.finished.query():
            return None
        return self.started.elapsed_time(self.finished) / 1000


def is_out_of_memory(error: Exception) -> bool:
    """Whether a failed model run ran out of GPU memory: torch's error, CUDA's "out of memory",
    or ORT's CUDA EP and its capped arena ("Available memory of N is smaller than requested bytes
    of M" under run.gpu_mem_limit_mb)."""
    text = str(error).lower()
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in text or \
        "failed to allocate memory" in text or "is smaller than requested bytes" in text
