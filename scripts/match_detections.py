"""Do two runs over the same images find the same objects? Each detection scoring at least
--min-score in one run is matched, greedily by IoU, to a detection of the same image and label in
the other; a pair counts at --iou or more. Prints (and with --json writes) the counts each way and
the worst IoU of a matched pair: what docs/BENCHMARKS.md reports for a change to decoding.

Usage:  python scripts/match_detections.py RUN_A RUN_B [--min-score 0.9] [--iou 0.85] [--json OUT]
        (RUN_*: an output folder of gpudet detect, or its detections file)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pipeline.coco import read_detections  # noqa: E402


def iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[N, 4] x [M, 4] x1y1x2y2 -> [N, M]."""
    lt, rb = np.maximum(a[:, None, :2], b[None, :, :2]), np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(rb - lt, 0, None), axis=2)
    area = lambda x: np.prod(x[:, 2:] - x[:, :2], axis=1)  # noqa: E731
    return inter / np.maximum(area(a)[:, None] + area(b)[None] - inter, 1e-9)


def matched(found: dict[str, list[dict]], other: dict[str, list[dict]], min_score: float, threshold: float):
    """(detections of `found` at min_score or more, how many have a partner in `other` at
    `threshold`, the IoU of each one's best partner)."""
    total, hits, best = 0, 0, []
    for path, detections in found.items():
        for label in {d["label"] for d in detections}:
            mine = np.array([d["box"] for d in detections if d["label"] == label and d["score"] >= min_score])
            theirs = np.array([d["box"] for d in other.get(path, []) if d["label"] == label]).reshape(-1, 4)
            if not len(mine):
                continue
            total += len(mine)
            overlap = iou(mine, theirs) if len(theirs) else np.zeros((len(mine), 1))
            best += overlap.max(axis=1).tolist()
            hits += int((overlap.max(axis=1) >= threshold).sum())
    return total, hits, best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--min-score", type=float, default=0.9)
    parser.add_argument("--iou", type=float, default=0.85)
    parser.add_argument("--json")
    args = parser.parse_args()
    runs = [{r["path"]: r["detections"] for r in read_detections(path)} for path in (args.a, args.b)]
    report = {"a": args.a, "b": args.b, "min_score": args.min_score, "iou": args.iou,
              "images": [len(runs[0]), len(runs[1])]}
    for name, (one, other) in {"a_in_b": runs, "b_in_a": runs[::-1]}.items():
        total, hits, best = matched(one, other, args.min_score, args.iou)
        report[name] = {"detections": total, "matched": hits, "worst_iou": round(min(best), 4) if best else None,
                        "median_iou": round(float(np.median(best)), 4) if best else None}
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
