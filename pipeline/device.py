"""Which device the whole path runs on: one CUDA GPU, or the CPU. Never a silent fallback."""

from __future__ import annotations

import os
import re
from pathlib import Path
from dataclasses import dataclass

import torch

from .errors import DeviceError


@dataclass(frozen=True)
class Device:
    kind: str  # "cuda" or "cpu"
    index: int = 0

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def torch(self) -> torch.device:
        return torch.device(self.kind, self.index) if self.is_cuda else torch.device("cpu")

    def __str__(self) -> str:
        return f"cuda:{self.index}" if self.is_cuda else "cpu"

    def describe(self) -> str:
        if self.is_cuda:
            return f"cuda:{self.index} ({torch.cuda.get_device_name(self.index)})"
        return "cpu"


def cuda_problem(index: int) -> str | None:
    """None if cuda:index can run the path (torch sees it, ORT has its CUDA EP), else the reason."""
    if not torch.cuda.is_available():
        return "torch sees no CUDA GPU (no driver, no device, or a CPU build of torch)"
    if index >= torch.cuda.device_count():
        return f"cuda:{index} does not exist; this machine has {torch.cuda.device_count()} GPU(s)"
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return "onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu, not onnxruntime)"
    return None


def resolve_device(spec: str) -> Device:
    """auto -> the first GPU when one is usable, else the CPU; cuda / cuda:N -> that GPU or an error."""
    if spec == "cpu":
        return Device("cpu")
    if spec == "auto":
        return Device("cpu") if cuda_problem(0) else Device("cuda", 0)
    match = re.fullmatch(r"cuda(?::(\d+))?", spec)
    if not match:
        raise DeviceError(f"device {spec!r} is not one of auto, cpu, cuda, cuda:N (--device, run.device, "
                          "Detector.from_config(device=...))")
    index = int(match.group(1) or 0)
    problem = cuda_problem(index)
    if problem:
        raise DeviceError(f"device {spec}: {problem}; to run on the CPU: --device cpu (Python: "
                          "Detector.from_config(device='cpu'))")
    return Device("cuda", index)


def free_bytes(device: Device) -> int:
    """Memory free for a run: the GPU's free memory, or the host's available memory."""
    if device.is_cuda:
        return torch.cuda.mem_get_info(device.index)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) << 10
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
