"""Python submission path: submitit runs the worker and hands back rank 0's report (local
tasks here; on the real Slurm test cluster: tests/launchers/test_submit_slurm.py)."""
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from ddp_smoke.errors import ConfigError
from ddp_smoke import task
from ddp_smoke.coordination import fate
from ddp_smoke.submit import (AFTER_REPORT_S, GPU_CPUS_PER_PROC, IMAGE_PYTHON,
                              ReportNotWritten, SmokeFailed, TaskDied, plan,
                              submit)
from tests.launch import REPO
from tests.sandbox.faults import SmallFolder

QUICK = ["--checks", "environment,ddp_step", "--timeout", "20"]  # a later --timeout wins


@pytest.mark.timeout(180)
def test_local_two_processes_return_a_passing_report(tmp_path):
    report = submit("local", procs_per_node=2, folder=tmp_path, worker_args=QUICK,
                    wait_timeout_s=150)
    assert (report["verdict"], report["world_size"]) == ("pass", 2)
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    # rank 0's task log, one the caller can tail, said each check as it was judged (issue 51)
    logs = "".join(p.read_text(errors="replace") for p in tmp_path.rglob("*_0_log.err"))
    assert "ddp-smoke: [1/2] environment PASS in " in logs, logs[-3000:]
    assert "ddp-smoke: [2/2] ddp_step PASS in " in logs, logs[-3000:]


@pytest.mark.timeout(180)
def test_local_fault_raises_with_the_culprit_and_the_report(tmp_path):
    with pytest.raises(SmokeFailed) as e:
        submit("local", procs_per_node=2, folder=tmp_path, wait_timeout_s=150,
               worker_args=QUICK + ["--fault", "1:corrupt@ddp_step"])
    assert e.value.report["verdict"] == "fail"
    assert [(k["rank"], k["check"]) for k in e.value.culprits] == [(1, "ddp_step")]
    assert "rank 1" in str(e.value)
    assert ": verdict fail (PRACTICE: --fault 1:corrupt@ddp_step); " in str(e.value)  # issue 35


@pytest.mark.timeout(180)
def test_local_rank0_dead_returns_the_survivors_report(tmp_path):
    """Issue 24: rank 0 hosted the store and took it along; task 0's store host now holds it,
    and a survivor's report naming rank 0 comes back (it was TaskDied, no culprit, and a
    traceback from the watchdog's look at the abort list in task 1's log)."""
    t = time.monotonic()
    with pytest.raises(SmokeFailed) as e:
        submit("local", procs_per_node=3, folder=tmp_path, wait_timeout_s=150,
               worker_args=QUICK + ["--fault", "0:crash@ddp_step"])
    print(f"\nsubmit local, rank 0 crashed: report back after {time.monotonic() - t:.1f} s")
    assert [(k["rank"], k["check"]) for k in e.value.culprits] == [(0, "ddp_step")]
    assert e.value.report["written_by"] == "rank 1 (took over from rank 0)"


@pytest.mark.timeout(180)
def test_local_rank_stopped_is_named_and_its_task_cancelled_after_the_report(tmp_path):
    """Rank 1's task stopped (SIGSTOP) as it starts: it never ends by itself, so the job never
    finishes; submit cancels it AFTER_REPORT_S after the report and raises with the verdict
    (the campaign's sigstop.last.join.submit.1x2 waited out the wait timeout instead)."""
    stopped = []

    def stop_rank_1():
        end = time.monotonic() + 60
        while not stopped and time.monotonic() < end:
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                    cmd = open(f"/proc/{pid}/cmdline", "rb").read()
                except OSError:
                    continue
                if b"SUBMITIT_LOCAL_GLOBALID=1" in env and b"submitit.core._submit" in cmd \
                        and str(tmp_path).encode() in cmd:
                    os.kill(int(pid), signal.SIGSTOP)  # this test's own job's task
                    stopped.append(int(pid))
                    break
            time.sleep(0.05)
    threading.Thread(target=stop_rank_1, daemon=True).start()
    t = time.monotonic()
    # as a background job of a non-interactive shell (CI, the campaign): SIGINT ignored, which
    # submitit's local controller inherited and its cancel (a SIGINT) then did nothing
    ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with pytest.raises(SmokeFailed) as e:
            submit("local", procs_per_node=2, folder=tmp_path, wait_timeout_s=150,
                   worker_args=QUICK + ["--timeout", "5"])
    finally:
        signal.signal(signal.SIGINT, ignored)
    took = time.monotonic() - t
    print(f"\nsubmit local, rank 1 stopped: {took:.1f} s; {e.value}")
    assert stopped, "rank 1's task was never seen"
    assert [k["rank"] for k in e.value.culprits] == [1], e.value.report["checks"]
    assert took < 5 + AFTER_REPORT_S + 40, took  # not the wait timeout (150 s)
    try:
        state = fate.state_of(open(f"/proc/{stopped[0]}/stat").read())
    except OSError:
        state = None  # gone
    assert state in (None, "X", "Z"), f"the stopped task was left behind ({state})"


def test_local_report_folder_that_cannot_take_a_report_is_refused_before_submitting(tmp_path):
    """A folder in report.json's place (a read-only or full share alike): one line, no job."""
    (tmp_path / "report" / "report.json").mkdir(parents=True)
    with pytest.raises(ConfigError, match="cannot remove report.json left by another run"):
        submit("local", procs_per_node=2, folder=tmp_path, worker_args=QUICK)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]  # nothing submitted


@pytest.mark.timeout(180)
def test_local_report_the_folder_cannot_take_comes_back_from_a_tasks_stderr(tmp_path, capfd):
    """The report folder fills up mid-run, a folder too small for rank 0 to keep room for the
    report in (1 MiB; with room, the report takes it: tests/outputs/test_report_write_failure.
    py), or turns read-only (the campaign's read_only.rank0.storage.submit.1x4): rank 0 puts
    the report on its task's stderr as one JSON line; submit reads it back, says why the folder
    took none and, the checks having passed, raises ReportNotWritten (the CLI exits 1): a pass
    nobody kept is not one."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    with SmallFolder(tmp_path / "report", size=1 << 20) as folder:
        filled = threading.Thread(target=_fill_once_rank0_holds_it, args=(folder,), daemon=True)
        filled.start()
        # iterations for 3 s: the folder fills while they run, however late a loaded host
        # wakes the filling thread (QUICK alone ended before it once, in a suite run)
        with pytest.raises(ReportNotWritten) as e:
            submit("local", procs_per_node=2, folder=tmp_path, wait_timeout_s=150,
                   worker_args=QUICK + ["--duration", "3"])
        filled.join(timeout=5)
    err = capfd.readouterr().err
    assert e.value.report["run_id"] == f"submitit-{e.value.job_id}-0", e.value.report
    assert e.value.report["verdict"] == "pass", e.value.report
    assert "report.json: No space left on device (ENOSPC); rank 0's report, from its task's " \
        "stderr: the report follows as one JSON line" in err, err[-2000:]
    assert "verdict pass, but no report kept: cannot write" in str(e.value)


def _fill_once_rank0_holds_it(folder: SmallFolder, timeout_s: float = 60.0) -> None:
    """Fill the folder to its last byte once rank 0 holds it (``.ddp-smoke.lock``: its start's
    writability check passed): only the report is still to be written there."""
    end = time.monotonic() + timeout_s
    while not (folder.path / ".ddp-smoke.lock").exists() and time.monotonic() < end:
        time.sleep(0.05)
    folder.fill()


def test_plan_renders_slurm_parameters_and_refuses_node_local_folders(tmp_path):
    p = plan("slurm", nodes=2, procs_per_node=4, gpus_per_node=4, partition="gpu",
             account="ops", folder=REPO / ".sandbox" / "x", container_image="img:1",
             allow_local_folder=True)  # the checkout itself may live under /tmp (CI)
    assert p.parameters["nodes"] == 2 and p.parameters["tasks_per_node"] == 4
    assert p.parameters["slurm_partition"] == "gpu" and p.parameters["gpus_per_node"] == 4
    assert "--container-image=img:1" in p.parameters["slurm_srun_args"]
    assert p.worker_args[-2:] == ["--report-dir", str(p.report_dir)]
    with pytest.raises(ConfigError, match="node-local"):
        plan("slurm", folder=tmp_path)
    with pytest.raises(ConfigError, match="nodes=2"):
        plan("local", nodes=2)


def _sbatch_text(p) -> str:
    """The batch script submitit would submit for plan p (its own renderer, nothing sent)."""
    import submitit
    executor = submitit.SlurmExecutor(folder=p.folder, python=p.python)
    executor.update_parameters(**{k.removeprefix("slurm_"): v for k, v in p.parameters.items()
                                  if k not in ("timeout_min", "name", "tasks_per_node")},
                               time=p.parameters["timeout_min"], job_name="ddp-smoke",
                               ntasks_per_node=p.parameters["tasks_per_node"])
    return executor._make_submission_file_text(executor._submitit_command_str, "uid")


def test_container_runs_the_images_python_and_checks_submitit(tmp_path):
    """A pyxis task cannot run the login node's python path: it runs the image's."""
    import submitit
    p = plan("slurm", nodes=2, procs_per_node=8, gpus_per_node=8, container_image="img:1",
             folder=REPO / ".sandbox" / "c", allow_local_folder=True)
    assert p.python == IMAGE_PYTHON
    assert p.worker_args[:2] == ["--submitit-version", submitit.__version__]
    text = _sbatch_text(p)
    assert "srun --unbuffered --output" in text and "--container-image=img:1" in text
    assert f"{IMAGE_PYTHON} -u -m submitit.core._submit" in text
    assert sys.executable not in text  # the login node's interpreter appears nowhere
    with pytest.raises(RuntimeError, match=f"submitit {submitit.__version__} in the container, "
                                           "0.0.1 on the submitting side"):
        task.run(["--submitit-version", "0.0.1", "--checks", "environment"], False)


def test_gpu_runs_get_whole_nodes_memory_and_cpus(tmp_path):
    gpu = plan("slurm", nodes=2, procs_per_node=8, gpus_per_node=8,
               folder=REPO / ".sandbox" / "g", allow_local_folder=True)
    assert (gpu.parameters["cpus_per_task"], gpu.parameters["slurm_exclusive"],
            gpu.parameters["slurm_mem"]) == (GPU_CPUS_PER_PROC, True, "0")
    text = _sbatch_text(gpu)
    for line in ("#SBATCH --exclusive", "#SBATCH --mem=0", f"#SBATCH --cpus-per-task="
                 f"{GPU_CPUS_PER_PROC}", "#SBATCH --gpus-per-node=8"):
        assert line in text, text
    cpu = plan("slurm", nodes=2, procs_per_node=2, folder=REPO / ".sandbox" / "g",
               allow_local_folder=True)
    assert cpu.parameters["cpus_per_task"] == 1 and "slurm_exclusive" not in cpu.parameters
    mine = plan("slurm", gpus_per_node=8, cpus_per_proc=12, exclusive=False,
                folder=REPO / ".sandbox" / "g", allow_local_folder=True)
    assert mine.parameters["cpus_per_task"] == 12 and "slurm_mem" not in mine.parameters


@pytest.mark.timeout(60)
def test_cli_dry_run_and_bad_input():
    cli = [sys.executable, "-m", "ddp_smoke.submit"]
    dry = subprocess.run(cli + ["--cluster", "slurm", "--nodes", "2", "--folder",
                                str(REPO / ".sandbox" / "dry"), "--allow-local-folder",
                                "--dry-run", "--", *QUICK],
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert dry.returncode == 0 and "nodes=2" in dry.stdout and "--checks" in dry.stdout
    site = subprocess.run(cli + ["--cluster", "slurm", "--folder", str(REPO / ".sandbox" / "dry"),
                                 "--allow-local-folder", "--python", "/opt/site/python",
                                 "--dry-run", "--", *QUICK],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    assert site.returncode == 0 and "worker: /opt/site/python -m" in site.stdout, site.stdout
    bad = subprocess.run(cli + ["--", "--checks", "nope"], capture_output=True, text=True,
                         cwd=REPO, timeout=60)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "nope" in bad.stderr


@pytest.mark.timeout(180)
def test_local_task_whose_preflight_fails_is_named_in_the_launchers_report(tmp_path,
                                                                           monkeypatch):
    """Each node's first task runs preflight before the worker: a missing interface fails it
    in seconds; no worker report exists, so submit writes the launcher's, naming that task
    (the other task, left waiting for rank 0's store, is a victim)."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ib7")
    with pytest.raises(TaskDied) as e:
        submit("local", procs_per_node=2, folder=tmp_path, wait_timeout_s=150,
               worker_args=["--checks", "environment", "--timeout", "10"])
    report = e.value.report
    assert report is not None and report["verdict"] == "fail", str(e.value)
    [check] = report["checks"]
    assert check["name"] == "preflight"
    [culprit] = check["culprits"]
    assert culprit["rank"] == 0 and "GLOO_SOCKET_IFNAME=ib7: no interface ib7" in \
        culprit["reason"], culprit
    assert (tmp_path / "report" / "report.json").exists()
