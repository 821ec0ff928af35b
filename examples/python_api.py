"""The Python API in a few lines: per-image results on the host, or detections kept on the device.

Run: python examples/python_api.py [SOURCE] [--device cpu|cuda]
"""

import argparse

from pipeline import Detector, ImageError


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("source", nargs="?", default="samples")
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()

    detector = Detector.from_config(device=args.device, batch_size=8)

    # 1. Per-image results on the host: numpy arrays in original pixels.
    for result in detector.run(args.source):
        if isinstance(result, ImageError):
            print(f"skipped {result.path}: {result.reason}")
            continue
        for box, score, name in zip(result.boxes_xyxy, result.scores, result.names):
            print(f"{result.path}: {name} {score:.3f} at {box.round(1).tolist()}")

    # 2. Detections as torch tensors on the device, for work that continues on the GPU: no host copy.
    from pipeline.source import list_images

    refs = list_images(args.source)
    for batch, found in detector.stream(refs, on_error=lambda errors: None, on_device=True):
        areas = (found.boxes_xyxy[:, 2:] - found.boxes_xyxy[:, :2]).prod(dim=1)  # computed where the boxes are
        print(f"batch of {len(batch.refs)}: {len(found.scores)} faces on {found.scores.device}, "
              f"areas {areas.round().tolist()}")


if __name__ == "__main__":
    main()
