"""How fast gpudet's source reads and checks files, on threads or in worker processes, alone and
beside a thread that keeps the interpreter busy (as the pipeline's main loop does with DALI's
feeding and the JSON encoding).

A thread that reads a file gives up the interpreter for each open and read, and then waits to
take it back: up to Python's switch interval (5 ms) while another thread is running Python.
Worker processes (`run.read_processes`) read outside this interpreter: started for the pass, or
already started and kept from an earlier list, as a Detector keeps them ("kept": the first batch
then shows no start-up). Every image of SOURCE is read --rounds times in one pass per setting,
after one warm pass (the page cache). Usage:
    python scripts/probe_read.py SOURCE [--threads 4] [--processes 1 2] [--batch-size 32]
        [--rounds 2] [--switch-ms 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from contextlib import ExitStack, nullcontext

from pipeline.source import ImageRef, ProcessReaders, list_images, read_batches

# A record as the RetinaFace configs write it: three faces with landmarks.
RECORD = {"index": 1, "path": "/data/images/000001.jpg", "width": 1024, "height": 768, "detections": [
    {"box": [101.25, 202.5, 303.75, 404.0], "score": 0.99871, "label": 0, "name": "face",
     "landmarks": [120.5, 250.25, 180.75, 251.0, 150.5, 300.25, 125.0, 340.5, 175.25, 341.0]}] * 3}


class BusyInterpreter:
    """A thread that encodes JSON records until stopped: Python bytecode, never a blocking call."""

    def __init__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            json.dumps(RECORD)

    def __enter__(self) -> BusyInterpreter:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def images_per_s(refs, *, batch_size: int, threads: int, processes: int,
                 readers: ProcessReaders | None = None) -> tuple[float, float]:
    """(images read and checked per second after the first batch, seconds to the first batch:
    the worker processes' start-up, unless `readers` were started before)."""
    start = time.perf_counter()
    first = None
    count = 0
    for batch in read_batches(refs, batch_size=batch_size, num_threads=threads, processes=processes,
                              readers=readers):
        if first is None:
            first = time.perf_counter()
        else:
            count += len(batch)
    return count / (time.perf_counter() - first), first - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source")
    parser.add_argument("--threads", type=int, default=4, help="reading threads (run.num_threads)")
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2], help="worker process counts to try")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--switch-ms", type=float, default=None, help="sys.setswitchinterval, in ms")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.switch_ms:
        sys.setswitchinterval(args.switch_ms / 1000)
    listed = list_images(args.source)
    refs = [ImageRef(k, listed[k % len(listed)].path) for k in range(len(listed) * args.rounds)]
    images_per_s(listed, batch_size=args.batch_size, threads=args.threads, processes=0)  # the page cache
    settings = [(f"{args.threads} threads", 0, False)] + \
        [(f"{n} processes{kept}", n, bool(kept)) for n in args.processes for kept in ("", ", kept")]
    rows = []
    for name, processes, kept in settings:
        for busy in (False, True):
            with ExitStack() as stack:
                readers = stack.enter_context(ProcessReaders(processes)) if kept else None
                if readers:  # started, and one list served, before the timed pass
                    images_per_s(listed[:args.batch_size], batch_size=args.batch_size, threads=1, processes=0,
                                 readers=readers)
                stack.enter_context(BusyInterpreter() if busy else nullcontext())
                rate, startup = images_per_s(refs, batch_size=args.batch_size, threads=args.threads,
                                             processes=processes, readers=readers)
            rows.append({"reader": name, "busy_thread": busy, "images_per_s": round(rate, 1),
                         "first_batch_s": round(startup, 3)})
            print(f"{name:>18}  {'beside a busy thread' if busy else 'alone':>20}  {rate:10,.0f} img/s"
                  f"  (first batch after {startup * 1000:,.0f} ms)", flush=True)
    report = {"images": len(refs), "files": len(listed), "rounds": args.rounds, "batch_size": args.batch_size,
              "switch_interval_ms": sys.getswitchinterval() * 1000, "rows": rows,
              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": " ".join(sys.argv)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
