"""Node pairs for the bandwidth check, per rail where nodes have several: measure on every
rank, blame on rank 0.

Each node's leader (its first rank) exchanges a buffer with one other leader per round: a
simultaneous send and receive, nccl-tests' sendrecv, busbw = algbw = S / t, t the fastest of
``pair_iters`` exchanges, taken on the slower side. Barriers separate the rounds, so a leader
never talks to two partners at once. Pass 1 is the first ``pair_rounds`` rounds of a
round-robin; pass 2 pairs each suspect with a known-good node and measures each link
suspect again (a pair counts with its better pass). The plan is a pure function of
a table every rank holds (``perf.round_robin``, ``perf.second_pass``), so all ranks take the
same collectives in the same order; P2P on the default group needs no subgroup, hence no
``new_group`` call that every rank would have to make in the same order.

Rails. When a node's ranks send on two or more network devices (a ``rails`` setting on gloo;
one NIC per GPU under NCCL: :mod:`._rails`), the ranks of one local rank form a rail, and the
same two passes run inside every rail, node against node; round j of every rail runs at once
(their pairs share no rank and, on a rail-optimized fabric, no link), so the time grows with the
pairs per rail, not with rails x pairs. A rank whose rail was found dead before the process
group (:mod:`ddp_smoke.coordination.rails`) is left out of it. Blame is per rail against one
reference, the 90th-percentile pair of all rails: a node slow on one rail is named as that
node's rail, not the node and not its healthy rails; a node slow on every rail as the node; a
rail without one fine pair among three or more nodes as the rail (its leaf switch, or the
setting that steers the traffic); a dead rail as dead.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..coordination import progress
from ..model import percentile
from . import _rail_blame, perf

_SKIP = "all ranks are on one node: link pairs need leaders on >= 2 nodes"


def layout(nodes: list[int], local: list[int], device: list[int],
           dead: list[int]) -> list[dict] | None:
    """The rails, one per local rank i: ``{"index": i, "ranks": [the rank of each node on it,
    None where none or dead]}``; None when no node sends on two devices (one network: node
    pairs, as ever). ``device``: a number per rank naming its device (0: unknown)."""
    by_node: dict[int, set] = {}
    for r, n in enumerate(nodes):
        by_node.setdefault(n, set()).add(device[r])
    if not any(len(d - {0}) >= 2 for d in by_node.values()):
        return None
    rows = []
    for i in sorted(set(local)):
        row: list[int | None] = [None] * (max(nodes) + 1)
        for r, n in enumerate(nodes):
            if local[r] == i and not dead[r]:
                row[n] = r
        rows.append({"index": i, "ranks": row})
    return rows


def measure(ctx, cfg: dict, nodes: list[int], rails: list | None, clock) -> dict:
    """Run both passes; every rank in a pair returns its own pairs' timings."""
    k = max(nodes) + 1
    if k < 2 or cfg["pair_rounds"] < 1:
        return {"skipped": _SKIP if k < 2 else "bandwidth.pair_rounds is 0"}
    leaders = [nodes.index(i) for i in range(k)]
    groups = [rail["ranks"] for rail in rails] if rails else [leaders]
    spot = next(((g, row.index(ctx.rank)) for g, row in enumerate(groups) if ctx.rank in row),
                (None, None))
    size = cfg["pair_bytes_gpu" if ctx.device.type == "cuda" else "pair_bytes_cpu"]
    cut = margin(ctx.device.type, cfg)
    first = [_on_nodes(perf.round_robin(len(_members(row)), cfg["pair_rounds"]), row)
             for row in groups]
    mine = _rounds(ctx, cfg, first, 1, groups, spot, size, clock)
    tables = _first_pass_tables(ctx, first, size, mine)
    reference = percentile([v for t in tables for v in t.values()], 90) \
        if rails and any(tables) else None
    second = [_on_nodes(perf.second_pass(len(_members(row)), _on_positions(t, row), cut,
                                         cfg["pair_rounds"], reference), row)
              for row, t in zip(groups, tables)]
    mine += _rounds(ctx, cfg, second, 2, groups, spot, size, clock)
    out = {"leaders": leaders, "size_bytes": size, "device_type": ctx.device.type,
           "measured": mine}
    if rails:  # the table is rank 0's to judge: other ranks need not post it
        out = {**out, "rails": rails if ctx.rank == 0 else None}
        if ctx.rank:
            out["leaders"] = None
    return out


def margin(device_type: str, cfg: dict) -> float:
    """How far below the reference a pair is slow: gloo on CPUs is far noisier than a fabric."""
    return cfg["pair_margin_cpu" if device_type == "cpu" else "pair_margin"]


def _members(row: list) -> list[int]:
    return [n for n, r in enumerate(row) if r is not None]


def _on_nodes(plan: list, row: list) -> list:
    """A plan over a rail's positions (0 …) as node numbers."""
    members = _members(row)
    return [[(members[a], members[b]) for a, b in pairs] for pairs in plan]


def _on_positions(table: dict, row: list) -> dict:
    where = {n: i for i, n in enumerate(_members(row))}
    return {(where[a], where[b]): v for (a, b), v in table.items()}


def _rounds(ctx, cfg, plans, pass_number, groups, spot, size, clock) -> list[dict]:
    """Round j of every rail at once (one rank is in one rail); a barrier between rounds."""
    g, me = spot
    out = []
    for number in range(max((len(p) for p in plans), default=0)):
        pairs = plans[g][number] if g is not None and number < len(plans[g]) else []
        peer = next((b if a == me else a for a, b in pairs if me in (a, b)), None)
        if peer is not None:
            time_s = _exchange(ctx, groups[g][peer], size, cfg["pair_iters"], clock)
            out.append({"pass": pass_number, "round": number, "node": me, "peer_node": peer,
                        "time_us": time_s * 1e6, **({"rail": g} if len(groups) > 1 else {})})
        progress.barrier()  # rounds never overlap: each rank talks to one partner at a time
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


def _first_pass_tables(ctx, plans: list, size: int, mine: list[dict]) -> list[dict]:
    """Every first-pass pair's busbw from the slower side's time, per rail, identical on
    every rank.

    One slot per planned pair (O(nodes × pair_rounds) per rail), not a nodes × nodes table:
    at thousands of nodes that table is hundreds of MB to reduce and seconds to read back.
    """
    slot = {(g, p): i for i, (g, p) in
            enumerate((g, p) for g, plan in enumerate(plans) for r in plan for p in r)}
    times = torch.zeros(max(1, len(slot)), dtype=torch.float64, device=ctx.device)
    for m in mine:
        times[slot[(m.get("rail", 0), tuple(sorted((m["node"], m["peer_node"]))))]] = \
            m["time_us"]
    progress.all_reduce(times, op=dist.ReduceOp.MAX)  # MAX copies a value: bit-identical everywhere
    table = times.tolist()
    out: list[dict] = [{} for _ in plans]
    for (g, p), i in slot.items():
        if table[i] > 0:
            out[g][p] = perf.algbw_gbps(size, table[i] / 1e6)
    return out


# -- judging (rank 0, pure) ----------------------------------------------------------------

def judge(ev, cfg: dict) -> tuple[dict, list]:
    """The pairs' figures and culprits (slow nodes, slow links; per rail: slow or dead rails
    of a node, rails slow everywhere) from every rank's timings."""
    first = ev.observations[0]["pairs"]
    if "skipped" in first:
        return {"skipped": first["skipped"]}, []
    rails, size, cut = first.get("rails"), first["size_bytes"], margin(first["device_type"], cfg)
    busbw, records = _best(ev.observations, size, len(rails or [None]))
    everything = [v for t in busbw for v in t.values()]
    reference = percentile(everything, 90) if rails and everything else None
    blames = [perf.attribute(t, cut, reference) for t in busbw]
    if not rails:
        return _node_judgement(ev, first["leaders"], size, cut, busbw[0], records[0], blames[0])
    return _rail_blame.judge(ev, first["leaders"], rails, size, cut, busbw, records, blames)


def _best(observations: list, size: int, n: int) -> tuple[list[dict], list[dict]]:
    """Per rail: each pair's busbw (its better pass, the slower side's time) and its record."""
    by_pass: dict = {}
    for o in observations:
        for m in o["pairs"]["measured"]:
            key = (m.get("rail", 0), tuple(sorted((m["node"], m["peer_node"]))), m["pass"])
            if m["time_us"] > by_pass.get(key, {"time_us": 0.0})["time_us"]:
                by_pass[key] = m  # the slower side's time is the exchange's
    records: list[dict] = [{} for _ in range(n)]
    for (g, pair, _), m in sorted(by_pass.items()):
        if m["time_us"] < records[g].get(pair, {"time_us": float("inf")})["time_us"]:
            records[g][pair] = m  # measured twice (a link suspect): its better pass counts
    busbw = [{p: perf.algbw_gbps(size, m["time_us"] / 1e6) for p, m in r.items()}
             for r in records]
    return busbw, records


def _node_judgement(ev, leaders, size, cut, busbw, measured, blame) -> tuple[dict, list]:
    host = [ev.host(r) for r in leaders]
    results = [{"pass": m["pass"], "round": m["round"], "node_a": a, "node_b": b,
                "rank_a": leaders[a], "rank_b": leaders[b], "host_a": host[a], "host_b": host[b],
                "time_us": m["time_us"], "busbw_gbps": busbw[(a, b)],
                "slow": (a, b) in blame["slow"]} for (a, b), m in sorted(measured.items())]
    figures = {"nodes": len(leaders), "leaders": leaders, "size_bytes": size,
               "reference_busbw_gbps": blame["reference"], "margin": cut, "results": results}
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

