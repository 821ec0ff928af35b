"""The YOLO and DETR families' contracts: anchor_free against Ultralytics' own NMS on a YOLO11n
that Ultralytics builds (random weights, from its model YAML) and exports, with no download;
padded_end_to_end and set_prediction on small ONNX graphs with those families' outputs."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from conftest import ROOT, SAMPLES, batched_constant_model, cpu_and_cuda, gpudet, read_jsonl
from pipeline.postprocess import Thresholds


def ultralytics(code: str, folder: Path) -> None:
    """Run Python code that uses Ultralytics in a process of its own, in `folder`: importing it
    replaces PIL's Image.open for the whole process (its HEIF patch, which pip-installs a package on
    a file PIL cannot open), which the other tests must not inherit; its settings go into `folder`."""
    done = subprocess.run([sys.executable, "-c", code], cwd=folder, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "YOLO_CONFIG_DIR": str(folder / "settings")})
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def yolo11n(tmp_path_factory):
    """YOLO11n (COCO's 80 classes) with seeded random weights, exported by Ultralytics at 320x320
    with a dynamic batch: output0 [B, 84, 2100]."""
    folder = tmp_path_factory.mktemp("yolo")
    ultralytics("import torch\nfrom ultralytics import YOLO\ntorch.manual_seed(0)\n"
                "YOLO('yolo11n.yaml').export(format='onnx', simplify=False, imgsz=320, dynamic=True)\n", folder)
    return folder / "yolo11n.onnx"


def identity_meta(batch: int, height: int, width: int, device) -> torch.Tensor:
    """postprocess.image_meta of images that are the model input as they are (no resize, no pad)."""
    return torch.tensor([[1.0, 1.0, 0.0, 0.0, height, width]] * batch, device=device)


def yolo_head(rng, batch: int, positions: int, classes: int) -> np.ndarray:
    """A YOLOv8-style raw output [B, 4+K, N] as a trained head gives it: boxes (centre, size, in
    320x320 input pixels) clustered around a few objects, so that NMS has work, and distinct scores."""
    centres = rng.uniform(20, 300, (batch, 30, 2))
    pick = rng.integers(0, 30, (batch, positions))
    centre = np.take_along_axis(centres, pick[..., None], axis=1) + rng.normal(0, 6, (batch, positions, 2))
    size = rng.uniform(20, 120, (batch, positions, 2))
    scores = rng.random((batch, positions, classes)) ** 6
    return np.concatenate([centre, size, scores], axis=2).transpose(0, 2, 1).astype(np.float32)


@cpu_and_cuda()
def test_anchor_free_keeps_what_ultralytics_nms_keeps(device, tmp_path):
    """A head's raw output through gpudet's contract and through Ultralytics' own
    non_max_suppression: the same boxes (within 1 px), scores and classes, image by image, with
    hundreds of overlapping candidates per image."""
    from pipeline.contracts.anchor_free import AnchorFree

    raw = yolo_head(np.random.default_rng(0), 3, 2100, 80)
    np.save(tmp_path / "raw.npy", raw)
    settings = ((0.25, 0.7, 300), (0.05, 0.45, 100), (0.6, 0.5, 5))
    ultralytics("import numpy as np, torch\nfrom ultralytics.utils.nms import non_max_suppression\n"
                "raw = torch.from_numpy(np.load('raw.npy'))\n"
                f"for k, (c, i, m) in enumerate({settings!r}):\n"
                "    for b, kept in enumerate(non_max_suppression(raw, conf_thres=c, iou_thres=i, max_det=m)):\n"
                "        np.save(f'kept_{k}_{b}.npy', kept.numpy())\n", tmp_path)
    head = torch.from_numpy(raw).to(device)
    for k, (threshold, iou, cap) in enumerate(settings):
        found = AnchorFree(first=True, objectness=False, pre_nms_top_k=30000, device=torch.device(device))(
            {"output0": head}, identity_meta(3, 320, 320, device), num_images=3,
            thresholds=Thresholds(threshold, iou, cap)).to_host()
        for b in range(3):
            theirs = np.load(tmp_path / f"kept_{k}_{b}.npy")
            rows = found.batch_index == b
            ours = np.concatenate([found.boxes_xyxy[rows], found.scores[rows, None], found.labels[rows, None]], axis=1)
            assert len(ours) == len(theirs) > 0, (threshold, b, len(ours), len(theirs))
            ours = ours[np.argsort(-ours[:, 4], kind="stable")]
            theirs = theirs[np.argsort(-theirs[:, 4], kind="stable")]
            assert np.abs(ours[:, :4] - np.clip(theirs[:, :4], 0, 320)).max() <= 1.0
            assert np.allclose(ours[:, 4], theirs[:, 4], atol=1e-5) and (ours[:, 5] == theirs[:, 5]).all()


def test_a_yolo_export_runs_through_detect_and_devices_with_the_preset(yolo11n, tmp_path):
    """`gpudet detect --config yolo_coco --model yolo11n.onnx` recognises anchor_free and records
    COCO's names; --devices cpu,cpu gives the same records; inspect names the contract."""
    common = ["--config", "yolo_coco", "--model", yolo11n, "--device", "cpu", "--set", "preprocess.size=[320,320]",
              "--score-threshold", "0", "--set", "postprocess.max_detections=20"]  # random weights score ~1e-4
    one = gpudet("detect", SAMPLES, "--out", tmp_path / "one", *common)
    assert one.returncode == 0, one.stderr
    records = read_jsonl(tmp_path / "one" / "detections.jsonl")
    assert len(records) == 6 and all(len(r["detections"]) == 20 for r in records)
    names = {d["name"] for r in records for d in r["detections"]}
    coco = yaml.safe_load((ROOT / "configs" / "yolo_coco.yaml").read_text())["model"]["labels"]
    assert names and names <= set(coco)
    two = gpudet("detect", SAMPLES, "--out", tmp_path / "two", "--devices", "cpu,cpu", *common)
    assert two.returncode == 0, two.stderr
    assert sorted(read_jsonl(tmp_path / "two" / "detections.jsonl"), key=lambda r: r["index"]) == records
    inspect = gpudet("inspect", yolo11n)
    assert "anchor_free" in inspect.stdout, inspect.stdout


@pytest.fixture(scope="module")
def rtdetr(tmp_path_factory):
    """RT-DETR-l (COCO's 80 classes) with seeded random weights, built by Ultralytics from its model
    YAML and exported at 320x320 with a dynamic batch: output0 [B, 300, 6]."""
    folder = tmp_path_factory.mktemp("rtdetr")
    ultralytics("import torch\nfrom ultralytics import RTDETR\ntorch.manual_seed(0)\n"
                "RTDETR('rtdetr-l.yaml').export(format='onnx', simplify=False, imgsz=320, dynamic=True)\n", folder)
    return folder / "rtdetr-l.onnx"


@cpu_and_cuda()
def test_set_prediction_keeps_what_ultralytics_rtdetr_keeps(rtdetr, device, tmp_path):
    """The RT-DETR export's raw output through gpudet's contract and through Ultralytics' own
    RTDETRPredictor.postprocess, for two images stretched to 320x320 from other sizes: the same
    boxes (within 1 px), scores and classes; then the export through `gpudet detect` with the
    rtdetr_coco preset, recognised as set_prediction."""
    import onnxruntime as ort

    from pipeline.contracts.set_prediction import SetPrediction
    from pipeline.postprocess import image_meta

    images = np.random.default_rng(0).random((2, 3, 320, 320), dtype=np.float32)
    raw = ort.InferenceSession(str(rtdetr), providers=["CPUExecutionProvider"]).run(None, {"images": images})[0]
    np.save(tmp_path / "raw.npy", raw)
    sizes = [(480, 640), (300, 451)]
    settings = ((0.0, 300), (float(np.median(raw[..., 4])), 50))
    ultralytics("import numpy as np, torch\nfrom types import SimpleNamespace\n"
                "from ultralytics.models.rtdetr.predict import RTDETRPredictor\n"
                "raw = torch.from_numpy(np.load('raw.npy'))\n"
                f"for k, (conf, most) in enumerate({settings!r}):\n"
                "    p = RTDETRPredictor(overrides={'conf': conf, 'max_det': most, 'verbose': False})\n"
                "    p.model, p.batch = SimpleNamespace(names={i: str(i) for i in range(80)}), (['a', 'b'],)\n"
                f"    originals = [np.zeros((h, w, 3), np.uint8) for h, w in {sizes!r}]\n"
                "    for b, result in enumerate(p.postprocess(raw, None, originals)):\n"
                "        np.save(f'kept_{k}_{b}.npy', result.boxes.data.numpy())\n", tmp_path)
    contract = SetPrediction(activation="sigmoid", input_hw=(320, 320), device=torch.device(device), rows=True)
    orig_hw = np.array(sizes, np.int64)
    meta = image_meta(320 / orig_hw.astype(np.float32), np.zeros((2, 2), np.float32), orig_hw)
    for k, (threshold, cap) in enumerate(settings):
        found = contract({"output0": torch.from_numpy(raw).to(device)}, meta, num_images=2,
                         thresholds=Thresholds(threshold, 0.7, cap)).to_host()
        for b in range(2):
            theirs = np.load(tmp_path / f"kept_{k}_{b}.npy")
            rows = found.batch_index == b
            ours = np.concatenate([found.boxes_xyxy[rows], found.scores[rows, None], found.labels[rows, None]], axis=1)
            assert len(ours) == len(theirs) > 0, (threshold, b, len(ours), len(theirs))
            ours, theirs = (a[np.lexsort((a[:, 0], a[:, 1], -a[:, 4]))] for a in (ours, theirs))
            height, width = sizes[b]
            theirs[:, :4] = np.clip(theirs[:, :4], 0, [width, height, width, height])
            assert np.abs(ours[:, :4] - theirs[:, :4]).max() <= 1.0
            assert np.allclose(ours[:, 4], theirs[:, 4], atol=1e-5) and (ours[:, 5] == theirs[:, 5]).all()
    run = gpudet("detect", SAMPLES, "--out", tmp_path / "o", "--config", "rtdetr_coco", "--model", rtdetr, "--device",
                 device, "--set", "preprocess.size=[320,320]", "--score-threshold", "0")
    assert run.returncode == 0, run.stderr
    records = read_jsonl(tmp_path / "o" / "detections.jsonl")
    assert len(records) == 6 and all(len(r["detections"]) == 300 for r in records)
    assert '"set_prediction"' in (tmp_path / "o" / "summary.json").read_text()


def padded(rows: np.ndarray, size: int = 300) -> np.ndarray:
    out = np.zeros((size, 6), np.float32)
    out[:len(rows)] = rows
    return out


def test_padded_end_to_end_drops_the_padding_and_maps_boxes_to_the_image(tmp_path):
    """[B, 300, 6] rows (x1 y1 x2 y2 score class, model-input pixels) after zero padding, and the
    columns layout with num_dets: the same detections, best first, mapped from the 640x640
    letterbox back onto the 512x512 photo (scale 1.25), thresholded and capped."""
    rows = np.array([[64, 64, 320, 320, 0.6, 2], [320, 0, 640, 160, 0.95, 0], [0, 0, 10, 10, 0.2, 1]], np.float32)
    as_rows = batched_constant_model(tmp_path / "rows.onnx", {"output0": padded(rows)},
                                     metadata={"names": "{0: 'person', 1: 'bicycle', 2: 'car'}"})
    columns = batched_constant_model(tmp_path / "columns.onnx", {
        "boxes": padded(rows)[:, :4], "scores": np.r_[rows[:, 4], np.full(297, 0.99, np.float32)],  # padding scored
        "labels": padded(rows)[:, 5].astype(np.int64), "num_dets": np.array([3], np.int64)},
        metadata={"names": "{0: 'person', 1: 'bicycle', 2: 'car'}"})
    for model in (as_rows, columns):
        out = tmp_path / model.stem
        run = gpudet("detect", SAMPLES / "astronaut.png", "--out", out, "--model", model, "--device", "cpu",
                     "--set", "model.landmarks=0", "--score-threshold", "0.5")
        assert run.returncode == 0, run.stderr
        (record,) = read_jsonl(out / "detections.jsonl")
        assert [(d["name"], d["score"]) for d in record["detections"]] == [("person", 0.95), ("car", 0.6)]
        assert record["detections"][0]["box"] == [256.0, 0.0, 512.0, 128.0]  # clipped to the photo
        assert record["detections"][1]["box"] == [51.2, 51.2, 256.0, 256.0]
    capped = gpudet("detect", SAMPLES / "astronaut.png", "--out", tmp_path / "capped", "--model", as_rows, "--device",
                    "cpu", "--set", "model.landmarks=0", "--score-threshold", "0.1", "--set", "postprocess.max_detections=2")
    assert capped.returncode == 0, capped.stderr
    (record,) = read_jsonl(tmp_path / "capped" / "detections.jsonl")
    assert [d["score"] for d in record["detections"]] == [0.95, 0.6]


def test_model_outputs_maps_names_no_contract_knows(tmp_path):
    """An export that names its padded columns its own way is refused with a hint to map them;
    model.outputs maps them ({the contract's name: the model's}) and the records are those of the
    named export; a name the model lacks is one line naming its outputs."""
    rows = np.array([[320, 0, 640, 160, 0.95, 0], [64, 64, 320, 320, 0.6, 2]], np.float32)
    model = batched_constant_model(tmp_path / "own.onnx", {
        "det_b": padded(rows)[:, :4], "det_s": padded(rows)[:, 4], "det_c": padded(rows)[:, 5].astype(np.int64)})
    common = ["--model", model, "--device", "cpu", "--set", "model.landmarks=0", "--set", "model.labels=[a,b,c]",
              "--score-threshold", "0.5"]
    refused = gpudet("detect", SAMPLES / "astronaut.png", "--out", tmp_path / "refused", *common)
    assert refused.returncode == 2 and "model.outputs" in refused.stderr and "Traceback" not in refused.stderr
    mapped = gpudet("detect", SAMPLES / "astronaut.png", "--out", tmp_path / "mapped", *common,
                    "--set", "model.outputs={boxes: det_b, scores: det_s, labels: det_c}")
    assert mapped.returncode == 0, mapped.stderr
    (record,) = read_jsonl(tmp_path / "mapped" / "detections.jsonl")
    assert [(d["name"], d["score"], d["box"]) for d in record["detections"]] == [
        ("a", 0.95, [256.0, 0.0, 512.0, 128.0]), ("c", 0.6, [51.2, 51.2, 256.0, 256.0])]
    summary = (tmp_path / "mapped" / "summary.json").read_text()
    assert '"padded_end_to_end"' in summary
    wrong = gpudet("detect", SAMPLES / "astronaut.png", "--out", tmp_path / "wrong", *common,
                   "--set", "model.outputs={boxes: det_box, scores: det_s, labels: det_c}")
    assert wrong.returncode == 2 and "'det_box'" in wrong.stderr and "det_b float" in wrong.stderr
    assert len([line for line in wrong.stderr.splitlines() if "ERROR" in line]) == 1, wrong.stderr


@pytest.mark.parametrize("activation", ["sigmoid", "softmax"])
def test_set_prediction_scores_as_its_family_does_and_maps_normalised_boxes(tmp_path, activation):
    """logits [B, Q, K] and pred_boxes [B, Q, 4] (normalised centre-size): sigmoid takes the best Q
    (query, class) pairs over every class (RT-DETR), softmax each query's best class but the last
    (DETR's "no object"); boxes over the model input, through a stretch resize back to the photo."""
    queries, classes = 5, 4
    logits = np.full((queries, classes), -8.0, np.float32)
    logits[0, 1], logits[0, 2] = 4.0, 3.0  # query 0: two classes over the threshold (sigmoid keeps both)
    logits[3, 0] = 2.0
    boxes = np.tile(np.array([0.5, 0.5, 0.25, 0.5], np.float32), (queries, 1))
    boxes[3] = [0.1, 0.2, 0.2, 0.2]
    model = batched_constant_model(tmp_path / "detr.onnx", {"logits": logits, "pred_boxes": boxes})
    run = gpudet("detect", SAMPLES / "chelsea.png", "--out", tmp_path / "o", "--model", model, "--device", "cpu",
                 "--set", "model.landmarks=0", "--set", f"model.score_activation={activation}", "--set",
                 "preprocess.resize=stretch", "--set", "model.labels=[a,b,c,d]", "--score-threshold", "0.5")
    assert run.returncode == 0, run.stderr
    (record,) = read_jsonl(tmp_path / "o" / "detections.jsonl")
    width, height = record["width"], record["height"]  # chelsea.png: 451x300, stretched to 640x640
    centre = [0.5 * width - 0.125 * width, 0.25 * height, 0.5 * width + 0.125 * width, 0.75 * height]
    corner = [0.0, 0.1 * height, 0.2 * width, 0.3 * height]
    if activation == "sigmoid":
        expected = [("b", 1 / (1 + np.exp(-4.0)), centre), ("c", 1 / (1 + np.exp(-3.0)), centre),
                    ("a", 1 / (1 + np.exp(-2.0)), corner)]
    else:  # softmax over a, b, c (and d, "no object"), each query's best
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        p = e / e.sum(axis=1, keepdims=True)
        expected = [("a", p[3, 0], corner), ("b", p[0, 1], centre)]  # best first: query 3 is surer
    got = [(d["name"], d["score"], d["box"]) for d in record["detections"]]
    assert [g[0] for g in got] == [e[0] for e in expected], got
    for (_, score, box), (_, want_score, want_box) in zip(got, expected):
        assert abs(score - want_score) < 1e-4 and np.abs(np.array(box) - want_box).max() < 0.02


def test_the_families_are_told_apart_by_their_outputs():
    from pipeline.contracts import recognise
    from pipeline.session import TensorSpec

    def spec(name, *shape):
        return TensorSpec(name, "tensor(float)", shape)

    cases = {"anchor_free": [spec("output0", "batch", 84, "anchors")],
             "padded_end_to_end": [spec("output0", "batch", 300, 6)],
             "set_prediction": [spec("logits", "batch", 300, 80), spec("pred_boxes", "batch", 300, 4)],
             "end_to_end": [spec("boxes", "n", 4), spec("scores", "n"), spec("batch_index", "n")],
             "retinanet_heads": [spec("cls_logits", "b", 120087, 91), spec("bbox_regression", "b", 120087, 4)]}
    for expected, outputs in cases.items():
        assert recognise(outputs, "auto", Path("m.onnx")).name == expected
    single_class_v5 = [spec("output0", 1, 25200, 6)]  # dense: more rows than any padded list
    assert recognise(single_class_v5, "auto", Path("m.onnx")).name == "anchor_free"
    rtdetr = {"task": "detect", "head": "RTDETRDecoder", "end2end": "False"}  # Ultralytics' RT-DETR: its queries
    for outputs in ([spec("output0", "batch", "d1", "anchors")], [spec("output0", 1, 300, 6)]):
        assert recognise(outputs, "auto", Path("m.onnx"), rtdetr).name == "set_prediction"
    yolo = {"task": "detect", "head": "Detect", "end2end": "False"}
    assert recognise([spec("output0", "batch", "d1", "anchors")], "auto", Path("m.onnx"), yolo).name == "anchor_free"


@pytest.mark.cuda
def test_the_yolo_preset_replays_an_export_with_a_fixed_batch_as_a_cuda_graph(yolo11n, tmp_path):
    """run.cuda_graph auto (the yolo_coco preset) on a GPU: an export with a fixed batch runs as
    ORT's CUDA graph, the same weights exported with a dynamic batch run kernel by kernel (no
    error), and both record every image with as many detections as the cap allows."""
    from pipeline import Detector

    ultralytics("import torch\nfrom ultralytics import YOLO\ntorch.manual_seed(0)\n"
                "YOLO('yolo11n.yaml').export(format='onnx', simplify=False, imgsz=320, batch=4)\n", tmp_path)
    fixed = tmp_path / "yolo11n.onnx"
    sets = ["preprocess.size=[320,320]", "postprocess.score_threshold=0.0001", "postprocess.max_detections=20"]

    def found(model):
        detector = Detector.from_config("yolo_coco", model=str(model), device="cuda", batch_size=4, overrides=sets)
        return detector.engine.cuda_graph, [len(r.labels) for r in detector.run(str(SAMPLES))]

    assert found(fixed) == (True, [20] * 6)  # random weights score every position ~1e-4: the cap fills
    assert found(yolo11n) == (False, [20] * 6)
