"""The output formats: detections.jsonl's lines built a column at a time are those of the records;
detections.parquet holds what detections.jsonl holds, resumes, merges and is read by the tools
users read Parquet with."""

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from pipeline import sinks
from pipeline.cli import main
from pipeline.folder import OutputFolder
from pipeline.parquet import ParquetWriter, detection_table, text_path, write_parquet
from pipeline.results import Detections, ImageRef, detection_records
from pipeline.sinks import BatchRecords, Row, detection_lines, jsonl

from conftest import PHOTOS, SAMPLES, cpu_and_cuda, gpudet, one_clear_line, read_jsonl, read_results

def detect(*args, device: str = "cpu") -> int:
    """In this process, quiet, batches of 2."""
    return main(["detect", *map(str, args), "--device", device, "--batch-size", "2", "--quiet"])


@cpu_and_cuda()
def test_parquet_holds_the_jsonl_records_and_resumes_over_them(tmp_path, device):
    folder = os.fsencode(tmp_path / "in")
    os.mkdir(folder)
    for photo in PHOTOS:
        shutil.copy(photo, folder + b"/" + os.fsencode(photo.name))
    shutil.copy(SAMPLES / "grace_hopper.jpg", folder + b"/caf\xe9.jpg")  # a name that is not UTF-8
    (tmp_path / "in" / "broken.jpg").write_bytes(b"\xff\xd8\xff" + b"\x00" * 64)
    for output_format in ("jsonl", "parquet"):
        assert detect(os.fsdecode(folder), "--out", tmp_path / output_format, "--format", output_format,
                      device=device) == 3

    from pipeline.coco import read_detections

    jsonl, parquet = read_results(tmp_path / "jsonl"), read_results(tmp_path / "parquet")
    assert sorted(read_detections(tmp_path / "parquet"), key=lambda r: r["index"]) == jsonl and len(jsonl) == 7
    # path: text (\xNN for a byte that is not UTF-8); path_bytes: the name's bytes where path cannot hold them
    assert [(r["path"], r["path_bytes"]) for r in parquet] == [
        (text_path(r["path"]), None if r["path"].isascii() else os.fsencode(r["path"])) for r in jsonl]
    assert sum(r["path_bytes"] is not None for r in parquet) == 1
    assert main(["draw", str(tmp_path / "parquet"), "--out", str(tmp_path / "drawn"), "--quiet"]) == 0  # each file found
    assert len(list((tmp_path / "drawn").glob("*.jpg"))) == 7
    assert sum(len(r["detections"]) for r in parquet) == 4 and "landmarks" in parquet[0]["detections"][0]
    assert read_jsonl(tmp_path / "jsonl" / "errors.jsonl") == read_jsonl(tmp_path / "parquet" / "errors.jsonl")
    summary = json.loads((tmp_path / "parquet" / "summary.json").read_text())
    assert summary["format"] == "parquet" and summary["processed"] == 7 and summary["detections"] == 4


    # A resume over the same folder finds every image recorded (the name that is not UTF-8 too).
    assert detect(os.fsdecode(folder), "--out", tmp_path / "parquet", "--format", "parquet", "--resume",
                  device=device) == 3
    assert json.loads((tmp_path / "parquet" / "summary.json").read_text())["already_done"] == 8
    assert read_results(tmp_path / "parquet") == parquet


def test_the_write_stage_counts_the_last_parquet_file(tmp_path, monkeypatch):
    """Parquet holds rows until a file is due: the file written as the loop ends is part of the
    write stage that `gpudet detect` and `gpudet bench` report, not time that no stage shows."""
    write_file = ParquetWriter.flush

    def slow(self):
        if self._rows:
            time.sleep(0.3)
        write_file(self)

    monkeypatch.setattr(ParquetWriter, "flush", slow)
    listing = tmp_path / "list.txt"
    listing.write_text("".join(f"{photo}\n" for photo in PHOTOS))
    assert detect(listing, "--out", tmp_path / "out", "--format", "parquet") == 0
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["seconds"]["write"] >= 0.3
    report = tmp_path / "bench.json"
    assert main(["bench", str(listing), "--device", "cpu", "--batch-size", "2", "--iterations", "1", "--skip-naive",
                 "--format", "parquet", "--json", str(report)]) == 0
    assert json.loads(report.read_text())["gpudet_stages_s"]["write"] >= 0.3


def test_pandas_and_duckdb_read_the_parquet_folder(tmp_path):
    import duckdb
    import pandas as pd

    assert detect(SAMPLES, "--out", tmp_path / "o", "--format", "parquet") == 0
    records = read_results(tmp_path / "o")
    where = tmp_path / "o" / "detections.parquet"
    frame = pd.read_parquet(where)
    assert list(frame["index"]) == [r["index"] for r in records] and list(frame["path"]) == [str(p) for p in PHOTOS]
    faces = duckdb.sql(f"select path, unnest(detections).score as score from read_parquet('{where}/*.parquet') "
                       "order by score desc").fetchall()
    assert sorted(faces) == sorted((r["path"], d["score"]) for r in records for d in r["detections"])
    assert len(faces) == 3


def test_a_resume_adds_files_and_each_image_is_recorded_once(tmp_path, monkeypatch):
    monkeypatch.setattr(ParquetWriter, "FLUSH_ROWS", 2)  # a file per batch of 2
    first, whole = tmp_path / "first.txt", tmp_path / "whole.txt"
    first.write_text("".join(f"{p}\n" for p in PHOTOS[:3]))
    whole.write_text("".join(f"{p}\n" for p in PHOTOS))
    out = tmp_path / "o"
    assert detect(first, "--out", out, "--format", "parquet") == 0
    assert len(list((out / "detections.parquet").glob("*.parquet"))) == 2
    (out / "detections.parquet" / ".part-1-0badf00d.parquet.tmp").write_bytes(b"PAR1 torn")  # a kill mid-write
    assert len(read_results(out)) == 3  # readers of the folder pass over it
    assert detect(whole, "--out", out, "--format", "parquet", "--resume") == 0
    assert [r["index"] for r in read_results(out)] == list(range(len(PHOTOS)))
    assert not list((out / "detections.parquet").glob(".*.tmp"))
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["already_done"], summary["processed"]) == (3, 3)

    assert detect(tmp_path / "first.txt", "--out", tmp_path / "single", "--format", "parquet") == 0
    assert read_results(tmp_path / "single") == read_results(out)[:3]


def test_a_folder_of_one_format_is_continued_only_in_that_format(tmp_path, capsys):
    """Another --format than the folder holds is refused; --resume without --format continues in
    the folder's own (what the interrupt message's advice, 'continue with --resume', needs)."""
    out = tmp_path / "o"
    assert detect(SAMPLES, "--out", out) == 0
    capsys.readouterr()
    assert detect(SAMPLES, "--out", out, "--format", "parquet", "--resume") == 2
    err = capsys.readouterr().err
    assert "detections.jsonl holds results in jsonl" in err and "--format jsonl" in err and len(err.splitlines()) == 1
    assert detect(SAMPLES, "--out", out) == 2  # neither --resume nor --overwrite
    assert json.loads((out / "summary.json").read_text())["processed"] == 6  # a refused run changes nothing
    assert detect(SAMPLES, "--out", out, "--format", "parquet", "--overwrite") == 0
    assert not (out / "detections.jsonl").exists() and len(read_results(out)) == 6
    capsys.readouterr()
    assert detect(SAMPLES, "--out", out, "--resume") == 0  # --resume alone continues in the folder's format
    assert not (out / "detections.jsonl").exists() and len(read_results(out)) == 6
    assert json.loads((out / "summary.json").read_text())["already_done"] == 6 and capsys.readouterr().err == ""


def batch_of(indices: list[int], found_per_image: int = 2) -> tuple[list[ImageRef], np.ndarray, Detections]:
    """A batch of images `indices` (its size rows padded by 3), each with `found_per_image` detections."""
    m = len(indices) * found_per_image
    found = Detections(batch_index=np.repeat(np.arange(len(indices)), found_per_image),
                       boxes_xyxy=np.arange(4 * m, dtype=np.float32).reshape(m, 4),
                       scores=np.linspace(1, 0.5, m, dtype=np.float32), labels=np.zeros(m, np.int64), landmarks=None)
    return [ImageRef(i, f"img{i}.jpg") for i in indices], np.full((len(indices) + 3, 2), 100), found


ANY_CHARACTER = st.characters(exclude_categories=())
"""Lone surrogates too: Python's name for a byte of a file name that is not UTF-8."""


@st.composite
def batches(draw):
    """A batch as the postprocess hands it over: any float32 values (NaN, infinities, subnormals,
    -0.0), labels in and out of the names, images with no detections, rows of images past the
    batch's refs, landmarks or none, file names of any characters (lone surrogates too)."""
    size = draw(st.integers(0, 5))
    m = draw(st.integers(0, 40))
    points = draw(st.sampled_from([None, 1, 5]))
    floats = lambda *shape: draw(hnp.arrays(np.float32, shape, elements=st.floats(width=32)))  # noqa: E731
    found = Detections(batch_index=np.sort(draw(hnp.arrays(np.int64, m, elements=st.integers(0, size + 1)))),
                       boxes_xyxy=floats(m, 4), scores=floats(m),
                       labels=draw(hnp.arrays(np.int64, m, elements=st.integers(-2, 12))),
                       landmarks=None if points is None else floats(m, points, 2))
    refs = [ImageRef(draw(st.integers(0, 2**40)), draw(st.text(ANY_CHARACTER))) for _ in range(size)]
    return refs, draw(hnp.arrays(np.int64, (size + 2, 2), elements=st.integers(1, 10**5))), found


@settings(max_examples=300, deadline=None)
@given(batch=batches(), names=st.lists(st.text(ANY_CHARACTER), max_size=10))
def test_detection_lines_are_the_bytes_of_the_records(batch, names):
    """Built a column at a time however few the detections, the lines are those of the records."""
    refs, orig_hw, found = batch
    with mock.patch.dict(sinks.COLUMNS_FROM, boxes=0, landmarks=0):
        assert detection_lines(refs, orig_hw, found, names) == jsonl(detection_records(refs, orig_hw, found, names))


def test_detection_lines_of_a_name_that_is_not_utf8_are_escaped_as_the_records():
    """A file name, or a class name, with bytes that are not UTF-8, in a batch over COLUMNS_FROM."""
    refs, orig_hw, found = batch_of([0, 1], found_per_image=sinks.COLUMNS_FROM["boxes"])
    refs[1] = ImageRef(1, os.fsdecode(b"caf\xe9.jpg"))
    lines = detection_lines(refs, orig_hw, found, ["face"])
    assert lines == jsonl(detection_records(refs, orig_hw, found, ["face"]))
    assert os.fsencode(json.loads(lines.splitlines()[1])["path"]) == b"caf\xe9.jpg"
    refs[1] = ImageRef(1, "cafe.jpg")
    lines = detection_lines(refs, orig_hw, found, [os.fsdecode(b"caf\xe9")])
    assert lines == jsonl(detection_records(refs, orig_hw, found, [os.fsdecode(b"caf\xe9")]))
    assert json.loads(lines.splitlines()[0])["detections"][0]["name"] == os.fsdecode(b"caf\xe9")


def batch_table(indices: list[int], found_per_image: int = 2):
    """Rows of detection_table for images `indices`, each with `found_per_image` detections."""
    return detection_table(*batch_of(indices, found_per_image), ["face"])


def test_the_writer_holds_batches_until_a_bound_and_writes_them_as_one_file(tmp_path, monkeypatch):
    """Rows built once per file from the batches held: the same rows as one table per batch, the
    files cut at FLUSH_DETECTIONS (the memory bound) as at FLUSH_ROWS."""
    monkeypatch.setattr(ParquetWriter, "FLUSH_DETECTIONS", 6)
    with ParquetWriter(tmp_path / "detections.parquet") as writer:
        for indices, per_image in (([0, 1], 2), ([2], 0), ([3, 4], 2), ([5], 3)):
            writer.append(BatchRecords(*batch_of(indices, per_image), ["face"]))
    files = sorted((tmp_path / "detections.parquet").glob("*.parquet"))
    import pyarrow.parquet as pq

    assert [pq.read_metadata(f).num_rows for f in files] == [5, 1]  # 8 detections held: a file; then the end
    expected = [row for indices, n in (([0, 1], 2), ([2], 0), ([3, 4], 2), ([5], 3))
                for row in batch_table(indices, n).to_pylist()]
    assert pq.read_table(tmp_path / "detections.parquet").to_pylist() == expected


def test_a_batch_of_many_detections_reads_back_the_same_from_either_format(tmp_path):
    """OutputFolder.record with JSONL's lines built a column at a time (over COLUMNS_FROM in the
    batch) and with Parquet's rows: the same records, each image's count in the tally."""
    per_image = sinks.COLUMNS_FROM["boxes"]
    refs, orig_hw, found = batch_of([0, 1, 2], found_per_image=per_image)
    folders = {}
    for output_format in ("jsonl", "parquet"):
        folder = folders[output_format] = OutputFolder(tmp_path / output_format, output_format=output_format)
        folder.begin(refs)
        with folder.writing():
            rows = folder.record(SimpleNamespace(refs=refs, orig_hw=orig_hw), found, ["face"])
        assert [(r.index, r.detections) for r in rows] == [(i, per_image) for i in range(3)]
        folder.close()
    jsonl_records = read_results(tmp_path / "jsonl")
    parquet_records = [{k: v for k, v in r.items() if k != "path_bytes"} for r in read_results(tmp_path / "parquet")]
    assert jsonl_records == parquet_records and len(jsonl_records[2]["detections"]) == per_image


def test_the_merge_keeps_each_image_once_across_shard_files(tmp_path):
    """A Ray batch run again after an actor failed: two shards hold the same images. The merge
    moves the shards' files in, rewrites those with an image seen before, and keeps an image
    recorded as processed out of errors.jsonl."""
    out = tmp_path / "o"
    a, b = "ray-" + "a" * 12, "ray-" + "b" * 12
    for shard, parts in {a: [[0, 1, 2], [3, 4]], b: [[3, 4], [4, 5, 5, 6]]}.items():
        folder = out / ".gpudet-shards" / shard / "detections.parquet"
        folder.mkdir(parents=True)
        for k, indices in enumerate(parts):
            write_parquet(batch_table(indices), folder / f"part-{k}-{shard[-8:]}.parquet")
    (out / ".gpudet-shards" / b / "errors.jsonl").write_text(
        '{"index":5,"path":"img5.jpg","reason":"decode_failed","message":"x"}\n'
        '{"index":7,"path":"img7.jpg","reason":"missing","message":"x"}\n')
    (out / "settings.json").write_text('{"gpudet": "the run that started the shards"}')  # what begin writes first
    rows: list[Row] = []
    with OutputFolder(out, output_format="parquet", resume=True) as folder:
        folder.merge(rows.append)
    assert sorted(r.index for r in rows if r.processed) == list(range(7))
    assert all(r.detections == 2 for r in rows if r.processed)
    assert [(r.index, r.reason) for r in rows if not r.processed] == [(7, "missing")]
    assert [r["index"] for r in read_results(out)] == list(range(7))
    assert [e["index"] for e in read_jsonl(out / "errors.jsonl")] == [7]
    assert not list((out / ".gpudet-shards").glob("*/detections.parquet/*.parquet"))  # moved in, or dropped as repeats
    assert read_results(out)[0]["detections"][1] == {"box": [4.0, 5.0, 6.0, 7.0], "score": 0.9, "label": 0,
                                                     "name": "face"}


def test_draw_and_the_coco_reader_take_a_parquet_output(tmp_path, capsys):
    from pipeline.coco import read_detections

    assert detect(SAMPLES, "--out", tmp_path / "p", "--format", "parquet") == 0
    assert detect(SAMPLES, "--out", tmp_path / "j") == 0
    by_index = lambda records: sorted(records, key=lambda r: r["index"])  # noqa: E731
    assert by_index(read_detections(tmp_path / "p")) == by_index(read_detections(tmp_path / "j" / "detections.jsonl"))
    assert read_detections(tmp_path / "p" / "detections.parquet") == read_detections(tmp_path / "p")
    assert main(["draw", str(tmp_path / "p"), "--out", str(tmp_path / "drawn"), "--quiet"]) == 0
    assert len(list((tmp_path / "drawn").glob("*.jpg"))) == 6
    (tmp_path / "p" / "detections.parquet" / "part-9-0badf00d.parquet").write_bytes(b"")
    assert main(["draw", str(tmp_path / "p"), "--out", str(tmp_path / "drawn"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "part-9-0badf00d.parquet: not Parquet that gpudet detect wrote" in err and "gpudet detect --resume" in err
    assert len(err.splitlines()) == 1, err
    shutil.rmtree(tmp_path / "p" / "detections.parquet")
    (tmp_path / "p" / "detections.parquet").mkdir()  # a run where every image failed
    assert read_detections(tmp_path / "p") == []


def test_what_is_not_gpudets_parquet_is_one_line_on_resume(tmp_path, capsys):
    out = tmp_path / "o"
    assert detect(SAMPLES, "--out", out, "--format", "parquet") == 0
    (out / "detections.parquet" / "part-0-0badf00d.parquet").write_bytes(b"")  # empty, as a crash could leave one
    capsys.readouterr()
    assert detect(SAMPLES, "--out", out, "--format", "parquet", "--resume") == 2
    err = capsys.readouterr().err
    assert "part-0-0badf00d.parquet: not Parquet that gpudet detect wrote" in err and len(err.splitlines()) == 1, err
    (out / "detections.parquet" / "part-0-0badf00d.parquet").unlink()
    shutil.rmtree(out / "detections.parquet")
    (out / "detections.parquet").write_text("not a folder")
    assert detect(SAMPLES, "--out", out, "--format", "parquet", "--resume") == 2
    err = capsys.readouterr().err
    assert "detections.parquet is not a folder gpudet wrote" in err and len(err.splitlines()) == 1, err
    # --overwrite removes what gpudet wrote only: a file of that name is someone else's
    assert detect(SAMPLES, "--out", out, "--format", "parquet", "--overwrite") == 2
    assert (out / "detections.parquet").read_text() == "not a folder"
    (out / "detections.parquet").unlink()
    assert detect(SAMPLES, "--out", out, "--format", "parquet", "--overwrite") == 0
    assert len(read_results(out)) == 6


def test_a_file_size_limit_on_a_parquet_file_is_exit_4_and_resume_finishes(tmp_path):
    """The file is written whole or not at all: the temporary one goes, nothing torn is left."""
    listing = tmp_path / "list.txt"
    listing.write_text("".join(f"{p}\n" for p in PHOTOS) * 20)
    out = tmp_path / "o"

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (3000, 3000))

    run = gpudet("detect", listing, "--out", out, "--device", "cpu", "--batch-size", "8", "--format", "parquet",
                 preexec_fn=limit)
    one_clear_line(run, 4, "file size limit", "--resume")
    assert not [p for p in (out / "detections.parquet").iterdir()]
    resumed = gpudet("detect", listing, "--out", out, "--device", "cpu", "--batch-size", "8", "--format", "parquet",
                     "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert [r["index"] for r in read_results(out)] == list(range(120))


def test_without_pyarrow_parquet_is_one_line_saying_what_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    assert detect(SAMPLES, "--out", tmp_path / "o", "--format", "parquet") == 2
    err = capsys.readouterr().err
    assert "pip install 'gpudet[parquet]'" in err and len(err.splitlines()) == 1
    assert detect(SAMPLES, "--out", tmp_path / "o") == 0  # JSONL needs no pyarrow


@pytest.mark.parametrize("output_format", ["jsonl", "parquet"])
def test_an_interrupted_run_keeps_what_it_recorded_in_either_format(tmp_path, output_format, monkeypatch):
    """Ctrl-C after two batches: the records so far are written (Parquet: the rows held go to a
    file), the exit is 130, and --resume records every image once."""
    from pipeline.detector import Detector

    stream = Detector.stream_batches

    def interrupted(self, batches, on_error, **kwargs):
        for n, item in enumerate(stream(self, batches, on_error, **kwargs)):
            if n == 2:
                raise KeyboardInterrupt
            yield item

    monkeypatch.setattr(Detector, "stream_batches", interrupted)
    out = tmp_path / "o"
    assert detect(SAMPLES, "--out", out, "--format", output_format) == 130
    assert [r["index"] for r in read_results(out)] == [0, 1, 2, 3]
    monkeypatch.setattr(Detector, "stream_batches", stream)
    assert detect(SAMPLES, "--out", out, "--format", output_format, "--resume") == 0
    assert [r["index"] for r in read_results(out)] == list(range(6))


def test_a_parquet_folder_loads_pyarrow_as_it_opens_not_in_the_first_file(tmp_path):
    """What pyarrow loads on first use (pandas, where installed) is paid when the output folder
    opens, before the loop's clock, not in the loop's first file (a clean interpreter: the tests
    before this one have loaded it)."""
    code = f"""
import sys
import numpy as np
from types import SimpleNamespace
from pipeline.results import Detections, ImageRef
from pipeline.folder import OutputFolder
with OutputFolder({str(tmp_path / "out")!r}, output_format="parquet") as folder, folder.writing():
    loaded = set(sys.modules)
    batch = SimpleNamespace(refs=[ImageRef(0, "a.jpg")], orig_hw=np.array([[480, 640]]))
    found = Detections(batch_index=np.zeros(1, np.int64), boxes_xyxy=np.ones((1, 4), np.float32),
                       scores=np.ones(1, np.float32), labels=np.zeros(1, np.int64), landmarks=None)
    folder.record(batch, found, ["face"])
    folder.flush()
print(sorted({{m.split(".")[0] for m in set(sys.modules) - loaded}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"loaded in the loop: {out}"
