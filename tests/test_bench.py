"""`gpudet bench` runs every measurement side by side and reports ratios, machine and command."""

import json
import shutil
import subprocess

from pipeline.cli import main

from conftest import ROOT, SAMPLES


def test_bench_reports_rates_ratios_and_the_machine(tmp_path, capsys):
    report_path = tmp_path / "bench.json"
    assert main(["bench", str(SAMPLES), "--device", "cpu", "--batch-size", "4", "--limit", "6", "--iterations", "1",
                 "--latency", "5", "--naive-limit", "4", "--json", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    assert set(report["images_per_s"]) == {"gpudet", "model", "preprocess", "naive"}
    assert all(rate > 0 for rate in report["images_per_s"].values())
    assert report["ratios"]["gpudet / naive"] == round(report["images_per_s"]["gpudet"] /
                                                       report["images_per_s"]["naive"], 3)
    assert report["images"] == 6 and report["machine"]["cores"] >= 1 and report["date"]
    assert report["naive"] == {"images": 4, "batch": 1, "precision": "float32",
                               "session": "the same model file, ORT's default provider options, numpy in and out"}
    assert report["detections_per_image"] == 0.5  # 3 faces in 6 photos, counted from the records written
    assert 0 < report["machine"]["python_loop_ms"] < 1000  # the host's speed on one core, for comparing machines
    setup = report["gpudet_setup_s"]  # what a job pays once: the detector, then its first batch
    assert setup["since_start"] >= setup["detector"] > 0 and setup["first_batch"] > 0
    assert report["job_wall_s"] > setup["since_start"] + setup["first_batch"]
    # which code made the numbers: this checkout's commit (tests run from one)
    code = report["gpudet"]
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert code["source"] == str(ROOT / "pipeline") and code["commit"].rstrip("+") == head.strip()[:12]
    assert report["command"] == (f"gpudet bench {SAMPLES} --device cpu --batch-size 4 --limit 6 --iterations 1 "
                                 f"--latency 5 --naive-limit 4 --json {report_path}")
    stages = report["gpudet_stages_s"]
    assert {"read", "preprocess", "engine", "postprocess", "write"} <= set(stages) and stages["engine"] > 0
    assert stages["gpu_utilisation_percent"] is None  # on the CPU
    latency = report["latency_batch_1"]
    assert latency["images"] == 5 and 0 < latency["p50_ms"] <= latency["p99_ms"]
    out = capsys.readouterr().out
    assert "gpudet / naive" in out and "latency, batch 1, 5 images: p50" in out and "gpudet stages" in out
    assert f"({setup['detector']:.2f} s building it), {setup['first_batch']:.2f} s for the first batch" in out
    assert f"a fixed piece of Python in {report['machine']['python_loop_ms']:.1f} ms" in out
    assert "(first 4 images, batch 1, float32)" in out and f"from {ROOT / 'pipeline'} at {code['commit']}" in out


def test_bench_passes_report_the_median_pass_and_list_them_all(tmp_path, capsys):
    report_path = tmp_path / "bench.json"
    assert main(["bench", str(SAMPLES), "--device", "cpu", "--batch-size", "4", "--limit", "6", "--iterations", "1",
                 "--skip-naive", "--passes", "3", "--format", "parquet", "--json", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    assert report["output_format"] == "parquet" and report["detections_per_image"] == 0.5  # 3 faces, 6 images
    passes = report["gpudet_passes_images_per_s"]
    assert len(passes) == 3 and all(rate > 0 for rate in passes)
    assert report["images_per_s"]["gpudet"] == sorted(passes)[1]
    assert report["ratios"]["gpudet / model"] == round(sorted(passes)[1] / report["images_per_s"]["model"], 3)
    assert "gpudet passes (images/s, the median above): " + ", ".join(f"{r:.1f}" for r in passes) in \
        capsys.readouterr().out


def test_bench_fails_loudly_when_an_image_fails(tmp_path, capsys):
    """A rate counts the records written: an image that cannot be processed stops the benchmark
    with its name, rather than a rate over fewer images than listed."""
    listing = tmp_path / "list.txt"
    (tmp_path / "bad.jpg").write_bytes(b"\xff\xd8\xff" + b"\x00" * 64)
    listing.write_text(f"{SAMPLES / 'china.jpg'}\n{tmp_path / 'bad.jpg'}\n")
    assert main(["bench", str(listing), "--device", "cpu", "--batch-size", "2", "--iterations", "1",
                 "--skip-naive"]) == 2
    assert "bench: 1 of 2 images failed (first: " + str(tmp_path / "bad.jpg") in capsys.readouterr().err


def test_a_report_path_that_cannot_be_written_is_refused_before_the_measuring(tmp_path, capsys):
    assert main(["bench", str(SAMPLES), "--device", "cpu", "--json", str(tmp_path / "nodir" / "b.json")]) == 2
    captured = capsys.readouterr()
    assert "--json" in captured.err and "does not exist" in captured.err and "Traceback" not in captured.err
    assert captured.out == ""  # nothing measured


def test_the_decoders_lines_about_a_bad_file_are_logged_at_debug_not_printed(tmp_path, capfd):
    """What libjpeg-turbo prints about a cut JPEG (no file named in it) goes to the log at debug;
    gpudet's own line names the file."""
    shutil.copy(SAMPLES / "astronaut.png", tmp_path)
    (tmp_path / "cut.jpg").write_bytes((SAMPLES / "china.jpg").read_bytes()[:20000])
    main(["bench", str(tmp_path), "--device", "cpu", "--limit", "2", "--iterations", "1", "--skip-naive"])
    err = capfd.readouterr().err
    assert "cut.jpg" in err and "Premature end" not in err and "libjpeg" not in err, err
