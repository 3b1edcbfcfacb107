"""What a check sees: :class:`Context` on every rank, :class:`Evidence` on rank 0."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from ..config.faults import Injector
from ..config.launchenv import LaunchEnv
from ..coordination import stragglers
from ..model import Culprit
from .health.readers import cgroup


@dataclass
class Context:
    """What a check's ``run(ctx)`` may use on its rank."""

    env: LaunchEnv
    backend: str
    device: torch.device
    config: dict[str, Any]
    faults: Injector
    report_dir: str
    storage_dir: str

    rank = property(lambda self: self.env.rank)
    world_size = property(lambda self: self.env.world_size)
    local_rank = property(lambda self: self.env.local_rank)
    timeout_s = property(lambda self: float(self.config["timeout"]))

    def section(self, name: str) -> dict[str, Any]:
        """The check's own options (its section in defaults.yaml)."""
        return self.config.get(name, {})

    def held_s(self) -> float | None:
        """On a CPU rank, the seconds a CPU quota has held it back so far (None on a GPU)."""
        return cgroup.held_s() if self.device.type == "cpu" else None

    def cpu_pace(self, held_before: float | None) -> dict | None:
        """Posted beside a check's waits on a CPU rank (coordination/stragglers.py): whether
        this node's ranks share its cores (as many rank threads as usable cores, or more), the
        seconds a CPU quota held this rank back since ``held_before`` (:meth:`held_s`), and
        what rank 0 needs to count the ranks of other launcher nodes on the same kernel (the
        boot id, this rank's threads, its usable cores): namespaces or containers as nodes of
        one machine share its cores too."""
        if self.device.type != "cpu":
            return None
        held, threads, cores = self.held_s(), torch.get_num_threads(), usable_cores()
        return {"shared": self.env.local_world_size * threads >= cores,
                "held_s": None if held is None or held_before is None else
                round(held - held_before, 3),
                "kernel": cgroup.boot_id(), "threads": threads, "cores": cores}


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask: a container's or Slurm's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def shared_hosts(ev) -> list:
    """Hosts whose ranks share cores: as many rank threads there (each observation's
    ``threads``) as the host's usable cores (``cores``) or more. With every core taken by a
    rank, anything else on the host (the launcher, the store host, gloo's threads, a browser
    on a laptop) takes its time from some rank: measured, a healthy 2-rank run on 2 cores in
    CI at a pace of 0.59."""
    return sorted(stragglers.oversubscribed((ev.host(r), o["threads"], o["cores"])
                                            for r, o in enumerate(ev.observations)), key=str)


def pace_margin(ev, cpu: bool) -> tuple[float, list]:
    """``(straggler margin, hosts whose ranks share cores)`` for a check that judges ranks'
    pace (compute, training): the ``compute`` section's margin for GPUs, for CPU ranks with
    cores of their own, or for CPU ranks sharing their host's cores."""
    cfg, shared = ev.config["compute"], shared_hosts(ev) if cpu else []
    return cfg["straggler_margin_cpu_shared" if shared else
               "straggler_margin_cpu" if cpu else "straggler_margin"], shared


@dataclass
class Evidence:
    """What a check's ``judge(ev)`` sees on rank 0: every rank's observation, by rank."""

    name: str
    observations: list[dict[str, Any]]
    ranks: list[dict[str, Any]]
    config: dict[str, Any]

    world_size = property(lambda self: len(self.observations))

    def host(self, rank: int) -> str | None:
        return self.ranks[rank].get("host") if rank < len(self.ranks) else None

    def culprit(self, rank: int | None, reason: str) -> Culprit:
        """A culprit with the host filled in from the rank's identity."""
        return Culprit(rank, None if rank is None else self.host(rank), reason)

    def link_culprit(self, a: int, b: int, reason: str) -> Culprit:
        """The link between ranks ``a`` and ``b``: both ends named, neither convicted."""
        return Culprit(None, None, reason, ranks=[a, b], hosts=[self.host(a), self.host(b)])

    def section(self, name: str | None = None) -> dict[str, Any]:
        return self.config.get(name or self.name, {})
