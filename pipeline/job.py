"""One run of `gpudet detect`, the job around the loop, written once for every way images reach
detectors:

    run_job(source, config, options, executor)
      the output folder opened and held       folder.OutputFolder (its lock)
      the source listed                       listing.list_images (a URL source's by a process
                                              of its own while the executor loads its
                                              libraries: Executor.load)
      what is left to do                      OutputFolder.begin (--resume, --overwrite)
      the model checked                       check_model: before anything in --out changes
      the executor run over it                how images reach detectors: this process
                                              (runner.py), a worker per device (parallel.py),
                                              a Ray actor pool (distributed.py)
      interrupted (Ctrl-C, SIGTERM, SIGHUP)   what was written stays, for --resume
      the shards merged, then dropped         OutputFolder.merge, drop_shards
      summary.json and the exit code          one shape, one rule (`finish`)

`record_stream` is the one loop from the data path's batches to records, which this process's
runs, `gpudet bench` and each Ray actor use.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from . import storage
from .config import Config, resolve_model_path
from .errors import EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_USAGE, last_record_written
from .folder import OutputFolder, RunResult
from .results import ImageRef
from .sinks import Row
from .listing import ListedApart, list_images
from .timing import StageClock, process_seconds

if TYPE_CHECKING:
    from .detector import Detector


@dataclass(frozen=True)
class RunOptions:
    """How one `gpudet detect` treats its output folder and its source."""

    out: str | Path
    root: str | None = None
    """The folder a file list's relative paths resolve against (default: the list's)."""
    output_format: str = "jsonl"
    resume: bool = False
    overwrite: bool = False
    retry_failed: bool = False
    progress: bool | None = None
    """A progress bar on stderr; None: where stderr is a terminal."""

    @property
    def show_progress(self) -> bool:
        return sys.stderr.isatty() if self.progress is None else self.progress


@dataclass
class Outcome:
    """What an executor reports of its run over the images left to do."""

    device: str
    setup_s: float = 0.0
    """From the run's clock start until images flowed (building detectors, starting workers)."""
    clock_start: float | None = None
    """perf_counter() where this run's clock starts, when the executor imported what its detector
    needs first (torch, DALI): those imports count as the command's start, as they do for any
    command that builds a detector. None: when run_job began."""
    stages: dict[str, float] = field(default_factory=dict)
    """Seconds the loop waited on each stage (one process)."""
    model: dict | None = None
    """What summary.json says of the model, where the executor knows better than the check
    (the providers a detector runs on)."""
    counted: bool = True
    """The folder's tally counted this run's records as they were written; False: they are in
    the shards, and the merge counts them."""
    on_merged: Callable[[Row], None] | None = None
    """Sees each record of this run that the merge keeps (per-worker counts)."""
    failures: Callable[[], list[str]] = list
    """What stopped images from being recorded (a worker, the cluster): exit 1, --resume goes on.
    Asked after the merge, as `extra` is."""
    extra: Callable[[], dict[str, Any]] = dict
    """The executor's own fields of summary.json, built after the merge."""
    stopped_on_usage: Callable[[], bool] = lambda: False
    """A worker stopped on an error it said itself, exit 2 (the store refused the credentials, a
    shard it may not write): the run exits 2, as one process would, and --resume goes on."""


class Executor(Protocol):
    """How images reach detectors. `devices`: where its detectors run ("cpu", "cuda:N", "auto"),
    whose models check_model reads."""

    devices: list[str]
    load: Callable[[], None] | None
    """What its run needs in this process, imported with the stop signals held (this process's
    detector: torch, DALI, ONNX Runtime): run_job calls it while a URL source is listed. None where
    its workers import what they need (--devices, --ray)."""

    def run(self, folder: OutputFolder, todo: list[ImageRef], *, source: str, images: int, config: Config,
            options: RunOptions) -> Outcome:
        """Record every image of `todo` into `folder` (its records, or its shards), calling
        folder.started() before anything is written. A Ctrl-C once that has begun sets
        folder.tally.interrupted and returns what was done."""


def run_job(source: str, config: Config, options: RunOptions, executor: Executor) -> RunResult:
    """`gpudet detect SOURCE --out ...`: the run, whichever executor carries it."""
    started_at = datetime.now(timezone.utc)
    startup_s, t0 = process_seconds(), time.perf_counter()  # the command's start and imports, before this clock
    with OutputFolder(options.out, output_format=options.output_format, resume=options.resume,
                      overwrite=options.overwrite, retry_failed=options.retry_failed) as folder:
        not_images: list[Path] = []
        refs = listed(source, options.root, not_images, executor)
        todo = folder.begin(refs, config.result_settings())
        outcome, model = Outcome(device=config.run.device), None
        if todo:
            model = check_model(config, executor.devices)
            outcome = executor.run(folder, todo, source=str(source), images=len(refs), config=config,
                                   options=options)
        folder.started()  # a run with nothing to do changes the folder here (its summary)
        last_record_written()  # from here an interrupt is noted: the merge and the summary go on
        return finish(folder, todo, outcome, source=str(source), images=len(refs), config=config,
                      model=outcome.model or model, started_at=started_at, startup_s=startup_s, t0=t0,
                      not_images=len(not_images))


def listed(source: str, root: str | None, skipped: list[Path], executor: Executor) -> list[ImageRef]:
    """The images of `source` (list_images). A URL source is listed by a process of its own while
    the executor loads what its run needs here (Executor.load): the store's pages and those
    imports, each seconds, do not wait on each other, nor on this interpreter's lock (the imports
    are made even where the listing then fails or leaves nothing to do). Where the executor loads
    nothing here, it is listed here: a process would only add its start and the copy of the list."""
    # (--root with a URL: list_images says why not)
    if not storage.is_url(str(source)) or root is not None or executor.load is None:
        return list_images(source, root=root, skipped=skipped)
    apart = ListedApart(str(source))  # closes what it opened where its start is interrupted
    try:
        executor.load()
        return apart.refs()
    finally:
        apart.close()


def finish(folder: OutputFolder, todo: list[ImageRef], outcome: Outcome, *, source: str, images: int,
           config: Config, model: dict | None, started_at: datetime, startup_s: float, t0: float,
           not_images: int = 0) -> RunResult:
    """The records of the shards merged into the folder's files (each image once), the shards
    dropped once every image is recorded, summary.json written, and the one exit-code rule:
    130 interrupted, 1 images not recorded (a worker or the cluster failed: --resume goes on),
    3 some images failed (in this run or before), else 0."""
    tally = folder.tally
    if outcome.clock_start is not None:
        startup_s += outcome.clock_start - t0
        t0 = outcome.clock_start
    if folder.shards:
        owned = {r.index for r in todo}

        def count(row: Row) -> None:
            if not outcome.counted and row.index in owned:  # else counted as written, or recorded before
                tally.count(row)
                if outcome.on_merged is not None:
                    outcome.on_merged(row)

        folder.merge(count)
    unrecorded = 0 if tally.interrupted else len(todo) - tally.processed - tally.failed
    failures, extra = outcome.failures(), outcome.extra()  # before the shards (their summaries) go
    usage = outcome.stopped_on_usage() and not tally.interrupted
    failed = bool(failures or unrecorded) and not tally.interrupted
    if not tally.interrupted and not failed:  # every image recorded: nothing writes to the shards any more
        folder.drop_shards()
    total_s = time.perf_counter() - t0
    loop_s = max(0.0, total_s - outcome.setup_s) if todo else 0.0
    seconds = {"wall": process_seconds(), "startup": startup_s, "total": total_s, "setup": outcome.setup_s,
               "loop": loop_s, **outcome.stages}
    summary = folder.write_summary(source=source, images=images, todo=len(todo), device=outcome.device,
                                   seconds=seconds, loop_seconds=loop_s, started=started_at, model=model,
                                   config=config.to_dict(),
                                   extra={**extra, "not_recorded": unrecorded, "failures": failures,
                                          "skipped_not_images": not_images})
    code = EXIT_INTERRUPTED if tally.interrupted else EXIT_USAGE if usage else EXIT_INTERNAL if failed \
        else tally.exit_code
    return RunResult(summary, code)


def check_model(config: Config, devices: list[str]) -> dict:
    """The models the executor's detectors will load (model.path on a GPU, model.cpu_path on the
    CPU where set, both for "auto"), read before the output folder changes: a file that is not
    there, is no ONNX model, has no image input or fits no contract is one line here, not a
    failure of every worker. Returns what summary.json says of the one a GPU (else the CPU) loads."""
    from .contracts import recognise, renamed
    from .session import declared, find_image_input

    on_cpu = sorted({False if d.startswith("cuda") else True for d in devices} |
                    ({False} if "auto" in devices else set()))
    records = {}
    for cpu in on_cpu:
        path = resolve_model_path(config, on_cpu=cpu)
        model = renamed(declared(path), config.model.outputs)
        find_image_input(model.inputs, path)
        records[cpu] = model.record(recognise(model.outputs, config.model.contract, path, model.metadata).name)
    return records[min(records)]  # False (a GPU's) sorts first


def record_stream(detector: Detector, batches: Iterable[list], folder: OutputFolder, *, clock: StageClock,
                  on_rows: Callable[[list[Row]], None] = lambda rows: None) -> None:
    """The data path's batches written as records into `folder` (inside its `writing()`): each
    processed image's record, each failed image's error, every record written out at the end.
    `on_rows` sees what each write counted (progress, a request's answer)."""
    def failed(errors) -> None:
        on_rows(folder.fail(errors))

    for batch, found in detector.stream_batches(batches, failed, clock=clock):  # the data path
        with clock("write"):  # sinks: one record per image
            rows = folder.record(batch, found, detector.labels)
        on_rows(rows)
    with clock("write"):  # the rows a writer holds (Parquet's, until its next file)
        folder.flush()
