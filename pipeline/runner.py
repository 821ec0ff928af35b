"""This process, one device: how `gpudet detect` runs without --devices or --ray, and what each
--devices worker runs on its share. A Detector (the data path) streams every image into the output
folder through job.record_stream; the job around it is job.run_job's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .config import Config
from .errors import decoder_level, last_record_written, signals_held, stderr_into_log
from .folder import OutputFolder
from .job import Outcome, RunOptions, record_stream
from .results import ImageRef
from .source import batched
from .timing import StageClock


@dataclass
class InProcess:
    """The executor of a run in this process (job.Executor)."""

    devices: list[str]

    def run(self, folder: OutputFolder, todo: list[ImageRef], *, source: str, images: int, config: Config,
            options: RunOptions) -> Outcome:
        return detect_into(folder, todo, config, progress=options.show_progress)


def detect_into(folder: OutputFolder, todo: list[ImageRef], config: Config, *, progress: bool) -> Outcome:
    """Build the detector and run it over `todo`, writing into `folder` (an output folder, or a
    --devices worker's shard)."""
    from tqdm import tqdm

    with signals_held():  # torch, DALI and Triton: imported by the runs that build a detector
        from .detector import Detector

    t0 = time.perf_counter()  # this run's clock: the imports above count as the command's start
    detector = Detector.from_config(config)
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
