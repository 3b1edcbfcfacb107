"""Kill workers the way a node does (SIGKILL, no goodbye) once every other rank waits for them.

Shared by the launcher tests of issue 24 (Slurm, Docker, pods, submit): the workers are found
by their environment (``RANK`` and ``DDP_SMOKE_RUN_ID``) in /proc, as root sees every process
of the sandboxes (they have their own network and UTS namespaces, not their own PIDs); when to
kill is read from the store host the launcher started (``DDP_SMOKE_STORE``), whose address
the store host prints.
"""
from __future__ import annotations

import datetime
import os
import re
import signal
import time
from pathlib import Path

STORE_LINE = re.compile(r"serving the coordination store at (\S+):(\d+)")


def _processes():
    """(pid, argv, environment) of every process root can read."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            env = dict(kv.split(b"=", 1) for kv in (entry / "environ").read_bytes().split(b"\0")
                       if b"=" in kv)
        except OSError:
            continue
        yield int(entry.name), cmd, env


def workers(run_id: str | None = None, marker: str | None = None) -> dict[int, int]:
    """rank -> pid of the ddp_smoke workers of run ``run_id`` (or whose environment holds
    ``marker``, e.g. ``KEY=value``)."""
    found = {}
    for pid, cmd, env in _processes():
        if b"ddp_smoke" not in cmd or b"torch.distributed.run" in cmd or b"RANK" not in env:
            continue
        if b"ddp_smoke.store_host" in cmd:
            continue
        if run_id is not None and env.get(b"DDP_SMOKE_RUN_ID") != run_id.encode():
            continue
        if marker is not None and marker.encode() not in b"\0".join(
                k + b"=" + v for k, v in env.items()):
            continue
        found[int(env[b"RANK"])] = pid
    return found


def store_hosts(run_id: str) -> list[int]:
    """The pids of run ``run_id``'s store host (``python -m ddp_smoke.store_host``)."""
    return [pid for pid, cmd, env in _processes() if b"ddp_smoke.store_host" in cmd
            and env.get(b"DDP_SMOKE_RUN_ID") == run_id.encode()]


def store_of(text: str):
    """A client of the store host whose line is in ``text``, on the harness's prefix."""
    m = STORE_LINE.search(text)
    return store_at(m.group(1), int(m.group(2))) if m else None


def store_at(host: str, port: int, timeout_s: float = 10):
    """A client of the store host at ``host:port``, on the harness's prefix."""
    import torch.distributed as dist
    raw = dist.TCPStore(host, port, 1, False, datetime.timedelta(seconds=timeout_s),
                        wait_for_workers=False)
    return dist.PrefixStore("ddp_smoke/0", raw)


def wait_arrived(store, check: str, ranks, timeout_s: float) -> None:
    """Until each rank in ``ranks`` arrived at ``check`` (its first iteration)."""
    end = time.monotonic() + timeout_s
    keys = [f"arrive/{check}/0/{r}" for r in ranks]
    while not store.check(keys):
        assert time.monotonic() < end, f"ranks {list(ranks)} not at {check} in {timeout_s} s"
        time.sleep(0.1)


def kill(pids) -> float:
    """SIGKILL each pid; returns when (monotonic)."""
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return time.monotonic()


def wait_file(path: Path, timeout_s: float) -> float | None:
    """Monotonic time ``path`` appeared (non-empty), None if not within ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if path.exists() and path.stat().st_size:
            return time.monotonic()
        time.sleep(0.1)
    return None
