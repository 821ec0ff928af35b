"""Where the loop's time goes: seconds per stage, for summary.json and `gpudet bench`."""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

_END = object()


class StageClock:
    """Main-thread wall time per stage, exclusive: time inside a nested stage (the source read
    while preprocessing asks for the next batch) counts only for the inner one. Stages overlap on
    the device (DALI decodes ahead on its own threads), so these are the times the loop waited
    on each stage; they add up to the loop's time. `add` counts time spent on another thread
    (the engine's): it overlaps the loop's stages."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self._stack: list[str] = []
        self._since = 0.0
        self._lock = threading.Lock()

    def add(self, stage: str, seconds: float) -> None:
        with self._lock:
            self.seconds[stage] += seconds

    def _charge(self) -> None:
        now = time.perf_counter()
        if self._stack:
            self.add(self._stack[-1], now - self._since)
        self._since = now

    @contextmanager
    def __call__(self, stage: str):
        self._charge()
        self._stack.append(stage)
        try:
            yield
        finally:
            self._charge()
            self._stack.pop()

    def timed(self, iterable: Iterable, stage: str) -> Iterator:
        """Iterate `iterable`, counting the time spent producing each item under `stage`."""
        iterator = iter(iterable)
        while True:
            with self(stage):
                item = next(iterator, _END)
            if item is _END:
                return
            yield item


def process_seconds() -> float:
    """Seconds since this process started (the command), imports included: what a user waits
    from pressing enter. Linux: from /proc; elsewhere, since this module was imported."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED


_IMPORTED = time.perf_counter()
