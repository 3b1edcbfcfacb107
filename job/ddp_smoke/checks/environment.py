"""Every rank sees the same software, sits in its own slot, and the world is as promised.

Per rank: torch / CUDA / NCCL / cuDNN / driver / Python versions, the device, and the launcher's
environment (secrets redacted by name and by value shape: ``ddp_smoke.redact``). Asserted:
versions agree across ranks, each (host, local_rank) slot and each GPU is used once, local ranks on a host are 0..n-1, the
world size and node count match what the launcher promised (--expect-world-size,
--expect-nodes), and no two machines call themselves by one hostname (nodes cloned from one
image: NCCL's host hash is the hostname, so a GPU run fails with "Duplicate GPU detected").
Culprit: the odd rank out (the minority value, or both holders of a slot); for a shared
hostname, one rank per machine, each with its address and scheduler node name.
"""
from __future__ import annotations

import collections
import os
import platform
import re

import torch

from .. import redact
from ..model import FAIL, PASS, CheckResult

_ENV_PREFIXES = ("MASTER_", "TORCHELASTIC_", "PET_", "SLURM_", "NCCL_", "GLOO_", "TORCH_",
                 "CUDA_", "OMP_", "LOCAL_", "GROUP_", "ROLE_", "SUBMITIT_", "NVIDIA_",
                 "ENROOT_", "PYXIS_", "APPTAINER_", "SINGULARITY_", "DDP_SMOKE_")
_ENV_NAMES = ("RANK", "WORLD_SIZE", "JOB_COMPLETION_INDEX", "HOSTNAME", "KUBERNETES_SERVICE_HOST")


def launcher_env(environ=os.environ) -> dict[str, str]:
    """The launcher-related variables, secrets redacted by name and by value shape."""
    return {k: redact.env_value(k, v) for k, v in sorted(environ.items())
            if k.startswith(_ENV_PREFIXES) or k in _ENV_NAMES}


def versions() -> dict[str, str | None]:
    """The software stack this rank runs, as strings (None where absent)."""
    cuda = torch.cuda.is_available()
    nccl = torch.cuda.nccl.version() if cuda else None
    return {"torch": torch.__version__, "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl and str(nccl),
            "cudnn": str(torch.backends.cudnn.version()) if cuda else None,
            "driver": _driver_version(), "python": platform.python_version()}


def _driver_version() -> str | None:
    try:
        with open("/proc/driver/nvidia/version") as f:
            m = re.search(r"Kernel Module\s+(\S+)", f.read())
        return m.group(1) if m else None
    except OSError:
        return None


def run(ctx) -> dict:
    return {"versions": versions(), "env": launcher_env(),
            "world_size_env": int(os.environ["WORLD_SIZE"]),
            "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", 1))}


def judge(ev) -> CheckResult:
    obs, ranks = ev.observations, ev.ranks
    machines = _machines(ranks)
    culprits = (_odd_versions(ev) + _duplicate_hostnames(ev, machines)
                + _shared_slots(ev, machines) + _local_rank_gaps(ev, machines))
    hosts = sorted({r["host"] for r in ranks})
    cfg = ev.config
    if cfg["expect_world_size"] is not None and ev.world_size != cfg["expect_world_size"]:
        culprits.append(ev.culprit(None, f"WORLD_SIZE is {ev.world_size}, the launcher promised "
                                         f"{cfg['expect_world_size']}"))
    if cfg["expect_nodes"] is not None and len(set(machines)) != cfg["expect_nodes"]:
        culprits.append(ev.culprit(None, f"ranks span {len(hosts)} host(s) {hosts}, the launcher "
                                         f"promised {cfg['expect_nodes']} nodes"))
    loopback = [r["rank"] for r in ranks if len(hosts) > 1 and
                any(a.startswith("127.") for a in r.get("hostname_addresses", []))]
    notes = [f"# note: on ranks {loopback} the hostname resolves to loopback; set "
             "GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME or fix /etc/hosts"] if loopback else []
    v0 = obs[0]["versions"]
    summary = (f"{ev.world_size} ranks on {len(hosts)} node(s), torch {v0['torch']}"
               + (f", CUDA {v0['cuda']}, NCCL {v0['nccl']}" if v0["nccl"] else ""))
    return CheckResult("environment", FAIL if culprits else PASS,
                       summary=summary if not culprits else f"{len(culprits)} mismatch(es)",
                       culprits=culprits, notes=notes,
                       figures={"hosts": hosts, "versions": [o["versions"] for o in obs],
                                "env": [o["env"] for o in obs]})


def _odd_versions(ev) -> list:
    """The ranks whose version of a component differs from most ranks'; with no majority (two
    nodes, two installs) none is the odd one: the job is named, with each version's ranks."""
    out = []
    for key in ev.observations[0]["versions"]:
        values = [o["versions"][key] for o in ev.observations]
        counts = collections.Counter(values).most_common()
        common, count = counts[0]
        if count == len(values):
            continue
        if count * 2 <= len(values):
            said = "; ".join(f"{v} on ranks {_ranks([r for r, x in enumerate(values) if x == v])}"
                             for v, _ in counts)
            out.append(ev.culprit(None, f"{key} differs with no majority: {said}"))
            continue
        out += [ev.culprit(r, f"{key} {v} here, {common} on {count} of {len(values)} ranks")
                for r, v in enumerate(values) if v != common]
    return out


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" (+{len(ranks) - 8} more)" if len(ranks) > 8
                                             else "")


def _address(r: dict) -> str | None:
    """A rank's machine by address: its interfaces' addresses but loopback, else its route."""
    own = sorted(a for a in (r.get("addresses") or {}).values() if not a.startswith("127."))
    return ",".join(own) or r.get("route_address")


def _machines(ranks: list[dict]) -> list[str]:
    """Each rank's machine: its hostname, and where two machines share one, the hostname
    with the machine's addresses. Ranks of one hostname whose addresses overlap are one
    machine: an interface that came or went between two ranks' looks (a container's bridge
    or veth starting on the node) is no second machine (a rehearsal of the suite named one
    machine twice that way), where two cloned machines never share an address."""
    out = [r["host"] for r in ranks]
    by_host = collections.defaultdict(list)
    for i, r in enumerate(ranks):
        by_host[r["host"]].append(i)
    for host, members in by_host.items():
        groups: list[tuple[set, list]] = []  # (addresses, rank indices) of each machine
        for i in members:
            own = set((_address(ranks[i]) or "?").split(","))
            near = [g for g in groups if g[0] & own]
            groups = [g for g in groups if not g[0] & own] + [
                (own.union(*(g[0] for g in near)), [i] + [j for g in near for j in g[1]])]
        if len(groups) > 1:
            for addresses, ids in groups:
                for i in ids:
                    out[i] = f"{host}@{','.join(sorted(addresses))}"
    return out


def _duplicate_hostnames(ev, machines: list[str]) -> list:
    """One culprit per machine among machines that share a hostname."""
    groups = collections.defaultdict(lambda: collections.defaultdict(list))
    for r, m in zip(ev.ranks, machines):
        if m != r["host"]:
            groups[r["host"]][m].append(r)
    out = []
    for name, by_machine in groups.items():
        said = [_machine_words(rs) for rs in by_machine.values()]
        for i, rs in enumerate(by_machine.values()):
            others = "; ".join(w for j, w in enumerate(said) if j != i)
            out.append(ev.culprit(rs[0]["rank"], (
                f"{len(said)} machines have the same hostname {name!r}: this one {said[i]}, "
                f"the other {others}. Nodes cloned from one image? Give each its own "
                "hostname: NCCL tells hosts apart by hostname (on GPUs such a run fails with "
                "\"Duplicate GPU detected\"), and so do the launchers' host lists")))
    return out


def _machine_words(ranks: list[dict]) -> str:
    r = ranks[0]
    node = r.get("slurm_node") or r.get("k8s_node")
    kind = "Slurm node" if r.get("slurm_node") else "Kubernetes node"
    return (f"at {_address(r)}" + (f" ({kind} {node})" if node else "")
            + f" with rank(s) {', '.join(str(x['rank']) for x in ranks)}")


def _shared_slots(ev, machines: list[str]) -> list:
    out = []
    for label, key in (("slot (host, local_rank)", ("host", "local_rank")),
                       ("GPU", ("host", "gpu_uuid"))):
        seen = collections.defaultdict(list)
        for r, m in zip(ev.ranks, machines):
            if all(r.get(k) is not None for k in key):
                seen[(m, *(r[k] for k in key[1:]))].append(r["rank"])
        out += [ev.culprit(r, f"shares {label} {slot} with ranks {holders}")
                for slot, holders in seen.items() if len(holders) > 1 for r in holders]
    return out


def _local_rank_gaps(ev, machines: list[str]) -> list:
    by_host = collections.defaultdict(list)
    for r, m in zip(ev.ranks, machines):
        by_host[m].append(r["local_rank"])
    return [ev.culprit(None, f"host {h} has local ranks {sorted(lr)}, expected 0..{len(lr) - 1}")
            for h, lr in by_host.items() if sorted(lr) != list(range(len(lr)))]
