"""Model contracts: how a model's outputs become detections. One class per contract, one module
per class in this package:

    end_to_end         NMS in the model's graph: boxes [N, 4], scores [N], batch_index [N]
    ssd_heads          raw SSD heads against anchors (RetinaFace): loc, conf, landmarks
    retinanet_heads    torchvision RetinaNet's heads: cls_logits, bbox_regression
    padded_end_to_end  NMS in the graph, padded per image: [B, M, 6] (YOLO exported with NMS)
    set_prediction     DETR-family queries: logits [B, Q, K], pred_boxes [B, Q, 4]
    anchor_free        YOLO-family heads: [B, 4+K, N] or [B, N, 5+K]

A contract declares the outputs it reads (name -> rank; or `fits` on shapes and metadata), builds
its postprocess from the model and the config (`from_config`: the one place config becomes its
arguments), and is called as every postprocess is: `postprocess(outputs, meta, num_images=,
thresholds=)` (postprocess.py). A module added here is a contract gpudet knows (model.contract: its
`name`); one of your own is model.contract: `package.module:Class`, importable wherever the
detector runs (--devices workers and Ray actors too).
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from ..errors import ModelError, signals_held
from ..session import ModelIO, TensorSpec, describe_io

if TYPE_CHECKING:
    import torch

    from ..config import Config


class Contract:
    """A model output contract and its postprocess, on the device (subclasses: one per module)."""

    name: ClassVar[str]
    outputs: ClassVar[dict[str, int]]
    """The outputs it reads, by name, with their rank: what `auto` recognises it by."""
    optional: ClassVar[dict[str, int]] = {}
    order: ClassVar[int] = 100
    """`auto` tries the contracts in this order (then by name)."""
    captured: ClassVar[bool] = False
    """Static shapes and no host sync up to its final rows: on a GPU it runs as CUDA graphs, captured
    at setup for each set of the engine's output buffers (Detector._warm_up_postprocess)."""
    own_nms: ClassVar[bool] = False
    """NMS is in the model: its IoU threshold is the model's own, unless the model takes it as an input."""

    @classmethod
    def fits(cls, outputs: list[TensorSpec], metadata: dict[str, str] | None = None) -> bool:
        """Whether a model of these outputs (and metadata_props) follows this contract."""
        by_name = {s.name: s for s in outputs}
        return all(n in by_name and len(by_name[n].shape) == r for n, r in cls.outputs.items()) and all(
            len(by_name[n].shape) == r for n, r in cls.optional.items() if n in by_name)

    @classmethod
    def why(cls, outputs: list[TensorSpec], metadata: dict[str, str] | None = None) -> str:
        """What `fits` recognised it by, for gpudet inspect."""
        return "its outputs " + ", ".join(f"{n} (rank {r})" for n, r in cls.outputs.items())

    @classmethod
    def expected(cls) -> str:
        """What it reads, for an error message."""
        return f"{cls.name}: " + ", ".join(f"{n} (rank {r})" for n, r in cls.outputs.items()) + (
            ", optional " + ", ".join(f"{n} (rank {r})" for n, r in cls.optional.items()) if cls.optional else "")

    @classmethod
    def from_config(cls, model: ModelIO, config: Config, *, device: torch.device,
                    input_hw: tuple[int, int]) -> Contract:
        """The postprocess for `model` as `config` asks, on `device`, for inputs of input_hw."""
        raise NotImplementedError

    def compile_ahead(self, outputs: dict[str, tuple]) -> None:
        """Start compiling what its first call would (outputs: name -> (torch dtype, shape)) on a
        thread, beside the rest of the setup; nothing by default."""

    def __call__(self, outputs: dict[str, torch.Tensor], meta: torch.Tensor, *, num_images: int, thresholds):
        """The batch's final detections on the device (postprocess.DeviceDetections or
        PackedDetections): outputs by name, meta [B, 6] (postprocess.image_meta), the first
        num_images rows real images."""
        raise NotImplementedError


def static_outputs(model: ModelIO) -> bool:
    """Whether every output's shape is known but for its batch size: the engine then binds buffers
    of its own, the same every batch, and a postprocess over them can run as CUDA graphs (an
    output sized by the data, or by a dimension gpudet does not fix, is ORT's new allocation each
    batch)."""
    return all(isinstance(d, int) for spec in model.outputs for d in spec.shape[1:])


def renamed(model: ModelIO, names: dict[str, str]) -> ModelIO:
    """The model with its outputs under the names model.outputs gives them ({the contract's name:
    the model's}), for an export whose names no contract recognises; ModelError naming the model's
    outputs for a name it does not have."""
    if not names:
        return model
    have = {s.name for s in model.outputs}
    unknown = [name for name in names.values() if name not in have]
    if unknown:
        raise ModelError(f"model.outputs names {', '.join(map(repr, unknown))}, which {model.path.name} does not "
                         f"have; its outputs: {describe_io(model.outputs)}")
    as_contract = {theirs: ours for ours, theirs in names.items()}
    return dataclasses.replace(model, outputs=[dataclasses.replace(s, name=as_contract.get(s.name, s.name))
                                               for s in model.outputs])


class Renamed:
    """A contract's postprocess over outputs that model.outputs names by hand: the engine's
    outputs, by the model's names, reach it under the contract's."""

    def __init__(self, postprocess: Contract, names: dict[str, str]):
        self.postprocess, self.as_contract = postprocess, {theirs: ours for ours, theirs in names.items()}
        self.captured, self.own_nms = postprocess.captured, postprocess.own_nms

    def compile_ahead(self, outputs: dict[str, tuple]) -> None:
        self.postprocess.compile_ahead(outputs)  # named as the contract names them (the renamed model's)

    def __call__(self, outputs: dict[str, torch.Tensor], meta: torch.Tensor, **options):
        return self.postprocess({self.as_contract.get(k, k): v for k, v in outputs.items()}, meta, **options)


def known() -> list[type[Contract]]:
    """The contracts of this package, in the order `auto` tries them."""
    found = []
    for module in pkgutil.iter_modules(__path__):
        with signals_held():  # a contract's module may be the first to import torch (and its C++)
            loaded = importlib.import_module(f"{__name__}.{module.name}")
        found += [c for c in vars(loaded).values()
                  if isinstance(c, type) and issubclass(c, Contract) and c.__module__ == loaded.__name__]
    return sorted(found, key=lambda c: (c.order, c.name))


def named(name: str) -> type[Contract] | None:
    """model.contract's class: None for auto, a known contract by its name, or `module:Class`."""
    if name == "auto":
        return None
    if ":" in name:
        module, _, attribute = name.partition(":")
        try:
            found = getattr(importlib.import_module(module), attribute)
        except (ImportError, AttributeError) as e:
            raise ModelError(f"model.contract {name}: cannot import it ({e}); give module:Class of a contract "
                             "importable here (on PYTHONPATH)") from None
        if not (isinstance(found, type) and issubclass(found, Contract)):
            raise ModelError(f"model.contract {name}: not a subclass of pipeline.contracts.Contract")
        return found
    by_name = {c.name: c for c in known()}
    if name not in by_name:
        raise ModelError(f"model.contract {name!r}: not a contract gpudet knows; give auto, one of "
                         f"{', '.join(by_name)}, or module:Class of your own")
    return by_name[name]


def recognise(outputs: list[TensorSpec], requested: str, model_path: Path,
              metadata: dict[str, str] | None = None) -> type[Contract]:
    """The contract the model's outputs (and metadata_props) follow: model.contract's if it fits,
    else the first of `known()` that does (auto). ModelError listing the outputs and what was
    expected otherwise."""
    wanted = named(requested)
    candidates = [wanted] if wanted is not None else known()
    for contract in candidates:
        if contract.fits(outputs, metadata or {}):
            return contract
    raise ModelError(f"{model_path}: outputs do not fit the {requested} contract. Found: {describe_io(outputs)}. "
                     f"Expected {'; '.join(c.expected() for c in candidates)}. Where only the names differ, map "
                     "them in the config: model.outputs: {the contract's name: the model's}.")


def landmark_points(outputs: list[TensorSpec], requested: int, model_path: Path) -> int:
    """Landmark points per detection: model.landmarks when the model has a `landmarks` output
    (checked against its width, 2 values a point, where that is static), else 0."""
    spec = next((s for s in outputs if s.name == "landmarks"), None)
    if spec is None:
        return 0
    width = spec.shape[-1]
    if isinstance(width, int) and width != 2 * requested:
        raise ModelError(f"model.landmarks: {requested} points per detection, but {model_path.name}'s output "
                         f"{spec.describe()} holds {width} values ({width // 2} points of x, y); set "
                         f"model.landmarks: {width // 2}")
    return requested
