"""Where RetinaFace's 5,000 img/s on one GPU could come from (issue 4): the engine under each ORT
setting, and DALI's throughput with the pipeline's two batches in flight, per thread count.

    engine   ORT model-only on one batch (IOBinding, input and outputs on the device), per model,
             batch size and setting: as gpudet runs it (symbolic batch), the batch fixed at load
             (free-dimension override: shape arithmetic folds away), + prefer_nhwc, + ORT's own
             CUDA graph (the input at one address every run, as a probe can bind it)
    dali     the config's preprocessing over the image list, two batches in flight as
             Detector.stream keeps them, bytes already in memory: the rate the GPU and DALI's
             threads sustain, per run.num_threads

Each timing is a median over --iters runs after warm-up; every run ends in a host sync.
    python scripts/probe_retinaface.py IMAGE_LIST --models A.onnx B.onnx [--batch-sizes 32 64]
        [--threads 4 8 12] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from pipeline.bench import dali_images_per_s, machine
from pipeline.config import load_config
from pipeline.detector import preprocessor_args
from pipeline.device import resolve_device
from pipeline.engine import Engine, ImageInput
from pipeline.preprocess import Preprocessor
from pipeline.source import EncodedImage, list_images, read_checked
from probe_stages import timed

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "retinaface_mnet025_heads.yaml"
SETTINGS = {  # name: (fix the batch at load, CUDA EP options)
    "as gpudet runs it": (False, {}),
    "batch fixed": (True, {}),
    "batch fixed, prefer_nhwc": (True, {"prefer_nhwc": "1"}),
    "batch fixed, cuda graph": (True, {"enable_cuda_graph": "1"}),
    "batch fixed, prefer_nhwc, cuda graph": (True, {"prefer_nhwc": "1", "enable_cuda_graph": "1"}),
}


def engine_rates(models: list[str], batch_sizes: list[int], iters: int, log) -> dict:
    device = resolve_device("cuda")
    results = {}
    for model in models:
        for batch in batch_sizes:
            for name, (fixed, options) in SETTINGS.items():
                label = f"{Path(model).name} b{batch}: {name}"
                try:
                    engine = Engine(model, device=device, scalars={}, input_size_hw=(640, 640),
                                    batch_size=batch if fixed else None, cuda_options=options)
                    dtype = torch.float16 if engine.image_input.dtype == "float16" else torch.float32
                    x = torch.randn(batch, 3, 640, 640, device="cuda").mul_(50).to(dtype)
                    seconds = timed(lambda: engine.run(x), iters, warmup=5)  # ORT syncs each run
                    results[label] = {"ms_per_batch": round(1e3 * seconds, 3), "images_per_s": round(batch / seconds)}
                except Exception as e:  # a setting ORT refuses is reported, not fatal
                    results[label] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                log(f"{label}: {results[label]}")
    return results


def dali_rates(list_file: str, batch_sizes: list[int], threads: list[int], dtypes: list[str], log) -> dict:
    device = resolve_device("cuda")
    refs = list_images(list_file)
    items = [i for i in map(read_checked, refs) if isinstance(i, EncodedImage)]
    results = {}
    for batch, n, dtype in ((b, n, d) for b in batch_sizes for n in threads for d in dtypes):
        config = load_config(CONFIG, [f"run.batch_size={batch}", f"run.num_threads={n}"])
        model_input = ImageInput("input", "NCHW", dtype, (640, 640))
        pre = Preprocessor(device=device, **preprocessor_args(config, model_input, device))
        rate = dali_images_per_s(items, pre)
        results[f"dali b{batch} threads {n} {dtype}"] = {"images_per_s": round(rate)}
        log(f"dali b{batch} threads {n} {dtype}: {rate:.0f} img/s")
        del pre
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("images", help="file list (scripts/make_image_set.py writes one)")
    parser.add_argument("--models", nargs="+", required=True)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--threads", type=int, nargs="+", default=[4, 8, 12])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float16"], help="DALI's output type")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--only", nargs="+", default=["engine", "dali"])
    parser.add_argument("--json", type=Path)
    a = parser.parse_args()
    report = {"machine": machine(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "results": {}}

    def log(text: str) -> None:
        print(text, flush=True)

    if "engine" in a.only:
        report["results"].update(engine_rates(a.models, a.batch_sizes, a.iters, log))
    if "dali" in a.only:
        report["results"].update(dali_rates(a.images, a.batch_sizes, a.threads, a.dtypes, log))
    if a.json:
        a.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
