"""What the launcher told this process, read and checked once, without importing torch.

The variables read (set by torchrun, submitit's ``TorchDistributedEnvironment``, Slurm, the
Kubernetes manifests): RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (required);
LOCAL_WORLD_SIZE, GROUP_RANK (else SLURM_NODEID), TORCHELASTIC_RUN_ID,
TORCHELASTIC_USE_AGENT_STORE, TORCHELASTIC_RESTART_COUNT, SUBMITIT_FOLDER, SLURM_JOB_ID,
SLURM_STEP_ID, SLURM_RESTART_COUNT, DDP_SMOKE_RUN_ID and DDP_SMOKE_STORE (``host:port`` of a
store host process, :mod:`ddp_smoke.store_host`, that then holds the coordination
store instead of the torchrun agent or rank 0). A malformed one is a ConfigError
(one line, exit 2) on every rank, before any rank connects.

The run id
----------
Every report carries the id of the run that wrote it, and a report whose id is not the run's
own is never read as its verdict. The id is also a folder name (``reports/<run id>``, the
storage check's ``ddp-smoke-<run id>``), so it holds only ``[A-Za-z0-9._-]``, 1–128 chars.

* ``DDP_SMOKE_RUN_ID``, when the launcher sets it, is the id, as given. A launcher sets it
  when it knows an id unique per run and wants to find the report by it: the submitit path
  sets ``submitit-<job id>-<restart count>``; an sbatch script
  ``slurm-${SLURM_JOB_ID}-${SLURM_RESTART_COUNT:-0}``; a Kubernetes Job the job's uid (label
  ``batch.kubernetes.io/controller-uid`` through the downward API).
* Otherwise the launcher's own ids are not unique per run: ``--rdzv-id`` is often a fixed
  name (the Kubernetes manifests use the job's name), a Slurm job id repeats when the job is
  requeued or when an allocation runs the kit twice, and torchrun's static rendezvous and
  plain-env launches give none at all (``TORCHELASTIC_RUN_ID=none``). The id is then
  ``<launcher part>-<random>``: the launcher part says where it ran
  (``slurm-<job>.<step>-r<restart>``, ``torchrun-<rdzv id>``, ``local``), and the random part
  is drawn by rank 0 before it connects and handed to the other ranks through the store
  (:func:`ddp_smoke.coordination.runtime.share_run_id`). Ranks cannot agree on a random value without
  talking, and rank 0 needs the id before it connects (the default report folder is named
  after it), so rank 0 draws it and the others learn it once every rank has connected.
"""
from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass

from ..errors import ConfigError

_REQUIRED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_HINT = "launch under torchrun, e.g. `torchrun --standalone --nproc-per-node=2 -m ddp_smoke`"
RUN_ID_CHARS = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
NODE_RUN_PREFIX = "node-check-"  # node-check's run ids: node-check-<node>-<UTC time>-<hex>
PENDING = ""  # a non-zero rank's run id until rank 0's arrives through the store
MAX_WORLD = 1 << 24


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher told this process, read once from the environment."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    group_rank: int
    master_addr: str
    master_port: int
    agent_store: bool
    launcher: str
    run_id: str
    run_id_shared: bool = False  # True: the id came from the launcher (rank 0 still posts it)
    store: tuple[str, int] | None = None  # DDP_SMOKE_STORE: a store host outlives every rank

    @property
    def node_ranks(self) -> range:
        """The ranks of this rank's node, as torchrun numbers them (consecutive, from
        ``rank - local_rank``)."""
        first = self.rank - self.local_rank
        return range(first, first + self.local_world_size)

    @property
    def store_address(self) -> str:
        """``host:port`` of the coordination store, wherever it is hosted."""
        host, port = self.store or (self.master_addr, self.master_port)
        return f"{host}:{port}"

    @classmethod
    def from_environ(cls, environ=os.environ) -> "LaunchEnv":
        """Read the env contract; a missing or malformed variable is a ConfigError (exit 2)."""
        missing = [k for k in _REQUIRED if k not in environ]
        if missing:
            raise ConfigError(f"{', '.join(missing)} not set: not started by a launcher; {_HINT}")
        world = _int(environ, "WORLD_SIZE", 1, MAX_WORLD)
        rank = _int(environ, "RANK", 0, world - 1)
        local_world = _int(environ, "LOCAL_WORLD_SIZE", 1, world, default=1)
        local_rank = _int(environ, "LOCAL_RANK", 0, local_world - 1)
        group_key = "GROUP_RANK" if "GROUP_RANK" in environ else "SLURM_NODEID"
        group_rank = _int(environ, group_key, 0, world - 1, default=0)
        port = _int(environ, "MASTER_PORT", 1, 65535)
        addr = environ["MASTER_ADDR"]
        if not addr or any(c.isspace() or c in "/\0" for c in addr):
            raise ConfigError(f"MASTER_ADDR={addr!r}: expected a host name or address; {_HINT}")
        _int(environ, "TORCHELASTIC_RESTART_COUNT", 0, 1 << 31, default=0)
        launcher = ("torchrun" if "TORCHELASTIC_RUN_ID" in environ else
                    "submitit" if "SUBMITIT_FOLDER" in environ else "env")
        rid, shared = run_id(environ, rank)
        return cls(rank=rank, world_size=world, local_rank=local_rank,
                   local_world_size=local_world, group_rank=group_rank, master_addr=addr,
                   master_port=port,
                   agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
                   launcher=launcher, run_id=rid, run_id_shared=shared,
                   store=store_address(environ))


def store_address(environ=os.environ) -> tuple[str, int] | None:
    """DDP_SMOKE_STORE as ``(host, port)``, None when unset or empty."""
    raw = environ.get("DDP_SMOKE_STORE", "")
    if not raw:
        return None
    host, _, port = raw.rpartition(":")
    if not host or any(c.isspace() or c in "/\0" for c in host) or not port.isdigit() \
            or not 1 <= int(port) <= 65535:
        raise ConfigError(f"DDP_SMOKE_STORE={raw!r}: expected HOST:PORT of the store host "
                          "(python -m ddp_smoke.store_host prints it)")
    return host, int(port)


def _int(environ, key: str, lo: int, hi: int, default: int | None = None) -> int:
    raw = environ.get(key)
    if raw is None and default is not None:
        return default
    try:
        value = int(raw)
    except (TypeError, ValueError):
        value = None
    if value is None or not lo <= value <= hi:
        raise ConfigError(f"{key}={raw!r}: expected an integer in {lo}..{hi} "
                          f"(set by the launcher); {_HINT}")
    return value


def run_id(environ=os.environ, rank: int = 0) -> tuple[str, bool]:
    """``(id, shared)``: the launcher's unique id (shared=True), else a launcher part plus
    rank 0's random part (shared=False: the other ranks learn it through the store)."""
    given = environ.get("DDP_SMOKE_RUN_ID")
    if given is not None:
        return _safe("DDP_SMOKE_RUN_ID", given), True
    if environ.get("SLURM_JOB_ID"):
        restart = _int(environ, "SLURM_RESTART_COUNT", 0, 1 << 31, default=0)
        step = environ.get("SLURM_STEP_ID", "batch")
        part = _safe("SLURM_JOB_ID/SLURM_STEP_ID",
                     f"slurm-{environ['SLURM_JOB_ID']}.{step}-r{restart}")
    elif environ.get("TORCHELASTIC_RUN_ID", "none") != "none":
        part = "torchrun-" + _safe("TORCHELASTIC_RUN_ID", environ["TORCHELASTIC_RUN_ID"])[:64]
    else:
        part = "local"
    return (f"{part}-{secrets.token_hex(4)}" if rank == 0 else PENDING), False


def _safe(key: str, value: str) -> str:
    if not RUN_ID_CHARS.match(value) or not value.strip("."):  # "." and ".." are not folders
        raise ConfigError(f"{key}={value!r}: expected 1-128 characters from [A-Za-z0-9._-] "
                          "(the run id names the report and storage folders)")
    return value
