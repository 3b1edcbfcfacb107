"""Preflight and the launcher's verdict on a real three-node Slurm cluster (issue 28).

Each test breaks one node in the way a site sees on day one and submits the real template:
the job must end in seconds (the preflight's own time limit, not the rendezvous timeout) with a
report that names exactly that node and the reason in one line, and a last log line that
names the verdict and the node. The faults are real: iptables rules inside the node's network
namespace, an interpreter wrapper that gives one node a missing interface or a broken kit.
Run under the heavy-test flock (the cluster's names are fixed).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sandbox.hosts import Host, host_command
from tests.sandbox.slurm import slurm_fixture
from tests.launchers.test_slurm import _submit

PREFLIGHT_S = 25  # the preflight time limit the tests give the template (3 nodes importing
                 # torch at once on 2 loaded cores took more than 10 s, then more than 15 s,
                 # in rehearsals)
SLACK_S = 25      # scheduling, srun launch and the verdict around it, on 2 busy cores
RDZV_PORT = "29611"  # fixed, so that a firewall rule can name it before the job exists

cluster = slurm_fixture(nodes=3)


@pytest.fixture(scope="module")
def iptables(cluster):
    """iptables, installed with apt when missing (a fresh CI machine has none)."""
    if shutil.which("iptables") is None:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "-o", "DPkg::Lock::Timeout=300", "install", "-y",
                   "--no-install-recommends", "iptables"]
        if subprocess.run(install, env=env, capture_output=True, timeout=900).returncode:
            subprocess.run(["apt-get", "-o", "DPkg::Lock::Timeout=300", "update"], env=env,
                           capture_output=True, timeout=900)
            subprocess.run(install, env=env, capture_output=True, timeout=900)
    assert shutil.which("iptables"), "iptables could not be installed with apt"
    return shutil.which("iptables")


def _in(host: Host, *argv: str) -> None:
    proc = subprocess.run(host_command(host, list(argv)), capture_output=True, text=True,
                          timeout=20)
    assert proc.returncode == 0, f"{argv}: {proc.stderr}"


@contextlib.contextmanager
def _dropped(host: Host, rules: list[list[str]]):
    """iptables DROP rules inside one node's namespace, removed afterwards."""
    for rule in rules:
        _in(host, "iptables", "-w", "5", "-I", *rule, "-j", "DROP")
    try:
        yield
    finally:
        for rule in rules:
            _in(host, "iptables", "-w", "5", "-D", *rule, "-j", "DROP")


WRAPPER = """#!/bin/sh
# One node only ({node}) gets the fault; every other node runs the venv's python as it is.
if [ "$SLURMD_NODENAME" = "{node}" ]; then {fault}; fi
exec {python} "$@"
"""


def _wrapper(tmp_path: Path, node: str, fault: str) -> str:
    path = tmp_path / "python-with-fault"
    path.write_text(WRAPPER.format(node=node, fault=fault, python=sys.executable))
    path.chmod(0o755)
    return str(path)


def _culprits(report: dict) -> dict[str, str]:
    return {k["host"]: k["reason"] for c in report["checks"] if c["status"] == "fail"
            for k in c["culprits"]}


def _run(cluster, tmp_path: Path, **env: str):
    env = {"PREFLIGHT_TIMEOUT": str(PREFLIGHT_S), "RDZV_PORT": RDZV_PORT,
           "GLOO_SOCKET_IFNAME": "eth0", **env}
    return _submit(cluster, tmp_path, ["--checks", "environment"], sbatch=("--nodes=3",),
                   timeout_s=120, **env)


def _named_exactly(job, node: str, check: str = "preflight") -> str:
    """The job failed with a report naming ``node`` only; returns its reason."""
    print(f"\n  last line: {job.last_line()}\n  time to verdict: {job.wall_s:.1f} s")
    assert job.report is not None, job.output[-4000:]
    print(f"  report: {_culprits(job.report)}")
    assert job.rc == 1 and job.report["verdict"] == "fail", job.output[-4000:]
    assert [c["name"] for c in job.report["checks"]] == [check]
    assert job.report["run_id"] == job.id
    culprits = _culprits(job.report)
    assert set(culprits) == {node}, culprits
    assert [h["host"] for h in job.report["hosts"] if h["status"] == "bad"] == [node]
    last = job.last_line()
    assert last.startswith("ddp-smoke: verdict fail · "), last
    assert f"{check}: {node}: " in last, last
    assert "\n" not in culprits[node] and "File \"" not in culprits[node]  # one line, no stack
    return culprits[node]


@pytest.mark.timeout(300)
def test_node_cut_from_the_batch_host_is_named(cluster, iptables, tmp_path):
    head, cut = cluster.hosts.hosts[0], cluster.hosts.hosts[2]
    with _dropped(cut, [["INPUT", "-s", head.addr], ["OUTPUT", "-d", head.addr]]):
        job = _run(cluster, tmp_path)
    reason = _named_exactly(job, cut.name)
    assert "task launch failed" in reason, reason
    assert job.wall_s < PREFLIGHT_S + SLACK_S + 20, job.wall_s  # srun's own launch timeout


@pytest.mark.timeout(300)
def test_node_cut_from_the_rendezvous_port_only_is_named(cluster, iptables, tmp_path):
    head, cut = cluster.hosts.hosts[0], cluster.hosts.hosts[2]
    rule = ["OUTPUT", "-p", "tcp", "-d", head.addr, "--dport", RDZV_PORT]
    with _dropped(cut, [rule]):
        job = _run(cluster, tmp_path)
    reason = _named_exactly(job, cut.name)
    assert f"cannot reach rendezvous {head.addr}:{RDZV_PORT}" in reason, reason
    assert "timed out" in reason, reason
    assert job.wall_s < PREFLIGHT_S + SLACK_S, job.wall_s


@pytest.mark.timeout(300)
def test_node_with_a_missing_gloo_interface_is_named(cluster, tmp_path):
    node = cluster.hosts.hosts[1].name
    python = _wrapper(tmp_path, node, "export GLOO_SOCKET_IFNAME=ib7")
    job = _run(cluster, tmp_path, WORKER_PYTHON=python)
    reason = _named_exactly(job, node)
    assert reason.startswith("interfaces: GLOO_SOCKET_IFNAME=ib7: no interface ib7"), reason
    assert job.wall_s < PREFLIGHT_S + SLACK_S, job.wall_s


@pytest.mark.timeout(300)
def test_node_whose_kit_does_not_import_is_named(cluster, tmp_path):
    node = cluster.hosts.hosts[2].name
    broken = tmp_path / "broken" / "ddp_smoke"  # an install missing one of its dependencies
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("import ddp_smoke_dependency_never_installed\n")
    python = _wrapper(tmp_path, node, f"export PYTHONPATH={broken.parent}")
    job = _run(cluster, tmp_path, WORKER_PYTHON=python)
    reason = _named_exactly(job, node)
    assert reason == ("ModuleNotFoundError: No module named "
                      "'ddp_smoke_dependency_never_installed'"), reason
    assert job.wall_s < PREFLIGHT_S + SLACK_S, job.wall_s


@pytest.mark.timeout(300)
def test_without_preflight_the_launcher_still_names_a_node_that_never_started(
        cluster, iptables, tmp_path):
    """PREFLIGHT=0, the issue's first case as it was: srun cannot launch on one node. The
    report now comes from the launcher, naming that node with srun's error."""
    head, cut = cluster.hosts.hosts[0], cluster.hosts.hosts[2]
    with _dropped(cut, [["INPUT", "-s", head.addr], ["OUTPUT", "-d", head.addr]]):
        job = _run(cluster, tmp_path, PREFLIGHT="0", RDZV_TIMEOUT="20")
    reason = _named_exactly(job, cut.name, check="launch")
    assert reason.startswith("no worker started: task launch failed"), reason


@pytest.mark.timeout(300)
def test_healthy_three_nodes_pass_and_preflight_costs_seconds(cluster, tmp_path):
    """The healthy run, with and without preflight: the difference is reported, not asserted
    beyond the preflight's own bound."""
    walls = {}
    for flag in ("1", "0"):
        submit_dir = tmp_path / f"preflight-{flag}"
        submit_dir.mkdir()
        job = _run(cluster, submit_dir, PREFLIGHT=flag)
        assert job.rc == 0, job.output[-4000:]
        assert job.report["verdict"] == "pass" and job.report["nodes"] == 3
        assert job.last_line().startswith("ddp-smoke: verdict pass · srun exit 0"), \
            job.last_line()
        paths = sorted(job.report_path.parent.glob("preflight/*.json"))
        assert [p.stem for p in paths] == (sorted(cluster.node_names) if flag == "1" else [])
        # each node's preflight within its own bound (the job's wall time around it is
        # printed, not asserted: on 2 loaded cores it moves by more than the preflight)
        took = [json.loads(p.read_text())["duration_s"] for p in paths]
        assert all(0 < s < PREFLIGHT_S for s in took), took
        walls[flag] = job.wall_s
    print(f"\nhealthy 3-node job: {walls['1']:.1f} s with preflight, {walls['0']:.1f} s "
          f"without: preflight costs {walls['1'] - walls['0']:+.1f} s")
