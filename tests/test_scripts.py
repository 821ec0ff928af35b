"""Every script in scripts/ starts: imports resolve and the command line parses (--help). A script
that imports a name the package no longer has fails here, not on the GPU machine."""

import subprocess
import sys

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
