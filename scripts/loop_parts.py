"""Where gpudet's loop loses against DALI alone: the same images through the loop's parts, one
added at a time, side by side in one process.

    dali          DALI alone on the files' bytes in memory, as `gpudet bench` measures it
    dali+model    and the model on each batch, on the engine's thread (no postprocess)
    dali|model    DALI alone while the engine's thread runs the model back to back on one batch:
                  what the two cost each other on the GPU (the model's rate beside it is kept too)
    stream_bytes  Detector.stream over the bytes: the whole data path, detections to the host
    stream_files  the same over the files (the source's reading threads)
    records       gpudet bench's loop: the files, records written into an output folder

Each part runs once to warm up, then --repeats times; the report keeps every rate. --py-spy BIN
then samples the records loop with py-spy, every thread and then the threads holding the GIL
(OUT/pyspy_all.txt, OUT/pyspy_gil.txt, py-spy's raw format), and parts.json says per thread where
its samples were (`summarise_py_spy`): whether the loop's thread waits or works, how busy the GIL is.

    python scripts/loop_parts.py LIST --out DIR [--limit 10000] [--config NAME] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pipeline.bench import code_version, gpudet_passes, machine, model_images_per_s  # noqa: E402
from pipeline.detector import Detector  # noqa: E402
from pipeline.listing import list_images  # noqa: E402
from pipeline.preprocess import preprocess_stream  # noqa: E402
from pipeline.results import ImageRef  # noqa: E402
from pipeline.source import EncodedImage, read_checked  # noqa: E402


def refuse(errors) -> None:
    raise SystemExit("loop_parts: cannot decode " + "; ".join(f"{e.path}: {e.message}" for e in errors))


class Parts:
    """The loop's parts over one set of images, for one detector."""

    def __init__(self, detector: Detector, refs: list[ImageRef]):
        self.detector, self.refs = detector, refs
        self.items = [i for i in map(read_checked, refs) if isinstance(i, EncodedImage)]
        if len(self.items) < len(refs):
            raise SystemExit("loop_parts: measure on images that are files gpudet reads (JPEG, PNG, ...)")
        size = detector.batch_size
        self.batches = [self.items[i:i + size] for i in range(0, len(self.items), size)]
        self.bytes = [item.data.tobytes() for item in self.items]
        self.one_batch = detector.preprocessor.run(self.items[:size])
        self.model_beside: list[float] = []

    def dali(self) -> int:
        detector = self.detector
        return sum(len(b.refs) for b in preprocess_stream(detector.preprocessor, self.batches, refuse,
                                                          depth=detector.prefetch_batches))

    def dali_model(self) -> int:
        """Each batch into the engine's output slots in turn; a slot is reused once its run is done."""
        detector, engine = self.detector, self.detector.engine
        running: deque = deque()
        images = 0
        for number, batch in enumerate(preprocess_stream(detector.preprocessor, self.batches, refuse,
                                                         depth=detector.prefetch_batches)):
            if len(running) == engine.slots:
                finished(running.popleft()[1])
            running.append((batch, engine.submit(engine.launch, batch.images, number % engine.slots)))
            images += len(batch.refs)
        for _, launched in running:
            finished(launched)
        return images

    def dali_beside_model(self) -> int:
        engine, stop, runs = self.detector.engine, threading.Event(), [0]

        def spin() -> None:
            while not stop.is_set():
                engine.launch(self.one_batch.images, 0, synchronize=True)
                runs[0] += 1

        spinning = engine.submit(spin)
        time.sleep(0.5)  # the model running before DALI starts
        start, first = time.perf_counter(), runs[0]
        count = self.dali()
        seconds, last = time.perf_counter() - start, runs[0]
        stop.set()
        spinning.result()
        self.model_beside.append((last - first) * self.detector.batch_size / seconds)
        return count

    def stream_bytes(self) -> int:
        return sum(len(batch.refs) for batch, _ in self.detector.stream(self.bytes, refuse))

    def stream_files(self) -> int:
        return sum(len(batch.refs) for batch, _ in self.detector.stream([r.path for r in self.refs], refuse))

    def records(self) -> tuple[int, float]:
        """Timed as the bench times a pass: without the start and stop of its GPU sampler (nvidia-smi,
        sampling every 200 ms: the call's wall clocks fall on those steps)."""
        run, = gpudet_passes(self.refs, self.detector, 1, warm_up=False)  # raises if an image fails
        return len(self.refs), run.seconds


def finished(launched) -> None:
    """Wait on the host for a model run queued by Engine.launch."""
    result = launched.result()
    if result.finished is not None:
        result.finished.synchronize()


def rates(part, repeats: int) -> list[float]:
    """part's images per second, `repeats` times after a warm-up: part returns its images, timed
    here, or (images, seconds) it timed itself."""
    part()  # warm-up
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        done = part()
        images, seconds = done if isinstance(done, tuple) else (done, time.perf_counter() - start)
        out.append(round(images / seconds, 1))
    return out


PY_SPY_RATE = 200  # samples per second


def summarise_py_spy(raw: Path, ticks: int, top: int = 4) -> dict:
    """py-spy's raw samples (one `THREAD;FRAME;...;FRAME COUNT` line per distinct stack) per thread
    name, pool threads of one name together: their samples as a share of `ticks` (the duration times
    the rate: with --gil, how long each thread held the GIL), and where they were, as the deepest
    frame in gpudet's package (`pipeline/`) and the innermost frame, most samples first, as shares
    of the thread's samples. Read the long-lived threads (the loop's, the engine's): py-spy names a
    thread by its pthread id, which a thread of the next pass's pools takes over, so those pools'
    names can mix."""
    threads: dict[str, Counter] = {}
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        thread, *frames = stack.split(";")
        name = re.sub(r"^thread \((?:0x)?[0-9a-fA-F]+\):\s*", "", thread) or thread
        ours = [f for f in frames if "pipeline/" in f]
        where = f"{ours[-1] if ours else '-'} > {frames[-1] if frames else '-'}"
        threads.setdefault(name, Counter())[where] += int(count)
    samples = sum(sum(c.values()) for c in threads.values())
    summary = {"ticks": ticks, "samples": samples, "share_of_ticks": round(samples / ticks, 3), "threads": {}}
    for name, places in sorted(threads.items(), key=lambda item: -sum(item[1].values())):
        held = sum(places.values())
        summary["threads"][name] = {
            "samples": held, "share_of_ticks": round(held / ticks, 3),
            "where": [[place, round(n / held, 3)] for place, n in places.most_common(top)]}
    return summary


def py_spy(binary: str, out: Path, detector: Detector, refs: list[ImageRef], seconds: int) -> dict:
    """py-spy over this process while the records loop runs: every thread (idle ones too), then the
    threads holding the GIL; the loop's rates under each, and the samples summarised."""
    under = {}
    for name, flag in (("all", "--idle"), ("gil", "--gil")):
        raw = out / f"pyspy_{name}.txt"
        spy = subprocess.Popen([binary, "record", "--pid", str(os.getpid()), "--duration", str(seconds),
                                "--rate", str(PY_SPY_RATE),
                                "--threads", "--nonblocking", "--format", "raw", "-o", str(raw),
                                flag], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        passes = []
        while spy.poll() is None:
            passes += [round(p.images_per_s, 1) for p in gpudet_passes(refs, detector, 1, warm_up=False)]
        under[name] = {"returncode": spy.returncode, "stderr": spy.stderr.read()[-500:], "records_images_per_s": passes}
        if spy.returncode == 0 and raw.exists():
            under[name]["summary"] = summarise_py_spy(raw, seconds * PY_SPY_RATE)
    return under


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="a list file (or folder) of images")
    parser.add_argument("--out", required=True, type=Path, help="folder for parts.json (and py-spy's samples)")
    parser.add_argument("--config", default=None, help="a config name or YAML file (default: the embedded one)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override")
    parser.add_argument("--limit", type=int, default=10_000, help="the first N images of the source")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each part, after its warm-up")
    parser.add_argument("--model-iterations", type=int, default=200, help="runs of the model alone on one batch")
    parser.add_argument("--py-spy", default=None, metavar="BIN", help="also sample the records loop with py-spy")
    parser.add_argument("--py-spy-seconds", type=int, default=4)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    host = machine()
    detector = Detector.from_config(args.config, overrides=args.set)
    refs = [ImageRef(i, r.path) for i, r in enumerate(list_images(args.source)[:args.limit])]
    parts = Parts(detector, refs)
    report = {"images": len(refs), "batch_size": detector.batch_size, "device": detector.device.describe(),
              "config": detector.config.source_file, "sets": args.set,
              "model_alone_images_per_s": round(model_images_per_s(parts.items[:detector.batch_size], detector,
                                                                   args.model_iterations), 1), "images_per_s": {}}
    for name, part in (("dali", parts.dali), ("dali+model", parts.dali_model), ("dali|model", parts.dali_beside_model),
                       ("stream_bytes", parts.stream_bytes), ("stream_files", parts.stream_files),
                       ("records", parts.records)):
        report["images_per_s"][name] = rates(part, args.repeats)
        print(f"{name:<13} {report['images_per_s'][name]} img/s", flush=True)
    # one per run of "dali|model", its warm-up first: the timed runs' rates
    report["model_beside_dali_images_per_s"] = [round(r, 1) for r in parts.model_beside[1:]]
    if args.py_spy:
        report["py_spy"] = py_spy(args.py_spy, args.out, detector, refs, args.py_spy_seconds)
    report.update(machine=host, gpudet=code_version(), date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  command="python scripts/loop_parts.py " + " ".join(sys.argv[1:] if argv is None else argv))
    (args.out / "parts.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
