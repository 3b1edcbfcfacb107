"""Python submission path on the real Slurm test cluster: submitit's sbatch, squeue and scancel
against the sandbox's two nodes (local tasks: tests/launchers/test_submit.py). A module of its
own: the Slurm sandbox's modules run one after another in one worker (tests/conftest.py), and
the local tasks need no place in that queue."""
import subprocess
import sys
import time

import pytest

from ddp_smoke.submit import SmokeFailed, SmokeTimeout, submit
from tests.launchers.test_submit import QUICK
from tests.sandbox.slurm import slurm_fixture

cluster = slurm_fixture(nodes=2)


@pytest.fixture
def on_cluster(cluster, monkeypatch):
    """Clients (sbatch, squeue, scancel) find the sandbox's slurm.conf, as on a login node."""
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return cluster


def _slurm(tmp_path, worker_args, **kwargs):
    # The sandbox's nodes share this machine's /tmp, so a node-local folder is shared here.
    return submit("slurm", nodes=2, procs_per_node=1, folder=tmp_path, allow_local_folder=True,
                  worker_args=QUICK + worker_args, **kwargs)


@pytest.mark.timeout(240)
def test_slurm_two_nodes_return_the_report(on_cluster, tmp_path):
    report = _slurm(tmp_path, [], wait_timeout_s=180)
    assert (report["verdict"], report["world_size"], report["nodes"]) == ("pass", 2, 2)
    assert sorted(r["host"] for r in report["ranks"]) == sorted(on_cluster.node_names)


@pytest.mark.timeout(240)
def test_slurm_fault_raises_with_the_culprit(on_cluster, tmp_path):
    with pytest.raises(SmokeFailed) as e:
        _slurm(tmp_path, ["--fault", "1:raise@ddp_step"], wait_timeout_s=180)
    culprits = e.value.culprits
    assert [(k["rank"], k["check"]) for k in culprits] == [(1, "ddp_step")]
    assert culprits[0]["host"] in on_cluster.node_names


@pytest.mark.timeout(240)
def test_slurm_timeout_cancels_the_job_and_raises_within_the_bound(on_cluster, tmp_path):
    started = time.monotonic()
    with pytest.raises(SmokeTimeout) as e:
        _slurm(tmp_path, ["--fault", "1:hang@ddp_step", "--timeout", "120"], wait_timeout_s=15)
    assert time.monotonic() - started < 15 + 20
    job_id = e.value.job_id
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # scancel is asynchronous: the job leaves the queue soon
        queue = subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True)
        if job_id not in queue.stdout:
            break
        time.sleep(1)
    assert job_id not in queue.stdout, queue.stdout


@pytest.mark.timeout(240)
def test_slurm_tasks_run_the_given_interpreter(on_cluster, tmp_path):
    """submitit's `python` reaches every task (as the image's interpreter does with pyxis)."""
    marker = tmp_path / "used"
    wrapper = tmp_path / "python-wrapper"
    wrapper.write_text(f"#!/bin/sh\necho \"$SLURM_PROCID\" >> {marker}\n"
                       f"exec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    report = _slurm(tmp_path, [], wait_timeout_s=180, python=str(wrapper))
    assert report["verdict"] == "pass"
    assert sorted(marker.read_text().split()) == ["0", "1"]


@pytest.mark.timeout(240)
def test_tasks_that_leave_no_result_end_the_wait_and_are_named(on_cluster, tmp_path,
                                                               monkeypatch):
    """Every task killed before it could write its result (an interpreter that dies at
    start): without Slurm accounting submitit never calls such a job done, and its
    exception() waited for the missing result file forever (the campaign's
    blackhole.rank0.join.submit.3x1: srun could not launch a node's task, and ddp-smoke-submit
    never returned). Now each task is named once the result wait (shortened here) is over."""
    from ddp_smoke import submit as submitting
    from ddp_smoke.submit import TaskDied
    monkeypatch.setattr(submitting, "RESULT_WAIT_S", 2.0)
    wrapper = tmp_path / "python-that-dies"
    wrapper.write_text("#!/bin/sh\nkill -9 $$\n")
    wrapper.chmod(0o755)
    started = time.monotonic()
    with pytest.raises(TaskDied) as e:
        _slurm(tmp_path, [], wait_timeout_s=120, python=str(wrapper))
    assert time.monotonic() - started < 90
    [check] = e.value.report["checks"]
    assert sorted(k["rank"] for k in check["culprits"]) == [0, 1], check
    # each its first error line: srun's word that it was killed, or that it left no result
    assert all("Killed" in k["reason"] or "left no result" in k["reason"]
               for k in check["culprits"]), check
