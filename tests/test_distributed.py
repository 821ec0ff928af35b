"""The Ray Data runner on a local cluster with CPU actors: the single-process results, resumable."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.formats import record_format

from conftest import ROOT, SAMPLES, read_jsonl, read_results


def records(path):
    return sorted(read_jsonl(path), key=lambda r: r["index"])


@pytest.mark.parametrize("output_format", ["jsonl", "parquet"])
def test_ray_actors_give_the_single_process_results_and_resume(tmp_path, output_format):
    (tmp_path / "broken.jpg").write_bytes(b"\xff\xd8\xff" + b"\x00" * 64)
    listing = tmp_path / "list.txt"
    listing.write_text("".join(f"{p}\n" for p in sorted(SAMPLES.glob("*.*")) if p.suffix != ".md") +
                       f"{tmp_path / 'broken.jpg'}\n")
    common = ["--device", "cpu", "--batch-size", "2", "--quiet", "--format", output_format]
    assert main(["detect", str(listing), "--out", str(tmp_path / "one"), *common]) == 3
    assert main(["detect", str(listing), "--out", str(tmp_path / "ray"), "--ray", "--workers", "2", *common]) == 3
    assert read_results(tmp_path / "one") == read_results(tmp_path / "ray") and len(read_results(tmp_path / "one")) == 6
    assert records(tmp_path / "one" / "errors.jsonl") == records(tmp_path / "ray" / "errors.jsonl")
    summary = json.loads((tmp_path / "ray" / "summary.json").read_text())
    assert summary["processed"] == 6 and summary["failed"] == 1 and summary["actors"] == 2
    assert summary["format"] == output_format

    # Resume after a run that recorded only part: the rest is done, each image exactly once.
    if output_format == "jsonl":
        detections = (tmp_path / "ray" / "detections.jsonl").read_text().splitlines()
        (tmp_path / "ray" / "detections.jsonl").write_text("\n".join(detections[:2]) + "\n")
    else:
        files = sorted((tmp_path / "ray" / "detections.parquet").glob("*.parquet"))
        assert len(files) >= 2  # the actors' files, moved in by the merge
        files[-1].unlink()
    assert main(["detect", str(listing), "--out", str(tmp_path / "ray"), "--ray", "--workers", "2", "--resume",
                 *common]) == 3  # broken.jpg's failure is still in errors.jsonl
    assert read_results(tmp_path / "one") == read_results(tmp_path / "ray")
    # Nothing left: no actor, no Ray, the same files and a summary saying so.
    assert main(["detect", str(listing), "--out", str(tmp_path / "ray"), "--ray", "--workers", "2", "--resume",
                 *common]) == 3
    assert json.loads((tmp_path / "ray" / "summary.json").read_text())["already_done"] == 7
    assert read_results(tmp_path / "one") == read_results(tmp_path / "ray")


def ray_run(*args, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", "detect", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_the_actors_shards_are_merged_and_removed_and_the_driver_summary_names_model_and_config(tmp_path):
    run = ray_run(SAMPLES, "--out", tmp_path / "o", "--ray", "--workers", "2", "--device", "cpu", "--batch-size", "2",
                  "--quiet", "--log-json")
    assert run.returncode == 0, run.stderr[-3000:]
    for line in run.stderr.splitlines():  # --log-json: Ray's messages too, one JSON object a line
        json.loads(line)
    assert len(read_jsonl(tmp_path / "o" / "detections.jsonl")) == 6
    assert not (tmp_path / "o" / ".gpudet-shards").exists()  # merged, then removed: each record once in the folder
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["model"]["contract"] == "end_to_end" and summary["config"]["run"]["batch_size"] == 2
    assert summary["processed"] == 6 and summary["detections"] == 3


def test_a_bad_model_fails_before_ray_starts(tmp_path):
    (tmp_path / "bad.onnx").write_bytes(b"not onnx")
    run = ray_run(SAMPLES, "--out", tmp_path / "o", "--ray", "--device", "cpu", "--model", tmp_path / "bad.onnx")
    assert run.returncode == 2 and "Traceback" not in run.stderr and len(run.stderr.splitlines()) == 1, run.stderr
    assert "bad.onnx" in run.stderr


@pytest.mark.parametrize("output_format", ["jsonl", "parquet"])
def test_an_actor_killed_mid_run_loses_no_image_and_repeats_none(tmp_path, output_format):
    """SIGKILL to an actor after it recorded some images: Ray restarts it and runs its batches
    again (or, should Ray give up, --resume finishes): every image once in the merged files."""
    listing = tmp_path / "list.txt"
    photos = [p for p in sorted(SAMPLES.glob("*.*")) if p.suffix != ".md"]
    listing.write_text("".join(f"{p}\n" for p in photos * 20))
    out = tmp_path / "o"
    options = ["--ray", "--workers", "2", "--device", "cpu", "--batch-size", "2", "--quiet", "--format", output_format]
    process = subprocess.Popen([sys.executable, "-m", "pipeline", "detect", str(listing), "--out", str(out), *options],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed = None
    deadline = time.monotonic() + 300
    while killed is None and time.monotonic() < deadline and process.poll() is None:
        recorded = sum(record_format(p.name.split(".")[1]).count(p)
                       for p in (out / ".gpudet-shards").glob("ray-*/detections.*"))
        actors = [p for p in Path("/proc").glob("[0-9]*") if b"MapWorker" in read_bytes(p / "cmdline")]
        if recorded >= 10 and actors:
            killed = int(actors[0].name)
            os.kill(killed, signal.SIGKILL)
        time.sleep(0.05)
    process.communicate(timeout=600)
    assert killed, "no actor to kill: the run ended too soon"
    if process.returncode != 0:  # Ray gave up on the batches: what the shards hold stays, --resume does the rest
        resumed = ray_run(listing, "--out", out, *options, "--resume")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["index"] for r in read_results(out)] == list(range(len(photos) * 20))
    assert not (out / ".gpudet-shards").exists()


def read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def test_sigterm_to_a_ray_run_is_130_with_a_summary_and_resume_finishes(tmp_path):
    listing = tmp_path / "list.txt"
    listing.write_text("".join(f"{SAMPLES / 'grace_hopper.jpg'}\n" for _ in range(400)))
    out = tmp_path / "o"
    process = subprocess.Popen([sys.executable, "-m", "pipeline", "detect", str(listing), "--out", str(out), "--ray",
                                "--workers", "1", "--device", "cpu", "--batch-size", "2", "--quiet"], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not any((out / ".gpudet-shards").glob("ray-*/detections.jsonl")):
        assert process.poll() is None, process.communicate()
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 130 and "Traceback" not in stderr, stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["interrupted"] is True
    finished = ray_run(listing, "--out", out, "--ray", "--workers", "1", "--device", "cpu", "--batch-size", "8",
                       "--quiet", "--resume")
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert sorted(r["index"] for r in read_jsonl(out / "detections.jsonl")) == list(range(400))
    assert not (out / ".gpudet-shards").exists()  # kept by the interrupted run, merged and removed by the resume


def test_an_actor_whose_stream_stops_fails_every_request_instead_of_hanging(tmp_path):
    """The actor's stream thread ends (here: its shard's disk is full): the request it was serving,
    those queued behind it and any that come later fail with the reason, none waits forever."""
    import asyncio
    import errno

    import numpy as np

    from pipeline.config import load_config
    from pipeline.distributed import DetectActor
    from pipeline.errors import OutputWriteError

    actor = DetectActor(load_config(None, ["run.device=cpu", "run.batch_size=2"]), str(tmp_path / ".gpudet-shards"))

    def disk_full(*batch):
        raise OutputWriteError(actor.shard.files[0], OSError(errno.ENOSPC, "No space left on device"))

    actor.shard.record = disk_full
    photos = [str(p) for p in sorted(SAMPLES.glob("*.*")) if p.suffix != ".md"]

    def request(first: int) -> dict:
        return {"index": np.arange(first, first + 3), "path": np.array(photos[first:first + 3])}

    async def go():
        empty = await actor({"index": np.zeros(0, np.int64), "path": np.zeros(0, str)})
        assert all(len(v) == 0 for v in empty.values())
        both = await asyncio.wait_for(asyncio.gather(actor(request(0)), actor(request(3)), return_exceptions=True), 120)
        assert all(isinstance(e, OutputWriteError) for e in both), both
        later = await asyncio.wait_for(asyncio.gather(actor(request(0)), return_exceptions=True), 10)
        assert isinstance(later[0], RuntimeError) and "disk is full" in str(later[0])

    asyncio.run(go())


def test_an_actor_whose_parquet_file_cannot_be_written_fails_the_request_instead_of_hanging(tmp_path, monkeypatch):
    """The rows are written out before a request is answered: a write that fails there fails the
    request it was for, and the rest as above."""
    import asyncio
    import errno

    import numpy as np

    from pipeline import parquet
    from pipeline.config import load_config
    from pipeline.distributed import DetectActor
    from pipeline.errors import OutputWriteError

    def disk_full(table, path):
        raise OutputWriteError(path, OSError(errno.ENOSPC, "No space left on device"))

    monkeypatch.setattr(parquet, "write_parquet", disk_full)
    actor = DetectActor(load_config(None, ["run.device=cpu", "run.batch_size=2"]), str(tmp_path / ".gpudet-shards"),
                        output_format="parquet")
    photos = [str(p) for p in sorted(SAMPLES.glob("*.*")) if p.suffix != ".md"]

    async def go():
        first = await asyncio.wait_for(asyncio.gather(actor({"index": np.arange(3), "path": np.array(photos[:3])}),
                                                      return_exceptions=True), 120)
        assert isinstance(first[0], OutputWriteError), first
        later = await asyncio.wait_for(asyncio.gather(actor({"index": np.arange(3, 6), "path": np.array(photos[3:])}),
                                                      return_exceptions=True), 10)
        assert isinstance(later[0], Exception) and "disk is full" in str(later[0]), later  # queued or refused

    asyncio.run(go())


def test_ray_usage_errors_are_one_line(tmp_path):
    run = ray_run(SAMPLES, "--out", tmp_path / "o", "--ray", "--workers", "0", "--device", "cpu")
    assert run.returncode == 2 and run.stderr.strip() == "gpudet: ERROR: --workers 0: give at least 1 detector actor"


def test_a_ray_that_does_not_start_leaves_no_folder_and_changes_none(tmp_path):
    """A refused address: one line, exit 2, no new --out left behind, and an existing one as it was."""
    run = ray_run(SAMPLES, "--out", tmp_path / "o", "--ray", "ray://127.0.0.1:1", "--device", "cpu")
    assert run.returncode == 2 and "--ray ray://127.0.0.1:1: Ray did not start" in run.stderr, run.stderr
    assert not (tmp_path / "o").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    run = ray_run(SAMPLES, "--out", tmp_path / "mine", "--ray", "ray://127.0.0.1:1", "--device", "cpu")
    assert run.returncode == 2 and sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["notes.txt"]


def test_progress_is_a_bar_on_stderr_not_a_warning_from_ray(tmp_path):
    run = ray_run(SAMPLES, "--out", tmp_path / "o", "--ray", "--workers", "1", "--device", "cpu", "--progress")
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stderr.replace("\r", "\n").splitlines()
    bar = [line for line in lines if "6/6" in line]
    assert bar and not any(line.startswith("gpudet:") for line in bar), run.stderr[-3000:]
    # A run that goes well warns about nothing: Ray's notices about its own defaults, and how
    # gpudet calls Ray Data (no deprecated argument), stay below the default level.
    assert [line for line in lines if line.startswith(("gpudet: WARNING", "gpudet: ERROR"))] == [], run.stderr[-3000:]


def test_rays_own_lines_are_logged_at_their_level():
    import logging

    from pipeline.distributed import ray_level

    assert ray_level("2026-12-01 12:24:57,049\tWARNING __init__.py:28 -- Progress bars disabled.") == logging.INFO
    assert ray_level("2026-12-01 12:24:57,049\tINFO worker.py:1 -- Started a local Ray instance.") == logging.DEBUG
    assert ray_level("[2026-12-01 12:24:57,048 E 1181 1181] core_worker.cc:2465: Actor ...") == logging.WARNING
    assert ray_level("[2026-12-01 12:24:57,048 E 1181 1181] core_worker.cc:2465: Actor with class name: 'M' and "
                     "ID: '08' has constructor arguments in the object store and max_restarts > 0. If ...") \
        == logging.INFO
    assert ray_level("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt "
                     "out.") == logging.INFO
    assert ray_level("[2026-12-01 12:24:57,048 W 1181 1181] gcs_client.cc:1: slow") == logging.INFO
    assert ray_level("Traceback (most recent call last):") == logging.WARNING


def test_a_small_job_is_spread_over_every_actor():
    from pipeline.distributed import RAY_BATCH, ray_batch

    assert ray_batch(32, 1_000_000, 2) == 32 * RAY_BATCH  # a large job: the whole Ray batch
    assert ray_batch(32, 20_000, 8) == 1_280  # 20,000 / 16 = 1,250, rounded up to whole detector batches
    assert ray_batch(32, 10, 4) == 32  # never under one detector batch
