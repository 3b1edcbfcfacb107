"""--act slurm-drain on a real Slurm cluster: the bad node ends DRAIN with ddp-smoke's reason.

The sandbox cluster (tests/sandbox/slurm.py, two nodes) runs the real template with one rank
per node; rank 1, on the second node, is made a compute straggler (``--fault 1:slow@compute``).
Rank 0 drains the node its ranks recorded as SLURMD_NODENAME, and only that one; nothing at all
when a forger wrote into the run's store (issue 27). Run under
``flock /tmp/ddpsmoke-slurm.lock`` (one fixed cluster name on the machine).
"""
from __future__ import annotations

import os
import re
import subprocess
import threading
import time
import uuid

import pytest

from tests.forger import Forger, abort
from tests.sandbox.slurm import slurm_fixture
from tests.launchers.test_slurm import _submit
from tests.sandbox.faults import CpuQuota

cluster = slurm_fixture(nodes=2)


def _node(cluster, name: str) -> dict[str, str]:
    """``scontrol show node -o NAME`` as key=value pairs (Reason may hold spaces)."""
    out = subprocess.run(["scontrol", "show", "node", "-o", name], env=cluster.env(),
                         capture_output=True, text=True, timeout=10, check=True).stdout
    reason = re.search(r" Reason=(.*?)(?: \w+=|$)", out)
    fields = dict(kv.split("=", 1) for kv in out.split() if "=" in kv)
    return {**fields, "Reason": reason.group(1) if reason else ""}


@pytest.fixture
def slow_second_node(cluster):
    """The second node held to 15 % of a core (a cgroup CPU quota on its slurmd, which every
    process of a job step on that node inherits): a real slow node, not an injected fault,
    since --act slurm-drain never drains on an injected one. (A quarter of a core passed
    once, on a host loaded enough that the other node's rank got little more.)"""
    with CpuQuota(0.15, name=f"ddp-smoke-slurm-{os.getpid()}") as quota:
        quota.add(cluster.pids[f"slurmd.{cluster.node_names[1]}"])
        yield cluster.node_names[1]


@pytest.mark.timeout(240)
def test_act_slurm_drain_drains_exactly_the_bad_node_with_the_reason(cluster, slow_second_node,
                                                                      tmp_path):
    try:
        job = _submit(cluster, tmp_path, ["--checks", "environment,compute",
                                          "--act", "slurm-drain"])
        assert job.rc != 0 and job.report is not None, job.output[-4000:]
        ranks = job.report["ranks"]
        assert all(r["slurm_node"] == r["host"] for r in ranks)  # NodeName = hostname here
        bad = ranks[1]["slurm_node"]
        good = ranks[0]["slurm_node"]
        assert bad == slow_second_node
        assert [h["status"] for h in job.report["hosts"]] == ["good", "bad"]
        assert f"--act slurm-drain: {bad} drained" in job.output, job.output[-4000:]
        state = _node(cluster, bad)
        print(f"\n{bad}: State={state['State']} Reason={state['Reason']}")
        assert "DRAIN" in state["State"]
        assert state["Reason"].startswith(f"ddp-smoke {job.id}: compute: fp32 matmul ")
        assert "DRAIN" not in _node(cluster, good)["State"]
    finally:
        for name in cluster.node_names:  # give the nodes back to the next test
            subprocess.run(["scontrol", "update", f"NodeName={name}", "State=RESUME"],
                           env=cluster.env(), capture_output=True, timeout=10)


def _worker_store(tag: str, timeout_s: float) -> tuple[str, int] | None:
    """The store's address as anyone on a node finds it: in a worker's environment (here the
    worker whose environment carries ``FORGE_TAG=tag``). Never its secret: the forger has none."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                env = dict(kv.split("=", 1) for kv in open(f"/proc/{pid}/environ", "rb").read()
                           .decode(errors="replace").split("\0") if "=" in kv)
            except OSError:
                continue
            if env.get("FORGE_TAG") == tag and "RANK" in env and "MASTER_PORT" in env:
                if env.get("DDP_SMOKE_STORE"):  # the kit's store is the store host's
                    host, _, port = env["DDP_SMOKE_STORE"].rpartition(":")
                    return host, int(port)
                return env["MASTER_ADDR"], int(env["MASTER_PORT"])
        time.sleep(0.1)
    return None


@pytest.mark.timeout(240)
def test_act_slurm_drain_drains_nothing_in_a_run_whose_store_held_a_forged_record(
        cluster, slow_second_node, tmp_path):
    """The same job as above (rank 1 slow: its node is bad), with a forger on the network that
    posts rank 0 "terminated by SIGTERM" into the run's store. The forged abort names no one,
    the report carries the finding, and nothing is drained, not even the genuinely bad node."""
    tag = uuid.uuid4().hex
    found: dict = {}

    def forge():
        where = _worker_store(tag, 120)
        if where:
            found["forger"] = Forger(*where, abort(0, "compute"))
            found["forger"].run()
    thread = threading.Thread(target=forge, daemon=True)
    thread.start()
    try:
        job = _submit(cluster, tmp_path, ["--checks", "environment,compute",
                                          "--act", "slurm-drain"], FORGE_TAG=tag)
        forger = found.get("forger")
        if forger:
            forger.stop.set()
        assert forger is not None and forger.done, (forger and forger.error, job.output[-3000:])
        assert job.rc != 0 and job.report is not None, job.output[-4000:]
        culprits = {k["rank"] for c in job.report["checks"] for k in c["culprits"]}
        assert culprits == {1}, job.report["checks"]
        assert [h["status"] for h in job.report["hosts"]] == ["good", "bad"]
        findings = job.report["security"]["findings"]
        print(f"\nforged {forger.done}; findings {findings}")
        assert {(f["key"], f["rank"]) for f in findings} >= {("abort/listed", 0)}, findings
        assert "--act slurm-drain: nothing drained: the store held" in job.output
        assert " drained" not in job.output.replace("nothing drained", "")
        for name in cluster.node_names:
            assert "DRAIN" not in _node(cluster, name)["State"]
    finally:
        for name in cluster.node_names:
            subprocess.run(["scontrol", "update", f"NodeName={name}", "State=RESUME"],
                           env=cluster.env(), capture_output=True, timeout=10)
