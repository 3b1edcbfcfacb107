"""Rails, for real: a slow or dead rail of one node is named as that node's rail, a rail slow
everywhere as the rail.

Three network-namespace nodes, each with two interfaces on two bridges (two rails, two leaf
switches) joined by a spine namespace (tests/sandbox/hosts.py, ``rail_subnets``); torchrun
with c10d rendezvous on every node, two gloo ranks per node, local rank i on rail i (the site
setting ``rails: [eth0, eth1]``). The faults are the kernel's own
(../shared/reference/fault-recipes.md): one node's rail 1 throttled with tbf at both ends of
its veth; one node's rail 1 dropped with iptables inside it (a dead NIC or cable); rail 1
throttled on every node (its leaf switch); 3 % of the packets lost between two nodes on
rail 1 alone (a bad cable on one rail). Each fault case runs more than once where a race
could show as a wrong culprit set. One two-rail sandbox serves the whole module, and a run
without the ``rails`` setting on it stays what a one-network run always was.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from tests import report_schema
from tests.launch import HELD_REPEAT
from tests.multinode import Nodes, torchrun_argv
from tests.sandbox import faults
from tests.sandbox.hosts import Host, HostSandbox, sandbox_fixture

PREFIX, SUBNET, RAIL1 = "dsl", "10.231.37.0/24", "10.231.38.0/24"
NODES, PER_NODE = 3, 2
# Small transfers: at 200 mbit a large buffer takes seconds per exchange.
CONFIG = """rails: [eth0, eth1]
bandwidth:
  max_bytes_cpu: 262144
  pair_bytes_cpu: 2097152
  pair_rounds: 3
"""

box = sandbox_fixture(PREFIX, SUBNET, NODES, needs=("tc", "iptables"), rail_subnets=(RAIL1,))
_port = iter(range(29700, 29790))


@contextlib.contextmanager
def _slow_rail(hosts: list[Host], rail: int = 1):
    """That rail of those nodes slow, both directions (tbf on both ends of each rail veth)."""
    with contextlib.ExitStack() as stack:
        for h in hosts:
            stack.enter_context(faults.slow_node(h, rail))
        yield


def run(sandbox: HostSandbox, tmp_path: Path, config: str = CONFIG,
        checks: str = "environment,bandwidth,rails", timeout_s: float = 240) -> tuple[dict, Nodes]:
    """One run on every node; returns rank 0's report (schema-checked) and the nodes."""
    (tmp_path / "cfg.yaml").write_text(config)
    worker = ["--backend", "gloo", "--checks", checks, "--timeout", "60", "--config",
              str(tmp_path / "cfg.yaml"), "--report-dir", str(tmp_path / "report")]
    nodes, port, first = Nodes(sandbox, tmp_path), next(_port), sandbox.hosts[0]
    for host in sandbox.hosts:
        nodes.start(host, torchrun_argv(host, NODES, PER_NODE, f"{first.name}:{port}",
                                        f"dsl-{port}-{os.getpid()}",
                                        "join_timeout=60,read_timeout=60", worker))
    codes = nodes.wait(timeout_s)
    path = tmp_path / "report" / "report.json"
    assert path.exists(), f"no report; exit codes {codes}\n{nodes.tails()}"
    return report_schema.read(path), nodes


def _check(report: dict, name: str) -> dict:
    return next(c for c in report["checks"] if c["name"] == name)


def _rank(report: dict, host: Host, local: int) -> int:
    return next(r["rank"] for r in report["ranks"]
                if r["host"] == host.name and r["local_rank"] == local)


def _named(report: dict) -> list[tuple]:
    """Every culprit of every check as (check, rank, host, rail index, rail device)."""
    return [(c["name"], k["rank"], k["host"], (k.get("rail") or {}).get("index"),
             (k.get("rail") or {}).get("device"))
            for c in report["checks"] for k in c["culprits"]]


def _show(report: dict, nodes: Nodes) -> None:
    bw = _check(report, "bandwidth")
    pairs = bw["figures"]["pairs"]
    print(f"wall {nodes.elapsed():.1f} s; bandwidth {bw['duration_s']:.2f} s (pairs "
          f"{bw['figures']['pairs_s']:.2f} s); reference {pairs.get('reference_busbw_gbps')}")
    for p in pairs.get("results", []):
        print(f"  rail {p.get('rail')} {p['host_a']} <-> {p['host_b']} pass {p['pass']}: "
              f"{p['busbw_gbps']:.3f} GB/s{' slow' if p['slow'] else ''}")
    for c in report["checks"]:
        for k in c["culprits"]:
            print("  culprit", c["name"], k["rank"], k.get("ranks"), k.get("rail"), k["reason"])
    print("  rails check:", _check(report, "rails")["summary"])


@pytest.mark.timeout(300)
def test_healthy_rails_are_measured_each_on_its_own(box, tmp_path):
    report, nodes = run(box, tmp_path)
    _show(report, nodes)
    assert report["verdict"] == "pass", _named(report)
    pairs = _check(report, "bandwidth")["figures"]["pairs"]
    assert [r["index"] for r in pairs["rails"]] == [0, 1]
    assert {p["rail"] for p in pairs["results"]} == {0, 1}
    for rail in pairs["rails"]:
        assert rail["devices"] == [f"eth{rail['index']}"] * NODES


@pytest.mark.timeout(300)
def test_one_network_is_node_pairs_as_before(box, tmp_path):
    """No rails setting: every rank on eth0 (the launcher's GLOO_SOCKET_IFNAME), node pairs."""
    report, nodes = run(box, tmp_path, config=CONFIG.replace("rails: [eth0, eth1]\n", ""))
    _show(report, nodes)
    assert report["verdict"] == "pass", _named(report)
    pairs = _check(report, "bandwidth")["figures"]["pairs"]
    assert "rails" not in pairs and all("rail" not in p for p in pairs["results"])
    assert pairs["leaders"] == [_rank(report, h, 0) for h in box.hosts]
    assert {r["device"] for r in _check(report, "rails")["figures"]["ranks"]} == {"eth0"}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("attempt", range(HELD_REPEAT))
def test_one_nodes_slow_rail_is_named_as_that_rail(box, tmp_path, attempt):
    slow = box.hosts[2]
    with _slow_rail([slow]):
        report, nodes = run(box, tmp_path)
    _show(report, nodes)
    assert _named(report) == [("bandwidth", _rank(report, slow, 1), slow.name, 1, "eth1")]
    culprit = _check(report, "bandwidth")["culprits"][0]
    assert culprit["reason"].startswith(f"node {slow.name} rail 1 (eth1) is slow with every "
                                        "partner on it")
    hosts = {h["host"]: h for h in report["hosts"]}
    assert hosts[slow.name]["status"] == "bad"
    assert hosts[slow.name]["rails"] == [{"index": 1, "device": "eth1", "port": None,
                                          "status": "bad"}]
    assert all(h["status"] == "good" for n, h in hosts.items() if n != slow.name)
    assert (tmp_path / "report" / "bad_rails.txt").read_text() == f"{slow.name} rail 1 eth1\n"
    assert (tmp_path / "report" / "bad_hosts.txt").read_text() == f"{slow.name}\n"
    html = (tmp_path / "report" / "report.html").read_text()
    assert f"rank {_rank(report, slow, 1)} ({slow.name}) · rail 1 (eth1)" in html
    printed = [line for line in nodes.log(box.hosts[0].name).splitlines()  # rank 0's lines
               if line.startswith(f"#   bad     {slow.name} ")]
    assert len(printed) == 1 and "· rail 1 (eth1) bad bandwidth: " in printed[0], printed


@pytest.mark.timeout(300)
@pytest.mark.parametrize("attempt", range(HELD_REPEAT))
def test_one_nodes_dead_rail_is_named_and_the_run_goes_on(box, tmp_path, attempt):
    dead = box.hosts[1]
    with faults.dead_interface(dead, rail=1):
        report, nodes = run(box, tmp_path)
    _show(report, nodes)
    assert _named(report) == [("bandwidth", _rank(report, dead, 1), dead.name, 1, "eth1")]
    culprit = _check(report, "bandwidth")["culprits"][0]
    assert culprit["reason"].startswith(f"node {dead.name} rail 1 (eth1) carries no connection")
    assert _check(report, "environment")["status"] == "pass"  # the run went on without it


@pytest.mark.timeout(300)
def test_a_rail_slow_on_every_node_is_named_as_the_rail(box, tmp_path):
    with _slow_rail(box.hosts):
        report, nodes = run(box, tmp_path)
    _show(report, nodes)
    assert _named(report) == [("bandwidth", None, None, 1, "eth1")]
    assert _check(report, "bandwidth")["culprits"][0]["reason"].startswith(
        "rail 1 (eth1) slow on all nodes: its leaf switch or the NCCL setting")
    assert all(h["status"] == "good" for h in report["hosts"])


@pytest.mark.timeout(300)
def test_a_lossy_link_on_one_rail_is_named_on_that_rail_with_both_ends(box, tmp_path):
    a, b = box.hosts[1], box.hosts[2]
    with faults.lossy_link(a, b, 0.03, rail=1):
        report, nodes = run(box, tmp_path)
    _show(report, nodes)
    named = {(k["rank"], frozenset(zip(k.get("ranks") or [], k.get("hosts") or [])),
              (k.get("rail") or {}).get("index"))
             for c in report["checks"] for k in c["culprits"]}
    ends = frozenset({(_rank(report, a, 1), a.name), (_rank(report, b, 1), b.name)})
    assert named == {(None, ends, 1)}, [k for c in report["checks"] for k in c["culprits"]]
