"""Engine: IOBinding through DLPack, static-output buffers reused, dynamic outputs on the device."""

import dataclasses
import importlib.util
import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch

from pipeline.device import Device
from pipeline.engine import Engine
from pipeline.errors import ModelError
from pipeline.contracts.end_to_end import EndToEnd
from pipeline.postprocess import Thresholds, image_meta
from pipeline.results import Detections
from pipeline.preprocess import Preprocessor
from pipeline.source import read_checked
from pipeline.listing import list_images

from conftest import ROOT, SAMPLES, cpu_and_cuda

MODEL = ROOT / "models" / "retinaface_mnet025.onnx"
SCALARS = {"score_threshold": 0.5, "iou_threshold": 0.4, "max_detections": 750}
ANCHORS_640 = (80 * 80 + 40 * 40 + 20 * 20) * 2


@pytest.fixture(scope="module")
def heads_model(tmp_path_factory):
    """The raw RetinaFace heads with a static 640x640 input (batch symbolic): a static-output model."""
    spec = importlib.util.spec_from_file_location("build_retinaface", ROOT / "scripts" / "build_retinaface.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    path = tmp_path_factory.mktemp("m") / "heads.onnx"
    onnx.save(build.heads_only(onnx.load(str(MODEL)), 640, 640), str(path))
    return path


def device_of(name: str) -> Device:
    return Device("cuda", 0) if name == "cuda" else Device("cpu")


def sample_batch(device: Device, size: int = 640, batch_size: int = 4):
    preprocessor = Preprocessor(device=device, batch_size=batch_size, num_threads=2, height=size, width=size,
                                resize="letterbox", channel_order="BGR", mean=[104, 117, 127], std=[1, 1, 1],
                                pad_value=0, dtype="float32", layout="NCHW", hw_decoder_load=0.9)
    items = [read_checked(r) for r in list_images(SAMPLES)[:batch_size]]
    return preprocessor, items


@cpu_and_cuda()
def test_input_is_bound_without_a_copy_and_outputs_stay_on_the_device(device):
    dev = device_of(device)
    preprocessor, items = sample_batch(dev)
    batch = preprocessor.run(items)
    engine = Engine(MODEL, device=dev, scalars=SCALARS)
    bound = []  # the OrtValue the engine binds as the model's input, seen at the binding call
    binding = engine.binding

    class Spy:
        def bind_ortvalue_input(self, name, value):
            bound.append((name, value.data_ptr(), value.device_name()))
            return binding.bind_ortvalue_input(name, value)

        def __getattr__(self, name):
            return getattr(binding, name)

    engine.binding = Spy()
    outputs = engine.run(batch.images)
    engine.binding = binding
    # DALI's own buffer, bound where it is: no host copy, no device copy
    assert bound == [(engine.image_input.name, batch.images.data_ptr(), "cuda" if dev.is_cuda else "cpu")]
    ort_outputs = engine.binding.get_outputs()
    for spec, ort_value in zip(engine.outputs, ort_outputs):
        tensor = outputs[spec.name]
        assert tensor.device.type == dev.kind
        assert tensor.data_ptr() == ort_value.data_ptr(), spec.name  # torch reads ORT's allocation
    assert outputs["boxes"].shape[1] == 4 and outputs["batch_index"].dtype == torch.int64


@cpu_and_cuda()
def test_static_outputs_reuse_preallocated_buffers_across_batches(device, heads_model):
    dev = device_of(device)
    engine = Engine(heads_model, device=dev, scalars={})
    assert engine.image_input.size_hw == (640, 640)
    preprocessor, items = sample_batch(dev)
    pointers, firsts = [], []
    for group in (items[:2], items[2:4], items[:2][::-1]):
        out = engine.run(preprocessor.run(group).images)
        assert out["loc"].shape == (2, ANCHORS_640, 4) and out["loc"].device.type == dev.kind
        pointers.append({k: v.data_ptr() for k, v in out.items()})
        firsts.append(out["conf"][0, :, 1].max().item())
    assert pointers[0] == pointers[1] == pointers[2]
    assert firsts[0] != firsts[1]  # the buffers hold each run's real outputs, not a stale copy
    # A batch of another size gets its own buffers, kept as well.
    out = engine.run(preprocessor.run(items[:1]).images)
    again = engine.run(preprocessor.run(items[1:2]).images)
    assert out["loc"].shape[0] == 1 and out["loc"].data_ptr() == again["loc"].data_ptr() != pointers[0]["loc"]


def test_a_dynamic_input_size_is_fixed_at_load_time():
    engine = Engine(MODEL, device=Device("cpu"), scalars=SCALARS, input_size_hw=(480, 320))
    assert engine.image_input.size_hw == (480, 320)
    assert Engine(MODEL, device=Device("cpu"), scalars=SCALARS).image_input.size_hw is None


def test_model_with_an_unusable_input_is_refused_with_what_was_found(tmp_path):
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", ["x"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 10])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 10])])
    path = tmp_path / "identity.onnx"
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8), str(path))
    with pytest.raises(ModelError, match=r"found inputs: x float \[1, 10\]"):
        Engine(path, device=Device("cpu"), scalars={})


def dtoh_copies(trace_path) -> list[int]:
    """Bytes of every device-to-host memcpy in a torch profiler chrome trace."""
    events = json.loads(open(trace_path).read())["traceEvents"]
    return [e.get("args", {}).get("bytes", -1) for e in events
            if e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", "")]


@pytest.mark.cuda
def test_no_device_to_host_copy_of_model_outputs(tmp_path):
    """Profile engine + postprocess on a heavy batch: the only sizable D2H copy is the final rows."""
    from torch.profiler import ProfilerActivity, profile

    dev = Device("cuda", 0)
    preprocessor, items = sample_batch(dev, batch_size=12)
    items = [read_checked(r) for r in list_images(SAMPLES)] * 2  # 12 images
    # Many candidates: a low in-model threshold and a loose NMS give thousands of rows.
    engine = Engine(MODEL, device=dev, scalars={"score_threshold": 0.01, "iou_threshold": 0.95,
                                                "max_detections": 750})
    batch = preprocessor.run(items)
    engine.run(batch.images)  # warm-up (cuDNN algorithm search, allocations)
    meta = image_meta(batch.scale_yx, batch.pad_yx, batch.orig_hw, dev.torch)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as engine_prof:
        outputs = engine.run(batch.images)
    output_bytes = sum(t.numel() * t.element_size() for t in outputs.values())
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as post_prof:
        det = EndToEnd(num_landmarks=5)(outputs, meta, num_images=len(items),
                                        thresholds=Thresholds(0.9, 0.4, 750)).to_host()
    engine_prof.export_chrome_trace(str(tmp_path / "engine.json"))
    post_prof.export_chrome_trace(str(tmp_path / "post.json"))
    engine_copies, post_copies = dtoh_copies(tmp_path / "engine.json"), dtoh_copies(tmp_path / "post.json")
    final_bytes = len(det.scores) * (3 + 4 + 10) * 4
    print(f"rows {outputs['boxes'].shape[0]}, model outputs {output_bytes} B, final rows {final_bytes} B, "
          f"D2H in engine {engine_copies}, in postprocess {post_copies}")
    assert outputs["boxes"].shape[0] > 1000 and len(det.scores) >= 3
    # ORT's NMS reads its candidate count back (a few bytes); the outputs themselves never move.
    assert sum(engine_copies) < output_bytes / 100
    # Postprocess: the count of kept rows (8 bytes) and the final rows, nothing else.
    assert sorted(post_copies)[-1] == final_bytes and sum(post_copies) <= final_bytes + 64


def test_external_data_outside_the_model_folder_is_refused(tmp_path):
    from onnx.external_data_helper import convert_model_to_external_data

    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["b", 3, 8, 8])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["b", 3, 8, 8])
    weight = onnx.numpy_helper.from_array(np.ones((1, 3, 8, 8), np.float32) * 2, "w")
    graph = onnx.helper.make_graph([onnx.helper.make_node("Mul", ["x", "w"], ["y"])], "g", [x], [y], [weight])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8)
    (tmp_path / "models").mkdir()
    convert_model_to_external_data(model, location="weights.bin", size_threshold=0)
    onnx.save(model, str(tmp_path / "models" / "inside.onnx"))
    Engine(tmp_path / "models" / "inside.onnx", device=Device("cpu"), scalars={})  # its own folder: fine
    for entry in model.graph.initializer[0].external_data:
        if entry.key == "location":
            entry.value = "../secret.bin"
    (tmp_path / "secret.bin").write_bytes(b"\0" * 4 * 3 * 64)
    onnx.save(model, str(tmp_path / "models" / "escape.onnx"))
    with pytest.raises(ModelError, match="outside the model's folder"):
        Engine(tmp_path / "models" / "escape.onnx", device=Device("cpu"), scalars={})


@pytest.mark.cuda
def test_ssd_heads_postprocess_copies_only_the_final_detections(tmp_path):
    """Raw heads bound to static buffers, decoded + NMS'd in torch: one device-to-host copy per
    batch, the packed final rows (each image's count and flag, then as many rows per image as the
    batch needs, rounded up to a power of two)."""
    from torch.profiler import ProfilerActivity, profile

    from pipeline import Detector

    detector = Detector.from_config(ROOT / "configs" / "retinaface_mnet025_heads.yaml", device="cuda", batch_size=12,
                                    overrides=["postprocess.score_threshold=0.3"])
    refs = list_images(SAMPLES) * 2
    refs = [type(r)(i, r.path) for i, r in enumerate(refs)]
    list(detector.stream(refs, on_error=lambda errors: None))  # warm-up
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        (batch, found), = list(detector.stream(refs, on_error=lambda errors: None))
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    copies = dtoh_copies(tmp_path / "trace.json")
    assert detector.postprocess.graphs.enabled and detector.postprocess.graphs._graphs  # replayed as a CUDA graph
    rows = detector.postprocess.reader.rows
    most = int(np.bincount(found.batch_index).max())
    block_bytes = (1 + rows) * 12 * (6 + 10) * 4
    heads_bytes = 12 * ANCHORS_640 * (4 + 2 + 10) * 4
    print(f"ssd_heads: {len(found.scores)} detections (at most {most} per image), rows read {rows}, "
          f"D2H copies {copies}")
    assert copies == [block_bytes] and rows == max(16, 1 << (most - 1).bit_length())
    assert sum(copies) < heads_bytes / 100


def test_cuda_graph_needs_static_shapes_and_says_so(heads_model):
    """run.cuda_graph on a model with in-graph NMS (dynamic N) is refused with what was found; on
    the CPU the option does nothing."""
    engine = Engine(heads_model, device=Device("cpu"), scalars={}, batch_size=2, cuda_graph=True)
    assert not engine.cuda_graph and engine.image_input.batch == 2 and engine.declared_batch is None
    if not torch.cuda.is_available():
        return
    with pytest.raises(ModelError, match="run.cuda_graph needs static shapes.*dynamic outputs boxes"):
        Engine(ROOT / "models" / "retinaface_mnet025.onnx", device=Device("cuda", 0), input_size_hw=(640, 640),
               batch_size=2, cuda_graph=True, scalars={"score_threshold": 0.5, "iou_threshold": 0.4,
                                                      "max_detections": 10})


@pytest.mark.cuda
def test_ort_cuda_graph_replays_per_slot_on_each_new_batch(heads_model):
    """ORT's CUDA graph (one per output slot, each with its own input buffer): every run computes on
    the batch given now, into that slot's buffers, the same numbers as without the graph."""
    dev = Device("cuda", 0)
    plain = Engine(heads_model, device=dev, scalars={})
    graphed = Engine(heads_model, device=dev, scalars={}, batch_size=2, cuda_graph=True)
    graphed.warm_up(2, (640, 640))  # captures both slots
    for step in range(4):
        x = torch.randn(2, 3, 640, 640, generator=torch.Generator().manual_seed(step)).mul_(50).cuda()
        slot = step % 2
        want = {k: v.clone() for k, v in plain.run(x).items()}
        got = graphed.run(x, slot=slot)
        assert got["loc"].data_ptr() == graphed.static_buffers(2, slot)["loc"].data_ptr()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-3, atol=1e-3)


@pytest.mark.cuda
def test_detect_with_ort_cuda_graph_finds_the_same(tmp_path):
    """The RetinaFace heads config with run.cuda_graph=true: the same detections as without, also
    with three output slots (three captured graphs, the model a batch further ahead)."""
    from pipeline import Detector

    def found(*overrides):
        detector = Detector.from_config(ROOT / "configs" / "retinaface_mnet025_heads.yaml", device="cuda",
                                        batch_size=4, overrides=["postprocess.score_threshold=0.5", *overrides])
        parts = [d for _, d in detector.stream(list_images(SAMPLES) * 2, lambda e: None)]
        assert detector.postprocess.graphs.enabled  # the postprocess replayed its own CUDA graphs too
        return Detections(**{k: np.concatenate([getattr(p, k) for p in parts]) for k in (
            "batch_index", "boxes_xyxy", "scores", "labels", "landmarks")})

    a = found()
    for b in found("run.cuda_graph=true"), found("run.cuda_graph=true", "run.pipeline_depth=3"):
        assert a.batch_index.tolist() == b.batch_index.tolist() and len(a.scores) >= 6
        assert np.allclose(a.scores, b.scores, atol=1e-4) and np.allclose(a.boxes_xyxy, b.boxes_xyxy, atol=0.05)


def test_launch_on_the_cpu_is_a_complete_run(heads_model):
    """On the CPU there is nothing to queue: launch returns the finished outputs, run's numbers."""
    engine = Engine(heads_model, device=Device("cpu"), scalars={})
    x = torch.randn(2, 3, 640, 640, generator=torch.Generator().manual_seed(0)).mul_(50)
    launched = engine.launch(x)
    assert launched.complete and launched.started is None and launched.seconds() is None
    launched.wait()  # nothing to wait for
    want = {k: v.clone() for k, v in launched.outputs.items()}
    for name, value in engine.run(x).items():
        torch.testing.assert_close(value, want[name])


def read_on_another_stream(launched, dev: Device) -> dict[str, torch.Tensor]:
    """A launched run's outputs as a reader on a stream of its own takes them: it waits for the
    run (Launched.wait), copies them, and the host waits for that copy."""
    reader = torch.cuda.Stream(dev.torch)
    with torch.cuda.stream(reader):
        launched.wait()
        got = {k: v.clone() for k, v in launched.outputs.items()}
    reader.synchronize()
    return got


@pytest.mark.cuda
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_launch_queues_the_model_without_a_host_wait(heads_model, cuda_graph):
    """Engine.launch on a GPU returns while the model is still queued behind earlier work on the
    engine's stream; a reader on another stream that waits for it (Launched.wait) reads run()'s
    numbers. A model with a dynamic output (in-graph NMS) is synchronized as before."""
    dev = Device("cuda", 0)
    engine = Engine(heads_model, device=dev, scalars={}, batch_size=2, cuda_graph=cuda_graph)
    engine.warm_up(2, (640, 640))
    x = torch.randn(2, 3, 640, 640, generator=torch.Generator().manual_seed(1)).mul_(50).cuda()
    want = {k: v.clone() for k, v in engine.run(x, slot=1).items()}
    with torch.cuda.stream(engine.stream):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of spinning ahead of the model on its stream
    launched = engine.launch(x, slot=0)
    assert not launched.complete and not launched.finished.query()  # returned before the model ran
    got = read_on_another_stream(launched, dev)
    assert 0 < launched.seconds() < 0.1  # the model's own time: the spin ran before its first event
    for name in want:
        torch.testing.assert_close(got[name], want[name])
    nms = Engine(MODEL, device=dev, scalars=SCALARS, input_size_hw=(640, 640))
    assert nms.launch(x).complete


class LateProducer:
    """A DLPack producer whose tensor is still being written when it is handed out, as a DALI batch
    may be: the write waits behind a spin on the producer's own stream. It keeps the DLPack stream
    contract: a named reader stream waits for the write on the GPU; no stream named, the host waits."""

    def __init__(self, value: torch.Tensor, spin_cycles: int):
        self.stream = torch.cuda.Stream(value.device)
        self.stream.wait_stream(torch.cuda.current_stream(value.device))
        self.tensor = torch.full_like(value, float("nan"))
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(spin_cycles)
            self.tensor.copy_(value)
        self.written = torch.cuda.Event()
        self.written.record(self.stream)
        self.readers: list = []

    def __dlpack_device__(self):
        return self.tensor.__dlpack_device__()

    def __dlpack__(self, stream=None, **unused):
        self.readers.append(stream)
        if stream is None:
            self.written.synchronize()
        elif stream != -1:
            reader = torch.cuda.default_stream() if stream == 1 else torch.cuda.ExternalStream(stream)
            reader.wait_event(self.written)
        return self.tensor.__dlpack__(stream=-1)


@pytest.mark.cuda
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_the_model_waits_on_the_gpu_for_its_input_to_be_written(heads_model, cuda_graph):
    """DALI hands out a batch while its kernels may still be writing it on DALI's stream. The engine
    takes it through DLPack naming its own stream as the reader: the model (and the CUDA-graph
    input copy) wait for those writes on the GPU, and launch does not wait for them on the host."""
    dev = Device("cuda", 0)
    engine = Engine(heads_model, device=dev, scalars={}, batch_size=2, cuda_graph=cuda_graph)
    engine.warm_up(2, (640, 640))
    x = torch.randn(2, 3, 640, 640, generator=torch.Generator().manual_seed(2)).mul_(50).cuda()
    want = {k: v.clone() for k, v in engine.run(x, slot=1).items()}
    late = LateProducer(x, 200_000_000)  # ~0.1 s of spinning before the write
    launched = engine.launch(late, slot=0)
    assert late.readers == [engine.stream.cuda_stream]
    assert not late.written.query()  # launch returned while the input was still unwritten
    got = read_on_another_stream(launched, dev)
    for name in want:
        torch.testing.assert_close(got[name], want[name])


@pytest.mark.cuda
def test_a_host_array_is_taken_as_before_by_an_engine_on_the_gpu(heads_model):
    """Host memory has no stream to name: a numpy batch goes to ORT as it is (ORT copies it in)."""
    engine = Engine(heads_model, device=Device("cuda", 0), scalars={})
    x = torch.randn(2, 3, 640, 640, generator=torch.Generator().manual_seed(3)).mul_(50)
    want = {k: v.clone() for k, v in engine.run(x.cuda()).items()}
    for name, value in engine.run(x.numpy()).items():
        torch.testing.assert_close(value, want[name])


def test_the_session_module_imports_without_torch():
    """`gpudet detect` opens its session before torch is imported (session.start_early): the
    module it does that with must not import torch, DALI or Triton itself."""
    code = ("import sys, pipeline.session; heavy = {'torch', 'nvidia.dali', 'triton'} & set(sys.modules); "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_start_early_starts_nothing_off_the_gpu():
    """On the CPU (or with no CUDA EP) there is no head start to give: nothing is opened."""
    from pipeline import session
    from pipeline.config import load_config

    session.start_early(load_config(None, ["run.device=cpu"]))
    if not torch.cuda.is_available():
        session.start_early(load_config(None, []))
    assert not session._started


def test_start_early_leaves_the_opening_to_the_engine_thread(monkeypatch):
    """start_early returns at once: the CUDA context and stream, the session and then its first
    run are made on the thread that becomes the engine's, while the caller imports torch, DALI
    and Triton (the CUDA parts stand in here: the opening waits until the test lets it go)."""
    import threading

    from pipeline import session
    from pipeline.config import load_config

    release, seen = threading.Event(), {}

    def open_session(**kwargs):
        seen["open"] = threading.current_thread()
        assert release.wait(10), "start_early waited for the opening"
        return "the session"

    def first_run(opening, *args):
        seen["run"] = (threading.current_thread(), opening.result())

    monkeypatch.setattr(session.ort, "get_available_providers", lambda: ["CUDAExecutionProvider"])
    monkeypatch.setattr(session, "has_driver", lambda: True)
    monkeypatch.setattr(session, "new_stream", lambda index: seen.setdefault("stream", threading.current_thread())
                        and 1234)
    monkeypatch.setattr(session, "open_session", open_session)
    monkeypatch.setattr(session, "_first_run", first_run)
    session.start_early(load_config(None, ["run.device=cuda"]))
    try:
        (started,) = session._started.values()
        assert not started.opening.done()  # start_early came back while the opening waits
        release.set()
        started.first_run.result(timeout=10)
    finally:
        release.set()
        session.drop_started()
    assert started.opening.result() == session.Early(1234, "the session")
    assert seen["stream"] is seen["open"] is started.thread is not threading.current_thread()
    assert seen["run"] == (started.thread, session.Early(1234, "the session"))


def test_an_early_session_no_engine_takes_is_stopped_and_let_go():
    """drop_started (after from_config's engine, and when the command ends): a session start_early
    left is removed, its first run's terminate flag set (ORT ends a run between its nodes) and the
    run waited for, so that no CUDA work of it goes on beside a graph captured next, and neither its
    memory nor its thread outlasts the command."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    import onnxruntime as ort

    from pipeline import session

    executor = ThreadPoolExecutor(1)
    thread = executor.submit(threading.current_thread).result()
    options = ort.RunOptions()

    def run_until_terminated():  # stands in for a run still going: ORT's ends at the flag
        deadline = time.monotonic() + 10
        while not options.terminate:
            if time.monotonic() > deadline:
                return "never told to stop"
            time.sleep(0.01)
        return "stopped"

    first_run = executor.submit(run_until_terminated)
    opening = executor.submit(lambda: None)
    session._started[("key",)] = session.Started(executor, thread, opening, first_run, options)
    session.drop_started()
    assert not session._started and options.terminate
    assert first_run.done() and first_run.result() == "stopped" and not thread.is_alive()
    with pytest.raises(RuntimeError, match="after shutdown"):
        executor.submit(print)


@pytest.mark.cuda
def test_a_session_started_early_is_taken_over_with_its_first_run():
    """session.start_early (what `gpudet detect` and `gpudet bench` call before their imports)
    opens the default config's session on a CUDA stream of its own and starts the model's first
    run on a thread; Detector.from_config takes that session, thread and stream over, and finds
    what a detector that opened its own finds."""
    from pipeline import Detector, session
    from pipeline.config import load_config

    config = load_config(None, ["run.device=cuda"])
    session.start_early(config)
    (started,) = session._started.values()
    early = Detector.from_config(config)
    assert not session._started
    assert started.first_run.done() and started.first_run.exception() is None
    engine, opened = early.engine, started.opening.result()
    assert engine.session is opened.opened.session and engine._executor is started.executor
    assert engine.stream.cuda_stream == opened.stream
    plain = Detector.from_config(config)
    assert plain.engine.stream.cuda_stream != opened.stream

    def found(detector):
        return [(r.path, r.boxes_xyxy.round(1).tolist(), r.scores.round(3).tolist()) for r in detector.run(SAMPLES)]

    assert found(early) == found(plain) and sum(len(boxes) for _, boxes, _ in found(plain)) == 3

    # Asked for other options, the engine opens its own session and the early one is let go.
    session.start_early(config)
    other = Detector.from_config(dataclasses.replace(config, run=dataclasses.replace(config.run, batch_size=16)))
    assert not session._started and other.engine.stream.cuda_stream != opened.stream


def test_the_cpu_session_runs_the_optimized_graph():
    """The CPU engine's session has ONNX Runtime's graph optimizations on (unoptimized, the default
    model ran at half its speed on a 2-core CPU)."""
    import onnxruntime as ort

    from pipeline import Detector

    detector = Detector.from_config(device="cpu")
    options = detector.engine.session.get_session_options()
    assert options.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL


def test_the_cpu_takes_its_own_batch_size_unless_one_is_given():
    from pipeline import Detector

    assert Detector.from_config(device="cpu").batch_size == 8  # run.cpu_batch_size
    assert Detector.from_config(device="cpu", batch_size=32).batch_size == 32  # --batch-size sets both
    assert Detector.from_config(device="cpu", overrides=["run.cpu_batch_size=3"]).batch_size == 3


def test_cuda_graph_auto_fixes_the_batch_only_where_the_shapes_allow_a_graph(heads_model, tmp_path):
    """run.cuda_graph auto: a model whose outputs the batch size decides gets its batch fixed (what
    a graph needs); a model with an output of its own size (an end-to-end export's detections)
    keeps any batch size, where cuda_graph true refuses it with the reason."""
    from pipeline.session import open_session

    static = open_session(heads_model, cuda_index=None, batch_size=4, cuda_graph="auto")
    assert static.session.get_inputs()[0].shape[0] == 4
    dynamic = tmp_path / "dynamic.onnx"  # found [4, n]: where the image is not zero
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("NonZero", ["images"], ["found"])], "dynamic",
        [onnx.helper.make_tensor_value_info("images", onnx.TensorProto.FLOAT, ["b", 3, "h", "w"])],
        [onnx.helper.make_tensor_value_info("found", onnx.TensorProto.INT64, [4, "n"])])
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8),
              str(dynamic))
    opened = open_session(dynamic, cuda_index=None, input_size_hw=(64, 64), batch_size=4, cuda_graph="auto")
    assert opened.session.get_inputs()[0].shape[0] == "b" and not opened.cuda_graph
    with pytest.raises(ModelError, match="run.cuda_graph needs static shapes"):
        open_session(dynamic, cuda_index=0, input_size_hw=(64, 64), batch_size=4, cuda_graph=True)
