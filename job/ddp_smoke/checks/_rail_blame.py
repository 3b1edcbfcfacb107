"""The bandwidth check's blame of node pairs (rank 0, pure): which node, which link, and on
a run with rails which node's rail, which rail. One network is the one-rail case: its pairs
are its nodes' leaders, its culprits carry no rail and its reasons name none.

Input: the pairs measured inside every rail (:mod:`._pairs`), each rail's attribution against
the one reference of all rails (:func:`.perf.attribute`), and each rank's rail
(:mod:`._rails`: its device, and whether it was found dead before the process group). On a
run with rails every culprit names its rail in ``rail`` (``{"index", "device", "port"}``; a
rail named as a whole also lists its ``ranks``, whom the waits then do not name again)
besides its rank and host:

* a rail dead on a node: that node's rail (the rank on it), with the peers that could not
  reach it; dead on every node (three or more): the rail, no host; between two nodes that
  cannot tell which end: both ends, as a link;
* a rail with no fine pair among three or more nodes: the rail, no host ("slow on all nodes:
  its leaf switch or the NCCL setting");
* a node slow with every partner on one rail: that node's rail, not the node, not its other
  rails; slow on every rail it is on: the node, as without rails;
* a pair slow while both ends are fast with others on the rail: the link on that rail.
"""
from __future__ import annotations

import dataclasses

from ..coordination import reach
from ..model import rail_label
from . import perf



def figures_and_culprits(ev, leaders: list[int], rails: list[dict] | None, size: int,
                         cut: float, busbw: list[dict], records: list[dict],
                         blames: list[dict]) -> tuple[dict, list]:
    """``(figures, culprits)`` of the pairs; ``rails`` None: one network, the one-rail case
    whose row is the nodes' leaders."""
    one = rails is None
    rails = [{"index": 0, "ranks": leaders}] if one else rails
    host = [ev.host(r) for r in leaders]
    ref = blames[0]["reference"] if blames else None
    results = []
    for g, rail in enumerate(rails):
        row = rail["ranks"]
        results += [{**({} if one else {"rail": rail["index"]}), "pass": m["pass"],
                     "round": m["round"], "node_a": a, "node_b": b, "rank_a": row[a],
                     "rank_b": row[b], "host_a": host[a], "host_b": host[b],
                     "time_us": m["time_us"], "time_us_max": m["time_us_max"],
                     "rtt_us": m.get("rtt_us"), "busbw_gbps": busbw[g][(a, b)],
                     "slow": (a, b) in blames[g]["slow"]}
                    for (a, b), m in sorted(records[g].items())]
    figures = {"nodes": len(leaders), "leaders": leaders, "size_bytes": size,
               "reference_busbw_gbps": ref, "margin": cut, "results": results}
    if one:
        return figures, (_slow_nodes(ev, rails, busbw, blames, host, leaders, set(), one)
                         + _links(ev, rails, busbw, blames, host, set(), one))
    dead = _dead(ev)
    figures["rails"] = [{"index": r["index"], "ranks": r["ranks"],
                         "devices": [_device(ev, x) for x in r["ranks"]]} for r in rails]
    figures["dead"] = dead
    wide = _slow_everywhere(ev, rails, busbw, blames, ref)
    culprits = _dead_culprits(ev, dead) + list(wide.values())
    culprits += _slow_nodes(ev, rails, busbw, blames, host, leaders, set(wide), one)
    culprits += _links(ev, rails, busbw, blames, host, set(wide), one)
    return figures, culprits


def _device(ev, rank: int | None) -> str | None:
    return None if rank is None else (ev.observations[rank].get("rail") or {}).get("device")


def rail_of(ev, rank: int | None, index: int) -> dict:
    """The culprit's ``rail``: index, device, and port where NCCL names one."""
    got = (ev.observations[rank].get("rail") or {}) if rank is not None else {}
    return {"index": index, "device": got.get("device"), "port": got.get("port")}


def _label(ev, rank: int | None, index: int) -> str:
    return rail_label(rail_of(ev, rank, index))


def with_rail(culprit, rail: dict):
    return dataclasses.replace(culprit, rail=rail)


def _devices(ev, ranks) -> str:
    names = sorted({d for d in (_device(ev, r) for r in ranks) if d})
    return f" ({', '.join(names)})" if names else ""


# -- dead rails ----------------------------------------------------------------------------

def _dead(ev) -> list[dict]:
    out = []
    for r, o in enumerate(ev.observations):
        rail = o.get("rail") or {}
        if rail.get("dead"):
            out.append({"rank": r, "host": ev.host(r), "rail": rail["index"],
                        "device": rail.get("device"), "sent_on": rail.get("sent_on"),
                        **rail["dead"]})
    return out


def _dead_culprits(ev, dead: list[dict]) -> list:
    by_rail: dict[int, list[dict]] = {}
    for d in dead:
        by_rail.setdefault(d["rail"], []).append(d)
    on_rail = {}
    for r, o in enumerate(ev.observations):
        on_rail.setdefault((o.get("rail") or {}).get("index"), set()).add(ev.host(r))
    out, tried = [], reach.tries(ev.config.get("diagnosis"))  # as the rails' probes tried
    for index, ds in sorted(by_rail.items()):
        first = ds[0]["rank"]
        if len(ds) >= 3 and {d["host"] for d in ds} == on_rail.get(index, set()):
            out.append(with_rail(ev.culprit(None, (
                f"{_label(ev, first, index)} dead on all nodes: no rank on it could connect "
                f"to another ({tried}, before the process group); its leaf switch, its "
                "cabling or the addresses on it")),
                {**rail_of(ev, first, index), "ranks": [d["rank"] for d in ds]}))
            continue
        for d in ds:
            if d["why"] == "cut off":
                out.append(with_rail(ev.culprit(d["rank"], (
                    f"node {d['host']} {_label(ev, d['rank'], index)} carries no connection: "
                    f"{len(d['unreached'])} of the {d['tried']} rail peers tried "
                    f"({', '.join(d['unreached'])}) could not connect to it or be connected to "
                    f"from it ({tried}, before the process group); rank {d['rank']} sent on "
                    f"{d['sent_on'] or 'the default interface'} instead and its rail was not "
                    "measured")), rail_of(ev, d["rank"], index)))
        loose = [d for d in ds if d["why"] != "cut off"]
        if len(loose) >= 2:
            ranks = [d["rank"] for d in loose]
            out.append(with_rail(dataclasses.replace(ev.link_culprit(ranks[0], ranks[1], (
                f"{_label(ev, ranks[0], index)} between {', '.join(d['host'] for d in loose)} "
                f"carries no connection ({tried}) and the other nodes cannot tell which end is "
                "at fault: look at both")), ranks=ranks, hosts=[d["host"] for d in loose]),
                rail_of(ev, ranks[0], index)))
    return out


# -- slow rails ----------------------------------------------------------------------------

def _slow_everywhere(ev, rails, busbw, blames, ref) -> dict:
    """Rails (by position) with no fine pair among three or more nodes, with their culprit."""
    out = {}
    if len(rails) < 2:
        return out  # no other rail to measure it against
    for g, rail in enumerate(rails):
        nodes = {n for p in busbw[g] for n in p}
        if len(nodes) < 3 or set(busbw[g]) - set(blames[g]["slow"]):
            continue
        values = sorted(busbw[g].values())
        ranks = [r for r in rail["ranks"] if r is not None]
        index = rail["index"]
        out[g] = with_rail(ev.culprit(None, (
            f"rail {index}{_devices(ev, ranks)} slow on all nodes: its leaf switch or the "
            f"NCCL setting that steers the traffic (NCCL_IB_HCA, NCCL_CROSS_NIC): "
            f"{len(values)} pairs among {len(nodes)} nodes at {values[0]:.2f}-{values[-1]:.2f} "
            f"GB/s, {perf.shortfall_pct(values[-1], ref):.0f} % or more below the reference "
            f"{ref:.2f} GB/s of the other rails")),
            {"index": index, "device": _device(ev, ranks[0]) if ranks else None,
             "port": None, "ranks": ranks})
    return out


def _partners(busbw: dict, n: int, host: list) -> str:
    return ", ".join(f"{host[b if a == n else a]} {v:.2f}"
                     for (a, b), v in sorted(busbw.items()) if n in (a, b))


def _slow_nodes(ev, rails, busbw, blames, host, leaders, wide: set, one: bool) -> list:
    ref = blames[0]["reference"]
    named: dict[int, list[int]] = {}
    for g in range(len(rails)):
        if g not in wide:
            for n in blames[g]["nodes"]:
                named.setdefault(n, []).append(g)
    out = []
    for n, gs in sorted(named.items()):
        on = [g for g in range(len(rails)) if any(n in p for p in busbw[g])]
        if len(on) >= 2 and set(gs) == set(on):
            per = "; ".join(f"rail {rails[g]['index']}: {_partners(busbw[g], n, host)}"
                            for g in gs)
            out.append(ev.culprit(leaders[n], f"node {host[n]} is slow with every partner on "
                                              f"every rail ({per} GB/s; reference {ref:.2f} GB/s)"))
            continue
        fine = len(on) - len(gs)
        for g in gs:
            rank, index = rails[g]["ranks"][n], rails[g]["index"]
            where = "" if one else f" {_label(ev, rank, index)}"
            out.append(_on_rail(ev.culprit(rank, (
                f"node {host[n]}{where} is slow with every partner{'' if one else ' on it'} "
                f"({_partners(busbw[g], n, host)} GB/s; reference {ref:.2f} GB/s)"
                + (f"; its other {fine} rail(s) are fine" if fine else ""))),
                ev, rank, index, one))
    return out


def _links(ev, rails, busbw, blames, host, wide: set, one: bool) -> list:
    ref = blames[0]["reference"]
    on_it = "" if one else " on it"
    why = {"links": f"both nodes are fast with other partners{on_it}",
           "unresolved": "too few partners to tell node from link (raise bandwidth.pair_rounds)"}
    out = []
    for g, rail in enumerate(rails):
        if g in wide:
            continue
        row, index = rail["ranks"], rail["index"]
        for kind, reason in why.items():
            for a, b in blames[g][kind]:
                v, where = busbw[g][(a, b)], "" if one else f" on {_label(ev, row[a], index)}"
                out.append(_on_rail(ev.link_culprit(row[a], row[b], (
                    f"link {host[a]} (rank {row[a]}) <-> {host[b]} (rank {row[b]}){where}: "
                    f"{v:.2f} GB/s, {perf.shortfall_pct(v, ref):.0f} % below the reference "
                    f"{ref:.2f} GB/s; {reason}")), ev, row[a], index, one))
    return out


def _on_rail(culprit, ev, rank: int | None, index: int, one: bool):
    """The culprit with its rail; on one network as it is."""
    return culprit if one else with_rail(culprit, rail_of(ev, rank, index))
