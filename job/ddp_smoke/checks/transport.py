"""Transport: the network NCCL really used on each rank (IB, Socket, a plugin) and GPUDirect RDMA.

NCCL picks its transport silently: without ``libibverbs`` in the image, without the RDMA
device in the pod, or with a wrong ``NCCL_IB_HCA``, it logs (at INFO only) that it uses TCP
sockets, and the run passes at a fraction of the fabric's bandwidth. With the nccl backend the
worker turns NCCL's INFO log on for the INIT and NET subsystems into one file per process
(``REPORT_DIR/nccl/<host>.<pid>.log``; each of ``NCCL_DEBUG``, ``NCCL_DEBUG_SUBSYS`` and
``NCCL_DEBUG_FILE`` only where the user has not set it), and every rank here parses its own
(:mod:`ddp_smoke.checks._nccl_log`): network, NICs, GPUDirect RDMA, why verbs were not used.
Figures: one record per rank. Pass criterion, on a multi-node run: every rank used the network
named by ``--expect-transport`` (``ib``, ``socket`` or a plugin's name, e.g. ``libfabric``;
config key ``expect_transport``, else the profile's ``expect_transport``), or, with no
expectation, the same network on every node. A rank whose log names no network fails the
expectation too: no data is not a pass. On one node the figures are reported, never judged
(NCCL uses NVLink/shared memory there; the network is not exercised).
Culprits: one per node that used another network (or left no evidence), with its ranks.
Skips on gloo (no NCCL).
"""
from __future__ import annotations

import collections
import os

import torch

from ..config import profiles
from ..coordination import progress
from ..model import FAIL, PASS, SKIP, CheckResult
from . import _nccl_log as nccl_log


def expectation(config: dict) -> str | None:
    """The network the run must use: ``expect_transport``, else the profile's, else None."""
    return config.get("expect_transport") or profiles.load(profiles.selected(config)).get(
        "expect_transport")


def run(ctx) -> dict:
    """Parse this rank's NCCL log, once its communicator exists."""
    if ctx.backend != "nccl":
        return {"skipped": f"backend {ctx.backend}: NCCL is not used"}
    # NCCL chooses its network when the first communicator is created; make sure it exists
    # even when this check runs alone.
    progress.all_reduce(torch.ones(1, device=ctx.device))  # settles the stream itself
    facts, files = nccl_log.read_own_log()
    return {**facts, "log_files": files, "nccl_debug": os.environ.get("NCCL_DEBUG"),
            "nccl_debug_subsys": os.environ.get("NCCL_DEBUG_SUBSYS")}


def judge(ev) -> CheckResult:
    """Every rank on the expected (or a common) network; culprits per node."""
    obs = ev.observations
    if any("skipped" in o for o in obs):
        return CheckResult("transport", SKIP, summary=obs[0].get("skipped", "skipped"))
    hosts = [ev.host(r) for r in range(len(obs))]
    nodes = len(set(hosts))
    figures = {"ranks": [{"rank": r, "host": hosts[r], **o} for r, o in enumerate(obs)],
               "nodes": nodes}
    networks = collections.Counter(o["network"] for o in obs)
    want = expectation(ev.config)
    figures["expected"] = want
    shown = ", ".join(f"{n or 'unknown'} x{c}" for n, c in networks.most_common())
    if nodes < 2:
        return CheckResult("transport", PASS, figures=figures,
                           summary=f"one node: network {shown} (not judged: not exercised)")
    if want:
        bad = [r for r, o in enumerate(obs) if not nccl_log.matches(o["network"], want)]
        why = f"expected {want}"
    else:
        common = networks.most_common(1)[0][0]
        bad = [r for r, o in enumerate(obs) if o["network"] != common or common is None]
        why = f"the other nodes use {common}" if common else "no rank's log names a network"
    culprits = _per_node(ev, obs, hosts, bad, why)
    summary = (f"network {shown}" + (f", expected {want}" if want else "")
               + (f"; {len(culprits)} node(s) differ" if culprits else ""))
    return CheckResult("transport", FAIL if culprits else PASS, summary=summary,
                       figures=figures, culprits=culprits)


def _per_node(ev, obs, hosts, bad: list[int], why: str) -> list:
    """One culprit per node: its lowest bad rank, naming the node's other bad ranks."""
    by_host: dict[str, list[int]] = collections.defaultdict(list)
    for r in bad:
        by_host[hosts[r]].append(r)
    culprits = []
    for host, ranks in sorted(by_host.items(), key=lambda kv: kv[1][0]):
        o = obs[ranks[0]]
        used = o["network"] or ("no NCCL log found" if not o.get("log_files")
                                else "no 'Using network' line in " + o["log_files"][0])
        hint = f"; {o['fallback']}" if o.get("fallback") else ""
        if o["network"] is None and o.get("nccl_debug") not in (None, "INFO", "TRACE"):
            hint += f"; NCCL_DEBUG={o['nccl_debug']} hides the INFO lines: unset it"
        culprits.append(ev.culprit(ranks[0], f"ranks {ranks} used {used} ({why}){hint}"))
    return culprits
