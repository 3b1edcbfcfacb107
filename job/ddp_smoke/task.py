"""What each submitit task runs (``ddp_smoke.submit`` submits :func:`run`): the environment
contract, the node's preflight, the store host on task 0's node, then the worker in-process."""
from __future__ import annotations

import os
import sys
from typing import Any

from . import preflight
from .config.args import parse_config
from .coordination import hosting, store

STORE_WAIT_S = 300.0  # a task waits this long for task 0's store host (nodes start unevenly)
PREFLIGHT_TIMEOUT_S = 30.0  # a node's preflight (torch import, CUDA initialisation)


def submitit_version() -> str:
    import submitit
    return submitit.__version__


def run(worker_args: list[str], gpus: bool, store_max_s: float = 3600.0,
        secret: str | None = None) -> Any:
    """What each submitit task runs: export the env contract, then the worker, in-process.
    ``secret``: the run's signing secret (``DDP_SMOKE_SECRET``), drawn by the submitting side."""
    import submitit

    if worker_args[:1] == ["--submitit-version"]:
        wanted, worker_args = worker_args[1], worker_args[2:]
        if submitit.__version__ != wanted:
            raise RuntimeError(f"submitit {submitit.__version__} in the container, {wanted} on "
                               "the submitting side: install the same version in both (the "
                               "image pickles and unpickles submitit's objects)")
    submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=gpus)
    if secret:
        os.environ["DDP_SMOKE_SECRET"] = secret
    run_id = run_id_of(submitit.JobEnvironment().job_id,
                       os.environ.get("SLURM_RESTART_COUNT", "0"))
    os.environ["DDP_SMOKE_RUN_ID"] = run_id
    report_dir = worker_args[worker_args.index("--report-dir") + 1]
    try:
        _preflight(worker_args, gpus)
    except RuntimeError:  # no store host then: the other tasks stop at once (no run to join)
        if os.environ["RANK"] == "0":
            hosting.publish_address(hosting.address_file(report_dir, run_id), "none")
        raise
    _store_host(report_dir, run_id, store_max_s)
    store.quiet_slices()  # (where submitit has not imported torch already)
    from . import harness  # late: torch only in the task, not on the submitting side

    code = harness.run(parse_config(worker_args))
    return code


def _store_host(report_dir: str, run_id: str, max_s: float) -> None:
    """The coordination store in a process of its own on rank 0's node, so that rank 0's
    death does not take it down (DDP_SMOKE_STORE): task 0 starts it and leaves its address
    in the (shared) report folder; the other tasks wait for that file."""
    path = hosting.address_file(report_dir, run_id)
    if os.environ["RANK"] == "0":
        address = hosting.start_detached(os.environ["MASTER_ADDR"], report_dir, max_s)
        hosting.publish_address(path, address)
    else:
        address = hosting.await_address(path, STORE_WAIT_S)
    if address == "none":  # a node failed its preflight (task 0's says which): no rank 0
        raise RuntimeError("a node failed its preflight (task 0's record says which): this "
                           "task stops without a run to join")
    os.environ[hosting.ENV] = address


def _preflight(worker_args: list[str], gpus: bool) -> None:
    """Preflight (ddp_smoke/preflight.py) in the first task of each node, before the worker:
    a node that cannot run it fails its task in seconds with the reason, and leaves its record
    beside the report for :func:`submit`. Several nodes: each says hello to task 0's, which
    listens meanwhile on MASTER_PORT + 1 (not MASTER_PORT: the process group's store binds it
    right after) and waits for all: a node that cannot reach it (a firewall on high ports) or
    whose path to it drops large packets, where rank 0's store lives, is named in seconds,
    before the run would stall on its records."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    import submitit
    nodes = submitit.JobEnvironment().num_nodes
    hello = [] if nodes < 2 else [
        "--rdzv", f"{os.environ['MASTER_ADDR']}:{int(os.environ['MASTER_PORT']) + 1}",
        "--nodes", str(nodes), *(["--serve"] if os.environ["RANK"] == "0" else [])]
    args = preflight._parser().parse_args([
        "--report-dir", worker_args[worker_args.index("--report-dir") + 1],
        "--gpus", os.environ.get("SLURM_NTASKS_PER_NODE", "1") if gpus else "0",
        "--timeout", str(PREFLIGHT_TIMEOUT_S), *hello])
    record = preflight.run(args)
    print(preflight.line(record), file=sys.stderr, flush=True)
    if not record["ok"]:
        if all(c["ok"] or c["name"] == "joined" for c in record["checks"]):
            # task 0's own node is fine; the others' failures are theirs (not a FAIL line)
            raise RuntimeError(f"task 0's node passed its preflight, another did not: "
                               f"{record['reason']}: no run to start")
        raise RuntimeError(preflight.line(record))


def run_id_of(job_id: str, restart: str | int = 0) -> str:
    """The run id a task of submitit job ``job_id`` gives the worker."""
    return f"submitit-{job_id}-{restart}"
