"""What an adversarial user meets: one clear line and the documented exit code, never a traceback;
one writer per output folder; inputs that hang, lie or sit behind links. Real subprocesses, real
signals, a real lock contention, a real FIFO."""

import json
import logging
import os
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ROOT, SAMPLES, gpudet, one_clear_line, read_jsonl, wait_for_lines


def test_a_list_with_a_name_that_is_not_utf8_runs_and_records_it(tmp_path):
    listing = tmp_path / "l.txt"
    listing.write_bytes(b"b\xff.jpg\n" + str(SAMPLES / "china.jpg").encode() + b"\n")
    run = gpudet("detect", listing, "--out", tmp_path / "o", "--device", "cpu")
    assert run.returncode == 3, run.stderr[-2000:]
    (error,) = read_jsonl(tmp_path / "o" / "errors.jsonl")
    assert os.fsencode(error["path"]) == os.fsencode(tmp_path) + b"/b\xff.jpg" and error["reason"] == "missing"
    assert len(read_jsonl(tmp_path / "o" / "detections.jsonl")) == 1


def test_a_fifo_and_a_device_in_the_list_are_refused_without_hanging(tmp_path):
    os.mkfifo(tmp_path / "f.jpg")
    listing = tmp_path / "l.txt"
    listing.write_text(f"{tmp_path / 'f.jpg'}\n/dev/zero\n{SAMPLES / 'china.jpg'}\n")
    run = gpudet("detect", listing, "--out", tmp_path / "o", "--device", "cpu", timeout=120)
    assert run.returncode == 3, run.stderr[-2000:]
    reasons = {e["path"]: e["reason"] for e in read_jsonl(tmp_path / "o" / "errors.jsonl")}
    assert reasons == {str(tmp_path / "f.jpg"): "not_a_file", "/dev/zero": "not_a_file"}


def damaged_copies(good: Path, rng: random.Random, *, cuts: tuple[int, ...]) -> list[str]:
    """Copies of an image file beside it, cut short at each percentage of `cuts`, and four with 20
    bytes changed (two within the first 4 KB, the headers; two anywhere); their names, in order."""
    data, ext = good.read_bytes(), good.suffix
    names = []
    for pct in cuts:
        names.append(f"cut{pct}{ext}")
        (good.parent / names[-1]).write_bytes(data[:len(data) * pct // 100])
    for j in range(4):
        changed = bytearray(data)
        for _ in range(20):
            changed[rng.randrange(8, 4096 if j < 2 else len(data))] = rng.randrange(256)
        names.append(f"flip{j}{ext}")
        (good.parent / names[-1]).write_bytes(bytes(changed))
    return names


def test_corrupt_jpeg2000_files_are_recorded_and_the_job_goes_on(tmp_path):
    """JPEG 2000 files cut short or with bytes changed, one after another: each is a decode_failed
    record and the good images around them are found (DALI's own JPEG 2000 decoder could end the
    process with SIGSEGV on such a pair; gpudet decodes JPEG 2000 with Pillow)."""
    import PIL.Image

    good = tmp_path / "good.jp2"
    PIL.Image.open(SAMPLES / "astronaut.png").convert("RGB").save(good)
    names = damaged_copies(good, random.Random(7), cuts=(3, 30, 70, 97))
    listing = tmp_path / "l.txt"
    listing.write_text("\n".join(names[:4] + ["good.jp2"] + names[4:] + [str(SAMPLES / "china.jpg")]) + "\n")
    run = gpudet("detect", listing, "--out", tmp_path / "o", "--device", "cpu", "--batch-size", "2")
    assert run.returncode == 3, (run.returncode, run.stderr[-2000:])
    found = {r["index"]: r for r in read_jsonl(tmp_path / "o" / "detections.jsonl")}
    failed = {e["index"]: e for e in read_jsonl(tmp_path / "o" / "errors.jsonl")}
    assert sorted([*found, *failed]) == list(range(10))
    assert {0, 1, 2, 3} <= set(failed) and {4, 9} <= set(found)  # cut short: never an image; good ones found
    assert len(found[4]["detections"]) == 1 and (found[4]["width"], found[4]["height"]) == (512, 512)
    assert all(e["reason"] == "decode_failed" and "jpeg2000" in e["message"] for e in failed.values())


def test_a_run_accepted_then_stopped_before_it_starts_leaves_the_folder_as_it_was(tmp_path):
    """--resume --retry-failed and --overwrite are accepted by the folder, then the detector is not
    built (a device that is not there, a model file that is not ONNX): the records, errors.jsonl,
    summary.json and settings.json stay as the run before left them, byte for byte."""
    source = tmp_path / "img"
    source.mkdir()
    (source / "a.jpg").write_bytes((SAMPLES / "china.jpg").read_bytes())
    (source / "b.jpg").write_bytes(b"")
    out = tmp_path / "o"
    assert gpudet("detect", source, "--out", out, "--device", "cpu").returncode == 3
    files = ("detections.jsonl", "errors.jsonl", "summary.json", "settings.json")
    before = {name: (out / name).read_bytes() for name in files}
    (tmp_path / "bad.onnx").write_text("not a model")
    for extra in (["--resume", "--retry-failed", "--device", "cuda:99"], ["--overwrite", "--device", "cuda:99"],
                  ["--overwrite", "--model", tmp_path / "bad.onnx", "--device", "cpu"],
                  ["--overwrite", "--model", tmp_path / "bad.onnx", "--devices", "cpu,cpu"]):
        one_clear_line(gpudet("detect", source, "--out", out, *extra), 2)
        assert {name: (out / name).read_bytes() for name in files} == before, extra
        assert sorted(p.name for p in out.iterdir()) == sorted([*files, ".gpudet.lock"])
    one_clear_line(gpudet("detect", source, "--out", tmp_path / "new" / "sub", "--model", tmp_path / "bad.onnx",
                          "--device", "cpu"), 2)
    assert not (tmp_path / "new").exists()  # the folders it made for a run that never started, gone again


def test_resume_without_format_keeps_parquet_before_its_first_file(tmp_path):
    """A Parquet run whose records so far are all failures (errors.jsonl only; its detections folder
    made, empty, as after a kill before the first file): --resume without --format goes on in
    Parquet, not JSONL beside it."""
    (tmp_path / "empty.jpg").write_bytes(b"")
    listing = tmp_path / "l.txt"
    listing.write_text(f"{tmp_path / 'empty.jpg'}\n")
    out = tmp_path / "o"
    assert gpudet("detect", listing, "--out", out, "--format", "parquet", "--device", "cpu").returncode == 3
    assert not list((out / "detections.parquet").iterdir())
    listing.write_text(f"{tmp_path / 'empty.jpg'}\n{SAMPLES / 'china.jpg'}\n")
    run = gpudet("detect", listing, "--out", out, "--resume", "--device", "cpu")
    assert run.returncode == 3, run.stderr[-2000:]
    assert not (out / "detections.jsonl").exists() and len(list((out / "detections.parquet").iterdir())) == 1
    assert json.loads((out / "summary.json").read_text())["format"] == "parquet"


def test_an_empty_source_is_refused_not_taken_as_this_folder(tmp_path):
    one_clear_line(gpudet("detect", "", "--out", tmp_path / "o", "--device", "cpu", cwd=SAMPLES), 2,
                   "the source is empty")
    assert not (tmp_path / "o").exists()
    one_clear_line(gpudet("detect", "a" * 300 + ".jpg", "--out", tmp_path / "o", "--device", "cpu"), 2,
                   "does not exist")


def test_a_file_list_not_named_txt_is_named_before_any_setup(tmp_path):
    """A text file of paths named paths.lst, given as the source: one line saying a list's name
    ends in .txt (it was taken as one image, recorded as unknown_format after the model's setup);
    a text file named .jpg is still an image that fails, with its record."""
    (tmp_path / "paths.lst").write_text(f"{SAMPLES / 'china.jpg'}\n")
    one_clear_line(gpudet("detect", tmp_path / "paths.lst", "--out", tmp_path / "o", "--device", "cpu"), 2,
                   "holds text, not an image", "rename it paths.txt")
    (tmp_path / "t.jpg").write_text("not an image\n")
    run = gpudet("detect", tmp_path / "t.jpg", "--out", tmp_path / "j", "--device", "cpu")
    assert run.returncode == 3 and read_jsonl(tmp_path / "j" / "errors.jsonl")[0]["reason"] == "unknown_format"


@pytest.fixture
def unprivileged(tmp_path_factory):
    """(a folder this test's unprivileged user can reach, the command prefix that runs as that
    user): nobody through setpriv where the tests run as root (whom no permission stops), else
    the user itself."""
    import shutil
    import tempfile

    if os.geteuid() != 0:
        prefix = []
    elif shutil.which("setpriv"):
        prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    else:
        pytest.skip("running as root without setpriv: no user whom a permission stops")
    folder = Path(tempfile.mkdtemp(prefix="gpudet-perm-"))
    folder.chmod(0o777)
    if subprocess.run([*prefix, sys.executable, "-c", "import pipeline"], cwd=ROOT).returncode:
        shutil.rmtree(folder)
        pytest.skip("the unprivileged user cannot run this Python")
    yield folder, prefix
    for path in folder.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    shutil.rmtree(folder)


def test_what_cannot_be_read_is_named_one_line_or_warned(unprivileged):
    """An unreadable list, a source behind an unreadable folder and an unreadable source folder
    are one line and exit 2; an unreadable folder inside the source is named in a warning, the
    images beside it processed."""
    folder, prefix = unprivileged
    (folder / "imgs" / "locked").mkdir(parents=True)
    (folder / "imgs" / "a.jpg").write_bytes((SAMPLES / "china.jpg").read_bytes())
    (folder / "imgs" / "locked" / "b.jpg").write_bytes((SAMPLES / "china.jpg").read_bytes())
    (folder / "list.txt").write_text(f"{folder / 'imgs' / 'a.jpg'}\n")
    (folder / "list.txt").chmod(0)
    (folder / "imgs" / "locked").chmod(0)

    def run(source, out):
        return subprocess.run([*prefix, sys.executable, "-m", "pipeline", "detect", str(source), "--out",
                               str(folder / out), "--device", "cpu"], cwd=ROOT, capture_output=True, text=True,
                              timeout=300, env={**os.environ, "HOME": str(folder)})

    (folder / "imgs" / "nosearch").mkdir()  # its names can be listed, not looked at
    (folder / "imgs" / "nosearch" / "c.jpg").write_bytes((SAMPLES / "china.jpg").read_bytes())
    (folder / "imgs" / "nosearch").chmod(0o444)
    (folder / "closed").mkdir()
    (folder / "closed").chmod(0)
    one_clear_line(run(folder / "list.txt", "o1"), 2, "list.txt: cannot read it")
    one_clear_line(run(folder / "imgs" / "a.jpg", "closed/new/out"), 2, "cannot be made")
    one_clear_line(run(folder / "imgs" / "locked" / "b.jpg", "o2"), 2, "cannot look at it")
    one_clear_line(run(folder / "imgs" / "locked", "o3"), 2, "locked: cannot read it")
    partly = run(folder / "imgs", "o4")
    assert partly.returncode == 3 and "Traceback" not in partly.stderr, partly.stderr[-2000:]
    assert f"WARNING: {folder / 'imgs' / 'locked'}: cannot read this folder" in partly.stderr
    assert [r["path"] for r in read_jsonl(folder / "o4" / "detections.jsonl")] == [str(folder / "imgs" / "a.jpg")]
    assert [(e["path"], e["reason"]) for e in read_jsonl(folder / "o4" / "errors.jsonl")] == [
        (str(folder / "imgs" / "nosearch" / "c.jpg"), "unreadable")]


@pytest.mark.parametrize("damage", [b"this is not json\n", b"[1, 2]\n", b"\x00" * 64 + b"\n", b"{}\n",
                                    b'{"index": [0], "path": "a.jpg"}\n'],
                         ids=["text", "not-an-object", "nul-bytes", "no-index", "index-not-a-number"])
def test_resume_over_a_damaged_records_file_names_the_line(tmp_path, damage):
    """A line of detections.jsonl that is no record (edited by hand, or NUL bytes a crash of the
    machine left) stops --resume with one line naming the file and the line, exit 2."""
    out = tmp_path / "o"
    assert gpudet("detect", SAMPLES, "--out", out, "--device", "cpu").returncode == 0
    lines = (out / "detections.jsonl").read_bytes().splitlines(keepends=True)
    (out / "detections.jsonl").write_bytes(b"".join(lines[:2] + [damage] + lines[2:]))
    one_clear_line(gpudet("detect", SAMPLES, "--out", out, "--resume", "--device", "cpu"), 2,
                   "detections.jsonl: line 3 is not a record gpudet wrote", "remove that line")


def test_resume_with_another_source_is_refused_naming_both_paths(tmp_path):
    """A list given by a relative path records its images' paths as they resolved from the folder
    the run ran in: a --resume from elsewhere is refused, naming the recorded path and this
    source's, and from the same folder it goes on."""
    (tmp_path / "lists").mkdir()
    (tmp_path / "lists" / "l.txt").write_text(f"../a.jpg\n{SAMPLES / 'china.jpg'}\n")
    (tmp_path / "a.jpg").write_bytes((SAMPLES / "grace_hopper.jpg").read_bytes())
    out = tmp_path / "o"
    assert gpudet("detect", "lists/l.txt", "--out", out, "--device", "cpu", cwd=tmp_path).returncode == 0
    one_clear_line(gpudet("detect", tmp_path / "lists" / "l.txt", "--out", out, "--device", "cpu", "--resume"), 2,
                   "record 0 (lists/../a.jpg) is not of this source, whose image 0 is "
                   f"{tmp_path / 'lists' / '../a.jpg'}", "from the folder that run ran in")
    assert gpudet("detect", "lists/l.txt", "--out", out, "--device", "cpu", "--resume", cwd=tmp_path).returncode == 0


def slow_list(tmp_path: Path, count: int = 400) -> Path:
    listing = tmp_path / "slow.txt"
    listing.write_text("".join(f"{SAMPLES / 'grace_hopper.jpg'}\n" for _ in range(count)))
    return listing


def start(listing: Path, out: Path, *extra) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pipeline", "detect", str(listing), "--out", str(out), "--device",
                             "cpu", "--batch-size", "2", "--set", "run.num_threads=1", *map(str, extra)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_second_run_into_a_folder_in_use_is_refused_naming_the_first(tmp_path):
    out = tmp_path / "out"
    first = start(slow_list(tmp_path), out)
    try:
        wait_for_lines(out / "detections.jsonl", 2)
        second = gpudet("detect", SAMPLES, "--out", out, "--device", "cpu", "--resume")
        one_clear_line(second, 2, "in use by another gpudet run", f"pid {first.pid}")
    finally:
        first.send_signal(signal.SIGINT)
        first.communicate(timeout=120)
    assert first.returncode == 130
    records = read_jsonl(out / "detections.jsonl")
    assert len(records) == len({r["index"] for r in records})  # the first run's lines, whole and once each


def test_overwrite_then_kill_leaves_no_summary_of_another_run(tmp_path):
    out = tmp_path / "out"
    assert gpudet("detect", SAMPLES, "--out", out, "--device", "cpu").returncode == 0
    assert json.loads((out / "summary.json").read_text())["processed"] == 6
    process = start(slow_list(tmp_path), out, "--overwrite")
    deadline = time.monotonic() + 120
    while b'"index":10,' not in (out / "detections.jsonl").read_bytes():  # the new run's records, not the old
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.05)
    process.kill()
    process.communicate()
    assert not (out / "summary.json").exists()


def test_an_interrupt_during_the_imports_ends_with_130_not_an_error(tmp_path):
    """SIGINT while torch, DALI and ORT are being imported (their C code turned an interrupt into an
    ImportError, or the process into -SIGINT or an abort, until signals were held back while they
    load): exit 130 and one line, every time."""
    rng = random.Random(5)
    codes = []
    for k in range(6):
        process = subprocess.Popen([sys.executable, "-m", "pipeline", "detect", str(SAMPLES), "--out",
                                    str(tmp_path / f"o{k}"), "--device", "cpu"], cwd=ROOT, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        time.sleep(rng.uniform(0.2, 1.2))
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=120)
        assert process.returncode in (0, 130) and "Traceback" not in stderr, (process.returncode, stderr[-2000:])
        codes.append(process.returncode)
    assert 130 in codes


@pytest.mark.parametrize("setting, words", [
    ("preprocess.size=[100000,100000]", ["preprocess.size", "1..16384"]),
    ("preprocess.size=[8000,8000]", ["run.batch_size", "GiB"]),
    ("run.batch_size=1000000000000", ["run.batch_size", "1..4096"]),
    ("run.num_threads=100000", ["run.num_threads"]),
    ("model.landmarks=3", ["model.landmarks: 3", "set model.landmarks: 5"]),
    ("preprocess.mean=[.nan,117,127]", ["preprocess.mean[0]", "not a finite number"]),
])
def test_settings_that_cannot_run_are_refused_before_the_run(tmp_path, setting, words):
    run = gpudet("detect", SAMPLES, "--out", tmp_path / "o", "--device", "cpu", "--set", setting)
    one_clear_line(run, 2, *words)
    assert not (tmp_path / "o" / "errors.jsonl").exists() or not read_jsonl(tmp_path / "o" / "errors.jsonl")


def test_a_config_that_is_not_yaml_and_a_model_path_that_does_not_exist(tmp_path):
    one_clear_line(gpudet("detect", SAMPLES, "--out", tmp_path / "o", "--config", "/bin/ls"), 2, "/bin/ls",
                   "not a text file")
    run = gpudet("detect", SAMPLES, "--out", tmp_path / "o", "--model", "nodir/retinaface_mnet025.onnx")
    one_clear_line(run, 2, "nodir/retinaface_mnet025.onnx", "not found")


@pytest.mark.parametrize("where", ["a file", "under a file", "/proc/nope"])
def test_an_output_folder_that_cannot_be_made_is_one_line(tmp_path, where):
    (tmp_path / "f").touch()
    out = {"a file": tmp_path / "f", "under a file": tmp_path / "f" / "sub", "/proc/nope": "/proc/nope"}[where]
    one_clear_line(gpudet("detect", SAMPLES, "--out", out, "--device", "cpu"), 2, f"--out {out}")


def test_symbolic_links_planted_in_the_output_folder_are_never_written_through(tmp_path):
    assert gpudet("detect", SAMPLES, "--out", tmp_path / "o", "--device", "cpu").returncode == 0  # gpudet's folder
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    for name in ("detections.jsonl", "summary.json"):
        (tmp_path / "o" / name).unlink()
        (tmp_path / "o" / name).symlink_to(victim)
        one_clear_line(gpudet("detect", SAMPLES, "--out", tmp_path / "o", "--device", "cpu", "--overwrite"), 2,
                       "symbolic link", name)
        (tmp_path / "o" / name).unlink()
    assert victim.read_text() == "precious\n"


def test_eval_of_a_file_that_is_not_detections_or_not_ground_truth(tmp_path):
    images = {"images": [{"id": 1, "file_name": "astronaut.png"}], "categories": [{"id": 1, "name": "face"}]}
    annotations, ground_truth = tmp_path / "ann.json", tmp_path / "gt.json"
    annotations.write_text(json.dumps(images))
    ground_truth.write_text(json.dumps({**images, "annotations": []}))
    one_clear_line(gpudet("eval", ROOT / "README.md", "--annotations", ground_truth), 2, "README.md is not "
                   "detections.jsonl, detections.parquet or an output folder")
    (tmp_path / "d.jsonl").write_text("# not a record\n")
    one_clear_line(gpudet("eval", tmp_path / "d.jsonl", "--annotations", ground_truth), 2, "d.jsonl: line 1 is not a "
                   "record gpudet wrote")
    assert gpudet("detect", SAMPLES, "--out", tmp_path / "o", "--device", "cpu").returncode == 0
    one_clear_line(gpudet("eval", tmp_path / "o" / "detections.jsonl", "--annotations", annotations), 2,
                   "no 'annotations' list")


def test_a_closed_stdout_is_not_a_failure_of_the_run(tmp_path):
    run = subprocess.run(f"set -o pipefail; {sys.executable} -m pipeline detect samples --out {tmp_path / 'o'} "
                         "--device cpu | true", shell=True, cwd=ROOT, capture_output=True, text=True,
                         executable="/bin/bash")
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert len(read_jsonl(tmp_path / "o" / "detections.jsonl")) == 6


def test_a_file_size_limit_is_exit_4_saying_so_and_resume_finishes(tmp_path):
    """ulimit -f: the write fails with EFBIG (Python ignores SIGXFSZ); what was written stays whole,
    and the batch whose write failed leaves no part of a line (the file readable line by line as
    it is left)."""
    listing = tmp_path / "list.txt"
    listing.write_text("".join(f"{p}\n" for p in sorted(SAMPLES.glob("*.*")) if p.suffix != ".md") * 40)
    out = tmp_path / "o"

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (8000, 8000))

    run = gpudet("detect", listing, "--out", out, "--device", "cpu", "--batch-size", "8", preexec_fn=limit)
    one_clear_line(run, 4, "file size limit", "--resume")
    before = (out / "detections.jsonl").read_bytes()
    assert 0 < len(before) <= 8000 and before.endswith(b"\n")
    assert all(json.loads(line)["index"] >= 0 for line in before.splitlines())
    resumed = gpudet("detect", listing, "--out", out, "--device", "cpu", "--batch-size", "8", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert sorted(r["index"] for r in read_jsonl(out / "detections.jsonl")) == list(range(240))


def test_a_batch_of_large_images_is_decoded_in_parts(tmp_path):
    """preprocess.max_batch_pixels bounds what one DALI batch decodes: eight images of 1 MP at a
    budget of 2.5 MP go to DALI two at a time, and every image is still processed once."""
    from PIL import Image

    from pipeline import Detector
    from pipeline.listing import list_images

    for k in range(8):
        Image.open(SAMPLES / "grace_hopper.jpg").resize((1000, 1000)).save(tmp_path / f"big{k}.png")
    detector = Detector.from_config(device="cpu", batch_size=8, overrides=["preprocess.max_batch_pixels=2500000"])
    fed = []
    submit = detector.preprocessor.submit
    detector.preprocessor.submit = lambda batch: (fed.append(len(batch)), submit(batch))[1]
    found = [r.index for b, _ in detector.stream(list_images(tmp_path), lambda errors: None) for r in b.refs]
    assert fed == [2, 2, 2, 2] and sorted(found) == list(range(8))


CONFIG_KEYS = {
    "model": ["path", "cpu_path", "contract", "labels", "landmarks", "anchor_strides", "anchor_sizes",
              "box_variances"],
    "preprocess": ["size", "resize", "channel_order", "mean", "std", "pad_value", "decoder", "max_pixels",
                   "max_file_mb", "max_batch_pixels", "hw_decoder_load"],
    "postprocess": ["score_threshold", "iou_threshold", "max_detections", "pre_nms_top_k", "compile"],
    "run": ["batch_size", "device", "num_threads", "prefetch_batches", "pipeline_depth", "gpu_mem_limit_mb",
            "prefer_nhwc", "fuse_conv_bias", "tf32", "oom_retry", "cuda_graph", "worker_restarts"],
}
VALUES = st.one_of(st.integers(-10**15, 10**15), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
                   st.none(), st.text(max_size=12), st.lists(st.integers(-5, 100000), max_size=4),
                   st.lists(st.floats(-1e6, 1e6), max_size=4), st.just("[[1, 2], [3]]"))


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(section=st.sampled_from(sorted(CONFIG_KEYS)), data=st.data(), value=VALUES)
def test_fuzz_config_overrides_never_raise_anything_but_a_config_error(section, data, value):
    """Any --set value for any key: a config that loads, or ConfigError naming the key, never
    another exception (the values that pass are then checked to build on this machine below)."""
    from pipeline.config import ConfigError, load_config

    key = data.draw(st.sampled_from(CONFIG_KEYS[section]))
    text = value if isinstance(value, str) and value.startswith("[[") else json.dumps(value)
    try:
        load_config(None, [f"{section}.{key}={text}"])
    except ConfigError as e:
        assert f"{section}.{key}" in str(e) or "overrides" in str(e)


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(lines=st.lists(st.one_of(st.binary(max_size=20), st.sampled_from([b"#c", b" ", b"\r", b"\xef\xbb\xbf", b"~",
                                                                          b"~a\x00", b"a.jpg", b" a.jpg "])),
                     max_size=8))
def test_fuzz_list_syntax_never_raises(tmp_path_factory, lines):
    """Any bytes in a file list: a list of refs (every line kept as a path, or skipped as blank or
    a comment) or SourceError for a list of none; never another exception."""
    from pipeline.errors import SourceError
    from pipeline.listing import list_images

    listing = tmp_path_factory.mktemp("list") / "l.txt"
    listing.write_bytes(b"\n".join(line.replace(b"\n", b"") for line in lines))
    try:
        refs = list_images(listing)
    except SourceError:
        return
    assert [r.index for r in refs] == list(range(len(refs))) and all(isinstance(r.path, str) for r in refs)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(base=st.sampled_from(["/data", "/", ".", "rel/dir", "/data/", "/a//b"]),
       text=st.text(alphabet="ab./~ #", max_size=12).filter(lambda t: t.strip() and not t.startswith("#")))
def test_a_listed_path_resolves_as_pathlib_would(base, text):
    """listing.resolved joins the plain names of a list (neither blank nor a comment) by hand: the
    same string pathlib gives."""
    from pipeline.listing import resolved

    item = Path(os.path.expanduser(text))  # ~user/x for a user that does not exist stays as written
    assert resolved(str(Path(base)), text) == str(item if item.is_absolute() else Path(base) / item)  # base: a Path


def test_log_json_holds_with_corrupt_images_in_the_list(tmp_path):
    """The decoders print their complaints about a truncated or garbled file to stderr, a line per
    row it misses or a bare libjpeg message, naming no file: gpudet logs them at debug, so stderr
    holds only gpudet's own lines (with --log-json one JSON object a line), and errors.jsonl names
    the files."""
    data = (SAMPLES / "grace_hopper.jpg").read_bytes()
    (tmp_path / "cut.jpg").write_bytes(data[:len(data) // 2])  # no end marker: refused before DALI
    (tmp_path / "short_scan.jpg").write_bytes(data[:len(data) // 2] + b"\xff\xd9")  # its scan ends early: decoded
    (tmp_path / "cut.png").write_bytes((SAMPLES / "astronaut.png").read_bytes()[:2000])  # refused before DALI
    garbled = bytearray((SAMPLES / "china.jpg").read_bytes())
    garbled[garbled.index(b"\xff\xda") + 5] = 0xFF  # the scan's first component ID: no such component
    (tmp_path / "garbled.jpg").write_bytes(garbled)
    listing = tmp_path / "list.txt"
    listing.write_text(f"{tmp_path / 'cut.jpg'}\n{tmp_path / 'short_scan.jpg'}\n{tmp_path / 'cut.png'}\n"
                       f"{tmp_path / 'garbled.jpg'}\n"
                       f"{SAMPLES / 'china.jpg'}\n")
    debug = gpudet("detect", listing, "--out", tmp_path / "debug", "--device", "cpu", "--log-level", "DEBUG")
    assert debug.returncode == 3 and "DEBUG: library: Corrupt JPEG data" in debug.stderr  # they complain
    assert "DEBUG: library: Invalid component ID 255 in SOS" in debug.stderr
    plain = gpudet("detect", listing, "--out", tmp_path / "plain", "--device", "cpu")  # the default: not a line of it
    assert plain.returncode == 3 and "Corrupt JPEG" not in plain.stderr and "library" not in plain.stderr, plain.stderr
    run = gpudet("detect", listing, "--out", tmp_path / "o", "--device", "cpu", "--log-json", "--log-level", "INFO")
    assert run.returncode == 3, run.stderr[-2000:]
    entries = [json.loads(line) for line in run.stderr.splitlines()]
    assert entries and entries[-1]["message"] == "run finished" and "libjpeg" not in run.stderr
    assert sorted(e["reason"] for e in read_jsonl(tmp_path / "o" / "errors.jsonl")) == \
        ["decode_failed", "truncated", "truncated"]  # the short scan decodes, with its complaints
    quiet = gpudet("detect", listing, "--out", tmp_path / "q", "--device", "cpu", "--quiet")
    assert quiet.returncode == 3 and quiet.stderr == "", quiet.stderr[-2000:]


def test_a_librarys_colour_codes_and_parser_lines_stay_off_the_log(tmp_path):
    """DALI's image parsers write coloured lines ("[ERROR] [png_parser] ..." in ANSI red) about a
    bad file: logged at debug without the escape codes, so neither the terminal at the default
    level nor a --log-json line carries them."""
    script = tmp_path / "s.py"
    script.write_text(
        "import logging, os\n"
        "from pipeline.errors import setup_logging, stderr_into_log\n"
        "from pipeline.errors import decoder_level\n"
        "setup_logging(level='DEBUG', as_json=True)\n"
        "with stderr_into_log('library', decoder_level):\n"
        "    os.write(2, b'\\x1b[0;31m[ERROR] \\x1b[0m[png_parser] Could not retrieve image info\\n')\n"
        "    os.write(2, b'.\\n')\n"  # libtiff's trailer, parted from its warning by another thread's line
        "    os.write(2, b'\\x1b[1msomething else\\x1b[0m\\n')\n")
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    records = [json.loads(line) for line in done.stderr.splitlines()]
    assert [(r["level"], r["message"]) for r in records] == [
        ("DEBUG", "library: [ERROR] [png_parser] Could not retrieve image info"), ("DEBUG", "library: ."),
        ("WARNING", "library: something else")], done.stderr


@pytest.mark.parametrize("line", [
    "Code stream size is not big enough.",  # nvImageCodec's nvbmp, on a BMP cut short
    "Could not decode bmp code stream - 3",
    "Could not parse tiff data - 2",
    "[ERROR] [png_parser] Could not retrieve image info",
    "Premature end of JPEG file",
    "TIFFReadDirectory: Bogus \"StripByteCounts\" field, ignoring and calculating from imagelength",
])
def test_what_a_decoder_says_about_a_bad_file_is_debug(line):
    from pipeline.errors import decoder_level

    assert decoder_level(line) == logging.DEBUG


def test_other_library_lines_stay_warnings():
    from pipeline.errors import decoder_level

    assert decoder_level("CUDA driver version is insufficient for CUDA runtime version") == logging.WARNING


def test_what_the_decoders_print_about_corrupt_files_stays_off_the_terminal(tmp_path):
    """PNG, TIFF, WebP, BMP and PNM files cut short or with bytes changed: OpenCV's and libtiff's
    lines about them (which name no file: errors.jsonl does) are logged at debug, not printed as
    warnings; every file is recorded once."""
    import PIL.Image

    image = PIL.Image.open(SAMPLES / "astronaut.png").convert("RGB")
    rng = random.Random(3)
    names = []
    for ext in ("png", "tiff", "webp", "bmp", "ppm"):
        image.save(tmp_path / f"good.{ext}")
        names += damaged_copies(tmp_path / f"good.{ext}", rng, cuts=(30, 70, 97))
    listing = tmp_path / "l.txt"
    listing.write_text("\n".join(names) + "\n")
    run = gpudet("detect", listing, "--out", tmp_path / "o", "--device", "cpu", "--no-progress")
    assert run.returncode == 3 and "WARNING" not in run.stderr, run.stderr[-3000:]
    recorded = read_jsonl(tmp_path / "o" / "detections.jsonl") + read_jsonl(tmp_path / "o" / "errors.jsonl")
    assert sorted(r["index"] for r in recorded) == list(range(len(names)))


def test_a_reader_of_stderr_that_goes_away_does_not_hang_the_capture(tmp_path):
    """Under --log-json the libraries' stderr is read from a pipe and logged; when the real stderr
    breaks (its reader exited), a failed write must not be reported into that same pipe."""
    script = tmp_path / "s.py"
    script.write_text(
        "import logging, os\n"
        "from pipeline.errors import setup_logging, stderr_into_log\n"
        "setup_logging(as_json=True)\n"
        "with stderr_into_log('lib', lambda line: logging.WARNING):\n"
        "    for _ in range(2000):\n"
        "        os.write(2, b'a library line\\n')\n"
        "        logging.getLogger('gpudet').warning('ours')\n"
        "print('done', flush=True)\n")
    process = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    process.stderr.close()  # the reader of stderr is gone
    out, _ = process.communicate(timeout=60)
    assert "done" in out


def test_resume_of_a_folder_that_gained_a_file_sorting_first_names_it(tmp_path):
    import shutil

    src = tmp_path / "photos"
    src.mkdir()
    for name in ("b.jpg", "c.jpg"):
        shutil.copy(SAMPLES / "grace_hopper.jpg", src / name)
    assert gpudet("detect", src, "--out", tmp_path / "o", "--device", "cpu", "--no-progress").returncode == 0
    shutil.copy(SAMPLES / "china.jpg", src / "0000.jpg")
    run = gpudet("detect", src, "--out", tmp_path / "o", "--device", "cpu", "--resume", "--no-progress")
    one_clear_line(run, 2)
    line = run.stderr
    assert f"the source changed since the run that wrote it: {src}/b.jpg was image 0 then and is image 1 now " \
           f"({src}/0000.jpg is image 0 now, a file new since then or one that sorts before it)" in line, line
    assert "detect the new files into another --out" in line and "--root" not in line
