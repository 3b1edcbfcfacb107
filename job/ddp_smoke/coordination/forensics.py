"""Hang forensics: what a live rank leaves behind when a run is aborted.

Called from the watchdog thread, because the main thread may sit inside a C++ collective
where no Python runs:

* ``REPORT_DIR/stacks/rank<R>.txt`` — the Python stacks of all this rank's threads
  (``faulthandler``, which reads them without the main thread's help);
* ``REPORT_DIR/flight/rank<R>.json`` — PyTorch's Flight Recorder of this rank's process group:
  the last collectives issued, their sequence ids and state. torch 2.13 records them for
  gloo as for NCCL when ``TORCH_FR_BUFFER_SIZE`` is set before the group is created (its
  older name ``TORCH_NCCL_TRACE_BUFFER_SIZE`` is deprecated); :func:`flight_recorder_env`
  sets it. With NCCL the
  library also dumps on its own watchdog timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT``) to
  ``REPORT_DIR/flight/nccl-rank<R>``; read dumps with PyTorch's ``torchfrtrace``;
* the innermost frame of the kit's code on the main thread ("in _measure, bandwidth.py:123"),
  which rank 0 prints beside a culprit.
"""
from __future__ import annotations

import faulthandler
import os
import sys
import threading
from typing import Callable

from .records import Forensics

TRACE_ENTRIES = "2000"  # collectives kept per rank: the whole default suite fits
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The kit's own plumbing, relative to the package: never the frame a culprit is "in".
_PLUMBING = ("coordination/", "harness.py", "config/faults.py", "checks/_timing.py",
             "__main__.py", "cli.py")


_ALSO: list[Callable[[], dict]] = []


def also(read: Callable[[], dict]) -> None:
    """Add a reading to this rank's forensics, from a layer above this one (the health
    check's CPU quota on its node); a reading that raises is left out."""
    if read not in _ALSO:
        _ALSO.append(read)


def flight_recorder_env(report_dir: str, environ=os.environ) -> None:
    """Turn on PyTorch's Flight Recorder for this process, unless the user chose otherwise."""
    environ.setdefault("TORCH_FR_BUFFER_SIZE", TRACE_ENTRIES)
    environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    environ.setdefault("TORCH_FR_DUMP_TEMP_FILE",
                       os.path.join(os.path.abspath(report_dir), "flight", "nccl-rank"))


def innermost_kit_frame(thread_id: int | None = None) -> str | None:
    """``"in FUNC, FILE:LINE"`` for the innermost frame of ddp_smoke's own code on a thread
    (the main thread by default), plumbing (the collective wrapper, the clock) skipped but
    named: ``"in all_reduce (comm) <- _measure, bandwidth.py:123"``."""
    frame = sys._current_frames().get(thread_id or threading.main_thread().ident)
    via = None
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path.startswith(_PACKAGE + os.sep):
            rel, name = os.path.relpath(path, _PACKAGE), os.path.basename(path)
            if not rel.startswith(_PLUMBING):
                here = f"{frame.f_code.co_name}, {name}:{frame.f_lineno}"
                return f"in {via} <- {here}" if via else f"in {here}"
            if rel == "coordination/progress.py" and via is None:
                via = f"{frame.f_code.co_name} (comm)"
        frame = frame.f_back
    return f"in {via}" if via else None


def issued(trace: bytes) -> dict:
    """``{"issued": N}``: the last world collective this rank handed to its backend (the
    Flight Recorder's ``collective_seq_id`` on the default group; every rank issues the same
    ones in the same order), ``{}`` when the trace says nothing."""
    import json
    try:
        seqs = [e["collective_seq_id"] for e in json.loads(trace).get("entries", [])
                if not e.get("is_p2p") and str(e.get("pg_id", 0)) == "0"]
    except (ValueError, KeyError, TypeError, AttributeError):
        return {}
    return {"issued": max(seqs, default=0)}  # 0: it never handed one over


def dump(report_dir: str, rank: int) -> Forensics:
    """Write this rank's stacks and Flight Recorder trace; return what was written (paths,
    and errors as text: forensics never raise)."""
    out: dict = {"where": innermost_kit_frame()}
    stacks = os.path.join(report_dir, "stacks", f"rank{rank}.txt")
    try:
        os.makedirs(os.path.dirname(stacks), exist_ok=True)
        with open(stacks, "w") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
        out["stacks"] = stacks
    except OSError as e:
        out["stacks_error"] = f"{stacks}: {e.strerror}"
    flight = os.path.join(report_dir, "flight", f"rank{rank}.json")
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json
        trace = _dump_fr_trace_json()
        os.makedirs(os.path.dirname(flight), exist_ok=True)
        with open(flight, "wb") as f:
            f.write(trace)
        out["flight_recorder"] = flight
        out.update(issued(trace))
    except Exception as e:  # noqa: BLE001 — no recorder in this build, or no process group
        out["flight_recorder_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    for read in _ALSO:
        try:
            out.update(read())
        except Exception:  # noqa: BLE001 — forensics never raise
            pass
    prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE")
    nccl_dump = f"{prefix}{rank}"
    if prefix and os.path.exists(nccl_dump):  # NCCL's own watchdog dumped on its timeout
        out["nccl_flight_recorder"] = nccl_dump
    return Forensics(**out)
