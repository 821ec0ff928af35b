import re

import pytest

from pipeline.config import ConfigError, load_config, resolve_model_path

from conftest import ROOT, SAMPLES


def write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_default_config_is_the_embedded_retinaface():
    config = load_config()
    assert config.model.labels == ("face",) and config.preprocess.channel_order == "BGR"
    assert resolve_model_path(config).name == "retinaface_mnet025_heads_640_fp16_nhwc.onnx"  # a GPU's
    assert resolve_model_path(config, on_cpu=True).name == "retinaface_mnet025.onnx"  # the CPU's: float32
    given = load_config(None, ["model.path=mine.onnx", "model.cpu_path=null"])  # what --model sets
    assert given.model.cpu_path is None


@pytest.mark.parametrize("text, key", [
    ("model:\n  pathh: x.onnx\n", "model.pathh"),
    ("modle:\n  path: x.onnx\n", "'modle'"),
    ("run:\n  batch_size: eight\n", "run.batch_size"),
    ("run:\n  batch_size: 2.5\n", "run.batch_size"),
    ("preprocess:\n  resize: crop\n", "preprocess.resize"),
    ("preprocess:\n  mean: 3\n", "preprocess.mean"),
    ("preprocess:\n  mean: [1, 2]\n", "preprocess.mean"),
    ("postprocess:\n  score_threshold: 1.5\n", "postprocess.score_threshold"),
    ("run:\n  batch_size: 0\n", "run.batch_size"),
    ("run:\n  prefetch_batches: 0\n", "run.prefetch_batches"),
    ("run:\n  pipeline_depth: 1\n", "run.pipeline_depth"),
    ("preprocess:\n  hw_decoder_load: 1.5\n", "preprocess.hw_decoder_load"),
    ("run: 3\n", "'run'"),
    ("- a\n- b\n", "top level"),
    ("run: [\n", "not valid YAML"),
    ("postprocess: {score_threshold: 0.5}\npostprocess:\n  iou_threshold: 0.3\n", "line 2: 'postprocess' is given twice"),
    ("run:\n  batch_size: 8\n  batch_size: 16\n", "line 3: 'batch_size' is given twice"),
])
def test_bad_config_names_the_key(tmp_path, text, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.").replace("[", r"\[")):
        load_config(write(tmp_path, text))


def test_set_overrides_any_key_with_types_checked(tmp_path):
    config = load_config(None, ["postprocess.score_threshold=0.5", "run.batch_size=4", "preprocess.size=[320, 480]"])
    assert config.postprocess.score_threshold == 0.5 and config.run.batch_size == 4
    assert config.preprocess.size == (320, 480)
    with pytest.raises(ConfigError, match="run.nope"):
        load_config(None, ["run.nope=1"])
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["run.batch_size"])
    with pytest.raises(ConfigError, match="run.batch_size"):
        load_config(None, ["run.batch_size=many"])


def test_an_error_names_the_override_or_file_that_set_the_key(tmp_path):
    """A value a key refuses, by its type or by the config's checks, is named by the override
    that gave it (as the user wrote it), or by the file; the key follows."""
    from pipeline import Detector

    cases = [(lambda: load_config(None, ["run.batch_size=0"], origin="--set"), "--set run.batch_size=0: run.batch_size: "),
             (lambda: load_config(None, ["run.batch_size=0", "run.batch_size=2", "preprocess.size=[0, 9]"]),
              r"overrides preprocess.size=\[0, 9\]: preprocess.size: needs"),
             (lambda: load_config(None, [("--batch-size 0", "run.batch_size=0")]), "--batch-size 0: run.batch_size: "),
             (lambda: Detector.from_config(batch_size=0), "batch_size=0: run.batch_size: must be in"),
             (lambda: Detector.from_config(overrides=["postprocess.iou_threshold=x"]),
              "overrides postprocess.iou_threshold=x: postprocess.iou_threshold: expected float"),
             (lambda: load_config(write(tmp_path, "run:\n  batch_size: many\n")),
              re.escape(f"{tmp_path / 'c.yaml'}: run.batch_size: expected int"))]
    for make, match in cases:
        with pytest.raises(ConfigError, match="^" + match):
            make()
    assert load_config(None, ["run.batch_size=0", "run.batch_size=2"]).run.batch_size == 2  # the last one decides


def test_int_is_accepted_for_float_but_bool_is_not_an_int(tmp_path):
    assert load_config(write(tmp_path, "postprocess:\n  score_threshold: 1\n")).postprocess.score_threshold == 1.0
    with pytest.raises(ConfigError, match="run.batch_size"):
        load_config(write(tmp_path, "run:\n  batch_size: true\n"))


def test_missing_config_file_and_model_are_named(tmp_path):
    with pytest.raises(ConfigError, match="nothere.yaml"):
        load_config(tmp_path / "nothere.yaml")
    config = load_config(write(tmp_path, "model:\n  path: missing.onnx\n"))
    with pytest.raises(ConfigError, match="missing.onnx"):
        resolve_model_path(config)


def test_model_path_resolves_against_the_config_folder(tmp_path):
    (tmp_path / "m.onnx").write_bytes(b"x")
    config = load_config(write(tmp_path, "model:\n  path: m.onnx\n"))
    assert resolve_model_path(config) == (tmp_path / "m.onnx").resolve()


def test_a_model_option_resolves_against_the_working_folder_first(tmp_path, monkeypatch):
    """--model (the API's model=) m.onnx with an m.onnx here and another beside the config: this
    folder's, as a path typed on a command line means; the config's model.path m.onnx: the one
    beside the config."""
    from pipeline.config import option_overrides

    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "m.onnx").write_bytes(b"beside the config")
    (tmp_path / "m.onnx").write_bytes(b"here")
    monkeypatch.chdir(tmp_path)
    given = load_config(write(tmp_path / "cfg", "model:\n  path: m.onnx\n"), option_overrides(model="m.onnx"))
    assert resolve_model_path(given) == (tmp_path / "m.onnx").resolve()
    assert resolve_model_path(load_config(tmp_path / "cfg" / "c.yaml")) == (tmp_path / "cfg" / "m.onnx").resolve()


@pytest.mark.parametrize("name, fused", [("retinanet_r50_coco", True), ("retinaface_mnet025", True),
                                         ("retinaface_mnet025_e2e", False), ("retinaface_mnet025_heads", False)])
def test_only_the_configs_checked_on_a_gpu_ask_ort_to_fuse_the_conv_bias(name, fused):
    """fuse_conv_bias is on where the GPU tests compare it with the CPU (RetinaNet, the default
    RetinaFace config's float16 heads) and off elsewhere: on the H200, with the option on for every config, the
    RetinaFace models once found hundreds of faces in a photo of one (docs/BENCHMARKS.md)."""
    from pathlib import Path

    config = load_config(Path(__file__).parent.parent / "configs" / f"{name}.yaml")
    assert config.run.fuse_conv_bias == fused


def test_the_detector_hands_the_run_options_to_the_cuda_ep():
    """Detector.from_config turns run.* into ORT's CUDA EP options (kept by the engine also on the CPU)."""
    from pipeline import Detector

    detector = Detector.from_config(device="cpu", overrides=["run.prefer_nhwc=true", "run.fuse_conv_bias=true",
                                                             "run.tf32=false", "run.gpu_mem_limit_mb=64"])
    assert detector.engine.cuda_options == {"prefer_nhwc": "1", "fuse_conv_bias": "1", "use_tf32": "0",
                                            "gpu_mem_limit": str(64 << 20), "arena_extend_strategy": "kSameAsRequested"}


def test_the_api_keywords_are_type_checked_as_the_cli_options_are():
    """from_config(batch_size="8") would become run.batch_size=8 through the overrides' YAML:
    refused, as --batch-size refuses a non-number."""
    from pipeline import Detector

    for kwargs, match in (({"batch_size": "8"}, r"batch_size='8': give a whole number"),
                          ({"batch_size": 8.0}, "batch_size=8.0"), ({"batch_size": True}, "batch_size=True"),
                          ({"device": 0}, r"device=0: give one of")):
        with pytest.raises(ConfigError, match=match):
            Detector.from_config(**kwargs)


def test_fusing_the_conv_bias_needs_nhwc(tmp_path):
    """In NCHW cuDNN had no fused kernel for RetinaNet's stem on the H200 (the first batch failed
    deep in ORT): the config says so before any model loads."""
    with pytest.raises(ConfigError, match="run.fuse_conv_bias: needs run.prefer_nhwc"):
        load_config(write(tmp_path, "run:\n  fuse_conv_bias: true\n"))
    assert load_config(write(tmp_path, "run:\n  fuse_conv_bias: true\n  prefer_nhwc: true\n")).run.fuse_conv_bias


def test_a_shipped_config_is_found_by_its_name_and_a_folder_is_named_as_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/ folder here, as for a user of the installed package
    for name in ("retinaface_mnet025_e2e", "retinaface_mnet025_e2e.yaml"):
        assert load_config(name) == load_config(ROOT / "configs" / "retinaface_mnet025_e2e.yaml")
    (tmp_path / "mine.yaml").write_text("run: {batch_size: 3}\n")
    assert load_config("mine.yaml").run.batch_size == 3  # a file of the name here comes first
    with pytest.raises(ConfigError, match="is a folder"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match="does not exist.*retinanet_r50_coco"):
        load_config("retinanet")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("sub/retinaface_mnet025_e2e.yaml")  # a path with a folder means that folder


def one_box_model(path, **options):
    """A constant end_to_end model: one box of label 1 in image 0."""
    import numpy as np

    from conftest import constant_model

    return constant_model(path, {"boxes": np.array([[4, 4, 40, 40]], np.float32), "scores": np.array([0.99], np.float32),
                                 "batch_index": np.array([0], np.int64), "labels": np.array([1], np.int64)}, **options)


def test_a_model_without_its_config_gives_what_it_declares_and_names_what_is_guessed(tmp_path):
    """--model with no --config: the model's fixed input size and its class names (Ultralytics'
    `names` metadata) are taken, RetinaFace's channel order, mean and std are not: RGB 0..1 is
    guessed, with one warning naming the keys to set."""
    import json

    from conftest import gpudet

    model = one_box_model(tmp_path / "yolo.onnx", metadata={"names": "{0: 'person', 1: 'car'}"},
                          input_shape=[1, 3, 320, 320])
    run = gpudet("detect", SAMPLES / "astronaut.png", "--out", tmp_path / "o", "--model", model, "--device", "cpu",
                 "--set", "model.landmarks=0")
    assert run.returncode == 0, run.stderr
    warnings = [line for line in run.stderr.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and "yolo.onnx came without a config: gpudet takes its input size and class names " \
        "from it, and guesses what it does not say (channel_order RGB, mean [0,0,0], std [255,255,255]); if it was trained otherwise, set preprocess.channel_order, preprocess.mean, " \
        "preprocess.std" in warnings[0], run.stderr
    settings = json.loads((tmp_path / "o" / "settings.json").read_text())
    assert settings["model"]["labels"] == ["person", "car"] and settings["preprocess"]["size"] == [320, 320]
    (record,) = [json.loads(line) for line in (tmp_path / "o" / "detections.jsonl").read_text().splitlines()]
    assert record["detections"][0]["name"] == "car"


def test_what_the_user_sets_stays_and_labels_nobody_names_are_numbers(tmp_path):
    import json

    from conftest import gpudet

    model = one_box_model(tmp_path / "m.onnx")
    run = gpudet("detect", SAMPLES / "astronaut.png", "--out", tmp_path / "o", "--model", model, "--device", "cpu",
                 "--set", "model.landmarks=0", "--set", "preprocess.channel_order=BGR")
    assert run.returncode == 0, run.stderr
    assert "guesses what it does not say (mean [0,0,0], std [255,255,255], labels label numbers)" \
        in run.stderr and "channel_order" not in run.stderr, run.stderr
    settings = json.loads((tmp_path / "o" / "settings.json").read_text())
    assert settings["preprocess"]["channel_order"] == "BGR" and settings["model"]["labels"] == []
    (record,) = [json.loads(line) for line in (tmp_path / "o" / "detections.jsonl").read_text().splitlines()]
    assert record["detections"][0]["name"] == "1"


def test_a_model_gpudet_ships_keeps_the_embedded_config():
    from pipeline.config import load_config, option_overrides

    config = load_config(None, option_overrides(model="retinaface_mnet025_heads_640.onnx"))
    assert config.model.labels == ("face",) and config.preprocess.channel_order == "BGR"
