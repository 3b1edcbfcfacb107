"""Slurm: `sbatch --wait slurm/ddp_smoke.sbatch` on a real slurmctld + slurmd cluster.

The cluster (tests/sandbox/slurm.py) has two nodes, each a network namespace with its own
hostname, and no GPUs. The tests submit the real template as a user would, from a submit
directory, overriding only what this machine needs: no GPUs (``--gpus-per-node=0``), 2 CPUs per
node, the venv's python, and the workers per node. Reports land where the template puts them by
default: ``<submit dir>/reports/<job id>/``.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.sandbox.slurm import slurm_fixture

TEMPLATE = Path(__file__).resolve().parents[1] / "slurm" / "ddp_smoke.sbatch"
JOB_TIMEOUT_S = 150  # a 2-node job takes ~15-45 s here; beyond this it hangs: cancel it
MACHINE = ["--gpus-per-node=0", "--cpus-per-task=2"]  # this machine has no GPUs, 2 cores

cluster = slurm_fixture(nodes=2)


class Job:
    """One finished sbatch --wait: its exit status, output file, report and wall time."""

    def __init__(self, rc: int, stdout: str, submit_dir: Path, wall_s: float):
        self.rc, self.wall_s = rc, wall_s
        match = re.search(r"Submitted batch job (\d+)", stdout)
        assert match, f"sbatch printed no job id: {stdout!r}"
        self.id = match.group(1)
        out = submit_dir / f"ddp-smoke-{self.id}.out"
        self.output = out.read_text(errors="replace") if out.exists() else ""
        report = submit_dir / "reports" / self.id / "report.json"
        self.report = json.loads(report.read_text()) if report.exists() else None

    def last_line(self) -> str:
        """The template's one-line summary."""
        return self.output.strip().splitlines()[-1] if self.output.strip() else ""


def _submit(cluster, submit_dir: Path, worker: list[str], nproc: int = 1, **env: str) -> Job:
    """Runs `sbatch --wait` on the template from submit_dir, cancelling the job if it hangs."""
    env = cluster.env(WORKER_PYTHON=sys.executable, NPROC_PER_NODE=str(nproc),
                      OMP_NUM_THREADS="1", **env)  # one thread per rank on 2 cores
    argv = ["sbatch", "--wait", *MACHINE, str(TEMPLATE), *worker]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(argv, cwd=submit_dir, env=env, capture_output=True, text=True,
                              timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # Our private cluster: every job on it is ours.
        subprocess.run(["scancel", "--user", "root"], env=env, timeout=10)
        pytest.fail(f"job did not finish in {JOB_TIMEOUT_S} s; see {submit_dir}/ddp-smoke-*.out")
    return Job(proc.returncode, proc.stdout + proc.stderr, submit_dir, time.monotonic() - t0)


@pytest.mark.timeout(240)
def test_two_nodes_pass(cluster, tmp_path):
    submit_dir = tmp_path / "submit dir with 'quote' & space"  # the template must quote
    submit_dir.mkdir()
    job = _submit(cluster, submit_dir, ["--checks", "environment,ddp_step"], nproc=2)
    print(f"\nsbatch -> report, 2 nodes x 2: {job.wall_s:.1f} s; timings "
          f"{job.report and job.report['timings']}")
    assert job.rc == 0, job.output[-4000:]
    report = job.report
    assert report["verdict"] == "pass"
    assert (report["world_size"], report["nodes"]) == (4, 2)
    slots = sorted((r["host"], r["local_rank"]) for r in report["ranks"])
    assert slots == [(n, i) for n in cluster.node_names for i in range(2)]
    addr = {h.name: h.addr for h in cluster.hosts.hosts}
    assert all(r["addresses"]["eth0"] == addr[r["host"]] for r in report["ranks"])
    assert job.last_line().startswith("ddp-smoke: verdict pass"), job.last_line()
    for node in cluster.node_names:  # per-node log prefixes, from torchrun --role
        assert f"[{node}:0]:" in job.output
    assert "srun exit 0" in job.last_line(), job.output[-4000:]  # no rank died on the way out


@pytest.mark.timeout(240)
def test_failing_node_fails_the_job_and_is_named(cluster, tmp_path):
    """Rank 1, alone on the second node, dies mid-check (as after an OOM kill or segfault)."""
    job = _submit(cluster, tmp_path, ["--checks", "environment,ddp_step",
                                      "--fault", "1:crash@ddp_step"])
    assert job.rc != 0, job.output[-4000:]
    assert job.report is not None, f"no report; output:\n{job.output[-4000:]}"
    assert job.report["verdict"] == "fail"
    named = {(c["rank"], c["host"]) for check in job.report["checks"]
             for c in check["culprits"]}
    if job.report.get("error"):
        named.add((job.report["error"].get("rank"), job.report["error"].get("host")))
    assert (1, cluster.node_names[1]) in named, json.dumps(job.report, indent=1)[-3000:]
    assert job.last_line().startswith("ddp-smoke: verdict fail"), job.last_line()


@pytest.mark.timeout(120)
def test_bad_worker_option_is_one_clear_line(cluster, tmp_path):
    job = _submit(cluster, tmp_path, ["--checks", "environment,no_such_check"])
    assert job.rc != 0
    assert re.search(r"ddp-smoke: error: .*no_such_check", job.output), job.output[-3000:]
    assert job.report is None
    assert "verdict none (no report)" in job.last_line(), job.last_line()


@pytest.mark.timeout(60)
def test_bad_container_mode_fails_before_launch(cluster, tmp_path):
    job = _submit(cluster, tmp_path, [], CONTAINER="docker")
    assert job.rc == 2
    assert "CONTAINER=docker; expected none, pyxis or apptainer" in job.output
    assert "srun" not in job.output
