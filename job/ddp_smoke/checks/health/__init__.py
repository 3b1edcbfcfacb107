"""Health: every GPU and HCA of each node read directly and judged; silent data corruption.

One rank per node (local rank 0) reads its node through three readers (:mod:`.readers`):
NVML (nvidia-ml-py) for every GPU, sysfs/procfs for the HCA ports and the driver's own list
of GPUs, and the kernel log for XIDs, SXids and fallen-off-the-bus messages. The harness calls
:func:`begin` before the first check: start readings, then a sampler thread that watches the
GPUs (clock-event reasons, PCIe link, temperatures) and the ports while compute and bandwidth
load them, waiting on NVML's XID events in between. ``health`` (last in the default order)
takes the end readings and judges the whole run, one signal family per module (gpud's layout):

============ ===============================================================================
presence     NVML opens (a GPU run that cannot read its GPUs fails), count, unreachable and lost
             GPUs, the driver's GPUs NVML misses, readings NVML refused (not measured)
memory       ECC mode and volatile uncorrected errors, remapped rows, retired pages, recovery action
xid          NVML XID events during the run, kernel-log XIDs / XID 154 / fallen off the bus / SXids
clocks       HW slowdown under load, SW thermal, power and thermal violation time, temperatures
pcie         the link under load against the profile, replays over the run
nvlink       every link's state against the SKU's design, per-link error counters
fabric       NVSwitch fabric registration, health mask and summary
gpu_settings persistence, MIG, InfoROM, VBIOS uniformity, stray processes
hca          GPU-traffic ports' state and rate, counters (saturation too), flaps
cpu          a cgroup CPU quota that held the node's processes back during the run
sdc          the same seeded product on every rank, bit for bit
============ ===============================================================================

Each family is ``judge(node, limits) -> [Finding]`` (:mod:`.finding`) on recorded JSON, so a
recorded node judges as a live one; ``DDP_SMOKE_HEALTH_REPLAY=<recording>`` makes the readers
serve a recorded node instead of this machine (:mod:`.readers.replay`), and the report says so.
Culprits: the GPU (index, bus id, serial; the rank that uses it) or HCA port with the evidence
and the operator's action; the node itself; the rank whose product disagrees. A reading the
hardware does not support is "not measured", never a pass; a node whose hardware could not be
read at all makes the check SKIP with why — except on a GPU run, where it fails that node.
Every rule's source: docs/health.md.
"""
from __future__ import annotations

import os
import time

from ...config import profiles
from ...coordination import forensics
from ...model import FAIL, PASS, SKIP, CheckResult
from . import (clocks, cpu, fabric, gpu_settings, hca, memory, nvlink, pcie, presence, sdc,
               xid)
from .finding import CHECKED, NOT_MEASURED, WARN, Finding, Limits
from .readers import REPLAY_ENV, Node, cgroup, replay
from .reading import end_gpus, gpu_reading, samples

FAMILIES = (presence, memory, xid, clocks, pcie, nvlink, fabric, gpu_settings, hca, cpu)
_NODE: dict = {}  # this process's node reader (local rank 0 only)


# -- on every rank ----------------------------------------------------------------------------

def begin(ctx) -> None:
    """Harness hook, before the first check: start readings and the sampler. Never fatal."""
    if ctx.local_rank != 0 or _NODE:
        return
    thresholds = ctx.section("health")
    _NODE["node"] = node = Node(thresholds["sample_period_s"])
    node.start()
    forensics.also(lambda: {"held": held_back(node, thresholds)})


def held_back(node: Node, thresholds: dict) -> str | None:
    """This node's CPU quota judged over the run so far, as :mod:`.cpu` judges the check's
    window: an aborted run's word on ranks too slow for its deadline (this check never ran).
    None when no quota held them back."""
    quota = next(r for r in node.others if isinstance(r, cgroup.CpuQuotaReader))
    reading = {"cpu": {"start": quota.first, "end": cgroup.read()}}
    return next((f.line() for f in cpu.judge(reading, Limits(thresholds)) if f.level == FAIL),
                None)


def run(ctx) -> dict:
    t = time.monotonic()
    reading = None
    if ctx.local_rank == 0:
        if not _NODE:
            begin(ctx)  # no hook ran (a caller outside the harness): counters start now
        reading = _NODE["node"].finish()
    read_s = time.monotonic() - t
    return {"sdc": sdc.product(ctx, ctx.section("health")), "gpu_uuid": _gpu_uuid(ctx),
            "cuda": ctx.device.type == "cuda", "pid": os.getpid(), "node": reading,
            "node_read_s": round(read_s, 4)}


def _gpu_uuid(ctx) -> str | None:
    if ctx.device.type == "cuda":
        import torch
        uuid = str(getattr(torch.cuda.get_device_properties(ctx.device), "uuid", "") or "")
        return None if not uuid else uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
    recording = os.environ.get(REPLAY_ENV)
    return replay.rank_gpu_uuid(recording, ctx.local_rank) if recording else None


# -- judging (rank 0, pure) -----------------------------------------------------------------

def judge_node(node: dict, lim: Limits) -> list[Finding]:
    """Every family's findings on one node's reading."""
    return [f for family in FAMILIES for f in family.judge(node, lim)]


def judge(ev) -> CheckResult:
    obs, t = ev.observations, ev.section()
    expect = profiles.load(profiles.selected(ev.config)).get("health", {})
    if len({ev.host(r) for r in range(ev.world_size)}) < 2:  # one node uses no fabric: its
        expect = {k: v for k, v in expect.items() if not k.startswith("hca")}  # HCAs unjudged
    culprits, nodes = [], []
    for r, o in enumerate(obs):
        if o.get("node") is None:
            continue
        host = ev.host(r)
        here = [q for q in range(len(obs)) if ev.host(q) == host]
        owners = {obs[q]["gpu_uuid"]: q for q in here if obs[q].get("gpu_uuid")}
        cuda = sum(bool(obs[q].get("cuda")) for q in here)
        lim = Limits(t, expect, gpu_run=bool(cuda or expect.get("gpus_per_node")),
                     gpu_ranks=cuda, run_pids=tuple(obs[q]["pid"] for q in here))
        findings = judge_node(o["node"], lim)
        for f in findings:
            if f.level == FAIL:
                culprits.append(ev.culprit(owners.get(f.gpu.uuid) if f.gpu else None, f.line()))
                culprits[-1].host = host  # a GPU no rank uses, a port: the node is named
        nodes.append(_node_figures(host, r, o, findings, owners))
    for f in sdc.rank_findings(obs):
        if len(f.ranks) == 1:
            culprits.append(ev.culprit(f.ranks[0], f.what))
        else:
            culprits.append(ev.link_culprit(f.ranks[0], f.ranks[1], f.what))
            culprits[-1].ranks, culprits[-1].hosts = list(f.ranks), [ev.host(q) for q in f.ranks]
    measured = [n for n in nodes if n["gpus"] or n["hca_ports"]]
    status = FAIL if culprits else PASS if measured else SKIP
    summary = sdc.summary(obs)
    if culprits:
        summary = f"{len(culprits)} problem(s): {culprits[0].reason}"
    elif measured:
        summary += "; " + "; ".join(f"{len(n['gpus'])} GPU(s), {n['hca_ports']} HCA port(s) "
                                    f"read on {n['host']}" + (" (replayed)" if n["replay"] else "")
                                    for n in measured)
    else:
        summary += "; hardware not read: " + "; ".join(sorted(
            {m for n in nodes for m in n["not_measured"] if m.startswith(("GPUs", "HCAs"))}))
    figures = {"legend": "per node: gpus = each GPU read (index, bus id, serial, the rank using "
                         "it, worst finding); findings = fail and warn; not_measured = what "
                         "could not be judged and why; checked = what was read and judged",
               "thresholds": t, "profile": expect, "nodes": nodes, "sdc": sdc.summary(obs),
               "sdc_culprits": sorted({q for f in sdc.rank_findings(obs) for q in f.ranks}),
               "node_read_s_max": max((n["read_s"] for n in nodes), default=0.0)}
    return CheckResult("health", status, summary=summary, culprits=culprits, figures=figures,
                       notes=_notes(nodes))


def _node_figures(host, rank: int, o: dict, findings: list[Finding], owners: dict) -> dict:
    node = o["node"]
    worst: dict[int, str] = {}
    for f in findings:
        if f.gpu is not None and f.gpu.index is not None and f.level in (FAIL, WARN):
            worst[f.gpu.index] = FAIL if FAIL in (f.level, worst.get(f.gpu.index)) else WARN
    gpus = []
    for g in end_gpus(node):
        s = samples(node, g["index"]) or {}
        gpus.append({"index": g["index"], "name": g.get("name"), "bus_id": g.get("bus_id"),
                     "serial": g.get("serial"), "uuid": g.get("uuid"),
                     "rank": owners.get(g.get("uuid")), "status": worst.get(g["index"], "ok"),
                     "temp_max_c": s.get("temp_max_c"),
                     "pcie_busy": None if not s.get("busy") else
                     f"Gen{s['pcie_gen_busy_max']} x{s['pcie_width_busy_max']}",
                     "nvlink_up": len((g.get("nvlink") or {}).get("up", [])) or None})
    hca = node.get("hca") or {}
    return {"host": host, "rank": rank, "read_s": o["node_read_s"], "replay": node.get("replay"),
            "boot_id": (node.get("cpu") or {}).get("boot_id"),
            "driver": (gpu_reading(node).get("end") or {}).get("driver"), "gpus": gpus,
            "hca_ports": len(hca.get("end") or {}),
            "findings": [{**f.as_dict(), "line": f.line()} for f in findings
                         if f.level in (FAIL, WARN)],
            "not_measured": [f.line() for f in findings
                             if f.level == NOT_MEASURED],
            "checked": [f.what for f in findings if f.level == CHECKED]}


def _notes(nodes: list[dict]) -> list[str]:
    notes = []
    for n in nodes:
        if n["replay"]:
            notes.append(f"# health {n['host']}: REPLAYED from {n['replay']} ({REPLAY_ENV}): "
                         "not this machine's hardware")
        notes += [f"# health {n['host']}: not measured: {m}" for m in n["not_measured"][:20]]
        notes += [f"# health {n['host']}: warning: {f['line']}"
                  for f in n["findings"] if f["level"] == WARN][:20]
    return notes
