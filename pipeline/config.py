"""Typed, strict configuration: YAML file -> dataclasses, with `--set key=value` overrides.

Every key is declared here with its type and default; an unknown key, a wrong type or an invalid
value raises ConfigError naming the key. A Config is read-only (frozen, lists as tuples): what a
Detector was built from cannot change under it; `dataclasses.replace` makes a changed copy.
`Detector.from_config` is the one place that turns a Config into the stages' arguments; the
stages themselves take plain keyword arguments.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import numbers
import os
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .errors import ConfigError
from .yamlfile import parse_yaml, shown

log = logging.getLogger("gpudet")


@dataclass(frozen=True)
class ModelConfig:
    path: str = "retinaface_mnet025.onnx"
    """ONNX file. Relative paths resolve against the config file's folder, the working directory,
    then gpudet's models/."""
    cpu_path: str | None = None
    """The ONNX file for a run on the CPU, where another build of the same network is faster (the
    default config: float32 there, float16 on a GPU); None: `path` everywhere. --model sets both."""
    contract: str = "auto"
    """How outputs are read (docs/MODELS.md, "The model contract"): auto recognises it from the
    outputs; or a contract's name (pipeline/contracts/: end_to_end, ssd_heads, retinanet_heads,
    padded_end_to_end, set_prediction, anchor_free),
    or `module:Class` of a contract of your own."""
    labels: tuple[str, ...] = ("face",)
    """Class names, indexed by the model's label output (or label 0 when it has none); a label with
    no name here (all of them where this is empty) is named by its number."""
    landmarks: int = 5
    """Landmark points per detection the model outputs (0 for none)."""
    anchor_strides: tuple[int, ...] = (8, 16, 32)
    """ssd_heads: feature-map strides, in the order of the heads' anchors (RetinaFace's)."""
    anchor_sizes: tuple[tuple[float, ...], ...] = ((16.0, 32.0), (64.0, 128.0), (256.0, 512.0))
    """ssd_heads: square anchor sizes in input pixels, per stride."""
    box_variances: tuple[float, ...] = (0.1, 0.2)
    """ssd_heads: SSD box coding variances (center, size)."""
    objectness: Literal["auto", True, False] = "auto"
    """anchor_free: whether a YOLO head's rows hold an objectness score after the box (YOLOv5/v7);
    auto: a [B, N, 5+K] output has one, a [B, 4+K, N] output (YOLOv8/11) has not."""
    score_activation: Literal["sigmoid", "softmax"] = "sigmoid"
    """set_prediction: how logits become scores: sigmoid (RT-DETR, D-FINE) or softmax (DETR, whose
    last class is "no object")."""
    outputs: dict[str, str] = field(default_factory=dict)
    """The model's outputs by the names its contract reads them by, where the export named them
    otherwise: {the contract's name: the model's}, e.g. {logits: pred_logits, pred_boxes: boxes}."""


@dataclass(frozen=True)
class PreprocessConfig:
    size: tuple[int, ...] = (640, 640)
    """Model input [height, width], used when the model's own input size is dynamic."""
    resize: Literal["letterbox", "stretch"] = "letterbox"
    """letterbox keeps the aspect ratio and pads right/bottom; stretch scales each axis alone."""
    channel_order: Literal["RGB", "BGR"] = "BGR"
    mean: tuple[float, ...] = (104.0, 117.0, 127.0)
    """Per channel, in channel_order, in 0..255 pixel units."""
    std: tuple[float, ...] = (1.0, 1.0, 1.0)
    pad_value: float | None = None
    """The letterbox padding: a pixel value (0..255) in every channel, normalised as the image is;
    None: the mean colour (0 once normalised), what torchvision's detection transform pads with and
    what RetinaFace was trained on."""
    decoder: Literal["auto", "cpu"] = "auto"
    """auto: on a GPU, nvJPEG (with the hardware JPEG decoder where the GPU has one); on the CPU,
    the CPU decoders. cpu: decode on the CPU everywhere, the rest still on the device: the decoded
    pixels of a CPU-only run (nvJPEG's differ by a few levels), e.g. to compare devices; slower."""
    max_pixels: int = 100_000_000
    """Refuse (too_large) images whose header declares more pixels: 100 MP decodes to 300 MB.
    0 turns the check off."""
    max_file_mb: int = 512
    """Refuse (too_large) files larger than this many MiB before reading them. 0: no cap."""
    max_batch_pixels: int = 400_000_000
    """What one batch may decode at once, in declared pixels (3 bytes each): a batch of larger
    images is decoded in smaller batches. 400 MP holds 32 photos of 12 MP. 0: no bound."""
    scaled_decode: bool = True
    """A JPEG at least twice as large as the letterbox makes it (a 12 MP photo for a 640x640 model)
    is decoded at 1/2, 1/4 or 1/8 of its size on the reading threads (libjpeg-turbo's reduced
    DCT), then letterboxed by DALI: most of its pixels are never made. The result differs from a
    full decode by the resampling alone (docs/BENCHMARKS.md measures the same faces); false decodes
    every pixel, in DALI. CMYK JPEGs are decoded whole."""
    scaled_share: float = 0.0
    """scaled_decode on a GPU: the share of the batches whose large JPEGs the host decodes at a
    reduced scale; the others go to DALI whole (the hardware decoder), both at once. 0 by default:
    the share that pays depends on the host's cores, and a share they cannot keep pace with holds
    the decoder back (docs/BENCHMARKS.md measures shares on 16 cores). On the CPU every large JPEG
    is decoded at a reduced scale."""
    hw_decoder_load: float = 0.9
    """decoder auto on a GPU with a hardware JPEG decoder (A100, H100, H200): the share of each
    batch's JPEGs it decodes (DALI's hw_decoder_load; its default is 0.65, slower on the H200:
    docs/BENCHMARKS.md); nvJPEG decodes the rest on the GPU's SMs."""


@dataclass(frozen=True)
class PostprocessConfig:
    score_threshold: float = 0.9
    """Keep detections scoring at least this. 0.9 is the RetinaFace reference's threshold."""
    iou_threshold: float = 0.4
    max_detections: int = 750
    """Per image, highest scores first."""
    classes: tuple[str | int, ...] = ()
    """Keep only detections of these classes: names of model.labels, or label numbers (empty:
    every class). Applied to each image's final detections, after NMS and max_detections."""
    pre_nms_top_k: int = 1000
    """ssd_heads and anchor_free: the best candidates per image (over the threshold) that enter NMS."""
    compile: bool = False
    """Raw-heads models on a GPU: fuse the postprocess (decode, top-k, IoU, NMS steps) into Triton
    kernels with torch.compile. The detector's setup waits for the compile (tens of seconds; less
    once inductor's cache on disk has it), so it pays off on long jobs only; falls back to the
    plain kernels, with a warning, where compiling fails."""


@dataclass(frozen=True)
class RunConfig:
    batch_size: int = 32
    cpu_batch_size: int = 8
    """Images per batch on the CPU, where a smaller batch keeps the model's activations in the
    caches (docs/BENCHMARKS.md, "On a CPU"). --batch-size (the API's batch_size=) sets both."""
    device: str = "auto"
    """auto | cpu | cuda | cuda:N. cuda without a usable GPU is an error, never a silent fallback."""
    num_threads: int = 4
    """DALI's CPU threads (CPU decoding and CPU-side operators) and the file-reading threads. PNG
    and other non-JPEG formats decode on the CPU: raise it for PNG-heavy sets."""
    decode_threads: int = 0
    """Threads that decode large JPEGs at a reduced scale (preprocess.scaled_decode), beside the
    num_threads that read and check the files; 0: one per core."""
    storage_requests: int = 128
    """Object-storage sources: requests in flight (whole batches are read ahead to keep about
    this many; a store answers each after milliseconds to tens of them, a local disk at once)."""
    storage_read_ahead_mb: int = 512
    """Object-storage sources: what the batches read ahead may hold, in MiB (at the mean object
    size so far), whatever storage_requests asks; at least prefetch_batches' worth is read ahead."""
    storage_processes: int = 2
    """Processes that fetch a URL source's objects, each with its own Python interpreter: this
    one's threads (DALI's feeding, the model's launches, the writer) hold its GIL, which each
    fetched object needs. 0: fetched by this process's threads."""
    prefetch_batches: int = 2
    """Batches DALI preprocesses ahead of the one the engine takes, and batches of files read
    ahead of DALI (each one more holds a batch of encoded and decoded images and its model input
    in memory)."""
    pipeline_depth: int = 2
    """Batches past DALI at once, from the model to the writer, each with its own set of the
    model's output buffers (and, with cuda_graph, its own input buffer and captured graph). 2:
    the postprocess of one batch overlaps the model on the next; 3: the model may also run a batch
    further ahead while the main loop waits on DALI and writes (on a GPU; the CPU runs inline)."""
    gpu_mem_limit_mb: int = 0
    """Cap on ONNX Runtime's CUDA memory arena, in MiB (0: no cap). DALI's buffers are separate."""
    prefer_nhwc: bool = False
    """ONNX Runtime CUDA EP option prefer_nhwc: convolutions in channels-last (NHWC) layout, where
    the tensor cores want it."""
    fuse_conv_bias: bool = False
    """ONNX Runtime CUDA EP option fuse_conv_bias: each convolution's bias added inside cuDNN's
    convolution kernel (a runtime-fused cuDNN graph) instead of by a kernel of its own after it.
    Needs prefer_nhwc (in NCHW cuDNN finds no fused kernel for a 3-channel stem). Compare a model's
    GPU detections with the CPU's before turning it on (the shipped configs that set it are tested
    that way on a GPU)."""
    tf32: bool = True
    """Let the CUDA EP run float32 convolutions and matmuls on TF32 tensor cores (ORT's default):
    faster, with ~1e-3 relative error. false for float32 results that match the CPU's closely."""
    oom_retry: bool = True
    """On GPU out-of-memory in the model, run each batch in halves (down to one image) and go on."""
    cuda_graph: Literal["auto", True, False] = False
    """ONNX Runtime's CUDA graph for the model (GPU only): its kernels captured once and replayed,
    the batch size fixed at load, one device-to-device copy of each batch into the graph's input
    buffer. Needs a model with static output shapes (a heads contract, an export with a fixed
    batch). No out-of-memory retry. auto: on where the model's shapes allow it, else off (a model
    exported with dynamic shapes runs kernel by kernel, its batch size free)."""
    worker_restarts: int = 2
    """--devices: a worker that dies (killed by a signal or aborted, as by a CUDA fault: the
    process cannot continue, nothing is lost since results are flushed per batch) is started again
    on its images not yet recorded, up to this many times, while each run records something. A
    worker that exits with an error of gpudet's (a bad config, model or device) is not restarted."""


def class_numbers(classes: tuple, labels: tuple[str, ...], *, where: str = "postprocess.classes") -> tuple[int, ...]:
    """The label numbers of `classes` (names of `labels`, or numbers)."""
    numbers = []
    for value in classes:
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            numbers.append(value)
        elif isinstance(value, str) and value in labels:
            numbers.append(labels.index(value))
        else:
            named = f"the model's are {', '.join(labels[:20])}{', ...' if len(labels) > 20 else ''}" if labels \
                else "model.labels names none"
            raise ConfigError(f"{where}: {shown(value)} is not a class ({named}); give class names or label numbers")
    return tuple(sorted(set(numbers)))


def check_thresholds(score_threshold: float, iou_threshold: float, max_detections: int, *, where: str = "") -> None:
    """What the postprocess keeps, checked (the config's, or a run's own): ConfigError naming the
    key (`where` + name) otherwise."""
    def need(ok: bool, name: str, message: str) -> None:
        if not ok:
            raise ConfigError(f"{where}{name}: {message}")

    def number(value) -> bool:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)

    need(number(score_threshold) and 0.0 <= score_threshold <= 1.0, "score_threshold",
         f"{shown(score_threshold)} must be a number in [0, 1]")
    need(number(iou_threshold) and 0.0 < iou_threshold <= 1.0, "iou_threshold",
         f"{shown(iou_threshold)} must be a number in (0, 1]")
    whole = isinstance(max_detections, numbers.Integral) and not isinstance(max_detections, bool)
    need(whole and 0 < max_detections <= 100_000, "max_detections", f"{shown(max_detections)} must be a whole number in "
                                                                     "1..100000")


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)
    postprocess: PostprocessConfig = field(default_factory=PostprocessConfig)
    run: RunConfig = field(default_factory=RunConfig)
    source_file: str | None = None
    """The YAML file this came from (set by load_config, not a user key)."""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("source_file")
        return d

    def result_settings(self) -> dict[str, Any]:
        """What decides the records, not how fast they come or which images are refused: the
        model keys, the image as the model sees it, the thresholds. A --resume goes on only with
        the same, so that one folder's records come from one detector."""
        d = json.loads(json.dumps(self.to_dict()))  # tuples as the lists a JSON file gives back
        seen = ("size", "resize", "channel_order", "mean", "std", "pad_value")
        return {"model": d["model"], "preprocess": {k: d["preprocess"][k] for k in seen},
                "postprocess": {k: v for k, v in d["postprocess"].items() if k != "compile"}}

    def validate(self) -> None:
        def need(ok: bool, key: str, message: str) -> None:
            if not ok:
                raise ConfigError(f"{key}: {message}")

        p = self.preprocess
        need(len(p.size) == 2 and all(0 < v <= MAX_SIDE for v in p.size), "preprocess.size",
             f"needs [height, width], each in 1..{MAX_SIDE}")
        need(len(p.mean) == 3, "preprocess.mean", "needs 3 values, one per channel")
        need(len(p.std) == 3 and all(v > 0 for v in p.std), "preprocess.std", "needs 3 values > 0")
        need(p.max_pixels >= 0, "preprocess.max_pixels", "must be >= 0 (0: no limit)")
        need(p.max_file_mb >= 0, "preprocess.max_file_mb", "must be >= 0 (0: no cap)")
        need(p.max_batch_pixels >= 0, "preprocess.max_batch_pixels", "must be >= 0 (0: no bound)")
        need(p.pad_value is None or 0 <= p.pad_value <= 255, "preprocess.pad_value",
             "must be a pixel value in [0, 255], or null for the mean colour")
        need(0.0 <= p.hw_decoder_load <= 1.0, "preprocess.hw_decoder_load", "must be in [0, 1]")
        need(0.0 <= p.scaled_share <= 1.0, "preprocess.scaled_share", "must be in [0, 1]")
        need(0 <= self.run.decode_threads <= 256, "run.decode_threads", "must be in 0..256 (0: one per core)")
        q = self.postprocess
        check_thresholds(q.score_threshold, q.iou_threshold, q.max_detections, where="postprocess.")
        need(0 < q.pre_nms_top_k <= 100_000, "postprocess.pre_nms_top_k", "must be in 1..100000")
        m = self.model
        need(len(m.anchor_strides) == len(m.anchor_sizes), "model.anchor_sizes", "needs one list per anchor stride")
        need(len(m.box_variances) == 2, "model.box_variances", "needs [center, size]")
        need(0 < self.run.batch_size <= 4096, "run.batch_size", "must be in 1..4096")
        need(0 < self.run.cpu_batch_size <= 4096, "run.cpu_batch_size", "must be in 1..4096")
        need(0 < self.run.num_threads <= 256, "run.num_threads", "must be in 1..256")
        need(self.run.worker_restarts >= 0, "run.worker_restarts", "must be >= 0 (0: never restart a worker)")
        need(0 < self.run.storage_requests <= 4096, "run.storage_requests", "must be in 1..4096")
        need(self.run.storage_read_ahead_mb > 0, "run.storage_read_ahead_mb", "must be > 0")
        need(0 <= self.run.storage_processes <= 64, "run.storage_processes", "must be in 0..64 (0: fetched here)")
        need(0 < self.run.prefetch_batches <= 16, "run.prefetch_batches", "must be in 1..16")
        need(2 <= self.run.pipeline_depth <= 8, "run.pipeline_depth", "must be in 2..8 (2: the postprocess of one "
             "batch overlaps the model on the next)")
        need(self.run.gpu_mem_limit_mb >= 0, "run.gpu_mem_limit_mb", "must be >= 0 (0: no cap)")
        need(self.run.prefer_nhwc or not self.run.fuse_conv_bias, "run.fuse_conv_bias",
             "needs run.prefer_nhwc: true (in NCHW cuDNN has no fused kernel for a 3-channel stem); set "
             "prefer_nhwc, or fuse_conv_bias: false")
        need(0 <= self.model.landmarks <= 1000, "model.landmarks", "must be in 0..1000")


MAX_SIDE = 16384  # the largest model input side gpudet accepts (pixels)

SECTIONS = {"model": ModelConfig, "preprocess": PreprocessConfig, "postprocess": PostprocessConfig,
            "run": RunConfig}


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Check `value` against the field's annotation; accept int for float; raise ConfigError."""
    hint = annotation
    origin = typing.get_origin(hint)
    if origin is Literal:
        if value not in typing.get_args(hint):
            choices = ", ".join(map(str, typing.get_args(hint)))
            raise ConfigError(f"{key}: {shown(value)} is not one of {choices}")
        return value
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in typing.get_args(hint):
            return None
        inners = [a for a in typing.get_args(hint) if a is not type(None)]
        for inner in inners[:-1]:  # str | int: the first that takes the value
            with contextlib.suppress(ConfigError):
                return _coerce(key, value, inner)
        return _coerce(key, value, inners[-1])
    if origin is dict:
        key_type, value_type = typing.get_args(hint)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, e.g. {{name: name}}, got {shown(value)}")
        return {_coerce(f"{key} key", k, key_type): _coerce(f"{key}.{k}", v, value_type) for k, v in value.items()}
    if origin is tuple:
        item = typing.get_args(hint)[0]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {shown(value)}")
        return tuple(_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value))
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}: {shown(value)} is not a finite number")
    if hint in (int, float, str, bool) and (type(value) is not hint):
        raise ConfigError(f"{key}: expected {hint.__name__}, got {shown(value)} ({type(value).__name__})")
    return value


def _apply(sections: dict[str, dict[str, Any]], values: dict[str, Any], origin: str) -> None:
    """Check `values` ({section: {key: value}}) and merge them into `sections`."""
    for section, body in values.items():
        if section not in SECTIONS:
            raise ConfigError(f"{origin}: unknown section {shown(section)}; expected one of {', '.join(SECTIONS)}")
        if not isinstance(body, dict):
            raise ConfigError(f"{origin}: section {shown(section)} must be a mapping of keys")
        hints = typing.get_type_hints(SECTIONS[section])
        for key, value in body.items():
            if key not in hints:
                raise ConfigError(f"{origin}: unknown key {section}.{shown(key)[1:-1]}; known: {', '.join(hints)}")
            try:
                sections[section][key] = _coerce(f"{section}.{key}", value, hints[key])
            except ConfigError as e:
                raise ConfigError(f"{origin}: {e}") from None


def parse_override(text: str, origin: str = "overrides") -> dict[str, Any]:
    """`section.key=value` (value parsed as YAML) -> {"section": {"key": value}}. origin: what
    errors call it (the CLI's --set, the API's overrides)."""
    if "=" not in text:
        raise ConfigError(f"{origin} {shown(text)}: expected section.key=value, e.g. postprocess.score_threshold=0.5")
    dotted, raw = text.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) != 2:
        raise ConfigError(f"{origin} {shown(text)}: the key must be section.key, e.g. run.batch_size")
    if len(text) > MAX_OVERRIDE_CHARS:
        raise ConfigError(f"{origin} {shown(text)}: {len(text):,} characters, over the {MAX_OVERRIDE_CHARS:,} a "
                          "value may have; put large values in a config file")
    value = parse_yaml(raw, f"{origin} {shown(text)}: value")
    return {parts[0]: {parts[1]: value}}


MAX_CONFIG_BYTES = 1 << 20
"""A config file over this size is refused: configs are a few hundred bytes."""
MAX_OVERRIDE_CHARS = 1 << 16
def _data_dir(name: str) -> Path:
    """configs/ or models/: inside the installed package (wheel), else beside it (source checkout)."""
    package = Path(__file__).resolve().parent
    installed = package / name
    return installed if installed.is_dir() else package.parent / name


def option_overrides(*, model: str | None = None, device: str | None = None, batch_size: int | None = None,
                     cli: bool = False) -> list[tuple[str, str]]:
    """The `--set` overrides that the --model, --device and --batch-size options stand for (the
    API's from_config keywords too, so a wrong type is refused here, not parsed into a right one),
    each paired with the option as the user gave it (cli: `--batch-size 0`, else `batch_size=0`),
    which load_config's errors name."""
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)):
        raise ConfigError(f"batch_size={shown(batch_size)}: give a whole number of images, e.g. batch_size=32")
    if device is not None and not isinstance(device, str):
        raise ConfigError(f"device={shown(device)}: give one of 'auto', 'cpu', 'cuda', 'cuda:N'")

    def said(name: str, value) -> str:
        return f"--{name.replace('_', '-')} {value}" if cli else f"{name}={shown(value)}"

    overrides = []
    if model is not None:
        # A relative path given here is the working directory's where it names a file there (a
        # config's model.path looks beside the config first: model_candidates).
        path = Path(os.path.expanduser(model))  # pathlib's expanduser raises for an unknown user (~nobody)
        here = Path.cwd() / path
        text = str(here) if not path.is_absolute() and here.is_file() else str(model)
        overrides += [(said("model", model), f"model.path={json.dumps(text)}"),
                      (said("model", model), "model.cpu_path=null")]
    if device is not None:
        overrides.append((said("device", device), f"run.device={device}"))
    if batch_size is not None:
        overrides += [(said("batch_size", batch_size), f"run.batch_size={batch_size}"),
                      (said("batch_size", batch_size), f"run.cpu_batch_size={batch_size}")]
    return overrides


def builtin_config(name: str = "retinaface_mnet025.yaml") -> Path:
    return _data_dir("configs") / name


def builtin_model_dir() -> Path:
    return _data_dir("models")


def config_file(text: str | Path | None) -> Path:
    """The YAML file a config name means: the embedded default for None; a file that exists; else,
    for a bare name (with or without .yaml), the config of that name gpudet ships (configs/), as
    --model finds a bundled model by its name."""
    if text is None:
        return builtin_config()
    given = Path(text).expanduser()
    if given.is_file():
        return given
    if given.is_dir():
        raise ConfigError(f"config {given} is a folder; give a YAML config file (or the name of one gpudet ships)")
    if str(text) == given.name:
        for shipped in (builtin_config(given.name), builtin_config(f"{given.name}.yaml")):
            if shipped.is_file():
                log.info("config %s: the one gpudet ships, %s (no file of that name here)", text, shipped)
                return shipped
    names = ", ".join(sorted(p.stem for p in _data_dir("configs").glob("*.yaml")))
    raise ConfigError(f"config file {given} does not exist; give a YAML file's path or the name of a config gpudet "
                      f"ships: {names}")


def load_config(path: str | Path | None = None, overrides: Iterable[str | tuple[str, str]] = (), *,
                origin: str = "overrides") -> Config:
    """Load a YAML config (default: the embedded RetinaFace one), apply overrides, validate.
    overrides: 'section.key=value' strings, or (what the user wrote, 'section.key=value') pairs, as
    for the CLI's --batch-size; an error about a key an override set names that override: origin
    and the string (origin: the API's overrides, the CLI's --set), or what the user wrote."""
    given, path = path, config_file(path)
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: {path.stat().st_size:,} bytes, over the {MAX_CONFIG_BYTES:,} a config may "
                              "have; --config takes a YAML config (configs/ has examples)")
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file; --config takes a YAML config (configs/ has examples)") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it: {e.strerror or e}") from None
    values = parse_yaml(text, str(path)) or {}
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    _apply(sections, values, str(path))
    set_by: dict[str, str] = {}
    for item in overrides:
        said, text = item if isinstance(item, tuple) else (f"{origin} {shown(item)[1:-1]}", item)
        values = parse_override(text, origin)
        _apply(sections, values, said)
        [(section, body)] = values.items()
        set_by[f"{section}.{next(iter(body))}"] = said
    config = Config(**{name: kind(**sections[name]) for name, kind in SECTIONS.items()}, source_file=str(path))
    try:
        config.validate()
        if given is None and "model.path" in set_by:  # a model without a config of its own
            config = taken_from_the_model(config, set_by)
        class_numbers(config.postprocess.classes, config.model.labels)  # the model's names, where it gives them
    except ConfigError as e:
        key = str(e).split(":", 1)[0]
        if key in set_by:
            raise ConfigError(f"{set_by[key]}: {e}") from None
        raise
    return config


GUESSED = {"preprocess.channel_order": "RGB", "preprocess.mean": (0.0, 0.0, 0.0),
           "preprocess.std": (255.0, 255.0, 255.0)}
"""What a model given without its config is fed where the model cannot say: RGB pixels scaled to
0..1, as YOLO, RT-DETR and torchvision's detection exports take them."""


def taken_from_the_model(config: Config, set_by: dict[str, str]) -> Config:
    """A model given without a config of its own (--model, or model=, and no config named):
    the embedded config's settings are RetinaFace's, so what the model declares replaces them (its
    input size where it is fixed, its class names from its metadata: `names` as Ultralytics writes
    it, or `labels`), and what it cannot declare is guessed (GUESSED), with one warning naming the
    keys to set. What the user set (--set) stays; a model gpudet ships keeps the embedded config."""
    try:
        path = resolve_model_path(config)
    except ConfigError:
        return config  # named where the model is loaded
    if path.parent == builtin_model_dir().resolve():
        return config
    declared = model_declarations(path)
    if declared is None:  # not a model ONNX reads: named where it is loaded
        return config
    labels, size_hw = declared
    changes = {key: value for key, value in GUESSED.items() if key not in set_by}
    if "model.labels" not in set_by:
        changes["model.labels"] = labels
    if size_hw is not None and "preprocess.size" not in set_by:
        changes["preprocess.size"] = size_hw
    sections = {}
    for key, value in changes.items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
    config = dataclasses.replace(config, **{section: dataclasses.replace(getattr(config, section), **values)
                                            for section, values in sections.items()})
    guessed = [key for key in (*GUESSED, "model.labels") if key in changes and not (key == "model.labels" and labels)]
    if guessed:
        def typed(value) -> str:  # as --set takes it
            return f"[{','.join(f'{v:g}' for v in value)}]" if isinstance(value, tuple) else str(value)

        shown_values = ", ".join(f"{key.split('.')[1]} {typed(changes[key]) if changes[key] else 'label numbers'}"
                                 for key in guessed)
        taken = " and ".join(what for what, found in (("input size", size_hw), ("class names", labels)) if found)
        log.warning("%s came without a config: gpudet %sguesses what it does not say (%s); if it was trained "
                    "otherwise, set %s (--set, or a config: docs/MODELS.md)", path.name,
                    f"takes its {taken} from it, and " if taken else "", shown_values, ", ".join(guessed))
    return config


def model_declarations(path: Path) -> tuple[tuple[str, ...], tuple[int, int] | None] | None:
    """A model's class names (its metadata's `names`, Ultralytics' {0: 'person', ...}, or
    `labels`: a JSON list or names separated by commas; () where it has neither) and its image
    input's fixed [height, width] (None where dynamic), read with ONNX without its weights; None
    where ONNX cannot read the file."""
    import ast

    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:
        return None
    if not model.graph.input:  # an empty file parses as an empty model
        return None
    metadata = {p.key: p.value for p in model.metadata_props}
    labels: tuple[str, ...] = ()
    try:
        if max(map(len, metadata.values()), default=0) > 1 << 20:
            raise ValueError("metadata too large to be class names")
        if "names" in metadata:
            names = ast.literal_eval(metadata["names"])
            if isinstance(names, dict) and names and all(isinstance(k, int) and k >= 0 for k in names):
                labels = tuple(str(names.get(k, k)) for k in range(max(names) + 1))
        elif "labels" in metadata:
            text = metadata["labels"].strip()
            names = json.loads(text) if text.startswith("[") else [n.strip() for n in text.split(",")]
            labels = tuple(str(n) for n in names)
    except (ValueError, SyntaxError, RecursionError, MemoryError):
        labels = ()
    weights = {i.name for i in model.graph.initializer}
    size_hw = None
    for given in model.graph.input:
        if given.name in weights:
            continue
        dims = [d.dim_value if d.HasField("dim_value") else None for d in given.type.tensor_type.shape.dim]
        if len(dims) == 4:
            h, w = (dims[2], dims[3]) if dims[1] == 3 else (dims[1], dims[2])
            size_hw = (h, w) if h and w else None
        break
    return labels, size_hw


def model_candidates(text: str, config_dir: Path | None = None) -> list[Path]:
    """Where a model file named `text` is looked for, in order: itself if absolute; else beside the
    config (config_dir), in the working directory and, for a bare file name, in gpudet's models/."""
    given = Path(os.path.expanduser(text))
    if given.is_absolute():
        return [given]
    candidates = [config_dir / given] if config_dir else []
    candidates.append(Path.cwd() / given)
    if given.name == text:  # a path with a folder means that folder: never another file of its name
        candidates.append(builtin_model_dir() / given.name)
    return candidates


def resolve_model_path(config: Config, *, on_cpu: bool = False) -> Path:
    """model.path (on_cpu: model.cpu_path, if set): absolute, or relative to the config's folder,
    then the working directory; a bare file name also in gpudet's models/."""
    key = "cpu_path" if on_cpu and config.model.cpu_path else "path"
    text = getattr(config.model, key)
    candidates = model_candidates(text, Path(config.source_file).parent if config.source_file else None)
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
        if candidate.exists():  # a folder, a FIFO, a device: named as what it is, not as missing
            raise ConfigError(f"model.{key}: {candidate} is not a file; give the model file's path (--model FILE, the "
                              f"API's model=, or model.{key})")
    tried = ", ".join(str(c) for c in candidates)
    raise ConfigError(f"model.{key}: {text} not found (looked in: {tried}); give the model file's path (--model "
                      f"FILE, the API's model=, or model.{key}); models gpudet does not ship are made by scripts/, "
                      "for example scripts/export_retinanet.py for torchvision RetinaNet")
