"""`gpudet bench`: side by side, in one run, on the same images and model.

    naive        PIL decode + letterbox + numpy normalize, `session.run` with numpy in and out,
                 one image at a time: what users write first
    gpudet       the whole pipeline (Detector.stream), records written to a JSONL file
    model        ORT alone with IOBinding on one preprocessed batch, repeated
    preprocess   DALI alone on the same images (read into memory first), run.prefetch_batches in
                 flight as in the pipeline

Each measurement is warmed up first and counts images/s over the whole set (model: over
repeated batches); for gpudet also the seconds the loop waited on each stage and, on a GPU, the
mean GPU utilisation (nvidia-smi) while it ran, and what a job pays once before that rate (building
the detector: model load, warm-up, compiled postprocess; the first batch). Ratios are computed here,
from this run; the report records hardware, versions, the host's speed on one core, date and the
exact command. `--latency N` adds batch-1 latency (p50/p99, file to detections). The torch-eager
and DataLoader baselines need torchvision's RetinaNet; they are in scripts/bench_retinanet.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from .config import Config
from .detector import Detector
from .preprocess import Preprocessor, preprocess_stream
from .results import ImageError, ImageRef
from .errors import SourceError
from .session import SCALAR_INPUTS
from .folder import OutputFolder
from .listing import list_images
from .job import record_stream
from .formats import record_format
from .sinks import read_complete_records
from .source import EncodedImage, batched, read_checked
from .timing import StageClock, process_seconds


def naive_images_per_s(refs: list[ImageRef], detector: Detector) -> float:
    """The baseline: PIL + numpy on the host, one `session.run` per image with numpy arrays."""
    import onnxruntime as ort
    from PIL import Image, ImageOps

    config, engine = detector.config, detector.engine
    p = config.preprocess
    height, width = engine.image_input.size_hw or tuple(p.size)
    dtype = np.float16 if engine.image_input.dtype == "float16" else np.float32
    providers = engine.session.get_providers()
    session = ort.InferenceSession(str(detector.model_path), providers=providers)
    names = {i.name for i in session.get_inputs()}
    t = detector.thresholds
    scalars = {k: np.array([v], SCALAR_INPUTS[k]) for k, v in [("score_threshold", t.score_threshold),
               ("iou_threshold", t.iou_threshold), ("max_detections", t.max_detections)] if k in names}
    mean, std = np.array(p.mean, np.float32), np.array(p.std, np.float32)

    def one(path: str) -> None:
        image = ImageOps.exif_transpose(Image.open(path)).convert("RGB")
        scale = min(height / image.height, width / image.width)
        resized = image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))),
                               Image.Resampling.BILINEAR)
        canvas = np.empty((height, width, 3), np.float32)
        canvas[:] = mean if p.pad_value is None else p.pad_value  # as the DALI graph pads
        pixels = np.asarray(resized, np.float32)
        canvas[:pixels.shape[0], :pixels.shape[1]] = pixels[..., ::-1] if p.channel_order == "BGR" else pixels
        tensor = ((canvas - mean) / std).astype(dtype)
        tensor = tensor.transpose(2, 0, 1)[None] if engine.image_input.layout == "NCHW" else tensor[None]
        outputs = session.run(None, {engine.image_input.name: np.ascontiguousarray(tensor), **scalars})
        _ = [o.shape for o in outputs]  # the outputs are numpy on the host: the copy happened

    for ref in refs[:2]:  # warm-up
        one(ref.path)
    start = time.perf_counter()
    for ref in refs:
        one(ref.path)
    return len(refs) / (time.perf_counter() - start)


class GpuUtilisation:
    """nvidia-smi's utilization.gpu of one GPU, sampled every 200 ms while in the `with` block
    (the share of time a kernel was running). mean is None without a GPU or nvidia-smi."""

    def __init__(self, index: int | None):
        self.index, self.mean, self._process = index, None, None

    def __enter__(self) -> GpuUtilisation:
        if self.index is not None and shutil.which("nvidia-smi"):
            self._process = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-i", str(self.index),
                 "-lms", "200"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc) -> None:
        if self._process is None:
            return
        self._process.terminate()
        out, _ = self._process.communicate()
        samples = [int(v) for v in out.split() if v.isdigit()]
        self.mean = round(sum(samples) / len(samples), 1) if samples else None


@dataclass
class Pass:
    """One timed pass of gpudet over the images: records written per second, the seconds the loop
    waited on each stage, the GPU's mean utilisation, and the detections it wrote."""

    images_per_s: float
    seconds: float
    stages: dict
    detections_per_image: float


def gpudet_passes(refs: list[ImageRef], detector: Detector, passes: int = 1, *, warm_up: bool = True,
                  output_format: str = "jsonl") -> list[Pass]:
    """The pipeline as `gpudet detect` runs it: read, DALI, ORT, postprocess, records into an
    output folder (JSONL, or `output_format`), timed over `refs` `passes` times after one warm-up
    batch (warm_up=False: the caller ran one). A rate counts the records written; an image that
    fails stops the benchmark."""
    if warm_up:
        list(detector.stream(refs[:detector.batch_size], lambda errors: None))
    record_format(output_format).load()  # pyarrow's import for Parquet, once per process: not the first pass's
    runs = []
    for _ in range(passes):
        clock = StageClock()
        with tempfile.TemporaryDirectory() as tmp, \
                GpuUtilisation(detector.device.index if detector.device.is_cuda else None) as gpu:
            start = time.perf_counter()
            with OutputFolder(tmp, output_format=output_format) as folder, folder.writing():
                record_stream(detector, batched(refs, detector.batch_size), folder, clock=clock)
            seconds = time.perf_counter() - start
            failed = list(read_complete_records(folder.files[1]))
        t = folder.tally
        if t.failed:
            raise SourceError(f"bench: {t.failed} of {len(refs)} images failed (first: {failed[0]['path']}: "
                              f"{failed[0]['message']}); measure on images that decode")
        runs.append(Pass(images_per_s=t.processed / seconds, seconds=seconds,
                         stages={**{k: round(v, 4) for k, v in clock.seconds.items()},
                                 "gpu_utilisation_percent": gpu.mean},
                         detections_per_image=t.detections / max(t.processed, 1)))
    return runs


def model_images_per_s(items: list[EncodedImage], detector: Detector, iterations: int) -> float:
    batch = detector.preprocessor.run(items)
    for _ in range(3):
        detector.engine.run(batch.images)
    start = time.perf_counter()
    for _ in range(iterations):
        detector.engine.run(batch.images)
    return len(items) * iterations / (time.perf_counter() - start)


def dali_images_per_s(items: list[EncodedImage], preprocessor: Preprocessor, in_flight: int = 2) -> float:
    """DALI alone over `items` (bytes already in memory), fed as the pipeline feeds it
    (preprocess_stream, `in_flight` batches ahead), after one warm-up pass (allocations, the
    hardware decoder's start). An image DALI cannot decode stops the measurement."""
    size = preprocessor.batch_size
    batches = [items[i:i + size] for i in range(0, len(items), size)]

    def undecodable(errors: list[ImageError]) -> None:
        raise RuntimeError("DALI alone: cannot decode " + "; ".join(f"{e.path}: {e.message}" for e in errors))

    def run_all() -> None:
        for _ in preprocess_stream(preprocessor, batches, undecodable, depth=in_flight):
            pass

    run_all()
    start = time.perf_counter()
    run_all()
    return len(items) / (time.perf_counter() - start)


def latency_ms(refs: list[ImageRef], config: Config, count: int) -> dict:
    """One image at a time through a batch-1 detector: read, DALI, ORT, postprocess, detections on
    the host. Percentiles of the per-image wall time, after 3 warm-up images."""
    detector = Detector.from_config(dataclasses.replace(config, run=dataclasses.replace(config.run, batch_size=1)))
    times = []
    for i, ref in enumerate((refs * (1 + (count + 3) // max(1, len(refs))))[:count + 3]):
        start = time.perf_counter()
        list(detector.stream([ref], lambda errors: None))
        if i >= 3:
            times.append(1e3 * (time.perf_counter() - start))
    times.sort()
    return {"images": len(times), "p50_ms": round(float(np.percentile(times, 50)), 3),
            "p99_ms": round(float(np.percentile(times, 99)), 3)}


def python_loop_ms(repeats: int = 5) -> float:
    """Milliseconds one core takes for a fixed piece of pure Python (100,000 loop steps of small
    int and dict work), the best of `repeats`. A pipeline whose loop is bound by the host (GPU busy
    well under 100%) follows this number from one machine to the next; it is in every report so that
    rates of different machine starts can be compared against it."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        counts: dict[int, int] = {}
        for i in range(100_000):
            counts[i & 63] = counts.get(i & 63, 0) + i
        best = min(best, time.perf_counter() - start)
    return round(1e3 * best, 3)


def machine() -> dict:
    import onnxruntime
    import torch
    from nvidia import dali

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"cpu": cpu, "cores": os.cpu_count(), "gpus": gpus, "python": platform.python_version(),
            "python_loop_ms": python_loop_ms(),
            "torch": torch.__version__, "onnxruntime": onnxruntime.__version__, "dali": dali.__version__}


CODE_PATHS = ("pipeline", "configs", "models", "scripts")
"""What a measurement ran: code_tree is git's tree of these paths as they are on disk."""


def code_version() -> dict:
    """Which gpudet made the numbers: its version, the folder it was imported from, and the git
    commit when that folder's parent is a checkout's root ("+" after it: uncommitted changes to
    tracked files), None for an installed wheel or a copy of the package outside a checkout. And
    code_tree: git's tree hash of CODE_PATHS as they are on disk (a copy of a working tree can
    carry another commit's metadata; this names its content), which a commit's own tree of those
    paths matches exactly when the code is that commit's."""
    from ._version import __version__

    root = Path(__file__).resolve().parent.parent
    commit = content = None
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()

        top, head = git("rev-parse", "--show-toplevel", "HEAD").split()
        if Path(top).resolve() == root:
            commit = head[:12] + ("+" if git("status", "--porcelain", "--untracked-files=no") else "")
            with tempfile.TemporaryDirectory() as tmp:  # the content, whatever the checkout's metadata says
                content = subprocess.run(
                    ["sh", "-c", 'git add -A -- "$@" && git write-tree', "sh", *CODE_PATHS], cwd=root,
                    env={**os.environ, "GIT_INDEX_FILE": str(Path(tmp) / "index")}, capture_output=True, text=True,
                    timeout=30, check=True).stdout.strip()
    except (OSError, ValueError, subprocess.SubprocessError):
        pass
    return {"version": __version__, "source": str(root / "pipeline"), "commit": commit, "code_tree": content}


def run_bench(source: str, config: Config, *, limit: int, iterations: int, skip_naive: bool = False,
              naive_limit: int = 300, latency: int = 0, passes: int = 1, output_format: str = "jsonl",
              command: str = "") -> dict:
    """naive_limit: the naive loop runs on the first N of the images (one at a time, for the same
    rate in a fraction of the time). passes: gpudet's timed passes over the images; the report's
    rate and stages are those of the median pass (the lower of the middle two), every pass's rate
    is listed. output_format: how the passes write their records (detect's --format)."""
    host = machine()  # before the detector's threads start, for its python_loop_ms
    refs = list_images(source)[:limit]
    refs = [ImageRef(i, r.path) for i, r in enumerate(refs)]
    # What a job pays once, before its images/s: from the command to a detector ready (imports,
    # model load, the engine's warm-up and CUDA graphs), then the first batch (DALI's start, the
    # decoder's), which is also the passes' warm-up.
    start = time.perf_counter()
    detector = Detector.from_config(config)
    setup = {"detector": time.perf_counter() - start, "since_start": process_seconds()}
    config = detector.config  # a model with a static batch size has set run.batch_size
    start = time.perf_counter()
    list(detector.stream(refs[:detector.batch_size], lambda errors: None))
    setup["first_batch"] = time.perf_counter() - start
    items = [i for i in map(read_checked, refs[:detector.batch_size]) if isinstance(i, EncodedImage)]
    runs = gpudet_passes(refs, detector, passes, warm_up=False, output_format=output_format)
    median = sorted(runs, key=lambda run: run.images_per_s)[(len(runs) - 1) // 2]
    encoded = [i for i in map(read_checked, refs) if isinstance(i, EncodedImage)]
    megapixels = sum(i.pixels for i in encoded) / max(len(encoded), 1) / 1e6  # per image, as the headers say
    rates = {
        "gpudet": median.images_per_s,
        "model": model_images_per_s(items, detector, iterations),
        # every image, in memory, decoded whole, as many batches in flight as the pipeline keeps
        "preprocess": dali_images_per_s(encoded, detector.preprocessor, in_flight=config.run.prefetch_batches),
    }
    # The naive loop and the latency mode run one image at a time: not with a fixed batch size.
    fixed_batch = detector.engine.declared_batch if detector.engine.declared_batch not in (None, 1) else None
    skipped, naive = {}, {}
    if fixed_batch and not skip_naive:
        skipped["naive"] = (f"the model takes batches of exactly {fixed_batch}; the naive loop runs one image at "
                            "a time: give it a model with a dynamic batch")
    elif not skip_naive:
        rates["naive"] = naive_images_per_s(refs[:naive_limit], detector)
        naive = {"images": min(naive_limit, len(refs)), "batch": 1, "precision": detector.engine.image_input.dtype,
                 "session": "the same model file, ORT's default provider options, numpy in and out"}
    # Ratios of the rates as reported (rounded), so the report checks out against itself.
    rates = {k: round(v, 2) for k, v in rates.items()}
    ratios = {"gpudet / model": rates["gpudet"] / rates["model"]}
    if "naive" in rates:
        ratios["gpudet / naive"] = rates["gpudet"] / rates["naive"]
    report_latency = None
    if latency:
        report_latency = ({"skipped": f"the model's batch size is fixed at {fixed_batch}"} if fixed_batch
                          else latency_ms(refs, config, latency))
    return {  # "images" first: the report's first key is how a later --json knows the file is one (layout.py)
        "images": len(refs),
        **({"latency_batch_1": report_latency} if report_latency else {}), **({"skipped": skipped} if skipped else {}),
        "output_format": output_format, **({"naive": naive} if naive else {}),
        "batch_size": detector.batch_size, "device": detector.device.describe(),
        "model": str(detector.model_path), "contract": detector.contract, "config": config.source_file,
        "images_per_s": rates, "megapixels_per_image": round(megapixels, 3),
        "megapixels_per_s": {k: round(v * megapixels, 1) for k, v in rates.items() if k in ("gpudet", "preprocess")},
        "gpudet_stages_s": median.stages,
        "detections_per_image": round(median.detections_per_image, 2),
        "gpudet_setup_s": {k: round(v, 3) for k, v in setup.items()},
        # what `gpudet detect` over these images takes from the command: setup, the first batch, the rest
        "job_wall_s": round(setup["since_start"] + setup["first_batch"] +
                            max(0, len(refs) - detector.batch_size) / median.images_per_s, 3),
        **({"gpudet_passes_images_per_s": [round(run.images_per_s, 2) for run in runs]} if passes > 1 else {}),
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
        "machine": host, "gpudet": code_version(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command,
    }


def format_report(report: dict) -> str:
    lines = [f"gpudet bench: {report['images']} images, batch {report['batch_size']}, {report['device']}, "
             f"{Path(report['model']).name} ({report['contract']}), records as {report.get('output_format', 'jsonl')}",
             f"  {'what':<12} {'images/s':>10} {'megapixels/s':>13}   ({report.get('megapixels_per_image', 0):.2f} MP "
             "per image)"]
    for name, rate in report["images_per_s"].items():
        naive = report.get("naive", {})
        first = f"   (first {naive['images']} images, batch 1, {naive['precision']})" if name == "naive" else ""
        mp = report.get("megapixels_per_s", {}).get(name)
        lines.append(f"  {name:<12} {rate:>10.1f} {'' if mp is None else f'{mp:.1f}':>13}{first}")
    if "gpudet_passes_images_per_s" in report:
        lines.append("  gpudet passes (images/s, the median above): " +
                     ", ".join(f"{rate:.1f}" for rate in report["gpudet_passes_images_per_s"]))
    lines += [f"  {name:<16} {value:.2f}x" for name, value in report["ratios"].items()]
    if "gpudet_setup_s" in report:
        setup = report["gpudet_setup_s"]
        lines.append(f"  gpudet setup, paid once per job: {setup['since_start']:.2f} s from the command to a ready "
                     f"detector ({setup['detector']:.2f} s building it), {setup['first_batch']:.2f} s for the first "
                     f"batch; {report['images']} images from the command: {report['job_wall_s']:.2f} s")
        lines.append(f"  detections per image written: {report['detections_per_image']:.2f}")
    stages = dict(report["gpudet_stages_s"])
    gpu = stages.pop("gpu_utilisation_percent")
    lines.append("  gpudet stages (s the loop waited): " + ", ".join(f"{k} {v:.2f}" for k, v in stages.items()) +
                 (f"; GPU busy {gpu:.0f}%" if gpu is not None else ""))
    lines += [f"  {name}: skipped, {why}" for name, why in report.get("skipped", {}).items()]
    if "latency_batch_1" in report:
        lat = report["latency_batch_1"]
        lines.append(f"  latency, batch 1: {lat['skipped']}" if "skipped" in lat else
                     f"  latency, batch 1, {lat['images']} images: p50 {lat['p50_ms']:.1f} ms, "
                     f"p99 {lat['p99_ms']:.1f} ms")
    m = report["machine"]
    lines.append(f"  on {m['cpu']} ({m['cores']} cores){', ' + ', '.join(m['gpus']) if m['gpus'] else ''}; "
                 f"torch {m['torch']}, onnxruntime {m['onnxruntime']}, dali {m['dali']}; {report['date']}")
    if "python_loop_ms" in m:
        lines.append(f"  host: a fixed piece of Python in {m['python_loop_ms']:.1f} ms on one core (before the runs)")
    code = report.get("gpudet") or {}
    if code:
        lines.append(f"  gpudet {code['version']} from {code['source']}" +
                     (f" at {code['commit']}" if code["commit"] else ""))
    return "\n".join(lines)


def report_json(report: dict) -> str:
    """The report as `gpudet bench --json` writes it."""
    return json.dumps(report, indent=2) + "\n"
