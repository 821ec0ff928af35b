"""A cluster through Ray Data: the image list as a dataset, an actor pool of detectors.

    ray.data.from_items([{index, path}, ...])                 the images not yet recorded
      .map_batches(DetectActor, concurrency=N, num_gpus=1)    each actor: one Detector (DALI + ORT)
      -> the driver streams each returned record into detections.jsonl / errors.jsonl

Records come back to the driver (a few hundred bytes an image) and are written there, so the
output files, --resume and "each image exactly once" work as for one process: the driver drops a
record whose index it has already written (Ray may rerun a batch after an actor fails).
Workers need gpudet installed (the same version) and the images at the same paths.
"""

from __future__ import annotations

import json
import logging
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from .config import Config
from .errors import ConfigError
from .results import ImageError, ImageRef, detection_records
from .sinks import OutputFolder, RunResult
from .source import list_images


class DetectActor:
    """One Detector per Ray actor; a call takes a batch of {index, path} and returns JSON records."""

    def __init__(self, config: Config):
        from .detector import Detector

        self.detector = Detector.from_config(config)
        self.labels = config.model.labels

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        refs = [ImageRef(int(i), str(p)) for i, p in zip(batch["index"], batch["path"], strict=True)]
        kinds, records, errors = [], [], []
        for preprocessed, found in self.detector.stream(refs, errors.extend):
            for record in detection_records(preprocessed.refs, preprocessed.orig_hw, found, self.labels):
                kinds.append("detection")
                records.append(json.dumps(record, ensure_ascii=False))
        for error in errors:
            kinds.append("error")
            records.append(json.dumps(error.to_record(), ensure_ascii=False))
        return {"kind": np.array(kinds, dtype=object), "record": np.array(records, dtype=object)}


def run_on_ray(source: str, out_dir: str | Path, config: Config, *, address: str | None = None, workers: int = 2,
               gpus_per_worker: float | None = None, root: str | None = None, progress: bool | None = None,
               resume: bool = False, overwrite: bool = False) -> RunResult:
    """`gpudet detect --ray [ADDRESS] --workers N`: an actor pool on a Ray cluster (a local one
    when no address is given)."""
    try:
        import ray
    except ImportError:
        raise ConfigError("--ray needs Ray Data: pip install 'gpudet[ray]' (or 'ray[data]')") from None
    with OutputFolder(out_dir, resume=resume, overwrite=overwrite) as folder:
        return _run_on_ray(ray, folder, source, config, address=address, workers=workers,
                           gpus_per_worker=gpus_per_worker, root=root, progress=progress)


def _run_on_ray(ray, folder: OutputFolder, source: str, config: Config, *, address: str | None, workers: int,
                gpus_per_worker: float | None, root: str | None, progress: bool | None) -> RunResult:
    started_at, started = datetime.now(timezone.utc), time.perf_counter()
    refs = list_images(source, root=root)
    todo = folder.begin(refs)
    started_here = not ray.is_initialized()
    ray.init(address=address, ignore_reinit_error=True, include_dashboard=False, log_to_driver=False,
             logging_level=logging.WARNING, **({} if address else {"num_cpus": max(4, 2 * workers)}))
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # gpudet shows its own
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    if gpus_per_worker is None:  # one GPU per actor where the cluster has GPUs and the config allows
        has_gpus = ray.cluster_resources().get("GPU", 0) > 0
        gpus_per_worker = 1.0 if has_gpus and config.run.device != "cpu" else 0.0
    dataset = ray.data.from_items([{"index": r.index, "path": r.path} for r in todo])
    detected = dataset.map_batches(DetectActor, fn_constructor_kwargs={"config": config},
                                   batch_size=config.run.batch_size, compute=ray.data.ActorPoolStrategy(size=workers),
                                   num_gpus=gpus_per_worker, num_cpus=1, batch_format="numpy")
    seen: set[int] = set()
    from tqdm import tqdm

    with folder.writing(), tqdm(total=len(todo), unit="img", disable=not progress, dynamic_ncols=True) as bar:
        for batch in detected.iter_batches(batch_size=None, batch_format="numpy"):
            rows = [(kind, json.loads(text)) for kind, text in zip(batch["kind"], batch["record"], strict=True)]
            fresh = [(kind, r) for kind, r in rows if r["index"] not in seen]
            seen.update(r["index"] for _, r in fresh)
            folder.record([r for kind, r in fresh if kind == "detection"])
            folder.fail([ImageError(**r) for kind, r in fresh if kind == "error"])
            bar.update(len(fresh))
    if started_here:
        ray.shutdown()
    elapsed = time.perf_counter() - started
    summary = folder.write_summary(
        source=str(source), images=len(refs), todo=len(todo), device=f"ray ({workers} actors)",
        seconds={"total": elapsed}, loop_seconds=elapsed, started=started_at, config=config.to_dict(),
        extra={"ray": address or "local", "actors": workers, "gpus_per_actor": gpus_per_worker})
    missing = len(todo) - len(seen)
    if missing:
        raise RuntimeError(f"Ray returned no record for {missing} images; run again with --resume")
    return RunResult(summary, folder.tally.exit_code)
