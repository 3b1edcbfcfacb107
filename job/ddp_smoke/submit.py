"""Submit the worker with submitit and get rank 0's report back, from Python or the shell.

    from ddp_smoke.submit import submit, SmokeFailed
    report = submit("slurm", nodes=2, procs_per_node=8, gpus_per_node=8, partition="gpu")
    print(report["verdict"], report["world_size"], report["nodes"])

One submitit task per process: submitit's ``TorchDistributedEnvironment`` exports RANK,
WORLD_SIZE, MASTER_ADDR/PORT and (on GPU) CUDA_VISIBLE_DEVICES=<local rank> in each task, and
the worker runs in that task with no torchrun agent (rank 0 hosts the store). Chosen over one
task per node running torchrun because each rank is then a Slurm task of its own: a rank that
dies is a task that failed, with its own stderr, which this module quotes when it raises.

The submitit folder holds pickles and logs that every node must read: it defaults to
``reports/submitit/<time>`` under the working directory (which on a cluster is normally on the
shared home or project filesystem) and a node-local path (tmpfs, /tmp …) is refused for Slurm.
Rank 0 writes the report to ``<folder>/report/report.json``; this module reads it from there,
so a report written by a run that failed is returned inside the exception, never lost.

Each task sets ``DDP_SMOKE_RUN_ID=submitit-<job id>-<restart count>`` before the worker
starts, so the report carries the job's id; a report in the folder whose run id is not the
submitted job's (a second submission into the same ``--folder``, whose rank 0 then died) is
never returned: ``TaskDied`` is raised instead. A requeued job writes under a higher restart
count; any restart of the submitted job is its own.

Waiting uses its own timeout: without Slurm accounting a cancelled job never finishes in
submitit's eyes. On timeout the job is cancelled and SmokeTimeout raised. Once the job's own
report is there, its tasks get ``AFTER_REPORT_S`` more to end; a task still running then (a
rank stopped by SIGSTOP or a debugger, frozen in the kernel) is cancelled with the job and the
report returned: its verdict never waits for the wait timeout.

Containers (``container_image``, through pyxis): submitit starts each task as
``<python> -u -m submitit.core._submit <folder>``, by default with *this* interpreter's path,
which does not exist inside the image. With an image the tasks run the image's interpreter
(``container_python``, default the image from docker/'s ``/opt/ddp-smoke/venv/bin/python``),
and the image must hold the same submitit version as this side (it unpickles what this side
pickled): a task whose submitit differs stops with a message naming both versions.

GPU runs (``gpus_per_node`` > 0) get defaults fit for an acceptance test: whole nodes
(``--exclusive``: a neighbour's job would skew every figure), all of each node's memory
(``--mem=0``) and ``GPU_CPUS_PER_PROC`` CPUs per process unless ``cpus_per_proc`` is given.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from . import task
from .submit_plan import CLUSTERS, GPU_CPUS_PER_PROC, IMAGE_PYTHON, Plan, plan
from .config.args import Parser, parse_config
from .coordination import hosting, lost
from .errors import ConfigError
from .model import Culprit, injected
from .outputs import (REPORT_FOLLOWS, Said, launch_report, prepare, publish,
                      report_in_stderr)
from .outputs.last_line import from_lost
from .outputs.report import as_dict, json_line

LAST_RESORT_S = 15.0  # after the job: the store host's report of last resort comes within this
AFTER_REPORT_S = 15.0  # after the job's report: the tasks still running then are cancelled
CANCEL_WAIT_S = 10.0  # and then waited for this long at most
RESULT_WAIT_S = 15.0  # after the job: a task's result file on a shared filesystem, at most
MAX_WAIT_S = 7 * 86400.0  # a week: longer is a typo, and time.monotonic arithmetic stays sane


class SmokeError(RuntimeError):
    """Base of the failures ``submit`` raises; ``report`` is rank 0's report when written."""

    def __init__(self, message: str, report: dict | None = None, job_id: str | None = None):
        super().__init__(message)
        self.report, self.job_id = report, job_id


class SmokeFailed(SmokeError):
    """The run finished with verdict fail; ``culprits`` lists who the checks blamed."""

    @property
    def culprits(self) -> list[dict]:
        return [dict(k, check=c["name"]) for c in (self.report or {}).get("checks", [])
                for k in c["culprits"]]


class TaskDied(SmokeError):
    """No report: a task died before rank 0 could write one."""


class ReportNotWritten(SmokeError):
    """The run finished but its folder took no report (full, read-only): ``report`` is rank
    0's, read back from its task's stderr; a pass is not one until the report is kept."""


class SmokeTimeout(SmokeError):
    """The job did not finish within the wait timeout; it was cancelled."""


def owns(report: dict, job_id: str) -> bool:
    """True when ``report`` was written by (any restart of) submitit job ``job_id``."""
    rid, prefix = str(report.get("run_id", "")), task.run_id_of(job_id, "")
    return rid.startswith(prefix) and rid[len(prefix):].isdigit()


def check_wait_timeout(value: Any) -> float:
    """The wait timeout in seconds: a finite number in (0, a week]; else ConfigError."""
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not 0 < value <= MAX_WAIT_S):  # NaN fails every comparison: refused too
        raise ConfigError(f"wait_timeout_s (--wait-timeout) = {value!r}: expected seconds, "
                          f"a finite number > 0 and <= {MAX_WAIT_S:g}")
    return float(value)


def submit(cluster: str = "local", *, wait_timeout_s: float = 900, progress: bool | None = None,
           **kwargs) -> dict:
    """Submit the worker, wait for it, and return rank 0's report (a dict).

    Args:
        cluster: ``slurm`` or ``local``.
        wait_timeout_s: cancel the job and raise SmokeTimeout after this long.
        progress: print job id, state changes and elapsed time on stderr; default: only when
            stderr is a terminal.
        **kwargs: the parameters of :func:`plan`.

    Returns:
        The report as written to ``report.json``, verdict pass.

    Raises:
        SmokeFailed: verdict fail; ``.report`` and ``.culprits`` say what and who.
        TaskDied: no report; the message names the task, host and the tail of its stderr.
        ReportNotWritten: verdict pass, but the folder took no report (full, read-only).
        SmokeTimeout: the wait timed out; the job was cancelled.
        ConfigError: bad parameters.
    """
    import submitit

    check_wait_timeout(wait_timeout_s)
    p = plan(cluster, **kwargs)
    p.folder.mkdir(parents=True, exist_ok=True)
    # a folder that cannot take the report: one line, nothing submitted (rank 0 keeps room)
    prepare(str(p.report_dir), room=False)
    # submitit's pickles carry the run's signing secret: the folder is the user's alone
    os.chmod(p.folder, p.folder.stat().st_mode & ~0o077)
    extra = {"slurm_python": p.python} if p.python and cluster == "slurm" else {}
    executor = submitit.AutoExecutor(folder=p.folder / "%j", cluster=cluster, **extra)
    executor.update_parameters(**p.parameters)
    with _cancellable(cluster):
        job = executor.submit(task.run, p.worker_args, bool(p.parameters.get("gpus_per_node")),
                              60.0 * p.parameters["timeout_min"],
                              secrets.token_hex(32))  # one per run: nothing outside is evidence
    say = _progress(sys.stderr.isatty() if progress is None else progress)
    say(f"submitted job {job.job_id} ({cluster}, {p.parameters['nodes']} node(s) x "
        f"{p.parameters['tasks_per_node']}); folder {p.folder}")
    _wait(job, wait_timeout_s, say, p.report_dir / "report.json")
    report, said = _own_report(p.report_dir / "report.json", job.job_id), None
    end = time.monotonic() + (LAST_RESORT_S if _store_hosted(p, job) else 0)
    while report is None:  # every rank died: the store host writes; or the folder took none
        if (said := _said_on_stderr(job)) is not None or time.monotonic() >= end:
            report = said and said.report
            break
        time.sleep(0.5)
        report = _own_report(p.report_dir / "report.json", job.job_id)
    if said is not None:
        print(f"ddp-smoke-submit: {said.why}; rank 0's report, from its task's stderr: "
              f"{REPORT_FOLLOWS}\n{json_line(report)}", file=sys.stderr)
    if report is None:
        errors = _task_errors(job, cluster)
        notice = (_death_notice(job, errors) + _survivors(p.report_dir, job.job_id)
                  + _foreign(p.report_dir / "report.json"))
        raise TaskDied(notice, report=_launch_report(job, p, errors), job_id=job.job_id)
    if report["verdict"] != "pass":
        failed = SmokeFailed("", report, job.job_id)
        lines = [f"rank {k['rank']} ({k['host']}) at {k['check']}: {k['reason']}"
                 for k in failed.culprits] or ["no culprit named"]
        mark = f" (PRACTICE: --fault {injected(report)})" if injected(report) else ""
        failed.args = (f"ddp-smoke job {job.job_id}: verdict fail{mark}; " + "; ".join(lines),)
        raise failed
    if said is not None:
        raise ReportNotWritten(f"ddp-smoke job {job.job_id}: verdict pass, but no report kept: "
                               f"{said.why}", report, job.job_id)
    return report


@contextlib.contextmanager
def _cancellable(cluster: str):
    """submitit cancels a local job by SIGINT to its controller, which inherits this process's
    disposition: started with SIGINT ignored (a background job of a non-interactive shell, as
    CI and the campaign start it) it ignores the cancel, and a stopped task outlived it
    (sigstop.last.join.submit.1x2). The controller starts with SIGINT's default instead."""
    restore = (cluster == "local" and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
               and threading.current_thread() is threading.main_thread())
    if restore:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # exec makes it SIG_DFL
    try:
        yield
    finally:
        if restore:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def _own_report(path: Path, job_id: str) -> dict | None:
    """The report at ``path`` when job ``job_id`` wrote it; None when absent, unreadable or
    another run's (its verdict is not this job's)."""
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) and owns(report, job_id) else None


def _said_on_stderr(job) -> Said | None:
    """This job's report from a task's stderr, and why the folder took none (full, read-only):
    rank 0 (or a survivor) puts it there as one JSON line."""
    for task_id in range(job.num_tasks):
        try:
            text = Path(job.task(task_id).paths.stderr).read_text(errors="replace")
        except OSError:
            continue
        said = report_in_stderr(text)
        if said is not None and owns(said.report, job.job_id):
            return said
    return None


def _survivors(report_dir: Path, job_id: str) -> str:
    """What the ranks that lost the coordination store left (:mod:`ddp_smoke.outputs.last_line`)."""
    records = {r: v for r, v in lost.read(str(report_dir)).items()
               if str(v.get("run_id", "")).startswith(task.run_id_of(job_id, ""))}
    return f"\n{from_lost(records)}" if records else ""


def _foreign(path: Path) -> str:
    """A note on a report that is there but not this job's."""
    try:
        rid = json.loads(path.read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return ""
    return f"\n{path} is another run's report (run id {rid!r}); not this job's verdict"


def _wait(job, timeout_s: float, say, report: Path) -> None:
    """Until the job finishes, AFTER_REPORT_S past its own report, or timeout_s (raises)."""
    start, state, reported = time.monotonic(), None, None
    while not _finished(job):
        elapsed = time.monotonic() - start
        if elapsed > timeout_s:
            job.cancel(check=False)
            raise SmokeTimeout(f"ddp-smoke job {job.job_id} did not finish within {timeout_s:.0f}"
                               " s; it was cancelled", job_id=job.job_id)
        if reported is None and _own_report(report, job.job_id) is not None:
            reported = elapsed
        elif reported is not None and elapsed - reported > AFTER_REPORT_S:
            job.cancel(check=False)
            say(f"job {job.job_id}: cancelled {AFTER_REPORT_S:.0f} s after its report, a task "
                "still running (stopped or frozen?)")
            end = time.monotonic() + CANCEL_WAIT_S
            while not _finished(job) and time.monotonic() < end:  # its tasks gone, at best
                time.sleep(0.5)
            return
        if job.state != state:
            state = job.state
            say(f"job {job.job_id}: {state} after {elapsed:.0f} s")
        time.sleep(1.0)
    say(f"job {job.job_id}: done after {time.monotonic() - start:.0f} s")


def _finished(job) -> bool:
    """submitit's answer, or Slurm's: without accounting, submitit never sees a job that failed
    or was cancelled finish (its state stays UNKNOWN), so a job gone from squeue is over."""
    if job.done():
        return True
    if type(job).__name__ != "SlurmJob":
        return False
    q = subprocess.run(["squeue", "-h", "-j", str(job.job_id), "-o", "%T"], capture_output=True,
                       text=True, timeout=60)
    return (q.returncode == 0 and not q.stdout.strip()) or "Invalid job id" in q.stderr


def _store_hosted(p: Plan, job) -> bool:
    """Task 0 started a store host (its address, not "none"): a last-resort report may come."""
    path = Path(hosting.address_file(str(p.report_dir), task.run_id_of(job.job_id, 0)))
    try:
        return path.read_text().strip() not in ("", "none")
    except OSError:
        return False


def _task_errors(job, cluster: str) -> dict[int, BaseException]:
    """Each failed task's error, read once. A task ended by a signal or os._exit, or one srun
    never launched, writes no result file, for which submitit's exception() waits as long as
    the job is not done by its own reckoning: without Slurm accounting, forever (a black hole
    to one node: srun could not launch its task, and ddp-smoke-submit never returned). Such a
    task's error is its own words, once RESULT_WAIT_S passed (a slow shared filesystem may
    show the file late; on one machine's own disk there is nothing to wait for)."""
    errors: dict[int, BaseException] = {}
    end = time.monotonic() + (0 if cluster == "local" else RESULT_WAIT_S)
    for task_id in range(job.num_tasks):
        one = job.task(task_id)
        while not one.paths.result_pickle.exists() and time.monotonic() < end:
            time.sleep(0.5)
        if not one.paths.result_pickle.exists():
            errors[task_id] = RuntimeError(f"task {task_id} left no result: it was never "
                                           "launched, or was killed")
            continue
        try:
            error = one.exception()
        except Exception as e:  # noqa: BLE001 — submitit raises on unreadable results too
            error = e
        if error is not None:
            errors[task_id] = error
    return errors


def _death_notice(job, errors: dict[int, BaseException]) -> str:
    """Which task died, where, and the tail of its stderr."""
    parts = [f"ddp-smoke job {job.job_id} ended without a report (state {job.state})"]
    for task_id, error in errors.items():
        tail = (job.task(task_id).stderr() or "").strip().splitlines()[-8:]
        parts.append(f"task {task_id} failed: {str(error).strip().splitlines()[0]}\n    "
                     + "\n    ".join(tail))
    return "\n".join(parts)


def _launch_report(job, p: Plan, errors: dict[int, BaseException]) -> dict | None:
    """No report from the worker: write the launcher's (ddp_smoke/outputs/launch_report.py),
    one culprit per failed task with its first error line and its node from the preflight
    records; returned, unless the folder holds another run's report (never overwritten)."""
    path = p.report_dir / "report.json"
    if path.exists():
        return None
    run_id = task.run_id_of(job.job_id, 0)
    per_node = int(p.parameters["tasks_per_node"])
    hosts = {r.get("node_rank"): r.get("node")
             for r in launch_report.read_records(str(p.report_dir), run_id).values()}
    culprits, unlaunched = [], {}
    for task_id, error in errors.items():
        text = (job.task(task_id).stderr() or "") + "\n" + str(error)
        culprits.append(Culprit(task_id, hosts.get(task_id // per_node),
                                launch_report.error_line(text.splitlines())))
        unlaunched.update({node: why for node, why in launch_report.launch_errors(text).items()
                           if why.startswith("task launch failed")})
    # srun could not launch a node's tasks (task 0's stderr holds srun's word): that node is
    # the culprit, the tasks it then stopped are victims
    failed = [Culprit(None, node, why) for node, why in unlaunched.items()] or \
        [k for k in culprits if launch_report.failed_preflight(k.reason)]
    victims = [f"task {k.rank}: {k.reason}" for k in culprits if k not in failed] if failed \
        else []  # the others then waited for a rank that never came
    nodes = [str(n) for n in range(int(p.parameters["nodes"]))]
    stage = "preflight" if failed and not unlaunched else "run"
    report = launch_report.build(stage, nodes, failed or culprits,
                                 victims, str(p.report_dir), run_id, "submitit", {})
    # every artifact a run leaves; a report that cannot be written still travels with the
    # exception
    publish(report, str(p.report_dir), run_id, print_summary=False)
    return as_dict(report)


def _progress(enabled: bool):
    return (lambda message: print(f"ddp-smoke-submit: {message}", file=sys.stderr,
                                  flush=True)) if enabled else (lambda message: None)


def main(argv: list[str] | None = None) -> None:
    """``ddp-smoke-submit [options] [-- worker options]``: exit 0 pass, 1 fail, 2 bad input."""
    argv = list(sys.argv[1:] if argv is None else argv)
    worker = argv[argv.index("--") + 1:] if "--" in argv else []
    ours = argv[:argv.index("--")] if "--" in argv else argv
    ap = Parser(prog="ddp-smoke-submit",
                usage="ddp-smoke-submit [options] [-- WORKER_ARGS …]",
                description="Submit the ddp-smoke worker with submitit (one task per process, "
                            "to Slurm or this\nmachine), wait, and print rank 0's verdict. "
                            "WORKER_ARGS after -- go to every rank\n(python -m ddp_smoke "
                            "--help lists them). Exit status: 0 pass, 1 fail (culprits\n"
                            "printed), 2 bad input.",
                epilog="example:\n  ddp-smoke-submit --cluster slurm --nodes 2 "
                       "--procs-per-node 8 --gpus-per-node 8 \\\n    --partition gpu -- "
                       "--timeout 60\nWhy one task per process, the folder rules, containers: "
                       "pydoc ddp_smoke.submit")
    ap.add_argument("--cluster", choices=CLUSTERS, default="local",
                    help="where the tasks run (default local)")
    ap.add_argument("--nodes", type=int, default=1, metavar="N", help="nodes (default 1)")
    ap.add_argument("--procs-per-node", type=int, default=2, metavar="N",
                    help="ranks per node, one per GPU (default 2)")
    ap.add_argument("--gpus-per-node", type=int, default=0, metavar="N",
                    help="GPUs per node; > 0 also asks for whole nodes (default 0)")
    ap.add_argument("--partition", help="Slurm partition (default: the cluster's)")
    ap.add_argument("--account", help="Slurm account (default: yours)")
    ap.add_argument("--qos", help="Slurm QoS (default: the account's)")
    ap.add_argument("--time-min", type=int, default=10, metavar="MINUTES",
                    help="Slurm time limit (default 10)")
    ap.add_argument("--container-image", metavar="IMAGE",
                    help="run the tasks in this image through pyxis (default: none)")
    ap.add_argument("--container-python", default=IMAGE_PYTHON, metavar="PATH",
                    help=f"the image's interpreter (default {IMAGE_PYTHON})")
    ap.add_argument("--python", metavar="PATH",
                    help="the tasks' interpreter on Slurm's nodes, without a container (default: "
                         "this one): the nodes' own venv, or a site's wrapper around it")
    ap.add_argument("--cpus-per-proc", type=int, metavar="N",
                    help=f"CPUs per process (default 1; {GPU_CPUS_PER_PROC} with GPUs)")
    ap.add_argument("--folder", metavar="DIR",
                    help="submitit's folder, shared by every node; the report goes to "
                         "DIR/report (default reports/submitit/<time>)")
    ap.add_argument("--allow-local-folder", action="store_true",
                    help="accept a node-local --folder for Slurm (single-node clusters)")
    ap.add_argument("--wait-timeout", type=float, default=900, metavar="SECONDS",
                    help="cancel the job and exit 1 after this long (default 900)")
    ap.add_argument("--dry-run", action="store_true",
                    help="print what would be submitted, submit nothing")
    try:
        a = ap.parse_args(ours)
        kwargs = dict(nodes=a.nodes, procs_per_node=a.procs_per_node,
                      gpus_per_node=a.gpus_per_node, partition=a.partition, account=a.account,
                      qos=a.qos, time_min=a.time_min, container_image=a.container_image,
                      container_python=a.container_python, python=a.python,
                      cpus_per_proc=a.cpus_per_proc,
                      folder=a.folder, worker_args=worker, allow_local_folder=a.allow_local_folder)
        check_wait_timeout(a.wait_timeout)
        if a.dry_run:
            print(plan(a.cluster, **kwargs))
            sys.exit(0)
        parse_config(worker)  # bad worker options fail here, not in every task
        report = submit(a.cluster, wait_timeout_s=a.wait_timeout, **kwargs)
    except ConfigError as e:
        print(f"ddp-smoke-submit: error: {e}", file=sys.stderr)
        sys.exit(2)
    except SmokeError as e:
        print(f"ddp-smoke-submit: {e}", file=sys.stderr)
        sys.exit(1)
    print(f"verdict: {report['verdict'].upper()} — world_size {report['world_size']}, "
          f"nodes {report['nodes']}, report {report.get('config', {}).get('report_dir')}")
    sys.exit(0)


if __name__ == "__main__":
    main()
