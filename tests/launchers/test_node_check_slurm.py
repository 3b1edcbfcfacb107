"""node-check as Slurm's HealthCheckProgram on a real cluster, and the circuit breaker of a run.

One sandbox cluster of four nodes (tests/sandbox/slurm.py) for the module:

* a full report filesystem: a real 3-node sbatch whose storage folder is a full tmpfs: the
  storage check names the folder, no rank and no host, so ``--act slurm-drain`` drains none
  (the circuit breaker of outputs/fleet.py is tested on recorded reasons, tests/outputs/);
* ``slurm/node-check.sh`` as HealthCheckProgram (slurm.conf lines as docs/continuous.md gives
  them, applied with ``scontrol reconfigure``): a node whose slurmd sits under a cgroup CPU
  quota and a node whose ``eth0`` (GLOO_SOCKET_IFNAME) is gone are drained by Slurm through
  the kit within one health-check interval of the fault, each with the kit's reason and its
  finding; a healthy node stays idle; a node drained by hand stays drained with its own reason
  through passing checks; once the faults are gone the kit resumes exactly its own drains.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddp_smoke.outputs import act
from tests.launchers.test_slurm import _submit
from tests.sandbox.slurm import slurm_fixture
from tests.sandbox.faults import CpuQuota

REPO = Path(__file__).resolve().parents[2]
cluster = slurm_fixture(nodes=4)
INTERVAL_S = 30   # HealthCheckInterval here; a node-check of 4 loaded nodes takes ~5-20 s
TIMEOUT_S = 25    # node-check's own bound (< the interval: one check at a time per node)
HAND = "maintenance by hand"


def _ctl(cluster, *args: str) -> str:
    return subprocess.run(["scontrol", *args], env=cluster.env(), capture_output=True,
                          text=True, timeout=10, check=True).stdout


def _states(cluster) -> dict[str, dict]:
    return act.parse_nodes(_ctl(cluster, "show", "node"))


def _health_check(cluster, folder: Path, root: Path, on: bool) -> None:
    """The wrapper copied beside its node-check.conf; slurm.conf's health lines set (or taken
    out) and the cluster reconfigured."""
    folder.mkdir(exist_ok=True)
    script = folder / "node-check.sh"
    shutil.copy(REPO / "slurm" / "node-check.sh", script)
    (folder / "node-check.conf").write_text(
        f"PYTHON={sys.executable}\nREPORT_ROOT={root}\nTIMEOUT={TIMEOUT_S}\n"
        f"export SLURM_CONF={cluster.conf} GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1\n")
    lines = [ln for ln in cluster.conf.read_text().splitlines()
             if not ln.startswith("HealthCheck")]
    if on:
        lines += [f"HealthCheckProgram={script}", f"HealthCheckInterval={INTERVAL_S}",
                  "HealthCheckNodeState=ANY"]
    cluster.conf.write_text("\n".join(lines) + "\n")
    _ctl(cluster, "reconfigure")


def _wait(what: str, done, timeout_s: float, every_s: float = 1.0):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = done()
        if got:
            return got
        time.sleep(every_s)
    pytest.fail(f"{what}: not within {timeout_s:.0f} s")


def _runs(root: Path, node: str, since: float) -> list[dict]:
    """This node's node-check reports that started after ``since`` (their folders' mtime)."""
    out = []
    for folder in sorted(root.glob(f"node-check-{node}-*")):
        report = folder / "report.json"
        if folder.stat().st_mtime >= since and report.exists():
            out.append(json.loads(report.read_text()))
    return out


@pytest.mark.timeout(240)
def test_a_full_report_filesystem_drains_no_node(cluster, tmp_path):
    """The storage check names the full folder, not the ranks that wrote to it (a full,
    read-only or over-quota filesystem fails whichever rank writes first): no host is bad, so
    ``--act slurm-drain`` has nothing to drain (nor a breaker to trip)."""
    full = tmp_path / "full"
    full.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(full)], check=True)
    try:
        (full / "filler").write_bytes(b"\0" * (60 << 10))
        job = _submit(cluster, tmp_path, ["--checks", "environment,storage", "--act",
                                          "slurm-drain", "--storage-dir", str(full)],
                      sbatch=("-N", "3"))
    finally:
        subprocess.run(["umount", str(full)], check=True)
    report = job.report
    assert report is not None and report["verdict"] == "fail", job.output[-4000:]
    storage = next(c for c in report["checks"] if c["name"] == "storage")
    print(f"\nstorage culprits: {[(k['rank'], k['host']) for k in storage['culprits']]}")
    assert storage["culprits"] and {(k["rank"], k["host"]) for k in storage["culprits"]} == \
        {(None, None)}, storage["culprits"]
    assert all(k["reason"].startswith(f"unwritable folder {full}/") and
               "No space left on device" in k["reason"] for k in storage["culprits"]), storage
    assert [h["status"] for h in report["hosts"]] == ["good"] * 3
    assert "--act slurm-drain" not in job.output, job.output[-4000:]
    assert not any("DRAIN" in s["state"] for s in _states(cluster).values())
    assert not (job.report_path.parent / "actions.json").exists()


@pytest.mark.timeout(420)
def test_health_check_drains_faulty_nodes_leaves_the_others_and_resumes_its_own(cluster,
                                                                               tmp_path):
    healthy, slow, unplugged, by_hand = cluster.node_names
    root = tmp_path / "node-checks"
    host = cluster.hosts.hosts[2]
    _ctl(cluster, "update", f"NodeName={by_hand}", "State=DRAIN", f"Reason={HAND}")
    try:
        with CpuQuota(0.25, name=f"ddp-smoke-nc-{os.getpid()}") as quota:
            quota.add(cluster.pids[f"slurmd.{slow}"])
            _rename(host.netns, "eth0", "eth0-gone")
            t0 = time.time()
            _health_check(cluster, tmp_path / "hc", root, on=True)
            drained = _wait("both faulty nodes drained", lambda: _drained(cluster, slow, unplugged),
                            2 * INTERVAL_S + TIMEOUT_S + 20)
            took = time.time() - t0
            print(f"\nfaults -> both drained in {took:.0f} s (interval {INTERVAL_S} s, "
                  f"node-check bound {TIMEOUT_S} s): {drained}")
            assert drained[slow].startswith("ddp-smoke node-check: ") and \
                "CPU quota" in drained[slow], drained
            assert drained[unplugged].startswith(
                "ddp-smoke node-check: preflight: interfaces: GLOO_SOCKET_IFNAME=eth0: no "
                "interface eth0 on this node"), drained
            _wait("a passing check on the healthy and the hand-drained node after the faults",
                  lambda: all(any(r["verdict"] == "pass" for r in _runs(root, n, t0))
                              for n in (healthy, by_hand)), INTERVAL_S + TIMEOUT_S + 20)
            states = _states(cluster)
            assert "DRAIN" not in states[healthy]["state"], states
            assert "DRAIN" in states[by_hand]["state"] and \
                states[by_hand]["reason"].startswith(HAND), states
        _rename(host.netns, "eth0-gone", "eth0")
        _wait("the kit's own drains resumed", lambda: not any(
            "DRAIN" in s["state"] for n, s in _states(cluster).items() if n != by_hand),
            2 * INTERVAL_S + TIMEOUT_S + 20)
        states = _states(cluster)
        assert states[by_hand]["reason"].startswith(HAND), states  # never resumed by the kit
        history = subprocess.run([sys.executable, "-m", "ddp_smoke", "history", str(root)],
                                 capture_output=True, text=True, timeout=60)
        said = history.stdout.split("# fleet:")[-1]
        print(said)
        for node in (slow, unplugged):
            assert f" drain  {node}" in said and f" resume {node}" in said, said
        assert by_hand not in said.split("# lemons")[0].split("\n", 1)[1], said
    finally:
        _health_check(cluster, tmp_path / "hc", root, on=False)
        if not _has(host.netns, "eth0"):
            _rename(host.netns, "eth0-gone", "eth0")
        for name in cluster.node_names:
            subprocess.run(["scontrol", "update", f"NodeName={name}", "State=RESUME"],
                           env=cluster.env(), capture_output=True, timeout=10)


def _drained(cluster, *nodes: str) -> dict[str, str] | None:
    states = _states(cluster)
    if all("DRAIN" in states[n]["state"] for n in nodes):
        return {n: states[n]["reason"] for n in nodes}
    return None


def _has(netns: str, ifname: str) -> bool:
    return subprocess.run(["ip", "-n", netns, "link", "show", ifname],
                          capture_output=True).returncode == 0


def _rename(netns: str, old: str, new: str) -> None:
    """An interface renamed in the node's namespace (its address and link stay, so slurmd
    still talks to slurmctld): for the kit, the interface it was told to use is gone."""
    for args in (("set", old, "down"), ("set", old, "name", new), ("set", new, "up")):
        subprocess.run(["ip", "-n", netns, "link", *args], check=True, timeout=10)
