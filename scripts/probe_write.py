"""Time the sinks' work per batch on the main loop: detection_records + the JSONL lines, as
gpudet writes them (orjson) and with the json module (without orjson, and before it was used).

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
from pipeline import sinks
from pipeline.sinks import detection_records, jsonl
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
        return jsonl(records())

    def json_module_lines():
        return "".join(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n" for r in records()).encode()

    assert [json.loads(x) for x in lines().splitlines()] == [json.loads(x) for x in json_module_lines().splitlines()]
    for name, fn in (("detection_records", records),
                     (f"records + JSONL lines ({'orjson' if sinks.orjson else 'json module: orjson missing'})", lines),
                     ("records + JSONL lines (json module)", json_module_lines)):
        for _ in range(10):
            fn()
        start = time.perf_counter()
        for _ in range(a.iters):
            fn()
        print(f"{name}: {(time.perf_counter() - start) / a.iters * 1e3:.3f} ms per batch of {a.batch_size} "
              f"({m} detections)")


if __name__ == "__main__":
    main()
