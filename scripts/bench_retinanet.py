"""RetinaNet R50-FPN, side by side in one run: gpudet against what users would otherwise run.

    gpudet            `gpudet detect`'s path (Detector.stream + JSONL records) with the config's
                      engine options, fp16 heads model, batch 16
    ort alone         the same model file and engine options, IOBinding, one batch repeated
    torch eager       the same network in torch, fp16 channels_last (model only)
    pytorch strong    what a competent engineer writes in torch: files read on threads, JPEGs
                      decoded on the GPU in batches (torchvision.io.decode_jpeg), letterbox and
                      normalize on the GPU, fp16 channels_last with cudnn.benchmark, the network
                      replayed as a CUDA graph, torchvision's own postprocess, detections to the host
    pytorch usual     a DataLoader with PIL workers (persistent, pinned memory), eager fp16
                      torchvision RetinaNet with its own postprocess, detections to the host
    naive             PIL + numpy + `session.run` with numpy in and out, one image at a time

Weights are random (torchvision's initialisation, seed 0), with the classification head's bias
shifted so that about --detections-per-image detections per image survive the 0.05 threshold and
NMS (export_retinanet.py --detections-per-image), as a trained model's do on photos: every
row reports the detections per image it wrote. Two bounds run beside it: gpudet with the
unshifted model (no detection survives: what NMS and writing cost is left out) and at score 0
(every level's top 1,000 reach NMS, 300 kept per image). Every rate counts the detection records
on the host; the wall clock with setup stands beside each loop rate. Needs torchvision.

    python scripts/bench_retinanet.py IMAGE_LIST --out DIR [--limit 2000] [--detections-per-image 100]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import export_retinanet as exporter  # noqa: E402

from pipeline.bench import code_version, gpudet_passes, machine, model_images_per_s, naive_images_per_s  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.detector import Detector  # noqa: E402
from pipeline.source import EncodedImage, read_checked
from pipeline.listing import list_images  # noqa: E402

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "retinanet_r50_coco.yaml"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only to try this script out
HALF = torch.float16 if DEVICE == "cuda" else torch.float32  # torchvision's NMS has no float16 CPU kernel
MEAN, STD = exporter.IMAGENET_MEAN, exporter.IMAGENET_STD  # the config's, in 0..255 units


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def row(images: int, seconds: float, detections: int, setup_s: float | None = None, **extra) -> dict:
    """A rate over the images whose detections reached the host, with what the run paid before it."""
    return {"images_per_s": round(images / seconds, 1), "images": images,
            "detections_per_image": round(detections / max(images, 1), 1),
            **({"setup_s": round(setup_s, 2), "wall_s": round(setup_s + seconds, 2)} if setup_s is not None else {}),
            **extra}


def export_models(out: Path, model: torch.nn.Module, shift: float, batch: int, size_hw: tuple[int, int],
                  log) -> dict[str, Path]:
    """The fp16 heads model at batch `batch`, with the detection load (the class bias shifted by
    `shift`) and without (the zero-load bound); the fp32 end-to-end model with the load, any
    batch size, for the naive loop."""
    loaded = copy.deepcopy(model)
    exporter.shift_class_bias(loaded, shift)
    files = {}
    for name, source, contract, fp16, dynamic in [("heads_fp16_load", loaded, "retinanet_heads", True, False),
                                                  ("heads_fp16_zero", model, "retinanet_heads", True, False),
                                                  ("e2e_fp32_load", loaded, "end_to_end", False, True)]:
        path = out / f"retinanet_{name}_{batch}_{size_hw[0]}x{size_hw[1]}_{shift:.4f}.onnx"
        if not path.exists():
            start = time.perf_counter()
            exporter.export(source, contract, path, size_hw=size_hw, batch_size=batch, dynamic_batch=dynamic,
                            fp16=fp16)
            log(f"exported {path.name} in {time.perf_counter() - start:.1f} s")
        files[name] = path
    return files


def gpudet_rows(paths_file: str, files: dict[str, Path], batch: int, size_hw: tuple[int, int], log) -> dict:
    """gpudet end to end under the load and the two bounds, and ORT alone on the same model."""
    refs = list_images(paths_file)
    results = {}
    for name, model, overrides in [("gpudet", "heads_fp16_load", []),
                                   ("gpudet, zero-load bound (no detection survives)", "heads_fp16_zero", []),
                                   ("gpudet, heavy-NMS bound (score 0: 300 per image)", "heads_fp16_load",
                                    ["postprocess.score_threshold=0.0"])]:
        config = load_config(CONFIG, [f"model.path={files[model]}", f"run.device={DEVICE}", f"run.batch_size={batch}",
                                      f"preprocess.size={list(size_hw)}", *overrides])
        start = time.perf_counter()
        detector = Detector.from_config(config)
        list(detector.stream(refs[:batch], lambda errors: None))  # the first batch: DALI's and the decoder's start
        setup_s = time.perf_counter() - start
        for output_format in ("jsonl", "parquet"):  # the same detector: its setup is paid once
            run, = gpudet_passes(refs, detector, warm_up=False, output_format=output_format)
            label = name if output_format == "jsonl" else f"{name}, --format parquet"
            results[label] = row(len(refs), run.seconds, round(run.detections_per_image * len(refs)), setup_s,
                                 stages_s=run.stages)
            log(f"{label}: {results[label]}")
        if model == "heads_fp16_load" and not overrides:  # the same engine, its options, one batch again and again
            items = [i for i in map(read_checked, refs[:detector.batch_size]) if isinstance(i, EncodedImage)]
            results["ort alone"] = {"images_per_s": round(model_images_per_s(items, detector, iterations=50), 1),
                                    "cuda_options": detector.engine.cuda_options}
            log(f"ort alone: {results['ort alone']}")
        del detector
    return results


def torch_eager(model: torch.nn.Module, batch: int, size_hw: tuple[int, int], log) -> dict:
    heads = exporter.Heads(model).to(DEVICE).half().eval().to(memory_format=torch.channels_last)
    x = torch.randn(batch, 3, *size_hw, device=DEVICE).half().contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        for _ in range(3):
            heads(x)
        sync()
        times = []
        for _ in range(30):
            start = time.perf_counter()
            heads(x)
            sync()
            times.append(time.perf_counter() - start)
    rate = batch / statistics.median(times)
    log(f"torch eager: {rate:.1f} img/s")
    return {"torch eager fp16 channels_last (model only)": {"images_per_s": round(rate, 1)}}


def letterbox_gpu(images: list[torch.Tensor], size_hw: tuple[int, int]) -> tuple[torch.Tensor, list[float]]:
    """uint8 [3, h, w] images on the GPU -> one fp16 [B, 3, H, W] channels_last batch, each image
    scaled to fit (bilinear, antialiased) at the top left, normalized, the rest the mean colour (0
    once normalized, as torchvision's transform and gpudet pad); and each image's scale."""
    height, width = size_hw
    batch = torch.tensor(MEAN, device=DEVICE, dtype=torch.float16)[None, :, None, None].repeat(len(images), 1, height,
                                                                                                width)
    scales = []
    for i, image in enumerate(images):
        scale = min(height / image.shape[1], width / image.shape[2])
        h, w = max(1, round(image.shape[1] * scale)), max(1, round(image.shape[2] * scale))
        batch[i, :, :h, :w] = torch.nn.functional.interpolate(image[None].float(), size=(h, w), mode="bilinear",
                                                              antialias=True, align_corners=False)[0]
        scales.append(scale)
    mean = torch.tensor(MEAN, device=DEVICE, dtype=torch.float16)[:, None, None]
    std = torch.tensor(STD, device=DEVICE, dtype=torch.float16)[:, None, None]
    batch = (batch - mean) / std
    return batch.contiguous(memory_format=torch.channels_last), scales


def pytorch_strong(paths: list[str], model: torch.nn.Module, batch: int, size_hw: tuple[int, int], threads: int,
                   log) -> dict:
    """GPU decode and letterbox, fp16 channels_last with cudnn.benchmark, the backbone and heads as
    a CUDA graph, torchvision's postprocess_detections, detections to the host."""
    from torchvision.io import ImageReadMode, decode_jpeg, read_file

    start = time.perf_counter()
    torch.backends.cudnn.benchmark = True
    model = model.to(DEVICE).half().eval().to(memory_format=torch.channels_last)
    model.score_thresh, model.nms_thresh, model.detections_per_img = 0.05, 0.5, 300
    heads = exporter.Heads(model)
    static = torch.zeros(batch, 3, *size_hw, device=DEVICE, dtype=torch.float16).contiguous(
        memory_format=torch.channels_last)
    graph = None
    with torch.no_grad():
        for _ in range(3):  # cudnn.benchmark's search, allocations
            heads(static)
        sync()
        if DEVICE == "cuda":
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits, regression = heads(static)
    grids = [(-(-size_hw[0] // s), -(-size_hw[1] // s)) for s in (8, 16, 32, 64, 128)]
    level_sizes = [h * w * 9 for h, w in grids]
    features = [torch.zeros(1, 1, h, w, device=DEVICE) for h, w in grids]
    image_list = type("ImageList", (), {"tensors": static[:1], "image_sizes": [tuple(size_hw)]})()
    anchors = list(model.anchor_generator(image_list, features)[0].split(level_sizes))
    setup_s = time.perf_counter() - start

    chunks = [paths[i:i + batch] for i in range(0, len(paths), batch)]
    with ThreadPoolExecutor(threads) as pool:
        def read(chunk):  # the files of a batch, on the reading threads
            return [pool.submit(read_file, path) for path in chunk]

        def run(chunks) -> tuple[int, int]:
            images = detections = 0
            pending = [read(chunks[0])] if chunks else []
            for k in range(len(chunks)):
                if k + 1 < len(chunks):
                    pending.append(read(chunks[k + 1]))
                data = [f.result() for f in pending.pop(0)]
                decoded = decode_jpeg(data, mode=ImageReadMode.RGB, device=DEVICE)
                x, scales = letterbox_gpu(decoded, size_hw)
                with torch.no_grad():
                    if graph is not None and len(x) == batch:
                        static.copy_(x)
                        graph.replay()
                        out_logits, out_regression = logits[:len(x)], regression[:len(x)]
                    else:
                        out_logits, out_regression = heads(x)
                    head = {"cls_logits": list(out_logits.float().split(level_sizes, 1)),
                            "bbox_regression": list(out_regression.float().split(level_sizes, 1))}
                    found = model.postprocess_detections(head, [anchors] * len(x), [tuple(size_hw)] * len(x))
                for d, scale in zip(found, scales):
                    boxes = (d["boxes"] / scale).cpu().numpy()  # detections on the host
                    _ = d["scores"].cpu().numpy(), d["labels"].cpu().numpy()
                    detections += len(boxes)
                images += len(x)
            return images, detections

        run(chunks[:2])  # warm-up: nvJPEG's and the allocator's start
        sync()
        start = time.perf_counter()
        images, detections = run(chunks)
        sync()
        seconds = time.perf_counter() - start
    model.float().cpu().to(memory_format=torch.contiguous_format)
    result = row(images, seconds, detections, setup_s, threads=threads, cuda_graph=graph is not None)
    log(f"pytorch strong: {result}")
    return {"pytorch strong (GPU decode, fp16 channels_last, CUDA graph)": result}


def pytorch_usual(paths: list[str], model: torch.nn.Module, batch: int, size_hw: tuple[int, int], workers: int,
                  log) -> dict:
    """The pipeline most users write first: DataLoader + PIL workers -> eager fp16 torchvision RetinaNet."""
    from PIL import Image

    class Images(torch.utils.data.Dataset):
        def __len__(self):
            return len(paths)

        def __getitem__(self, i):
            image = Image.open(paths[i]).convert("RGB")
            scale = min(size_hw[0] / image.height, size_hw[1] / image.width)
            image = image.resize((round(image.width * scale), round(image.height * scale)), Image.Resampling.BILINEAR)
            return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)

    start = time.perf_counter()
    model = model.to(DEVICE, HALF).eval()
    model.score_thresh, model.nms_thresh, model.detections_per_img = 0.05, 0.5, 300
    # Images arrive letterboxed to size_hw's longer side; torchvision's transform keeps them.
    model.transform.min_size, model.transform.max_size = (max(size_hw),), max(size_hw)
    loader = torch.utils.data.DataLoader(Images(), batch_size=batch, num_workers=workers, collate_fn=list,
                                         pin_memory=True, persistent_workers=True, prefetch_factor=4)

    def run(limit: int | None = None) -> tuple[int, int]:
        images = detections = 0
        with torch.no_grad():
            for batch_images in loader:
                batch_images = [im.to(DEVICE, non_blocking=True).to(HALF) / 255 for im in batch_images]
                found = model(batch_images)
                detections += sum(len(d["boxes"].cpu()) for d in found)
                images += len(batch_images)
                if limit and images >= limit:
                    break
        return images, detections

    run(limit=batch * 2)  # warm-up: the workers start (and stay), cuDNN
    setup_s = time.perf_counter() - start
    start = time.perf_counter()
    images, detections = run()
    sync()
    seconds = time.perf_counter() - start
    model.float().cpu()
    result = row(images, seconds, detections, setup_s, workers=workers)
    log(f"pytorch usual: {result}")
    return {"pytorch usual (DataLoader + PIL workers, eager fp16)": result}


def naive(paths_file: str, files: dict[str, Path], count: int, size_hw: tuple[int, int], log) -> dict:
    refs = list_images(paths_file)[:count]
    config = load_config(CONFIG, [f"model.path={files['e2e_fp32_load']}", f"run.device={DEVICE}", "run.batch_size=1",
                                  f"preprocess.size={list(size_hw)}", "run.prefer_nhwc=false",
                                  "run.fuse_conv_bias=false"])
    rate = naive_images_per_s(refs, Detector.from_config(config))
    log(f"naive: {rate:.2f} img/s")
    return {"naive (PIL + numpy + session.run, fp32, batch 1)": {"images_per_s": round(rate, 2), "images": count}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("images", help="file list of JPEGs (scripts/make_image_set.py writes one)")
    parser.add_argument("--out", type=Path, required=True, help="folder for the models and bench_retinanet.json")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--size", type=int, nargs=2, default=[800, 800])
    parser.add_argument("--limit", type=int, default=2000, help="images for the end-to-end runs")
    parser.add_argument("--detections-per-image", type=int, default=100,
                        help="the load: detections per image the seeded model keeps (about)")
    parser.add_argument("--naive-limit", type=int, default=64)
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2),
                        help="DataLoader workers / reading threads of the PyTorch pipelines")
    parser.add_argument("--only", nargs="*", default=["gpudet", "torch", "strong", "usual", "naive"])
    a = parser.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    report_path = a.out / "bench_retinanet.json"

    def log(text: str) -> None:
        print(text, flush=True)

    size_hw = tuple(a.size)
    root = Path(a.images).parent
    paths = [line if Path(line).is_absolute() else str(root / line)
             for line in (raw.strip() for raw in Path(a.images).read_text().splitlines()) if line][:a.limit]
    listed = a.out / "images.txt"
    listed.write_text("\n".join(paths) + "\n")
    model = exporter.build_model("retinanet_resnet50_fpn", None, 91, 0)
    start = time.perf_counter()
    shift = exporter.detection_load_shift(model, a.detections_per_image, paths[:8], size_hw)
    log(f"class bias shift for about {a.detections_per_image} detections per image: {shift:.4f} "
        f"({time.perf_counter() - start:.1f} s)")
    files = export_models(a.out, model, shift, a.batch_size, size_hw, log)
    exporter.shift_class_bias(model, shift)  # the torch baselines run the loaded model too
    report = {"batch_size": a.batch_size, "size_hw": list(size_hw), "images": len(paths),
              "detections_per_image_asked": a.detections_per_image, "class_bias_shift": round(shift, 4),
              "results": {},
              "machine": machine(), "gpudet": code_version(),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": " ".join(sys.argv)}
    sections = {"gpudet": lambda: gpudet_rows(str(listed), files, a.batch_size, size_hw, log),
                "torch": lambda: torch_eager(model, a.batch_size, size_hw, log),
                "strong": lambda: pytorch_strong(paths, model, a.batch_size, size_hw, a.workers, log),
                "usual": lambda: pytorch_usual(paths, model, a.batch_size, size_hw, a.workers, log),
                "naive": lambda: naive(str(listed), files, a.naive_limit, size_hw, log)}
    for name in a.only:
        report["results"].update(sections[name]())
        report_path.write_text(json.dumps(report, indent=2) + "\n")
    r = report["results"]
    rate = {k: v["images_per_s"] for k, v in r.items()}
    pairs = {"gpudet / ort alone": ("gpudet", "ort alone"),
             "gpudet / pytorch strong": ("gpudet", "pytorch strong (GPU decode, fp16 channels_last, CUDA graph)"),
             "gpudet / pytorch usual": ("gpudet", "pytorch usual (DataLoader + PIL workers, eager fp16)"),
             "gpudet / naive": ("gpudet", "naive (PIL + numpy + session.run, fp32, batch 1)"),
             "ort alone / torch eager": ("ort alone", "torch eager fp16 channels_last (model only)"),
             "gpudet heavy-NMS bound / gpudet zero-load bound": ("gpudet, heavy-NMS bound (score 0: 300 per image)",
                                                                 "gpudet, zero-load bound (no detection survives)"),
             "gpudet heavy-NMS bound / gpudet zero-load bound, --format parquet": (
                 "gpudet, heavy-NMS bound (score 0: 300 per image), --format parquet",
                 "gpudet, zero-load bound (no detection survives), --format parquet"),
             "gpudet --format parquet / ort alone": ("gpudet, --format parquet", "ort alone")}
    report["ratios"] = {name: round(rate[top] / rate[bottom], 3) for name, (top, bottom) in pairs.items()
                        if rate.get(top) and rate.get(bottom)}
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"results": r, "ratios": report["ratios"]}, indent=1))


if __name__ == "__main__":
    main()
