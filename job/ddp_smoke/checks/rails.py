"""Rails: the chain rank → host → GPU → NIC, and whether each rank sends on the NIC nearest it.

A rail-optimized node has one NIC per GPU, each behind the same PCIe switch as its GPU; NCCL
picks each GPU's NIC from the node's topology. What goes wrong is the pairing: ``NCCL_IB_HCA``
listing the NICs in another order, ``NCCL_CROSS_NIC`` letting a ring leave through another
rail, a topology file of another machine, a NIC on the wrong NUMA node: GPU 3's traffic then
crosses the CPU interconnect to NIC 5, and all-reduce loses bandwidth with no error. This check
reads, on every rank, with no traffic of its own:

* the network device the rank sends on (:mod:`._rails`: NCCL's own log, or the interface gloo
  was given) and, from sysfs (:mod:`._topology`), the PCI address and NUMA node of that NIC,
  of the rank's GPU, and of the cores the rank may run on (its CPU affinity);
* the other NICs it could have used: under NCCL those in its NIC list and those the ``rails``
  setting names (a rail NCCL does not list: its port down, or left out by ``NCCL_IB_HCA``);
  under gloo the ``rails`` setting's interfaces.

Pass criterion, per rank: its NIC is as near its GPU as any (PIX, PXB, PHB, NODE, SYS in the
words of ``nvidia-smi topo -m``), or, on a CPU rank, on a NUMA node of its cores when one of
the candidates is; and, with a ``rails`` setting under NCCL, the NIC NCCL chose is the one the
setting names for the rank's local rank. Culprits: each rank that misses, named with its host,
GPU and rail, the nearer NIC, and the fix (``NCCL_IB_HCA``, ``NCCL_CROSS_NIC=0``, the site's
topology file ``NCCL_TOPO_FILE``; on CPU ranks the NUMA binding or the order of ``rails``).
Figures: the chain of every rank (``ranks``). Skips on one node (no rank sends over a network)
and when no rank's NIC could be placed (virtual interfaces, no sysfs): never a pass on no data.
"""
from __future__ import annotations

import os

import torch

from ..coordination import identity, progress, rails as rail_binding
from ..model import FAIL, PASS, SKIP, CheckResult, Culprit
from . import _nccl_log as nccl_log, _rails, _topology as topology
from .health.readers import sysfs as hca_ports

_WORDS = {"PIX": "behind one PCIe switch", "PXB": "across several PCIe switches",
          "PHB": "through the CPU's PCIe host bridge",
          "NODE": "across host bridges of one NUMA node",
          "SYS": "on another NUMA node, across the CPU interconnect"}


def run(ctx) -> dict:
    """This rank's rail and where its GPU, cores and NICs sit."""
    if ctx.backend == "nccl":
        # NCCL names its NICs when a communicator connects: make sure one has, even alone.
        progress.all_reduce(torch.ones(1, device=ctx.device))
    rail = _rails.mine(ctx)
    setting = ctx.config.get("rails")
    wanted = rail_binding.interface(setting, ctx.local_rank) if setting else None
    bus = _bus_id(ctx.device)
    if ctx.backend == "nccl":
        facts = nccl_log.read_own_log()[0]
        listed = [n["device"] for t in nccl_log.nics(facts["devices"]).values()
                  for n in t.values()]
        candidates = nccl_candidates(topology.rdma_devices("/"), listed, setting)
    else:
        candidates = {d: True for d in (setting or [])}
    return {"rail": rail, "wanted": wanted,
            **locate("/", rail.get("sent_on") or rail.get("device"), bus,
                     set(os.sched_getaffinity(0)), candidates)}


def nccl_candidates(devices: list[str], listed: list[str], setting: list | None) -> dict:
    """The NICs a GPU could have used under NCCL, each with whether NCCL lists it: those NCCL
    lists, and those the ``rails`` setting names that it does not (a rail whose port is down,
    or that NCCL_IB_HCA leaves out). A NIC neither names (storage, management) is no rail."""
    rails = {str(d).split(":")[0] for d in setting or []}
    return {d: d in listed for d in devices if d in listed or d in rails}


def _bus_id(device) -> str | None:
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    ids = [getattr(props, k, None) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    return identity.pci_bus_id(*ids) if all(isinstance(i, int) for i in ids) else None


def locate(root: str, nic_name: str | None, gpu_bus: str | None, cores: set[int],
           candidates: dict[str, bool]) -> dict:
    """Where the rank's NIC, GPU and cores sit under ``root``, and every candidate NIC's link
    to them (``listed``: whether the backend could use it, e.g. in NCCL's NIC list)."""
    gpu = topology.gpu(root, gpu_bus) if gpu_bus else None
    cores_numa = topology.numa_of_cpus(root, cores)
    nic = topology.nic(root, nic_name) if nic_name else None
    ports = (hca_ports.read_ports(root) or {}) if candidates else {}
    placed = {}
    for name, listed in candidates.items():
        got = topology.nic(root, name)
        if got:  # an RDMA device's port states: why NCCL may not list it
            states = {k.partition("/")[2]: p["state"] for k, p in ports.items()
                      if k.partition("/")[0] == name}
            placed[name] = {**got, "listed": listed, "ports": states}
    return {"gpu": gpu and {**gpu, "bus_id": gpu_bus}, "cores_numa": cores_numa,
            "cores": _ranges(cores), "nic": nic and {**nic, "device": nic_name},
            "candidates": placed}


def _ranges(cores: set[int]) -> str:
    """{0, 1, 2, 5} → "0-2,5"."""
    out, run = [], []
    for c in sorted(cores):
        if run and c != run[-1] + 1:
            out.append(run)
            run = []
        run.append(c)
    if run:
        out.append(run)
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in out)


# -- judging (rank 0, pure) ----------------------------------------------------------------

def judge(ev) -> CheckResult:
    """The chain of every rank; a culprit per rank whose NIC is farther than a candidate."""
    obs = ev.observations
    hosts = [ev.host(r) for r in range(len(obs))]
    chain = [_chain(r, hosts[r], o) for r, o in enumerate(obs)]
    figures = {"ranks": chain, "nodes": len(set(hosts))}
    if figures["nodes"] < 2:
        return CheckResult("rails", SKIP, figures=figures,
                           summary="one node: no rank sends over a network")
    culprits = [c for r, o in enumerate(obs) for c in _findings(ev, r, o, chain[r])]
    placed = [c for c in chain if c["link"]]
    if not placed and not culprits:
        why = sorted({c["not_measured"] for c in chain if c["not_measured"]})
        return CheckResult("rails", SKIP, figures=figures,
                           summary=f"not measured: {'; '.join(why) or 'nothing to place'}")
    links = sorted({c["link"] for c in placed})
    summary = (f"{len(placed)} of {len(chain)} ranks placed ({', '.join(links)})"
               + (f"; {len(culprits)} rank(s) send on a farther NIC than they could"
                  if culprits else "; each sends on a NIC as near as any"))
    return CheckResult("rails", FAIL if culprits else PASS, summary=summary, figures=figures,
                       culprits=culprits)


def _chain(rank: int, host, o: dict) -> dict:
    """One rank's rank → host → GPU → NIC record, with the link between GPU (or cores) and NIC."""
    rail, nic, gpu = o["rail"], o.get("nic"), o.get("gpu")
    out = {"rank": rank, "host": host, "rail": rail.get("index"), "device": rail.get("device"),
           "port": rail.get("port"), "sent_on": rail.get("sent_on"), "source": rail.get("source"),
           "gpu": gpu and {k: gpu.get(k) for k in ("bus_id", "numa_node")},
           "cores": o.get("cores"), "cores_numa": o.get("cores_numa"),
           "nic": nic and {k: nic.get(k) for k in ("device", "pci", "numa_node", "kind")},
           "link": None, "not_measured": None}
    out["link"], out["not_measured"] = _link(rail, nic, gpu, o.get("cores_numa") or [])
    return out


def _link(rail: dict, nic: dict | None, gpu: dict | None, cores_numa: list) -> tuple:
    if not (rail.get("sent_on") or rail.get("device")):
        return None, rail.get("source") or "no network device"
    if nic is None:
        return None, (f"{rail.get('sent_on') or rail.get('device')} has no PCI device in sysfs "
                      "(a virtual interface)")
    if gpu:
        return topology.link(gpu, nic), None
    if nic["numa_node"] is None or not cores_numa:
        return None, "no NUMA node in sysfs for the NIC or the cores"
    return ("local" if nic["numa_node"] in cores_numa else "remote"), None


def _findings(ev, rank: int, o: dict, chain: dict) -> list:
    rail = o["rail"]
    tag = {"index": rail.get("index"), "device": rail.get("device"), "port": rail.get("port")}
    out = []
    sent = rail.get("sent_on") or rail.get("device")
    if o.get("wanted") and sent and rail.get("source") == "NCCL log" and \
            o["wanted"] not in (sent, f"{sent}:{rail.get('port')}"):
        out.append(ev.culprit(rank, (
            f"{_who(o, rank)} sends on {sent}; the site's rails name {o['wanted']} for local "
            f"rank {rail.get('index')}: set NCCL_IB_HCA to list the rails in that order, keep "
            "NCCL_CROSS_NIC=0, or give NCCL the site's topology file (NCCL_TOPO_FILE)")))
    nearer = _nearer(o, chain)
    if nearer:
        out.append(ev.culprit(rank, nearer))
    return [Culprit(c.rank, c.host, c.reason, rail=tag) for c in out]


def _why_unlisted(states: dict) -> str:
    """Why NCCL leaves a rail's NIC out, from its port states (the health check's reader)."""
    shown = ", ".join(f"port {p} {s}" for p, s in sorted(states.items()))
    if states and not any("ACTIVE" in (s or "") for s in states.values()):
        return f"its port is not active ({shown}): the health check names it; reseat or replace"
    if states:
        return f"NCCL_IB_HCA leaves it out ({shown}): list it for this rail"
    return "its port is down or NCCL_IB_HCA leaves it out"


def _who(o: dict, rank: int) -> str:
    gpu = o.get("gpu")
    if gpu:
        return f"GPU {gpu['bus_id']} (NUMA {_numa(gpu['numa_node'])}, rank {rank})"
    return f"rank {rank} (cores {o.get('cores')}, NUMA {_numa(o.get('cores_numa'))})"


def _numa(n) -> str:
    if isinstance(n, list):
        return ",".join(map(str, n)) or "?"
    return "?" if n is None else str(n)


def _nearer(o: dict, chain: dict) -> str | None:
    """Why this rank's NIC is farther than a candidate, with the fix; None if it is not."""
    nic, gpu, link = o.get("nic"), o.get("gpu"), chain["link"]
    if link in (None, "local") or not o.get("candidates"):
        return None
    sent = nic["device"]
    if gpu:
        ranked = sorted((topology.LINKS.index(topology.link(gpu, c)), name, c)
                        for name, c in o["candidates"].items() if name != sent)
        if not ranked or ranked[0][0] >= topology.LINKS.index(link):
            return None
        _, best, c = ranked[0]
        near = topology.link(gpu, c)
        fix = ("set NCCL_IB_HCA so that this rank's rail is " + best +
               ", keep NCCL_CROSS_NIC=0, or give NCCL the site's topology file (NCCL_TOPO_FILE)")
        if not c["listed"]:
            fix = f"NCCL does not list {best}: " + _why_unlisted(c.get("ports") or {})
        return (f"{_who(o, chain['rank'])} sends on {sent} "
                f"({nic['pci']}, NUMA {_numa(nic['numa_node'])}): {link}, {_WORDS[link]}; "
                f"{best} ({c['pci']}) is {near}, {_WORDS[near]}: {fix}")
    cores = o.get("cores_numa") or []
    local = [name for name, c in o["candidates"].items()
             if name != sent and c["numa_node"] in cores]
    if not local:
        return None
    return (f"rank {chain['rank']} runs on cores {o.get('cores')} (NUMA {_numa(cores)}) but sends "
            f"on {sent} (NUMA {_numa(nic['numa_node'])}); {local[0]} is on NUMA "
            f"{_numa(o['candidates'][local[0]]['numa_node'])}: bind the rank to NUMA "
            f"{nic['numa_node']} (numactl --cpunodebind={nic['numa_node']}) or order the rails "
            f"setting so that local rank {chain['rail']} gets {local[0]}")
