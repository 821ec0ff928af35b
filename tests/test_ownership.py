"""gpudet never touches what is not its own: user files in --out, files outside --out, processes
that outlive their run. Real subprocesses and signals; a real file system filled up where the
machine lets a test mount one."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import EXPECTED_FACES, PHOTOS, SAMPLES, constant_model, gpudet, one_clear_line, read_jsonl

from pipeline.cli import main

def tree(folder: Path, *, lock: bool = True) -> dict[str, bytes]:
    """Every file under `folder` (links as their target's name) by its relative path, with its
    bytes; lock=False: without gpudet's lock file, which each run rewrites with its pid."""
    files = {}
    for path in sorted(folder.rglob("*")):
        if not lock and path.name == ".gpudet.lock":
            continue
        if path.is_symlink():
            files[str(path.relative_to(folder))] = os.readlink(path).encode()
        elif path.is_file():
            files[str(path.relative_to(folder))] = path.read_bytes()
    return files


def images_in(tmp_path: Path, count: int = 3) -> Path:
    source = tmp_path / "src"
    source.mkdir()
    for photo in PHOTOS[:count]:
        shutil.copy(photo, source / photo.name)
    return source


def test_a_folder_named_shards_in_out_is_the_users_and_stays(tmp_path):
    """A run, a --resume and an --overwrite into a folder that holds the user's shards/k/f: the
    file stays (gpudet's shards are .gpudet-shards/, known by their names)."""
    out = tmp_path / "u"
    (out / "shards" / "k").mkdir(parents=True)
    (out / "shards" / "k" / "f").write_text("x\n")
    for extra in ([], ["--resume"], ["--overwrite"]):
        run = gpudet("detect", SAMPLES, "--out", out, "--device", "cpu", *extra)
        assert run.returncode == 0, (extra, run.stderr[-2000:])
        assert (out / "shards" / "k" / "f").read_text() == "x\n", extra
    assert len(read_jsonl(out / "detections.jsonl")) == len(EXPECTED_FACES)


def test_out_as_the_source_folder_records_its_images_and_deletes_none(tmp_path):
    """--out is the source folder, with an image under shards/2024/: recorded, kept, and a --resume
    finds nothing left to do (neither gpudet's files nor a drawing folder are taken as images)."""
    source = images_in(tmp_path)
    (source / "shards" / "2024").mkdir(parents=True)
    shutil.copy(SAMPLES / "grace_hopper.jpg", source / "shards" / "2024" / "a.jpg")
    before = tree(source)
    assert gpudet("detect", source, "--out", source, "--device", "cpu").returncode == 0
    assert {k: v for k, v in tree(source).items() if k in before} == before
    paths = sorted(r["path"] for r in read_jsonl(source / "detections.jsonl"))
    assert paths == sorted(str(source / name) for name in before)
    summary = json.loads((source / "summary.json").read_text())
    assert summary["skipped_not_images"] == 0  # nor the run's own lock, listed before its settings are there
    assert main(["draw", str(source), "--out", str(source / "vis"), "--quiet"]) == 0
    assert main(["draw", str(source), "--out", str(tmp_path / "other" / "vis"), "--quiet"]) == 0
    shutil.move(tmp_path / "other" / "vis", source / "drawn")  # a drawing folder moved into the source
    resumed = gpudet("detect", source, "--out", source, "--device", "cpu", "--resume")
    assert resumed.returncode == 0 and "nothing left to process" in resumed.stdout, resumed.stderr[-2000:]
    assert {k: v for k, v in tree(source).items() if k in before} == before


def test_an_output_folder_inside_the_source_is_never_listed(tmp_path):
    """--out inside the source: its records, its shards and the drawings made into it are not
    images of the source, for a new run or a --resume."""
    source = images_in(tmp_path)
    out = source / "out"
    assert gpudet("detect", source, "--out", out, "--device", "cpu", "--devices", "cpu,cpu").returncode == 0
    assert main(["draw", str(out), "--out", str(out / "vis"), "--quiet"]) == 0
    resumed = gpudet("detect", source, "--out", out, "--device", "cpu", "--resume")
    assert resumed.returncode == 0 and "nothing left to process" in resumed.stdout, resumed.stderr[-2000:]
    assert main(["detect", str(source), "--out", str(tmp_path / "o2"), "--device", "cpu", "--quiet"]) == 0
    assert len(read_jsonl(tmp_path / "o2" / "detections.jsonl")) == 3


@pytest.mark.parametrize("name", ["settings.json", "summary.json", "errors.jsonl", "detections.jsonl",
                                  "detections.parquet"])
def test_a_folder_that_is_not_gpudets_and_holds_its_names_is_refused(tmp_path, name):
    """A non-empty --out whose settings.json is not gpudet's, holding a name gpudet writes: refused
    with one line naming it, exit 2, with and without --overwrite, nothing in it changed."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    if name == "detections.parquet":
        (out / name).mkdir()
        (out / name / "part-1-0badf00d.parquet").write_bytes(b"my table")
    else:
        (out / name).write_text('{"model": "mine"}\n')
    before = tree(out)
    for extra in ([], ["--overwrite"], ["--resume"]):
        one_clear_line(gpudet("detect", SAMPLES, "--out", out, "--device", "cpu", *extra), 2, name,
                       "gpudet did not write")
        assert tree(out) == before and sorted(p.name for p in out.iterdir()) == sorted(["notes.txt", name])


def test_overwrite_removes_gpudets_files_only_and_says_so(tmp_path):
    """--overwrite in a gpudet folder: its records go, in either format and in its shards; a user's
    file inside detections.parquet/ or a shard stays, and so do their folders."""
    out = tmp_path / "o"
    assert gpudet("detect", SAMPLES, "--out", out, "--device", "cpu", "--format", "parquet").returncode == 0
    (out / "detections.parquet" / "README.txt").write_text("my notes on this table\n")
    shard = out / ".gpudet-shards" / "0"
    shard.mkdir(parents=True)
    (shard / "errors.jsonl").write_text("")
    (shard / "keep.txt").write_text("mine\n")
    run = gpudet("detect", SAMPLES, "--out", out, "--device", "cpu", "--overwrite")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "--overwrite: removed gpudet's" in run.stderr and "detections.parquet/ (1 files)" in run.stderr
    assert (out / "detections.parquet" / "README.txt").read_text() == "my notes on this table\n"
    assert (shard / "keep.txt").read_text() == "mine\n" and not (shard / "errors.jsonl").exists()
    assert not list((out / "detections.parquet").glob("*.parquet"))
    assert len(read_jsonl(out / "detections.jsonl")) == len(EXPECTED_FACES)


NAMES = ["detections.jsonl", "errors.jsonl", "summary.json", "settings.json", ".gpudet.lock", "detections.parquet",
         ".gpudet-shards", "shards", "0", "ray-aaaaaaaaaaaa", "part-1-0badf00d.parquet", "notes.txt", "sub"]


USERS_NAMES = ["notes.txt", "sub", "mine.parquet", "part-1.parquet", "shards", "a.jpg"]
"""Names gpudet never writes inside its own folders (a file of its own name there is its own)."""


@st.composite
def user_trees(draw, names: list[str] = NAMES) -> dict[str, bytes]:
    """Up to 6 files at depth 1 to 3, named from `names` (gpudet's own names and others)."""
    files = {}
    for _ in range(draw(st.integers(1, 6))):
        parts = draw(st.lists(st.sampled_from(names), min_size=1, max_size=3))
        files["/".join(parts)] = draw(st.binary(min_size=1, max_size=20))
    names = sorted(files)  # a path that is another's folder cannot also be a file
    return {k: v for k, v in files.items() if not any(other.startswith(k + "/") for other in names)}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(files=user_trees(), inside=user_trees(USERS_NAMES))
def test_user_files_in_out_stay_byte_identical_or_the_run_is_refused(tmp_path_factory, files, inside):
    """A random tree of the user's files in --out (gpudet's names among them): a run, a --resume and
    an --overwrite each leave every one byte-identical, or refuse (exit 2); so do the user's files
    put inside gpudet's own folders after its first run."""
    out = tmp_path_factory.mktemp("out")
    for name, data in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)
    before = tree(out)
    code = main(["detect", str(PHOTOS[0]), "--out", str(out), "--device", "cpu", "--quiet"])
    assert code in (0, 2) and {k: v for k, v in tree(out).items() if k in before} == before
    if code == 2:
        assert tree(out) == before
        return
    for name, data in inside.items():  # beside gpudet's files in its own folders: the shards', the Parquet folder
        for folder in (".gpudet-shards", "detections.parquet"):
            path = out / folder / name
            if not any(p.is_file() for p in [*path.parents][:-len(out.parts)]) and not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
    before = {k: v for k, v in tree(out).items() if k in before or k.split("/")[0] in (".gpudet-shards",
                                                                                          "detections.parquet")}
    for extra in (["--resume"], ["--overwrite"]):
        code = main(["detect", str(PHOTOS[0]), "--out", str(out), "--device", "cpu", "--quiet", *extra])
        assert code in (0, 2), extra
        assert {k: v for k, v in tree(out).items() if k in before} == before, extra


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_devices_workers_die_with_a_killed_parent_and_resume_finishes(tmp_path):
    """kill -9 of a --devices parent while its workers run: they are gone within a second (none
    writes after the parent is gone), and an immediate --resume records every image exactly once."""
    listing = tmp_path / "l.txt"
    listing.write_text("".join(f"{p}\n" for p in PHOTOS) * 20)
    out = tmp_path / "o"
    for round_ in range(2):
        command = [sys.executable, "-m", "pipeline", "detect", str(listing), "--out", str(out), "--devices",
                   "cpu,cpu", "--batch-size", "2", "--no-progress"] + (["--resume"] if round_ else [])
        recorded = sum(len(read_jsonl(p)) for p in out.glob(".gpudet-shards/*/detections.jsonl"))
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and \
                sum(p.read_bytes().count(b"\n") for p in out.glob(".gpudet-shards/*/detections.jsonl")) <= recorded:
            time.sleep(0.1)
        assert process.poll() is None, process.stderr.read()[-2000:]
        workers = [pid for pid in children(process.pid) if "pipeline" in Path(f"/proc/{pid}/cmdline").read_text()
                   or "multiprocessing" in Path(f"/proc/{pid}/cmdline").read_text()]
        process.kill()
        process.wait()
        time.sleep(1.0)
        assert workers and not [pid for pid in workers if alive(pid)], workers
    run = gpudet("detect", listing, "--out", out, "--devices", "cpu,cpu", "--resume")
    assert run.returncode == 0, run.stderr[-2000:]
    assert sorted(r["index"] for r in read_jsonl(out / "detections.jsonl")) == list(range(len(PHOTOS) * 20))


def test_a_run_writes_nothing_into_home(tmp_path):
    """ONNX Runtime's telemetry (a device id and an event database under ~/.cache/Microsoft) is off:
    HOME stays empty, and a HOME that does not exist is not made."""
    home = tmp_path / "home"
    home.mkdir()
    for where in (home, tmp_path / "no-home"):
        run = gpudet("detect", SAMPLES, "--out", tmp_path / "o", "--device", "cpu", "--overwrite",
                     env={**os.environ, "HOME": str(where)})
        assert run.returncode == 0, run.stderr[-2000:]
    assert not list(home.iterdir()) and not (tmp_path / "no-home").exists()


def alias_bomb(levels: int) -> str:
    """YAML of `levels` nested aliases, 9 of each level in the next: 9**levels strings once expanded."""
    items = ["&l0 [" + ", ".join(["lol"] * 9) + "]"]
    items += [f"&l{k} [" + ", ".join([f"*l{k - 1}"] * 9) + "]" for k in range(1, levels)]
    return "[" + ", ".join(items) + "]"


@pytest.mark.parametrize("case", ["alias bomb", "deep", "set bomb", "set deep", "huge set"])
def test_hostile_configs_are_one_short_line_and_exit_2(tmp_path, case):
    config = tmp_path / "c.yaml"
    config.write_text({"alias bomb": f"run:\n  batch_size: {alias_bomb(7)}\n", "deep": "[" * 100_000}.get(case, "run: {}\n"))
    value = {"set bomb": alias_bomb(7), "set deep": "[" * 100_000, "huge set": "[" + ",".join(["1"] * 40_000) + "]"}
    started = time.monotonic()
    run = gpudet("detect", SAMPLES, "--out", tmp_path / "o", "--config", config, "--set",
                 f"run.device={value.get(case, 'cpu')}", timeout=60)
    one_clear_line(run, 2)
    assert len(run.stderr) < 600 and time.monotonic() - started < 30, run.stderr[:600]
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("shell", ["--progress 2>&1 | head -c 100", "--progress 2>&-", "--no-progress 2>&-", ">&-",
                                   "--progress 2>&1 >&- | head -c 10"])
def test_a_broken_or_closed_stream_never_stops_or_fails_the_job(tmp_path, shell):
    """Progress and log lines that cannot be written are dropped: every record, summary.json, and
    the job's own exit code."""
    listing = tmp_path / "l.txt"
    listing.write_text("".join(f"{p}\n" for p in PHOTOS) * 10)
    out = tmp_path / "o"
    run = subprocess.run(f"set -o pipefail; {sys.executable} -m pipeline detect {listing} --out {out} --device cpu "
                         f"--batch-size 2 {shell}; echo \"rc=${{PIPESTATUS[0]}}\" >&2", shell=True, executable="/bin/bash",
                         capture_output=True, text=True, timeout=300)
    assert "rc=0" in run.stderr, run.stderr[-2000:]
    assert len(read_jsonl(out / "detections.jsonl")) == len(PHOTOS) * 10
    assert json.loads((out / "summary.json").read_text())["processed"] == len(PHOTOS) * 10
    assert not (out / "errors.jsonl").read_text()


def test_sighup_stops_the_run_as_sigterm_does(tmp_path):
    listing = tmp_path / "l.txt"
    listing.write_text("".join(f"{p}\n" for p in PHOTOS) * 30)
    out = tmp_path / "o"
    process = subprocess.Popen([sys.executable, "-m", "pipeline", "detect", str(listing), "--out", str(out), "--device",
                                "cpu", "--batch-size", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    records = out / "detections.jsonl"
    deadline = time.monotonic() + 120  # the first record written: the run has begun (a signal during setup
    while time.monotonic() < deadline and not (records.is_file() and records.stat().st_size):  # leaves no folder)
        time.sleep(0.05)
    process.send_signal(signal.SIGHUP)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130 and "Traceback" not in err, err[-2000:]
    assert [line for line in err.splitlines() if "ERROR" in line][0].endswith("continue with --resume"), err
    assert gpudet("detect", listing, "--out", out, "--device", "cpu", "--resume").returncode == 0
    assert sorted(r["index"] for r in read_jsonl(out / "detections.jsonl")) == list(range(len(PHOTOS) * 30))


def test_a_file_size_limit_at_the_start_is_exit_4_and_leaves_no_folder(tmp_path):
    """The first write of a run (the lock's pid) fails: one line, exit 4, and the --out it made is gone."""
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0)); from pipeline.cli import main; "
            f"sys.exit(main(['detect', {str(SAMPLES)!r}, '--out', {str(tmp_path / 'o' / 'sub')!r}, '--device', 'cpu']))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    one_clear_line(run, 4, ".gpudet.lock")
    assert not (tmp_path / "o").exists()


def test_a_full_disk_at_the_start_is_exit_4_and_leaves_no_folder(tmp_path):
    """A real full file system (a 1 MiB tmpfs, filled), mounted in a user namespace of the test's
    own where the machine allows one: exit 4, one line, and no new folder in it."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-Urm", "true"], capture_output=True).returncode:
        pytest.skip("this machine lets no test mount a file system (unshare -Urm)")
    mount = tmp_path / "full"
    mount.mkdir()
    script = (f"mount -t tmpfs -o size=1m tmpfs {mount} && (head -c 2M /dev/zero > {mount}/filler || true) && "
              f"{sys.executable} -m pipeline detect {SAMPLES} --out {mount}/o --device cpu; echo rc=$? >&2; "
              f"ls -A {mount} >&2")
    run = subprocess.run(["unshare", "-Urm", "sh", "-c", script], capture_output=True, text=True, timeout=120)
    assert "rc=4" in run.stderr and "the disk is full" in run.stderr, run.stderr[-2000:]
    assert "Traceback" not in run.stderr and run.stderr.strip().splitlines()[-1] == "filler", run.stderr[-2000:]


@pytest.mark.parametrize("case", ["outside the batch", "NaN box", "infinite score"])
def test_model_outputs_no_record_may_hold_are_bad_model_output_records(tmp_path, case):
    """An end-to-end model whose batch_index leaves the batch, or whose box or score is NaN or
    infinite: those images are recorded as bad_model_output (the batch's, or the image's), the
    others as usual, never a traceback and never null in a box."""
    import numpy as np

    boxes = np.array([[1, 1, 20, 20], [2, 2, 30, 30]], np.float32)
    scores = np.array([0.95, 0.97], np.float32)
    batch_index = np.array([0, 1], np.int64)
    if case == "outside the batch":
        batch_index[1] = -1
    elif case == "NaN box":
        boxes[0, 2] = np.nan
    else:
        scores[0] = np.inf
    model = constant_model(tmp_path / "m.onnx", {"boxes": boxes, "scores": scores, "batch_index": batch_index})
    listing = tmp_path / "l.txt"
    listing.write_text("".join(f"{p}\n" for p in PHOTOS[:4]))
    run = gpudet("detect", listing, "--out", tmp_path / "o", "--model", model, "--device", "cpu", "--batch-size", "2",
                 "--set", "model.landmarks=0")
    assert run.returncode == 3 and "Traceback" not in run.stderr, run.stderr[-2000:]
    failed = read_jsonl(tmp_path / "o" / "errors.jsonl")
    done = read_jsonl(tmp_path / "o" / "detections.jsonl")
    assert {e["reason"] for e in failed} == {"bad_model_output"} and "null" not in (tmp_path / "o" / "detections.jsonl").read_text()
    expected = {"outside the batch": [0, 1, 2, 3], "NaN box": [0, 2], "infinite score": [0, 2]}[case]
    assert sorted(e["index"] for e in failed) == expected
    assert sorted(r["index"] for r in done) == sorted(set(range(4)) - set(expected))
    assert all(len(r["detections"]) == 1 for r in done)  # image 1 of its batch: its detection, renumbered


def test_model_outputs_of_different_lengths_stop_the_run_with_one_line(tmp_path):
    import numpy as np

    model = constant_model(tmp_path / "m.onnx", {"boxes": np.zeros((3, 4), np.float32),
                                                  "scores": np.ones(2, np.float32),
                                                  "batch_index": np.zeros(2, np.int64)})
    one_clear_line(gpudet("detect", SAMPLES, "--out", tmp_path / "o", "--model", model, "--device", "cpu",
                          "--set", "model.landmarks=0"), 2, "output boxes is [3, 4]", "needs [2, 4]")


@pytest.mark.parametrize("name, content", [("empty.onnx", b""), ("garbage.onnx", b"\x00garbage" * 100),
                                           ("gt.json", b'{"images": [], "annotations": []}\n')])
def test_inspect_and_model_of_any_file_are_one_line(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    for run in (gpudet("inspect", path), gpudet("detect", SAMPLES, "--out", tmp_path / "o", "--model", path,
                                                 "--device", "cpu")):
        one_clear_line(run, 2, str(path))
        assert len(run.stderr.splitlines()) == 1, run.stderr
    assert not (tmp_path / "o").exists()


def lossless_jpeg(pixels: np.ndarray, bits: int = 8) -> bytes:
    """A lossless JPEG (ITU T.81 process 14, SOF3, predictor 1: the sample to the left) of uint8 or
    uint16 pixels [H, W] or [H, W, C]: a minimal encoder, one Huffman table of 5-bit codes."""
    import numpy as np

    samples = pixels.reshape(pixels.shape[0], pixels.shape[1], -1).astype(np.int64)
    height, width, channels = samples.shape
    # Prediction: the first sample from 2^(P-1), the first row from the left, each row's first from above.
    predicted = np.empty_like(samples)
    predicted[0, 0] = 1 << (bits - 1)
    predicted[0, 1:] = samples[0, :-1]
    predicted[1:, 0] = samples[:-1, 0]
    predicted[1:, 1:] = samples[1:, :-1]
    out, acc, count = bytearray(), 0, 0
    for diff in ((samples - predicted) % 65536).ravel().tolist():
        diff = diff - 65536 if diff >= 32768 else diff
        size = abs(diff).bit_length() if diff != -32768 else 16
        extra = diff if diff >= 0 else diff + (1 << size) - 1
        acc, count = (acc << 5) | size, count + 5  # symbol `size`: its 5-bit code is its value
        if size and size < 16:
            acc, count = (acc << size) | (extra & ((1 << size) - 1)), count + size
        while count >= 8:
            byte = (acc >> (count - 8)) & 0xFF
            out += bytes([byte, 0]) if byte == 0xFF else bytes([byte])
            count -= 8
        acc &= (1 << count) - 1  # the bits not yet written only: a bounded int, not one of the whole image
    if count:
        byte = ((acc << (8 - count)) | ((1 << (8 - count)) - 1)) & 0xFF
        out += bytes([byte, 0]) if byte == 0xFF else bytes([byte])

    def segment(marker: int, body: bytes) -> bytes:
        return bytes([0xFF, marker]) + (len(body) + 2).to_bytes(2, "big") + body

    counts = bytes([0, 0, 0, 0, 17] + [0] * 11)  # 17 codes of 5 bits: symbols 0..16
    dht = segment(0xC4, bytes([0x00]) + counts + bytes(range(17)))
    sof = segment(0xC3, bytes([bits]) + height.to_bytes(2, "big") + width.to_bytes(2, "big") + bytes([channels])
                  + b"".join(bytes([c + 1, 0x11, 0]) for c in range(channels)))
    sos = segment(0xDA, bytes([channels]) + b"".join(bytes([c + 1, 0x00]) for c in range(channels)) + bytes([1, 0, 0]))
    return b"\xff\xd8" + dht + sof + sos + bytes(out) + b"\xff\xd9"


def test_jpeg_headers_that_lie_and_lossless_jpegs(tmp_path):
    """A JPEG whose header declares 9999x9999 over 512x600 data is `truncated`, not a grey image of
    that size; 8-bit lossless JPEGs (grey and colour) are decoded, to their exact pixels; a 16-bit
    one, which no decoder here reads, is `unsupported` with what to do."""
    import numpy as np
    from PIL import Image

    from pipeline import Detector, ImageError

    data = bytearray((SAMPLES / "grace_hopper.jpg").read_bytes())
    frame = data.find(b"\xff\xc0")
    data[frame + 5:frame + 9] = (9999).to_bytes(2, "big") * 2
    (tmp_path / "lies.jpg").write_bytes(bytes(data))
    face = np.asarray(Image.open(SAMPLES / "astronaut.png").convert("RGB"))
    (tmp_path / "lossless.jpg").write_bytes(lossless_jpeg(face))
    (tmp_path / "lossless_grey.jpg").write_bytes(lossless_jpeg(face[:, :, 1]))
    (tmp_path / "lossless16.jpg").write_bytes(lossless_jpeg(face[:64, :64, 0].astype(np.uint16) * 257, bits=16))
    assert np.array_equal(np.asarray(Image.open(tmp_path / "lossless.jpg")), face)  # the encoder is right
    names = ["lies.jpg", "lossless.jpg", "lossless_grey.jpg", "lossless16.jpg"]
    results = list(Detector.from_config(device="cpu").run([str(tmp_path / n) for n in names]))
    reasons = [r.reason if isinstance(r, ImageError) else len(r.scores) for r in results]
    assert reasons == ["truncated", 1, 1, "unsupported"], [getattr(r, "message", r) for r in results]
    assert "9999x9999" in results[0].message and "convert it" in results[3].message


def test_the_api_yields_what_a_failing_generator_gave_before_raising_its_error():
    from pipeline import Detector

    def photos():
        yield from (str(p) for p in PHOTOS)
        raise RuntimeError("the generator's own error")

    detector = Detector.from_config(device="cpu", batch_size=2)
    results = []
    with pytest.raises(RuntimeError, match="the generator's own error"):
        for result in detector.run(photos()):
            results.append(result)
    assert [r.index for r in results] == list(range(len(PHOTOS)))


def test_a_folder_source_records_dangling_links_and_fifos_named_as_images(tmp_path):
    """What a list records, a folder records too: a dangling link is `missing` (naming its target),
    a FIFO `not_a_file`, never skipped without a word."""
    source = images_in(tmp_path, 1)
    (source / "gone.jpg").symlink_to(tmp_path / "nowhere.jpg")
    os.mkfifo(source / "pipe.jpg")
    run = gpudet("detect", source, "--out", tmp_path / "o", "--device", "cpu", timeout=120)
    assert run.returncode == 3, run.stderr[-2000:]
    failed = {Path(e["path"]).name: e for e in read_jsonl(tmp_path / "o" / "errors.jsonl")}
    assert {k: e["reason"] for k, e in failed.items()} == {"gone.jpg": "missing", "pipe.jpg": "not_a_file"}
    assert "nowhere.jpg, which does not exist" in failed["gone.jpg"]["message"]


def test_a_parquet_file_that_is_not_gpudets_part_is_never_merged_moved_or_removed(tmp_path):
    """A file of the user's in detections.parquet/ (a copy of a part, another table) through a
    --devices run, its --resume and an --overwrite: read by none, removed by none."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = tmp_path / "o"
    assert gpudet("detect", SAMPLES, "--out", out, "--devices", "cpu,cpu", "--format", "parquet").returncode == 0
    part = sorted((out / "detections.parquet").glob("part-*.parquet"))[0]
    (out / "detections.parquet" / "zz_backup.parquet").write_bytes(part.read_bytes())
    pq.write_table(pa.table({"index": [0], "path": ["x"]}), out / "detections.parquet" / "mine.parquet")
    before = tree(out / "detections.parquet")
    mine = {k: v for k, v in before.items() if not k.startswith("part-")}
    for extra in (["--resume"], ["--overwrite"]):
        run = gpudet("detect", SAMPLES, "--out", out, "--devices", "cpu,cpu", "--format", "parquet", *extra)
        assert run.returncode == 0, (extra, run.stderr[-2000:])
        assert {k: v for k, v in tree(out / "detections.parquet").items() if k in mine} == mine, extra
    assert len(pq.read_table(out / "detections.parquet", ignore_prefixes=["zz_", "mine"])) == len(EXPECTED_FACES)


@pytest.mark.parametrize("what", ["a link to a folder", "a file"])
def test_a_shard_path_that_is_not_gpudets_folder_is_refused_before_anything_changes(tmp_path, what):
    out, mine = tmp_path / "o", tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine\n")
    assert gpudet("detect", SAMPLES, "--out", out, "--device", "cpu").returncode == 0
    (out / ".gpudet-shards").mkdir()
    if what == "a file":
        (out / ".gpudet-shards" / "0").write_text("mine\n")
    else:
        (out / ".gpudet-shards" / "0").symlink_to(mine)
    before = tree(out, lock=False)
    one_clear_line(gpudet("detect", SAMPLES, "--out", out, "--devices", "cpu,cpu", "--overwrite"), 2,
                   "is not a shard folder gpudet made")
    assert tree(out, lock=False) == before and tree(mine) == {"notes.txt": b"mine\n"}


def test_a_lock_left_by_a_run_killed_in_setup_does_not_make_a_users_folder_gpudets(tmp_path):
    out = tmp_path / "proj"
    out.mkdir()
    (out / ".gpudet.lock").write_text("pid 123 on host, started 2026-01-01T00:00:00+00:00\n")
    (out / "settings.json").write_text('{"editor": "settings"}\n')
    (out / "summary.json").write_text('{"my": "summary"}\n')
    before = tree(out)
    one_clear_line(gpudet("detect", SAMPLES, "--out", out, "--device", "cpu"), 2, "settings.json", "summary.json")
    assert tree(out) == before


def test_a_link_in_a_shard_is_never_read_or_cut_through(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_bytes(b"line one\nline two, no newline")
    out = tmp_path / "o"
    assert gpudet("detect", SAMPLES, "--out", out, "--device", "cpu").returncode == 0
    (out / ".gpudet-shards" / "0").mkdir(parents=True)
    (out / ".gpudet-shards" / "0" / "errors.jsonl").symlink_to(notes)
    one_clear_line(gpudet("detect", SAMPLES, "--out", out, "--device", "cpu", "--resume"), 2, "symbolic link")
    assert notes.read_bytes() == b"line one\nline two, no newline"


def test_devices_with_stderr_closed_records_every_image(tmp_path):
    run = subprocess.run(f"{sys.executable} -m pipeline detect {SAMPLES} --out {tmp_path / 'o'} --devices cpu,cpu 2>&-",
                         shell=True, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0 and "Traceback" not in run.stdout, run.stdout[-2000:]
    assert len(read_jsonl(tmp_path / "o" / "detections.jsonl")) == len(EXPECTED_FACES)
    assert not (tmp_path / "o" / ".gpudet-shards").exists()


def test_a_folder_once_used_as_out_or_drawn_into_keeps_its_photos_in_a_later_source(tmp_path):
    """gpudet's own files are left out of a folder source, never the user's photos beside them:
    a subfolder that was a run's source and --out, drawings made into the source folder itself."""
    photos = images_in(tmp_path, 2)
    (photos / "2024").mkdir()
    for photo in PHOTOS[2:5]:
        shutil.copy(photo, photos / "2024" / photo.name)
    assert gpudet("detect", photos / "2024", "--out", photos / "2024", "--device", "cpu").returncode == 0
    assert main(["draw", str(photos / "2024"), "--out", str(photos), "--quiet"]) == 0  # drawings beside the photos
    assert len(list(photos.glob("0*_*.jpg"))) == 3
    run = gpudet("detect", photos, "--out", tmp_path / "all", "--device", "cpu")
    assert run.returncode == 0, run.stderr[-2000:]
    assert sorted(Path(r["path"]).name for r in read_jsonl(tmp_path / "all" / "detections.jsonl")) == \
        sorted(p.name for p in PHOTOS[:5])


def test_draw_never_replaces_a_file_it_did_not_draw(tmp_path):
    out, mine = tmp_path / "o", tmp_path / "mine"
    assert gpudet("detect", SAMPLES / "china.jpg", "--out", out, "--device", "cpu").returncode == 0
    mine.mkdir()
    (mine / "00000000_china.jpg").write_text("precious\n")
    one_clear_line(gpudet("draw", out, "--out", mine), 2, "00000000_china.jpg", "not a drawing gpudet made")
    assert (mine / "00000000_china.jpg").read_text() == "precious\n"
    assert gpudet("draw", out, "--out", tmp_path / "vis").returncode == 0
    assert gpudet("draw", out, "--out", tmp_path / "vis").returncode == 0  # its own drawings: replaced


@pytest.mark.parametrize("value", ["2001-13-45", "!!int abc", "!!float x", "!!timestamp 2020-99-99"])
def test_values_yaml_cannot_construct_are_one_line(tmp_path, value):
    one_clear_line(gpudet("detect", SAMPLES, "--out", tmp_path / "o", "--set", f"run.device={value}"), 2,
                   "run.device=", "not valid YAML")


def test_deeply_nested_json_in_the_folder_is_one_line(tmp_path):
    out = tmp_path / "o"
    assert gpudet("detect", SAMPLES, "--out", out, "--device", "cpu").returncode == 0
    with open(out / "detections.jsonl", "a") as f:
        f.write("[" * 5000 + "\n")
    one_clear_line(gpudet("detect", SAMPLES, "--out", out, "--device", "cpu", "--resume"), 2, "line 7")
    (out / "settings.json").write_text("[" * 100_000)
    one_clear_line(gpudet("detect", SAMPLES, "--out", tmp_path / "o", "--device", "cpu", "--resume"), 2)


def test_external_data_that_names_no_file_is_one_line(tmp_path):
    import onnx
    from onnx import helper

    weight = helper.make_tensor("w", onnx.TensorProto.FLOAT, [1], [1.0])
    weight.data_location = onnx.TensorProto.EXTERNAL
    weight.ClearField("float_data")
    weight.external_data.add(key="location", value="a\x00b")
    graph = helper.make_graph([helper.make_node("Mul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["b", 3, 8, 8])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["b", 3, 8, 8])], [weight])
    model = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(model))
    one_clear_line(gpudet("inspect", model), 2, "names no file")


def test_a_socket_in_a_folder_source_is_not_a_file(tmp_path):
    import socket

    source = images_in(tmp_path, 1)
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(source / "sock.jpg"))
    try:
        assert gpudet("detect", source, "--out", tmp_path / "o", "--device", "cpu").returncode == 3
    finally:
        server.close()
    assert [e["reason"] for e in read_jsonl(tmp_path / "o" / "errors.jsonl")] == ["not_a_file"]


NOCAP = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner",
         "--inh-caps=-dac_override,-dac_read_search,-fowner"]


@pytest.mark.parametrize("case", ["out read-only", "records unreadable", "parquet folder read-only"])
def test_what_gpudet_may_not_read_or_write_is_one_line_and_changes_nothing(tmp_path, case):
    """Permissions, as a user without root meets them (root's overrides dropped where the tests
    run as root): one line, exit 2, the folder as it was."""
    if os.geteuid() == 0 and (shutil.which("setpriv") is None or subprocess.run([*NOCAP, "true"]).returncode):
        pytest.skip("root, and no setpriv to drop root's file-permission overrides")
    out = tmp_path / "o"
    output_format = "parquet" if "parquet" in case else "jsonl"
    assert gpudet("detect", SAMPLES, "--out", out, "--device", "cpu", "--format", output_format).returncode == 0
    target = {"out read-only": out, "records unreadable": out / "detections.jsonl",
              "parquet folder read-only": out / "detections.parquet"}[case]
    target.chmod(0o000 if case == "records unreadable" else 0o555)
    before = tree(out, lock=False) if case != "records unreadable" else None
    try:
        extra = "--overwrite" if "parquet" in case else "--resume"
        prefix = NOCAP if os.geteuid() == 0 else []
        run = subprocess.run([*prefix, sys.executable, "-m", "pipeline", "detect", str(SAMPLES), "--out", str(out),
                              "--device", "cpu", extra], capture_output=True, text=True, timeout=300)
        one_clear_line(run, 2)
    finally:
        target.chmod(0o755 if target.is_dir() else 0o644)
    if before is not None:
        assert tree(out, lock=False) == before
