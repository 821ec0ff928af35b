"""This process, one device: how `gpudet detect` runs without --devices or --ray, and what each
--devices worker runs on its share. A Detector (the data path) streams every image into the output
folder through job.record_stream; the job around it is job.run_job's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING

from . import storage
from .config import Config
from .errors import decoder_level, last_record_written, signals_held, stderr_into_log
from .folder import OutputFolder
from .job import Outcome, RunOptions, record_stream
from .results import ImageRef
from .source import batched, fetch_processes
from .timing import StageClock

if TYPE_CHECKING:
    from .detector import Detector


@dataclass
class InProcess:
    """The executor of a run in this process (job.Executor)."""

    devices: list[str]

    def load(self) -> None:
        detector_class()

    def run(self, folder: OutputFolder, todo: list[ImageRef], *, source: str, images: int, config: Config,
            options: RunOptions) -> Outcome:
        return detect_into(folder, todo, config, progress=options.show_progress)


def detector_class() -> type[Detector]:
    """The Detector, its libraries imported (torch, DALI, ONNX Runtime, Triton: seconds, the first
    time) with the stop signals held."""
    with signals_held():
        from .detector import Detector
    return Detector


def detect_into(folder: OutputFolder, todo: list[ImageRef], config: Config, *, progress: bool) -> Outcome:
    """Build the detector and run it over `todo`, writing into `folder` (an output folder, or a
    --devices worker's shard)."""
    from tqdm import tqdm

    build = detector_class().from_config
    t0 = time.perf_counter()  # this run's clock: the imports above count as the command's start
    with fetchers_started(todo, config):
        detector = build(config)
        setup_s = time.perf_counter() - t0
        clock = StageClock()
        # What libraries print meanwhile goes through the log; the decoders' complaints about a bad file
        # (lines that name no file; errors.jsonl names it) at debug, not onto stderr: a JPEG cut short
        # prints a line per row it misses.
        with stderr_into_log("library", decoder_level) as stderr, folder.writing(), \
                tqdm(total=len(todo), unit="img", disable=not progress, file=stderr, dynamic_ncols=True) as bar:
            try:
                record_stream(detector, batched(todo, detector.batch_size), folder, clock=clock,
                              on_rows=lambda rows: bar.update(len(rows)))
            except KeyboardInterrupt:  # Ctrl-C, SIGTERM or SIGHUP: what was written stays; --resume continues
                folder.tally.interrupted = True
            last_record_written()  # closing the files and the summary go on whatever comes
    model_batch = detector.engine.run_batch or detector.batch_size
    return Outcome(device=detector.device.describe(), setup_s=setup_s, clock_start=t0, stages=dict(clock.seconds),
                   model=detector.describe(), extra=lambda: {"model_batch": model_batch})


@contextmanager
def fetchers_started(todo: list[ImageRef], config: Config) -> Iterator[None]:
    """A block that builds the detector and runs it over `todo`: where `todo` holds a URL (within
    its first FIRST_URL_WITHIN), the processes that fetch the objects (run.storage_processes)
    start as the block does, each making that URL's clients while the detector is built, and the
    reader takes them at its first batch (fetching.started); those it did not take are let go at
    the block's end."""
    url = next((ref.path for ref in islice(todo, FIRST_URL_WITHIN) if storage.is_url(ref.path)), None)
    run = config.run
    if url is None or not run.storage_processes:
        yield
        return
    from . import fetching

    fetching.start_early(fetch_processes(run.storage_processes, run.storage_requests, run.batch_size), url)
    try:
        yield
    finally:
        fetching.drop_early()


FIRST_URL_WITHIN = 10_000
"""How far into a run's images fetchers_started looks for a URL (a list of local files is not
walked whole)."""
