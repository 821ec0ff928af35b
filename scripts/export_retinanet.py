"""Export torchvision's RetinaNet (ResNet50-FPN, v1 or v2) to ONNX in gpudet's two contracts.

    end_to_end       images            float32|float16 [B, 3, H, W]  RGB, ImageNet mean/std
                     score_threshold   float32 [1]
                     iou_threshold     float32 [1]
                     max_detections    int64   [1]   per image
                     -> boxes [N, 4] float32 x1y1x2y2 input pixels, scores [N], labels [N] int64,
                        batch_index [N] int64     (N: all detections of the batch)
    retinanet_heads  images            float32|float16 [B, 3, H, W]
                     -> cls_logits [B, A, K], bbox_regression [B, A, 4]   (static shapes)
                     anchors, box coding and top-k in the model's metadata (`gpudet.retinanet`)

B is fixed at export (`--batch-size`; static shapes let ORT fold all shape arithmetic, so no
Memcpy nodes on the CUDA EP and CUDA graphs become possible), or dynamic with `--dynamic-batch`.
H x W is fixed (`--size`, default 800 800: the config letterboxes every image into it).

The end-to-end graph's postprocess is torchvision's (`RetinaNet.postprocess_detections`), batched
over the images instead of a Python loop per image: each level's top-k (anchor, class) pairs of
the raw logits (sigmoid is monotonic, so it runs on the winners only), found on the level's top-k
anchors by best class, with the levels side by side as rows of one TopK (ORT's TopK runs one CUDA
block per row: per level, 16 rows would leave most of the GPU idle); for all levels' winners at
once, the sigmoid, the decode with the box coder's clamp, the clip to the input; then per-class NMS
with the coordinate-offset trick (no per-class scores tensor), in two ways joined by one `If` per
batch. The fast one runs greedy NMS on every image at once: the IoU matrix of each image's best
`--nms-prefix` (1,024) candidates and 16 rounds of "kept unless a kept, better candidate overlaps
it" (on fp16 0/1 matrices), whose fixed point is greedy NMS's answer; it holds the answer
when the rounds reached that fixed point and the prefix holds 300 kept or all the candidates above
the threshold. Any image where that fails sends the batch to the other way, one
`NonMaxSuppression` over [B, 1, 5 x top-k], which ORT runs image after image with a host
synchronisation each (docs/BENCHMARKS.md: 0.3 ms per image at the worst case on an H200). Both
give torchvision's detections (tested, each way).

Weights: `--checkpoint FILE` (a state_dict, or a dict holding one under "model" or
"state_dict", as torchvision's reference training scripts save), else random initialisation
(benchmarks only: its scores are meaningless, and none passes 0.05; `--detections-per-image N`
shifts the class bias so that about N per image do, the load a trained model puts on NMS). Nothing is downloaded: torchvision's weight URLs
cannot be reached offline, so fetch the checkpoint once where you can and pass the file.

Needs torch and torchvision (`pip install torch==2.14.1 torchvision==0.29.1`, or any matching
pair); gpudet itself never imports torchvision.

    python scripts/export_retinanet.py --contract end_to_end --out models/retinanet_r50_e2e.onnx
    python scripts/export_retinanet.py --contract retinanet_heads --fp16 --out models/retinanet_r50_heads_fp16.onnx
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

try:
    import torchvision
    from torchvision.models.detection import retinanet_resnet50_fpn, retinanet_resnet50_fpn_v2
    from torchvision.models.detection.image_list import ImageList
except ImportError as e:  # the exporter's one extra need; the pipeline never imports torchvision
    sys.exit(f"export_retinanet.py needs torchvision ({e}). Install a pair that matches your torch, for example\n"
             "    pip install torch==2.14.1 torchvision==0.29.1")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pipeline.contracts.retinanet_heads import RETINANET_METADATA, RetinaNetHeads, decode_box_deltas  # noqa: E402

SAMPLES = Path(__file__).resolve().parent.parent / "samples"
IMAGENET_MEAN, IMAGENET_STD = [123.675, 116.28, 103.53], [58.395, 57.12, 57.375]  # torchvision's, in 0..255 units

ARCHITECTURES = {"retinanet_resnet50_fpn": retinanet_resnet50_fpn,
                 "retinanet_resnet50_fpn_v2": retinanet_resnet50_fpn_v2}


def build_model(arch: str, checkpoint: Path | None, num_classes: int, seed: int) -> nn.Module:
    """torchvision's RetinaNet in eval mode, with the checkpoint's weights or seeded random ones."""
    torch.manual_seed(seed)
    model = ARCHITECTURES[arch](weights=None, weights_backbone=None, num_classes=num_classes)
    if checkpoint is not None:
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)
        for key in ("model", "state_dict"):
            if isinstance(state, dict) and isinstance(state.get(key), dict):
                state = state[key]
        try:
            model.load_state_dict(state)
        except RuntimeError as e:
            sys.exit(f"{checkpoint}: does not fit {arch} with {num_classes} classes: {e}")
    return model.eval()


class Heads(nn.Module):
    """Backbone + FPN + heads: images [B, 3, H, W] -> cls_logits [B, A, K], bbox_regression [B, A, 4]."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.backbone, self.head = model.backbone, model.head

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.head(list(self.backbone(images).values()))
        return out["cls_logits"], out["bbox_regression"]


def detection_load_shift(model: nn.Module, detections_per_image: float, paths: list[str],
                         size_hw: tuple[int, int], *, score_threshold: float = 0.05, iou_threshold: float = 0.5,
                         max_detections: int = 300) -> float:
    """The shift of the classification head's bias (every class but 0, the background id) that
    makes torchvision's postprocess keep about `detections_per_image` detections per image of
    `paths` (mean, letterboxed to size_hw): random weights keep none above 0.05, a trained model
    tens to hundreds on a photo. Bisection over the shift on the head's outputs, computed once."""
    from PIL import Image

    images = []
    for path in paths:
        image = Image.open(path).convert("RGB")
        scale = min(size_hw[0] / image.height, size_hw[1] / image.width)
        image = image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))),
                             Image.Resampling.BILINEAR)
        pixels = np.zeros((*size_hw, 3), np.float32)  # the padding: 0 once normalized, as gpudet pads
        pixels[:image.height, :image.width] = (np.asarray(image) - IMAGENET_MEAN) / IMAGENET_STD
        images.append(torch.from_numpy(pixels.transpose(2, 0, 1).astype(np.float32)))
    batch = torch.stack(images)
    model = copy.deepcopy(model).float().eval()
    with torch.no_grad():
        features = list(model.backbone(batch).values())
        head = model.head(features)

    def kept(shift: float) -> float:
        logits = head["cls_logits"].clone()
        logits[..., 1:] += shift
        found = torchvision_postprocess(model, batch, {"cls_logits": logits, "bbox_regression": head["bbox_regression"]},
                                        features=features, score_threshold=score_threshold,
                                        iou_threshold=iou_threshold, max_detections=max_detections)
        return float(np.mean([len(d["scores"]) for d in found]))

    low, high = 0.0, 8.0  # the count grows with the shift
    for _ in range(20):
        middle = (low + high) / 2
        low, high = (middle, high) if kept(middle) < detections_per_image else (low, middle)
    return (low + high) / 2


def shift_class_bias(model: nn.Module, shift: float) -> None:
    """Add `shift` to the classification head's bias of every class but 0 (in place)."""
    conv = model.head.classification_head.cls_logits
    with torch.no_grad():
        conv.bias.view(-1, model.head.classification_head.num_classes)[:, 1:] += shift


def anchor_layout(model: nn.Module, size_hw: tuple[int, int]) -> dict:
    """What gpudet needs to rebuild torchvision's anchors on the device: per level the feature grid,
    the integer stride torchvision uses (input size // grid, so 61 and 114 px for P6/P7 at 800),
    and the rounded cell anchors; plus box coding and top-k. Anchors are [A, 4] x1y1x2y2, level by
    level, row-major over the grid, cell anchors innermost (torchvision's order)."""
    with torch.no_grad():
        features = list(model.backbone(torch.zeros(1, 3, *size_hw)).values())
    grids = [list(f.shape[-2:]) for f in features]
    model.anchor_generator.set_cell_anchors(torch.float32, torch.device("cpu"))
    return {
        "input_hw": list(size_hw),
        "grids": grids,
        "strides": [[size_hw[0] // g[0], size_hw[1] // g[1]] for g in grids],
        "cell_anchors": [a.tolist() for a in model.anchor_generator.cell_anchors],
        "box_weights": list(model.box_coder.weights),
        "box_clip": model.box_coder.bbox_xform_clip,
        "topk_candidates": model.topk_candidates,
        "num_classes": model.head.classification_head.num_classes,
    }


def reference_anchors(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """torchvision's own anchors for this input size: [A, 4] x1y1x2y2."""
    features = list(model.backbone(images[:1]).values())
    return model.anchor_generator(ImageList(images[:1], [tuple(images.shape[-2:])]), features)[0]


class OnnxNms(torch.autograd.Function):
    """ONNX NonMaxSuppression over boxes [B, N, 4], scores [B, 1, N] -> selected [M, 3]
    (batch, class, box), best first per image. Eager forward (torchvision.ops.nms) for testing."""

    @staticmethod
    def forward(ctx, boxes, scores, max_per_image, iou_threshold, score_threshold):
        rows = []
        for b in range(boxes.shape[0]):
            candidates = torch.nonzero(scores[b, 0] > score_threshold)[:, 0]
            kept = candidates[torchvision.ops.nms(boxes[b, candidates], scores[b, 0, candidates],
                                                  float(iou_threshold))][: int(max_per_image)]
            rows.append(torch.stack([torch.full_like(kept, b), torch.zeros_like(kept), kept], dim=1))
        return torch.cat(rows)

    @staticmethod
    def symbolic(g, boxes, scores, max_per_image, iou_threshold, score_threshold):
        return g.op("NonMaxSuppression", boxes, scores, max_per_image, iou_threshold, score_threshold)


class EndToEnd(nn.Module):
    """Heads + torchvision's postprocess, batched over images, in one graph (module docstring)."""

    def __init__(self, model: nn.Module, size_hw: tuple[int, int], prefix: int = 1024, steps: int = 16):
        super().__init__()
        self.heads = Heads(model)
        self.prefix, self.steps = prefix, steps
        layout = anchor_layout(model, size_hw)
        # gpudet's own anchor builder (tested against torchvision's AnchorGenerator)
        anchors = RetinaNetHeads(layout=layout, device=torch.device("cpu"), cuda_graphs=False).anchors
        self.register_buffer("anchors", anchors, persistent=False)
        self.level_sizes = [g[0] * g[1] * len(c) for g, c in zip(layout["grids"], layout["cell_anchors"])]
        self.topk, self.weights, self.clip = layout["topk_candidates"], tuple(layout["box_weights"]), layout["box_clip"]
        # The levels side by side as rows [L, widest level] of anchor ids (a short level padded
        # with anchor 0, masked out): one TopK over all levels' rows instead of one per level.
        lengths = torch.tensor(self.level_sizes)[:, None]  # [L, 1]
        starts, positions = lengths.cumsum(0) - lengths, torch.arange(max(self.level_sizes))[None]
        self.register_buffer("level_starts", starts, persistent=False)
        self.register_buffer("level_lengths", lengths, persistent=False)
        self.register_buffer("level_padding", positions >= lengths, persistent=False)
        self.register_buffer("level_table", torch.where(self.level_padding, 0, positions + starts), persistent=False)
        self.size_hw = size_hw
        height, width = size_hw
        self.register_buffer("limits", torch.tensor([width, height, width, height], dtype=torch.float32),
                             persistent=False)

    def forward(self, images, score_threshold, iou_threshold, max_detections):
        logits, regression = self.heads(images)  # the model's dtype; only the winners go to float32
        batch, _, num_classes = logits.shape
        # The best class of every anchor in one pass over all levels, and each level's winners
        # gathered from the whole tensor: ORT has no views, so a per-level slice would copy the
        # logits (350 MB at batch 16) before reducing them.
        best_class = logits.amax(dim=2)  # [B, A]
        # ORT's TopK gives each row one CUDA block: per level it would run 16 blocks, one per
        # image, on a GPU of 132 SMs. So the levels go side by side as rows, [B, L, widest level],
        # and one TopK takes every level's winners (at 800 x 800: 9 TopKs -> 2; docs/BENCHMARKS.md).
        lowest = torch.finfo(logits.dtype).min
        levels = len(self.level_sizes)
        k = min(self.topk, max(self.level_sizes))
        rows = best_class[:, self.level_table].masked_fill(self.level_padding, lowest)  # [B, L, widest]
        # Top-k pairs lie on the top-k anchors by best class (postprocess.RetinaNetHeads); a level
        # of fewer than k anchors keeps them all, and the padding it drew is masked from here on.
        slot = rows.topk(k, dim=2)[1]  # [B, L, k] positions in each level's row
        real = slot < self.level_lengths  # [B, L, k]
        anchor = torch.where(real, slot + self.level_starts, 0).reshape(batch, levels * k)
        pairs = logits.gather(1, anchor[..., None].expand(-1, -1, num_classes))  # [B, L * k, K]
        pairs = pairs.masked_fill(~real.reshape(batch, levels * k, 1), lowest).reshape(batch, levels, k * num_classes)
        top, index = pairs.topk(min(self.topk, k * num_classes), dim=2)  # [B, L, k2], best first
        row = torch.div(index, num_classes, rounding_mode="floor")
        found = real.gather(2, row).reshape(batch, -1)  # False: padding (a level of < k2 pairs)
        anchor = anchor.reshape(batch, levels, k).gather(2, row).reshape(batch, -1)
        labels = (index % num_classes).reshape(batch, -1)
        top = top.reshape(batch, -1)
        # Decode, sigmoid and clip once for all levels' winners: each op is a kernel launch in ORT,
        # and on these small tensors the launches cost more than the work.
        scores = torch.where(found, top.float().sigmoid(), float("-inf"))  # padding never passes
        deltas = regression.gather(1, anchor[..., None].expand(-1, -1, 4)).float()
        height, width = self.size_hw
        boxes = decode_box_deltas(deltas, self.anchors[anchor], self.weights, self.clip)
        boxes = torch.min(boxes.clamp(min=0), self.limits)  # clip to the input: x to width, y to height
        # Per-class NMS as one NMS: shift each class's boxes to its own region (torchvision's trick).
        shifted = boxes + (labels * (max(height, width) + 1)).to(boxes.dtype)[..., None]
        fast, settled = self.prefix_nms(shifted, scores, score_threshold, iou_threshold, max_detections)
        selected = OnnxNms.apply(shifted, scores[:, None, :], max_detections, iou_threshold, score_threshold)
        exact = self.rows(boxes, scores, labels, selected[:, 0], selected[:, 2])
        return (*(self.rows(boxes, scores, labels, *fast)), settled, *exact)

    @staticmethod
    def rows(boxes, scores, labels, image, row):
        """The contract's outputs for candidates (image, row): boxes [N, 4], scores, labels, batch_index."""
        flat = image * boxes.shape[1] + row
        return boxes.reshape(-1, 4)[flat], scores.reshape(-1)[flat], labels.reshape(-1)[flat], image

    def prefix_nms(self, shifted, scores, score_threshold, iou_threshold, max_detections):
        """Greedy NMS, batched over the images, on each image's best `prefix` candidates: the IoU
        matrix [B, P, P] and `steps` rounds of keep[j] = no kept i < j overlaps j (a fixed point of
        these rounds is greedy NMS's answer, whatever the chain of suppressions). An image is
        settled when the rounds reached that fixed point and the prefix holds its answer: at least
        max_detections kept, or every candidate above the threshold inside the prefix. Returns the
        kept (image, row) in image-then-score order, at most max_detections per image, and whether
        every image settled (else the graph takes NonMaxSuppression's path: `join_paths`)."""
        count = min(self.prefix, scores.shape[1])
        passed = scores > score_threshold
        top, order = torch.where(passed, scores, torch.full_like(scores, -1.0)).topk(count, dim=1)
        valid = top >= 0  # scores are sigmoids; -1 marks a candidate below the threshold
        b = shifted.gather(1, order[..., None].expand(-1, -1, 4))  # [B, P, 4], best first
        x1, y1, x2, y2 = (b[..., i] for i in range(4))  # [B, P] each
        area = (x2 - x1) * (y2 - y1)
        # The IoU matrix [B, P, P], x and y apart: no [B, P, P, 2] tensor, no reduction over its
        # last axis of 2 (ORT's reductions are slow on a short innermost axis).
        w = (torch.min(x2[:, :, None], x2[:, None]) - torch.max(x1[:, :, None], x1[:, None])).clamp(min=0)
        h = (torch.min(y2[:, :, None], y2[:, None]) - torch.max(y1[:, :, None], y1[:, None])).clamp(min=0)
        inter = w * h
        iou = inter / (area[:, :, None] + area[:, None] - inter)
        earlier = torch.ones(count, count, dtype=torch.bool, device=scores.device).triu(1)  # i < j
        suppresses = ((iou > iou_threshold) & (earlier & valid[:, :, None])).half()  # [B, i, j]
        # keep[j] = valid[j] and no kept i < j suppresses j, as relu(valid - keep @ suppresses) on
        # 0/1 halves: the product counts the kept suppressors (at most P = 1,024, an integer fp16
        # holds exactly), and a round reads half the bytes float32 would. Three ops a round.
        keep = previous = valid_f = valid.half()[:, None, :]  # [B, 1, P]
        for _ in range(self.steps):
            previous = keep
            keep = torch.relu(valid_f - torch.bmm(keep, suppresses))
        keep, previous = keep[:, 0] > 0, previous[:, 0] > 0
        kept = keep.long()
        settled = ((keep == previous).all(dim=1) &
                   ((kept.sum(1) >= max_detections) | (passed.long().sum(1) <= count))).all()
        image, slot = torch.nonzero(keep & (kept.cumsum(1) <= max_detections), as_tuple=True)
        return (image, order.reshape(-1)[image * count + slot]), settled


OUTPUTS = ["boxes", "scores", "labels", "batch_index"]
SHAPES = {"boxes": ["N", 4], "scores": ["N"], "labels": ["N"], "batch_index": ["N"]}


def join_paths(proto, cond: str = "settled") -> None:
    """Turn EndToEnd's exported graph (the outputs twice: fast_* from the prefix NMS, nms_* from
    NonMaxSuppression; and `settled`) into the contract's: one If on `settled` whose then-branch
    passes the fast outputs and whose else-branch holds the nodes only NonMaxSuppression's path
    needs, so ORT runs that path only for a batch the prefix did not settle. One host decision per
    batch (the condition is read on the host), not one per image or class."""
    import onnx
    from onnx import helper

    graph = proto.graph
    producer = {name: node for node in graph.node for name in node.output}

    def upstream(names) -> set[int]:
        seen, stack = set(), list(names)
        while stack:
            node = producer.get(stack.pop())
            if node is not None and id(node) not in seen:
                seen.add(id(node))
                stack.extend(node.input)
        return seen

    fast, slow = [f"fast_{n}" for n in OUTPUTS], [f"nms_{n}" for n in OUTPUTS]
    only_slow = upstream(slow) - upstream([cond, *fast])
    types = {o.name: o.type.tensor_type.elem_type for o in graph.output}

    def branch(name: str, nodes, sources) -> onnx.GraphProto:
        pairs = list(zip(sources, OUTPUTS))
        moves = [helper.make_node("Identity", [src], [f"{name}_{out}"]) for src, out in pairs]
        results = [helper.make_tensor_value_info(f"{name}_{out}", types[src], SHAPES[out]) for src, out in pairs]
        return helper.make_graph(nodes + moves, name, [], results)

    then_branch = branch("prefix_path", [], fast)
    else_branch = branch("nms_path", [n for n in graph.node if id(n) in only_slow], slow)
    kept = [n for n in graph.node if id(n) not in only_slow]
    del graph.node[:]
    graph.node.extend(kept + [helper.make_node("If", [cond], OUTPUTS, then_branch=then_branch,
                                               else_branch=else_branch)])
    outputs = [helper.make_tensor_value_info(out, types[src], SHAPES[out]) for src, out in zip(fast, OUTPUTS)]
    del graph.output[:]
    graph.output.extend(outputs)


def torchvision_detections(model: nn.Module, images: torch.Tensor, *, score_threshold: float, iou_threshold: float,
                           max_detections: int) -> list[dict[str, torch.Tensor]]:
    """torchvision's eager detections on already-normalized images [B, 3, H, W] (its transform,
    which resizes and normalizes, is skipped so both sides see the same tensors)."""
    with torch.no_grad():
        features = list(model.backbone(images).values())
        head = model.head(features)
    return torchvision_postprocess(model, images, head, features=features, score_threshold=score_threshold,
                                   iou_threshold=iou_threshold, max_detections=max_detections)


def torchvision_postprocess(model: nn.Module, images: torch.Tensor, head: dict[str, torch.Tensor], *,
                            score_threshold: float, iou_threshold: float, max_detections: int,
                            features: list[torch.Tensor] | None = None):
    """torchvision's postprocess of the head's outputs (cls_logits [B, A, K], bbox_regression).
    features: the backbone's for these images (their shapes place the anchors), else computed."""
    model.score_thresh, model.nms_thresh, model.detections_per_img = score_threshold, iou_threshold, max_detections
    with torch.no_grad():
        if features is None:
            features = list(model.backbone(images[:1]).values())
        image_list = ImageList(images, [tuple(images.shape[-2:])] * len(images))
        anchors = model.anchor_generator(image_list, features)
        per_level = [f.shape[-2] * f.shape[-1] * model.anchor_generator.num_anchors_per_location()[0]
                     for f in features]
        split = {k: list(v.split(per_level, dim=1)) for k, v in head.items()}
        return model.postprocess_detections(split, [list(a.split(per_level)) for a in anchors],
                                            image_list.image_sizes)


def export(model: nn.Module, contract: str, out: Path, *, size_hw: tuple[int, int], batch_size: int,
           dynamic_batch: bool, fp16: bool, opset: int = 17, device: str | None = None,
           nms_prefix: int = 1024) -> None:
    """Write `model` (left unchanged) as an ONNX file of `contract`. The trace runs on `device`
    (default: the GPU when there is one; a batch of 16 at 800x800 is slow on a CPU).
    nms_prefix: candidates per image the end-to-end graph's batched NMS looks at before it falls
    back (EndToEnd.prefix_nms)."""
    import onnx

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if fp16 else torch.float32
    model = copy.deepcopy(model).float().eval()
    layout = anchor_layout(model, size_hw)
    images = torch.zeros(batch_size, 3, *size_hw, dtype=dtype, device=device)
    dynamic = {"images": {0: "batch"}} if dynamic_batch else None
    if contract == "retinanet_heads":
        module = Heads(model).eval()
        args, inputs, outputs = (images,), ["images"], ["cls_logits", "bbox_regression"]
        if dynamic:
            dynamic.update({"cls_logits": {0: "batch"}, "bbox_regression": {0: "batch"}})
    else:
        module = EndToEnd(model, size_hw, prefix=nms_prefix).eval()
        args = (images, *(torch.tensor([v], device=device) for v in (0.05, 0.5, 300)))
        inputs = ["images", "score_threshold", "iou_threshold", "max_detections"]
        outputs = [f"fast_{n}" for n in OUTPUTS] + ["settled"] + [f"nms_{n}" for n in OUTPUTS]
    module = module.to(device=device, dtype=dtype)
    if contract == "end_to_end":
        module.anchors = module.anchors.float()  # decode and NMS stay in float32
        module.limits = module.limits.float()
    out.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        torch.onnx.export(module, args, str(out), input_names=inputs, output_names=outputs, opset_version=opset,
                          dynamic_axes=dynamic, dynamo=False, do_constant_folding=True)
    proto = onnx.load(str(out))
    if contract == "end_to_end":
        join_paths(proto)
    entry = proto.metadata_props.add()
    entry.key, entry.value = RETINANET_METADATA, json.dumps({**layout, "contract": contract})
    proto.producer_name = f"gpudet scripts/export_retinanet.py (torchvision {torchvision.__version__})"
    onnx.checker.check_model(proto)
    onnx.save(proto, str(out))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contract", choices=["end_to_end", "retinanet_heads"], required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default="retinanet_resnet50_fpn")
    parser.add_argument("--checkpoint", type=Path, help="torchvision state_dict (.pth); default: random weights")
    parser.add_argument("--num-classes", type=int, default=91, help="91: torchvision's COCO label ids")
    parser.add_argument("--size", type=int, nargs=2, default=[800, 800], metavar=("H", "W"))
    parser.add_argument("--batch-size", type=int, default=16, help="static batch size of the model")
    parser.add_argument("--dynamic-batch", action="store_true", help="batch dimension symbolic instead")
    parser.add_argument("--fp16", action="store_true", help="backbone and heads in float16 (input too)")
    parser.add_argument("--seed", type=int, default=0, help="random initialisation seed (no --checkpoint)")
    parser.add_argument("--detections-per-image", type=float, default=0, metavar="N",
                        help="random weights only: shift the class bias so that about N detections per image "
                             "survive 0.05 and NMS on --calibration images (a benchmark's load; default: none)")
    parser.add_argument("--calibration", nargs="+", default=[str(SAMPLES / n) for n in
                                                           ("astronaut.png", "grace_hopper.jpg", "china.jpg",
                                                            "coffee.png", "chelsea.png", "camera.png")],
                        help="images the load is calibrated on (default: the bundled photos)")
    parser.add_argument("--nms-prefix", type=int, default=1024,
                        help="end_to_end: candidates per image the batched NMS looks at before NonMaxSuppression")
    a = parser.parse_args(argv)
    if a.checkpoint is not None and not a.checkpoint.is_file():
        sys.exit(f"--checkpoint {a.checkpoint}: no such file")
    model = build_model(a.arch, a.checkpoint, a.num_classes, a.seed)
    if a.detections_per_image:
        if a.checkpoint is not None:
            sys.exit("--detections-per-image seeds random weights; a checkpoint brings its own detections")
        shift = detection_load_shift(model, a.detections_per_image, a.calibration, tuple(a.size))
        shift_class_bias(model, shift)
        print(f"class bias shifted by {shift:.4f}: about {a.detections_per_image:g} detections per image")
    export(model, a.contract, a.out, size_hw=tuple(a.size), batch_size=a.batch_size, dynamic_batch=a.dynamic_batch,
           fp16=a.fp16, nms_prefix=a.nms_prefix)
    print(f"wrote {a.out} ({a.out.stat().st_size / 1e6:.1f} MB): {a.arch}, {a.contract}, "
          f"{'float16' if a.fp16 else 'float32'}, batch {'dynamic' if a.dynamic_batch else a.batch_size}, "
          f"{a.size[0]}x{a.size[1]}, {'weights ' + str(a.checkpoint) if a.checkpoint else 'random weights'}")


if __name__ == "__main__":
    main()
