"""Who stopped an aborted run: pure functions from an evidence snapshot to culprits and victims.

The report's culprit is what an operator drains, so blame rests on positive evidence, in this
order; the first kind found names the culprits, every other rank that stopped is a victim
(listed in the figures with what it was doing, never as a culprit):

1. terminated — the rank received SIGTERM/SIGINT/SIGUSR1/SIGUSR2 (a node reclaimed, a
   container stopped, a time limit). Every rank terminated: the launcher stopped the job;
2. raised — the check raised on that rank (not a communication error: those are symptoms);
3. died — its heartbeat stopped without a termination notice (killed, crashed, frozen, or its
   node lost the network);
4. never connected to the coordination store;
4b. reachability (:mod:`ddp_smoke.coordination.reach`): a node no other node can connect to,
   a link between two nodes that reach others but not each other, or one that carries a
   connection and not a large payload — the cause behind ranks that all wait, alive, in the
   process group's set-up or inside one collective; and ahead of 3. when every silent rank
   is on a node it names (a node cut off stops its heartbeats too);
5. did not arrive at the check the others were waiting in (process alive);
5b. a lossy link (:mod:`ddp_smoke.coordination.retransmits`): TCP timed out and sent again
   between two nodes in the stopped check — a link down for a while (a flapping port) holds
   the ranks at both ends inside a collective, alive, and ahead of 6. names it;
6. collective progress (:mod:`ddp_smoke.coordination.progress`): ranks that never *entered* the collective the
   others are blocked in, or are stuck in an older one; for a point-to-point exchange, the
   peer that is not in it; the ranks the others waited for in the check's collectives
   until its deadline passed (:mod:`ddp_smoke.coordination.stragglers`); ranks that did not
   finish a check with no collective in flight;
7. communication errors alone (a rank saw its peer vanish, nobody else was seen at fault).

Reasons say what happened; "within N s" only where that deadline really passed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..model import Culprit
from . import fate, reach, stragglers




@dataclass
class Snapshot:
    """What the writer of the report knows when it blames an aborted run.

    Attributes:
        stage: the check (or ``init``/``finish``) where the run stopped.
        world_size: ranks in the run.
        timeout_s: the per-phase deadline.
        hosts: host of each rank (None when it never said).
        connected: ranks that posted their identity to the store.
        arrived: ranks that arrived at ``stage``.
        finished: ranks that posted their observation of ``stage``.
        dead: ranks whose heartbeat stopped, terminated ones excluded.
        aborts: each aborting rank's first reason, as posted (:mod:`.records`: one type per
            kind of ``keys.ABORT_KINDS``, stopped ones left out; ``at``: wall time).
        progress: each rank's last published collective progress (``progress.progress()``,
            plus its ``stage``).
        where: innermost frame of the kit's code on each live rank's main thread.
        store: ``addr:port`` of the coordination store, for "never connected".
        dead_after_s: heartbeat silence that counts as dead.
        reach: each live node leader's probes of the others (``tried``, ``failed``).
        issued: each live rank's last collective handed to its backend (Flight Recorder).
        fates: how each dead rank ended, where a witness saw it (:mod:`.fate`).
        waits: each live rank's seconds inside each collective of ``stage`` until the abort
            (:mod:`.stragglers`).
        held: a node's CPU quota finding, by the rank that read it (its local rank 0), where
            the quota held that node's ranks back over the run so far.
        lossy: the links (or nodes) whose TCP connections lost packets in the stopped check,
            as culprits (:func:`ddp_smoke.coordination.retransmits.culprits`).
        rules: the run's ``diagnosis`` thresholds (None: the package's): ``stuck_after_s``
            here, the waits' in :func:`.stragglers.waits_and_stragglers`.
    """

    stage: str
    world_size: int
    timeout_s: float
    hosts: list
    connected: set = field(default_factory=set)
    arrived: set = field(default_factory=set)
    finished: set = field(default_factory=set)
    dead: set = field(default_factory=set)
    aborts: dict = field(default_factory=dict)
    progress: dict = field(default_factory=dict)
    where: dict = field(default_factory=dict)
    store: str = "?"
    dead_after_s: float = 1.5
    reach: dict = field(default_factory=dict)
    issued: dict = field(default_factory=dict)
    fates: dict = field(default_factory=dict)
    waits: dict = field(default_factory=dict)
    held: dict = field(default_factory=dict)
    lossy: list = field(default_factory=list)
    rules: dict | None = None


@dataclass
class Blame:
    culprits: list
    victims: list  # [{"rank", "host", "state"}]


def assign(s: Snapshot) -> Blame:
    """Culprits and victims of an aborted run (pure)."""
    net = reach.culprits(s.reach, s.hosts, s.rules)
    culprits = (_terminated_first(s) or _silenced_by(net, s)
                or (_raised(s) + _died(s) + _never(s)) or net or _absent(s) or _held_back(s)
                or s.lossy or _by_progress(s) or _slowed(s) or _unfinished(s) or _comm_only(s)
                or [Culprit(None, None, "aborted: " + "; ".join(
                    f"rank {r} {a['kind']}" for r, a in sorted(s.aborts.items())) or "unknown")])
    culprits += _held_nodes(s, culprits)
    named = {c.rank for c in culprits} | {r for c in culprits for r in (c.ranks or [])}
    first = _first_event(s, culprits)
    victims = [{"rank": r, "host": s.hosts[r], "state": _state(s, r, first)}
               for r in range(s.world_size) if r not in named and r in s.connected]
    return Blame(culprits, victims)


# -- the kinds of evidence, in order ----------------------------------------------------------

def _culprit(s: Snapshot, rank: int, reason: str) -> Culprit:
    return Culprit(rank, s.hosts[rank], reason, where=s.where.get(rank))


def _terminated_first(s: Snapshot) -> list:
    """Ranks terminated before any rank raised or died. A launcher that sees one worker fail
    stops the others (torchrun sends SIGTERM to the whole local group): terminations after
    a death or an error are its consequence, and those ranks are victims."""
    term = {r: a for r, a in s.aborts.items() if a["kind"] == "terminated"}
    first_fault = min([a.get("at", 0.0) for a in s.aborts.values()
                       if a["kind"] == "error" and not a.get("comm")] +
                      [_died_at(s, r) for r in s.dead], default=None)
    if not term or (first_fault is not None and first_fault <= min(a.get("at", 0.0)
                                                                  for a in term.values())):
        return []
    if s.connected and set(term) >= s.connected:
        names = sorted({a.get("signal", "a signal") for a in term.values()})
        return [Culprit(None, None, f"terminated by the launcher ({'/'.join(names)} to all "
                                    f"ranks) during {s.stage}")]
    return [_culprit(s, r, f"terminated by {a.get('signal', 'a signal')} during "
                           f"{a.get('stage', s.stage)}") for r, a in sorted(term.items())]


def _silenced_by(net: list, s: Snapshot) -> list:
    """The network's culprits, when they explain every silent rank: a node cut off, or one
    end of a dead link to the store's node, stops heartbeats too. The ranks on the named
    nodes went silent because their node lost the network, not because they died."""
    silent = set(s.dead) | {r for r in range(s.world_size) if r not in s.connected}
    hosts = {c.host for c in net} | {h for c in net for h in (c.hosts or [])}
    # the store's node (rank 0's, under every launcher) cut off: every other rank's heartbeat
    # stops reaching it, wherever that rank is
    store_cut = any(c.rank is not None and c.host == s.hosts[0] for c in net)
    if not net or not silent or (not store_cut and any(s.hosts[r] not in hosts
                                                       for r in silent)):
        return []
    return net if not _raised(s) else []


def _died_at(s: Snapshot, rank: int) -> float:
    """Wall time of a dead rank's last heartbeat (it died at most one beat later)."""
    return (s.progress.get(rank) or {}).get("t", 0.0)


def _raised(s: Snapshot) -> list:
    return [_culprit(s, r, a.get("reason") or f"raised {a.get('type')}: {a.get('message')}")
            for r, a in sorted(s.aborts.items()) if a["kind"] == "error" and not a.get("comm")]


def _died(s: Snapshot) -> list:
    out = []
    for r in sorted(s.dead):
        seen = fate.describe(s.fates.get(r) or {}, s.stage)
        out.append(_culprit(s, r, (
            f"{seen}; no heartbeat for {s.dead_after_s} s" if seen else
            f"no heartbeat for {s.dead_after_s} s during {s.stage}: the process died, or its "
            "node lost the network" if r in s.arrived or r in s.finished
            else f"died before arriving at {s.stage} (no heartbeat for {s.dead_after_s} s)")))
    return out


def _never(s: Snapshot) -> list:
    return [Culprit(r, s.hosts[r], f"never connected to the store at {s.store} (not started, "
                                   "or cannot reach it)")
            for r in range(s.world_size) if r not in s.connected]


def _deadline_passed(s: Snapshot) -> bool:
    return any(a["kind"] == "timeout" for a in s.aborts.values())


def _live(s: Snapshot) -> set:
    return s.connected - s.dead


def _absent(s: Snapshot) -> list:
    if s.stage in ("init", "finish"):
        waiting = s.connected - s.arrived if s.stage == "init" else set()
    else:
        waiting = _live(s) - s.arrived - s.finished
    if not waiting or not (s.arrived or s.stage == "init"):
        return []
    bound = f" within {s.timeout_s} s" if _deadline_passed(s) else ""
    return [_culprit(s, r, f"did not arrive at {s.stage}{bound} (process alive: hung?)")
            for r in sorted(waiting) if r not in s.aborts or s.aborts[r]["kind"] == "timeout"]


def _describe(p: dict) -> str:
    size = f", {p['bytes']} B" if p.get("bytes") else ""
    peer = f" with rank {p['peer']}" if p.get("peer") is not None else ""
    return f"{p.get('op')}{peer}{size}"


def _by_progress(s: Snapshot) -> list:
    """Blame by collective progress among the ranks stuck inside ``stage``."""
    stuck = {r: s.progress.get(r) or {} for r in sorted(_live(s) & s.arrived - s.finished)}
    blocked = {r: p for r, p in stuck.items() if p.get("inside") and p.get("peer") is None}
    if not blocked:
        return []
    k = max(p["seq"] for p in blocked.values())
    front = blocked_in = sorted(r for r, p in blocked.items() if p["seq"] == k)
    what = _describe(blocked[front[0]])
    behind = {r: p for r, p in stuck.items() if p.get("seq", 0) < k}
    if not behind:
        if len(blocked_in) == len(stuck) and len(stuck) == s.world_size:
            return _never_issued(s, blocked_in, k, what) or [Culprit(
                None, None, f"every rank entered collective #{k} ({what}) in "
                                        f"{s.stage} and none left: no rank lagged, the "
                                        "collective itself is stuck (network or backend)")]
        return []
    for seq in sorted({p["seq"] for p in behind.values() if p.get("inside")}):
        # ranks inside one older collective: one that never issued it holds the others there
        held = [r for r, p in behind.items() if p.get("inside") and p["seq"] == seq
                and p.get("peer") is None]
        low = _never_issued(s, held, seq, _describe(behind[held[0]])) if held else []
        if low:
            return low
    out, victims = [], set()
    for r, p in behind.items():
        if r in victims:
            continue
        peer = p.get("peer")
        if p.get("inside") and peer is not None:
            q = behind.get(peer)
            if q is not None and q.get("inside") and q.get("peer") == r:
                if r < peer:  # both inside the same exchange: the link between them
                    out.append(Culprit(None, None, (
                        f"link {s.hosts[r]} (rank {r}) <-> {s.hosts[peer]} (rank {peer}): "
                        f"their {_describe(p)} is stuck with both inside it"),
                        ranks=[r, peer], hosts=[s.hosts[r], s.hosts[peer]]))
                victims |= {r, peer}
                continue
            victims.add(r)  # r waits in an exchange its peer is not in: the peer is to blame
            if peer in stuck and peer not in behind:
                out.append(_culprit(s, peer, f"never entered the {p.get('op')} with rank {r}, "
                                             f"which waits in it ({_describe(p)})"))
            continue
        if p.get("inside"):
            if (p.get("for_s") or 0) < (s.rules or stragglers.RULES)["stuck_after_s"]:
                continue  # moving through it as the run stopped: not what held the others
            out.append(_culprit(s, r, (
                f"stuck inside collective #{p['seq']} ({_describe(p)}) for {p.get('for_s')} s "
                f"that other ranks completed; ranks {_ranks(front)} wait in #{k} ({what})")))
        else:
            last = f"#{p['seq']} ({_describe(p)})" if p.get("seq") else "none"
            out.append(_culprit(s, r, (
                f"never entered collective #{k} ({what}) of {s.stage} that ranks "
                f"{_ranks(front)} are blocked in; its last collective was {last}, left "
                f"{p.get('for_s')} s before")))
    out = [c for c in out if c.rank not in victims]
    return _unique(_narrowed(s, out))


def _held_back(s: Snapshot) -> list:
    """The deadline passed with every rank alive, and a node's CPU quota held its ranks back
    (its local rank 0's reading): that rank is the culprit, whatever the others' progress
    shows of where it held them (slow_rank.store_node.environment.slurm.4x1 named the rank
    it kept inside a collective, and not itself)."""
    if not _deadline_passed(s) or _live(s) != set(range(s.world_size)):
        return []
    return [_culprit(s, r, f"did not finish {s.stage} within {s.timeout_s} s: its node's CPU "
                           "quota held it back") for r in sorted(s.held) if r not in s.finished]


def _narrowed(s: Snapshot, out: list) -> list:
    """Several ranks named behind the others as the deadline passed: a rank too slow for it
    (a throttled GPU, a busy host) holds its neighbours in a ring or an exchange back with it,
    and at the abort they are between the same two collectives as it is (the campaign's
    slow_rank.rank0.join.image.3x1 named rank 2 beside rank 0). The slow ones are those the
    check's waits so far name (the rule a finished check's stragglers are named by); nobody
    picked out, all stay."""
    named = {c.rank for c in out if c.rank is not None}
    picked = set(_waited_for(s)) & named if len(named) > 1 else set()
    return [c for c in out if c.rank in picked] if picked else out


def _held_nodes(s: Snapshot, culprits: list) -> list:
    """The node of a named rank whose CPU quota held its ranks back: a culprit too, with the
    quota's finding (as the health check names it when the run gets that far)."""
    hosts = {s.hosts[c.rank] for c in culprits if c.rank is not None}
    return [Culprit(None, s.hosts[r], text) for r, text in sorted(s.held.items())
            if s.hosts[r] in hosts]


def _never_issued(s: Snapshot, ranks, k: int, what: str) -> list:
    """``ranks`` are inside collective #k by their own count: those whose Flight Recorder
    shows fewer collectives handed to the backend than the others never really entered it
    (a call that never reached the backend, a hung communication thread); the others wait
    for them. Nothing when a rank's recorder is unknown, or all agree."""
    got = {r: s.issued[r] for r in ranks if r in s.issued}
    if len(got) < max(2, len(ranks)):
        return []
    top = max(got.values())
    low = sorted(r for r, n in got.items() if n < top)
    return [_culprit(s, r, f"inside collective #{k} ({what}) by its own count, but never "
                           f"issued it to the backend: its Flight Recorder ends at collective "
                           f"{s.issued[r]}, the other ranks' at {top}, inside which they wait")
            for r in low]


def _slowed(s: Snapshot) -> list:
    """Every rank alive and inside the check past its deadline, none blocked in a collective
    another never entered: the ranks the others waited for in the check's collectives until
    the abort, by the rule a finished check's stragglers are named by (:mod:`.stragglers`).
    A rank too slow for the deadline (a CPU quota, a throttled GPU) held the others, and at
    the abort it may be between two collectives as they are."""
    if _live(s) != set(range(s.world_size)) or s.finished:
        return []
    return [_culprit(s, r, f"did not finish {s.stage} within {s.timeout_s} s: {reason}")
            for r, reason in _waited_for(s).items()]


def _waited_for(s: Snapshot) -> dict[int, str]:
    """The deadline passed and every rank's waits in the check are known: the ranks the others
    waited for (:func:`.stragglers.waits_and_stragglers`), with why; else none."""
    ranks = range(s.world_size)
    if not _deadline_passed(s) or any(r not in s.waits for r in ranks):
        return {}
    return dict(stragglers.waits_and_stragglers([s.waits[r] for r in ranks], s.rules)[1])


def _unfinished(s: Snapshot) -> list:
    """Alive ranks that arrived but did not finish, with no world collective in flight."""
    stuck = [r for r in sorted(_live(s) & s.arrived - s.finished)
             if not (s.progress.get(r) or {}).get("inside")]
    bound = f"within {s.timeout_s} s" if _deadline_passed(s) else "before the run stopped"
    return [_culprit(s, r, f"did not finish {s.stage} {bound} (process alive, not in a "
                           "collective)") for r in stuck]


def _comm_only(s: Snapshot) -> list:
    comm = sorted(r for r, a in s.aborts.items() if a["kind"] == "error" and a.get("comm"))
    if not comm:
        return []
    return [Culprit(None, None, f"communication errors on ranks {_ranks(comm)} and no rank "
                                f"seen dead, stuck or terminated: a network fault? (first: "
                                f"{s.aborts[comm[0]].get('message')})")]


# -- victims ------------------------------------------------------------------------------

def _first_event(s: Snapshot, culprits: list) -> tuple[str, float | None]:
    """What the culprits did, in words, and when (wall time, where known)."""
    ranks = [c.rank for c in culprits if c.rank is not None]
    if not ranks:
        return "the run stopped", None
    r = ranks[0]
    a = s.aborts.get(r) or {}
    who = f"rank {r}" if len(ranks) == 1 else f"ranks {_ranks(ranks)}"
    if a.get("kind") == "terminated":
        return f"{who} was terminated", a.get("at")
    if a.get("kind") == "error":
        return f"{who} raised", a.get("at")
    if r in s.dead:
        return f"{who} died", _died_at(s, r)
    return f"{who} stopped making progress", None


def _state(s: Snapshot, r: int, first: tuple[str, float | None]) -> str:
    """A victim's state in words: what it was doing and how it stopped."""
    event, at = first
    a = s.aborts.get(r) or {}
    p = s.progress.get(r) or {}
    doing = (f"blocked in {_describe(p)} #{p.get('seq')}" if p.get("inside")
             else "finished " + s.stage if r in s.finished else f"in {p.get('stage', s.stage)}")
    if a.get("at") is not None and at is not None and a["at"] >= at:
        how = f"stopped {a['at'] - at:.1f} s after {event}"
    else:
        how = f"stopped because {event}"
    if a.get("kind") == "terminated":
        how = f"terminated by {a.get('signal')}, " + how
    elif a.get("kind") == "error":
        how += f" ({'communication error' if a.get('comm') else 'error'}: {a.get('message')})"
    elif a.get("kind") == "timeout":
        how += f" (its own {s.timeout_s} s deadline passed waiting for {a.get('waiting_for')})"
    return f"{doing}; {how}"


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return ", ".join(map(str, ranks[:8])) + (f" … ({len(ranks)} ranks)" if len(ranks) > 8 else "")


def _unique(culprits: list) -> list:
    seen, out = set(), []
    for c in culprits:
        key = (c.rank, tuple(c.ranks or ()), c.reason)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out
