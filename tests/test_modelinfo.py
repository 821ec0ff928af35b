"""`gpudet inspect`."""

import json

import onnx
import pytest

from pipeline.cli import main

from conftest import ROOT


def test_inspect_reports_io_and_contract(capsys):
    assert main(["inspect", str(ROOT / "models" / "retinaface_mnet025.onnx")]) == 0
    text = capsys.readouterr().out
    assert "contract   end_to_end" in text and "input      input float [batch_size, 3, height, width]" in text
    assert "ai.onnx 11" in text
    assert main(["inspect", str(ROOT / "models" / "retinaface_mnet025_heads_640.onnx"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["contract"] == "ssd_heads" and info["image_input"]["size_hw"] == [640, 640]
    assert "loc float [batch_size, 16800, 4]" in info["outputs"]


def test_inspect_explains_a_model_that_fits_no_contract(tmp_path, capsys):
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", ["x"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3, 8, 8])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 3, 8, 8])])
    path = tmp_path / "identity.onnx"
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8), path)
    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "contract   none" in text and "y float [1, 3, 8, 8]" in text and "boxes (rank 2)" in text
    assert main(["inspect", str(tmp_path / "missing.onnx")]) == 2
    graph = onnx.helper.make_graph(  # and one with no image input at all
        [onnx.helper.make_node("Identity", ["x"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 10])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 10])])
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8), path)
    assert main(["inspect", str(path)]) == 0
    assert "image      none: " in capsys.readouterr().out


@pytest.mark.cuda
def test_inspect_shows_where_ort_places_the_nodes_on_a_gpu(capsys):
    """With a GPU, inspect says which nodes ORT runs off the CUDA EP: the end-to-end RetinaFace
    model keeps more shape arithmetic on the CPU (its NMS part) than the raw-heads model (on the
    H200 with ORT 1.31, in an ad-hoc run of the same profile: 37 and 14 nodes, no Memcpy nodes)."""
    assert main(["inspect", str(ROOT / "models" / "retinaface_mnet025.onnx"), "--json"]) == 0
    e2e = json.loads(capsys.readouterr().out)["cuda_placement"]
    assert main(["inspect", str(ROOT / "models" / "retinaface_mnet025_heads_640.onnx")]) == 0
    text = capsys.readouterr().out
    assert main(["inspect", str(ROOT / "models" / "retinaface_mnet025_heads_640.onnx"), "--json"]) == 0
    heads = json.loads(capsys.readouterr().out)["cuda_placement"]
    print("end-to-end:", e2e, "\nheads:", heads, "\n", text)
    assert e2e["nodes"]["CUDAExecutionProvider"] > 100 and heads["nodes"]["CUDAExecutionProvider"] > 100
    cpu = lambda p: p["nodes"].get("CPUExecutionProvider", 0)  # noqa: E731
    assert cpu(e2e) > cpu(heads) and sum(e2e["cpu_ops"].values()) == cpu(e2e)
    assert f"{heads['nodes']['CUDAExecutionProvider']} nodes on the GPU" in text and "Memcpy nodes:" in text
