"""Node pairs for the bandwidth check: measure on every rank, blame on rank 0.

Each node's leader (its first rank) exchanges a buffer with one other leader per round: a
simultaneous send and receive, nccl-tests' sendrecv, busbw = algbw = S / t, t the fastest of
``pair_iters`` exchanges, taken on the slower side. Barriers separate the rounds, so a leader
never talks to two partners at once. Pass 1 is the first ``pair_rounds`` rounds of a
round-robin; pass 2 pairs each suspect with a known-good node and measures each link
suspect again (a pair counts with its better pass). The plan is a pure function of
a table every rank holds (``perf.round_robin``, ``perf.second_pass``), so all ranks take the
same collectives in the same order; P2P on the default group needs no subgroup, hence no
``new_group`` call that every rank would have to make in the same order.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..coordination import progress
from . import perf

_SKIP = "all ranks are on one node: link pairs need leaders on >= 2 nodes"


def measure(ctx, cfg: dict, nodes: list[int], clock) -> dict:
    """Run both passes; leaders return their own pairs' timings, other ranks none."""
    k = max(nodes) + 1
    if k < 2 or cfg["pair_rounds"] < 1:
        return {"skipped": _SKIP if k < 2 else "bandwidth.pair_rounds is 0"}
    leaders = [nodes.index(i) for i in range(k)]
    me = nodes[ctx.rank] if leaders[nodes[ctx.rank]] == ctx.rank else None
    size = cfg["pair_bytes_gpu" if ctx.device.type == "cuda" else "pair_bytes_cpu"]
    first = perf.round_robin(k, cfg["pair_rounds"])
    mine = _rounds(ctx, cfg, first, 1, leaders, me, size, clock)
    busbw = _first_pass_table(ctx, [p for r in first for p in r], size, mine)
    second = perf.second_pass(k, busbw, margin(ctx.device.type, cfg), cfg["pair_rounds"])
    mine += _rounds(ctx, cfg, second, 2, leaders, me, size, clock)
    return {"leaders": leaders, "size_bytes": size, "device_type": ctx.device.type,
            "measured": mine}


def margin(device_type: str, cfg: dict) -> float:
    """How far below the reference a pair is slow: gloo on CPUs is far noisier than a fabric."""
    return cfg["pair_margin_cpu" if device_type == "cpu" else "pair_margin"]


def _rounds(ctx, cfg, rounds, pass_number, leaders, me, size, clock) -> list[dict]:
    out = []
    for number, pairs in enumerate(rounds):
        peer = next((b if a == me else a for a, b in pairs if me in (a, b)), None)
        if peer is not None:
            time_s = _exchange(ctx, leaders[peer], size, cfg["pair_iters"], clock)
            out.append({"pass": pass_number, "round": number, "node": me, "peer_node": peer,
                        "time_us": time_s * 1e6})
        progress.barrier()  # rounds never overlap: each leader talks to one partner at a time
    return out


def _exchange(ctx, peer: int, size_bytes: int, iters: int, clock) -> float:
    """Seconds of the fastest of ``iters`` simultaneous sends and receives with ``peer``.

    Each timed exchange starts right after an untimed one-element handshake, so both sides
    time a whole exchange from a common start (the sweep's per-iteration barrier, for two).
    The fastest, not the mean: other traffic only slows an exchange, while a bad node or
    link is slow every time, so the minimum separates them on a busy cluster.
    """
    send = torch.ones(size_bytes // 4, dtype=torch.float32, device=ctx.device)
    recv = torch.empty_like(send)
    token = torch.zeros(2, dtype=torch.float32, device=ctx.device)

    def swap(out, into):
        progress.sendrecv(out, into, peer)

    swap(send, recv)  # the first exchange opens the connection
    times = []
    for _ in range(iters):
        swap(token[:1], token[1:])
        times.append(clock(lambda: swap(send, recv)))
    return min(times)


def _first_pass_table(ctx, planned: list[tuple[int, int]], size: int,
                      mine: list[dict]) -> dict:
    """Every first-pass pair's busbw from the slower side's time, identical on every rank.

    One slot per planned pair (O(nodes × pair_rounds)), not a nodes × nodes table: at
    thousands of nodes that table is hundreds of MB to reduce and seconds to read back.
    """
    slot = {p: i for i, p in enumerate(planned)}
    times = torch.zeros(max(1, len(planned)), dtype=torch.float64, device=ctx.device)
    for m in mine:
        times[slot[tuple(sorted((m["node"], m["peer_node"])))]] = m["time_us"]
    progress.all_reduce(times, op=dist.ReduceOp.MAX)  # MAX copies a value: bit-identical everywhere
    table = times.tolist()
    return {p: perf.algbw_gbps(size, table[i] / 1e6) for p, i in slot.items() if table[i] > 0}


def judge(ev, cfg: dict) -> tuple[dict, list]:
    """The pairs' figures and culprits (slow nodes, slow links) from every leader's timings."""
    first = ev.observations[0]["pairs"]
    if "skipped" in first:
        return {"skipped": first["skipped"]}, []
    leaders, size = first["leaders"], first["size_bytes"]
    by_pass: dict = {}
    for o in ev.observations:
        for m in o["pairs"]["measured"]:
            key = (tuple(sorted((m["node"], m["peer_node"]))), m["pass"])
            if m["time_us"] > by_pass.get(key, {"time_us": 0.0})["time_us"]:
                by_pass[key] = m  # the slower side's time is the exchange's
    measured: dict = {}
    for (pair, _), m in sorted(by_pass.items()):
        if m["time_us"] < measured.get(pair, {"time_us": float("inf")})["time_us"]:
            measured[pair] = m  # measured twice (a link suspect): its better pass counts
    busbw = {p: perf.algbw_gbps(size, m["time_us"] / 1e6) for p, m in measured.items()}
    blame = perf.attribute(busbw, margin(first["device_type"], cfg))
    host = [ev.host(r) for r in leaders]
    results = [{"pass": m["pass"], "round": m["round"], "node_a": a, "node_b": b,
                "rank_a": leaders[a], "rank_b": leaders[b], "host_a": host[a], "host_b": host[b],
                "time_us": m["time_us"], "busbw_gbps": busbw[(a, b)],
                "slow": (a, b) in blame["slow"]} for (a, b), m in sorted(measured.items())]
    figures = {"nodes": len(leaders), "leaders": leaders, "size_bytes": size,
               "reference_busbw_gbps": blame["reference"],
               "margin": margin(first["device_type"], cfg),
               "results": results}
    return figures, _culprits(ev, blame, busbw, leaders, host)


def _culprits(ev, blame: dict, busbw: dict, leaders: list[int], host: list) -> list:
    ref = blame["reference"]
    out = []
    for n in blame["nodes"]:
        partners = ", ".join(f"{host[b if a == n else a]} {v:.2f}"
                             for (a, b), v in sorted(busbw.items()) if n in (a, b))
        out.append(ev.culprit(leaders[n], f"node {host[n]} is slow with every partner "
                                          f"({partners} GB/s; reference {ref:.2f} GB/s)"))
    why = {"links": "both nodes are fast with other partners",
           "unresolved": "too few partners to tell node from link (raise bandwidth.pair_rounds)"}
    for kind, reason in why.items():
        for a, b in blame[kind]:
            out.append(ev.link_culprit(leaders[a], leaders[b], (
                f"link {host[a]} (rank {leaders[a]}) <-> {host[b]} (rank {leaders[b]}): "
                f"{busbw[(a, b)]:.2f} GB/s, {perf.shortfall_pct(busbw[(a, b)], ref):.0f} % below "
                f"the reference {ref:.2f} GB/s; {reason}")))
    return out
