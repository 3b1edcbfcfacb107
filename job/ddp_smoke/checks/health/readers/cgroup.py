"""The CPU quota this process runs under, and how often it held the process back; the boot id.

A CFS bandwidth limit (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us``)
on the process's cgroup or any cgroup above it lets the processes in it run for ``quota``
microseconds per ``period``; ``cpu.stat`` counts the enforcement periods in which they were
runnable (``nr_periods``) and those in which they hit the limit and were stopped until the next
period (``nr_throttled``, with ``throttled_usec``/``throttled_time``): Linux
Documentation/scheduler/sched-bwc.rst. A node whose daemons (slurmd, a pod's limits) sit under
a quota holds back every process they start: the kit's ranks run, just slowly. Read from the
live system whatever the node being read (the quota is this process's, not the hardware's).

``/proc/sys/kernel/random/boot_id`` is new at every boot: two runs of one host with different
boot ids had a reboot between them (the fleet memory's lemon rule, outputs/fleet.py).
"""
from __future__ import annotations

import os
import time

BOOT_ID = "proc/sys/kernel/random/boot_id"


def boot_id(root: str = "/") -> str | None:
    try:
        with open(os.path.join(root, BOOT_ID)) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _stat(path: str) -> dict[str, int]:
    out = {}
    for line in (_text(os.path.join(path, "cpu.stat")) or "").splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


def _mounts() -> tuple[str | None, str | None]:
    """(cgroup v1 cpu controller's mount, cgroup v2 mount) from this process's mountinfo."""
    v1 = v2 = None
    for line in (_text("/proc/self/mountinfo") or "").splitlines():
        left, _, right = line.partition(" - ")
        fields, kind = left.split(), right.split()
        if len(fields) < 5 or len(kind) < 3:
            continue
        if kind[0] == "cgroup" and "cpu" in kind[2].split(","):
            v1 = v1 or fields[4]
        elif kind[0] == "cgroup2":
            v2 = v2 or fields[4]
    return v1, v2


def levels() -> tuple[str, list[str]] | None:
    """(version, the cgroup folders from this process's own up to the hierarchy's root), or
    None when no CPU controller is visible here."""
    v1, v2 = _mounts()
    for line in (_text("/proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        mount, version = (v1, "v1") if "cpu" in parts[1].split(",") else \
            (v2, "v2") if parts[0] == "0" and not parts[1] else (None, None)
        if mount is None or (version == "v2" and v1):
            continue  # hybrid: the v1 cpu controller is the one that limits
        path, out = parts[2].strip("/"), []
        while True:
            out.append(os.path.join(mount, path) if path else mount)
            if not path:
                return version, out
            path = os.path.dirname(path)
    return None


def _quota(folder: str, version: str) -> float | None:
    """CPUs the folder's quota allows (0.25: a quarter of one), None without a quota."""
    if version == "v2":
        words = (_text(os.path.join(folder, "cpu.max")) or "max").split()
        quota, period = words[0], words[1] if len(words) > 1 else "100000"
    else:
        quota = _text(os.path.join(folder, "cpu.cfs_quota_us")) or "-1"
        period = _text(os.path.join(folder, "cpu.cfs_period_us")) or "100000"
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None  # "max": no quota
    return q / p if q > 0 and p > 0 else None


def read() -> dict | None:
    """Each level's quota and counters now; None when no CPU controller is visible."""
    found = levels()
    if found is None:
        return None
    version, folders = found
    out = []
    for folder in folders:
        s = _stat(folder)
        throttled_s = (s.get("throttled_usec", 0) / 1e6 if version == "v2"
                       else s.get("throttled_time", 0) / 1e9)
        out.append({"path": folder, "quota_cpus": _quota(folder, version),
                    "periods": s.get("nr_periods", 0), "throttled": s.get("nr_throttled", 0),
                    "throttled_s": round(throttled_s, 6)})
    return {"version": version, "levels": out}


def held_s() -> float | None:
    """Seconds a CPU quota has held this process back so far: the largest throttled time of
    its cgroup and those above it (a quota is enforced on the cgroup that sets it); None when
    no CPU controller is visible here."""
    now = read()
    return None if now is None else max(level["throttled_s"] for level in now["levels"])


class CpuQuotaReader:
    """The quota at start and end of the window (counters judged as increases), and the boot
    id of the node read."""

    name = "cpu"

    def __init__(self, root: str = "/"):
        self.root, self.first, self.t0 = root, None, time.monotonic()

    def start(self) -> None:
        self.first, self.t0 = read(), time.monotonic()

    def sample(self) -> None:
        pass  # counters: the window's increase is what counts

    def finish(self) -> dict:
        end = read()
        reading = {"boot_id": boot_id(self.root), "start": self.first, "end": end,
                   "window_s": round(time.monotonic() - self.t0, 3)}
        self.first, self.t0 = end, time.monotonic()
        return reading
