"""The stopped stage's result and the report of a run that stopped, from the store: the one
path every writer of an aborted run's report takes — rank 0, the lowest survivor that took over
from it, and the store host when no rank is left (its report of last resort). Each writer says
what it knows besides the store (:class:`Stopped`: the stage, the checks' results so far, who
writes) and which ranks it found dead; the evidence is read here in a few calls
(:func:`add_stopped_result`), :mod:`.blame` names the culprits, and :func:`report_of` makes the
report every writer hands to :func:`ddp_smoke.outputs.publish`.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from .. import __version__
from ..model import FAIL, SKIP, CheckResult, Report, check_from_dict
from . import blame, fate, keys, reach, records, repeat, retransmits, signing
from .store import (Silence, dead_after, dead_ranks, posted, ranks_with,
                    read_beats, reads, try_get)

FORENSICS_WAIT_S = 2.0  # the writer waits this long at most for the live ranks' forensics
BLAME_ONLY = ("waits", "held", "tcp")  # forensics blame reads; the report has them as culprits
STORE_HOST = "store host"  # the writer when no rank could write


@dataclass
class Stopped:
    """What the report's writer knows of a stopped run besides the store.

    Attributes:
        stage: the check (or ``init``/``finish``) where the run stopped.
        iteration: the pass over the checks it stopped in (repeat mode; else 0).
        world_size, checks, timeout_s: the run's shape and its per-phase deadline.
        ranks: every rank's identity record (:func:`identities`).
        judged: the results judged so far, ``(iteration, result)`` in order; the stopped
            stage's result is appended here.
        store_address: where the ranks' coordination store was (for "never connected").
        report_dir: the run's report folder, where the ranks' last words are.
        writer: who writes the report: ``rank 0``, ``rank N`` (took over), or STORE_HOST.
    """

    stage: str
    iteration: int
    world_size: int
    checks: list[str]
    timeout_s: float
    ranks: list[dict]
    judged: list[tuple[int, CheckResult]] = field(default_factory=list)
    store_address: str = "?"
    writer: str = "rank 0"
    report_dir: str = ""  # where the ranks' last words are (coordination/fate.py)
    link_rules: dict | None = None  # the run's ``links`` thresholds (coordination/retransmits.py)
    rules: dict | None = None  # its ``diagnosis`` thresholds (coordination/blame.py)
    rails: list | None = None       # the run's ``rails`` setting

    def host(self, rank: int) -> str | None:
        return self.ranks[rank].get("host") if 0 <= rank < len(self.ranks) else None

    def key(self, stage: str) -> str:
        return keys.stage(stage, self.iteration)


def identities(store, world_size: int) -> list[dict]:
    """Every rank's identity record, in one read; a rank that never posted one says so."""
    got = reads(store, keys.RANK, range(world_size))
    return [got.get(r) or records.Identity.never_connected(r) for r in range(world_size)]


def add_stopped_result(store, s: Stopped, dead: set[int], beats: dict[int, dict],
                       figures: dict | None = None, me: int | None = None) -> set[int]:
    """Append the stopped stage's result to ``s.judged``; return the ranks found alive.

    ``dead``: the ranks the writer found dead (its own looks at the heartbeats); ``beats``:
    every rank's last heartbeat (stage and collective progress); ``figures``: the writer's own
    figures for the result; ``me``: the writer's rank (None: the store host). A few store
    calls per kind of key, not one per rank: 16,384 ranks are blamed in a fraction of a
    second (bench/coordination_scale.py).
    """
    world = range(s.world_size)
    connected = {r for r, i in enumerate(s.ranks) if "missing" not in i}  # genuine records
    live = connected - dead
    reasons = posted(store, keys.ABORT)
    # The forensics blame reads: the Flight Recorder's last collective of the live ranks
    # inside one by their own count (never issued), and every rank's waits when the deadline
    # passed with all of them alive (slowed). The rest are the report's, and its writer waits
    # for them after blaming: waiting here for every live rank held the verdict at 1,024
    # simulated ranks for FORENSICS_WAIT_S.
    slowed = live == set(world) and any(a["kind"] == keys.TIMEOUT for a in reasons.values())
    needed = live if slowed else {r for r in live if (beats.get(r) or {}).get("inside")}
    # and a dead rank's node mates: their word on how it ended (fate.note) comes just before
    # their forensics (measured: an OOM kill blamed without it, "no heartbeat" alone)
    dead_hosts = {s.host(d) for d in dead}
    needed |= {r for r in live if s.host(r) in dead_hosts}
    found = posted(store, keys.FORENSICS, needed, FORENSICS_WAIT_S)
    # every live node leader's probes of the others (reach.py)
    probed = posted(store, keys.REACH, live & set(reach.leaders(store)), reach.wait_s(s.rules))
    arrive = keys.CONNECT if s.stage == "init" else keys.of(keys.ARRIVE, s.key(s.stage))
    # A rank that posted its observation arrived first: only the others' arrivals are read
    # (each record read is checked against the run's secret; 4,096 of them cost ~10 ms)
    finished = ranks_with(store, keys.of(keys.OBS, s.key(s.stage)), world)
    snap = blame.Snapshot(
        stage=s.stage, world_size=s.world_size, timeout_s=s.timeout_s,
        hosts=[i.get("host") for i in s.ranks], connected=connected,
        arrived=finished | ranks_with(store, arrive, [r for r in world if r not in finished]),
        finished=finished, dead=dead,
        aborts={r: a for r, a in reasons.items() if a["kind"] != keys.STOPPED},
        progress=beats, where={r: f["where"] for r, f in found.items() if f.get("where")},
        reach=probed, issued={r: f["issued"] for r, f in found.items()
                              if f.get("issued") is not None},
        waits={r: f["waits"] for r, f in found.items() if f.get("waits") is not None},
        held={r: f["held"] for r, f in found.items() if f.get("held")},
        lossy=retransmits.culprits(
            retransmits.links([(found.get(r) or {}).get("tcp") for r in world], s.ranks),
            s.link_rules, s.ranks, s.rails) if s.link_rules else [],
        fates=_fates(store, s, sorted(dead), me), store=s.store_address,
        rules=s.rules,
        dead_after_s=dead_after(s.world_size, s.rules))
    blamed = blame.assign(snap)
    # Each live rank leaves its forensics once it sees the abort, maybe after this
    # function began: a culprit's innermost frame is worth a short wait.
    unsaid = {k.rank for k in blamed.culprits if k.rank in live and k.where is None}
    if unsaid - set(found):
        found = posted(store, keys.FORENSICS, unsaid, FORENSICS_WAIT_S)
        for k in blamed.culprits:
            k.where = k.where or found.get(k.rank, {}).get("where")
    done = {k.name for it, k in s.judged if it == s.iteration}
    # Outside a check (process-group init, between checks) the run itself failed: "launch".
    name = s.stage if s.stage in s.checks and s.stage not in done else "launch"
    s.judged.append((s.iteration, CheckResult(
        name, FAIL, summary=f"stopped at {s.stage}: {blamed.culprits[0].reason}",
        culprits=blamed.culprits,
        figures={"arrived": sorted(snap.arrived), "finished": sorted(snap.finished),
                 "dead": sorted(dead), "victims": blamed.victims,
                 "progress": {str(r): p for r, p in sorted(beats.items())},
                 "probes": {str(r): p for r, p in sorted(probed.items())},
                 "aborts": [reasons[r] for r in sorted(reasons)], **(figures or {})})))
    return live


def _fates(store, s: Stopped, dead: list[int], me: int | None) -> dict[int, dict]:
    """How each dead rank ended: its node's word (posted with the forensics
    :func:`add_stopped_result` has waited for), its launcher's (waited for, where the launcher
    witnesses), else what the writer sees of it now where it shares the writer's host (its node
    mates looked as they saw the abort, maybe while it was still exiting), else its own last
    words in a shared report folder."""
    seen = reads(store, keys.FATE, dead)
    # (a rank of the writer's node: its host name, and the launcher's node number, since a
    # cloned host name is not one machine)
    mine = s.ranks[me] if me is not None else {}
    mates = [s.ranks[r] for r in dead if r not in seen and "group_rank" in mine
             and s.ranks[r].get("group_rank") == mine["group_rank"]]
    seen.update(fate.look(mates, -1, s.report_dir or "."))
    # A witnessing launcher's word on each rank whose process is gone is on its way
    ended = reads(store, keys.EXIT, dead)
    owed = {r for r in dead if (seen.get(r) or {}).get("gone")} if fate.witnessed() else set()
    end = time.monotonic() + fate.WITNESS_WAIT_S
    while owed - set(ended) and time.monotonic() < end:
        time.sleep(0.05)
        ended = reads(store, keys.EXIT, dead)
    out = {}
    for r in dead:
        got = {**(seen.get(r) or (fate.said(s.report_dir, r) if s.report_dir else {})),
               "exit": ended.get(r)}
        if any(got.values()):
            out[r] = got
    return out


def add_stopped_result_as_a_rank(store, s: Stopped, silence: Silence,
                                  me: int | None = None) -> set[int]:
    """A rank writes (rank ``me``: 0, or the survivor that took over): the dead are the ranks
    whose heartbeat it saw stop (``silence``: every look its watchdog took, and more now until
    each rank is silent or seen moving); a rank that announced its termination is not dead, it
    is leaving. When this rank's own watchdog aborted the run on ranks gone silent, a rank it
    saw moving since their last move was alive after the trouble began: no look to wait for.
    Appends the stopped stage's result; returns the ranks found alive."""
    connected = [r for r, i in enumerate(s.ranks) if "missing" not in i]
    mine = posted(store, keys.ABORT).get(me) or {}
    since = silence.last_moved(mine["silent"]) if mine.get("kind") == keys.LOST else None
    dead, beats = dead_ranks(store, connected, silence, since)
    # Read after the heartbeats' wait: a launcher that stops the others when one rank dies
    # signals this rank too, which may blame before a loaded peer has said it was terminated;
    # that peer then leaves, silent by the end of the wait (CI once named rank 1, "no
    # heartbeat", beside rank 2's SIGSEGV under torchrun). The writer is alive, whatever its
    # heartbeat did (a busy machine can starve its thread).
    terminated = {r for r, a in posted(store, keys.ABORT).items()
                  if a["kind"] == keys.TERMINATED}
    return add_stopped_result(store, s, set(dead) - terminated - {me}, beats, me=me)


def first_error(store, s: Stopped) -> dict:
    """The report's headline error: the culprit's, never a victim's. A rank blocked by a dead
    peer raises too ("Connection reset by peer"), often first; :func:`add_stopped_result` has just
    named who stopped the run (the last result): its error, else its reason, leads. With
    no rank named: the first rank that raised, else the stage the run stopped at."""
    errors = {r: e for r, e in sorted(posted(store, keys.ABORT).items())
              if e.get("kind") == keys.ERROR}
    culprits = [k for k in s.judged[-1][1].culprits if k.rank is not None] if s.judged else []
    named = [k.rank for k in culprits]
    for r in [r for r in named if r in errors] or ([] if named else list(errors)):
        e = errors[r]
        return {"rank": r, "host": s.host(r), "type": e.get("type"),
                "message": e.get("message"), "stage": e["stage"]}
    if culprits:
        return {"rank": culprits[0].rank, "host": culprits[0].host, "type": "Culprit",
                "message": culprits[0].reason, "stage": s.stage}
    return {"rank": None, "host": None, "type": "Aborted",
            "message": f"run aborted at {s.stage}", "stage": s.stage}


def report_of(s: Stopped, *, started_at: str, backend: str, config: dict, timings: dict,
              run_id: str, error: dict | None = None, forensics: dict | None = None,
              security: dict | None = None) -> Report:
    """The report of a run from the results its writer holds: repeat mode's iterations folded, every
    selected check the run did not reach as skip, each rank's forensics with its host."""
    results = repeat.combine(s.judged, [r.get("host") for r in s.ranks])
    done = {r.name for r in results}
    results += [CheckResult(n, SKIP, summary=f"not run: the run stopped at {s.stage}")
                for n in s.checks if n not in done]
    return Report(version=__version__, started_at=started_at, backend=backend,
                  world_size=s.world_size, ranks=s.ranks, checks=results, config=config,
                  timings=timings, error=error, run_id=run_id, written_by=s.writer,
                  forensics=[{"rank": r, "host": s.host(r),
                              **{k: v for k, v in f.items() if k not in BLAME_ONLY}}
                             for r, f in sorted((forensics or {}).items())],
                  security=security or {})


# -- the store host's report of last resort ---------------------------------------------------

def first_silent(silent_at: dict[int, float], after_s: float) -> list[int]:
    """The ranks whose heartbeats stopped first: within ``after_s`` (the world's heartbeat
    silence) of the earliest (one beat lost to the look period); a whole job killed at once
    names every rank."""
    if not silent_at:
        return []
    first = min(silent_at.values())
    return sorted(r for r, t in silent_at.items() if t <= first + after_s)


def last_resort(store, meta: dict, silent_at: dict[int, float], address: str, why: str) -> Report:
    """The store host's report when no rank could write one, made from what the store holds.

    ``meta``: the run's shape every rank posted (:func:`.hosting.post_meta`); ``silent_at``:
    each rank that beat, and when (``time.monotonic()`` of the store host) its heartbeat last
    moved; ``why``: why no rank wrote."""
    now = time.monotonic()
    world = int(meta["world_size"])
    cfg = meta.get("config") or {}
    checks = list(cfg.get("checks") or [])
    iteration = _iteration(store, checks)
    beats = read_beats(store, range(world))
    gone = first_silent(silent_at, dead_after(world, cfg.get("diagnosis")))
    stage = _stage(store, checks, iteration, world) or next(
        (beats[r]["stage"] for r in gone if beats.get(r, {}).get("stage")), "init")
    s = Stopped(stage=stage, iteration=iteration, world_size=world, checks=checks,
                timeout_s=float(cfg.get("timeout") or 0), ranks=identities(store, world),
                judged=[(it, check_from_dict(json.loads(g))) for it in range(iteration + 1)
                        for name in checks
                        if (g := try_get(store, keys.of(keys.RESULT, keys.stage(name, it))))],
                store_address=address, writer=STORE_HOST,
                report_dir=str(meta.get("report_dir") or ""), link_rules=cfg.get("links"),
                rules=cfg.get("diagnosis"),
                rails=cfg.get("rails"))
    first_t = min(silent_at.values(), default=now)
    add_stopped_result(store, s, set(gone), beats, {
        "why": why, "silent_first": gone,
        "silent_after_s": {str(r): round(t - first_t, 3) for r, t in sorted(silent_at.items())},
        "all_silent_for_s": round(now - max(silent_at.values()), 3) if silent_at else None})
    first = gone[0] if gone else None
    posted_at = float(meta.get("posted_at") or time.time())
    return report_of(
        s, started_at=str(meta.get("started_at") or ""), backend=_backend(store, cfg, world),
        config=cfg, timings={"total_s": round(time.time() - posted_at, 4)},
        run_id=(try_get(store, keys.RUN_ID) or b"").decode() or str(meta.get("run_id") or ""),
        error={"rank": first, "host": s.host(first) if first is not None else None,
               "type": "AllRanksLost", "stage": stage,
               "message": f"every rank went silent at {stage} ({why}); the store host wrote "
                          "this report from the store"},
        forensics=posted(store, keys.FORENSICS), security=signing.section(store))


def _iteration(store, checks: list[str]) -> int:
    """The last iteration any rank arrived at (repeat mode; 0 otherwise)."""
    it = 0
    while checks and try_get(
            store, keys.every(keys.of(keys.ARRIVE, keys.stage(checks[0], it + 1)))) is not None:
        it += 1
    return it


def _stage(store, checks: list[str], iteration: int, world: int) -> str | None:
    """The last check any rank arrived at: a heartbeat's stage may be a beat old, and a run
    that dies fast dies between two beats."""
    arrived = [n for n in checks
               if ranks_with(store, keys.of(keys.ARRIVE, keys.stage(n, iteration)), range(world))]
    return arrived[-1] if arrived else None


def _backend(store, cfg: dict, world: int) -> str:
    asked = cfg.get("backend") or "auto"
    if asked != "auto":
        return asked
    nccl = try_get(store, keys.BACKEND)  # rank 0's count of the ranks that can run NCCL
    return "nccl" if nccl is not None and int(nccl) == world else "gloo"
