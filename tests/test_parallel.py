"""Several workers on one host (`--devices`): each image exactly once, a failing worker reported."""

import json
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.device import DeviceError
from pipeline.parallel import parse_devices
from pipeline.folder import OutputFolder

from conftest import EXPECTED_FACES, SAMPLES, cuda_usable, read_jsonl, read_results


def by_index(path):
    return sorted(read_jsonl(path), key=lambda r: r["index"])


def test_parse_devices():
    assert parse_devices("cpu, cpu") == ["cpu", "cpu"]
    with pytest.raises(DeviceError, match="gpu0"):
        parse_devices("gpu0")
    if cuda_usable():
        assert parse_devices("0") == ["cuda:0"]
    else:  # checked before any worker starts: a worker that cannot run would only fail later
        for text in ("all", "0", "cpu,cuda:1"):
            with pytest.raises(DeviceError, match="no CUDA GPU"):
                parse_devices(text)


@pytest.mark.parametrize("output_format", ["jsonl", "parquet"])
def test_two_workers_give_the_single_process_results(tmp_path, capsys, output_format):
    common = ["--format", output_format]
    assert main(["detect", str(SAMPLES), "--out", str(tmp_path / "one"), "--device", "cpu", "--quiet", *common]) == 0
    assert main(["detect", str(SAMPLES), "--out", str(tmp_path / "two"), "--devices", "cpu,cpu", *common]) == 0
    table = capsys.readouterr().out
    assert "worker 0 on cpu: 3 images" in table and "worker 1 on cpu: 3 images" in table, table
    assert read_results(tmp_path / "one") == read_results(tmp_path / "two") and len(read_results(tmp_path / "two")) == 6
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert [(w["worker"], w["processed"]) for w in summary["workers"]] == [(0, 3), (1, 3)]
    assert summary["failed_workers"] == [] and summary["model"]["contract"] == "end_to_end"
    assert summary["config"]["run"]["device"] == "auto"


def test_a_failing_worker_is_reported_and_resume_finishes(tmp_path, capsys):
    """A worker that stops on an error of gpudet's (here: a symbolic link planted in its shard,
    which it refuses to write through) is named with its exit code, which the run exits with (2,
    as one process would); the others' work is kept."""
    out = tmp_path / "out"
    (tmp_path / "bad.jpg").write_bytes(b"")
    listing = tmp_path / "list.txt"
    listing.write_text("".join(f"{p}\n" for p in sorted(SAMPLES.glob("*.*")) if p.suffix != ".md") +
                       f"{tmp_path / 'bad.jpg'}\n")
    (out / ".gpudet-shards" / "1").mkdir(parents=True)
    (out / ".gpudet-shards" / "1" / "errors.jsonl").symlink_to(tmp_path / "elsewhere.jsonl")
    (out / "settings.json").write_text('{"gpudet": "a run stopped before its first record"}')  # gpudet's folder
    assert main(["detect", str(listing), "--out", str(out), "--devices", "cpu,cpu", "--quiet"]) == 2  # the worker's code
    assert "worker 1 on cpu exited with code 2" in capsys.readouterr().err
    assert not (tmp_path / "elsewhere.jsonl").exists()
    (out / ".gpudet-shards" / "1" / "errors.jsonl").unlink()
    first = read_jsonl(out / "detections.jsonl") + read_jsonl(out / "errors.jsonl")
    assert sorted(r["index"] for r in first) == [0, 2, 4, 6]  # worker 0's share; nothing lost
    # The empty file was worker 0's and is recorded already: this run's images all succeed, and the
    # exit says that errors.jsonl lists a failure.
    assert main(["detect", str(listing), "--out", str(out), "--devices", "cpu,cpu,cpu", "--resume", "--quiet"]) == 3
    assert json.loads((out / "summary.json").read_text())["already_failed"] == 1
    done = read_jsonl(out / "detections.jsonl")
    failed = read_jsonl(out / "errors.jsonl")
    assert sorted([r["index"] for r in done] + [e["index"] for e in failed]) == list(range(7))
    assert [e["reason"] for e in failed] == ["empty"]
    assert not (out / ".gpudet-shards").exists()  # kept by the run with a failed worker; this one recorded every image


def test_a_worker_that_dies_is_started_again_on_what_it_had_not_recorded(tmp_path, capsys):
    """A worker killed mid-run (SIGKILL: as by the OOM killer, or an abort after a CUDA fault) after
    recording some batches: the parent starts it again on its images not yet recorded; every image
    ends up recorded exactly once, and the summary counts what both of its processes did."""
    images = [p for p in sorted(SAMPLES.glob("*.*")) if p.suffix != ".md"] * 16
    listing = tmp_path / "list.txt"
    listing.write_text("".join(f"{p}\n" for p in images))
    out = tmp_path / "out"
    shard = out / ".gpudet-shards" / "0"
    killed = []

    def kill_worker_0_after_its_first_batch():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            workers = [p for p in multiprocessing.active_children() if p.name.startswith("gpudet-worker0-")]
            recorded = sum(len(read_jsonl(shard / f)) for f in ("detections.jsonl", "errors.jsonl")
                           if (shard / f).exists())
            if workers and recorded >= 2:
                os.kill(workers[0].pid, signal.SIGKILL)
                killed.append(recorded)
                return
            time.sleep(0.01)

    watcher = threading.Thread(target=kill_worker_0_after_its_first_batch)
    watcher.start()
    code = main(["detect", str(listing), "--out", str(out), "--devices", "cpu,cpu", "--batch-size", "2"])
    watcher.join()
    assert killed and killed[0] < len(images) // 2  # it died with images of its share left
    assert code == 0
    indices = sorted(r["index"] for r in read_jsonl(out / "detections.jsonl"))
    assert indices == list(range(len(images)))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["restarts"] == 1 and summary["failed_workers"] == []
    assert summary["workers"][0]["exit_codes"] == [-signal.SIGKILL, 0]
    assert [w["processed"] for w in summary["workers"]] == [len(images) // 2] * 2
    assert summary["processed"] == len(images)
    printed = capsys.readouterr()
    assert "worker 0 on cpu died (exit code -9)" in printed.err
    assert "exit 0 (restarted after -9)" in printed.out


def test_resume_on_fewer_devices_merges_every_shard_it_counted(tmp_path, monkeypatch):
    """A --devices run on three workers stopped before its merge (killed): its records are only in
    .gpudet-shards/0..2. A --resume on one device counts them as done, so it must merge all three; a
    single-process --resume does the same. The run that completes removes the shards."""
    listing = tmp_path / "list.txt"
    listing.write_text("".join(f"{p}\n" for p in sorted(SAMPLES.glob("*.*")) if p.suffix != ".md") * 2)
    out = tmp_path / "out"

    def killed_before_the_merge():
        for name in ("detections.jsonl", "errors.jsonl", "summary.json"):
            (out / name).unlink(missing_ok=True)

    monkeypatch.setattr(OutputFolder, "drop_shards", lambda self: None)  # these runs leave their shards
    assert main(["detect", str(listing), "--out", str(out), "--devices", "cpu,cpu,cpu", "--quiet"]) == 0
    killed_before_the_merge()
    assert main(["detect", str(listing), "--out", str(out), "--devices", "cpu", "--resume", "--quiet"]) == 0
    assert sorted(r["index"] for r in read_jsonl(out / "detections.jsonl")) == list(range(12))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["already_done"] == 12 and "workers" not in summary  # nothing left: no worker started
    killed_before_the_merge()
    monkeypatch.undo()
    assert main(["detect", str(listing), "--out", str(out), "--device", "cpu", "--resume", "--quiet"]) == 0
    assert sorted(r["index"] for r in read_jsonl(out / "detections.jsonl")) == list(range(12))
    assert not (out / ".gpudet-shards").exists()


def test_more_devices_than_images_start_only_the_workers_with_images(tmp_path):
    out = tmp_path / "out"
    image = next(SAMPLES.glob("*.jpg"))
    assert main(["detect", str(image), "--out", str(out), "--devices", "cpu,cpu", "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["devices"] == ["cpu", "cpu"] and [w["processed"] for w in summary["workers"]] == [1]


def test_sigterm_to_the_parent_stops_the_workers_and_keeps_what_they_wrote(tmp_path):
    """A scheduler stopping the job sends SIGTERM to the parent only: it stops its workers (each
    ends its batch), merges their records, writes the summary and exits 130; --resume finishes."""
    import subprocess
    import sys

    images = [p for p in sorted(SAMPLES.glob("*.*")) if p.suffix != ".md"] * 40
    listing = tmp_path / "list.txt"
    listing.write_text("".join(f"{p}\n" for p in images))
    out = tmp_path / "out"
    command = [sys.executable, "-m", "pipeline", "detect", str(listing), "--out", str(out), "--devices", "cpu,cpu",
               "--batch-size", "2", "--quiet"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not all(
            (out / ".gpudet-shards" / k / "detections.jsonl").exists() and read_jsonl(out / ".gpudet-shards" / k / "detections.jsonl")
            for k in "01"):
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert "Traceback" not in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] and [w["exit_code"] for w in summary["workers"]] == [130, 130]
    first = read_jsonl(out / "detections.jsonl")
    assert 0 < len(first) < len(images) and summary["processed"] == len(first)
    assert (out / ".gpudet-shards").is_dir()  # kept for the resume
    assert main(["detect", str(listing), "--out", str(out), "--devices", "cpu,cpu", "--resume", "--quiet"]) == 0
    assert sorted(r["index"] for r in read_jsonl(out / "detections.jsonl")) == list(range(len(images)))
    assert not (out / ".gpudet-shards").exists()


def test_a_worker_process_imports_no_torch_before_its_early_session():
    """A --devices worker (spawned: it runs the command's script again, imports its target's module
    and unpickles its arguments: a Config and ImageRefs) opens its model's session and starts the
    first GPU run (session.start_early) before torch, DALI and Triton load: none of those imports
    may load them."""
    import subprocess
    import sys

    code = ("import sys, pipeline.cli, pipeline.parallel, pipeline.config, pipeline.results; "
            "heavy = {'torch', 'nvidia.dali', 'triton', 'onnxruntime'} & set(sys.modules); assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent)


@pytest.mark.cuda
def test_a_gpu_worker_takes_its_early_session_and_finds_what_one_process_finds(tmp_path):
    """`--devices 0`: the worker's detector takes over the session its process opened before the
    imports, and the merged records are the single process's."""
    import subprocess
    import sys

    def detect(out, *extra):
        done = subprocess.run([sys.executable, "-m", "pipeline", "detect", str(SAMPLES), "--out", str(out),
                               "--quiet", "--log-level", "DEBUG", *extra], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stderr

    one = detect(tmp_path / "one", "--device", "cuda")
    worker = detect(tmp_path / "worker", "--devices", "0")
    for log in (one, worker):
        assert "the session opened early is taken over" in log, log[-3000:]

    one, worker = read_results(tmp_path / "one"), read_results(tmp_path / "worker")
    assert [r["path"] for r in worker] == [r["path"] for r in one]
    for a, b in zip(worker, one):  # two processes: cuDNN may time its way to other kernels in each
        assert len(a["detections"]) == len(b["detections"]), (a, b)
        for d, e in zip(a["detections"], b["detections"]):
            assert max(abs(x - y) for x, y in zip(d["box"], e["box"])) <= 1.0, (a, b)


def test_a_worker_logs_as_its_parent():
    from pipeline.errors import logging_settings, setup_logging

    try:
        setup_logging("INFO", as_json=True)
        assert logging_settings() == ("INFO", True)
        setup_logging("WARNING", quiet=True)
        assert logging_settings() == ("ERROR", False)
    finally:
        setup_logging()


def test_sigterm_while_the_workers_import_ends_cleanly(tmp_path):
    """SIGTERM to the parent as soon as its workers exist, while they still load torch, DALI and
    ORT: they hold the signal until their handlers are in place, then stop; exit 130, no traceback,
    one line saying so (the parent's, not one per worker). A --resume in one process finishes and
    leaves no shards folder."""
    import subprocess
    import sys

    out = tmp_path / "out"
    process = subprocess.Popen([sys.executable, "-m", "pipeline", "detect", str(SAMPLES), "--out", str(out),
                                "--devices", "cpu,cpu"], stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None and len(children.read_text().split()) < 2:
        time.sleep(0.01)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=180)
    assert process.returncode == 130 and "Traceback" not in err, (process.returncode, err[-2000:])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] and all(w["exit_code"] in (0, 130) for w in summary["workers"]), summary
    assert [line for line in err.splitlines() if "interrupted" in line] == [
        "gpudet: ERROR: interrupted; results so far are complete; continue with --resume"], err[-2000:]
    assert main(["detect", str(SAMPLES), "--out", str(out), "--resume", "--quiet"]) == 0
    assert len(read_jsonl(out / "detections.jsonl")) == len(EXPECTED_FACES) and not (out / ".gpudet-shards").exists()


def test_a_file_name_that_is_not_utf8_is_merged(tmp_path):
    """Such a name is written with \\udcXX escapes; the merge of the workers' shards reads it back."""
    folder = tmp_path / "in"
    folder.mkdir()
    name = os.fsdecode(b"caf\xe9.jpg")
    (folder / name).write_bytes((SAMPLES / "china.jpg").read_bytes())
    (folder / "b.jpg").write_bytes((SAMPLES / "grace_hopper.jpg").read_bytes())
    out = tmp_path / "out"
    assert main(["detect", str(folder), "--out", str(out), "--devices", "cpu,cpu", "--quiet"]) == 0
    paths = {os.fsencode(r["path"]) for r in read_jsonl(out / "detections.jsonl")}
    assert paths == {os.fsencode(str(folder / name)), os.fsencode(str(folder / "b.jpg"))}
    assert main(["detect", str(folder), "--out", str(out), "--devices", "cpu", "--resume", "--quiet"]) == 0
