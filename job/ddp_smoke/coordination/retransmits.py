"""TCP retransmissions per link: a link that loses packets some of the time.

A cable or optic that drops a few percent of the frames, or a port that flaps, makes TCP send
again; nothing errors, collectives only slow down, and one bandwidth figure taken between two
outages looks fine. The kernel counts it per connection, so each rank reads, at a check's start
and end, ``tcp_info`` (``getsockopt(TCP_INFO)``) of every TCP socket the process holds — gloo's
pairs, NCCL's socket transport, the store connection — and posts with its observation, per peer
address, what the check added:

* ``retrans``: segments sent again (``tcpi_total_retrans``);
* ``rto``: retransmission timeouts (``tcpi_total_rto``, Linux ≥ 6.7; None before): nothing came
  back for at least the minimum RTO (200 ms on Linux), the mark of a link that was down;
* ``segs``: data segments sent (``tcpi_data_segs_out``), the denominator of a loss share.

Rank 0 (:func:`find_lossy`, pure) maps each peer address to its node through the ranks' interface
addresses (their identity records; a rail's own address names the rail), adds both directions
of each link, and names a link whose retransmissions stand far above the check's healthy
links'; a node whose every link does, with partners fine elsewhere, is named as the node.
Thresholds: ``links.*`` in defaults.yaml; measured figures: docs/diagnosis.md.

On InfiniBand/RoCE the data never touches a TCP socket (only the store and NCCL's bootstrap
do): there the HCA port counters the health check reads (symbol errors, link downs, recovery)
are the same evidence, per port.
"""
from __future__ import annotations

import dataclasses
import os
import socket
import struct

from ..model import Culprit, nodes_or_links

# struct tcp_info (include/uapi/linux/tcp.h): byte offsets of the fields read here
_TOTAL_RETRANS = 100   # __u32 tcpi_total_retrans
_DATA_SEGS_OUT = 156   # __u32 tcpi_data_segs_out (Linux 4.6)
_DSACK_DUPS = 216      # __u32 tcpi_dsack_dups (Linux 5.10)
_TOTAL_RTO = 240       # __u16 tcpi_total_rto (Linux 6.7)
_INFO_LEN = 248


def snapshot() -> dict[tuple, tuple]:
    """Every TCP connection of this process: ``(local, peer) -> (retrans, rto, segs)``; ``rto``
    None where the kernel does not count it. Sockets are borrowed by descriptor, never closed."""
    out: dict[tuple, tuple] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in fds:
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=fd)
        except OSError:  # gone meanwhile, or not a socket after all
            continue
        try:
            if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET,
                                                                       socket.AF_INET6):
                continue
            peer, local = sock.getpeername(), sock.getsockname()
            raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _INFO_LEN)
        except OSError:  # a listening or unconnected socket
            continue
        finally:
            sock.detach()  # the descriptor stays its owner's
        if len(raw) < _DATA_SEGS_OUT + 4:
            continue
        rto = struct.unpack_from("H", raw, _TOTAL_RTO)[0] if len(raw) >= _TOTAL_RTO + 2 else None
        dsack = struct.unpack_from("I", raw, _DSACK_DUPS)[0] if len(raw) >= _DSACK_DUPS + 4 else 0
        out[(local[:2], peer[:2])] = (struct.unpack_from("I", raw, _TOTAL_RETRANS)[0] - dsack, rto,
                                      struct.unpack_from("I", raw, _DATA_SEGS_OUT)[0])
    return out


def since(before: dict[tuple, tuple], after: dict[tuple, tuple] | None = None) -> dict:
    """Per peer address, what the connections added since ``before`` (a :func:`snapshot`):
    ``{address: [retrans, rto, segs]}``, only peers that sent something. A connection opened
    in between counts from zero; one closed in between is lost (gloo keeps its pairs open)."""
    after = snapshot() if after is None else after
    out: dict[str, list] = {}
    for conn, now in after.items():
        was = before.get(conn, (0, 0 if now[1] is not None else None, 0))
        row = out.setdefault(conn[1][0], [0, 0 if now[1] is not None else None, 0])
        row[0] += now[0] - was[0]
        if now[1] is not None and row[1] is not None:
            row[1] += now[1] - (was[1] or 0)
        row[2] += now[2] - was[2]
    return {a: r for a, r in out.items() if r[2] or r[0]}


class Counter:
    """This rank's connections counted from one observation to the next: a check's
    observation carries :meth:`take` (what the check added, with its arrival: the first
    check's also what the process group's set-up retransmitted), the forensics of a run aborted
    inside a check :meth:`so_far`."""

    def __init__(self) -> None:
        self._mark: dict[tuple, tuple] = {}

    def take(self) -> dict | None:
        """What the connections added since the last take, and start anew."""
        now = snapshot()
        got, self._mark = since(self._mark, now), now
        return got or None

    def so_far(self) -> dict | None:
        """:meth:`take` without starting anew."""
        return since(self._mark) or None


COUNTER = Counter()


# -- judging (rank 0, pure) ------------------------------------------------------------------

def links(posted: list[dict | None], ranks: list[dict]) -> dict[tuple, dict]:
    """Both directions of every link between two nodes, from each rank's :func:`since`:
    ``{(host_a, host_b, via): {"retrans", "rto", "segs", "sent": {host: [retrans, segs]}}}``,
    hosts sorted; ``sent``: each direction by its sender; ``via``: the interface of the peer
    address (one per rail on a rail run)."""
    owner = {}
    for r in ranks:
        for iface, addr in (r.get("addresses") or {}).items():
            if iface != "lo" and not addr.startswith("127."):
                owner.setdefault(addr, (r.get("host"), iface))
    out: dict[tuple, dict] = {}
    for r, rows in enumerate(posted):
        host = ranks[r].get("host") if r < len(ranks) else None
        for addr, (retrans, rto, segs) in (rows or {}).items():
            peer, iface = owner.get(addr, (None, None))
            if peer is None or host is None or peer == host:
                continue  # loopback, this node's own address, or not a rank's node
            link = out.setdefault((*sorted((host, peer)), iface),
                                  {"retrans": 0, "rto": 0, "segs": 0, "sent": {}})
            link["retrans"] += retrans
            link["rto"] = None if rto is None or link["rto"] is None else link["rto"] + rto
            link["segs"] += segs
            mine = link["sent"].setdefault(host, [0, 0])
            mine[0] += retrans
            mine[1] += segs
    return out


def worst(link: dict) -> tuple[int, float]:
    """The link's worse direction: its retransmitted segments, and their share of the data
    segments it sent (a fault in one direction only shows undiluted by the other)."""
    return max(((r, r / s if s else 0.0) for r, s in link["sent"].values()),
               key=lambda d: d[1], default=(0, 0.0))


def share(link: dict) -> float:
    return worst(link)[1]


def find_lossy(found: dict[tuple, dict], cfg: dict) -> dict:
    """The lossy links and nodes of one check, per network (``via``: one per rail).

    A link is lossy when one direction retransmitted ``retransmits_min`` segments or more, a
    share of ``retransmit_share`` of that direction's segments or more, or the link timed out
    ``rto_min`` times or more; and
    stands ``factor`` times above the reference, the 25th percentile of its network's other
    links in that measure (so a fabric that retransmits everywhere names no single link; with
    one link, two nodes, the thresholds alone decide). A node is named
    instead of its links when every link it has is lossy, two or more of them, each partner
    clean elsewhere (:func:`ddp_smoke.model.nodes_or_links`).

    Returns ``{"links": [(host_a, host_b, via) …], "nodes": [(host, via) …],
    "reference": {via: {"share", "rto"}}}``.
    """
    out: dict = {"links": [], "nodes": [], "reference": {}}
    for via in sorted({k[2] for k in found}, key=str):
        mine = {k[:2]: v for k, v in found.items() if k[2] == via}
        lossy = [p for p, v in mine.items() if _stands_out(v, [o for q, o in mine.items()
                                                               if q != p], cfg)]
        nodes, bad = nodes_or_links(lossy, mine)
        out["nodes"] += [(h, via) for h in nodes]
        out["links"] += [(*p, via) for p in bad]
        out["reference"][via] = {"share": _quartile([share(v) for v in mine.values()]),
                                 "rto": _quartile([v["rto"] or 0 for v in mine.values()])}
    return out


def _stands_out(link: dict, others: list[dict], cfg: dict) -> bool:
    """Above the thresholds and ``factor`` times the other links' 25th percentile (none on a
    run of two nodes: the thresholds alone)."""
    ref_share = _quartile([share(v) for v in others])
    ref_rto = _quartile([v["rto"] or 0 for v in others])
    retrans, worse = worst(link)
    return ((retrans >= cfg["retransmits_min"]
             and worse >= max(cfg["retransmit_share"], cfg["factor"] * ref_share))
            or (link["rto"] or 0) >= max(cfg["rto_min"], cfg["factor"] * ref_rto))


def _quartile(values: list[float]) -> float:
    values = sorted(values)
    return values[(len(values) - 1) // 4] if values else 0.0


def describe(link: dict) -> str:
    """The evidence in words: counts and share per direction, timeouts."""
    rto = "" if link["rto"] is None else (
        f"; {link['rto']} retransmission timeout(s) (nothing came back for 200 ms or more)")
    sent = ", ".join(f"{h} {r} of {s} ({100 * r / s:.2f} %)"
                     for h, (r, s) in sorted(link["sent"].items()) if s)
    return f"TCP segments sent again: {sent or 'none'}{rto}"


def figure(found: dict[tuple, dict]) -> list[dict]:
    """The check's links as a figure (only links that retransmitted)."""
    return [{"hosts": [a, b], "via": via, "retrans": v["retrans"], "rto": v["rto"],
             "segs": v["segs"], "sent": v["sent"]}
            for (a, b, via), v in sorted(found.items(), key=str) if v["retrans"]]


def culprits(found: dict[tuple, dict], cfg: dict, ranks: list[dict],
             rails: list | None = None) -> list[Culprit]:
    """The lossy nodes and links of :func:`find_lossy` as culprits: a node by its first rank, a
    link by both ends (each node's first rank); on a run with ``rails`` (the setting: one
    interface per local rank), the rail as well."""
    lossy = find_lossy(found, cfg)
    first: dict = {}
    for r, rec in enumerate(ranks):
        first.setdefault((rec.get("host"), rec.get("local_rank", 0)), r)
        first.setdefault(rec.get("host"), r)

    def rail(via):  # the rail's index, and the end's rank on it
        k = rails.index(via) if rails and via in rails else None
        return k, (None if k is None else {"index": k, "device": via, "port": None})

    out = []
    for h, via in lossy["nodes"]:
        k, on = rail(via)
        out.append(Culprit(first.get((h, k), first[h]), h, (
            f"node {h}{f' on rail {k} ({via})' if on else ''} loses packets on every link: "
            + "; ".join(f"with {p[0] if p[1] == h else p[1]}: {describe(v)}"
                        for p, v in sorted(found.items()) if h in p[:2] and p[2] == via)),
            rail=on))
    for a, b, via in lossy["links"]:
        k, on = rail(via)
        ra, rb = first.get((a, k), first[a]), first.get((b, k), first[b])
        ref = lossy["reference"][via]
        out.append(Culprit(None, None, (
            f"link {a} (rank {ra}) <-> {b} (rank {rb}){f' on rail {k} ({via})' if on else ''} "
            f"loses packets: {describe(found[(a, b, via)])}; its network's other links "
            f"{100 * ref['share']:.2f} %, {ref['rto']:g} timeout(s)"),
            ranks=[ra, rb], hosts=[a, b], rail=on))
    return out


def attach(result, posted: list[dict | None], ranks, cfg: dict) -> None:
    """Add the links figure to a judged check's result, and its lossy links and nodes as
    culprits (``cfg``: the run's config, for ``links`` and ``rails``). A skipped check stays
    skipped. Called before the stragglers are named: a lossy link's ends arrive late because
    of it, and :func:`ddp_smoke.coordination.stragglers.attach` names no rank named here."""
    found = links(posted, list(ranks))
    if not found:
        return
    result.figures["links"] = figure(found)
    named = culprits(found, cfg["links"], list(ranks), cfg["rails"])
    if named and result.status != "skip":
        result.status = "fail"
        result.summary = f"lossy: {named[0].reason}; {result.summary}"
        for c in named:  # the check named the same link or node already: one culprit, two
            same = [i for i, k in enumerate(result.culprits) if _key(k) == _key(c)]
            if same:  # pieces of evidence
                k = result.culprits[same[0]]
                result.culprits[same[0]] = dataclasses.replace(k, reason=f"{k.reason}; {c.reason}")
            else:
                result.culprits.append(c)


def _key(c: Culprit) -> tuple:
    return c.rank, sorted(c.ranks or []), (c.rail or {}).get("index")
