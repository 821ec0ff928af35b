"""ssd_heads: raw SSD-style heads against anchors (RetinaFace), decoded and NMS'd on the device."""

from __future__ import annotations

import torch

from ..kernels import compile_ahead
from ..nms import NMS_STEPS, batched_nms, top_nms
from ..postprocess import BlockReader, Compiled, GraphCache, PackedDetections, Thresholds, box_columns, kept_slots, \
    maybe_compiled, pack_rows, real_images, rows_to_original
from . import Contract, landmark_points


class SsdHeads(Contract):
    """Postprocess for raw SSD-style heads (RetinaFace): decode, top-k, NMS, all batched on the device.

        loc        [B, A, 4]   SSD box coding against anchors (cx, cy, w, h in input pixels)
        conf       [B, A, 2]   softmax scores; class 1 is the object
        landmarks  [B, A, 2K]  optional, coded like the box centers

    The anchors are made once on the device. Only the top `pre_nms_top_k` candidates per image
    are decoded. NMS (nms.top_nms: exact greedy, no host sync) looks at each image's best
    `nms_prefix` candidates, NMS_STEPS fixed-point steps: that settles an image with no more
    candidates above the threshold, whose suppression chains are that short (nearly every photo:
    a face gives a handful of candidates). An image it does not settle is done again exactly, on
    all its candidates, to the fixed point.
    """

    name = "ssd_heads"
    outputs = {"loc": 3, "conf": 3}
    optional = {"landmarks": 3}
    order = 20
    captured = True

    def __init__(self, *, strides: list[int], sizes: list[list[float]], variances: list[float],
                 pre_nms_top_k: int, input_hw: tuple[int, int], num_landmarks: int, device: torch.device,
                 nms_prefix: int = 256, compile: bool = False):
        self.strides, self.sizes, self.variances = strides, sizes, variances
        self.pre_nms_top_k = pre_nms_top_k
        self.nms_prefix = min(nms_prefix, pre_nms_top_k)
        self.input_hw = tuple(input_hw)
        self.num_landmarks = num_landmarks
        self.device = device
        self._anchors: dict[tuple[int, int], torch.Tensor] = {}
        self.graphs = GraphCache(device)
        self.reader = BlockReader()
        self._packed = maybe_compiled(self.packed, device, compile)

    @classmethod
    def from_config(cls, model, config, *, device, input_hw) -> SsdHeads:
        m = config.model
        return cls(strides=m.anchor_strides, sizes=m.anchor_sizes, variances=m.box_variances,
                   pre_nms_top_k=config.postprocess.pre_nms_top_k, input_hw=input_hw,
                   num_landmarks=landmark_points(model.outputs, m.landmarks, model.path), device=device,
                   compile=config.postprocess.compile)

    def compile_ahead(self, outputs: dict[str, tuple[torch.dtype, tuple]]) -> None:
        """Start compiling the Triton kernel NMS launches on a GPU (kernels.compile_ahead).
        outputs: the model's outputs by name, (dtype, shape). Not under postprocess.compile,
        whose inductor writes kernels of its own."""
        if not isinstance(self._packed, Compiled):
            compile_ahead(self.device)

    def anchors(self, height: int, width: int) -> torch.Tensor:
        """[A, 4] (cx, cy, w, h) in input pixels, in the heads' order: per stride, row, column, size."""
        key = (height, width)
        if key not in self._anchors:
            parts = []
            for stride, sizes in zip(self.strides, self.sizes):
                rows, cols = -(-height // stride), -(-width // stride)
                cy, cx = torch.meshgrid((torch.arange(rows, device=self.device) + 0.5) * stride,
                                        (torch.arange(cols, device=self.device) + 0.5) * stride, indexing="ij")
                size = torch.tensor(sizes, dtype=torch.float32, device=self.device)
                n = len(sizes)
                parts.append(torch.stack([cx[..., None].expand(-1, -1, n), cy[..., None].expand(-1, -1, n),
                                          size.expand(rows, cols, n), size.expand(rows, cols, n)], -1).reshape(-1, 4))
            self._anchors[key] = torch.cat(parts).float()
        return self._anchors[key]

    def kept(self, loc: torch.Tensor, conf: torch.Tensor, num_images: torch.Tensor, *, input_hw: tuple[int, int],
             score_threshold: float, iou_threshold: float, max_detections: int, prefix: int, max_iterations: int,
             sync_every: int = 0):
        """The static-shape part: top-k, decode, NMS on the best `prefix` candidates (all of them:
        the exact path, checked for convergence every `sync_every` steps). num_images: [] int64
        tensor. Returns scores [B, k], index [B, k] (anchors), boxes [B, k, 4] x1y1x2y2 input
        pixels, keep [B, k] (capped at max_detections per image) and settled [B], on the device."""
        anchors = self.anchors(*input_hw)
        scores_all = conf[..., 1].float()  # [B, A]
        scores, index = scores_all.topk(min(self.pre_nms_top_k, scores_all.shape[1]), dim=1)  # best first
        valid = scores > score_threshold  # the reference keeps score > threshold
        valid &= real_images(len(valid), num_images, valid.device)
        prior = anchors[index]  # [B, k, 4]
        center_var, size_var = self.variances
        coded = loc.float().gather(1, index[..., None].expand(-1, -1, 4))
        centers = prior[..., :2] + coded[..., :2] * center_var * prior[..., 2:]
        wh = prior[..., 2:] * torch.exp(coded[..., 2:] * size_var)
        boxes = torch.cat([centers - wh / 2, centers + wh / 2], dim=-1)
        classes = torch.zeros_like(index)
        if prefix < len(index[0]):
            keep, settled = top_nms(boxes, scores, classes, valid, iou_threshold=iou_threshold,
                                    max_kept=max_detections, prefix=prefix, max_iterations=max_iterations)
            return scores, index, boxes, keep, settled
        keep, settled = batched_nms(boxes, scores, classes, valid, iou_threshold=iou_threshold,
                                    max_iterations=max_iterations, sync_every=sync_every)
        keep &= torch.cumsum(keep, dim=1) <= max_detections  # best first, so this caps per image
        return scores, index, boxes, keep, settled

    def packed(self, *tensors: torch.Tensor, num_landmarks: int, **options) -> torch.Tensor:
        """kept, then the final rows packed for the host (pack_rows; flag: NMS settled).
        tensors: loc, conf, [landmarks if num_landmarks,] num_images [] int64, meta [B, 6]."""
        loc, conf, *landmarks, num_images, meta = tensors
        scores, index, boxes, keep, converged = self.kept(loc, conf, num_images, **options)
        slot, count, present = kept_slots(keep, options["max_detections"])
        anchor = index.gather(1, slot)  # [B, D]
        columns = box_columns(torch.zeros_like(anchor), scores.gather(1, slot),
                              boxes.gather(1, slot[..., None].expand(-1, -1, 4)), meta)
        if num_landmarks:
            prior = self.anchors(*options["input_hw"])[anchor]  # [B, D, 4]
            coded = landmarks[0].float().gather(1, anchor[..., None].expand(-1, -1, 2 * num_landmarks))
            points = prior[..., None, :2] + coded.reshape(*anchor.shape, num_landmarks, 2) * self.variances[0] * \
                prior[..., None, 2:]
            columns.append(rows_to_original(points, meta))
        return pack_rows(torch.cat(columns, dim=-1), count, present, converged)

    def __call__(self, outputs: dict[str, torch.Tensor], meta: torch.Tensor, *, num_images: int,
                 thresholds: Thresholds) -> PackedDetections:
        options = dict(input_hw=self.input_hw, score_threshold=thresholds.score_threshold,
                       iou_threshold=thresholds.iou_threshold, max_detections=thresholds.max_detections,
                       num_landmarks=self.num_landmarks)
        buffers = (outputs["loc"], outputs["conf"]) + ((outputs["landmarks"],) if self.num_landmarks else ())
        block = self.graphs(self._packed, buffers, (torch.tensor(num_images), meta), prefix=self.nms_prefix,
                            max_iterations=NMS_STEPS, **options)

        def settle(images: list[int]) -> torch.Tensor:
            """The block with `images` done exactly: up to pre_nms_top_k steps, checked every 8."""
            rows = torch.tensor(images, device=block.device)
            again = self.packed(*(t[rows] for t in buffers), torch.tensor(len(images), device=block.device),
                                meta[images].to(block.device), prefix=self.pre_nms_top_k,
                                max_iterations=self.pre_nms_top_k, sync_every=8, **options)
            settled = block.clone()
            settled[:, rows] = again
            return settled

        return PackedDetections(block=block, num_landmarks=self.num_landmarks, num_images=num_images,
                                reader=self.reader, settle=settle)
