"""The Python API: Detector.from_config / run / stream(on_device=True), and the example that uses it."""

import itertools
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline import Detector, DeviceDetections, ImageError, ImageResult
from pipeline.errors import ConfigError
from pipeline.listing import list_images

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
def test_a_jpeg2000_file_finds_what_its_png_finds(tmp_path, device):
    """JPEG 2000 goes through Pillow, then DALI as decoded pixels, in a batch of its own between
    the files around it: the same face as the lossless PNG it was saved from, in input order."""
    import PIL.Image

    PIL.Image.open(SAMPLES / "astronaut.png").convert("RGB").save(tmp_path / "a.jp2", irreversible=False)
    paths = [str(SAMPLES / "grace_hopper.jpg"), str(tmp_path / "a.jp2"), str(SAMPLES / "astronaut.png")]
    results = list(Detector.from_config(device=device, batch_size=4).run(paths))
    assert [r.index for r in results] == [0, 1, 2] and all(isinstance(r, ImageResult) for r in results)
    assert len(results[1].scores) == len(results[2].scores) == 1 and (results[1].width, results[1].height) == (512, 512)
    assert np.abs(results[1].boxes_xyxy - results[2].boxes_xyxy).max() < 1


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


@cpu_and_cuda()
def test_the_documented_example_runs(device, tmp_path):
    """examples/python_api.py on a SOURCE given from another folder, which holds files that are no
    images and one cut short: every step reads that source, and the bad files are skipped."""
    source = samples_with_bad_files(tmp_path / "photos")
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "python_api.py"), str(source), "--device", device],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.count(": face ") == 3 and f"3 faces on {device}" in run.stdout
    assert run.stdout.count("skipped") == 2, run.stdout


def samples_with_bad_files(folder):
    """A copy of samples/ plus a JPEG cut short and a '.jpg' of random bytes."""
    import shutil

    shutil.copytree(SAMPLES, folder)
    data = (SAMPLES / "grace_hopper.jpg").read_bytes()
    (folder / "cut.jpg").write_bytes(data[:len(data) // 3])
    (folder / "noise.jpg").write_bytes(np.random.default_rng(0).bytes(100))
    return folder


def test_images_in_memory_are_taken_as_they_are_given(tmp_path):
    """Encoded bytes, PIL images, numpy HWC and torch CHW/HWC uint8 pixels (RGB), one bare image,
    and a generator read as it is needed: the faces each finds are those of its file; a value that
    is no image is an ImageError with a short label, never the data's repr."""
    import PIL.Image

    detector = Detector.from_config(device="cpu", batch_size=4)
    hopper = SAMPLES / "grace_hopper.jpg"
    rgb = np.asarray(PIL.Image.open(hopper).convert("RGB"))
    (single,) = detector.run(rgb)  # one image, not an iterable of rows
    assert single.path == "<array 0>" and len(single.scores) == 1 and (single.width, single.height) == (512, 600)
    given = [hopper.read_bytes(), PIL.Image.open(hopper), rgb, torch.from_numpy(rgb).permute(2, 0, 1),
             torch.from_numpy(rgb), torch.frombuffer(bytearray(hopper.read_bytes()), dtype=torch.uint8),
             str(hopper), {"not": "an image"}, np.zeros((4, 4), np.float32)]
    results = list(detector.run(iter(given)))
    endless = detector.run(itertools.repeat(str(hopper)))  # a generator is read as it is needed
    assert [len(r.scores) for r in itertools.islice(endless, 10)] == [1] * 10
    endless.close()
    found = {r.index: r for r in results if isinstance(r, ImageResult)}
    assert sorted(found) == list(range(7))
    boxes = [found[i].boxes_xyxy for i in range(7)]
    assert all(len(b) == 1 for b in boxes)
    assert max(np.abs(b - boxes[6]).max() for b in boxes) < 3  # decoded pixels: the file's, within a few px
    errors = {e.index: e for e in results if isinstance(e, ImageError)}
    assert [(i, e.reason, e.path) for i, e in sorted(errors.items())] == [
        (7, "bad_array", "<dict 7>"), (8, "bad_array", "<array 8>")]
    assert all(len(e.message) < 200 for e in errors.values())


def test_pil_images_that_cannot_load_or_are_16_bit_or_empty(tmp_path):
    """A PIL image is loaded when the detector takes it: one whose file is cut short, or closed,
    is an ImageError in its place (the images around it still found); a 16-bit one is scaled to 8
    bits as the decoder scales its file, so it finds the face its file does; an empty one is named."""
    import PIL.Image

    detector = Detector.from_config(device="cpu", batch_size=4)
    hopper = SAMPLES / "grace_hopper.jpg"
    data = hopper.read_bytes()
    (tmp_path / "cut.jpg").write_bytes(data[:len(data) // 2])
    closed = PIL.Image.open(hopper)
    closed.close()
    grey16 = np.asarray(PIL.Image.open(hopper).convert("L")).astype(np.uint16) * 257
    PIL.Image.fromarray(grey16).save(tmp_path / "grey16.png")
    opened16 = PIL.Image.open(tmp_path / "grey16.png")
    assert opened16.mode.startswith("I")  # what PIL's own convert("RGB") clips to almost white
    given = [PIL.Image.open(hopper), PIL.Image.open(tmp_path / "cut.jpg"), closed, opened16,
             PIL.Image.new("RGB", (0, 0)), str(tmp_path / "grey16.png")]
    results = list(detector.run(given))
    assert [type(r).__name__ for r in results] == ["ImageResult", "ImageError", "ImageError", "ImageResult",
                                                   "ImageError", "ImageResult"]
    assert [results[i].reason for i in (1, 2, 4)] == ["decode_failed", "decode_failed", "bad_array"]
    assert "PIL cannot load this image" in results[1].message and "empty image (0x0" in results[4].message
    assert len(results[3].scores) == len(results[5].scores) == 1
    assert np.abs(results[3].boxes_xyxy - results[5].boxes_xyxy).max() < 3
    grey = np.asarray(PIL.Image.open(hopper).convert("L"))  # a grey numpy array, as PIL's "L" image is taken
    as_array, as_pil = detector.run([grey, PIL.Image.fromarray(grey)])
    assert len(as_array.scores) == len(as_pil.scores) == 1 and np.allclose(as_array.boxes_xyxy, as_pil.boxes_xyxy)


def test_thresholds_per_call_and_a_read_only_config():
    import dataclasses

    import pytest

    detector = Detector.from_config(device="cpu", batch_size=8)
    default = sum(len(r.scores) for r in detector.run(str(SAMPLES)))
    looser = sum(len(r.scores) for r in detector.run(str(SAMPLES), score_threshold=0.3))
    capped = [len(r.scores) for r in detector.run(str(SAMPLES), score_threshold=0.3, max_detections=1)]
    assert looser > default == 3 and max(capped) == 1
    assert sum(len(r.scores) for r in detector.run(str(SAMPLES))) == default  # the next run: the config's again
    with pytest.raises(dataclasses.FrozenInstanceError):
        detector.config.postprocess.score_threshold = 0.1


@cpu_and_cuda()
def test_results_serialise_draw_and_stay_on_the_device_when_asked(tmp_path, device):
    import json

    from pipeline.cli import main

    detector = Detector.from_config(device=device, batch_size=8)
    results = list(detector.run(str(SAMPLES)))
    assert main(["detect", str(SAMPLES), "--out", str(tmp_path / "o"), "--device", device, "--batch-size", "8",
                 "--quiet"]) == 0
    lines = (tmp_path / "o" / "detections.jsonl").read_text().splitlines()
    assert [json.loads(json.dumps(r.to_dict())) for r in results] == [json.loads(line) for line in lines]
    drawn = next(r for r in results if len(r.scores)).draw()
    assert drawn.size == (512, 512) and drawn.mode == "RGB"
    on_device = list(detector.run(str(SAMPLES), on_device=True))
    assert all(r.boxes_xyxy.device.type == device for r in on_device)
    for a, b in zip(on_device, results):
        assert np.allclose(a.boxes_xyxy.cpu().numpy(), b.boxes_xyxy) and a.names == b.names
    assert json.dumps(on_device[0].to_dict()) == json.dumps(results[0].to_dict())


def test_on_error_hears_only_of_errors(tmp_path):
    (tmp_path / "bad.jpg").write_bytes(b"")
    detector = Detector.from_config(device="cpu", batch_size=2)
    heard = []
    refs = list_images(SAMPLES) + [list_images(tmp_path)[0]]
    list(detector.stream([type(r)(i, r.path) for i, r in enumerate(refs)], heard.append))
    assert [[e.reason for e in errors] for errors in heard] == [["empty"]]



def test_stream_takes_what_run_takes(tmp_path):
    """Plain paths, Path objects and images in memory, indexed by position, or a folder; a bad image
    goes to on_error."""
    (tmp_path / "text.jpg").write_text("not an image")
    detector = Detector.from_config(device="cpu", batch_size=2)
    astronaut = SAMPLES / "astronaut.png"
    items = [str(astronaut), tmp_path / "text.jpg", Image.open(astronaut), (SAMPLES / "china.jpg").read_bytes()]
    heard = []
    batches = list(detector.stream(items, heard.extend))
    assert sorted(r.index for b, _ in batches for r in b.refs) == [0, 2, 3]
    assert [(e.index, e.path) for e in heard] == [(1, str(tmp_path / "text.jpg"))]
    by_index = {r.index: n for b, found in batches for r, n in zip(b.refs, found.per_image(len(b.refs)))}
    assert len(by_index[0].scores) == len(by_index[2].scores) == 1  # the astronaut's face, from a path and from pixels
    folder = [r.path for b, _ in detector.stream(SAMPLES, heard.extend) for r in b.refs]  # a folder, as run takes it
    assert folder == [r.path for r in list_images(SAMPLES)] and len(heard) == 1

@cpu_and_cuda()
def test_the_readme_python_example_runs_as_written(device, tmp_path):
    """The README's Python API block, run as a script from the repository's root, on the device the
    default picks: the CPU where no GPU is visible, else the GPU."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Python API", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {})}
    samples_with_bad_files(tmp_path / "samples")  # the block's `samples`, with files that are no images in it
    run = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.count("astronaut.png") >= 1 and run.stdout.count("skipped") == 2


@pytest.mark.cuda
def test_cuda_tensors_go_to_dali_on_the_device():
    """uint8 pixels already on the GPU (torch, [3, H, W] as torchvision decodes them): the faces of
    the same pixels given on the host."""
    import PIL.Image

    detector = Detector.from_config(device="cuda", batch_size=4)
    rgb = np.asarray(PIL.Image.open(SAMPLES / "grace_hopper.jpg").convert("RGB"))
    on_gpu = torch.from_numpy(rgb).permute(2, 0, 1).cuda()
    host, device = list(detector.run([rgb, rgb])), list(detector.run([on_gpu, on_gpu]))
    assert [len(r.scores) for r in device] == [len(r.scores) for r in host] == [1, 1]
    assert np.abs(device[0].boxes_xyxy - host[0].boxes_xyxy).max() < 1


def test_a_buffer_the_caller_reuses_and_strided_arrays_are_read_as_given():
    """The stream reads ahead: a generator that refills one buffer for each image must still get
    each image's own result. Arrays that are views with strides are taken too."""
    import PIL.Image

    detector = Detector.from_config(device="cpu", batch_size=2)
    hopper = SAMPLES / "grace_hopper.jpg"
    rgb = np.asarray(PIL.Image.open(hopper).convert("RGB"))

    def refilled(n):
        buffer = rgb.copy()
        for k in range(n):
            buffer[:] = rgb if k % 2 == 0 else 0  # the face, then a black image
            yield buffer

    assert [len(r.scores) for r in detector.run(refilled(8))] == [1, 0] * 4
    encoded = np.frombuffer(hopper.read_bytes(), np.uint8)
    strided = [np.repeat(encoded, 2)[::2], rgb[:, ::-1], torch.from_numpy(rgb[:, ::-1].copy()).permute(2, 0, 1)]
    assert [len(r.scores) for r in detector.run(strided)] == [1, 1, 1]


@pytest.mark.cuda
def test_a_tensor_on_another_device_is_an_image_error():
    detector = Detector.from_config(device="cpu", batch_size=2)
    pixels = torch.zeros((64, 64, 3), dtype=torch.uint8, device="cuda")
    (error,) = detector.run([pixels])
    assert isinstance(error, ImageError) and error.reason == "bad_array"
    assert "cuda:0" in error.message and "cpu" in error.message


def test_results_come_in_input_order_with_errors_in_their_place(tmp_path):
    """The source's checks run ahead of the model: an error found early still comes after the
    results of the images before it."""
    (tmp_path / "empty.jpg").write_bytes(b"")
    photos = [str(p) for p in sorted(SAMPLES.glob("*.*")) if p.suffix != ".md"]
    given = (photos + [str(tmp_path / "empty.jpg")]) * 3
    detector = Detector.from_config(device="cpu", batch_size=2)
    results = list(detector.run(given))
    assert [r.index for r in results] == list(range(len(given)))
    assert [r.index for r in results if isinstance(r, ImageError)] == [6, 13, 20]


def test_per_call_thresholds_are_checked(tmp_path):
    import onnx

    detector = Detector.from_config(device="cpu", batch_size=2)
    for bad, key in [(dict(max_detections=0), "max_detections"), (dict(max_detections=2.5), "max_detections"),
                     (dict(score_threshold=-1), "score_threshold"), (dict(iou_threshold=0), "iou_threshold")]:
        with pytest.raises(ConfigError, match=key):
            next(detector.run(str(SAMPLES), **bad))
    assert len(list(detector.run(str(SAMPLES), max_detections=np.int64(1)))) == 6
    # A model that runs its own NMS at a fixed IoU (no iou_threshold input) cannot take another.
    model = onnx.load(ROOT / "models" / "retinaface_mnet025.onnx")
    (graph_input,) = [i for i in model.graph.input if i.name == "iou_threshold"]
    model.graph.input.remove(graph_input)
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array([0.4], np.float32), "iou_threshold"))
    onnx.save(model, tmp_path / "fixed_iou.onnx")
    fixed = Detector.from_config("retinaface_mnet025", device="cpu", model=str(tmp_path / "fixed_iou.onnx"),
                                 batch_size=2)  # RetinaFace's config, named: its channel order and mean
    with pytest.raises(ConfigError, match="no iou_threshold input"):
        next(fixed.run(str(SAMPLES), iou_threshold=0.6))
    assert sum(len(r.scores) for r in fixed.run(str(SAMPLES), score_threshold=0.5)) >= 3


@pytest.mark.cuda
def test_per_call_thresholds_on_the_gpu_are_captured_before_the_stream_runs(caplog):
    """The heads postprocess runs from CUDA graphs keyed on the thresholds: a run's own are
    captured as it starts, not mid-pipeline (where a capture fails and the graphs would go)."""
    detector = Detector.from_config(device="cuda", batch_size=4)
    default = [len(r.scores) for r in detector.run(str(SAMPLES))]
    looser = [len(r.scores) for r in detector.run(str(SAMPLES), score_threshold=0.3)]
    capped = [len(r.scores) for r in detector.run(str(SAMPLES), score_threshold=0.02, max_detections=2)]
    again = [len(r.scores) for r in detector.run(str(SAMPLES))]
    assert detector.postprocess.graphs.enabled and "capture failed" not in caplog.text
    assert default == again and sum(looser) > sum(default) and max(capped) == 2


def test_api_mistakes_are_named():
    with pytest.raises(ConfigError, match="a list of 'section.key=value' strings"):
        Detector.from_config(device="cpu", overrides="postprocess.score_threshold=0.5")
    for bad in ("score_threshold=0.5", "run.batch_sise=3"):  # named as the API calls them, not as the CLI does
        with pytest.raises(ConfigError, match=r"^overrides .*" + bad.split("=")[0]) as info:
            Detector.from_config(device="cpu", overrides=[bad])
        assert "--set" not in str(info.value)
    detector = Detector.from_config(device="cpu", batch_size=2)
    with pytest.raises(ConfigError, match="score_threshold: True must be a number"):
        next(detector.run(str(SAMPLES), score_threshold=True))


def test_import_gpudet_is_the_public_name():
    """`import gpudet` gives the API `pipeline` exports, from any folder."""
    run = subprocess.run([sys.executable, "-c", "import gpudet, pipeline; print(gpudet.Detector is pipeline.Detector, "
                          "gpudet.ImageError is pipeline.ImageError, gpudet.__version__ == pipeline.__version__)"],
                         cwd="/", capture_output=True, text=True, timeout=120)
    assert run.stdout.split() == ["True", "True", "True"], run.stderr


def test_result_boxes_in_the_forms_other_tools_take_and_as_a_table():
    detector = Detector.from_config(device="cpu")
    (result,) = detector.run(str(SAMPLES / "astronaut.png"))
    assert result.orig_shape == (512, 512) and len(result.scores) == 1
    (x1, y1, x2, y2), (cx, cy, w, h) = result.boxes_xyxy[0], result.xywh[0]
    assert np.allclose([cx, cy, w, h], [(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1])
    assert np.allclose(result.xyxyn * 512, result.boxes_xyxy) and np.allclose(result.xywhn * 512, result.xywh)
    assert result.to_json() == __import__("json").dumps(result.to_dict(), separators=(",", ":"))
    table = result.to_pandas()
    assert list(table.columns[:9]) == ["index", "path", "x1", "y1", "x2", "y2", "score", "label", "name"]
    assert len(table) == 1 and table.name[0] == "face" and len(table.landmarks[0]) == 5
    (on_device,) = detector.run(str(SAMPLES / "astronaut.png"), on_device=True)
    assert np.allclose(on_device.xywhn.cpu().numpy(), result.xywhn, atol=1e-6)
    import supervision as sv

    for found in (result.to_supervision(), on_device.to_supervision()):
        assert isinstance(found, sv.Detections) and len(found) == 1
        assert np.allclose(found.xyxy, result.boxes_xyxy) and list(found.data["class_name"]) == ["face"]
        assert found.class_id.tolist() == [0] and np.allclose(found.confidence, result.scores)


def test_draw_asks_for_an_image_given_in_memory_and_refuses_one_of_another_size():
    detector = Detector.from_config(device="cpu")
    photo = np.asarray(Image.open(SAMPLES / "astronaut.png").convert("RGB"))
    (result,) = detector.run(photo)
    with pytest.raises(ValueError, match=r"<array 0> was given in memory .* result\.draw\(image\)"):
        result.draw()
    assert result.draw(photo).size == (512, 512)
    with pytest.raises(ValueError, match="the image is 256x128 and <array 0>'s detections are in 512x512 pixels"):
        result.draw(photo[:128, :256])


def test_a_pil_image_is_turned_as_its_exif_orientation_says_like_its_file(tmp_path):
    """A photo stored on its side with EXIF orientation 6: as a path, as bytes and opened with PIL
    (also converted), it is the same upright image with the same face."""
    upright = Image.open(SAMPLES / "grace_hopper.jpg").convert("RGB")  # 512x600, one face
    exif = Image.Exif()
    exif[0x0112] = 6  # shown turned 90° clockwise: stored turned the other way
    upright.transpose(Image.Transpose.ROTATE_90).save(tmp_path / "turned.jpg", exif=exif, quality=95)
    detector = Detector.from_config(device="cpu")
    given = [str(tmp_path / "turned.jpg"), (tmp_path / "turned.jpg").read_bytes(), Image.open(tmp_path / "turned.jpg"),
             Image.open(tmp_path / "turned.jpg").convert("RGB")]
    results = list(detector.run(given))
    assert [(r.width, r.height, len(r.scores)) for r in results] == [(512, 600, 1)] * 4
    for r in results[1:]:
        assert np.abs(r.boxes_xyxy - results[0].boxes_xyxy).max() < 1.0


@cpu_and_cuda()
def test_a_class_filter_keeps_the_same_detections_on_the_host_and_on_the_device(device, tmp_path):
    """run(classes=) after a packed postprocess (anchor_free, CUDA graphs on a GPU) and after a
    dynamic one (end_to_end): the classes asked for, best first, the same with on_device=True."""
    from conftest import batched_constant_model, constant_model
    from pipeline import Detector

    centres = np.array([[100, 100, 40, 40], [300, 300, 80, 80], [500, 150, 60, 60], [200, 500, 50, 90]], np.float32)
    scores = np.array([[0.9, 0.1], [0.2, 0.8], [0.7, 0.05], [0.1, 0.6]], np.float32)  # per class: person, car
    head = np.concatenate([np.r_[centres, np.zeros((4, 4), np.float32)],
                           np.r_[scores, np.zeros((4, 2), np.float32)]], axis=1).T  # [6, 8]: a YOLOv8 head
    yolo = batched_constant_model(tmp_path / "yolo.onnx", {"output0": head}, input_shape=["b", 3, 640, 640],
                                  metadata={"names": "{0: 'person', 1: 'car'}"})
    e2e = constant_model(tmp_path / "e2e.onnx", {
        "boxes": np.array([[4, 4, 40, 40], [50, 50, 90, 90], [10, 60, 30, 90]], np.float32),
        "scores": np.array([0.95, 0.9, 0.6], np.float32), "batch_index": np.array([0, 0, 0], np.int64),
        "labels": np.array([0, 1, 1], np.int64)}, metadata={"names": "{0: 'person', 1: 'car'}"})
    for model, cars in ((yolo, [0.8, 0.6]), (e2e, [0.9, 0.6])):
        # run.cuda_graph off: these constant models compute their output shapes on the host, which
        # ORT cannot capture (the postprocess's own CUDA graphs, which this test is about, stay on)
        detector = Detector.from_config(device=device, model=str(model), overrides=[
            "model.landmarks=0", "preprocess.size=[640,640]", "preprocess.channel_order=RGB", "preprocess.mean=[0,0,0]",
            "preprocess.std=[255,255,255]", "run.cuda_graph=false"])
        for on_device in (False, True):
            (result,) = detector.run(str(SAMPLES / "astronaut.png"), classes=["car"], score_threshold=0.5,
                                     on_device=on_device)
            found = [float(s) for s in (result.scores.cpu().numpy() if on_device else result.scores)]
            assert result.names == ["car", "car"] and np.allclose(found, cars), (model.name, on_device, found)
