"""RetinaNet R50-FPN benchmark, side by side in one run (issues 3 and 4): what each way of running
the same network costs on this machine.

    ort <variant>      ORT model-only with IOBinding, input and outputs on the device
    torch eager        the same heads in torch, fp16 channels_last (model-only)
    postprocess        gpudet's heads postprocess (RetinaNetHeads) per batch, at score 0.05 and 0;
                       the end-to-end model's in-graph postprocess as (e2e time - heads time)
    dali               DALI alone (the config's letterbox into the model's input), on the GPU and
                       on the CPU's threads, images in memory
    torchvision post   torchvision's own postprocess_detections (a Python loop per image)
    pytorch pipeline   DataLoader with PIL decode/letterbox in worker processes, fp16 eager
                       torchvision RetinaNet with its own postprocess, detections to the host
    gpudet             `gpudet detect` end to end (Detector.stream + JSONL), per contract
    naive              PIL + numpy + `session.run` with numpy in and out, one image at a time

Weights are random (torchvision's initialisation, seed 0): speed does not depend on them, but
with them no candidate scores above 0.05, so postprocess is also measured at threshold 0, where
every level sends its top 1,000 to NMS (the worst case). Needs torchvision (exports the models).

    python scripts/bench_retinanet.py IMAGE_LIST --out DIR [--batch-size 16] [--size 800 800]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import export_retinanet as exporter  # noqa: E402

from pipeline.bench import code_version, machine  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.device import resolve_device  # noqa: E402
from pipeline.engine import Engine  # noqa: E402
from pipeline import nms  # noqa: E402
from pipeline.postprocess import Compiled, GraphCache, RetinaNetHeads, Thresholds, image_meta  # noqa: E402

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "retinanet_r50_coco.yaml"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only to try this script out
PYTORCH = "pytorch pipeline (DataLoader + eager fp16 + torchvision postprocess)"
NAIVE = "naive (PIL + numpy + session.run, fp32)"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn, *, iterations: int, warmup: int = 3) -> list[float]:
    """Seconds per call, each call synchronized (ORT syncs itself; torch work is synced here)."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return times


def summary(times: list[float], batch: int) -> dict:
    return {"ms_per_batch": round(1e3 * statistics.median(times), 3),
            "images_per_s": round(batch / statistics.median(times), 1),
            "ms_p99": round(1e3 * sorted(times)[int(0.99 * (len(times) - 1))], 3)}


def ort_engine(path: Path, *, nhwc: bool, cuda_graph: bool = False, score_threshold: float = 0.05,
               extra: dict[str, str] | None = None) -> Engine:
    """ORT with the RetinaNet config's CUDA EP options when nhwc (prefer_nhwc, fuse_conv_bias),
    ORT's defaults otherwise (in NCHW cuDNN found no fused kernel for the stem: gpudet's config
    refuses fuse_conv_bias without prefer_nhwc), `extra` on top."""
    options = {**({"prefer_nhwc": "1", "fuse_conv_bias": "1"} if nhwc else {}), **(extra or {})}
    if cuda_graph:
        options["enable_cuda_graph"] = "1"
    return Engine(path, device=resolve_device(DEVICE), cuda_options=options,
                  scalars={"score_threshold": score_threshold, "iou_threshold": 0.5, "max_detections": 300})


def models(out: Path, batch: int, size_hw: tuple[int, int], log) -> tuple[torch.nn.Module, dict[str, Path]]:
    model = exporter.build_model("retinanet_resnet50_fpn", None, 91, 0)
    files = {}
    for name, contract, fp16, dynamic, stem in [("heads_fp16", "retinanet_heads", True, False, 3),
                                                ("heads_fp16_stem8", "retinanet_heads", True, False, 8),
                                                ("heads_fp32", "retinanet_heads", False, False, 3),
                                                ("e2e_fp16", "end_to_end", True, False, 3),
                                                ("e2e_fp32_dynamic", "end_to_end", False, True, 3)]:
        path = out / f"retinanet_{name}.onnx"
        if not path.exists():
            start = time.perf_counter()
            exporter.export(model, contract, path, size_hw=size_hw, batch_size=batch, dynamic_batch=dynamic,
                            fp16=fp16, stem_channels=stem)
            log(f"exported {path.name} in {time.perf_counter() - start:.1f} s")
        files[name] = path
    return model, files


def model_only(files: dict[str, Path], model: torch.nn.Module, batch: int, size_hw, iterations: int, log) -> dict:
    results = {}
    x16 = torch.randn(batch, 3, *size_hw, device=DEVICE).half()
    variants = [("ort heads fp32 NCHW", "heads_fp32", False, False, None),
                ("ort heads fp16 NCHW", "heads_fp16", False, False, None),
                ("ort heads fp16 NHWC", "heads_fp16", True, False, None),
                ("ort heads fp16 NHWC cuda graph", "heads_fp16", True, True, None),
                ("ort heads fp16 NHWC, stem padded to 8 channels", "heads_fp16_stem8", True, False, None),
                # ORT's default, each conv's bias added by a kernel of its own (the RetinaNet config fuses
                # it: run.fuse_conv_bias), and cuDNN's heuristic algorithm choice instead of an exhaustive search
                ("ort heads fp16 NHWC without fuse_conv_bias", "heads_fp16", True, False, {"fuse_conv_bias": "0"}),
                ("ort heads fp16 NHWC conv algo HEURISTIC", "heads_fp16", True, False,
                 {"cudnn_conv_algo_search": "HEURISTIC"}),
                ("ort e2e fp16 NHWC score>0.05", "e2e_fp16", True, False, None)]
    def measure(engine: Engine) -> dict:
        x = x16 if engine.image_input.dtype == "float16" else x16.float()
        return summary(timed(lambda: engine.run(x), iterations=iterations), batch)

    for label, name, nhwc, graph, extra in variants:
        try:
            results[label] = measure(ort_engine(files[name], nhwc=nhwc, cuda_graph=graph, extra=extra))
        except Exception as e:  # a variant ORT refuses is reported, not fatal
            results[label] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        log(f"{label}: {results[label]}")
    results["ort e2e fp16 NHWC score>0"] = measure(ort_engine(files["e2e_fp16"], nhwc=True, score_threshold=0.0))
    log(f"ort e2e score>0: {results['ort e2e fp16 NHWC score>0']}")

    heads = exporter.Heads(model).to(DEVICE).half().eval().to(memory_format=torch.channels_last)
    xcl = x16.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        results["torch eager fp16 channels_last"] = summary(timed(lambda: heads(xcl), iterations=iterations), batch)
        log(f"torch eager: {results['torch eager fp16 channels_last']}")
        if DEVICE != "cuda":
            return results
        graph, static_in = torch.cuda.CUDAGraph(), xcl.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                heads(static_in)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            heads(static_in)
        results["torch eager fp16 channels_last cuda graph"] = summary(
            timed(graph.replay, iterations=iterations), batch)
    return results


def postprocess(files: dict[str, Path], model: torch.nn.Module, batch: int, size_hw, iterations: int, log) -> dict:
    engine = ort_engine(files["heads_fp16"], nhwc=True)
    x = torch.randn(batch, 3, *size_hw, device=DEVICE).half()
    outputs = {k: v.clone() for k, v in engine.run(x).items()}
    post = RetinaNetHeads.from_metadata(engine.metadata, files["heads_fp16"], torch.device(DEVICE))
    ones, zeros = np.ones((batch, 2), np.float32), np.zeros((batch, 2), np.float32)
    meta = image_meta(ones, zeros, np.array([size_hw] * batch))  # on the host, as the detector passes it
    results = {}
    for threshold in (0.05, 0.0):
        keep = Thresholds(threshold, 0.5, 300)
        found = post(outputs, meta, num_images=batch, thresholds=keep)
        scores, _, _ = post.candidates(outputs["cls_logits"], outputs["bbox_regression"])
        times = timed(lambda: post(outputs, meta, num_images=batch, thresholds=keep).host, iterations=iterations)
        results[f"gpudet heads postprocess score>{threshold}"] = {
            **summary(times, batch), "candidates_per_image": round(float((scores > threshold).sum()) / batch),
            "detections_per_image": round(len(found.to_host().scores) / batch, 1)}
        log(f"postprocess {threshold}: {results[f'gpudet heads postprocess score>{threshold}']}")
    results["gpudet heads postprocess stages score>0.0"] = stages = postprocess_stages(post, outputs, batch, iterations)
    log(f"postprocess stages: {stages}")
    if DEVICE == "cuda":  # postprocess.compile: the same steps as Triton kernels from torch.compile
        compiled = RetinaNetHeads.from_metadata(engine.metadata, files["heads_fp16"], torch.device(DEVICE),
                                                compile=True)
        for threshold in (0.05, 0.0):
            keep = Thresholds(threshold, 0.5, 300)
            start = time.perf_counter()
            found = compiled(outputs, meta, num_images=batch, thresholds=keep)
            found.host
            first_call = time.perf_counter() - start
            times = timed(lambda: compiled(outputs, meta, num_images=batch, thresholds=keep).host,
                          iterations=iterations)
            key = f"gpudet heads postprocess compiled score>{threshold}"
            results[key] = {**summary(times, batch), "first_call_s": round(first_call, 1),
                            "detections_per_image": round(len(found.to_host().scores) / batch, 1)}
            log(f"{key}: {results[key]}")
        results["gpudet heads postprocess compiled stages score>0.0"] = stages = postprocess_stages(
            compiled, outputs, batch, iterations, compile=True)
        log(f"compiled postprocess stages: {stages}")
    # torchvision's own postprocess (per image, per level, in Python) on the same outputs, score > 0.
    split_sizes = post.level_sizes
    cl, br = outputs["cls_logits"].float(), outputs["bbox_regression"].float()
    head = {"cls_logits": list(cl.split(split_sizes, 1)), "bbox_regression": list(br.split(split_sizes, 1))}
    anchors = [list(post.anchors.split(split_sizes))] * batch
    model = model.to(DEVICE).eval()
    model.score_thresh = 0.0
    with torch.no_grad():
        times = timed(lambda: model.postprocess_detections(head, anchors, [tuple(size_hw)] * batch),
                      iterations=max(3, iterations // 4), warmup=1)
    results["torchvision postprocess_detections score>0"] = summary(times, batch)
    log(f"torchvision postprocess: {results['torchvision postprocess_detections score>0']}")
    model.cpu()
    return results


def postprocess_stages(post: RetinaNetHeads, outputs: dict, batch: int, iterations: int, compile: bool = False) -> dict:
    """Where the heads postprocess spends its time at score 0 (the worst case): its parts replayed
    as CUDA graphs (on the CPU, run), cumulative up to the whole graph (packed rows); the
    fixed-point steps the images needed; and on a GPU the heaviest kernels of one run of the whole
    graph's function, launched one by one (compiled: the Triton kernels), by device time."""
    logits, regression, m = outputs["cls_logits"], outputs["bbox_regression"], post.nms_prefix
    meta = image_meta(np.ones((batch, 2), np.float32), np.zeros((batch, 2), np.float32),
                      np.array([post.input_hw] * batch))

    def candidates(logits, regression, count):
        return post.candidates(logits, regression)

    def with_suppressors(logits, regression, count):
        scores, labels, boxes = post.candidates(logits, regression)
        return nms.suppressors(boxes[:, :m], labels[:, :m], scores[:, :m] > 0, iou_threshold=0.5)

    def kept(logits, regression, count, *, steps):
        scores, labels, boxes = post.candidates(logits, regression)
        return nms.top_nms(boxes, scores, labels, scores > 0, iou_threshold=0.5, max_kept=300, prefix=m,
                           max_iterations=steps)

    graphs, results = GraphCache(torch.device(DEVICE)), {}
    parts = [("candidates", candidates, {}), ("+ suppressors", with_suppressors, {})]
    parts += [(f"+ {steps} NMS steps", kept, {"steps": steps}) for steps in ((16,) if compile else (4, 8, 16, 32))]
    for name, fn, options in parts:
        fn = Compiled(fn) if compile else fn
        times = timed(lambda: graphs(fn, (logits, regression), (torch.tensor(batch),), **options),
                      iterations=iterations)
        results[f"{name} ms"] = round(1e3 * statistics.median(times), 3)
    whole = dict(score_threshold=0.0, iou_threshold=0.5, max_detections=300)
    times = timed(lambda: graphs(post._packed, (logits, regression), (torch.tensor(batch), meta), **whole),
                  iterations=iterations)
    results["+ packed rows (the whole graph) ms"] = round(1e3 * statistics.median(times), 3)
    if not compile:
        scores, labels, boxes = post.candidates(logits, regression)
        by = nms.suppressors(boxes[:, :m], labels[:, :m], scores[:, :m] > 0, iou_threshold=0.5)
        steps = next(s for s in range(1, m + 1)
                     if bool(nms.fixed_point(by, scores[:, :m] > 0, max_iterations=s)[1].all()))
        results["fixed-point steps the batch needed"] = steps
    if DEVICE == "cuda":
        from torch.profiler import ProfilerActivity, profile
        count, meta_device = torch.tensor(batch, device=DEVICE), meta.to(DEVICE)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            post._packed(logits, regression, count, meta_device, **whole)
            sync()
        kernels = sorted(prof.key_averages(), key=lambda e: -getattr(e, "self_device_time_total", 0))
        how = "compiled" if compile else "eager"
        results[f"heaviest kernels ({how}, us: count)"] = {
            e.key[:90]: f"{e.self_device_time_total:.0f}: {e.count}" for e in kernels[:14]}
        results[f"all kernels ({how}, us)"] = round(sum(getattr(e, "self_device_time_total", 0) for e in kernels))
    return results


def pytorch_pipeline(paths: list[str], model: torch.nn.Module, batch: int, size_hw, workers: int, log) -> dict:
    """The typical user pipeline: DataLoader + PIL workers -> fp16 eager torchvision RetinaNet."""
    from PIL import Image

    class Images(torch.utils.data.Dataset):
        def __len__(self):
            return len(paths)

        def __getitem__(self, i):
            image = Image.open(paths[i]).convert("RGB")
            scale = min(size_hw[0] / image.height, size_hw[1] / image.width)
            image = image.resize((round(image.width * scale), round(image.height * scale)), Image.Resampling.BILINEAR)
            return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)

    model = model.to(DEVICE).half().eval()
    model.score_thresh = 0.05
    # Images arrive letterboxed to size_hw's longer side; keep torchvision's transform from
    # resizing them again, so both pipelines run the model on the same pixels.
    model.transform.min_size, model.transform.max_size = (max(size_hw),), max(size_hw)
    loader = torch.utils.data.DataLoader(Images(), batch_size=batch, num_workers=workers, collate_fn=list,
                                         pin_memory=True, persistent_workers=False)

    def run(limit: int | None = None) -> int:
        done = 0
        with torch.no_grad():
            for images in loader:
                images = [im.to(DEVICE, non_blocking=True).half() / 255 for im in images]
                detections = model(images)
                _ = [{k: v.cpu() for k, v in d.items()} for d in detections]
                done += len(images)
                if limit and done >= limit:
                    break
        return done

    run(limit=batch * 2)  # warm-up (cuDNN, workers)
    start = time.perf_counter()
    done = run()
    rate = done / (time.perf_counter() - start)
    model.float().cpu()
    log(f"pytorch pipeline ({workers} workers): {rate:.1f} img/s")
    return {PYTORCH: {"images_per_s": round(rate, 1), "workers": workers}}


def dali_alone(paths: list[str], model_path: Path, batch: int, workers: int, log) -> dict:
    """DALI alone, the RetinaNet config's preprocessing into the heads model's input (float16 NCHW),
    over the images already in memory, two batches in flight: on the GPU (nvJPEG and the hardware
    decoder, the config's threads) and on the CPU with `workers` threads."""
    from pipeline.bench import dali_images_per_s
    from pipeline.detector import Detector
    from pipeline.results import ImageRef
    from pipeline.source import EncodedImage, read_checked

    items = [i for i in (read_checked(ImageRef(k, p)) for k, p in enumerate(paths)) if isinstance(i, EncodedImage)]
    results = {}
    for device_name, threads in ([("cuda", None)] if DEVICE == "cuda" else []) + [("cpu", workers)]:
        config = load_config(CONFIG, [f"model.path={model_path}", f"run.device={device_name}",
                                      f"run.batch_size={batch}"] + ([f"run.num_threads={threads}"] if threads else []))
        preprocessor = Detector.from_config(config).preprocessor  # the heads model's input: float16 NCHW
        rate = dali_images_per_s(items, preprocessor)
        key = f"dali {device_name}, {preprocessor.num_threads} threads"
        results[key] = {"images_per_s": round(rate, 1), "images": len(items)}
        log(f"{key}: {rate:.1f} img/s")
        del preprocessor
    return results


def gpudet_runs(list_file: str, files: dict[str, Path], batch: int, log) -> dict:
    from pipeline.bench import gpudet_passes, naive_images_per_s
    from pipeline.detector import Detector
    from pipeline.source import list_images

    refs = list_images(list_file)
    results = {}
    for name in ("heads_fp16", "e2e_fp16"):
        config = load_config(CONFIG, [f"model.path={files[name]}", f"run.device={DEVICE}", f"run.batch_size={batch}"])
        detector = Detector.from_config(config)
        run, = gpudet_passes(refs, detector)
        results[f"gpudet {name}"] = {"images_per_s": round(run.images_per_s, 1), "contract": detector.contract,
                                     "stages_s": run.stages, "detections_per_image": run.detections_per_image}
        log(f"gpudet {name}: {run.images_per_s:.1f} img/s, {run.stages}")
    config = load_config(CONFIG, [f"model.path={files['e2e_fp32_dynamic']}", f"run.device={DEVICE}", "run.batch_size=1",
                                  "run.prefer_nhwc=false", "run.fuse_conv_bias=false"])
    detector = Detector.from_config(config)
    rate = naive_images_per_s(refs[:64], detector)
    results[NAIVE] = {"images_per_s": round(rate, 2)}
    log(f"naive: {rate:.2f} img/s")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("images", help="file list (scripts/make_image_set.py writes one)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--size", type=int, nargs=2, default=[800, 800])
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--limit", type=int, default=2000, help="images for the end-to-end runs")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    parser.add_argument("--only", nargs="*", default=["model", "postprocess", "dali", "pytorch", "gpudet"])
    a = parser.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    report_path = a.out / "bench_retinanet.json"

    def log(text: str) -> None:
        print(text, flush=True)

    size_hw = tuple(a.size)
    model, files = models(a.out, a.batch_size, size_hw, log)
    root = Path(a.images).parent
    paths = [str(root / line.strip()) if not Path(line.strip()).is_absolute() else line.strip()
             for line in Path(a.images).read_text().splitlines() if line.strip()][:a.limit]
    limited = a.out / "images.txt"
    limited.write_text("\n".join(paths) + "\n")
    report = {"batch_size": a.batch_size, "size_hw": list(size_hw), "images": len(paths), "results": {},
              "machine": machine(), "gpudet": code_version(),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": " ".join(sys.argv)}
    sections = {"model": lambda: model_only(files, model, a.batch_size, size_hw, a.iterations, log),
                "postprocess": lambda: postprocess(files, model, a.batch_size, size_hw, a.iterations, log),
                "dali": lambda: dali_alone(paths, files["heads_fp16"], a.batch_size, a.workers, log),
                "pytorch": lambda: pytorch_pipeline(paths, model, a.batch_size, size_hw, a.workers, log),
                "gpudet": lambda: gpudet_runs(str(limited), files, a.batch_size, log)}
    for name in a.only:
        report["results"].update(sections[name]())
        report_path.write_text(json.dumps(report, indent=2) + "\n")
    r = report["results"]

    def rate(key: str) -> float | None:
        return r.get(key, {}).get("images_per_s")

    ratios = {}
    pairs = {"ort heads fp16 NHWC / torch eager": ("ort heads fp16 NHWC", "torch eager fp16 channels_last"),
             "gpudet heads / ort heads fp16 NHWC": ("gpudet heads_fp16", "ort heads fp16 NHWC"),
             "gpudet heads / pytorch pipeline": ("gpudet heads_fp16", PYTORCH),
             "gpudet heads / naive": ("gpudet heads_fp16", NAIVE),
             "gpudet e2e / ort e2e score>0.05": ("gpudet e2e_fp16", "ort e2e fp16 NHWC score>0.05")}
    for name, (top, bottom) in pairs.items():
        if rate(top) and rate(bottom):
            ratios[name] = round(rate(top) / rate(bottom), 3)
    heads_ms = r.get("ort heads fp16 NHWC", {}).get("ms_per_batch")
    for key in ("gpudet heads postprocess score>0.05", "gpudet heads postprocess score>0.0",
                "gpudet heads postprocess compiled score>0.05", "gpudet heads postprocess compiled score>0.0"):
        if heads_ms and key in r:
            ratios[f"{key} / model"] = round(r[key]["ms_per_batch"] / heads_ms, 4)
    for threshold in ("0.05", "0"):
        e2e = r.get(f"ort e2e fp16 NHWC score>{threshold}", {}).get("ms_per_batch")
        if heads_ms and e2e:
            ratios[f"e2e in-graph postprocess score>{threshold} / model"] = round((e2e - heads_ms) / heads_ms, 4)
    report["ratios"] = ratios
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"results": r, "ratios": ratios}, indent=1))


if __name__ == "__main__":
    main()
