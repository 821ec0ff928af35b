"""The detector: failure isolation with batches in flight, chunked model runs, the stage clock."""

import os

import numpy as np
import pytest

from pipeline.device import Device
from pipeline.preprocess import Preprocessor, preprocess_stream
from pipeline.results import ImageRef
from pipeline.source import EncodedImage
from pipeline.timing import StageClock

from conftest import SAMPLES, cpu_and_cuda

E2E = SAMPLES.parent / "configs" / "retinaface_mnet025_e2e.yaml"
GOOD = np.fromfile(SAMPLES / "grace_hopper.jpg", np.uint8)
CORRUPT = np.concatenate([GOOD[:400], np.zeros(2000, np.uint8)])  # a JPEG cut off in its scan data
GARBAGE = np.frombuffer(b"\xff\xd8\xff" + b"\x13" * 500, np.uint8)  # a JPEG signature, then noise


@cpu_and_cuda()
def test_every_good_image_exactly_once_around_bad_ones(device):
    kinds = ["g", "b", "g", "g", "g", "g", "x", "b", "g", "g", "g", "x", "g"]
    data = {"g": GOOD, "b": CORRUPT, "x": GARBAGE}
    items = [EncodedImage(ImageRef(i, f"{k}{i}.jpg"), data[k]) for i, k in enumerate(kinds)]
    batches = [items[i:i + 4] for i in range(0, len(items), 4)]
    p = Preprocessor(device=Device("cuda", 0) if device == "cuda" else Device("cpu"), batch_size=4, num_threads=2,
                     height=64, width=64, resize="letterbox", channel_order="RGB", mean=[0, 0, 0], std=[1, 1, 1],
                     pad_value=0, dtype="float32", layout="NCHW", hw_decoder_load=0.9)
    errors = []
    done = [r.index for b in preprocess_stream(p, batches, errors.extend, depth=3) for r in b.refs]
    failed = [e.index for e in errors]
    assert sorted(done) == [i for i, k in enumerate(kinds) if k == "g"]
    assert len(done) == len(set(done))
    # Some corrupt JPEGs decode to garbage without an error; those that fail must be the bad ones.
    assert set(failed) <= {i for i, k in enumerate(kinds) if k != "g"} and {6, 11} <= set(failed)
    assert all(e.reason == "decode_failed" and e.message.startswith("cannot decode") for e in errors)
    assert len(done) + len(failed) <= len(kinds)


@cpu_and_cuda()
def test_a_stream_stopped_early_leaves_nothing_in_dali_for_the_next(device):
    p = Preprocessor(device=Device("cuda", 0) if device == "cuda" else Device("cpu"), batch_size=2, num_threads=2,
                     height=64, width=64, resize="letterbox", channel_order="RGB", mean=[0, 0, 0], std=[1, 1, 1],
                     pad_value=0, dtype="float32", layout="NCHW", hw_decoder_load=0.9)
    first = [[EncodedImage(ImageRef(i, f"a{i}.jpg"), GOOD) for i in (k, k + 1)] for k in range(0, 10, 2)]
    stopped = preprocess_stream(p, first, lambda errors: None, depth=3)
    assert next(stopped).refs[0].path == "a0.jpg"
    stopped.close()  # two batches were still in DALI
    assert not p.in_flight
    second = [[EncodedImage(ImageRef(i, f"b{i}.jpg"), GOOD) for i in (k, k + 1)] for k in range(0, 4, 2)]
    assert [r.path for b in preprocess_stream(p, second, lambda errors: None) for r in b.refs] == \
        ["b0.jpg", "b1.jpg", "b2.jpg", "b3.jpg"]


def test_stage_clock_is_exclusive(monkeypatch):
    # A fake clock, so the accounting is checked exactly and a loaded machine cannot change it.
    now = [100.0]
    monkeypatch.setattr("pipeline.timing.time.perf_counter", lambda: now[0])
    clock = StageClock()
    with clock("outer"):
        now[0] += 0.02
        with clock("inner"):
            now[0] += 0.03
        now[0] += 0.005
    assert clock.seconds["outer"] == pytest.approx(0.025) and clock.seconds["inner"] == pytest.approx(0.03)


@cpu_and_cuda()
def test_running_the_model_in_parts_gives_the_same_detections(device):
    """The out-of-memory fallback (Engine.run_batch): views of DALI's buffer, run a few images at a
    time, their outputs joined as one batch's (the end-to-end model: dynamic outputs, no CUDA graph)."""
    from pipeline import Detector
    from pipeline.postprocess import image_meta
    from pipeline.source import read_checked
    from pipeline.listing import list_images

    detector = Detector.from_config(E2E, device=device, batch_size=8)
    engine, preprocessor = detector.engine, detector.preprocessor
    preprocessor.pad_partial_batches = True
    batch = preprocessor.run([read_checked(r) for r in list_images(SAMPLES)])  # 6 images padded to 8
    meta = image_meta(batch.scale_yx, batch.pad_yx, batch.orig_hw)

    def found(run_batch):
        engine.run_batch = run_batch
        outputs = engine.run(batch.images)
        return detector.postprocess(outputs, meta, num_images=6, thresholds=detector.thresholds).to_host()

    whole = found(None)
    for part in (4, 3, 1):
        parts = found(part)
        assert parts.batch_index.tolist() == whole.batch_index.tolist()
        # cuDNN may pick other algorithms for other batch sizes: equal within rounding.
        assert np.allclose(parts.boxes_xyxy, whole.boxes_xyxy, atol=0.05)
        assert np.allclose(parts.landmarks, whole.landmarks, atol=0.05)
    assert sorted(whole.batch_index.tolist()) == [0, 1, 5]  # astronaut, camera, grace_hopper


@pytest.mark.cuda
def test_gpu_out_of_memory_halves_the_model_batch_and_finishes(tmp_path):
    """A real ORT out-of-memory under run.gpu_mem_limit_mb: the run goes on with smaller model batches
    (the end-to-end model: a CUDA graph, as the default config's, runs whole batches only)."""
    import json

    from pipeline.cli import main

    from conftest import EXPECTED_FACES, read_jsonl

    outcomes = {}
    for limit in (64, 128, 256, 512, 1024):
        out = tmp_path / f"limit{limit}"
        code = main(["detect", str(SAMPLES), "--out", str(out), "--device", "cuda", "--batch-size", "64",
                     "--config", str(E2E), "--set", f"run.gpu_mem_limit_mb={limit}", "--no-progress"])
        summary = json.loads((out / "summary.json").read_text()) if code == 0 else {}
        outcomes[limit] = (code, summary.get("model_batch"))
        if code == 0 and summary["model_batch"] < 64:
            faces = {os.path.basename(r["path"]): len(r["detections"]) for r in read_jsonl(out / "detections.jsonl")}
            assert faces == EXPECTED_FACES
            # With retrying off, the same limit is a clear error naming the batch size.
            code_off = main(["detect", str(SAMPLES), "--out", str(tmp_path / "off"), "--device", "cuda",
                             "--batch-size", "64", "--config", str(E2E), "--set", f"run.gpu_mem_limit_mb={limit}",
                             "--set", "run.oom_retry=false", "--no-progress"])
            assert code_off == 2
            print(f"gpu_mem_limit_mb={limit}: model batch 64 -> {summary['model_batch']}; outcomes {outcomes}")
            return
    pytest.fail(f"no memory limit made the model batch shrink and finish: {outcomes}")


@pytest.mark.parametrize("depth", [2, 3])
def test_engine_and_postprocess_on_threads_give_the_inline_results(tmp_path, depth):
    """The GPU's stream (engine and postprocess each on a thread, run.pipeline_depth output slots,
    a slot reused only after its postprocess finished), run here on the CPU's ORT: the same
    batches, in order, with the same detections as the inline path, around a bad image, with more
    batches than slots, every slot used; the engine's time is counted from its thread."""
    from pipeline import Detector
    from pipeline.listing import list_images

    (tmp_path / "bad.jpg").write_bytes(CORRUPT.tobytes())
    listed = list_images(SAMPLES) * 3 + [ImageRef(0, str(tmp_path / "bad.jpg"))] + list_images(SAMPLES)
    refs = [ImageRef(i, r.path) for i, r in enumerate(listed)]

    def run(overlap: bool, depth: int = 2):
        detector = Detector.from_config(SAMPLES.parent / "configs" / "retinaface_mnet025_heads.yaml", device="cpu",
                                        batch_size=4, overrides=["postprocess.score_threshold=0.5",
                                                                 f"run.pipeline_depth={depth}"])
        detector.overlap = overlap
        launch, slots = detector.engine.launch, set()
        detector.engine.launch = lambda images, slot=0, **kw: (slots.add(slot), launch(images, slot, **kw))[1]
        clock, errors = StageClock(), []
        out = [([r.index for r in b.refs], found) for b, found in detector.stream(refs, errors.extend, clock=clock)]
        return out, errors, clock, slots

    inline, inline_errors, _, _ = run(False)
    threaded, threaded_errors, clock, slots = run(True, depth)
    assert slots == set(range(depth))
    assert [i for i, _ in threaded] == [i for i, _ in inline] and len(threaded) >= 6
    for (_, a), (_, b) in zip(inline, threaded):
        assert a.batch_index.tolist() == b.batch_index.tolist() and np.array_equal(a.boxes_xyxy, b.boxes_xyxy)
        assert np.array_equal(a.scores, b.scores) and np.array_equal(a.landmarks, b.landmarks)
    assert [(e.index, e.reason) for e in threaded_errors] == [(e.index, e.reason) for e in inline_errors]
    assert sum(len(f.scores) for _, f in threaded) >= 8 and clock.seconds["engine"] > 0


@cpu_and_cuda()
def test_every_ort_run_happens_on_the_engines_own_thread(device):
    """ORT keeps its CUDA graphs per calling thread: a graph captured at warm-up on one thread and
    run from another is captured again mid-pipeline (on the H200 that capture failed beside the
    postprocess thread). So warm-up, the pipeline with and without threads, and a direct run all
    call ORT from the engine's one thread."""
    import threading

    import torch

    from pipeline import Detector
    from pipeline.listing import list_images

    class Recorder:  # the session, noting which thread each run comes from
        def __init__(self, session):
            self.session, self.threads = session, set()

        def run_with_iobinding(self, *args):
            self.threads.add(threading.current_thread())
            return self.session.run_with_iobinding(*args)

        def __getattr__(self, name):
            return getattr(self.session, name)

    detector = Detector.from_config(SAMPLES.parent / "configs" / "retinaface_mnet025_heads.yaml", device=device,
                                    batch_size=2, overrides=["run.cuda_graph=true"])
    engine = detector.engine
    engine.session = recorder = Recorder(engine.session)
    engine.warm_up(2, (640, 640))
    refs = list_images(SAMPLES)
    found = {}
    for overlap in (True, False):
        detector.overlap = overlap
        found[overlap] = [f.scores.tolist() for _, f in detector.stream(refs, lambda errors: None)]
    engine.run(torch.zeros(2, 3, 640, 640, device=engine.device.torch))  # the float32 NCHW heads
    assert recorder.threads == {engine._thread} and engine._thread is not threading.current_thread()
    assert found[True] == found[False] and len(found[True]) == 3


def test_a_detector_runs_one_stream_at_a_time_and_a_stopped_one_leaves_nothing_behind():
    from pipeline import Detector

    detector = Detector.from_config(SAMPLES.parent / "configs" / "retinaface_mnet025_heads.yaml", device="cpu",
                                    batch_size=2)
    faces = [(r.path, r.scores.tolist()) for r in detector.run(str(SAMPLES))]
    first = detector.run(str(SAMPLES))
    next(first)
    with pytest.raises(RuntimeError, match="already running a stream"):
        next(detector.run(str(SAMPLES)))  # its DALI batches and output buffers would be the first's
    first.close()
    assert [(r.path, r.scores.tolist()) for r in detector.run(str(SAMPLES))] == faces


def test_on_the_cpu_the_default_config_runs_a_short_batch_as_it_is():
    """run.batch_size fixes the model's batch dimension only for a CUDA graph: on the CPU a job's
    short last batch (or a job of 6 images) runs as it is, not padded to a batch of work."""
    from pipeline import Detector

    detector = Detector.from_config(device="cpu")
    assert detector.batch_size == 8
    assert detector.engine.image_input.batch is None and not detector.preprocessor.pad_partial_batches
    found = list(detector.run(str(SAMPLES)))
    assert len(found) == 6 and sum(len(r.scores) for r in found) == 3
