"""The Python API in a few lines: per-image results on the host, images in memory, a threshold for
one call, results as JSON and drawn, and detections kept on the device.

Run: python examples/python_api.py [SOURCE] [--device cpu|cuda]
"""

import argparse

import numpy as np
from PIL import Image, ImageOps

import gpudet


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("source", nargs="?", default="samples")
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()

    detector = gpudet.Detector.from_config(device=args.device, batch_size=8)

    # 1. Per-image results on the host: numpy arrays in original pixels.
    faces, first = 0, None
    for result in detector.run(args.source):
        if isinstance(result, gpudet.ImageError):  # a file that is no image, cut short, missing, ...
            print(f"skipped {result.path}: {result.reason}")
            continue
        faces += len(result.scores)
        first = first or result.path
        for box, score, name in zip(result.boxes_xyxy, result.scores, result.names):
            print(f"{result.path}: {name} {score:.3f} at {[round(float(v), 1) for v in box]}")

    # 2. An image already in memory (the source's first, upright as its EXIF says), with this
    #    call's own threshold; its record as JSON; drawn.
    if first is not None:
        photo = np.asarray(ImageOps.exif_transpose(Image.open(first)).convert("RGB"))
        (result,) = detector.run(photo, score_threshold=0.5)
        print(result.to_json()[:120], "...")
        print(f"first box as YOLO's centre-size over the image: {[round(float(v), 4) for v in result.xywhn[0]] if len(result.scores) else []}")
        print(f"drawn: {result.draw(photo).size}")

    # 3. Detections as torch tensors on the device, for work that continues there: no host copy.
    for result in detector.run(args.source, on_device=True):
        if isinstance(result, gpudet.ImageError):
            continue
        areas = (result.boxes_xyxy[:, 2:] - result.boxes_xyxy[:, :2]).prod(dim=1)  # where the boxes are
        if len(areas):
            print(f"{result.path}: areas {areas.round().tolist()} on {areas.device}")
    print(f"{faces} faces on {detector.device}")


if __name__ == "__main__":
    main()
