"""A cluster through Ray Data: the images as a dataset, an actor pool of detectors that write
their own results.

    ray.data.from_items([{index, path}, ...])           the images not yet recorded
      .map_batches(DetectActor, concurrency=N, ...)      each actor: one Detector whose pipeline
                                                         stays full across Ray's batches, writing
                                                         its records into out/shards/ray-<id>/
      -> the driver: one small row per image back (progress), then the shards merged into the
         output folder by image index, as --devices merges its workers', and removed once every
         image is recorded

The driver holds the images' paths, never their results. Ray may run a batch again after an
actor fails: the merge keeps each image once, and --resume reads the shards a killed run left.
Workers need gpudet installed (the same version) and the images at the same paths.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import os
import queue
import re
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np

from .config import Config
from .errors import ConfigError, GpudetError, catch_signals, one_line, signals_held, stderr_into_log
from .folder import OutputFolder
from .job import Outcome, RunOptions, record_stream
from .layout import SHARDS
from .results import ImageRef
from .source import FLUSH, batched
from .storage import OPTIONS_VARIABLE
from .timing import StageClock

log = logging.getLogger("gpudet")
SHARD_PREFIX = "ray-"
RAY_BATCH = 128
"""Detector batches per Ray batch: Ray's cost per batch (scheduling, the object store, the actor's
answer) is paid once per this many images (4,096 at batch 32, under a second of an H200's work),
while the actor's stream keeps its pipeline full across them (docs/BENCHMARKS.md, "--ray")."""


class DetectActor:
    """One per Ray actor: a Detector streaming every batch Ray hands this actor, in one long-lived
    stream on a thread of its own (DALI and the engine stay full across Ray's batches while Ray
    keeps several in flight: `__call__` is async). Records go to the actor's own shard of the
    output folder; Ray gets back one row per image: its index, whether it was processed, its
    detections, and when this actor took its first image (epoch seconds: the driver's rate starts
    there, not at the first row back, which comes only after a whole Ray batch)."""

    def __init__(self, config: Config, shards: str, output_format: str = "jsonl"):
        from .detector import Detector

        self.detector = Detector.from_config(config)
        self.shard = OutputFolder(Path(shards) / f"{SHARD_PREFIX}{uuid.uuid4().hex[:12]}",
                                  output_format=output_format, resume=True, shard=True)
        self.requests: queue.Queue = queue.Queue()
        self.failure: BaseException | None = None
        """Why the stream ended, if it did: every request from then on fails with it."""
        self.lock = threading.Lock()
        self.first_taken: float | None = None
        self.thread = threading.Thread(target=self._serve, name="gpudet-ray-stream", daemon=True)
        self.thread.start()

    async def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        refs = [ImageRef(int(i), str(p)) for i, p in zip(batch["index"], batch["path"], strict=True)]
        if not refs:
            return {"index": np.zeros(0, np.int64), "processed": np.zeros(0, bool), "detections": np.zeros(0, np.int64),
                    "first_taken": np.zeros(0)}
        self.first_taken = self.first_taken or time.time()
        done: Future = Future()
        with self.lock:  # a request is either queued before the stream ends (and failed by it) or refused
            if self.failure is not None:
                raise RuntimeError(f"this actor's detector stopped: {self.failure!r}") from self.failure
            self.requests.put((refs, done))
        rows = await asyncio.wrap_future(done)
        columns = {name: np.array(values) for name, values in zip(("index", "processed", "detections"), zip(*rows))}
        return {**columns, "first_taken": np.full(len(rows), self.first_taken)}

    def _serve(self) -> None:
        """The stream over every request's images, in arrival order, in the detector's batches,
        writing as batches finish and answering each request once all its images are recorded
        and written out (Ray may stop the actor as soon as the last request is answered)."""
        waiting: dict[int, tuple[Future, list]] = {}  # image index -> (its request's future, that request's rows)
        left: dict[int, int] = {}  # id(future) -> images of the request not yet recorded

        def batches():
            while True:
                try:
                    refs, done = self.requests.get(timeout=0.05)
                except queue.Empty:  # none waiting: every batch in the pipeline goes on to its request
                    yield FLUSH
                    continue
                rows: list = []
                left[id(done)] = len(refs)
                waiting.update((ref.index, (done, rows)) for ref in refs)
                yield from batched(refs, self.detector.batch_size)

        def recorded(index: int, processed: bool, detections: int) -> None:
            done, rows = waiting.pop(index)
            rows.append((index, processed, detections))
            left[id(done)] -= 1
            if not left[id(done)]:
                del left[id(done)]
                try:
                    self.shard.flush()
                except BaseException as e:  # out of `waiting` already: the stream's failure would not reach it
                    done.set_exception(e)
                    raise
                done.set_result(rows)

        def rows_recorded(rows) -> None:
            for row in rows:
                recorded(row.index, row.processed, row.detections)

        try:
            with self.shard.writing():
                record_stream(self.detector, batches(), self.shard, clock=StageClock(), on_rows=rows_recorded)
        except BaseException as e:  # the actor cannot go on: every request, waiting or queued, fails with the reason
            with self.lock:
                self.failure = e
            pending = [done for done, _ in waiting.values()]
            while not self.requests.empty():
                pending.append(self.requests.get_nowait()[1])
            for done in pending:  # Ray reports it as the batches' failure (the traceback is Ray's to show)
                if not done.done():
                    done.set_exception(e)


@dataclass
class OnRay:
    """The executor of `gpudet detect --ray [ADDRESS] --workers N` (job.Executor): an actor pool
    on a Ray cluster (a local one when no address is given). Its models are checked for the GPU
    and the CPU: an actor may land on either."""

    address: str | None
    workers: int
    devices: list[str]
    gpus_per_worker: float | None = None

    def __post_init__(self):
        if self.workers < 1:
            raise ConfigError(f"--workers {self.workers}: give at least 1 detector actor")
        try:
            with signals_held():
                import ray  # noqa: F401
        except ImportError:
            raise ConfigError("--ray needs Ray Data: pip install 'gpudet[ray]' (or 'ray[data]')") from None

    load = None  # the actors import what they need; Ray itself is imported above

    def run(self, folder: OutputFolder, todo: list[ImageRef], *, source: str, images: int, config: Config,
            options: RunOptions) -> Outcome:
        import ray

        started, show = time.perf_counter(), options.show_progress  # before Ray's messages are taken off stderr
        failure, streaming, gpus = None, 0.0, self.gpus_per_worker
        try:  # folder.started() once Ray runs: a Ray that does not start leaves the folder as it was
            streaming, gpus, failure = run_actors(ray, todo, config, folder.format, folder.path / SHARDS, self.address,
                                                  self.workers, gpus, show, started=folder.started)
        except KeyboardInterrupt:  # what the actors wrote stays in their shards; --resume goes on
            folder.tally.interrupted = True
        total = time.perf_counter() - started
        actors = f"{self.workers} actor" + ("" if self.workers == 1 else "s")
        return Outcome(device=f"ray ({actors})", setup_s=total - streaming if streaming else 0.0, counted=False,
                       failures=lambda: [f"the Ray job gave up: {failure}"] if failure else [],
                       extra=lambda: {"ray": self.address or "local", "actors": self.workers, "gpus_per_actor": gpus})


def run_actors(ray, todo: list[ImageRef], config: Config, output_format: str, shards: Path, address: str | None,
               workers: int, gpus: float | None, show: bool, started: Callable[[], None]
               ) -> tuple[float, float, str | None]:
    """Ray started (or reached), then `started()` (the actors write from here), the actors streamed
    over `todo`, Ray shut down if started here. Returns the stream's seconds, the GPUs per actor,
    and why Ray gave up (None if it did not)."""
    started_here = not ray.is_initialized()
    with stderr_into_log("ray", ray_level) as stderr:
        start_ray(ray, address, workers)
        try:
            started()
            if gpus is None:  # one GPU per actor where the cluster has GPUs and the config allows
                gpus = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 and config.run.device != "cpu" else 0.0
            try:
                return stream(ray, todo, config, output_format, shards, workers, gpus,
                              stderr if show else None), gpus, None
            except ray.exceptions.RayError as e:  # Ray gave up (an actor kept failing, the cluster went)
                return 0.0, gpus, one_line(e, 500)
        finally:
            if started_here:
                ray.shutdown()


class RayStartError(GpudetError):
    """Ray could not be started or reached."""


def ray_batch(batch_size: int, images: int, workers: int) -> int:
    """Images per Ray batch: RAY_BATCH detector batches, fewer where the job is small, so that
    every actor gets at least two."""
    share = -(-images // (2 * workers))  # ceil
    return min(batch_size * RAY_BATCH, max(batch_size, -(-share // batch_size) * batch_size))


def stream(ray, todo: list[ImageRef], config: Config, output_format: str, shards: Path, workers: int, gpus: float,
           progress: TextIO | None) -> float:
    """The actor pool over `todo`, waiting for every image's row (a progress bar counts them on
    `progress`, the terminal's stderr, where given).
    Returns the seconds from the first image an actor took to the last row back: the rate once
    the actors run (Ray's and the actors' start before it)."""
    from tqdm import tqdm

    dataset = ray.data.from_items([{"index": r.index, "path": r.path} for r in todo])
    detected = dataset.map_batches(DetectActor, fn_constructor_kwargs={"config": config, "shards": str(shards),
                                                                       "output_format": output_format},
                                   batch_size=ray_batch(config.run.batch_size, len(todo), workers),
                                   # Two calls at once per actor: the next Ray batch is queued on the
                                   # stream before the last one's images are all recorded, so the
                                   # pipeline never drains between them (Ray Data's default is one).
                                   **actor_pool(ray, workers, calls=2),
                                   num_gpus=gpus, num_cpus=1, batch_format="numpy")
    first, last = math.inf, None
    with tqdm(total=len(todo), unit="img", disable=progress is None, file=progress, dynamic_ncols=True) as bar:
        for rows in detected.iter_batches(batch_size=None, batch_format="numpy"):
            last = time.time()
            first = min(first, float(rows["first_taken"].min()))
            bar.update(len(rows["index"]))
    return max(0.0, last - first) if last is not None else 0.0  # the actors' clocks are their nodes'; one here


def actor_pool(ray, workers: int, calls: int) -> dict:
    """map_batches' arguments for `workers` actors taking `calls` calls at once each: the pool's
    own max_concurrent_calls_per_actor where this Ray has it (the actor's max_concurrency as a
    remote argument is deprecated from Ray 2.60), else that remote argument."""
    strategy = ray.data.ActorPoolStrategy
    if "max_concurrent_calls_per_actor" in inspect.signature(strategy).parameters:
        return {"compute": strategy(size=workers, max_concurrent_calls_per_actor=calls)}
    return {"compute": strategy(size=workers), "max_concurrency": calls}


RAY_NOTICES = re.compile(r"Token authentication is enabled for this Ray cluster|"
                         r"has constructor arguments in the object store and max_restarts > 0")
"""What Ray prints on every run about its own defaults, not about this job, logged at info: the
local cluster's token authentication, and Ray Data's actor pool keeping its actors' constructor
arguments in the object store (ray-project/ray#53727: should a restarted actor not get them, its
batches fail, and the job ends saying to run it again with --resume)."""


def ray_level(line: str) -> int:
    """The level a line Ray wrote to stderr is logged at by gpudet: Ray's info as debug, its warnings
    (advice about its own settings, which gpudet chose) as info, its errors and anything else as
    warnings. Python's lines carry "\tLEVEL ", the C++ core's "[date time L pid tid]"."""
    if RAY_NOTICES.search(line):
        return logging.INFO
    python = re.search(r"\t(DEBUG|INFO|WARNING|ERROR|CRITICAL) ", line)
    core = re.match(r"\[[^]]* ([DIWEF]) \d+ \d+\]", line)
    level = python.group(1)[0] if python else core.group(1) if core else "?"
    return {"D": logging.DEBUG, "I": logging.DEBUG, "W": logging.INFO}.get(level, logging.WARNING)


def start_ray(ray, address: str | None, workers: int) -> None:
    """ray.init, with Ctrl-C and SIGTERM left to gpudet (ray.init installs handlers of its own)."""
    try:
        carried = {name: os.environ[name] for name in (OPTIONS_VARIABLE,) if name in os.environ}
        ray.init(address=address, ignore_reinit_error=True, include_dashboard=False, log_to_driver=False,
                 configure_logging=False, **({} if address else {"num_cpus": max(4, 2 * workers)}),
                 **({"runtime_env": {"env_vars": carried}} if carried else {}))  # --storage-option for the actors
    except KeyboardInterrupt:
        raise
    except Exception as e:  # no cluster at the address, another Ray version, no room for a local one
        where = f"--ray {address}" if address else "--ray (a local cluster)"
        raise RayStartError(f"{where}: Ray did not start: {one_line(e)}; check the address, "
                            "that the cluster runs and has this Ray version, or run without an address for a "
                            "local one") from None
    ray.data.DataContext.get_current().enable_progress_bars = False  # gpudet shows its own
    catch_signals()
