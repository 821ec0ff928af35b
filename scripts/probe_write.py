"""Time the sinks' work per batch on the main loop: detection_records + the JSONL lines.

Synthetic detections (RetinaFace-like: 0-5 faces with 5 landmarks per image, batch 32), so it
runs anywhere; the H200 pipeline spent ~1.2 ms per batch there (docs/BENCHMARKS.md).
    python scripts/probe_write.py [--batch-size 32] [--iters 300]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from pipeline.postprocess import Detections
from pipeline.preprocess import PreprocessedBatch
from pipeline.sinks import detection_records
from pipeline.source import ImageRef


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--iters", type=int, default=300)
    a = parser.parse_args()
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 6, a.batch_size)
    m = int(counts.sum())
    found = Detections(batch_index=np.repeat(np.arange(a.batch_size), counts),
                       boxes_xyxy=rng.random((m, 4), np.float32) * 500, scores=rng.random(m, np.float32),
                       labels=np.zeros(m, np.int64), landmarks=rng.random((m, 5, 2), np.float32) * 500)
    batch = PreprocessedBatch(images=None, refs=[ImageRef(i, f"/data/images/img_{i:07d}.jpg")
                                                 for i in range(a.batch_size)],
                              orig_hw=np.full((a.batch_size, 2), 600), scale_yx=np.ones((a.batch_size, 2), np.float32),
                              pad_yx=np.zeros((a.batch_size, 2), np.float32))

    def records():
        return detection_records(batch, found, ["face"])

    def lines():
        return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records())

    for name, fn in (("detection_records", records), ("records + JSONL lines", lines)):
        for _ in range(10):
            fn()
        start = time.perf_counter()
        for _ in range(a.iters):
            fn()
        print(f"{name}: {(time.perf_counter() - start) / a.iters * 1e3:.3f} ms per batch of {a.batch_size} "
              f"({m} detections)")


if __name__ == "__main__":
    main()
