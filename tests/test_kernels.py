"""The Triton kernels against the torch ops they stand in for, bit for bit: on the GPU, and on the
CPU through Triton's interpreter (a process of its own: TRITON_INTERPRET is read at import)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline import kernels
from pipeline.nms import packed_bits, suppressors

HERE = Path(__file__).parent


def check_row_max(device: str) -> None:
    generator = torch.Generator().manual_seed(0)
    for shape in ((16, 5003, 91), (3, 7, 2), (2, 130), (1, 1, 1)):
        x = (torch.randn(*shape, generator=generator) * 4).half().to(device)
        x.view(-1)[::97] = float("-inf")  # a row may hold -inf (a masked logit)
        got = kernels.row_max(x)
        assert got.dtype == x.dtype and torch.equal(got, x.amax(dim=-1)), shape
    assert "row_max" not in kernels._failed, "the Triton kernel fell back to torch (see the warning)"


def random_boxes(generator: torch.Generator, batch: int, k: int, grid: bool) -> torch.Tensor:
    if grid:  # integer corners: many pairs at IoU exactly 1/2, 1/3, ... (ties at the threshold)
        xy = torch.randint(0, 12, (batch, k, 2), generator=generator).float() * 10
        wh = torch.randint(1, 5, (batch, k, 2), generator=generator).float() * 10
    else:
        xy = torch.rand(batch, k, 2, generator=generator) * 200
        wh = torch.rand(batch, k, 2, generator=generator) * 80 + 1
    return torch.cat([xy, xy + wh], dim=-1)


def check_suppressor_words(device: str) -> None:
    generator = torch.Generator().manual_seed(1)
    for batch, k, num_classes, grid in ((2, 1, 1, False), (2, 63, 2, False), (3, 64, 1, True), (2, 65, 3, True),
                                        (2, 300, 5, False), (2, 1024, 4, True)):
        boxes = random_boxes(generator, batch, k + 10, grid).to(device)
        classes = torch.randint(0, num_classes, (batch, k + 10), generator=generator).to(device)
        boxes, classes = boxes[:, :k], classes[:, :k]  # a prefix, as top_nms passes it: strided rows
        for threshold in (0.5, 0.3, 0.45):
            got = kernels.suppressor_words(boxes, classes, iou_threshold=threshold)
            expected = packed_bits(suppressors(boxes, classes, iou_threshold=threshold))
            assert got.dtype == torch.int64 and torch.equal(got, expected), (batch, k, threshold)
    assert "suppressor_words" not in kernels._failed, "the Triton kernel fell back to torch (see the warning)"


@pytest.mark.cuda
def test_row_max_on_the_gpu_is_amax():
    check_row_max("cuda")


@pytest.mark.cuda
def test_suppressor_words_on_the_gpu_are_the_packed_torch_suppressors():
    check_suppressor_words("cuda")


@pytest.mark.skipif(kernels.triton is None, reason="Triton is not installed beside torch")
def test_the_kernels_in_tritons_interpreter_give_the_torch_answers():
    code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_kernels as t; " \
           "t.check_row_max('cpu'); t.check_suppressor_words('cpu')"
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]


def test_without_triton_the_torch_ops_answer(monkeypatch):
    monkeypatch.setattr(kernels, "triton", None)
    x = torch.randn(2, 5, 91).half()
    assert torch.equal(kernels.row_max(x), x.amax(dim=-1))
    boxes, classes = random_boxes(torch.Generator().manual_seed(2), 2, 70, False), torch.zeros(2, 70, dtype=torch.long)
    assert torch.equal(kernels.suppressor_words(boxes, classes, iou_threshold=0.5),
                       packed_bits(suppressors(boxes, classes, iou_threshold=0.5)))
