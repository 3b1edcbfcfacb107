"""Four real faults that were named wrong, each named right now, repeated to catch races.

1. A rank killed mid-run by a signal it cannot catch (SIGKILL) or by a crash (SIGSEGV), while
   the launcher then SIGTERMs the others within a fraction of a second: the dead rank alone,
   said dead (it was "alive, did not finish" once, with its victims named).
2. A rank the kernel's OOM killer kills (a memory cgroup's limit): said as such, from the
   kernel log on its node.
3. Two hosts set to jumbo frames behind ports that are not (the bridge side of their veths
   stays at 1500): TCP connects, the store works, the first large collective never
   completes. The link is named, both ends, with the MTU hint; and the preflight, comparing
   every node's interface MTU, names a jumbo host among standard ones before any rank starts
   (the MTU most nodes share is the fabric's: with two of three hosts jumbo it would name the
   third).
4. Two machines with one hostname: named as such, with each one's address and Slurm node.

1, 2 and 4 are campaign cells (tests/campaign/matrix.py gives their exact expected outcome);
3 is built here, as the MTU mismatch it is.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.campaign import matrix, runner
from tests.launch import HELD_REPEAT, REPEAT, REPO
from tests.multinode import Nodes, torchrun_argv
from tests.sandbox import faults
from tests.sandbox.hosts import sandbox_fixture

CELLS = ([f"{k}.middle.collectives.{launcher}.1x3" for k in ("sigkill", "sigsegv")
          for launcher in ("torchrun", "smoke_local")] * REPEAT
         + ["oom.middle.bandwidth.torchrun.1x3", "oom.middle.collectives.smoke_local.1x3",
            "dup_hostname.middle.join.torchrun.3x1", "dup_hostname.last.join.slurm.3x1"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cell_id", CELLS)
def test_the_fault_is_named_right(cell_id, parts, tmp_path):
    cell = matrix.Cell.parse(cell_id)
    row = runner.run(cell, parts, tmp_path / "cell")
    print(f"\n{cell_id}: {row.wall_s:.1f} s, fault to report {row.got.report_s} s; "
          f"{row.got.text[:300]}")
    assert row.ok, f"{cell_id}: {'; '.join(row.problems)}; reasons: {row.got.text[:1500]}"
    if cell.kind in ("sigkill", "sigsegv", "oom"):  # the launcher's SIGTERM made no culprit
        assert "died" in row.got.text or "killed" in row.got.text


# -- 3. jumbo frames behind ports without them ------------------------------------------------

JUMBO = 9000
box = sandbox_fixture("dsj", "10.231.13.0/24", 3, needs=("ip", "iptables"))


def _jumbo(host) -> None:
    subprocess.run(["nsenter", f"--net=/run/netns/{host.netns}", "ip", "link", "set",
                    host.ifname, "mtu", str(JUMBO)], check=True, timeout=10)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("attempt", range(HELD_REPEAT))
def test_jumbo_frames_behind_a_port_without_them_name_the_link(box, tmp_path, attempt):
    a, b = box.hosts[1], box.hosts[2]  # node 1 holds the store: its links stay clean
    for h in (a, b):
        _jumbo(h)
    try:
        report = _run_three_nodes(box, tmp_path)
    finally:
        for h in (a, b):
            subprocess.run(["nsenter", f"--net=/run/netns/{h.netns}", "ip", "link", "set",
                            h.ifname, "mtu", "1500"], timeout=10)
    named = [(c["rank"], c.get("ranks")) for ch in report["checks"] for c in ch["culprits"]]
    reasons = " ".join(c["reason"] for ch in report["checks"] for c in ch["culprits"])
    assert named == [(None, [1, 2])], reasons
    assert "drops large ones" in reasons and "MTU" in reasons


def _run_three_nodes(box, tmp_path: Path) -> dict:
    rd = tmp_path / "report"
    nodes = Nodes(box, tmp_path)
    port = 29800 + os.getpid() % 100
    for h in box.hosts:
        nodes.start(h, torchrun_argv(h, 3, 1, f"{box.hosts[0].addr}:{port}", f"jumbo{port}",
                                     "join_timeout=60,read_timeout=30",
                                     ["--report-dir", str(rd), "--backend", "gloo",
                                      "--level", "quick", "--timeout", "15"]))
    nodes.wait(timeout_s=150)
    assert (rd / "report.json").exists(), nodes.tails()
    return json.loads((rd / "report.json").read_text())


def _preflight_three(box, tmp_path: Path) -> tuple[dict, list[str], str]:
    """Preflight on the three nodes (node 0 serves the rendezvous port), then the Slurm
    template's launch report of it: the host's record, the hosts the report names, and its
    output."""
    t0, procs = time.monotonic(), []
    rdzv = f"{box.hosts[0].addr}:{29900 + os.getpid() % 90}"
    for i, h in enumerate(box.hosts):
        extra = ["--serve", "--nodes", "3"] if i == 0 else []
        procs.append(box.popen(h, [sys.executable, "-m", "ddp_smoke", "preflight",
                                   "--report-dir", str(tmp_path), "--rdzv", rdzv,
                                   "--node", h.name, "--skip-torch", "--timeout", "20",
                                   *extra], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, env={**os.environ,
                                                              "SLURM_NODEID": str(i)}))
    for p in procs:
        p.wait(timeout=60)
    print(f"\npreflight of 3 nodes: {time.monotonic() - t0:.1f} s")
    host = json.loads((tmp_path / "preflight" / f"{box.hosts[0].name}.json").read_text())
    verdict = subprocess.run([sys.executable, "-m", "ddp_smoke", "launch-report", "--stage",
                              "preflight", "--report-dir", str(tmp_path), "--nodes",
                              " ".join(h.name for h in box.hosts)], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
    report = json.loads((tmp_path / "report.json").read_text())
    named = sorted(c["host"] for ch in report["checks"] for c in ch["culprits"])
    return host, named, verdict.stdout + verdict.stderr


@pytest.mark.timeout(120)
def test_preflight_names_the_jumbo_host_before_any_rank_starts(box, tmp_path):
    jumbo = box.hosts[2]
    _jumbo(jumbo)
    try:
        host, named, said = _preflight_three(box, tmp_path)
    finally:
        subprocess.run(["nsenter", f"--net=/run/netns/{jumbo.netns}", "ip", "link", "set",
                        jumbo.ifname, "mtu", "1500"], timeout=10)
    mtu = next(c for c in host["checks"] if c["name"] == "mtu")
    assert not mtu["ok"] and mtu["nodes"] == [jumbo.name], mtu
    assert named == [jumbo.name], said


@pytest.mark.timeout(120)
def test_preflight_names_a_node_behind_a_black_hole_to_the_rendezvous_host(box, tmp_path):
    """Large packets dropped between node 1 and the rendezvous host, every MTU equal (the
    campaign's blackhole.store_node.join.trainjob.3x1: the hellos passed, then torchrun's
    rendezvous waited out its 600 s join timeout, its state too large for the path once two
    nodes had joined, and nothing was said). The 64 KiB after each hello name node 1 within
    the probe's 5 s, on its own record and on the host's."""
    cut = box.hosts[1]
    t0 = time.monotonic()
    with faults.blackhole(box.hosts[0], cut):
        host, named, said = _preflight_three(box, tmp_path)
    assert time.monotonic() - t0 < 20
    own = json.loads((tmp_path / "preflight" / f"{cut.name}.json").read_text())
    assert not own["ok"] and "64 KiB message to it did not arrive" in own["reason"], own
    joined = next(c for c in host["checks"] if c["name"] == "joined")
    assert not joined["ok"] and joined["detail"].startswith(
        f"node rank 1 {cut.name}: path: its hello arrived"), joined
    assert named == [cut.name], said
