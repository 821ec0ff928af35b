"""Several devices of one host: one worker process per device, each with its own DALI pipeline
and ORT session on its share of the images, merged into the usual output files.

    out/.gpudet-shards/K/detections.*, errors.jsonl, summary.json   what worker K wrote (append-only)
    out/detections.*, errors.jsonl                  the merge: every input exactly once
    out/summary.json                                totals and one entry per worker

The shards are removed once merged, when every image of the run is recorded; a run interrupted, or
with a worker that failed, keeps them for --resume.

The job (job.run_job) lists the images and takes out those already recorded; this executor deals
the rest round-robin to the workers (`todo[k::n]`, so every input goes to exactly one), starts
them (spawn: CUDA cannot be forked), and shows one progress bar from the shard files until all
have stopped; the job merges them. A worker that dies (a signal: killed, or aborted by a CUDA
fault) is started again on its images not yet recorded (run.worker_restarts). A worker that
fails otherwise is reported with its device and exit code; what it wrote is merged and a
--resume picks up the rest. The summary's counts are read from the merged records, so a process
that died is counted too. Ctrl-C or SIGTERM to the parent stops the workers (each ends its
batch), and what they wrote is merged (exit 130). Workers die with the parent, even after
kill -9, and hold the output folder's lock with it.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import multiprocessing.context
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any

from .config import Config
from .errors import EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_OK, EXIT_SOME_FAILED, EXIT_USAGE, STOP_SIGNALS, DeviceError, \
    DroppingWrites, OutputError, die_with, ensure_standard_streams, guarded, logging_settings, setup_logging, \
    signals_held
from .folder import OutputFolder, Tally, recorded, result_paths
from .job import Outcome, RunOptions
from .layout import SHARDS
from .results import ImageRef
from .formats import RecordFormat
from .sinks import Row, lines_in
from .timing import process_seconds

log = logging.getLogger("gpudet")


def parse_devices(text: str) -> list[str]:
    """'0,1' -> cuda:0, cuda:1; 'all' -> every visible GPU; 'cpu,cpu' -> two CPU workers."""
    if text == "all":
        import torch

        count = torch.cuda.device_count()
        if count == 0:
            raise DeviceError("--devices all: no CUDA GPU is visible; use --device cpu or --devices cpu,cpu")
        return [f"cuda:{i}" for i in range(count)]
    devices = []
    for item in text.split(","):
        item = item.strip()
        if re.fullmatch(r"\d+", item):
            item = f"cuda:{item}"
        if not re.fullmatch(r"cpu|cuda:\d+", item):
            raise DeviceError(f"--devices {text}: {item!r} is not a GPU index, cuda:N or cpu")
        devices.append(item)
    if len(devices) < 1:
        raise DeviceError(f"--devices {text}: no device")
    from .device import cuda_problem

    for item in devices:  # before any worker starts: a worker that cannot run would only fail later
        problem = cuda_problem(int(item.split(":")[1])) if item != "cpu" else None
        if problem:
            raise DeviceError(f"--devices {text}: {problem}; use --devices cpu,cpu to run on the CPU")
    return devices


class InheritedFd:
    """A file descriptor that a spawned process inherits: the same open file, so that an flock on
    it (the output folder's lock) is held until the parent and every such process have ended."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        popen = multiprocessing.context.get_spawning_popen()
        if popen is None:
            raise TypeError("InheritedFd travels only to a process being spawned")
        return InheritedFd, (popen.duplicate_for_child(self.fd),)



def _worker(todo: list[ImageRef], shard: str, config: Config, output_format: str, source: str, images: int,
            logging_setup: tuple[str, bool], parent: int, lock: InheritedFd) -> None:
    """One worker process: the single-device run over its share, appended to its shard, with the
    shard's own summary; exit code as `gpudet detect`'s. It logs as the parent does; it stops on
    SIGTERM, which the parent sends when it is stopped (a terminal's Ctrl-C or hangup, which
    reaches every process of the group, is left to the parent, so that a worker is asked once),
    and dies with its parent (`die_with`). It holds the output folder's lock with the parent (`lock`)."""
    die_with(parent)
    ensure_standard_streams()
    setup_logging(*logging_setup)

    def run() -> int:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        # The stop signals stay held, as the parent held them when it started this process, while
        # session.start_early starts the engine's thread (which opens the model's session and makes
        # its first run on the GPU, and so never takes them); detect_into holds them again while
        # torch, DALI and Triton load beside that work.
        from .session import started_early

        with started_early(config):
            from .job import finish
            from .runner import detect_into

            started_at, startup_s, t0 = datetime.now(timezone.utc), process_seconds(), time.perf_counter()
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
            # Parquet rows written every 2 s: the parent's progress bar reads the shard's files, and
            # restarts a worker that died only if it had recorded images.
            with OutputFolder(shard, output_format=output_format, resume=True, flush_s=2.0, shard=True) as folder:
                outcome = detect_into(folder, todo, config, progress=False)
                return finish(folder, todo, outcome, source=source, images=images, config=config, model=None,
                              started_at=started_at, startup_s=startup_s, t0=t0).exit_code

    def quiet_when_stopped() -> int:
        try:
            return run()
        except KeyboardInterrupt:  # stopped by the parent during setup: the parent says so, once
            return EXIT_INTERRUPTED

    sys.exit(guarded(quiet_when_stopped))


@dataclass
class Worker:
    """One device's worker: its share of the images, and the processes that ran it (one, and one
    more per restart)."""

    device: str
    shard: Path
    share: list[ImageRef]
    restarts_left: int
    process: Any = None
    left: int = 0
    """Images of the share not yet recorded when the current process started."""
    exit_codes: list[int] = field(default_factory=list)
    ended: bool = False
    tally: Tally = field(default_factory=Tally)
    """What the merge found of its share."""


@dataclass
class OnDevices:
    """The executor of `gpudet detect --devices` (job.Executor): one worker process per device."""

    devices: list[str]

    load = None  # the workers import what they need

    def run(self, folder: OutputFolder, todo: list[ImageRef], *, source: str, images: int, config: Config,
            options: RunOptions) -> Outcome:
        """The workers started on their shares of `todo`, each into its shard, restarted where they
        die, waited for; Ctrl-C or SIGTERM stops them (each ends its batch). The merge (job.finish)
        counts what each recorded."""
        started = time.perf_counter()
        shards = [folder.path / SHARDS / str(k) for k in range(len(self.devices))]
        for path in (folder.path / SHARDS, *shards):  # before the folder changes: gpudet's folders, or none yet
            if os.path.lexists(path) and (path.is_symlink() or not path.is_dir()):
                what = "a symbolic link" if path.is_symlink() else "a file"
                raise OutputError(f"{path} is not a shard folder gpudet made ({what}); gpudet never writes through "
                                  "or over it: move it, or write into another --out")
        folder.started()  # the workers write into its shards from here
        context = multiprocessing.get_context("spawn")

        def start(worker: Worker, share: list[ImageRef]) -> None:
            (worker.shard / "summary.json").unlink(missing_ok=True)  # each process writes its own
            worker_config = replace(config, run=replace(config.run, device=worker.device))
            worker.process = context.Process(target=_worker, name=f"gpudet-worker{worker.shard.name}-{worker.device}",
                                             args=(share, str(worker.shard), worker_config, folder.format, source,
                                                   images, logging_settings(), os.getpid(),
                                                   InheritedFd(folder.lock_fd)))
            worker.left = len(share)
            # The worker inherits the stop signals blocked (they would break its imports of torch,
            # DALI and ORT) and unblocks them once its handlers are in place; one sent meanwhile
            # waits. The resource tracker is started first: starting, it unblocks them in this thread.
            resource_tracker.ensure_running()
            with signals_held():
                worker.process.start()

        def restarted(worker: Worker) -> bool:
            """After its process ended: start it again on the share's unrecorded images, if it died
            (killed by a signal) having recorded some, restarts left (run.worker_restarts)."""
            code = worker.process.exitcode
            worker.exit_codes.append(code)
            if code >= 0 or worker.restarts_left == 0:
                return False
            # Reading the shard cuts a torn last line (a kill mid-write) off, so the next run appends whole lines.
            done = set().union(*recorded(result_paths(worker.shard, folder.kind), todo, folder.kind))
            left = [r for r in worker.share if r.index not in done]
            if not left or len(left) == worker.left:
                return False
            worker.restarts_left -= 1
            log.warning("worker %s on %s died (exit code %d) after recording %d of its images; starting it again on "
                        "the %d left (run.worker_restarts: %d more)", worker.shard.name, worker.device, code,
                        worker.left - len(left), len(left), worker.restarts_left)
            start(worker, left)
            return True

        n = len(self.devices)
        workers = [Worker(device, shards[k], todo[k::n], config.run.worker_restarts)
                   for k, device in enumerate(self.devices) if todo[k::n]]
        first_record = None
        try:
            for worker in workers:
                start(worker, worker.share)
            files = [path for w in workers for path in result_paths(w.shard, folder.kind)]
            first_record = _wait_with_progress(workers, files, len(todo), options.show_progress, restarted,
                                               folder.kind)
        except KeyboardInterrupt:  # Ctrl-C, SIGTERM or SIGHUP: each worker ends its batch; what they wrote is merged
            workers = [w for w in workers if w.process is not None]
            _stop(workers)
            folder.tally.interrupted = True
        folder.tally.interrupted |= any(w.exit_codes[-1] == EXIT_INTERRUPTED for w in workers)
        owner = {r.index: w for w in workers for r in w.share}

        def on_merged(row: Row) -> None:
            owner[row.index].tally.count(row)

        return Outcome(device=", ".join(self.devices), setup_s=(first_record or time.perf_counter()) - started,
                       counted=False, on_merged=on_merged, failures=lambda: _failures(workers),
                       stopped_on_usage=lambda: any(w.exit_codes[-1] == EXIT_USAGE for w in workers),
                       extra=lambda: {"devices": self.devices, "workers": [_report(w) for w in workers],
                                      "restarts": sum(len(w.exit_codes) - 1 for w in workers),
                                      "failed_workers": _failures(workers)})


def _wait_with_progress(workers: list[Worker], files: list[Path], total: int, show: bool,
                        restarted: Callable[[Worker], bool], kind: RecordFormat) -> float | None:
    """Until every worker has ended (restarted where it died), a bar of the records in `files`,
    the workers' result files. Returns when the first record appeared (perf_counter), if one did."""
    from tqdm import tqdm

    def records() -> int:
        return sum(kind.count(f) if f.name == kind.file else lines_in(f) for f in files)

    baseline, first = records(), None

    def running() -> bool:
        for w in workers:
            if not w.ended and not w.process.is_alive():
                w.process.join()
                w.ended = not restarted(w)
        return any(not w.ended for w in workers)

    with tqdm(total=total, unit="img", disable=not show, file=DroppingWrites(sys.stderr), dynamic_ncols=True) as bar:
        while True:
            more = running()
            bar.n = records() - baseline
            if bar.n and first is None:
                first = time.perf_counter()
            bar.refresh()
            if not more:
                return first
            time.sleep(0.5)


STOP_TIMEOUT_S = 60.0
"""How long a stopped worker may take to end its batch and write its summary before it is killed."""


def _stop(workers: list[Worker]) -> None:
    """Ask every running worker to stop (SIGTERM: it ends its batch, writes its summary, exits
    130), wait for them, and kill one that does not end within STOP_TIMEOUT_S. Further interrupts
    meanwhile are not let through: the workers are already stopping."""
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in STOP_SIGNALS}
    try:
        running = [w for w in workers if not w.ended and w.process.is_alive()]
        for w in running:
            w.process.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for w in running:
            w.process.join(max(0.0, deadline - time.monotonic()))
            if w.process.is_alive():
                log.warning("worker %s on %s did not stop within %.0f s; killing it (what it wrote is kept)",
                            w.shard.name, w.device, STOP_TIMEOUT_S)
                w.process.kill()
                w.process.join()
        for w in workers:
            if not w.ended:
                w.process.join()
                w.exit_codes.append(w.process.exitcode)
                w.ended = True
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _report(worker: Worker) -> dict:
    """A worker's entry in summary.json: what the merge counted of its share, its exit codes, and
    the rate its last process's summary gives."""
    summary_path = worker.shard / "summary.json"  # its last process's, if that one finished
    s = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    t = worker.tally
    return {"worker": int(worker.shard.name), "device": worker.device, "exit_code": worker.exit_codes[-1],
            "exit_codes": worker.exit_codes, "processed": t.processed, "failed": t.failed, "detections": t.detections,
            "images_per_s": s.get("images_per_s")}


def _failures(workers: list[Worker]) -> list[str]:
    """The workers that stopped on an error of gpudet's (exit 1, 2; after a worker's exit 2, an
    error it said itself, the run exits 2: Outcome.stopped_on_usage), or died with images of their
    share not recorded (3: some images failed; 130: interrupted; killed after recording its whole
    share, nothing is missing)."""
    failures = []
    for worker in workers:
        code, t = worker.exit_codes[-1], worker.tally
        unrecorded = len(worker.share) - t.processed - t.failed
        if code not in (EXIT_OK, EXIT_SOME_FAILED, EXIT_INTERRUPTED) and (code in (EXIT_INTERNAL, EXIT_USAGE)
                                                                           or unrecorded):
            failures.append(f"worker {worker.shard.name} on {worker.device} exited with code {code}"
                            + (f", {unrecorded} of its images not recorded" if unrecorded else ""))
    return failures
