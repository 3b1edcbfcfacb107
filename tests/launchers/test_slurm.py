"""Slurm: `sbatch --wait slurm/ddp_smoke.sbatch` on a real slurmctld + slurmd cluster.

The cluster (tests/sandbox/slurm.py) has two nodes, each a network namespace with its own
hostname, and no GPUs. Its NodeNames (``cn-dss1``, ``cn-dss2``) resolve nowhere and differ from
NodeHostname (``dss-node1``) and NodeAddr (``10.231.2.11``), as on sites whose NodeNames are
inventory labels: the template must rendezvous on addresses from ``scontrol show node``. The tests submit the real template as a user would, from a submit
directory, overriding only what this machine needs: no GPUs (``--gpus-per-node=0``), 2 CPUs per
node, the venv's python, and the workers per node. Reports land where the template puts them by
default: ``<submit dir>/reports/<job id>/``.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import report_schema
from tests.sandbox.slurm import slurm_fixture

TEMPLATE = Path(__file__).resolve().parents[2] / "slurm" / "ddp_smoke.sbatch"
JOB_TIMEOUT_S = 150  # a 2-node job takes ~15-45 s here; beyond this it hangs: cancel it
MACHINE = ["--gpus-per-node=0", "--cpus-per-task=2"]  # this machine has no GPUs, 2 cores

cluster = slurm_fixture(nodes=2, node_name_prefix="cn-dss")


class Job:
    """One finished sbatch --wait: its exit status, output file, report and wall time."""

    def __init__(self, rc: int, stdout: str, submit_dir: Path, wall_s: float, run: str = ""):
        self.rc, self.wall_s = rc, wall_s
        match = re.search(r"Submitted batch job (\d+)", stdout)
        assert match, f"sbatch printed no job id: {stdout!r}"
        self.id = match.group(1)
        out = submit_dir / f"ddp-smoke-{self.id}.out"
        self.output = out.read_text(errors="replace") if out.exists() else ""
        self.report_path = submit_dir / "reports" / f"{self.id}{run}" / "report.json"
        self.report = (report_schema.read(self.report_path) if self.report_path.exists()
                       else None)

    def last_line(self) -> str:
        """The template's one-line summary."""
        return self.output.strip().splitlines()[-1] if self.output.strip() else ""


def _run_id(report: dict) -> str:
    """The report's run id; the rendezvous id every rank saw where the worker predates the key."""
    if "run_id" in report:
        return report["run_id"]
    env = next(c for c in report["checks"] if c["name"] == "environment")["figures"]["env"]
    return env[0]["TORCHELASTIC_RUN_ID"]


def _submit(cluster, submit_dir: Path, worker: list[str], nproc: int = 1,
            sbatch: tuple[str, ...] = (), timeout_s: float = JOB_TIMEOUT_S, **env: str) -> Job:
    """Runs `sbatch --wait` on the template from submit_dir, cancelling the job if it hangs."""
    env = cluster.env(**{"WORKER_PYTHON": sys.executable, "NPROC_PER_NODE": str(nproc),
                         "OMP_NUM_THREADS": "1", **env})  # one thread per rank on 2 cores
    argv = ["sbatch", "--wait", *MACHINE, *sbatch, str(TEMPLATE), *worker]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(argv, cwd=submit_dir, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        # Our private cluster: every job on it is ours.
        subprocess.run(["scancel", "--user", "root"], env=env, timeout=10)
        tail = "".join(p.read_text(errors="replace")[-3000:]
                       for p in submit_dir.glob("ddp-smoke-*.out"))
        pytest.fail(f"job did not finish in {timeout_s} s; its output ends:\n{tail}")
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
    assert _run_id(report) == job.id  # DDP_SMOKE_RUN_ID, the rendezvous id: the job's own
    slots = sorted((r["host"], r["local_rank"]) for r in report["ranks"])
    assert slots == [(n, i) for n in cluster.hostnames for i in range(2)]
    addr = {h.name: h.addr for h in cluster.hosts.hosts}
    assert all(r["addresses"]["eth0"] == addr[r["host"]] for r in report["ranks"])
    assert job.last_line().startswith("ddp-smoke: verdict pass"), job.last_line()
    # the node's name in each line's prefix (torchrun --role): only rank 0 prints on a pass
    assert f"[{cluster.node_names[0]}:0]:" in job.output, job.output[-4000:]
    # rank 0 said the join and each check as it was judged, in the job's log (issue 51)
    said = [ln.split("ddp-smoke: ", 1)[1] for ln in job.output.splitlines()
            if ln.startswith(f"[{cluster.node_names[0]}:0]:")
            and ("ddp-smoke: run " in ln or "ddp-smoke: [" in ln)]
    assert " 4 ranks on 2 nodes joined in " in said[0], said
    assert [x.split()[:3] for x in said[1:]] == [["[1/2]", "environment", "PASS"],
                                                  ["[2/2]", "ddp_step", "PASS"]], said
    for node in cluster.node_names:  # per-node log folders, each rank's lines in its own
        assert list(job.report_path.parent.glob(f"torchrun/{node}/*/attempt_0/0/stdout.log"))
    head = cluster.hosts.hosts[0].addr  # NodeAddr: the NodeName resolves nowhere
    assert re.search(rf"rendezvous {re.escape(head)}:\d+,", job.output), job.output[:2000]
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
    assert (1, cluster.hostnames[1]) in named, json.dumps(job.report, indent=1)[-3000:]
    assert job.last_line().startswith("ddp-smoke: verdict fail"), job.last_line()


@pytest.mark.timeout(120)
def test_bad_worker_option_is_one_clear_line(cluster, tmp_path):
    job = _submit(cluster, tmp_path, ["--checks", "environment,no_such_check"])
    assert job.rc == 2, job.output[-3000:]  # the worker's bad-input status, through torchrun
    assert re.search(r"ddp-smoke: error: .*no_such_check", job.output), job.output[-3000:]
    assert job.report is None
    assert "verdict none (no report)" in job.last_line(), job.last_line()


@pytest.mark.timeout(60)
def test_bad_container_mode_fails_before_launch(cluster, tmp_path):
    job = _submit(cluster, tmp_path, [], CONTAINER="docker")
    assert job.rc == 2
    assert "CONTAINER=docker; expected none, pyxis or apptainer" in job.output
    assert "srun" not in job.output


@pytest.mark.timeout(120)
def test_site_export_none_still_runs(cluster, tmp_path):
    """`sbatch --export=NONE` (a common site default): nothing of the submitter's environment
    reaches the job, and srun inherits SLURM_EXPORT_ENV=NONE unless the template resets it."""
    os.symlink(Path(sys.executable).parents[1], tmp_path / ".venv")  # the default WORKER_PYTHON
    job = _submit(cluster, tmp_path, ["--checks", "environment"], sbatch=("--export=NONE",))
    assert job.rc == 0, job.output[-4000:]
    assert (job.report["verdict"], job.report["world_size"]) == ("pass", 2)


LATE_PYTHON = """#!/bin/sh
# Node 0, which hosts the c10d store, starts its torchrun late (an image still being pulled);
# the batch host's own steps (the store host, the verdict) are not late.
case " $* " in *" -m torch.distributed.run "*)
  if [ "$SLURM_NODEID" = 0 ]; then sleep {late_s}; fi ;;
esac
exec {python} "$@"
"""


@pytest.mark.timeout(240)
def test_store_connection_is_bounded_by_rdzv_timeout(cluster, tmp_path):
    """c10d's store client gives up after read_timeout, not join_timeout. The template passes
    read_timeout = RDZV_TIMEOUT: with RDZV_TIMEOUT=5 a head 20 s late fails the job. Without
    it the bound would be the default read_timeout 60 s, which torch 2.13's client stretches to
    about 2 x 60 s + a backoff by retrying once (measured: 11.1 s for a 5 s timeout), and this
    job would pass. The real-world case, nodes pulling an image for minutes, is the other side
    of the same wire: RDZV_TIMEOUT (300 s) bounds both waits."""
    wrapper = tmp_path / "late-python"
    wrapper.write_text(LATE_PYTHON.format(late_s=20, python=sys.executable))
    wrapper.chmod(0o755)
    job = _submit(cluster, tmp_path, ["--checks", "environment"], WORKER_PYTHON=str(wrapper),
                  RDZV_TIMEOUT="5", PREFLIGHT="0")  # torchrun's own bound, not preflight's
    assert job.rc != 0, job.output[-4000:]
    assert "The connection to the C10d store has failed" in job.output, job.output[-4000:]
    # No worker ran: the launcher's report names the late head, not the node left waiting.
    [check] = job.report["checks"]
    assert check["name"] == "launch" and [k["host"] for k in check["culprits"]] == \
        [cluster.node_names[0]], check
    assert check["culprits"][0]["reason"].startswith("rendezvous host: its c10d store never "
                                                     "answered"), check
    assert job.last_line().startswith(f"ddp-smoke: verdict fail · launch: "
                                      f"{cluster.node_names[0]}: "), job.last_line()
    print(f"\nhead 20 s late, RDZV_TIMEOUT=5: job failed after {job.wall_s:.1f} s")


def _scontrol(cluster, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["scontrol", *args], env=cluster.env(), capture_output=True,
                          text=True, timeout=20)


def _wait_running(cluster, job_id: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while "JobState=RUNNING" not in _scontrol(cluster, "show", "job", job_id).stdout:
        assert time.monotonic() < deadline, f"job {job_id} not RUNNING after {timeout_s} s"
        time.sleep(0.3)


def _start(cluster, submit_dir: Path, *sbatch: str) -> str:
    env = cluster.env(WORKER_PYTHON=sys.executable, NPROC_PER_NODE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(["sbatch", "--parsable", *MACHINE, *sbatch, str(TEMPLATE),
                           "--checks", "environment,ddp_step"], cwd=submit_dir, env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def _wait_for(path: Path, timeout_s: float = JOB_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} not written after {timeout_s} s"
        time.sleep(0.5)


@pytest.mark.timeout(300)
def test_requeue_is_refused_and_a_forced_rerun_gets_its_own_report(cluster, tmp_path):
    """#SBATCH --no-requeue: `scontrol requeue` is refused. A user who overrides it with
    --requeue gets a second run whose run id and report folder are not the first one's."""
    job_id = _start(cluster, tmp_path)
    _wait_running(cluster, job_id)
    refused = _scontrol(cluster, "requeue", job_id)
    assert refused.returncode != 0, refused.stdout + refused.stderr
    _wait_for(tmp_path / "reports" / job_id / "report.json")

    forced = _start(cluster, tmp_path, "--requeue")
    _wait_running(cluster, forced)
    requeued = _scontrol(cluster, "requeue", forced)
    assert requeued.returncode == 0, requeued.stderr
    # Slurm holds a requeued job back (BeginTime) for a while; this test need not wait.
    time.sleep(1)
    _scontrol(cluster, "update", f"JobId={forced}", "StartTime=now")
    rerun = tmp_path / "reports" / f"{forced}.r1" / "report.json"
    _wait_for(rerun)
    report = report_schema.read(rerun)
    assert (_run_id(report), report["verdict"]) == (f"{forced}.r1", "pass")
    first = tmp_path / "reports" / forced / "report.json"
    assert not first.exists() or _run_id(report_schema.read(first)) == forced
