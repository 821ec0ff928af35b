"""The Python API: Detector.from_config / run / stream(on_device=True), and the example that uses it."""

import subprocess
import sys

import numpy as np
import torch

from pipeline import Detector, DeviceDetections, ImageError, ImageResult
from pipeline.source import list_images

from conftest import EXPECTED_FACES, ROOT, SAMPLES, cpu_and_cuda


@cpu_and_cuda()
def test_run_yields_results_and_errors_per_image(tmp_path, device):
    (tmp_path / "bad.jpg").write_bytes(b"")
    detector = Detector.from_config(device=device, batch_size=4)
    paths = [str(SAMPLES / name) for name in sorted(EXPECTED_FACES)] + [str(tmp_path / "bad.jpg")]
    results = list(detector.run(paths))
    assert sorted(r.index for r in results) == list(range(len(paths)))
    errors = [r for r in results if isinstance(r, ImageError)]
    assert [(e.index, e.reason) for e in errors] == [(6, "empty")]
    faces = {r.path.rsplit("/", 1)[1]: len(r.scores) for r in results if isinstance(r, ImageResult)}
    assert faces == EXPECTED_FACES
    hopper = next(r for r in results if r.path.endswith("grace_hopper.jpg"))
    assert (hopper.width, hopper.height) == (512, 600) and hopper.names == ["face"]
    assert hopper.boxes_xyxy.shape == (1, 4) and hopper.landmarks.shape == (1, 5, 2)


@cpu_and_cuda()
def test_stream_on_device_keeps_detections_on_the_device(device):
    detector = Detector.from_config(device=device, batch_size=8)
    batches = list(detector.stream(list_images(SAMPLES), on_error=lambda errors: None, on_device=True))
    assert len(batches) == 1
    batch, found = batches[0]
    assert isinstance(found, DeviceDetections)
    assert found.boxes_xyxy.device.type == device and found.scores.device.type == device
    assert sorted(found.batch_index.tolist()) == [0, 1, 5]  # astronaut, camera, grace_hopper
    on_host = found.to_host()
    assert np.allclose(on_host.boxes_xyxy, found.boxes_xyxy.cpu().numpy())
    assert isinstance(found.scores, torch.Tensor)


def test_the_documented_example_runs():
    run = subprocess.run([sys.executable, "examples/python_api.py", "samples", "--device", "cpu"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.count(": face ") == 3 and "3 faces on cpu" in run.stdout
