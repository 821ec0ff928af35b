"""The contract registry: recognition, a contract named in the config, and a contract of one's
own (tests/toy_contract.py) through `gpudet detect`, --devices and --ray."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.contracts import known, named, recognise
from pipeline.errors import ModelError
from pipeline.session import TensorSpec

from conftest import ROOT, SAMPLES, read_jsonl

HERE = Path(__file__).resolve().parent


def test_the_package_knows_its_contracts_in_order_and_by_name():
    assert [c.name for c in known()] == ["end_to_end", "ssd_heads", "retinanet_heads", "padded_end_to_end",
                                         "set_prediction", "anchor_free"]
    assert named("auto") is None and named("ssd_heads").name == "ssd_heads"
    with pytest.raises(ModelError, match="not a contract gpudet knows; give auto, one of end_to_end"):
        named("yolo")
    with pytest.raises(ModelError, match="cannot import it"):
        named("no_such_module:Thing")


def test_a_contract_named_in_the_config_must_fit_and_auto_takes_the_first_that_does(tmp_path):
    heads = [TensorSpec("loc", "tensor(float)", ("b", 100, 4)), TensorSpec("conf", "tensor(float)", ("b", 100, 2))]
    assert recognise(heads, "auto", tmp_path / "m.onnx").name == "ssd_heads"
    with pytest.raises(ModelError, match="do not fit the retinanet_heads contract.*cls_logits"):
        recognise(heads, "retinanet_heads", tmp_path / "m.onnx")


def dense_model(path: Path, boxes: np.ndarray, scores: np.ndarray) -> Path:
    """A toy ONNX model: for a batch of B images, the same dense boxes [B, M, 4] and scores [B, M]."""
    import onnx
    from onnx import helper, numpy_helper

    nodes = [
        helper.make_node("Shape", ["images"], ["shape"]),
        helper.make_node("Slice", ["shape", "zero", "one"], ["batch"]),
        helper.make_node("Concat", ["batch", "ones2"], ["reps3"], axis=0),
        helper.make_node("Concat", ["batch", "ones1"], ["reps2"], axis=0),
        helper.make_node("Tile", ["box_rows", "reps3"], ["boxes"]),
        helper.make_node("Tile", ["score_rows", "reps2"], ["scores"]),
    ]
    constants = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in
                 (("zero", [0]), ("one", [1]), ("ones2", [1, 1]), ("ones1", [1]))]
    constants += [numpy_helper.from_array(boxes[None].astype(np.float32), "box_rows"),
                  numpy_helper.from_array(scores[None].astype(np.float32), "score_rows")]
    graph = helper.make_graph(
        nodes, "dense", [helper.make_tensor_value_info("images", onnx.TensorProto.FLOAT, ["b", 3, "h", "w"])],
        [helper.make_tensor_value_info("boxes", onnx.TensorProto.FLOAT, ["b", len(boxes), 4]),
         helper.make_tensor_value_info("scores", onnx.TensorProto.FLOAT, ["b", len(boxes)])], constants)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    return path


def test_a_contract_of_ones_own_runs_through_detect_devices_and_ray(tmp_path):
    """tests/toy_contract.py (one file) plugs in by model.contract: module:Class. The same records
    from one process, two --devices workers and a local Ray cluster; boxes in original pixels."""
    boxes = np.array([[10, 20, 110, 220], [0, 0, 5, 5], [320, 0, 640, 320]], np.float32)
    model = dense_model(tmp_path / "dense.onnx", boxes, np.array([0.95, 0.2, 0.99], np.float32))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT)])}
    common = ["--model", str(model), "--device", "cpu", "--batch-size", "2", "--set", "model.contract=toy_contract:DenseBoxes",
              "--set", "model.landmarks=0", "--set", "postprocess.score_threshold=0.5"]
    results = {}
    for how, extra in (("here", []), ("devices", ["--devices", "cpu,cpu"]), ("ray", ["--ray", "--workers", "1"])):
        out = tmp_path / how
        run = subprocess.run([sys.executable, "-m", "pipeline", "detect", str(SAMPLES), "--out", str(out), *common,
                              *extra], capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
        assert run.returncode == 0, (how, run.stderr[-3000:])
        results[how] = sorted(read_jsonl(out / "detections.jsonl"), key=lambda r: r["index"])
        assert json.loads((out / "summary.json").read_text())["model"]["contract"] == "dense_boxes"
    assert results["here"] == results["devices"] == results["ray"]
    hopper = next(r for r in results["here"] if r["path"].endswith("grace_hopper.jpg"))  # 512x600: scale 600/640
    assert [d["score"] for d in hopper["detections"]] == [0.99, 0.95]
    scale_xy = (546 / 512, 640 / 600)  # DALI's letterbox of 512x600 into 640x640: 546x640
    expected = [v / scale_xy[k % 2] for k, v in enumerate((10, 20, 110, 220))]
    assert hopper["detections"][1]["box"] == pytest.approx(expected, abs=0.01)
    assert hopper["detections"][0]["box"] == pytest.approx([320 / scale_xy[0], 0, 512, 320 / scale_xy[1]], abs=0.01)
