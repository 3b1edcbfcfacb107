"""Timing of a section of work on this rank's device, with the ``slow`` fault applied."""
from __future__ import annotations

import time

import torch


class Clock:
    """Times one call: CUDA events on a GPU, ``perf_counter`` on CPU.

    On a GPU the work is asynchronous: a wall clock would time the launch, not the kernel.
    Events are recorded on the current stream, which waits for the collectives of
    ``torch.distributed`` (their ``wait()``), so the end event marks when the work finished.
    With ``cpu_time`` a CPU section is timed in this process's CPU seconds
    (``time.process_time``): what the cores delivered while they ran it, so other processes
    on a shared host do not make a rank look slow.
    """

    def __init__(self, device: torch.device, faults, cpu_time: bool = False):
        self.cuda = device.type == "cuda"
        self.faults = faults
        self._now = time.process_time if cpu_time else time.perf_counter

    def measure(self, fn) -> float:
        """Seconds ``fn()`` took on the device; never throttled (for calibration)."""
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3  # elapsed_time is in milliseconds
        t = self._now()
        fn()
        return self._now() - t

    def __call__(self, fn) -> float:
        """Seconds of a timed section; a rank with a ``slow`` fault takes SLOWDOWN× as long."""
        elapsed = self.measure(fn)
        t = time.perf_counter()
        self.faults.throttle(elapsed)
        return elapsed + (time.perf_counter() - t)
