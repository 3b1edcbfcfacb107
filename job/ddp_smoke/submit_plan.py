"""What ``ddp_smoke.submit`` would submit: submitit's parameters and the worker's argv, checked
and rendered without sending anything (``ddp-smoke-submit --dry-run`` prints it)."""
from __future__ import annotations

import os
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import task
from .errors import ConfigError

CLUSTERS = ("slurm", "local")
IMAGE_PYTHON = "/opt/ddp-smoke/venv/bin/python"  # the interpreter of the image from docker/
# 8 CPUs per GPU: data loading and NCCL's proxy threads per rank; 8-GPU nodes have >= 64 cores.
GPU_CPUS_PER_PROC = 8
_NODE_LOCAL = ("/tmp", "/var/tmp", "/dev/shm", "/run")


@dataclass
class Plan:
    """What would be submitted: the executor's parameters and the worker's argv (dry run)."""

    cluster: str
    folder: Path
    parameters: dict[str, Any]
    worker_args: list[str] = field(default_factory=list)
    python: str | None = None  # the tasks' interpreter; None: this one (submitit's default)

    @property
    def report_dir(self) -> Path:
        return self.folder / "report"

    def __str__(self) -> str:
        params = " ".join(f"{k}={v!r}" for k, v in sorted(self.parameters.items()))
        python = self.python or "this python"
        return (f"cluster={self.cluster} folder={self.folder}\n{params}\nworker: {python} -m "
                f"ddp_smoke {shlex.join(self.worker_args)}")


def plan(cluster: str = "local", nodes: int = 1, procs_per_node: int = 2,
         gpus_per_node: int = 0, partition: str | None = None, account: str | None = None,
         qos: str | None = None, time_min: int = 10, cpus_per_proc: int | None = None,
         container_image: str | None = None, folder: str | os.PathLike | None = None,
         worker_args: list[str] | None = None, allow_local_folder: bool = False,
         container_python: str = IMAGE_PYTHON, python: str | None = None,
         exclusive: bool | None = None) -> Plan:
    """Render the submission without sending it (pure, apart from resolving the folder).

    Args:
        cluster: ``slurm`` or ``local`` (this machine, subprocesses).
        nodes: nodes to allocate; ``local`` allows 1.
        procs_per_node: processes (= Slurm tasks, = GPUs on GPU nodes) per node.
        gpus_per_node: GPUs to request per node; 0 on CPU clusters.
        partition, account, qos: Slurm placement, passed as given.
        time_min: the job's time limit in Slurm, in minutes.
        cpus_per_proc: CPUs per task; default 1, or GPU_CPUS_PER_PROC on GPU runs.
        container_image: run the tasks in this image through pyxis (``srun --container-image``);
            the image must hold this package and this side's submitit version (the image from
            docker/ does when built with the same version).
        container_python: the image's interpreter, which the tasks then run.
        python: the tasks' interpreter without a container (default: this one).
        exclusive: whole nodes; default True on GPU runs (with all their memory), else False.
        folder: submitit's folder, shared with the nodes; default reports/submitit/<time>.
        worker_args: options for the worker (``--checks``, ``--timeout`` …).
        allow_local_folder: accept a node-local folder for Slurm (single-node clusters).

    Raises:
        ConfigError: for bad values, with the parameter and what was expected.
    """
    if cluster not in CLUSTERS:
        raise ConfigError(f"cluster {cluster!r}: expected one of {', '.join(CLUSTERS)}")
    if cpus_per_proc is None:
        cpus_per_proc = GPU_CPUS_PER_PROC if gpus_per_node else 1
    for name, value, lo in (("nodes", nodes, 1), ("procs_per_node", procs_per_node, 1),
                            ("time_min", time_min, 1), ("cpus_per_proc", cpus_per_proc, 1),
                            ("gpus_per_node", gpus_per_node, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < lo:
            raise ConfigError(f"{name}={value!r}: expected an integer >= {lo}")
    if cluster == "local" and nodes != 1:
        raise ConfigError(f"nodes={nodes}: the local cluster has one node")
    base = Path(folder) if folder else Path("reports", "submitit", time.strftime("%Y%m%d-%H%M%S"))
    base = base.absolute()
    if cluster == "slurm" and not allow_local_folder and str(base).startswith(_NODE_LOCAL):
        raise ConfigError(f"folder {base} is node-local: the nodes cannot read submitit's "
                          "pickles there; give a folder on a shared filesystem "
                          "(or --allow-local-folder / allow_local_folder=True on a "
                          "single-node cluster)")
    params: dict[str, Any] = {"nodes": nodes, "tasks_per_node": procs_per_node,
                              "cpus_per_task": cpus_per_proc, "timeout_min": time_min,
                              "name": "ddp-smoke"}
    if gpus_per_node:
        params["gpus_per_node"] = gpus_per_node
    if cluster == "slurm":
        extra = {"slurm_partition": partition, "slurm_account": account,
                 "slurm_qos": qos}
        params.update({k: v for k, v in extra.items() if v})
        if exclusive if exclusive is not None else bool(gpus_per_node):
            # Whole nodes, and all their memory (Slurm's --mem=0): the default share of a
            # node's memory per CPU is a site setting, often far below what 8 GPUs need.
            params.update(slurm_exclusive=True, slurm_mem="0")
        if container_image:  # pyxis: the folder must be visible inside the container too
            params["slurm_srun_args"] = [f"--container-image={container_image}",
                                         f"--container-mounts={base}:{base}"]
            python = container_python
    args = list(worker_args or [])
    if container_image:  # the task checks that the image's submitit is this side's
        args = ["--submitit-version", task.submitit_version()] + args
    return Plan(cluster, base, params, args + ["--report-dir", str(base / "report")], python)
