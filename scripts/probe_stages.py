"""Time each stage alone on one fixed batch: DALI preprocess, ORT engine, torch postprocess.

A probe for finding where the time goes (the side-by-side benchmark is `gpudet bench`).
Each stage is warmed up, then run --iters times; every stage ends in a host sync, so host clocks
measure it. Usage:
    python scripts/probe_stages.py SOURCE [--device cuda] [--batch-size 32] [--iters 50]
        [--cuda-option cudnn_conv_algo_search=HEURISTIC ...] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import statistics
import time

from pipeline.config import load_config, resolve_model_path
from pipeline.device import resolve_device
from pipeline.engine import Engine
from pipeline.modelinfo import cuda_placement
from pipeline.postprocess import end_to_end, to_device_meta
from pipeline.preprocess import Preprocessor
from pipeline.detector import engine_args, preprocessor_args
from pipeline.source import EncodedImage, list_images, read_checked


def timed(fn, iters: int, warmup: int = 3) -> float:
    """Median seconds of fn() over iters runs after warmup runs."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--cuda-option", action="append", default=[])
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--model", help="another ONNX model (e.g. build_retinaface.py --heads-only output)")
    args = parser.parse_args()
    extra = [f"model.path={args.model}"] if args.model else []
    config = load_config(None, args.overrides + extra + [f"run.batch_size={args.batch_size}"])
    device = resolve_device(args.device)
    cuda_options = dict(o.split("=", 1) for o in args.cuda_option)
    kwargs = engine_args(config)
    kwargs["cuda_options"] = {**kwargs["cuda_options"], **cuda_options}
    engine = Engine(resolve_model_path(config), device=device, **kwargs)
    preprocessor = Preprocessor(device=device, **preprocessor_args(config, engine.image_input, device))
    refs = list_images(args.source)[:args.batch_size]
    items = [i for i in map(read_checked, refs) if isinstance(i, EncodedImage)]
    pre_s = timed(lambda: preprocessor.run(items), args.iters)
    batch = preprocessor.run(items)
    engine_s = timed(lambda: engine.run(batch.images), args.iters)
    outputs = engine.run(batch.images)
    stages = [("preprocess", pre_s), ("engine", engine_s)]
    if "boxes" in outputs:
        meta = to_device_meta(batch.scale_yx, batch.pad_yx, batch.orig_hw, device.torch)
        stages.append(("postprocess", timed(lambda: end_to_end(
            outputs, meta, score_threshold=config.postprocess.score_threshold,
            max_detections=config.postprocess.max_detections, num_landmarks=5), args.iters)))
    n = len(items)
    print(f"{engine.model_path.name} on {device.describe()}, batch {n}, input {engine.inputs[0].describe()}, "
          f"cuda_options {cuda_options or '{}'}, {placement(engine, cuda_options)}")
    for name, s in stages:
        print(f"  {name:<12} {s * 1e3:8.2f} ms/batch {n / s:9.0f} img/s")


def placement(engine: Engine, cuda_options: dict) -> str:
    """Nodes ORT keeps on the CPU and Memcpy nodes between CUDA and CPU kernels (host round trips
    per run), from gpudet inspect's profile of one run at the pipeline's input size."""
    if not engine.device.is_cuda:
        return "placement: CPU run"
    found = cuda_placement(engine.model_path, engine.image_input.size_hw, device_index=engine.device.index,
                           cuda_options=cuda_options)
    return f"nodes on the CPU {found['nodes'].get('CPUExecutionProvider', 0)}, Memcpy nodes {len(found['memcpy'])}"


if __name__ == "__main__":
    main()
