"""Multi-host: real torchrun c10d rendezvous across network namespaces, one per "node".

Each node is a network namespace with its own address on a private bridge and its own hostname
(tests/sandbox/hosts.py). torchrun runs inside each with `--local-addr` and
`GLOO_SOCKET_IFNAME=eth0`, exactly as on a cluster. The happy paths assert on rank 0's
report.json; the failure paths assert that each ends within its bound, with a message that
names the cause. A node whose torchrun fails makes the harness stop the others, as
`srun --kill-on-bad-exit=1` does in the Slurm template.
"""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests import report_schema
from tests.multinode import Nodes as _Nodes, torchrun_argv as _torchrun
from tests.sandbox.hosts import Host, HostSandbox, sandbox_fixture

PREFIX, SUBNET = "dsh", "10.231.1.0/24"
NOBODY = "10.231.1.99"      # inside our subnet, held by no one: nothing answers there
UNHELD = "10.231.1.10"      # likewise; sorts before .11, so its node becomes group rank 0
STARTUP_S = 40              # torchrun + torch import on a loaded 2-core machine, generously

box = sandbox_fixture(PREFIX, SUBNET, 3)


def _run_job(box: HostSandbox, tmp_path: Path, nnodes: int, nproc: int, port: int,
             *options: str) -> dict:
    """Runs the worker on nnodes×nproc ranks; returns report.json plus the job's wall time."""
    hosts, report_dir = box.hosts[:nnodes], tmp_path / "report"
    worker = ["--backend", "gloo", "--checks", "environment,ddp_step,training", "--timeout", "60",
              "--expect-nodes", str(nnodes), "--expect-world-size", str(nnodes * nproc),
              "--report-dir", str(report_dir), *options]
    nodes = _Nodes(box, tmp_path)
    for host in hosts:
        nodes.start(host, _torchrun(host, nnodes, nproc, f"{hosts[0].name}:{port}",
                                    f"dsh-{nnodes}x{nproc}-{os.getpid()}",
                                    "join_timeout=60,read_timeout=30", worker))
    codes = nodes.wait(timeout_s=150)
    assert set(codes.values()) == {0}, f"exit codes {codes}\n{nodes.tails()}"
    report = report_schema.read(report_dir / "report.json")
    print(f"\n{nnodes}x{nproc}: wall {nodes.elapsed():.1f} s, timings {report['timings']}")
    return report


def _assert_spans(report: dict, hosts: list[Host], nproc: int) -> None:
    """The report shows the promised world, one record per (host, local_rank), right addresses."""
    assert report["verdict"] == "pass", json.dumps(report["checks"], indent=1)
    assert report["world_size"] == len(hosts) * nproc
    assert report["nodes"] == len(hosts)
    addr = {h.name: h.addr for h in hosts}
    slots = sorted((r["host"], r["local_rank"]) for r in report["ranks"])
    assert slots == sorted((h.name, i) for h in hosts for i in range(nproc))
    for r in report["ranks"]:
        assert r["addresses"]["eth0"] == addr[r["host"]], r
        assert r["route_address"] == addr[r["host"]], r  # gloo's path leaves by eth0, not lo
    assert [r["rank"] for r in report["ranks"]] == list(range(report["world_size"]))
    # HSDP as large jobs lay it out: shard within a node, replicate across the nodes
    training = next(c for c in report["checks"] if c["name"] == "training")["figures"]
    assert (training["layout"], training["mesh"]) == ("hsdp", [len(hosts), nproc]), training
    assert {k["host"] for k in training["ranks"]} == {h.name for h in hosts}


@pytest.mark.timeout(180)
def test_two_nodes_two_procs(box, tmp_path):
    # through node speakers (coordination/node.py): node 2's ranks beat, arrive and post
    # through rank 2, node 1's rank 1 through itself, across real hosts
    report = _run_job(box, tmp_path, 2, 2, 29410, "--node-speaker", "on")
    assert report["config"]["node_speaker"] == "on"
    _assert_spans(report, box.hosts[:2], nproc=2)
    # torchrun gives the first node (the lowest address) the low ranks.
    assert [r["host"] for r in report["ranks"]] == ["dsh-node1"] * 2 + ["dsh-node2"] * 2


@pytest.mark.timeout(180)
def test_three_nodes_one_proc(box, tmp_path):
    report = _run_job(box, tmp_path, nnodes=3, nproc=1, port=29411)
    _assert_spans(report, box.hosts, nproc=1)


def _fast_fail(box, logs: Path, port, local_addrs, endpoint=None, nnodes=2) -> _Nodes:
    """Starts a 1-proc-per-node job with 5 s rendezvous bounds on the hosts in local_addrs."""
    logs.mkdir()
    nodes = _Nodes(box, logs)
    worker = ["--backend", "gloo", "--checks", "environment", "--timeout", "10",
              "--report-dir", str(logs / "report")]
    for host, local_addr in local_addrs.items():
        nodes.start(host, _torchrun(host, nnodes, 1, endpoint or f"{box.hosts[0].name}:{port}",
                                    f"dsh-fail-{port}-{os.getpid()}",
                                    "join_timeout=5,read_timeout=5", worker, local_addr))
    return nodes


@pytest.fixture(scope="module")
def failures(box, tmp_path_factory):
    """The three misconfigurations, started together: each mostly waits out a 5 s bound.

    Each test below waits for and judges its own; the sandbox's teardown stops leftovers.
    """
    logs = tmp_path_factory.mktemp("failures")
    node1, node2 = box.hosts[:2]
    return {
        # Two nodes promised, one comes.
        "never_joins": _fast_fail(box, logs / "never_joins", 29420, {node1: None}),
        # The endpoint is an address nobody holds.
        "no_one": _fast_fail(box, logs / "no_one", 29421, {node1: None},
                             endpoint=f"{NOBODY}:29421"),
        # Node 1 advertises an address it does not hold; sorting first, it is group rank 0.
        "unreachable": _fast_fail(box, logs / "unreachable", 29422,
                                  {node1: UNHELD, node2: None}),
    }


FAIL_BOUND_S = STARTUP_S + 5 + 15  # start-up, the 5 s rendezvous bound, exit


@pytest.mark.timeout(120)
def test_node_never_joins(box, failures):
    """The rendezvous gives up after join_timeout; no worker ever starts."""
    nodes, node1 = failures["never_joins"], box.hosts[0]
    codes = nodes.wait(timeout_s=FAIL_BOUND_S)
    assert codes[node1.name] != 0
    assert "RendezvousTimeoutError" in nodes.log(node1.name), nodes.tails()
    assert not (nodes.logs / "report" / "report.json").exists()


@pytest.mark.timeout(120)
def test_endpoint_points_to_no_one(box, failures):
    """Nothing answers at the endpoint: the store connection fails after read_timeout."""
    nodes, node1 = failures["no_one"], box.hosts[0]
    codes = nodes.wait(timeout_s=FAIL_BOUND_S)
    log = nodes.log(node1.name)
    assert codes[node1.name] != 0
    assert "RendezvousConnectionError" in log, nodes.tails()
    assert f"({NOBODY}, 29421)" in log  # torch names the address it could not reach


@pytest.mark.timeout(120)
def test_node_advertises_unreachable_address(box, failures):
    """Node 1, group rank 0, advertises an address it does not hold.

    Its agent then blocks in torch's own TCPStore (300 s, not configurable) trying to reach
    itself at that address; node 2 waits read_timeout for the MASTER_ADDR that node 1 never
    publishes, fails, and the launcher (srun --kill-on-bad-exit in the template) stops node 1.
    """
    nodes, (node1, node2) = failures["unreachable"], box.hosts[:2]
    codes = nodes.wait(timeout_s=FAIL_BOUND_S)
    log2 = nodes.log(node2.name)
    assert codes[node2.name] not in (0, -signal.SIGTERM, -signal.SIGKILL), nodes.tails()
    assert "MASTER_ADDR" in log2 and "wait timeout" in log2, nodes.tails()
    assert codes[node1.name] != 0  # stopped by the launcher, or failed on its own
