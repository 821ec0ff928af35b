"""ONNX Runtime sessions, without torch: what Engine opens, and the head start the CLI gives it.

`open_session` reads a model's inputs, fixes its symbolic dimensions (ORT free-dimension
overrides) and opens the session on the CPU or on a CUDA device with the CUDA EP's options and a
compute stream of the caller's. Engine opens its session through it.

A session's first run on a GPU costs seconds, once per session (cuDNN's algorithm search, kernels
loaded and some compiled from PTX), and the imports before it (torch, DALI, Triton) cost seconds more, with the
GIL held. `start_early` opens the session a config asks for before those imports, on a CUDA
stream of its own, and then runs it once, both on the thread that will be the engine's: the CUDA
context, most of the session's opening and the run are C++ that releases the GIL, so they overlap
the imports. Engine takes that session, thread and stream over when it is built for the same model,
device and options (`take_started`); otherwise nothing is taken and Engine opens its own.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from .config import Config, RunConfig, resolve_model_path, shown
from .errors import ModelError, one_line, signals_held

if os.environ.get("ORT_DISABLE_TELEMETRY") != "0":  # as pipeline/__init__ says, for an onnxruntime imported before it
    ort.disable_telemetry_events()

SCALAR_INPUTS = {"score_threshold": np.float32, "iou_threshold": np.float32, "max_detections": np.int64}

log = logging.getLogger("gpudet")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # ORT type string, e.g. "tensor(float)"
    shape: tuple  # ints for static dims, strings (or None) for symbolic ones

    @classmethod
    def of(cls, arg) -> TensorSpec:
        """An ORT NodeArg (session.get_inputs(), get_outputs()) as a TensorSpec."""
        return cls(arg.name, arg.type, tuple(arg.shape))

    def describe(self) -> str:
        dims = ", ".join(str(d) if d is not None else "?" for d in self.shape)
        return f"{self.name} {self.dtype.removeprefix('tensor(').removesuffix(')')} [{dims}]"


@dataclass(frozen=True)
class ModelIO:
    """What gpudet reads of a model file: its inputs, outputs and metadata."""

    path: Path
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    metadata: dict[str, str]
    """The model's metadata_props (a retinanet_heads model keeps its anchor layout there)."""

    @classmethod
    def of(cls, path: Path, session: ort.InferenceSession) -> ModelIO:
        return cls(Path(path), [TensorSpec.of(a) for a in session.get_inputs()],
                   [TensorSpec.of(a) for a in session.get_outputs()],
                   dict(session.get_modelmeta().custom_metadata_map))

    def record(self, contract: str) -> dict:
        """What summary.json says of the model: its file (path, sha256), contract, inputs and outputs."""
        return {"path": str(self.path), "sha256": hashlib.sha256(self.path.read_bytes()).hexdigest(),
                "contract": contract, "inputs": [s.describe() for s in self.inputs],
                "outputs": [s.describe() for s in self.outputs]}


def declared(model_path: Path) -> ModelIO:
    """The model's inputs, outputs (symbolic dims kept) and metadata as declared, read without
    running it (an unoptimized CPU session), after check_external_data; ModelError, one line,
    where ONNX or ONNX Runtime cannot read it."""
    check_external_data(model_path)
    return ModelIO.of(model_path, _session(model_path, {}, None))


@dataclass(frozen=True)
class ImageInput:
    name: str
    layout: str  # "NCHW" or "NHWC"
    dtype: str  # "float32" or "float16"
    size_hw: tuple[int, int] | None  # static model input size, or None when any size is accepted
    batch: int | None = None  # static batch size, or None when any batch size is accepted

    def batch_shape(self, batch_size: int, size_hw: tuple[int, int]) -> tuple[int, int, int, int]:
        """A batch's shape in this input's layout (size_hw where the model leaves the size open)."""
        height, width = self.size_hw or size_hw
        return (batch_size, 3, height, width) if self.layout == "NCHW" else (batch_size, height, width, 3)


def describe_io(specs: list[TensorSpec]) -> str:
    return "; ".join(s.describe() for s in specs) or "(none)"


def find_image_input(inputs: list[TensorSpec], model_path: Path) -> ImageInput:
    """The one rank-4 float input with 3 channels, its layout, dtype and (static) size."""
    images = [s for s in inputs if s.name not in SCALAR_INPUTS]
    unknown = [s for s in images if len(s.shape) != 4 or s.dtype not in ("tensor(float)", "tensor(float16)")]
    if len(images) != 1 or unknown:
        raise ModelError(
            f"{model_path}: expected one image input float32/float16 [B, 3, H, W] or [B, H, W, 3], plus "
            f"optional {', '.join(SCALAR_INPUTS)}; found inputs: {describe_io(inputs)}")
    spec = images[0]
    if spec.shape[1] == 3:
        layout, hw = "NCHW", spec.shape[2:4]
    elif spec.shape[3] == 3:
        layout, hw = "NHWC", spec.shape[1:3]
    else:
        raise ModelError(f"{model_path}: image input {spec.describe()} has no channel dimension of 3 "
                         "at position 1 (NCHW) or 3 (NHWC)")
    static = all(isinstance(d, int) for d in hw)
    return ImageInput(spec.name, layout, "float16" if spec.dtype == "tensor(float16)" else "float32",
                      tuple(hw) if static else None, spec.shape[0] if isinstance(spec.shape[0], int) else None)


def not_a_model(model_path: Path, error: Exception) -> ModelError:
    """The one line for a file that ONNX or ONNX Runtime cannot read as a model: what it is (text,
    empty) and what they said, in one line."""
    try:
        with open(model_path, "rb") as f:
            head = f.read(64)
    except OSError:
        head = b""
    if isinstance(error, OSError) and not head:
        what = f"cannot read it ({error.strerror or error})"
    elif not head:
        what = "it is empty (0 bytes)"
    elif head.lstrip()[:1] in (b"{", b"["):
        what = "it holds JSON text, not an ONNX model"
    else:
        what = f"not a readable ONNX model ({type(error).__name__}: {one_line(error, 200)})"
    return ModelError(f"{model_path}: {what}; give an .onnx file (gpudet inspect FILE checks one)")


def check_external_data(model_path: Path) -> None:
    """Refuse a model whose external-data references point outside its own folder: a model file
    must not make gpudet read arbitrary files (`location: ../../etc/passwd`)."""
    import onnx

    try:
        if model_path.stat().st_size == 0:  # protobuf reads an empty file as an empty model
            raise ValueError("empty")
        model = onnx.load(str(model_path), load_external_data=False)
    except Exception as e:  # protobuf DecodeError, ParseError (text that is no ONNX), OSError, ...
        raise not_a_model(model_path, e) from None
    folder = model_path.resolve().parent

    def tensors(graph):
        yield from graph.initializer
        for node in graph.node:
            for attr in node.attribute:
                if attr.HasField("t"):
                    yield attr.t
                yield from attr.tensors
                for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                    yield from tensors(sub)

    for tensor in tensors(model.graph):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        location = next((e.value for e in tensor.external_data if e.key == "location"), "")
        try:
            target = (folder / location).resolve()
        except (ValueError, OSError):  # a NUL byte, a loop of links: no file it could read
            raise ModelError(f"{model_path}: tensor {tensor.name!r} reads external data from {shown(location)}, "
                             "which names no file; refusing to load it") from None
        if Path(location).is_absolute() or not target.is_relative_to(folder):
            raise ModelError(f"{model_path}: tensor {tensor.name!r} reads external data from {location!r}, outside "
                             f"the model's folder {folder}; refusing to load it")


def bind_scalars(binding: ort.IOBinding, inputs: list[TensorSpec], values: dict[str, float | int]) -> None:
    """The postprocess inputs a model declares (score_threshold, iou_threshold, max_detections),
    bound from `values` on the host, where ORT's kernels read them."""
    for spec in inputs:
        if spec.name in SCALAR_INPUTS:
            binding.bind_cpu_input(spec.name, np.array([values[spec.name]], SCALAR_INPUTS[spec.name]))


def engine_arguments(config: Config, *, on_gpu: bool) -> dict:
    """Engine's arguments from a config, for a GPU or the CPU: what Detector.from_config builds
    its engine with, and what start_early opens the same session with."""
    q, r = config.postprocess, config.run
    return dict(model_path=resolve_model_path(config, on_cpu=not on_gpu),
                input_size_hw=tuple(config.preprocess.size),
                scalars={"score_threshold": q.score_threshold, "iou_threshold": q.iou_threshold,
                         "max_detections": q.max_detections},
                batch_size=r.batch_size if r.cuda_graph and on_gpu else None, cuda_options=cuda_ep_options(r),
                cuda_graph=r.cuda_graph)


def cuda_ep_options(run: RunConfig) -> dict[str, str]:
    """run.* as ONNX Runtime CUDA EP options."""
    options = {"prefer_nhwc": "1"} if run.prefer_nhwc else {}
    if run.fuse_conv_bias:
        options["fuse_conv_bias"] = "1"
    if not run.tf32:
        options["use_tf32"] = "0"
    if run.gpu_mem_limit_mb:  # the arena grows only by what is asked, so the cap is reached late and exactly
        options.update(gpu_mem_limit=str(run.gpu_mem_limit_mb << 20), arena_extend_strategy="kSameAsRequested")
    return options


@dataclass
class Opened:
    """An open session and what Engine needs to know of it."""

    session: ort.InferenceSession
    model: ModelIO
    """Its inputs and outputs as opened (dimension overrides applied)."""
    image_input: ImageInput
    declared_batch: int | None
    """The batch size the model itself fixes (None: any); image_input.batch also counts batch_size."""
    cuda_options: dict[str, str]
    cuda_graph: bool
    """Whether ORT replays the model as a CUDA graph (run.cuda_graph "auto" decided)."""


def open_session(model_path: Path, *, cuda_index: int | None, stream: int | None = None,
                 input_size_hw: tuple[int, int] | None = None, batch_size: int | None = None,
                 cuda_options: dict[str, str] | None = None, cuda_graph: bool | str = False) -> Opened:
    """The session Engine runs (its arguments: Engine's), on cuda:`cuda_index` with `stream` as
    ORT's compute stream, or on the CPU (cuda_index None). cuda_graph "auto": on where the shapes
    allow it (Opened.cuda_graph says)."""
    check_external_data(model_path)
    cuda_options = dict(cuda_options or {})
    # A first, unoptimized CPU session only reads the inputs (it is cheap; the real session
    # depends on them through the dimension overrides).
    probe = _session(model_path, {}, None)
    inputs = [TensorSpec.of(a) for a in probe.get_inputs()]
    image = find_image_input(inputs, model_path)
    overrides = {}
    if image.size_hw is None and input_size_hw is not None:
        spec = next(s for s in inputs if s.name == image.name)
        hw_dims = spec.shape[2:4] if image.layout == "NCHW" else spec.shape[1:3]
        overrides = {d: v for d, v in zip(hw_dims, input_size_hw) if isinstance(d, str)}
        if len(overrides) != 2 or hw_dims[0] == hw_dims[1]:
            overrides = {}  # unnamed or shared dims cannot be fixed independently
    batch_dim = next(s for s in inputs if s.name == image.name).shape[0]
    size_fixed = image.size_hw is not None or len(overrides) == 2
    if image.batch is None and batch_size is not None and isinstance(batch_dim, str) and batch_dim not in overrides:
        overrides[batch_dim] = batch_size
    # ORT refuses a graph with nodes off the CUDA EP only after loading; say why first.
    dynamic = [f"{a.name} {a.shape}" for a in probe.get_outputs()
               if not all(isinstance(d, int) or (i == 0 and d == batch_dim) for i, d in enumerate(a.shape))]
    static = (image.batch is not None or batch_dim in overrides) and size_fixed and not dynamic
    if cuda_graph == "auto" and not static:
        overrides.pop(batch_dim, None)  # no graph: the batch size stays free
    asked, cuda_graph = cuda_graph, bool(cuda_graph) and cuda_index is not None and (static or cuda_graph != "auto")
    if cuda_graph:
        if not static:
            raise ModelError(f"{model_path}: run.cuda_graph needs static shapes (the batch and input size "
                             f"fixed, outputs the batch size decides); found inputs {describe_io(inputs)}, "
                             f"dynamic outputs {', '.join(dynamic) or 'none'}. Use a heads model, "
                             "run.cuda_graph=auto or run.cuda_graph=false")
        cuda_options["enable_cuda_graph"] = "1"
    providers = ["CPUExecutionProvider"]  # a list, also on the CPU: None is _session's unoptimized probe
    if cuda_index is not None:
        ort.preload_dlls()  # the CUDA 13 / cuDNN 9 libraries torch's wheels brought
        providers = [("CUDAExecutionProvider", {"device_id": str(cuda_index), "user_compute_stream": str(stream),
                                                **cuda_options}), "CPUExecutionProvider"]
    try:
        session = _session(model_path, overrides, providers)
    except ModelError as e:
        if not (cuda_graph and asked == "auto"):
            raise
        # ORT refuses a graph once it has placed some nodes off the CUDA EP: auto runs without one
        log.info("%s runs kernel by kernel (run.cuda_graph auto): %s", model_path.name, e)
        return open_session(model_path, cuda_index=cuda_index, stream=stream, input_size_hw=input_size_hw,
                            cuda_options={k: v for k, v in cuda_options.items() if k != "enable_cuda_graph"})
    model = ModelIO.of(model_path, session)
    return Opened(session, model, find_image_input(model.inputs, model_path), image.batch, cuda_options, cuda_graph)


def _session(model_path: Path, dim_overrides: dict[str, int], providers: list | None) -> ort.InferenceSession:
    """providers None: an unoptimized CPU session that only reads the model's inputs and outputs."""
    options = ort.SessionOptions()
    for name, value in dim_overrides.items():
        options.add_free_dimension_override_by_name(name, value)
    options.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_DISABLE_ALL if providers is None
                                        else ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    options.log_severity_level = 3  # placement notes go through `gpudet inspect`, not every run
    # ORT's default logger warns at session creation about plugin EP discovery ("No registered
    # plugin EP device found for 'CUDAExecutionProvider'") although the built-in CUDA EP loads.
    ort.set_default_logger_severity(3)
    try:
        return ort.InferenceSession(str(model_path), options, providers=providers or ["CPUExecutionProvider"])
    except Exception as e:  # ORT raises several types for unreadable or invalid models
        raise ModelError(f"{model_path}: ONNX Runtime cannot load it: {one_line(e, 400)}") from None


@dataclass
class Started:
    """A session start_early is opening ahead of its Engine, on the thread that becomes the
    engine's: first its stream and session (`opening`), then its first run."""

    executor: ThreadPoolExecutor
    thread: threading.Thread
    """The executor's one thread: the engine's, where the session opens and every run of it goes."""
    opening: Future
    """-> Early (its stream and session), or None where it could not open: no CUDA runtime or
    stream, or an error that Detector.from_config meets again and reports."""
    first_run: Future
    run_options: ort.RunOptions
    """The first run's options: `terminate` ends it early when no Engine takes the session."""


@dataclass(frozen=True)
class Early:
    """What start_early's opening made."""

    stream: int
    """ORT's compute stream (a cudaStream_t), created for this session."""
    opened: Opened


_started: dict[tuple, Started] = {}


def session_key(model_path: Path, cuda_index: int, *, input_size_hw, batch_size, cuda_options, cuda_graph) -> tuple:
    """What decides a session: a started one is taken only by an Engine asking for the same."""
    return (str(Path(model_path).resolve()), cuda_index, tuple(input_size_hw) if input_size_hw else None,
            batch_size, tuple(sorted((cuda_options or {}).items())), bool(cuda_graph))


def take_started(key: tuple) -> Started | None:
    """The session start_early opened for `key`, handed over once; None if there is none."""
    return _started.pop(key, None)


def drop_started() -> None:
    """Let go of sessions started early that no Engine took (the device was not the one foreseen,
    or the command ended before building its detector): their first run is told to stop, and ends
    after the node it is in (ORT checks between nodes: at most a few tenths of a second). It is
    waited for, with the session's opening before it if that still goes: a CUDA graph captured
    meanwhile on another stream fails at that run's allocations."""
    while _started:
        _, started = _started.popitem()
        started.run_options.terminate = True
        started.executor.shutdown(wait=True)


@contextmanager
def started_early(config: Config) -> Iterator[None]:
    """start_early for a block that then imports torch, DALI and Triton (the session's opening and
    its first run on the GPU beside them; SIGINT and SIGTERM held while their thread starts); a
    session no detector took in the block is let go at its end."""
    with signals_held():
        start_early(config)
    try:
        yield
    finally:
        drop_started()


def start_early(config: Config) -> None:
    """Start opening the session `Detector.from_config(config)` will use on a GPU, then its first
    run, on the engine's thread, before the caller imports torch (module docstring). The calling
    thread goes on at once: the CUDA context, the stream and the session are made beside its
    imports. Does nothing where that run would not be on a GPU or the config names no model
    file; every problem is left for Detector.from_config to meet and report."""
    run = config.run
    if run.device == "cpu" or "CUDAExecutionProvider" not in ort.get_available_providers():
        return
    try:
        index = 0 if run.device in ("auto", "cuda") else int(run.device.removeprefix("cuda:"))
        args = engine_arguments(config, on_gpu=True)
    except Exception as e:  # ConfigError, ModelError, ValueError (cuda:N): Detector.from_config reports them
        log.debug("no early start of the session: %s", e)
        return
    if not has_driver():
        return
    scalars = args.pop("scalars")
    executor = ThreadPoolExecutor(1, thread_name_prefix="gpudet-engine")
    thread = executor.submit(threading.current_thread).result()
    run_options = ort.RunOptions()
    if args["cuda_graph"]:
        run_options.add_run_config_entry("gpu_graph_id", "-1")  # run, neither capture nor replay
    opening = executor.submit(_open_early, index, args)
    first_run = executor.submit(_first_run, opening, index, run.batch_size, args["input_size_hw"], scalars,
                                run_options)
    _started[session_key(cuda_index=index, **args)] = Started(executor, thread, opening, first_run, run_options)


def _open_early(index: int, args: dict) -> Early | None:
    """start_early's opening, on the engine's thread: a stream, then the session on it."""
    try:
        stream = new_stream(index)
        if stream is None:
            return None
        return Early(stream, open_session(cuda_index=index, stream=stream, **args))
    except Exception as e:  # ModelError, ORT's: Detector.from_config meets them again and reports them
        log.debug("no early start of the session: %s", e)
        return None


def _first_run(opening: Future, index: int, batch_size: int, input_size_hw, scalars: dict,
               options: ort.RunOptions) -> None:
    """One run on a zero batch (the CUDA EP's one-time work), outside any CUDA graph, once the
    session is open (`opening`, done: it ran before this on the same thread)."""
    early = opening.result()
    if early is None:
        return
    opened = early.opened
    image = opened.image_input
    shape = image.batch_shape(image.batch or batch_size, input_size_hw)
    binding = opened.session.io_binding()
    zeros = np.zeros(shape, np.float16 if image.dtype == "float16" else np.float32)
    binding.bind_ortvalue_input(image.name, ort.OrtValue.ortvalue_from_numpy(zeros, "cuda", index))
    bind_scalars(binding, opened.model.inputs, scalars)
    for spec in opened.model.outputs:
        binding.bind_output(spec.name, "cuda", index)
    opened.session.run_with_iobinding(binding, options)


def new_stream(index: int) -> int | None:
    """A non-blocking CUDA stream on cuda:`index` (torch's own streams are so), made through the
    CUDA runtime that onnxruntime loaded, without torch; None if that runtime or a driver is not
    found. The calling thread's current device becomes cuda:`index`, as the session's opening on
    it makes it anyway (going back to the device before would make a context on cuda:0):
    start_early calls it on the engine's thread, and Engine then sets the device of the thread
    that built it."""
    if not has_driver():
        return None
    ort.preload_dlls()
    cudart = _cudart()
    if cudart is None:
        return None
    stream = ctypes.c_void_p()
    if cudart.cudaSetDevice(index) or cudart.cudaStreamCreateWithFlags(ctypes.byref(stream), 1):  # non-blocking
        return None
    return stream.value


def has_driver() -> bool:
    """Whether the CUDA driver loads: without it there is no GPU to start anything on."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def _cudart() -> ctypes.CDLL | None:
    """The CUDA runtime of the CUDA major onnxruntime was built for, as onnxruntime.preload_dlls
    loaded it (from the nvidia-* wheels); None if it is not loaded: a second runtime is never
    brought in."""
    from onnxruntime.capi import build_and_package_info

    major = getattr(build_and_package_info, "cuda_version", "").split(".")[0]
    if not major:
        return None
    try:
        with open("/proc/self/maps") as maps:
            loaded = {line.split()[-1] for line in maps
                      if re.search(rf"/libcudart\.so\.{major}(\.\d+)*$", line.rstrip())}
    except OSError:
        return None
    for path in sorted(loaded):
        try:
            return ctypes.CDLL(path, mode=os.RTLD_NOLOAD)
        except OSError:
            continue
    return None
