"""Every script in scripts/ starts: imports resolve and the command line parses (--help). A script
that imports a name the package no longer has fails here, not on the GPU machine."""

import json
import re
import subprocess
import sys
import time

import pytest

from conftest import ROOT

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
    assert len(SCRIPTS) >= 4


def test_the_benchmark_docs_are_what_the_reports_say():
    """docs/BENCHMARKS.md's tables and the README's speed table are rendered from docs/bench/:
    a number changed by hand there, or a report changed without rendering, fails here."""
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "render_benchmarks.py"), "--check"], cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_a_rendered_section_whose_markers_are_gone_is_an_error():
    """render_benchmarks.py fails on a section it cannot find instead of leaving its old numbers."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import render_benchmarks

    text = "<!-- rendered: a -->\nold\n<!-- end -->\n"
    assert render_benchmarks.render(text, {"a": lambda: "new"}) == "<!-- rendered: a -->\nnew\n<!-- end -->\n"
    with pytest.raises(SystemExit, match="'b'"):
        render_benchmarks.render(text, {"a": lambda: "new", "b": lambda: "x"})


def test_a_number_typed_by_hand_into_the_docs_fails_the_check():
    """Every number in docs/BENCHMARKS.md's prose and hand-made tables is in a report its section
    names: a number edited by hand there (a rate, a ratio, a share) to a value no report of its
    section holds, or a number in a section that names no report, is caught; so is an edit inside
    a rendered table of the README."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import render_benchmarks

    text = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    assert render_benchmarks.unbacked(text) == []
    section = text[text.index("### YOLO11n"):].split("\n#", 1)[0]
    held = render_benchmarks.section_numbers(section)
    for before, number, after in (("at\n", "2,317.6", " img/s"), ("**", "0.79", "x**"), ("busy ", "75", "%")):
        digits = len(number.partition(".")[2])
        value = float(number.replace(",", "")) + 10 ** -digits
        while any(round(round(v, digits) - value, 6) == 0 or round(round(v * 100, digits) - value, 6) == 0
                  for v in held):
            value += 10 ** -digits
        typed = f"{value:,.{digits}f}"
        edited = text.replace(before + number + after, before + typed + after, 1)
        assert edited != text, number
        assert any(line.endswith(f": {typed}") for line in render_benchmarks.unbacked(edited)), typed
    assert render_benchmarks.unbacked("## A section naming no report\n\nIt ran at 512 img/s.\n") == \
        ["## A section naming no report: 512"]
    readme = (ROOT / "README.md").read_text()
    number = re.search(r"\| (\d[\d,]*) img/s \|", render_benchmarks.speed_section(readme)).group(1)
    assert render_benchmarks.render(readme.replace(f"| {number} img/s |", "| 1 img/s |"),
                                    {"speed": render_benchmarks.speed_table}) == readme


def commit_code_tree(commit: str) -> str:
    """git's tree of bench.CODE_PATHS at `commit`, as code_version computes it from the files."""
    from pipeline.bench import CODE_PATHS

    listing = subprocess.run(["git", "ls-tree", commit, "--", *CODE_PATHS], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout
    return subprocess.run(["git", "mktree"], cwd=ROOT, input=listing, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_a_report_names_the_code_that_ran():
    """A report records code_tree, the hash of the code on the disk that ran; the commit a report
    names (its "tree", else the commit the machine's checkout recorded) must have that code. A copy
    of the working tree with stale git metadata can no longer pass for another commit, and a
    hand-written "tree" that is not what ran fails here. In a clean checkout code_version's
    code_tree is HEAD's."""
    from pipeline.bench import code_version

    here = code_version()
    if here["commit"] and not here["commit"].endswith("+"):
        assert here["code_tree"] == commit_code_tree("HEAD")
    for path in sorted((ROOT / "docs" / "bench").rglob("*.json")):
        report = json.loads(path.read_text())
        recorded = report["gpudet"] if isinstance(report.get("gpudet"), dict) else report.get("code", {})
        if recorded.get("code_tree"):
            named = report.get("tree", {}).get("commit") or recorded["commit"].rstrip("+")
            assert commit_code_tree(named) == recorded["code_tree"], f"{path.name}: {named} is not the code that ran"


def test_the_profile_summary_finds_where_the_gpu_idles():
    """profile_loop.summarise on a timeline made by hand: the GPU's busy share over the loop, its
    idle gaps, and what the host threads were doing in them."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import profile_loop

    def event(name, cat, ts, dur, **extra):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, **extra}

    trace = {"traceEvents": [
        event("gpudet loop", "user_annotation", 0, 1000, tid=1),
        event("conv", "kernel", 0, 100, args={"stream": 7}),
        event("copy", "gpu_memcpy", 300, 100, args={"stream": 9}),
        event("cudaStreamSynchronize", "cuda_runtime", 90, 220, tid=5),
        event("stage: postprocess", "user_annotation", 400, 600, tid=1),
    ]}
    summary = profile_loop.summarise(trace)
    assert summary["gpu_busy_percent"] == 20.0 and summary["streams_busy_percent"] == {"7": 10.0, "9": 10.0}
    assert summary["idle_gaps"] == {"count": 2, "seconds": 0.0008, "median_us": 600.0, "longest_us": 600.0,
                                    "at_least_us": 20.0}
    assert summary["during_idle_ms"] == {"thread 1: stage: postprocess": 0.6, "thread 5: cudaStreamSynchronize": 0.2}
    assert summary["gpu_time_by_name_ms"] == {"kernel: conv": 0.1, "gpu_memcpy: copy": 0.1}


def test_the_loop_parts_each_run_and_are_reported(tmp_path):
    """scripts/loop_parts.py on the CPU over a few distinct JPEGs: every part of the loop runs over
    every image and gets its rate in parts.json, with the code that ran."""
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_image_set.py"), str(tmp_path / "images"),
                    "--kind", "coco", "--count", "8", "--workers", "1"], check=True, capture_output=True, timeout=120)
    sys.path.insert(0, str(ROOT / "scripts"))
    import loop_parts

    out = tmp_path / "parts"
    assert loop_parts.main([str(tmp_path / "images" / "list.txt"), "--out", str(out), "--set", "run.device=cpu",
                            "--set", "run.cpu_batch_size=4", "--repeats", "1", "--model-iterations", "1"]) == 0
    report = json.loads((out / "parts.json").read_text())
    assert report["images"] == 8 and report["batch_size"] == 4 and report["device"] == "cpu"
    assert set(report["images_per_s"]) == {"dali", "dali+model", "dali|model", "stream_bytes", "stream_files",
                                           "records"}
    assert all(len(rates) == 1 and rates[0] > 0 for rates in report["images_per_s"].values())
    assert len(report["model_beside_dali_images_per_s"]) == 1 and report["model_alone_images_per_s"] > 0
    assert report["gpudet"]["code_tree"] and report["command"].startswith("python scripts/loop_parts.py")


def test_a_part_that_times_itself_is_rated_by_its_own_seconds():
    """loop_parts.rates: the records loop gives the seconds of its pass (the bench's timing, without
    its GPU sampler's start and stop), which the rate then takes instead of the call's wall clock."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import loop_parts

    def slow_to_stop() -> tuple[int, float]:
        time.sleep(0.05)  # what the part does around its timed pass
        return 100, 0.5

    assert loop_parts.rates(slow_to_stop, 2) == [200.0, 200.0]
    assert 0 < loop_parts.rates(lambda: 100, 1)[0] < 1e9


def test_py_spy_samples_are_summarised_per_thread_name(tmp_path):
    """loop_parts.summarise_py_spy: a pool's threads of one name count together, each sample is
    placed at the deepest frame in gpudet's package and the innermost frame, and the shares are of
    the thread's samples and of the ticks."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import loop_parts

    raw = tmp_path / "pyspy.txt"
    raw.write_text(
        "thread (11): MainThread;main (loop_parts.py:1);Preprocessor.result (pipeline/preprocess.py:199);"
        "Pipeline._outputs (nvidia/dali/pipeline.py:1503) 30\n"
        "thread (11): MainThread;main (loop_parts.py:1);Preprocessor.submit (pipeline/preprocess.py:188) 10\n"
        "thread (0x1f): gpudet-read_0;_worker (concurrent/futures/thread.py:89) 5\n"
        "thread (12): gpudet-read_0;read_file (pipeline/source.py:58) 15\n\n")
    summary = loop_parts.summarise_py_spy(raw, ticks=100)
    assert (summary["samples"], summary["share_of_ticks"]) == (60, 0.6)
    assert list(summary["threads"]) == ["MainThread", "gpudet-read_0"]
    main = summary["threads"]["MainThread"]
    assert (main["samples"], main["share_of_ticks"]) == (40, 0.4)
    waiting = "Preprocessor.result (pipeline/preprocess.py:199) > Pipeline._outputs (nvidia/dali/pipeline.py:1503)"
    assert main["where"][0] == [waiting, 0.75]
    assert summary["threads"]["gpudet-read_0"]["where"] == [
        ["read_file (pipeline/source.py:58) > read_file (pipeline/source.py:58)", 0.75],
        ["- > _worker (concurrent/futures/thread.py:89)", 0.25]]
