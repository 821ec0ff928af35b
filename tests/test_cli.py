"""`gpudet detect` end to end, in-process and as a subprocess."""

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from pipeline.cli import main

from conftest import EXPECTED_FACES, ROOT, SAMPLES, cpu_and_cuda, cuda_usable, detect, read_jsonl


@cpu_and_cuda()
def test_samples_give_the_expected_faces_with_a_smaller_last_batch(tmp_path, device):
    assert detect(SAMPLES, "--out", tmp_path, "--batch-size", 4, "--device", device) == 0
    records = read_jsonl(tmp_path / "detections.jsonl")
    assert [r["index"] for r in records] == list(range(6))  # 6 images, batches of 4 + 2
    faces = {os.path.basename(r["path"]): len(r["detections"]) for r in records}
    assert faces == EXPECTED_FACES
    face = next(r for r in records if r["path"].endswith("astronaut.png"))["detections"][0]
    assert face["name"] == "face" and face["label"] == 0 and face["score"] > 0.99 and len(face["landmarks"]) == 5
    assert (tmp_path / "errors.jsonl").read_text() == ""
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["processed"] == 6 and summary["failed"] == 0 and summary["detections"] == 3
    # The default config: the float16 heads on a GPU, the float32 end-to-end model on the CPU
    assert summary["model"]["contract"] == {"cpu": "end_to_end", "cuda": "ssd_heads"}[device]
    assert summary["config"]["run"]["batch_size"] == 4
    assert set(summary["seconds"]) >= {"read", "preprocess", "engine", "postprocess", "write"}


def paste(canvas_wh, offset_xy):
    canvas = Image.new("RGB", canvas_wh, (90, 120, 100))
    canvas.paste(Image.open(SAMPLES / "astronaut.png").convert("RGB"), offset_xy)
    return canvas


def test_letterbox_maps_boxes_back_on_portrait_landscape_and_odd_canvases(tmp_path):
    # The astronaut's face, alone at native size (512x512 -> scale 1.25), then pasted at known
    # offsets into canvases of other shapes; boxes must move with the offset, in original pixels.
    (tmp_path / "in").mkdir()
    paste((512, 512), (0, 0)).save(tmp_path / "in" / "a_native.png")
    cases = {"b_portrait.png": ((700, 1500), (100, 900)), "c_landscape.png": ((1700, 600), (1111, 44)),
             "d_odd.jpg": ((641, 1279), (3, 701))}
    for name, (size, offset) in cases.items():
        paste(size, offset).save(tmp_path / "in" / name, quality=95)
    assert detect(tmp_path / "in", "--out", tmp_path / "out", "--device", "cpu") == 0
    records = {os.path.basename(r["path"]): r for r in read_jsonl(tmp_path / "out" / "detections.jsonl")}
    reference = np.array(records["a_native.png"]["detections"][0]["box"])
    for name, ((w, h), (ox, oy)) in cases.items():
        record = records[name]
        assert (record["width"], record["height"]) == (w, h)
        assert len(record["detections"]) == 1, name
        box = np.array(record["detections"][0]["box"]) - [ox, oy, ox, oy]
        model_px = 640 / max(w, h)  # model-input pixels per original pixel
        assert np.abs(box - reference).max() < 3 / model_px, (name, box, reference)


def test_bad_images_are_recorded_and_the_job_goes_on(tmp_path):
    (tmp_path / "in").mkdir()
    for name in ["astronaut.png", "china.jpg", "grace_hopper.jpg"]:
        shutil.copy(SAMPLES / name, tmp_path / "in" / name)
    (tmp_path / "in" / "empty.jpg").write_bytes(b"")
    (tmp_path / "in" / "text.jpg").write_text("not an image")
    jpeg = (SAMPLES / "grace_hopper.jpg").read_bytes()
    (tmp_path / "in" / "header_only.jpg").write_bytes(jpeg[:200])  # cut before the frame header
    (tmp_path / "in" / "truncated.jpg").write_bytes(jpeg[:len(jpeg) // 2])  # cut in the scan data
    (tmp_path / "list.txt").write_text("\n".join(["astronaut.png", "empty.jpg", "missing.jpg", "text.jpg",
                                                  "truncated.jpg", "china.jpg", "grace_hopper.jpg",
                                                  "header_only.jpg"]) + "\n")
    code = detect(tmp_path / "list.txt", "--root", tmp_path / "in", "--out", tmp_path / "out", "--batch-size", 8,
                  "--device", "cpu")
    assert code == 3
    done = read_jsonl(tmp_path / "out" / "detections.jsonl")
    errors = read_jsonl(tmp_path / "out" / "errors.jsonl")
    assert sorted(r["index"] for r in done) == [0, 5, 6]
    assert {e["index"]: e["reason"] for e in errors} == {1: "empty", 2: "missing", 3: "unknown_format",
                                                         4: "truncated", 7: "bad_header"}
    assert all(e["path"].endswith(name) for e, name in zip(sorted(errors, key=lambda e: e["index"]), [
        "empty.jpg", "missing.jpg", "text.jpg", "truncated.jpg", "header_only.jpg"]))
    assert [len(r["detections"]) for r in sorted(done, key=lambda r: r["index"])] == [1, 0, 1]


def test_usage_and_config_errors_exit_2(tmp_path, capsys):
    assert detect(SAMPLES, "--out", tmp_path, "--set", "run.batch_sise=3") == 2
    assert "--set run.batch_sise" in capsys.readouterr().err  # named as the command line takes it
    # a value a key refuses is named by the option that gave it, then the key
    assert detect(SAMPLES, "--out", tmp_path, "--set", "postprocess.score_threshold=abc") == 2
    assert "--set postprocess.score_threshold=abc: postprocess.score_threshold: expected float" in \
        capsys.readouterr().err
    assert detect(SAMPLES, "--out", tmp_path, "--batch-size", "0") == 2
    assert "--batch-size 0: run.batch_size: must be in 1..4096" in capsys.readouterr().err
    assert detect(SAMPLES, "--out", tmp_path, "--model", tmp_path / "none.onnx") == 2
    assert "none.onnx" in capsys.readouterr().err
    assert detect(tmp_path / "no_such_dir", "--out", tmp_path) == 2
    (tmp_path / "bad.onnx").write_bytes(b"not onnx")
    assert detect(SAMPLES, "--out", tmp_path, "--model", tmp_path / "bad.onnx") == 2
    assert "bad.onnx" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["detect", str(SAMPLES)])  # --out missing
    assert info.value.code == 2
    capsys.readouterr()
    for wrong in (["--frobnicate"], ["extra_source"]):  # named with the command's usage, not gpudet's
        with pytest.raises(SystemExit) as info:
            main(["detect", str(SAMPLES), "--out", str(tmp_path), *wrong])
        err = capsys.readouterr().err
        assert info.value.code == 2 and err.startswith("usage: gpudet detect ") and \
            f"gpudet detect: error: unrecognized arguments: {wrong[0]}" in err, err
    pngs = sorted(str(p) for p in SAMPLES.glob("*.png"))  # what the shell makes of an unquoted samples/*.png
    with pytest.raises(SystemExit) as info:
        main(["detect", *pngs, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"({len(pngs)} paths, where detect takes one source: the shell expanded an " \
        "unquoted glob; quote it, gpudet detect 'photos/*.jpg', or give a folder or a file list)" in err, err
    for option, value in (("--limit", "0"), ("--iterations", "0"), ("--passes", "0"), ("--naive-limit", "0"),
                          ("--latency", "-1"), ("--limit", "-3")):  # counts gpudet bench cannot run with
        with pytest.raises(SystemExit) as info:
            main(["bench", str(SAMPLES), option, value])
        err = capsys.readouterr().err
        assert info.value.code == 2 and f"argument {option}: {value}: must be at least" in err, err


def test_a_run_that_writes_nothing_leaves_no_folder_it_made(tmp_path, capsys):
    """A new --out whose run stops before any record (the model is not found) is removed again,
    with the parents the run made for it; a folder that was there before stays, and so does one
    that holds records."""
    assert detect(SAMPLES, "--out", tmp_path / "new" / "out", "--model", tmp_path / "none.onnx") == 2
    assert "none.onnx" in capsys.readouterr().err
    assert not (tmp_path / "new").exists() and tmp_path.is_dir()
    (tmp_path / "mine").mkdir()
    assert detect(SAMPLES, "--out", tmp_path / "mine", "--model", tmp_path / "none.onnx") == 2
    assert (tmp_path / "mine").is_dir()
    assert detect(SAMPLES, "--out", tmp_path / "done", "--device", "cpu") == 0
    assert detect(SAMPLES, "--out", tmp_path / "done", "--model", tmp_path / "none.onnx", "--resume") == 2
    assert (tmp_path / "done" / "detections.jsonl").stat().st_size > 0


def test_format_choices_are_the_writers_and_help_stays_light():
    """--format's choices are the output formats sinks writes; `--help` parses them without
    importing sinks (numpy, orjson)."""
    from pipeline.cli import OUTPUT_FORMATS
    from pipeline.sinks import FORMATS

    assert OUTPUT_FORMATS == FORMATS
    code = ("import sys, contextlib, io\nfrom pipeline.cli import main\n"
            "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
            "    main(['detect', '--help'])\nprint('numpy' in sys.modules, 'pipeline.sinks' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert run.stdout.split() == ["False", "False"], run.stderr


@pytest.mark.skipif(cuda_usable(), reason="checks the error on a machine without a usable GPU")
def test_device_cuda_without_a_gpu_is_an_error_not_a_fallback(tmp_path, capsys):
    assert detect(SAMPLES, "--out", tmp_path, "--device", "cuda") == 2
    assert "device cuda: " in capsys.readouterr().err


def test_python_dash_m_and_the_console_script(tmp_path):
    listing = tmp_path / "list.txt"
    listing.write_text(f"{SAMPLES / 'astronaut.png'}\n")
    run = subprocess.run([sys.executable, "-m", "pipeline", "detect", str(listing), "--out", str(tmp_path / "o"),
                          "--device", "cpu"], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert "1/1 images, 1 detection," in run.stdout
    assert len(read_jsonl(tmp_path / "o" / "detections.jsonl")) == 1
    if importlib.metadata.packages_distributions().get("pipeline") is None:
        pytest.skip("gpudet is not pip-installed here (PYTHONPATH checkout): no console script to check")
    gpudet = shutil.which("gpudet", path=os.path.dirname(sys.executable))
    assert gpudet and subprocess.run([gpudet, "--version"], capture_output=True, text=True).stdout.startswith("gpudet")
    as_module = subprocess.run([sys.executable, "-m", "gpudet", "--version"], capture_output=True, text=True,
                               cwd=tmp_path)  # the public name, as `import gpudet`
    assert as_module.returncode == 0 and as_module.stdout.startswith("gpudet "), as_module.stderr


@pytest.mark.cuda
def test_gpu_and_cpu_give_the_same_detections(tmp_path):
    """The default command on each device (float16 heads on the GPU, float32 on the CPU)."""
    for device in ("cpu", "cuda"):
        assert detect(SAMPLES, "--out", tmp_path / device, "--device", device) == 0
    cpu, gpu = (read_jsonl(tmp_path / d / "detections.jsonl") for d in ("cpu", "cuda"))
    assert [r["path"] for r in cpu] == [r["path"] for r in gpu]
    for a, b in zip(cpu, gpu):
        assert len(a["detections"]) == len(b["detections"]), a["path"]
        for da, db in zip(a["detections"], b["detections"]):
            assert np.abs(np.array(da["box"]) - db["box"]).max() <= 3.0, (a["path"], da["box"], db["box"])
            assert np.abs(np.array(da["landmarks"]) - db["landmarks"]).max() <= 3.0
            assert abs(da["score"] - db["score"]) < 0.01


def test_file_names_that_are_not_utf8_are_written_and_read_back(tmp_path):
    folder = os.fsencode(tmp_path / "in")
    os.mkdir(folder)
    good, empty = folder + b"/caf\xe9.jpg", folder + b"/empty\xff.jpg"  # Latin-1 names: any bytes but / and NUL
    shutil.copy(SAMPLES / "grace_hopper.jpg", good)
    open(empty, "wb").close()
    shutil.copy(SAMPLES / "china.jpg", folder + "/北京.jpg".encode())
    assert detect(os.fsdecode(folder), "--out", tmp_path / "out", "--device", "cpu") == 3  # one image failed
    records = read_jsonl(tmp_path / "out" / "detections.jsonl")
    assert sorted(os.fsencode(r["path"]) for r in records) == sorted([good, folder + "/北京.jpg".encode()])
    assert [len(r["detections"]) for r in records if r["path"].endswith("jpg") and "caf" in r["path"]] == [1]
    errors = read_jsonl(tmp_path / "out" / "errors.jsonl")
    assert [(os.fsencode(e["path"]), e["reason"]) for e in errors] == [(empty, "empty")]


def test_resume_counts_earlier_failures_and_retry_failed_processes_them_again(tmp_path, capsys):
    """exit 3 while errors.jsonl lists failures, also for a --resume that had nothing new fail;
    --retry-failed processes them again once they are fixed."""
    listing = tmp_path / "list.txt"
    later = tmp_path / "later.jpg"
    listing.write_text(f"{SAMPLES / 'grace_hopper.jpg'}\n{later}\n")
    out = tmp_path / "out"
    assert detect(listing, "--out", out, "--device", "cpu") == 3
    later.write_bytes((SAMPLES / "china.jpg").read_bytes())  # the missing file, fixed
    capsys.readouterr()
    assert detect(listing, "--out", out, "--device", "cpu", "--resume") == 3
    assert f"(nothing left to process)\n        results in {out}/detections.jsonl, errors in {out}/errors.jsonl" \
        in capsys.readouterr().out  # the failure the exit code counts, and where it is
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["already_done"], summary["already_failed"], summary["failed"]) == (2, 1, 0)
    assert detect(listing, "--out", out, "--device", "cpu", "--retry-failed") == 2  # needs --resume
    assert detect(listing, "--out", out, "--device", "cpu", "--resume", "--retry-failed") == 0
    assert read_jsonl(out / "errors.jsonl") == []
    assert sorted(r["index"] for r in read_jsonl(out / "detections.jsonl")) == [0, 1]
    assert detect(listing, "--out", out, "--device", "cpu", "--workers", "2") == 2  # --workers without --ray


def test_resume_of_a_finished_run_builds_no_detector(tmp_path):
    """Every image recorded: --resume says there is nothing left, leaves the records as they are and
    loads no model, DALI or torch (in a process of its own, so the imports are its own)."""
    out = tmp_path / "out"
    assert detect(SAMPLES, "--out", out, "--device", "cpu") == 0
    records = (out / "detections.jsonl").read_bytes()
    code = ("import sys; from pipeline.cli import main; "
            f"rc = main(['detect', {str(SAMPLES)!r}, '--out', {str(out)!r}, '--resume']); "
            "print(rc, [m for m in ('torch', 'nvidia.dali', 'triton') if m in sys.modules])")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0 and run.stdout.splitlines()[-1] == "0 []", run.stdout + run.stderr
    assert "0/6 images (+6 done before), 0 detections, 0 failed" in run.stdout
    assert "(nothing left to process)" in run.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["already_done"], summary["processed"], summary["detections"]) == (6, 0, 0)
    assert (out / "detections.jsonl").read_bytes() == records and read_jsonl(out / "errors.jsonl") == []


def test_retry_failed_with_another_source_is_refused_before_anything_is_emptied(tmp_path):
    listing = tmp_path / "list.txt"
    listing.write_text(f"{SAMPLES / 'china.jpg'}\n{tmp_path / 'nope.jpg'}\n")
    out = tmp_path / "out"
    assert detect(listing, "--out", out, "--device", "cpu") == 3
    other = tmp_path / "other.txt"
    other.write_text(f"{SAMPLES / 'camera.png'}\n{tmp_path / 'nope.jpg'}\n")
    assert detect(other, "--out", out, "--device", "cpu", "--resume", "--retry-failed") == 2
    assert [e["reason"] for e in read_jsonl(out / "errors.jsonl")] == ["missing"]  # still there


def test_inspect_finds_a_bundled_model_by_its_name_as_detect_does(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # not in the working folder: gpudet's models/
    assert main(["inspect", "retinaface_mnet025.onnx", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["path"] == str(ROOT / "models" / "retinaface_mnet025.onnx")
    assert main(["inspect", "nothere.onnx"]) == 2
    assert main(["inspect", "retinaface_mnet025", "--json"]) == 0  # as --config takes a name without .yaml
    assert json.loads(capsys.readouterr().out)["path"] == str(ROOT / "models" / "retinaface_mnet025.onnx")


def test_a_url_of_a_scheme_gpudet_does_not_read_is_named_as_such(tmp_path, capsys):
    assert detect("ftp://host/photos/a.jpg", "--out", tmp_path / "o") == 2
    assert "gpudet reads no ftp:// URLs" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_a_path_option_given_empty_is_one_line_and_writes_nowhere(tmp_path, monkeypatch, capsys):
    """--out "" (an unset shell variable) is refused, never taken as the working folder; so are
    --save-drawings, --model and --annotations, and a --classes that names nothing."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    for argv, option in [(["detect", str(SAMPLES), "--out", ""], "--out"),
                         (["detect", str(SAMPLES), "--out", "o", "--save-drawings", ""], "--save-drawings"),
                         (["detect", str(SAMPLES), "--out", "o", "--model", ""], "--model"),
                         (["draw", "run", "--out", ""], "--out"),
                         (["export", "run", "--format", "csv", "--out", ""], "--out"),
                         (["eval", "run", "--annotations", ""], "--annotations"),
                         (["draw", "", "--out", "d"], "the records (DETECTIONS)"),
                         (["inspect", ""], "the model (MODEL)"),
                         (["detect", str(SAMPLES), "--out", "o", "--config", ""], "--config"),
                         (["detect", str(SAMPLES), "--out", "o", "--root", ""], "--root"),
                         (["detect", str(SAMPLES), "--out", "o", "--classes", " , "], "--classes ' , ' names no class")]:
        assert main([*argv, "--quiet"]) == 2, argv
        err = capsys.readouterr().err
        assert option in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_commands_reading_records_say_when_a_run_is_unfinished(tmp_path, capsys):
    """An output folder whose run stopped before its records (a killed --devices run leaves only
    shards) names itself and --resume; records of an interrupted run come with a warning."""
    assert detect(SAMPLES, "--out", tmp_path / "o", "--quiet") == 0
    (tmp_path / "o" / "detections.jsonl").unlink()
    assert main(["export", str(tmp_path / "o"), "--format", "csv", "--out", str(tmp_path / "d.csv"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'o'} is a gpudet output folder that holds no records yet" in err and \
        f"--out {tmp_path / 'o'} --resume" in err, err
    assert detect(SAMPLES, "--out", tmp_path / "o", "--overwrite", "--quiet") == 0
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    resumed = {"interrupted": True, "already_done": 3, "already_failed": 1, "processed": 1, "failed": 0}
    (tmp_path / "o" / "summary.json").write_text(json.dumps({**summary, **resumed}))  # done before: failed ones too
    assert main(["export", str(tmp_path / "o"), "--format", "csv", "--out", str(tmp_path / "d.csv")]) == 0
    assert "its run was stopped after 4 of its 6 images, so these records are not all of its images" in \
        capsys.readouterr().err
    (tmp_path / "o" / "summary.json").write_text(json.dumps({**summary, "interrupted": True}))  # after its last
    assert main(["export", str(tmp_path / "o"), "--format", "csv", "--out", str(tmp_path / "d.csv")]) == 0
    assert "stopped" not in capsys.readouterr().err


def test_classes_and_score_threshold_options_keep_what_they_say(tmp_path):
    """--classes by name or number and --score-threshold, on a model of two classes; the API's
    run(classes=) alike; a class the model does not name is one line, exit 2."""
    import numpy as np

    from conftest import constant_model, gpudet, one_clear_line
    from pipeline import Detector

    model = constant_model(tmp_path / "two.onnx", {
        "boxes": np.array([[4, 4, 40, 40], [50, 50, 90, 90], [10, 60, 30, 90]], np.float32),
        "scores": np.array([0.95, 0.9, 0.6], np.float32), "batch_index": np.array([0, 0, 0], np.int64),
        "labels": np.array([0, 1, 1], np.int64)}, metadata={"names": "{0: 'person', 1: 'car'}"})
    image = SAMPLES / "astronaut.png"

    def names(*options) -> list[str]:
        out = tmp_path / f"o{len(list(tmp_path.iterdir()))}"
        run = gpudet("detect", image, "--out", out, "--model", model, "--device", "cpu", "--set", "model.landmarks=0",
                     *options)
        assert run.returncode == 0, run.stderr
        (record,) = read_jsonl(out / "detections.jsonl")
        return [d["name"] for d in record["detections"]]

    assert names("--score-threshold", "0.5") == ["person", "car", "car"]
    assert names("--score-threshold", "0.5", "--classes", "car") == ["car", "car"]
    assert names("--classes", "0") == ["person"]  # at the default threshold, 0.9
    assert names("--classes", "person,1", "--score-threshold", "0.91") == ["person"]
    one_clear_line(gpudet("detect", image, "--out", tmp_path / "x", "--model", model, "--device", "cpu",
                          "--classes", "bus"), 2, "--classes bus: postprocess.classes: 'bus' is not a class (the model's "
                                                  "are person, car)")
    assert not (tmp_path / "x").exists()
    detector = Detector.from_config(device="cpu", model=str(model), overrides=["model.landmarks=0"])
    (result,) = detector.run(str(image), classes=["car"], score_threshold=0.5)
    assert result.names == ["car", "car"] and list(result.labels) == [1, 1]
    (result,) = detector.run(str(image), classes="person", score_threshold=0.5)  # one class, as a string
    assert result.names == ["person"]
