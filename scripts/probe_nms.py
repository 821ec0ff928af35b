"""Time ONNX Runtime's NonMaxSuppression alone, called as the end-to-end RetinaNet graph calls it.

    python scripts/probe_nms.py [--device cuda] [--boxes 5000] [--batches 1 16] [--iters 30]

The end-to-end contract (scripts/export_retinanet.py) ends in one NonMaxSuppression over
boxes [B, N, 4] (each class shifted to a region of its own) and scores [B, 1, N], at most 300
kept per image. This probe runs that node alone on random boxes (centres uniform over 800 x 800,
sides 16-300 px, 91 classes) with device-bound inputs, at a score threshold no box passes and at
one every box passes, for each batch size: the first shows the op's fixed cost per image, the
second adds the IoU work. Medians of --iters runs, ms per call.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from scripts.probe_e2e_ops import model, time_bound, value  # noqa: E402

SIZE, CLASSES = 800, 91


def nms_model() -> bytes:
    """One NonMaxSuppression node; batch and box count symbolic."""
    node = helper.make_node("NonMaxSuppression", ["boxes", "scores", "max_out", "iou", "score"], ["selected"])
    inputs = [value("boxes", TensorProto.FLOAT, ["B", "N", 4]), value("scores", TensorProto.FLOAT, ["B", 1, "N"]),
              value("max_out", TensorProto.INT64, [1]), value("iou", TensorProto.FLOAT, [1]),
              value("score", TensorProto.FLOAT, [1])]
    return model([node], inputs, [value("selected", TensorProto.INT64, ["M", 3])])


def random_boxes(batch: int, count: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Boxes [B, N, 4] shifted per class as the exporter does, scores [B, 1, N] in [0, 1)."""
    centre = rng.uniform(0, SIZE, (batch, count, 2))
    half = rng.uniform(8, 150, (batch, count, 2))
    boxes = np.clip(np.concatenate([centre - half, centre + half], -1), 0, SIZE)
    boxes += (rng.integers(0, CLASSES, (batch, count, 1)) * (SIZE + 1))
    return boxes.astype(np.float32), rng.uniform(0, 1, (batch, 1, count)).astype(np.float32)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--boxes", type=int, default=5000, help="candidates per image (5 levels x top-k 1000)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--json", type=Path)
    a = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = []
    for batch in a.batches:
        boxes, scores = random_boxes(batch, a.boxes, rng)
        for label, threshold in (("no box passes", 1.0), ("every box passes", 0.0)):
            seconds, binding = time_bound(  # boxes and scores on the device, as in the graph
                nms_model(), {"boxes": boxes, "scores": scores}, a.device, a.iters,
                host_inputs={"max_out": np.array([300], np.int64), "iou": np.array([0.5], np.float32),
                             "score": np.array([threshold], np.float32)})
            kept = binding.get_outputs()[0].shape()[0]
            rows.append({"batch": batch, "boxes": a.boxes, "case": label, "ms": round(seconds * 1e3, 3),
                         "ms_per_image": round(seconds * 1e3 / batch, 3), "kept": kept})
            print(f"B={batch:<3} N={a.boxes} {label:<17} {seconds * 1e3:8.3f} ms  "
                  f"({seconds * 1e3 / batch:.3f} ms per image, {kept} kept)")
    if a.json:
        a.json.write_text(json.dumps({"device": a.device, "ort": ort.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
