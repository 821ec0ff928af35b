"""The Ray Data runner on a local cluster with CPU actors: the single-process results, resumable."""

import json

from pipeline.cli import main

from conftest import SAMPLES, read_jsonl


def records(path):
    return sorted(read_jsonl(path), key=lambda r: r["index"])


def test_ray_actors_give_the_single_process_results_and_resume(tmp_path):
    (tmp_path / "broken.jpg").write_bytes(b"\xff\xd8\xff" + b"\x00" * 64)
    listing = tmp_path / "list.txt"
    listing.write_text("".join(f"{p}\n" for p in sorted(SAMPLES.glob("*.*")) if p.suffix != ".md") +
                       f"{tmp_path / 'broken.jpg'}\n")
    common = ["--device", "cpu", "--batch-size", "2", "--quiet"]
    assert main(["detect", str(listing), "--out", str(tmp_path / "one"), *common]) == 3
    assert main(["detect", str(listing), "--out", str(tmp_path / "ray"), "--ray", "--workers", "2", *common]) == 3
    assert records(tmp_path / "one" / "detections.jsonl") == records(tmp_path / "ray" / "detections.jsonl")
    assert records(tmp_path / "one" / "errors.jsonl") == records(tmp_path / "ray" / "errors.jsonl")
    summary = json.loads((tmp_path / "ray" / "summary.json").read_text())
    assert summary["processed"] == 6 and summary["failed"] == 1 and summary["actors"] == 2

    # Resume after a run that recorded only part: the rest is done, each image exactly once.
    detections = (tmp_path / "ray" / "detections.jsonl").read_text().splitlines()
    (tmp_path / "ray" / "detections.jsonl").write_text("\n".join(detections[:2]) + "\n")
    assert main(["detect", str(listing), "--out", str(tmp_path / "ray"), "--ray", "--workers", "2", "--resume",
                 *common]) == 0
    assert records(tmp_path / "one" / "detections.jsonl") == records(tmp_path / "ray" / "detections.jsonl")
