"""CPU quota: the node's processes held back by a cgroup's CFS bandwidth limit during the run.

Rule: a cgroup on the path of the reading rank's own (its cgroup or one above it) that has a
quota and stopped its processes in at least ``cpu_throttled_fraction`` (50 %) of the
enforcement periods in which they were runnable, over at least ``_MIN_PERIODS`` of them, fails
the node: a quota on slurmd, a pod's CPU limit, a systemd slice's ``CPUQuota=`` holds back
every process started under it (Linux Documentation/scheduler/sched-bwc.rst; the counters are
``nr_throttled`` / ``nr_periods`` of ``cpu.stat``). A reading without a visible CPU controller
is not measured. Reads :mod:`.readers.cgroup`.
"""
from __future__ import annotations

from .finding import Finding, Limits, checked, fail, unmeasured

SOURCE = "Linux CFS bandwidth control (sched-bwc.rst): cpu.stat nr_throttled / nr_periods"
_MIN_PERIODS = 10  # one second of runnable time at the default 100 ms period


def judge(node: dict, lim: Limits) -> list[Finding]:
    reading = node.get("cpu") or {}
    start, end = reading.get("start"), reading.get("end")
    if not end:
        return [] if "cpu" not in node else [
            unmeasured("CPU quota", "no cgroup CPU controller visible to this process")]
    before = {lv["path"]: lv for lv in (start or {}).get("levels", [])}
    share = lim.thresholds["cpu_throttled_fraction"]
    out, quotas = [], []
    for lv in end.get("levels", []):
        if lv.get("quota_cpus") is None:
            continue
        quotas.append(f"{lv['path']} {lv['quota_cpus']:g} CPU")
        was = before.get(lv["path"], {})
        periods = lv["periods"] - was.get("periods", 0)
        throttled = lv["throttled"] - was.get("throttled", 0)
        held_s = lv["throttled_s"] - was.get("throttled_s", 0.0)
        if periods >= _MIN_PERIODS and throttled >= share * periods:
            out.append(fail(f"CPU quota: this node's processes were held back in "
                            f"{throttled / periods:.0%} of the periods they could run",
                            f"cgroup {lv['path']} allows {lv['quota_cpus']:g} CPU; "
                            f"{throttled} of {periods} periods throttled, {held_s:.1f} s held "
                            "back during the run", "lift the quota (the cgroup of the node's "
                            "daemon, the pod's CPU limit) or find who set it", SOURCE))
    what = (f"CPU quota ({end.get('version')}): " +
            ("; ".join(quotas) if quotas else "none on this process's cgroups"))
    return out + [checked(what)]
