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

import statistics

import torch
import torch.distributed as dist

from ..coordination import proc, progress
from ..model import nodes_or_links, percentile
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
    reference = percentile([v for t in tables for v in t.values()],
                           cfg["pair_reference_percentile"]) if any(tables) else None
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
            # round trips first: they end on the first side half a trip after the other, and
            # the exchange's symmetric handshake evens that out before the round's barrier
            # (else the pairs' lower node always arrives last there: a straggler by design)
            rtt = _round_trips(ctx, groups[g][peer], me < peer, ctx.section("links"))
            waited = proc.cpu_wait_s()
            times = _exchange(ctx, groups[g][peer], size, cfg["pair_iters"], clock)
            out.append({"pass": pass_number, "round": number, "node": me, "peer_node": peer,
                        "time_us": min(times) * 1e6, "time_us_max": max(times) * 1e6,
                        **_cpu_wait_us("exchange", waited), **rtt,
                        **({"rail": g} if len(groups) > 1 else {})})
        progress.barrier()  # rounds never overlap: each rank talks to one partner at a time
    return out


def _exchange(ctx, peer: int, size_bytes: int, iters: int, clock) -> list[float]:
    """Seconds of each of ``iters`` simultaneous sends and receives with ``peer``; the pair
    is judged by the fastest.

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
    return times


def _round_trips(ctx, peer: int, first: bool, cfg: dict) -> dict:
    """``links.latency_iters`` round trips of one element with ``peer``, timed on the
    ``first`` side (the pair's lower node): ``{"rtt_us": [p50, p99, max]}`` there, ``{}`` on
    the echoing side. A packet lost on a small message costs a retransmission timer (a tail
    loss probe, at least 10 ms, or the 200 ms RTO), so loss shows in the tail, not the median."""
    if cfg["latency_iters"] < 1:
        return {}
    token = torch.zeros(1, dtype=torch.float32, device=ctx.device)
    # an untimed trip first: the peer's arrival from the round's barrier is not a round
    # trip (a barrier slowed by another lossy link let one side in 200 ms late: CI named a
    # healthy pair's node for it)
    progress.ping_pong(token, peer, first, 1)
    waited = proc.cpu_wait_s()
    got = progress.ping_pong(token, peer, first, cfg["latency_iters"])
    out = _cpu_wait_us("rtt", waited)
    if got:
        out["rtt_us"] = [round(percentile(got, q) * 1e6, 1) for q in (50, 99, 100)]
    return out


def _cpu_wait_us(what: str, since: float | None) -> dict:
    """``{"<what>_cpu_wait_us": …}``: how long this rank's threads waited for a core since
    ``since`` (:func:`proc.cpu_wait_s`), where the kernel counts it. Both sides of a pair post
    theirs: a trip or an exchange that one slow moment stretched is the link's only if the
    two processes were not kept off the cores as long."""
    now = proc.cpu_wait_s()
    if since is None or now is None:
        return {}
    return {f"{what}_cpu_wait_us": round(max(0.0, now - since) * 1e6, 1)}


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


# -- figures and culprits (rank 0, pure) ---------------------------------------------------

def figures_and_culprits(ev, cfg: dict) -> tuple[dict, list]:
    """The pairs' figures and culprits (slow nodes, slow links; per rail: slow or dead rails
    of a node, rails slow everywhere) from every rank's timings."""
    first = ev.observations[0]["pairs"]
    if "skipped" in first:
        return {"skipped": first["skipped"]}, []
    rails, size, cut = first.get("rails"), first["size_bytes"], margin(first["device_type"], cfg)
    busbw, records = _best(ev.observations, size, len(rails or [None]))
    everything = [v for t in busbw for v in t.values()]
    reference = percentile(everything, cfg["pair_reference_percentile"]) if everything else None
    blames = [perf.attribute(t, cut, reference) for t in busbw]
    figures, culprits = _rail_blame.figures_and_culprits(ev, first["leaders"], rails or None,
                                                         size, cut, busbw, records, blames)
    links = ev.section("links")
    tails = [unstable(r, links, first["device_type"]) for r in records]
    figures["latency"] = {"iters": links["latency_iters"], "floor_us": tails[0]["floor_us"],
                          "reference_p99_us": [t["reference_p99_us"] for t in tails],
                          "busy": [t["busy"] for t in tails]}
    rows = [rail["ranks"] for rail in rails] if rails else [first["leaders"]]
    return figures, culprits + _unstable_culprits(ev, tails, records, rows, rails, culprits)


def unstable(records: dict, cfg: dict, device_type: str) -> dict:
    """The pairs of one rail (or one network) bad only some of the time (pure).

    A pair is unstable when its p99 round trip stands ``latency_factor`` times above the
    other pairs' median p99 and above ``latency_p99_floor_ms[_cpu]`` (a lost small message
    waits for a retransmission timer); or intermittent when its slowest large exchange took
    ``latency_factor`` times its fastest and over the same floor more (on CPU, over
    ``latency_stall_ms`` more: a link that went down during one); or lossy when one round
    trip took ``latency_stall_ms`` or more (a lost message waits for TCP's loss timers,
    200 ms or more on Linux; healthy busy pairs here stay under 17 ms). Blamed on a node when
    every pair of it is bad, else on the link (:func:`ddp_smoke.model.nodes_or_links`).
    """
    floor_us = 1e3 * cfg["latency_p99_floor_ms_cpu" if device_type == "cpu"
                         else "latency_p99_floor_ms"]
    p99 = {p: m["rtt_us"][1] for p, m in records.items() if m.get("rtt_us")}
    ref = statistics.median(p99.values()) if p99 else None
    # each pair against the others' median (two nodes, one pair: the floor alone)
    tail = {p for p, v in p99.items()
            if v > max([floor_us] + [cfg["latency_factor"] * statistics.median(o) for o in
                                     [[w for q, w in p99.items() if q != p]] if o])}
    # On CPU ranks (TCP) a link down during an exchange costs it a retransmission timeout,
    # 200 ms or more; a shorter hiccup is the shared cores' scheduling (CI: 6 ranks on 2
    # cores once made one healthy exchange 10x its fastest and 50 ms slower)
    gap_us = max(floor_us, 1e3 * cfg["latency_stall_ms"]) if device_type == "cpu" else floor_us
    stalls = {p for p, m in records.items()
              if m["time_us_max"] > cfg["latency_factor"] * m["time_us"]
              and m["time_us_max"] - m["time_us"] > gap_us}
    waited = {p for p, m in records.items()
              if m.get("rtt_us") and m["rtt_us"][2] >= 1e3 * cfg["latency_stall_ms"]}
    # A pair whose two processes waited for a core as long as its worst moment stood above
    # its typical one: the cores' moment, not the link's (CI: a healthy rail's pair named
    # beside a slow rail on a suite-loaded machine). A lost message's 200 ms timer stands.
    busy = {p for p, m in records.items()
            if (p in tail or p in waited) and m.get("rtt_cpu_wait_us", -1) >=
            m["rtt_us"][2] - m["rtt_us"][0]
            or p in stalls and m.get("exchange_cpu_wait_us", -1) >=
            m["time_us_max"] - m["time_us"]}
    tail, stalls, waited = tail - busy, stalls - busy, waited - busy
    nodes, links = nodes_or_links(tail | stalls | waited, records)
    return {"reference_p99_us": ref, "floor_us": floor_us, "tail": sorted(tail),
            "stalls": sorted(stalls), "waited": sorted(waited), "busy": sorted(busy),
            "nodes": nodes, "links": links}


def _unstable_culprits(ev, tails: list[dict], records: list[dict], rows: list[list],
                       rails: list | None, named: list) -> list:
    """Culprits for the unstable nodes and links of every rail, skipping the ranks a
    bandwidth finding names already (one finding per cause)."""
    taken = {r for k in named for r in [k.rank, *(k.ranks or [])] if r is not None}
    out = []
    for g, t in enumerate(tails):
        row, on = rows[g], f" on rail {rails[g]['index']}" if rails else ""
        host = {n: ev.host(r) for n, r in enumerate(row) if r is not None}

        def tagged(culprit, rank, g=g):  # on a rail run, the rail
            return _rail_blame.with_rail(culprit, _rail_blame.rail_of(
                ev, rank, rails[g]["index"])) if rails else culprit
        for n in t["nodes"]:
            if row[n] in taken:
                continue
            out.append(tagged(ev.culprit(row[n], (
                f"node {host[n]}{on} is unstable with every partner: "
                + "; ".join(f"with {host[b if a == n else a]}: {_evidence(m, t, (a, b))}"
                            for (a, b), m in sorted(records[g].items()) if n in (a, b)))),
                row[n]))
        for a, b in t["links"]:
            if {row[a], row[b]} & taken:
                continue
            out.append(tagged(ev.link_culprit(row[a], row[b], (
                f"link {host[a]} (rank {row[a]}) <-> {host[b]} (rank {row[b]}){on} is "
                f"unstable: {_evidence(records[g][(a, b)], t, (a, b))}")), row[a]))
    return out


def _evidence(m: dict, t: dict, pair: tuple) -> str:
    parts = []
    p50, p99, top = m.get("rtt_us") or (0, 0, 0)
    if pair in t["tail"] or pair in t["waited"] or not m.get("rtt_us"):
        parts.append(f"p99 round trip {p99 / 1e3:.1f} ms against the pairs' median "
                     f"{t['reference_p99_us'] / 1e3:.2f} ms (p50 {p50 / 1e3:.2f} ms, "
                     f"max {top / 1e3:.1f} ms)")
    if pair in t["waited"]:
        parts.append(f"a round trip took {top / 1e3:.0f} ms: a lost message waiting for "
                     "TCP's loss timers")
    if pair in t["stalls"]:
        parts.append(f"its slowest exchange took {m['time_us_max'] / 1e3:.1f} ms, its fastest "
                     f"{m['time_us'] / 1e3:.1f} ms (intermittent)")
    return "; ".join(parts)


_WAITS = ("rtt_cpu_wait_us", "exchange_cpu_wait_us")


def _best(observations: list, size: int, n: int) -> tuple[list[dict], list[dict]]:
    """Per rail: each pair's busbw (its better pass, the slower side's time) and its record,
    which carries the pair's worst round-trip tail and slowest exchange of any pass, and the
    most its two ends waited for a core in one pass (``*_cpu_wait_us``, both ends summed)."""
    by_pass: dict = {}
    tails: dict = {}
    waits: dict = {}
    measured = [((m.get("rail", 0), tuple(sorted((m["node"], m["peer_node"]))), m["pass"]), m)
                for o in observations for m in o["pairs"]["measured"]]
    for key, m in measured:  # both ends' waits first: each end posts its own
        for what in _WAITS:
            if what in m:
                waits[key + (what,)] = waits.get(key + (what,), 0.0) + m[what]
    for key, m in measured:
        if m["time_us"] > by_pass.get(key, {"time_us": 0.0})["time_us"]:
            by_pass[key] = m  # the slower side's time is the exchange's
        tail = tails.setdefault(key[:2], {"time_us_max": 0.0})
        tail["time_us_max"] = max(tail["time_us_max"], m.get("time_us_max", m["time_us"]))
        if m.get("rtt_us") and m["rtt_us"][1] > tail.get("rtt_us", [0, -1])[1]:
            tail["rtt_us"] = m["rtt_us"]  # the first side times the round trips
        for what in _WAITS:
            if key + (what,) in waits:
                tail[what] = max(tail.get(what, 0.0), waits[key + (what,)])
    records: list[dict] = [{} for _ in range(n)]
    for (g, pair, _), m in sorted(by_pass.items()):
        if m["time_us"] < records[g].get(pair, {"time_us": float("inf")})["time_us"]:
            records[g][pair] = {**m, **tails[(g, pair)]}  # its better pass counts
    busbw = [{p: perf.algbw_gbps(size, m["time_us"] / 1e6) for p, m in r.items()}
             for r in records]
    return busbw, records
