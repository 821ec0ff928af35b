"""Every script in scripts/ starts: imports resolve and the command line parses (--help). A script
that imports a name the package no longer has fails here, not on the GPU machine."""

import json
import subprocess
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import profile_host as ph  # noqa: E402  (the helpers of both need nothing heavier than json)
import profile_pipeline as pp  # noqa: E402

SCRIPTS = sorted((ROOT / "scripts").glob("*.py"))


def test_every_script_answers_help():
    # One interpreter for all of them (each import of torch costs seconds); the scripts' folder on
    # the path, as when one runs `python scripts/NAME.py`.
    code = (
        "import runpy, sys\n"
        f"sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'scripts')!r}]\n"
        "failed = []\n"
        f"for path in {[str(p) for p in SCRIPTS]!r}:\n"
        "    sys.argv = [path, '--help']\n"
        "    try:\n"
        "        runpy.run_path(path, run_name='__main__')\n"
        "    except SystemExit as e:\n"
        "        if e.code not in (0, None): failed.append((path, e.code))\n"
        "    except Exception as e:\n"
        "        failed.append((path, repr(e)))\n"
        "print('FAILED', failed) if failed else print('ALL OK')\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0 and "ALL OK" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]
    assert len(SCRIPTS) >= 8


def test_probe_fuse_exposes_every_convolution(tmp_path):
    """scripts/probe_fuse.py (a GPU diagnosis) on the CPU: every Conv of the RetinaFace heads model
    read out with its attributes; both sessions are the CPU EP here, so they agree exactly."""
    import json

    out = tmp_path / "fuse.json"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "probe_fuse.py"), str(ROOT / "models" /
                    "retinaface_mnet025_heads_640.onnx"), "--batch", "1", "2", "--json", str(out)],
                   check=True, capture_output=True)
    report = json.loads(out.read_text())
    for rows in report["batches"].values():
        assert len(rows) == 59 and sum(r["group"] > 1 for r in rows) == 13  # MobileNet's depthwise convs
        assert all(r["relative_error"] == 0 and r["kernel"] for r in rows)


def test_probe_fuse_whole_model_under_each_optimisation(tmp_path):
    """--whole: the model's own outputs under four graph optimisation settings, with the fused
    convolution nodes ORT made (on the CPU EP: Conv + LeakyRelu unless that fusion is off)."""
    out = tmp_path / "whole.json"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "probe_fuse.py"), str(ROOT / "models" /
                    "retinaface_mnet025_heads_640.onnx"), "--whole", "--batch", "1", "--json", str(out)],
                   check=True, capture_output=True)
    report = json.loads(out.read_text())
    assert len(report) == 4
    assert "LeakyRelu" in report["all optimisations"]["nodes"]
    assert "LeakyRelu" not in report["without ConvActivationFusion"]["nodes"]
    for how in report.values():
        assert set(how["relative_error"]["1"]) == {"loc", "conf", "landmarks"}
        assert all(e == 0 for e in how["relative_error"]["1"].values())


def test_probe_e2e_ops_alternatives_give_the_per_anchor_maxima(tmp_path):
    """scripts/probe_e2e_ops.py (a GPU measurement) on the CPU at batch 1: every best-class way
    it times is checked against numpy's maxima inside the script (it exits non-zero otherwise)."""
    out = tmp_path / "ops.json"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "probe_e2e_ops.py"), "--device", "cpu", "--batch", "1",
                    "--iters", "1", "--json", str(out)], check=True, capture_output=True, cwd=ROOT, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert sum("best class" in row["op"] for row in rows) == 8 and all(row["ms"] > 0 for row in rows)


def test_profile_pipeline_adds_up_streams_overlap_and_gaps():
    """scripts/profile_pipeline.py's arithmetic on a made-up timeline (us): the model's stream 7
    runs [0, 100) and [150, 300) (one 50 us gap), stream 3 runs [50, 200) in two touching kernels,
    stream 9 [400, 410). Busy time is a union, not a sum; overlap is an intersection."""
    events = [{"name": "conv", "ts": 0, "dur": 100, "stream": 7},
              {"name": "conv", "ts": 150, "dur": 150, "stream": 7},
              {"name": "resize", "ts": 50, "dur": 100, "stream": 3},
              {"name": "norm", "ts": 150, "dur": 50, "stream": 3},
              {"name": "nms", "ts": 400, "dur": 10, "stream": 9}]
    report = pp.summarize(events, min_gap_us=20)
    assert report["span_ms"] == 0.41 and report["model_stream"] == "7"
    assert report["streams"]["7"]["busy_ms"] == 0.25 and report["streams"]["3"]["busy_ms"] == 0.15
    assert report["device_busy_ms"] == 0.31  # [0, 300) and [400, 410)
    assert report["model_stream_beside_ms"] == {"3": 0.1, "9": 0.0}  # [50, 100) and [150, 200)
    assert report["model_stream_gaps"] == {"count": 1, "total_ms": 0.05, "longest_ms": 0.05, "min_gap_us": 20}
    assert report["streams"]["3"]["heaviest_ms"] == {"resize": 0.1, "norm": 0.05}
    assert pp.summarize([])["device_busy_ms"] == 0.0


def test_profile_pipeline_reads_device_work_from_a_chrome_trace(tmp_path):
    """Kernels, copies and memsets with a stream come out of torch's chrome trace; host ops,
    flow events and device events without a stream do not."""
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "conv", "ts": 10.5, "dur": 4, "args": {"device": 0, "stream": 7}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": 20, "dur": 1, "args": {"stream": 3}},
        {"ph": "X", "cat": "gpu_memset", "name": "Memset", "ts": 22, "dur": 1, "args": {"stream": 3}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 0, "dur": 30, "args": {}},
        {"ph": "f", "cat": "ac2g", "name": "flow", "ts": 10},
        {"ph": "X", "cat": "kernel", "name": "no stream", "ts": 1, "dur": 1}]}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    events = pp.device_events(path)
    assert [(e["name"], e["stream"], e["ts"], e["dur"]) for e in events] == [
        ("conv", 7, 10.5, 4.0), ("Memcpy DtoH", 3, 20.0, 1.0), ("Memset", 3, 22.0, 1.0)]


def test_profile_host_reads_py_spy_stacks_per_thread_pool():
    """scripts/profile_host.py on made-up py-spy raw output (--threads): a pool's numbered threads
    count as one, each stack's innermost frame and innermost frame in gpudet's code are ranked,
    and share_of_pass is samples over rate x seconds (with --gil: the GIL's busy share)."""
    raw = "\n".join([
        "thread (11): MainThread;<module> (pipeline/__main__.py:5);stream (pipeline/detector.py:440);"
        "run (nvidia/dali/pipeline.py:10) 30",
        "thread (12): gpudet-read_0;_worker (concurrent/futures/thread.py:81);read_checked (pipeline/source.py:210);"
        "image_size (pipeline/source.py:150) 20",
        "thread (13): gpudet-read_1;_worker (concurrent/futures/thread.py:81);read_checked (pipeline/source.py:210);"
        "image_size (pipeline/source.py:150) 15",
        "thread (14): gpudet-read_1;_worker (concurrent/futures/thread.py:81) 5",
        "thread (15): gpudet-engine;_launch (pipeline/engine.py:346);run_with_iobinding (onnxruntime/x.py:578) 10",
        "py-spy> a line that is not a stack",
    ])
    samples = ph.parse_raw(raw)
    assert [(name, n) for name, _, n in samples] == [
        ("MainThread", 30), ("gpudet-read_0", 20), ("gpudet-read_1", 15), ("gpudet-read_1", 5), ("gpudet-engine", 10)]
    report = ph.summarize(samples, rate=100, seconds=0.5, top=2)
    assert report["samples"] == 80 and report["share_of_pass"] == 1.6
    assert list(report["threads"]) == ["gpudet-read", "MainThread", "gpudet-engine"]
    read = report["threads"]["gpudet-read"]
    assert read["samples"] == 40 and read["share_of_samples"] == 0.5
    assert read["innermost"] == {"image_size (pipeline/source.py:150)": 35,
                                 "_worker (concurrent/futures/thread.py:81)": 5}
    assert read["innermost_in_gpudet"] == {"image_size (pipeline/source.py:150)": 35, "(outside gpudet's code)": 5}
    assert report["threads"]["MainThread"]["innermost_in_gpudet"] == {"stream (pipeline/detector.py:440)": 30}
    assert "gpudet-engine: 10 samples (12%)" in ph.format_summary("gil", report)


def test_probe_read_measures_threads_and_processes(tmp_path):
    out = tmp_path / "read.json"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "probe_read.py"), str(ROOT / "samples"), "--threads", "2",
                    "--processes", "1", "--rounds", "20", "--batch-size", "8", "--json", str(out)],
                   check=True, capture_output=True, cwd=ROOT, timeout=300)
    report = json.loads(out.read_text())
    assert report["images"] == 20 * report["files"] and report["files"] == len(list((ROOT / "samples").glob("*.*g")))
    assert [(r["reader"], r["busy_thread"]) for r in report["rows"]] == [
        ("2 threads", False), ("2 threads", True), ("1 processes", False), ("1 processes", True),
        ("1 processes, kept", False), ("1 processes, kept", True)]
    assert all(r["images_per_s"] > 0 for r in report["rows"])
