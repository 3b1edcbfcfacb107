"""--act slurm-drain on a real Slurm cluster: the bad node ends DRAIN with ddp-smoke's reason.

The sandbox cluster (tests/sandbox/slurm.py, two nodes) runs the real template with one rank
per node; rank 1, on the second node, is made a compute straggler (``--fault 1:slow@compute``).
Rank 0 drains the node its ranks recorded as SLURMD_NODENAME, and only that one. Run under
``flock /tmp/ddpsmoke-slurm.lock`` (one fixed cluster name on the machine).
"""
from __future__ import annotations

import re
import subprocess

import pytest

from tests.sandbox.slurm import slurm_fixture
from tests.launchers.test_slurm import _submit

cluster = slurm_fixture(nodes=2)


def _node(cluster, name: str) -> dict[str, str]:
    """``scontrol show node -o NAME`` as key=value pairs (Reason may hold spaces)."""
    out = subprocess.run(["scontrol", "show", "node", "-o", name], env=cluster.env(),
                         capture_output=True, text=True, timeout=10, check=True).stdout
    reason = re.search(r" Reason=(.*?)(?: \w+=|$)", out)
    fields = dict(kv.split("=", 1) for kv in out.split() if "=" in kv)
    return {**fields, "Reason": reason.group(1) if reason else ""}


@pytest.mark.timeout(240)
def test_act_slurm_drain_drains_exactly_the_bad_node_with_the_reason(cluster, tmp_path):
    try:
        job = _submit(cluster, tmp_path, ["--checks", "environment,compute",
                                          "--fault", "1:slow@compute", "--act", "slurm-drain"])
        assert job.rc != 0 and job.report is not None, job.output[-4000:]
        ranks = job.report["ranks"]
        assert all(r["slurm_node"] == r["host"] for r in ranks)  # NodeName = hostname here
        bad = ranks[1]["slurm_node"]
        good = ranks[0]["slurm_node"]
        assert [h["verdict"] for h in job.report["hosts"]] == ["good", "bad"]
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
