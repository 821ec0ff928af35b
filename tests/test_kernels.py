"""The Triton kernels against the torch ops they stand in for, bit for bit: on the GPU, and on the
CPU through Triton's interpreter (a process of its own: TRITON_INTERPRET is read at import)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline import kernels
from pipeline.nms import fixed_point, packed_bits, suppressor_rows, suppressors

from conftest import random_boxes

HERE = Path(__file__).parent


@pytest.fixture(autouse=True)
def no_failed_kernels(monkeypatch):
    """Each test starts with every kernel usable (a kernel that failed is off for the process)."""
    monkeypatch.setattr(kernels, "_failed", set())


def check_row_max(device: str) -> None:
    generator = torch.Generator().manual_seed(0)
    big = (16, 5003, 91) if device == "cuda" else (2, 1003, 91)  # the interpreter runs a program at a time
    for shape in (big, (3, 7, 2), (2, 130), (1, 1, 1)):
        x = (torch.randn(*shape, generator=generator) * 4).half().to(device)
        x.view(-1)[::97] = float("-inf")  # a row may hold -inf (a masked logit)
        x.view(-1)[5::1009] = float("nan")  # and NaN (a broken model's output): the row's maximum is NaN
        got = kernels.row_max(x)
        assert got.dtype == x.dtype, shape
        torch.testing.assert_close(got, x.amax(dim=-1), rtol=0, atol=0, equal_nan=True)  # NaN where torch's is
    assert "row_max" not in kernels._failed, "the Triton kernel fell back to torch (see the warning)"


def check_suppressor_words(device: str) -> None:
    generator = torch.Generator().manual_seed(1)
    for batch, k, num_classes, grid in ((2, 1, 1, False), (2, 63, 2, False), (3, 64, 1, True), (2, 65, 3, True),
                                        (2, 300, 5, False), (2, 1024, 4, True)):
        boxes = random_boxes(generator, batch, k + 10, grid).to(device)
        classes = torch.randint(0, num_classes, (batch, k + 10), generator=generator).to(device)
        boxes, classes = boxes[:, :k], classes[:, :k]  # a prefix, as top_nms passes it: strided rows
        for threshold in (0.5, 0.3, 0.45):
            got = kernels.suppressor_words(boxes, classes, iou_threshold=threshold)
            assert got is not None, "the Triton kernel did not run (see the warning)"
            expected = packed_bits(suppressors(boxes, classes, iou_threshold=threshold))
            assert got.dtype == torch.int64 and torch.equal(got, expected), (batch, k, threshold)
    # NaN and infinite corners (a broken model's boxes): torch's IoU is NaN there, which suppresses nothing
    nan, inf = float("nan"), float("inf")
    boxes = torch.tensor([[[0, 0, 10, 10], [nan, 0, 10, 10], [0, 0, 10, 10], [-inf, -inf, inf, inf],
                           [-inf, -inf, inf, inf], [0, 0, inf, 10], [0, 0, inf, 10], [1, 1, 9, 9]]]).to(device)
    classes = torch.zeros(1, len(boxes[0]), dtype=torch.long, device=device)
    got = kernels.suppressor_words(boxes, classes, iou_threshold=0.5)
    assert torch.equal(got, packed_bits(suppressors(boxes, classes, iou_threshold=0.5)))
    assert "suppressor_words" not in kernels._failed, "the Triton kernel fell back to torch (see the warning)"


def check_fixed_point(device: str) -> None:
    """The kernel's steps against the torch steps (on the CPU, where they stop once every image
    converged: the same keep, since a converged keep stays), counts of candidates around whole
    words, chains longer than the steps (converged False) and shorter, invalid candidates."""
    generator = torch.Generator().manual_seed(3)
    chain = torch.stack([torch.arange(130.0), torch.zeros(130), torch.arange(130.0) + 10, torch.full((130,), 10.0)],
                        dim=1)[None]  # each box overlaps the next ones: one long chain of suppressions
    cases = [(random_boxes(generator, 3, k, grid), torch.randint(0, 3, (3, k), generator=generator))
             for k, grid in ((1, False), (63, True), (64, False), (65, True), (300, False), (1024, True))]
    cases.append((chain, torch.zeros(1, 130, dtype=torch.long)))
    for boxes, classes in cases:
        rows = packed_bits(suppressors(boxes, classes, iou_threshold=0.5))
        k = boxes.shape[1]
        counts = torch.randint(0, k + 1, (len(boxes),), generator=generator)
        counts[0] = k
        valid = torch.arange(k)[None] < counts[:, None]  # a prefix of each row, as top_nms's
        for steps in (1, 3, 16):
            expected = fixed_point(rows, valid, max_iterations=steps)
            got = kernels.fixed_point(rows.to(device), valid.to(device), steps)
            assert got is not None, "the Triton kernel did not run (see the warning)"
            assert torch.equal(got[0].cpu(), expected[0]) and torch.equal(got[1].cpu(), expected[1]), (k, steps)
    short = fixed_point(packed_bits(suppressors(chain, torch.zeros(1, 130, dtype=torch.long), iou_threshold=0.5)),
                        torch.ones(1, 130, dtype=torch.bool), max_iterations=3)
    assert not short[1].any(), "the chain converged in 3 steps: the case checks nothing about converged"
    assert "fixed_point" not in kernels._failed, "the Triton kernel fell back to torch (see the warning)"


@pytest.mark.cuda
def test_row_max_on_the_gpu_is_amax():
    check_row_max("cuda")


@pytest.mark.cuda
def test_suppressor_words_on_the_gpu_are_the_packed_torch_suppressors():
    check_suppressor_words("cuda")


@pytest.mark.cuda
def test_the_fixed_point_kernel_on_the_gpu_takes_the_torch_steps():
    check_fixed_point("cuda")


def check_compiled_ahead() -> None:
    """compile_ahead compiles each kernel as its first call specialises it: the calls after it
    compile nothing more. Run in a fresh process (nothing compiled yet)."""
    device = torch.device("cuda", 0)
    kernels.compile_ahead(device, row_max_inputs=[(torch.float16, 37)])  # 37 classes: a variant no call made
    assert kernels._ahead[device], "compile_ahead started no thread"
    kernels._compiled_ahead(device)
    # Triton's compiled variants of a kernel for a device (the first entry of its per-device caches)
    launched = (kernels._row_max_kernel, kernels._suppressor_words_kernel, kernels._fixed_point_kernel)
    compiled = [len(kernel.device_caches[0][0]) for kernel in launched]
    assert compiled == [1, 1, 1], compiled
    x = torch.randn(16, 5003, 37, device=device).half()
    torch.testing.assert_close(kernels.row_max(x), x.amax(dim=-1), rtol=0, atol=0)
    generator = torch.Generator().manual_seed(2)
    boxes, classes = random_boxes(generator, 2, 310, False).to(device), torch.zeros(2, 310, dtype=torch.long)
    classes = classes.to(device)
    for k in (300, 64, 1):  # prefixes, as top_nms and exact_nms pass them
        got = kernels.suppressor_words(boxes[:, :k], classes[:, :k], iou_threshold=0.45)
        assert torch.equal(got, packed_bits(suppressors(boxes[:, :k], classes[:, :k], iou_threshold=0.45)))
    big = random_boxes(generator, 2, 1024, False).to(device)  # top_nms's prefix: 16 words a row
    rows = packed_bits(suppressors(big, torch.zeros(2, 1024, dtype=torch.long, device=device), iou_threshold=0.45))
    assert kernels.fixed_point(rows, torch.ones(2, 1024, dtype=torch.bool, device=device), 16) is not None
    after = [len(kernel.device_caches[0][0]) for kernel in launched]
    assert after == compiled, f"the calls compiled variants compile_ahead did not: {compiled} -> {after}"
    assert not kernels._failed


@pytest.mark.cuda
def test_compile_ahead_compiles_what_the_first_calls_launch(tmp_path):
    code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_kernels as t; t.check_compiled_ahead()"
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_CACHE_DIR": str(tmp_path)},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]


def test_compile_ahead_off_the_gpu_starts_nothing(monkeypatch):
    monkeypatch.setattr(kernels, "_ahead", {})
    kernels.compile_ahead(torch.device("cpu"), row_max_inputs=[(torch.float16, 91)])
    assert not kernels._ahead
    kernels._compiled_ahead(torch.device("cpu"))  # nothing to wait for


EXIT_WHILE_COMPILING = """
import sys, time
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pipeline import kernels

# compile_ahead's work for one kernel, for an H100/H200 (sm_90): Triton compiles for a GPU without one
signature = {"boxes_ptr": "*fp32", "classes_ptr": "*i64", "out_ptr": "*i64", "K": "i32", "W": "i32",
             "box_batch_stride": "i32", "class_batch_stride": "i32", "threshold": "fp32", "BLOCK_J": "constexpr"}
kernels._in_background(torch.device("cuda", 0), lambda: triton.compile(
    ASTSource(kernels._suppressor_words_kernel, signature, {(8,): 16}), target=GPUTarget("cuda", 90, 32),
    options=dict(num_warps=1, enable_fp_fusion=False)))
time.sleep(float(sys.argv[1]))
sys.exit(3)
"""


@pytest.mark.skipif(kernels.triton is None, reason="Triton is not installed beside torch")
def test_a_process_that_exits_while_the_kernels_compile_exits_with_its_own_code(tmp_path):
    """A setup that fails (or a Ctrl-C) while compile_ahead's thread compiles: the process ends with
    its own exit code, not SIGABRT (a daemon thread taking the GIL back during the interpreter's
    exit aborts it), at whatever point of the compile it exits."""
    for delay in (0.0, 0.2, 0.4, 0.6, 0.8):
        done = subprocess.run([sys.executable, "-c", EXIT_WHILE_COMPILING, str(delay)], cwd=HERE.parent,
                              env={**os.environ, "TRITON_CACHE_DIR": str(tmp_path / str(delay))},
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 3, (delay, done.returncode, done.stderr[-2000:])


@pytest.mark.skipif(kernels.triton is None, reason="Triton is not installed beside torch")
def test_the_kernels_in_tritons_interpreter_give_the_torch_answers():
    code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_kernels as t; " \
           "t.check_row_max('cpu'); t.check_suppressor_words('cpu'); t.check_fixed_point('cpu')"
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]


def test_without_triton_the_torch_ops_answer(monkeypatch):
    monkeypatch.setattr(kernels, "INTERPRET", True)  # the kernels would be asked for these CPU tensors
    monkeypatch.setattr(kernels, "triton", None)
    x = torch.randn(2, 5, 91).half()
    assert torch.equal(kernels.row_max(x), x.amax(dim=-1))
    boxes, classes = random_boxes(torch.Generator().manual_seed(2), 2, 70, False), torch.zeros(2, 70, dtype=torch.long)
    assert kernels.suppressor_words(boxes, classes, iou_threshold=0.5) is None
    assert torch.equal(suppressor_rows(boxes, classes, iou_threshold=0.5),
                       packed_bits(suppressors(boxes, classes, iou_threshold=0.5)))


def test_a_kernel_that_fails_gives_way_to_the_torch_ops_once_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(kernels, "INTERPRET", True)
    calls = []

    def broken(x):
        calls.append(x)
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")

    monkeypatch.setattr(kernels, "_row_max", broken)
    x = torch.randn(3, 4, 91).half()
    with caplog.at_level("WARNING", logger="gpudet"):
        assert torch.equal(kernels.row_max(x), x.amax(dim=-1))
        assert torch.equal(kernels.row_max(x), x.amax(dim=-1))
    assert len(calls) == 1 and kernels._failed == {"row_max"}  # tried once, then torch's ops
    warnings = [r.getMessage() for r in caplog.records if "row_max" in r.getMessage()]
    assert len(warnings) == 1 and "C compiler" in warnings[0], warnings


def test_out_of_memory_is_not_a_reason_to_give_a_kernel_up(monkeypatch):
    monkeypatch.setattr(kernels, "INTERPRET", True)

    def out_of_memory(x):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(kernels, "_row_max", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        kernels.row_max(torch.randn(2, 91).half())
    assert not kernels._failed


def test_the_kernels_launch_on_their_tensors_gpu(monkeypatch):
    """Triton launches on the current device; the postprocess's thread starts on cuda:0."""
    on = kernels._on(torch.device("cuda", 1))  # made, not entered: no GPU needed
    assert isinstance(on, torch.cuda.device) and on.idx == 1
    monkeypatch.setattr(kernels, "INTERPRET", True)
    entered, launched = [], []

    class Recorder:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(self.device)

        def __exit__(self, *exc):
            pass

    monkeypatch.setattr(kernels, "_on", Recorder)
    monkeypatch.setattr(kernels, "_row_max", lambda x: launched.append(entered[-1]) or x.amax(dim=-1))
    monkeypatch.setattr(kernels, "_suppressor_words", lambda *a: launched.append(entered[-1]))
    x, boxes = torch.randn(2, 91).half(), torch.rand(1, 5, 4)
    kernels.row_max(x)
    kernels.suppressor_words(boxes, torch.zeros(1, 5, dtype=torch.long), iou_threshold=0.5)
    assert launched == [x.device, boxes.device]  # each launch inside its tensors' device
