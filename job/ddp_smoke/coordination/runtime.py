"""Process-group set-up in one place: launch env, backend, device binding, store, identity.

Works under torchrun (the agent hosts the TCPStore and says so with
``TORCHELASTIC_USE_AGENT_STORE=True``) and under any launcher that exports the plain env
contract, such as submitit's ``TorchDistributedEnvironment`` (rank 0 hosts the store).
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import socket

import torch
import torch.distributed as dist

from . import identity, keys, records
from .reach import route_address
from ..config.launchenv import LaunchEnv
from ..errors import ConfigError
from ..interfaces import ipv4_addresses


def share_run_id(env: LaunchEnv, tell, read) -> LaunchEnv:
    """Every rank's run id: rank 0 posts its own (``tell(key, value)``), the others read it
    (``read(key)``, blocking until rank 0 wrote it; see :mod:`ddp_smoke.config.launchenv`).
    Call once every rank has connected. Always one round, even for a launcher-given id:
    ranks started differently (one node through the image's entrypoint, which sets
    DDP_SMOKE_RUN_ID, another by a plain `torchrun` command) must not each decide on their
    own whether to wait for rank 0's."""
    if env.rank == 0:
        tell(keys.RUN_ID, env.run_id)
        return env
    return dataclasses.replace(env, run_id=read(keys.RUN_ID).decode())


def pick_backend(requested: str) -> str:
    """nccl when CUDA is usable, gloo otherwise; an explicit choice is honoured as given."""
    if requested != "auto":
        if requested == "nccl" and not torch.cuda.is_available():
            raise ConfigError("backend 'nccl' requested but CUDA is not available on this node; "
                              "use --backend gloo or auto")
        return requested
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def agree_backend(requested: str, pick: str, cuda_ranks: int,
                  world_size: int) -> tuple[str, str | None]:
    """The backend every rank runs, from how many ranks picked NCCL; and the problem, if any.

    With ``auto`` every rank must pick the same: when some ranks have usable CUDA and others
    do not, NCCL would hang in its rendezvous on the GPU ranks while the others run gloo. The
    problem text names the odd ranks' side with a ``{host}`` placeholder for their host.
    """
    if requested != "auto" or cuda_ranks in (0, world_size):
        return pick, None
    return "nccl", (f"no usable CUDA on {{host}} (torch.cuda.is_available() is False) while "
                    f"{cuda_ranks} of {world_size} ranks have it: backend auto needs every "
                    "node alike (check the driver and CUDA_VISIBLE_DEVICES there)")


class DeviceError(RuntimeError):
    """This rank cannot have the GPU its local rank asks for."""


def hostname() -> str:
    return socket.gethostname()


def bind_device(backend: str, local_rank: int) -> torch.device:
    """One GPU per process: LOCAL_RANK's GPU, or GPU 0 when the launcher masked all but one."""
    if backend != "nccl":
        return torch.device("cpu")
    count = torch.cuda.device_count()
    index = 0 if count == 1 else local_rank
    if index >= count:
        raise DeviceError(f"only {count} GPUs visible on {hostname()} for LOCAL_RANK="
                          f"{local_rank} (CUDA_VISIBLE_DEVICES="
                          f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}): nproc-per-node must "
                          "not exceed the GPUs per node")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def connect_store(env: LaunchEnv, timeout_s: float, may_host: bool = True) -> dist.Store:
    """A TCPStore client on MASTER_ADDR:MASTER_PORT, or its server.

    Rank 0 hosts the store when no torchrun agent does (submitit, plain env launchers), on
    its first connection only (``may_host``); later connections are clients of it. With
    DDP_SMOKE_STORE every rank is a client of the launcher's store host, which no rank's
    death takes down (:mod:`ddp_smoke.store_host`).
    """
    if env.store is not None:
        return dist.TCPStore(env.store[0], env.store[1], env.world_size, False,
                             datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
    is_master = may_host and env.rank == 0 and not env.agent_store
    return dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master,
                         datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def process_group_store(env: LaunchEnv, timeout_s: float) -> dist.Store:
    """The process group's own store connection: the launcher's rendezvous store (torchrun's
    agent's, else rank 0's at MASTER_ADDR:MASTER_PORT), where a plain ``init_process_group``
    would go. Never the kit's store host: its one connection per rank is the kit's, and the
    backend's set-up blocks on its store for as long as a peer is missing."""
    hosts = env.rank == 0 and not env.agent_store and env.store is not None  # else rank 0's
    # kit connection already serves MASTER_PORT (connect_store)
    return dist.TCPStore(env.master_addr, env.master_port, env.world_size, hosts,
                         datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def nccl_log_env(backend: str, report_dir: str, environ=os.environ) -> None:
    """With nccl, NCCL's INFO log of its INIT and NET subsystems into REPORT_DIR/nccl/, one file
    per process, for the transport check; each variable only where the user has not set it.

    Must run before the first communicator exists: NCCL reads these once, at its first init.
    """
    if backend != "nccl":
        return
    folder = os.path.join(os.path.abspath(report_dir), "nccl")
    os.makedirs(folder, exist_ok=True)  # per node: a report folder need not be shared
    environ.setdefault("NCCL_DEBUG", "INFO")
    environ.setdefault("NCCL_DEBUG_SUBSYS", "INIT,NET")
    environ.setdefault("NCCL_DEBUG_FILE", os.path.join(folder, "%h.%p.log"))


def init_process_group(env: LaunchEnv, backend: str, device: torch.device,
                       store: dist.Store, timeout_s: float) -> None:
    """Create the default group on a prefix of ``store`` with an explicit, short timeout."""
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=env.rank,
                            world_size=env.world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), **kwargs)


def store_route(env) -> tuple[str | None, str | None]:
    """The address and interface of this node's route to the coordination store: the network
    the run already uses (each is None when unknown)."""
    host, port = env.store or (env.master_addr, env.master_port)
    addr = route_address(host, port)
    return addr, next((n for n, a in ipv4_addresses().items() if a == addr), None)


def hostname_addresses(host: str) -> list[str]:
    """What this host's own name resolves to; 127.x here is a classic multi-node trap."""
    try:
        return sorted({a[4][0] for a in socket.getaddrinfo(host, None, socket.AF_INET)})
    except OSError:
        return []


def gpu_facts(device: torch.device) -> dict:
    """Name, PCI bus id and UUID of this rank's GPU; empty on CPU."""
    if device.type != "cuda":
        return {}
    props = torch.cuda.get_device_properties(device)
    return {"gpu_name": props.name, "gpu_bus_id": getattr(props, "pci_bus_id", None),
            "gpu_uuid": str(getattr(props, "uuid", "")) or None,
            "gpu_memory_bytes": props.total_memory}


def rank_record(env: LaunchEnv, device: torch.device) -> dict:
    """This rank's identity for the report's ``ranks`` list (:class:`.records.Identity`)."""
    host = socket.gethostname()
    return records.wire(records.Identity(
        rank=env.rank, local_rank=env.local_rank, group_rank=env.group_rank, host=host,
        pid=os.getpid(), device=str(device),
        route_address=route_address(env.master_addr, env.master_port),
        hostname_addresses=hostname_addresses(host), addresses=ipv4_addresses(),
        **gpu_facts(device), **launcher_node(), identity=identity.collect(device)))


def launcher_node(environ=os.environ) -> dict:
    """The launcher's name for this node, where it differs from the hostname: Slurm's NodeName
    (what scontrol drains) and, in a pod, the Kubernetes node (NODE_NAME from spec.nodeName)."""
    in_pod = "KUBERNETES_SERVICE_HOST" in environ  # NODE_NAME alone is too common a name
    names = {"slurm_node": environ.get("SLURMD_NODENAME"),
             "k8s_node": environ.get("NODE_NAME") if in_pod else None}
    return {k: v for k, v in names.items() if v}
