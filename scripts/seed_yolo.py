"""A detection load for a YOLO export with random weights: its class and box branches made to
answer the image, as trained weights do.

A YOLO that Ultralytics builds from its model YAML (no download) scores every position of a level
alike (its class logits are the bias alone) and draws every box the same size: greedy NMS over
such ties is no workload a user's model gives. This script scales the last 1x1 convolution of each
level's class and box branches (`model.23.cv3.*.2`, `model.23.cv2.*.2`, Ultralytics' names), so
that scores and boxes vary with the image, and sets the class biases so that about `--candidates`
positions per image score over `--score` on the images given (the yolo_coco preset's letterbox).
The bench then measures gpudet's postprocess on a load like a trained model's at its threshold.

    python scripts/seed_yolo.py yolo11n.onnx seeded.onnx samples/*.png samples/*.jpg
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper
from PIL import Image


def letterboxed(path: Path, size: int) -> np.ndarray:
    """The image as the yolo_coco preset feeds it: RGB over 255, longer side to `size`, padded
    right and bottom with grey 114."""
    image = Image.open(path).convert("RGB")
    scale = size / max(image.size)
    image = image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))), Image.BILINEAR)
    canvas = np.full((size, size, 3), 114, np.uint8)
    canvas[:image.height, :image.width] = np.asarray(image)
    return canvas.transpose(2, 0, 1).astype(np.float32) / 255


def head_layers(model: onnx.ModelProto, branch: str) -> list[onnx.TensorProto]:
    return [t for t in model.graph.initializer if t.name.startswith(f"model.23.{branch}.") and
            t.name.endswith(".2.weight")]


def run(model: onnx.ModelProto, images: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    batch = session.get_inputs()[0].shape[0]
    batch = batch if isinstance(batch, int) else len(images)
    rows = np.resize(images, (batch, *images.shape[1:]))  # a fixed batch: the images repeated
    return session.run(None, {session.get_inputs()[0].name: rows})[0][:len(images)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="an Ultralytics ONNX export of a detect model (output0 [B, 4+K, N])")
    parser.add_argument("out", type=Path)
    parser.add_argument("images", type=Path, nargs="+", help="images to set the load on")
    parser.add_argument("--candidates", type=float, default=100, help="positions per image over --score (default 100)")
    parser.add_argument("--score", type=float, default=0.25, help="the threshold they are counted at (default 0.25)")
    parser.add_argument("--gain", type=float, default=100.0, help="how much the last convolutions are scaled")
    parser.add_argument("--size", type=int, default=640)
    args = parser.parse_args()

    model = onnx.load(args.model)
    for tensor in head_layers(model, "cv3") + head_layers(model, "cv2"):
        tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor) * args.gain, tensor.name))
    images = np.stack([letterboxed(p, args.size) for p in args.images])
    biases = [t for t in model.graph.initializer if t.name.startswith("model.23.cv3.") and t.name.endswith(".2.bias")]
    for tensor in biases:
        tensor.CopyFrom(numpy_helper.from_array(np.zeros_like(numpy_helper.to_array(tensor)), tensor.name))
    scores = run(model, images)[:, 4:, :]  # sigmoid(logit): the bias 0 now
    logits = np.log(scores / (1 - scores + 1e-12) + 1e-30).max(axis=1)  # [images, N]: each position's best class
    positions = logits.shape[1]
    wanted = np.quantile(logits, 1 - args.candidates / positions)  # over all the images
    bias = math.log(args.score / (1 - args.score)) - wanted
    for tensor in biases:
        tensor.CopyFrom(numpy_helper.from_array(np.full(numpy_helper.to_array(tensor).shape, bias, np.float32),
                                                tensor.name))
    found = (run(model, images)[:, 4:, :].max(axis=1) > args.score).sum(axis=1)
    onnx.save(model, args.out)
    print(f"{args.out}: class bias {bias:.2f}; positions over {args.score} per image: {found.tolist()} "
          f"(mean {found.mean():.0f} of {positions})")


if __name__ == "__main__":
    main()
