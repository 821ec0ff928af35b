"""RetinaNet R50-FPN, side by side in one run: gpudet against what users would otherwise run.

    gpudet            `gpudet detect`'s path (Detector.stream + JSONL records) with the config's
                      engine options, fp16 heads model, batch 16
    ort alone         the same model file and engine options, IOBinding, one batch repeated
    torch eager       the same network in torch, fp16 channels_last (model only)
    pytorch expert    the strongest PyTorch pipeline we could write for the job: files read on
                      threads, JPEGs decoded on the GPU in batches (nvJPEG), letterboxed on a
                      stream of their own one batch ahead, fp16 channels_last with cudnn.benchmark,
                      the network replayed as a CUDA graph, the postprocess batched (a top-k per
                      level for the whole batch, one NMS over the batch) on a thread and stream of
                      its own while the next batch decodes and runs, one pinned copy per batch
    pytorch usual     a DataLoader with PIL workers (persistent, pinned memory), eager fp16
                      torchvision RetinaNet with its own postprocess, detections to the host
    naive             PIL + numpy + `session.run` with numpy in and out, one image at a time

Weights are random (torchvision's initialisation, seed 0), with the classification head's bias
shifted so that about --detections-per-image detections per image survive the 0.05 threshold and
NMS (export_retinanet.py --detections-per-image), as a trained model's do on photos: every
row reports the detections per image it wrote. Two bounds run beside it: gpudet with the
unshifted model (no detection survives: what NMS and writing cost is left out) and at score 0
(every level's top 1,000 reach NMS, 300 kept per image). Every rate counts the detection records
on the host. Each row runs in a process of its own: its setup is the time from that process's
start to its first result (imports, model, warm-up), the same way for every row, and its rate
the median of --passes passes over the images. Needs torchvision.

    python scripts/bench_retinanet.py IMAGE_LIST --out DIR [--limit 2000] [--detections-per-image 100]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import subprocess
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

STARTED = float(os.environ.get("BENCH_STARTED", time.time()))  # when the parent started this row's process
CONFIG = Path(__file__).resolve().parent.parent / "configs" / "retinanet_r50_coco.yaml"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only to try this script out
HALF = torch.float16 if DEVICE == "cuda" else torch.float32  # torchvision's NMS has no float16 CPU kernel
MEAN, STD = exporter.IMAGENET_MEAN, exporter.IMAGENET_STD  # the config's, in 0..255 units
EXPERT = "pytorch expert (GPU decode, CUDA graph, batched postprocess on its own stream)"
USUAL = "pytorch usual (DataLoader + PIL workers, eager fp16)"
NAIVE = "naive (PIL + numpy + session.run, fp32, batch 1)"


def since_start() -> float:
    """Seconds since this row's process was started: its setup, measured alike for every row."""
    return time.time() - STARTED


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def row(images: int, seconds: list[float], detections: int, setup_s: float, **extra) -> dict:
    """The median pass's rate over the images whose detections reached the host, each pass's, and
    what the process paid before its first result."""
    median = statistics.median(seconds)
    return {"images_per_s": round(images / median, 1), "passes": [round(images / s, 1) for s in seconds],
            "images": images, "detections_per_image": round(detections / max(images, 1), 1),
            "setup_s": round(setup_s, 2), "wall_s": round(setup_s + median, 2), **extra}


MODELS = {"heads_fp16_load": ("retinanet_heads", True, False),  # name: (contract, fp16, dynamic batch)
          "heads_fp16_zero": ("retinanet_heads", True, False),
          "e2e_fp32_load": ("end_to_end", False, True)}


def model_files(out: Path, shift: float, batch: int, size_hw: tuple[int, int]) -> dict[str, Path]:
    return {name: out / f"retinanet_{name}_{batch}_{size_hw[0]}x{size_hw[1]}_{shift:.4f}.onnx" for name in MODELS}


def export_models(out: Path, model: torch.nn.Module, shift: float, batch: int, size_hw: tuple[int, int],
                  log) -> dict[str, Path]:
    """The fp16 heads model at batch `batch`, with the detection load (the class bias shifted by
    `shift`) and without (the zero-load bound); the fp32 end-to-end model with the load, any
    batch size, for the naive loop."""
    loaded = copy.deepcopy(model)
    exporter.shift_class_bias(loaded, shift)
    files = model_files(out, shift, batch, size_hw)
    for name, (contract, fp16, dynamic) in MODELS.items():
        if not files[name].exists():
            start = time.perf_counter()
            exporter.export(model if name == "heads_fp16_zero" else loaded, contract, files[name], size_hw=size_hw,
                            batch_size=batch, dynamic_batch=dynamic, fp16=fp16)
            log(f"exported {files[name].name} in {time.perf_counter() - start:.1f} s")
    return files


ZERO = "gpudet, zero-load bound (no detection survives)"
HEAVY = "gpudet, heavy-NMS bound (score 0: 300 per image)"
GPUDET_SECTIONS = {  # section: (row, model, overrides)
    "gpudet": ("gpudet", "heads_fp16_load", []),
    "zero": (ZERO, "heads_fp16_zero", []),
    "heavy": (HEAVY, "heads_fp16_load", ["postprocess.score_threshold=0.0"]),
}


def gpudet_rows(section: str, paths_file: str, files: dict[str, Path], batch: int, size_hw: tuple[int, int],
                passes: int, log) -> dict:
    """gpudet end to end (JSONL, then Parquet from the same detector), and for the loaded model ORT
    alone on the same model file and engine options, one batch again and again."""
    refs = list_images(paths_file)
    variant, model, overrides = GPUDET_SECTIONS[section]
    config = load_config(CONFIG, [f"model.path={files[model]}", f"run.device={DEVICE}", f"run.batch_size={batch}",
                                  f"preprocess.size={list(size_hw)}", *overrides])
    detector = Detector.from_config(config)
    list(detector.stream(refs[:batch], lambda errors: None))  # the first batch: DALI's and the decoder's start
    setup_s = since_start()
    results = {}
    for output_format in ("jsonl", "parquet"):  # the same detector: its setup is paid once
        runs = gpudet_passes(refs, detector, passes, warm_up=False, output_format=output_format)
        label = variant if output_format == "jsonl" else f"{variant}, --format parquet"
        median = sorted(runs, key=lambda r: r.seconds)[len(runs) // 2]
        results[label] = row(len(refs), [r.seconds for r in runs], round(median.detections_per_image * len(refs)),
                             setup_s, stages_s=median.stages)
        log(f"{label}: {results[label]}")
    if section == "gpudet":
        items = [i for i in map(read_checked, refs[:detector.batch_size]) if isinstance(i, EncodedImage)]
        rates = [model_images_per_s(items, detector, iterations=50) for _ in range(passes)]
        results["ort alone"] = {"images_per_s": round(statistics.median(rates), 1),
                                "passes": [round(r, 1) for r in rates], "cuda_options": detector.engine.cuda_options}
        log(f"ort alone: {results['ort alone']}")
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


def letterbox_gpu(images: list[torch.Tensor], size_hw: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [3, h, w] images on the GPU -> one fp16 [B, 3, H, W] channels_last batch, each image
    scaled to fit (bilinear, antialiased) at the top left and normalized, the rest 0 (the mean
    colour once normalized, as torchvision's transform and gpudet pad); and each image's scale."""
    height, width = size_hw
    mean = torch.tensor(MEAN, device=DEVICE)[:, None, None]
    std = torch.tensor(STD, device=DEVICE)[:, None, None]
    batch = torch.zeros(len(images), 3, height, width, device=DEVICE, dtype=HALF).contiguous(
        memory_format=torch.channels_last)
    scales = []
    for i, image in enumerate(images):  # sizes differ: one resize each (on the decoding thread's stream)
        scale = min(height / image.shape[1], width / image.shape[2])
        h, w = max(1, round(image.shape[1] * scale)), max(1, round(image.shape[2] * scale))
        resized = torch.nn.functional.interpolate(image[None].float(), size=(h, w), mode="bilinear",
                                                  antialias=True, align_corners=False)[0]
        batch[i, :, :h, :w] = (resized - mean) / std
        scales.append(scale)
    return batch, torch.tensor(scales, device=DEVICE)


def level_anchors(model: torch.nn.Module, size_hw: tuple[int, int], device: str) -> list[torch.Tensor]:
    """torchvision's anchors for an image of size_hw, one [N_level, 4] tensor per FPN level."""
    grids = [(-(-size_hw[0] // s), -(-size_hw[1] // s)) for s in (8, 16, 32, 64, 128)]
    features = [torch.zeros(1, 1, h, w, device=device) for h, w in grids]
    image_list = type("ImageList", (), {"tensors": torch.zeros(1, 3, *size_hw, device=device),
                                        "image_sizes": [tuple(size_hw)]})()
    return list(model.anchor_generator(image_list, features)[0].split([h * w * 9 for h, w in grids]))


def batched_postprocess(model: torch.nn.Module, logits: torch.Tensor, regression: torch.Tensor,
                        anchors: list[torch.Tensor], size_hw: tuple[int, int], candidates: int = 1000,
                        score_threshold: float = 0.05, iou_threshold: float = 0.5,
                        max_detections: int = 300) -> tuple[torch.Tensor, torch.Tensor]:
    """torchvision's RetinaNet postprocess for a whole batch at once: per level the top
    `candidates` logits of every image in one top-k (fp16; sigmoid is monotone, so only the kept
    ones are scored), their boxes decoded, one NMS over the batch (boxes offset by image and class,
    in float64 so the offsets cost no precision), an image's best max_detections kept. Returns rows
    [n, 7] (image, x1, y1, x2, y2, score, label; image order, best first) and the per-image counts."""
    from torchvision.ops import nms

    count, classes = logits.shape[0], logits.shape[2]
    scores, boxes, labels = [], [], []
    start = 0
    for level_anchors in anchors:
        end = start + len(level_anchors)
        flat = logits[:, start:end].reshape(count, -1)
        top, index = flat.topk(min(candidates, flat.shape[1]), dim=1)
        anchor = torch.div(index, classes, rounding_mode="floor")
        deltas = regression[:, start:end].gather(1, anchor[..., None].expand(-1, -1, 4))
        decoded = model.box_coder.decode_single(deltas.reshape(-1, 4).float(), level_anchors[anchor.reshape(-1)])
        scores.append(top.float().sigmoid())
        boxes.append(decoded.reshape(count, -1, 4))
        labels.append(index % classes)
        start = end
    scores, boxes, labels = torch.cat(scores, 1), torch.cat(boxes, 1), torch.cat(labels, 1)
    boxes[..., 0::2] = boxes[..., 0::2].clamp(0, size_hw[1])
    boxes[..., 1::2] = boxes[..., 1::2].clamp(0, size_hw[0])
    image = torch.arange(count, device=logits.device)[:, None].expand_as(labels)
    keep = scores > score_threshold  # one host sync: how many candidates the batch has
    scores, boxes, labels, image = scores[keep], boxes[keep], labels[keep], image[keep]
    group = (image * classes + labels).double()
    offset = group[:, None] * (max(size_hw) + 1)
    kept = nms(boxes.double() + offset, scores.double(), iou_threshold)  # best first, over the whole batch
    kept = kept[torch.sort(image[kept], stable=True).indices]  # image by image, each best first
    per_image = torch.bincount(image[kept], minlength=count)
    first = torch.cumsum(per_image, 0) - per_image
    rank = torch.arange(len(kept), device=kept.device) - first[image[kept]]
    kept = kept[rank < max_detections]
    rows = torch.cat([image[kept, None].float(), boxes[kept], scores[kept, None], labels[kept, None].float()], 1)
    return rows, per_image.clamp(max=max_detections)


def pytorch_expert(paths: list[str], model: torch.nn.Module, batch: int, size_hw: tuple[int, int], threads: int,
                   passes: int, log) -> dict:
    """The strongest PyTorch pipeline we could write for the job, in three overlapping stages:
    files read on threads and JPEGs decoded on the GPU in batches (nvJPEG), letterboxed on a stream
    of their own, one batch ahead; the network (fp16, channels_last, cudnn.benchmark) replayed as a
    CUDA graph; the postprocess (batched_postprocess) on a third thread and stream, its rows
    reaching the host in one pinned copy per batch. Batch k's postprocess runs while batch k+1
    decodes and runs."""
    import queue
    import threading

    from torchvision.io import ImageReadMode, decode_jpeg, read_file

    torch.backends.cudnn.benchmark = True
    model = model.to(DEVICE).to(HALF).eval().to(memory_format=torch.channels_last)
    heads = exporter.Heads(model)
    static = torch.zeros(batch, 3, *size_hw, device=DEVICE, dtype=HALF).contiguous(memory_format=torch.channels_last)
    graph = None
    with torch.no_grad():
        for _ in range(3):  # cudnn.benchmark's search, allocations
            logits, regression = heads(static)
        sync()
        if DEVICE == "cuda":
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits, regression = heads(static)
    anchors = level_anchors(model, size_hw, DEVICE)
    cuda = DEVICE == "cuda"
    streams = [torch.cuda.Stream() if cuda else None for _ in range(2)]

    def on(stream):
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def event(stream):
        if stream is None:
            return None
        done = torch.cuda.Event()
        done.record(stream)
        return done

    def run(chunks: list[list[str]], pool: ThreadPoolExecutor) -> tuple[int, int]:
        """Every image's detections on the host: (images, detections)."""
        decoded_q, post_q = queue.Queue(2), queue.Queue(2)
        counts = {"images": 0, "detections": 0}
        errors = []

        def decode() -> None:  # stage 1: read, decode, letterbox one batch ahead
            try:
                reads = [pool.submit(read_file, p) for p in chunks[0]] if chunks else []
                for k in range(len(chunks)):
                    following = [pool.submit(read_file, p) for p in chunks[k + 1]] if k + 1 < len(chunks) else []
                    with on(streams[0]):
                        x, scales = letterbox_gpu(decode_jpeg([f.result() for f in reads], mode=ImageReadMode.RGB,
                                                              device=DEVICE), size_hw)
                    decoded_q.put((x, scales, event(streams[0])))
                    reads = following
            except BaseException as error:  # noqa: BLE001 (raised again by run)
                errors.append(error)
            finally:
                decoded_q.put(None)

        def post() -> None:  # stage 3: NMS over the batch, one copy to the host, records
            while (item := post_q.get()) is not None:
                if not errors:  # after an error, drain the queue so that stage 2 ends
                    try:
                        post_one(*item)
                    except BaseException as error:  # noqa: BLE001 (raised again by run)
                        errors.append(error)

        def post_one(batch_logits, batch_regression, scales, ready) -> None:
            with on(streams[1]):
                if ready is not None:
                    streams[1].wait_event(ready)
                    scales.record_stream(streams[1])  # made on the decoding stream, read here
                with torch.no_grad():
                    rows, per_image = batched_postprocess(model, batch_logits, batch_regression, anchors,
                                                          size_hw)
                rows[:, 1:5] /= scales[rows[:, 0].long(), None]
                host = torch.empty(rows.shape, pin_memory=cuda)
                host.copy_(rows, non_blocking=cuda)
                host_counts = per_image.to("cpu", non_blocking=cuda)
                if cuda:
                    streams[1].synchronize()
            per_image_rows = np.split(host.numpy(), np.cumsum(host_counts.numpy())[:-1])
            counts["detections"] += sum(len(r) for r in per_image_rows)
            counts["images"] += len(per_image_rows)

        workers = [threading.Thread(target=decode, daemon=True), threading.Thread(target=post, daemon=True)]
        for worker in workers:
            worker.start()
        with torch.no_grad():  # stage 2, on this thread: the network
            while (item := decoded_q.get()) is not None:
                x, scales, ready = item
                if ready is not None:
                    torch.cuda.current_stream().wait_event(ready)
                    x.record_stream(torch.cuda.current_stream())  # made on the decoding stream, read here
                if graph is not None:  # a last, partial batch padded: one shape, one graph
                    static[:len(x)].copy_(x)
                    static[len(x):].zero_()
                    graph.replay()
                    out_logits, out_regression = logits, regression
                else:
                    out_logits, out_regression = heads(x)
                # the graph's outputs are overwritten by the next batch: the postprocess gets copies
                post_q.put((out_logits[:len(x)].clone(), out_regression[:len(x)].clone(), scales, event(
                    torch.cuda.current_stream() if cuda else None)))
        post_q.put(None)
        for worker in workers:
            worker.join()
        if errors:
            raise errors[0]
        return counts["images"], counts["detections"]

    chunks = [paths[i:i + batch] for i in range(0, len(paths), batch)]
    with ThreadPoolExecutor(threads) as pool:
        run(chunks[:2], pool)  # warm-up: nvJPEG's and the allocator's start
        setup_s = since_start()
        seconds = []
        for _ in range(passes):
            start = time.perf_counter()
            images, detections = run(chunks, pool)
            seconds.append(time.perf_counter() - start)
    result = row(images, seconds, detections, setup_s, threads=threads, cuda_graph=graph is not None)
    log(f"pytorch expert: {result}")
    return {EXPERT: result}


def pytorch_usual(paths: list[str], model: torch.nn.Module, batch: int, size_hw: tuple[int, int], workers: int,
                  passes: int, log) -> dict:
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
    setup_s = since_start()
    seconds = []
    for _ in range(passes):
        start = time.perf_counter()
        images, detections = run()
        sync()
        seconds.append(time.perf_counter() - start)
    result = row(images, seconds, detections, setup_s, workers=workers)
    log(f"pytorch usual: {result}")
    return {USUAL: result}


def naive(paths_file: str, files: dict[str, Path], count: int, size_hw: tuple[int, int], log) -> dict:
    refs = list_images(paths_file)[:count]
    config = load_config(CONFIG, [f"model.path={files['e2e_fp32_load']}", f"run.device={DEVICE}", "run.batch_size=1",
                                  f"preprocess.size={list(size_hw)}", "run.prefer_nhwc=false",
                                  "run.fuse_conv_bias=false"])
    rate = naive_images_per_s(refs, Detector.from_config(config))
    log(f"naive: {rate:.2f} img/s")
    return {NAIVE: {"images_per_s": round(rate, 2), "images": count}}


SECTIONS = ["gpudet", "zero", "heavy", "torch", "expert", "usual", "naive"]


def run_section(name: str, a: argparse.Namespace, paths: list[str], files: dict[str, Path], log) -> dict:
    """One section, in this process."""
    size_hw = tuple(a.size)
    listed = str(a.out / "images.txt")
    if name in GPUDET_SECTIONS:
        return gpudet_rows(name, listed, files, a.batch_size, size_hw, a.passes, log)
    if name == "naive":
        return naive(listed, files, a.naive_limit, size_hw, log)
    model = exporter.build_model("retinanet_resnet50_fpn", None, 91, 0)
    exporter.shift_class_bias(model, a.shift)  # the torch rows run the loaded model too
    if name == "torch":
        return torch_eager(model, a.batch_size, size_hw, log)
    if name == "expert":
        return pytorch_expert(paths, model, a.batch_size, size_hw, a.workers, a.passes, log)
    return pytorch_usual(paths, model, a.batch_size, size_hw, a.workers, a.passes, log)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("images", help="file list of JPEGs (scripts/make_image_set.py writes one)")
    parser.add_argument("--out", type=Path, required=True, help="folder for the models and bench_retinanet.json")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--size", type=int, nargs=2, default=[800, 800])
    parser.add_argument("--limit", type=int, default=2000, help="images for the end-to-end runs")
    parser.add_argument("--passes", type=int, default=3, help="passes over the images per row (the median counts)")
    parser.add_argument("--detections-per-image", type=int, default=100,
                        help="the load: detections per image the seeded model keeps (about)")
    parser.add_argument("--naive-limit", type=int, default=64)
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2),
                        help="DataLoader workers / reading threads of the PyTorch pipelines")
    parser.add_argument("--only", nargs="*", default=SECTIONS, choices=SECTIONS)
    parser.add_argument("--section", choices=SECTIONS, help=argparse.SUPPRESS)  # one row's process
    parser.add_argument("--shift", type=float, help=argparse.SUPPRESS)
    a = parser.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    report_path = a.out / "bench_retinanet.json"

    def log(text: str) -> None:
        print(text, flush=True)

    size_hw = tuple(a.size)
    root = Path(a.images).parent
    paths = [line if Path(line).is_absolute() else str(root / line)
             for line in (raw.strip() for raw in Path(a.images).read_text().splitlines()) if line][:a.limit]
    if a.section:  # a row's own process: the parent exported the models and found the shift
        files = model_files(a.out, a.shift, a.batch_size, size_hw)
        result = run_section(a.section, a, paths, files, log)
        (a.out / f"section_{a.section}.json").write_text(json.dumps(result) + "\n")
        return
    (a.out / "images.txt").write_text("\n".join(paths) + "\n")
    model = exporter.build_model("retinanet_resnet50_fpn", None, 91, 0)
    start = time.perf_counter()
    shift = exporter.detection_load_shift(model, a.detections_per_image, paths[:8], size_hw)
    log(f"class bias shift for about {a.detections_per_image} detections per image: {shift:.4f} "
        f"({time.perf_counter() - start:.1f} s)")
    export_models(a.out, model, shift, a.batch_size, size_hw, log)
    del model
    report = {"batch_size": a.batch_size, "size_hw": list(size_hw), "images": len(paths), "passes": a.passes,
              "detections_per_image_asked": a.detections_per_image, "class_bias_shift": round(shift, 4),
              "results": {},
              "machine": machine(), "gpudet": code_version(),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": " ".join(sys.argv)}
    for name in a.only:  # one after another, each in a fresh process
        done = a.out / f"section_{name}.json"
        done.unlink(missing_ok=True)
        command = [sys.executable, __file__, *sys.argv[1:], "--section", name, "--shift", repr(shift)]
        subprocess.run(command, env={**os.environ, "BENCH_STARTED": repr(time.time())}, check=False)
        if not done.exists():
            log(f"{name}: the row's process ended without a result")
            continue
        report["results"].update(json.loads(done.read_text()))
        done.unlink()
        report_path.write_text(json.dumps(report, indent=2) + "\n")
    r = report["results"]
    rate = {k: v["images_per_s"] for k, v in r.items()}
    pairs = {"gpudet / ort alone": ("gpudet", "ort alone"),
             "gpudet / pytorch expert": ("gpudet", EXPERT),
             "gpudet / pytorch usual": ("gpudet", USUAL),
             "gpudet / naive": ("gpudet", NAIVE),
             "ort alone / torch eager": ("ort alone", "torch eager fp16 channels_last (model only)"),
             "gpudet heavy-NMS bound / gpudet zero-load bound": (HEAVY, ZERO),
             "gpudet heavy-NMS bound / gpudet zero-load bound, --format parquet": (
                 f"{HEAVY}, --format parquet", f"{ZERO}, --format parquet"),
             "gpudet --format parquet / ort alone": ("gpudet, --format parquet", "ort alone")}
    report["ratios"] = {name: round(rate[top] / rate[bottom], 3) for name, (top, bottom) in pairs.items()
                        if rate.get(top) and rate.get(bottom)}
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"results": r, "ratios": report["ratios"]}, indent=1))


if __name__ == "__main__":
    main()
