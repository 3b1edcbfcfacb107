"""The readers of one node, behind one small interface, and the thread that samples them.

A reader has a ``name`` (its key in the node's reading) and three methods:

``start()``   take the start readings (counters are judged as increases across the run);
``sample()``  one cheap sample while the other checks run (GPU clocks under load, a port's
              state: a link that flaps between two snapshots is seen here);
``finish()``  the JSON reading of the window since ``start`` (or the last ``finish``: repeat
              mode judges each iteration), never raising: what cannot be read says why.

:class:`Node` holds the readers of this node — NVML (:mod:`.nvml`), sysfs/procfs
(:mod:`.sysfs`), the kernel log (:mod:`.kmsg`) — and one daemon thread that samples them every
``sample_period_s``, waiting on NVML's XID events in between. With ``DDP_SMOKE_HEALTH_REPLAY``
set to a recorded node (:mod:`.replay`), every reader reads the recording instead: a pynvml-
shaped NVML and a made file tree. The reading then says so, and so does the report.
"""
from __future__ import annotations

import os
import threading
import time

from . import kmsg, nvml, replay, sysfs

REPLAY_ENV = "DDP_SMOKE_HEALTH_REPLAY"


class Node:
    """This node's readers and their sampler thread."""

    def __init__(self, period_s: float, environ=os.environ):
        self.period_s, self.replay = period_s, environ.get(REPLAY_ENV) or None
        root, binding = "/", None
        self.gpu, self.unavailable = None, None
        try:  # never fatal: a node that cannot be read is judged as such, with why
            if self.replay:
                recorded = replay.load(self.replay)
                root, binding = replay.materialise(recorded), replay.binding(recorded)
            self.gpu = nvml.GpuReader(nvml.open_binding(binding))
        except nvml.Unavailable as e:
            self.unavailable = {"code": e.code, "cause": e.cause, "fix": e.fix}
        except Exception as e:  # noqa: BLE001 — a binding or a recording this code has not met
            self.unavailable = {"code": type(e).__name__, "cause": str(e)[:300],
                                "fix": "report this reading failure"}
        self.root = root  # where sysfs, procfs and /dev/kmsg are read (a replay's own tree)
        self.others = [sysfs.HcaReader(root, environ.get("NCCL_IB_HCA")),
                       sysfs.PciReader(root), kmsg.KmsgReader(root)]
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.t0 = time.monotonic()

    @property
    def readers(self) -> list:
        return ([self.gpu] if self.gpu else []) + self.others

    def start(self) -> None:
        """Start readings, then the sampler. A reader that fails here is reported by its
        finish(): a driver or binding this code has not met must not stop the run."""
        self.t0 = time.monotonic()
        for r in self.readers:
            _guarded(r.start)
        self.thread = threading.Thread(target=self._run, name="ddp-smoke-health-sampler",
                                       daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            t = time.monotonic()
            for r in self.readers:
                _guarded(r.sample)
            if self.gpu and _guarded(lambda: self.gpu.wait(self.period_s, self.stop)):
                continue  # an XID event arrived: the next one may be queued already
            # never faster than the period, whatever a reader did (no busy loop on errors)
            self.stop.wait(max(0.0, self.period_s - (time.monotonic() - t)))

    def finish(self) -> dict:
        """Every reader's reading of the window; the sampler keeps running (repeat mode)."""
        out: dict = {"replay": self.replay}
        if self.gpu is None:
            out["gpu"] = {"unavailable": self.unavailable}
        for r in self.readers:
            try:
                out[r.name] = r.finish()
            except Exception as e:  # noqa: BLE001 — listed as not read, with why
                out[r.name] = {"unavailable": {"code": type(e).__name__, "cause": str(e)[:300],
                                               "fix": "report this reading failure"}}
        return out


    def close(self) -> None:
        """Stop the sampler (the check leaves it to the process's end: repeat mode)."""
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=2 * self.period_s + 1)


def _guarded(step):
    try:
        return step()
    except Exception:  # noqa: BLE001 — the finish() of the same reader says what failed
        return None
