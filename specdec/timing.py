"""Seconds per phase of a decoding step, synchronized with the device only when profiling.

``PhaseTimer`` is the one phase timer of the engine and the drafters. Blocks are timed either as
``with timer("verify"): ...`` (phases may nest; a name used twice adds up) or by ``mark(phase)``,
which adds the time since the previous mark (or the start) to ``phase``.

``sync``: a callable run at the end of every phase before the clock is read (e.g.
``torch.cuda.synchronize``), so that the device work queued in a phase is counted in it; None (what
the engine and the drafters pass unless asked to profile): no synchronize, the seconds are host wall
time (device work still running when a phase ends is counted where the host next waits for it).
Under an active ``torch.profiler`` each ``with`` phase is also a ``record_function`` range
``specdec.<phase>``.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Callable

import torch

__all__ = ["PhaseTimer", "device_sync", "since_process_start"]

_IMPORTED = time.time()  # the fallback process start where /proc is not there


def since_process_start() -> float:
    """Seconds since this process started (Linux: from ``/proc/self/stat``; elsewhere since this
    module's import, which misses the interpreter's start and the imports before it)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time() - _IMPORTED


def device_sync(device: torch.device) -> Callable[[], None] | None:
    """A callable that waits for ``device``'s queued work (``torch.cuda.synchronize``), or None for a
    device with nothing to wait for (the CPU)."""
    if device.type != "cuda":
        return None
    return lambda: torch.cuda.synchronize(device)


class PhaseTimer:
    """Seconds per phase (``seconds[phase]``); see the module doc.

    Args:
        sync: run at every phase end before the clock is read; None: host wall time, no synchronize.
        start: the ``time.perf_counter()`` the first ``mark`` counts from (default: now).
    """

    def __init__(self, sync: Callable[[], None] | None = None, start: float | None = None) -> None:
        self._sync = sync
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self._last = time.perf_counter() if start is None else start

    def __call__(self, phase: str) -> "_Phase":
        return _Phase(self, phase)

    def mark(self, phase: str) -> None:
        """Add the time since the previous mark (or the start) to ``phase``."""
        if self._sync is not None:
            self._sync()
        now = time.perf_counter()
        self.seconds[phase] += now - self._last
        self._last = now


class _Phase:
    """One ``with timer(phase)`` block (a plain context manager: cheaper than a generator's)."""

    __slots__ = ("timer", "phase", "start", "range")

    def __init__(self, timer: PhaseTimer, phase: str) -> None:
        self.timer, self.phase, self.range = timer, phase, None

    def __enter__(self) -> None:
        if torch.autograd.profiler._is_profiler_enabled:
            self.range = torch.profiler.record_function(f"specdec.{self.phase}")
            self.range.__enter__()
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            if self.timer._sync is not None:
                self.timer._sync()
            self.timer.seconds[self.phase] += time.perf_counter() - self.start
        if self.range is not None:
            self.range.__exit__(*exc)
