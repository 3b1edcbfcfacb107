"""The writer's judgement of an aborted run: the store's evidence, read in a few calls, then
:mod:`.blame` names the culprits of the stage where the run stopped."""
from __future__ import annotations

from ..model import FAIL, CheckResult
from . import blame, fate, keys, reach
from .store import DEAD_AFTER_S, dead_ranks, posted, ranks_with, reads

FORENSICS_WAIT_S = 2.0  # the writer waits this long at most for the live ranks' forensics


def judge_abort(c, store) -> set[int]:
    """Append the failed stage's result to ``c.judged``; return the ranks found alive.

    A few store calls per kind of key, not one per rank: 4,096 ranks are judged in a fraction
    of a second after a watched abort (bench/coordination_scale.py).
    """
    stage, world = c.stage, range(c.env.world_size)
    ids = c.identities(store)
    connected = {r for r, i in enumerate(ids) if "missing" not in i}  # genuine records
    reasons = posted(store, keys.ABORT)
    terminated = {r for r, a in reasons.items() if a["kind"] == keys.TERMINATED}
    dead, beats = dead_ranks(store, sorted(connected), terminated, c.silence)
    reasons = {**posted(store, keys.ABORT), **reasons}  # and those posted while we looked
    live = connected - set(dead)
    # every live rank's forensics (its Flight Recorder's last collective is evidence too)
    found = posted(store, keys.FORENSICS, live, FORENSICS_WAIT_S)
    # every live node leader's probes of the others (reach.py)
    probed = posted(store, keys.REACH, live & set(reach.leaders(store)), reach.WAIT_S)
    arrive = keys.CONNECT if stage == "init" else keys.of(keys.ARRIVE, c.key(stage))
    # A rank that posted its observation arrived first: only the others' arrivals are read
    # (each record read is checked against the run's secret; 4,096 of them cost ~10 ms)
    finished = ranks_with(store, keys.of(keys.OBS, c.key(stage)), world)
    snap = blame.Snapshot(
        stage=stage, world_size=c.env.world_size, timeout_s=float(c.cfg["timeout"]),
        hosts=[i.get("host") for i in ids], connected=connected,
        arrived=finished | ranks_with(store, arrive, [r for r in world if r not in finished]),
        finished=finished,
        dead=set(dead), aborts={r: a for r, a in reasons.items() if a["kind"] != keys.STOPPED},
        progress=beats, where={r: f["where"] for r, f in found.items() if f.get("where")},
        reach=probed, issued={r: f["issued"] for r, f in found.items() if "issued" in f},
        fates=_fates(c, store, sorted(dead)),
        store=c.env.store_address, dead_after_s=DEAD_AFTER_S)
    verdict = blame.judge(snap)
    # Each live rank leaves its forensics once it sees the abort, maybe after this judge
    # began: a culprit's innermost frame is worth a short wait.
    unsaid = {k.rank for k in verdict.culprits if k.rank in live and k.where is None}
    if unsaid - set(found):
        found = posted(store, keys.FORENSICS, unsaid, FORENSICS_WAIT_S)
        for k in verdict.culprits:
            k.where = k.where or found.get(k.rank, {}).get("where")
    figures = {"arrived": sorted(snap.arrived), "finished": sorted(snap.finished),
               "dead": sorted(dead), "victims": verdict.victims,
               "progress": {str(r): p for r, p in sorted(beats.items())},
               "unreached": {str(r): p["failed"] for r, p in sorted(probed.items())
                             if p.get("failed")},
               "aborts": [reasons[r] for r in sorted(reasons)],
               "writer": f"rank {c.env.rank}"}  # rank 0, or the survivor that took over
    judged = {k.name for it, k in c.judged if it == c.iteration}
    # Outside a check (process-group init, between checks) the run itself failed: "launch".
    name = stage if stage in c.checks and stage not in judged else "launch"
    c.judged.append((c.iteration, CheckResult(
        name, FAIL, summary=f"stopped at {stage}: {verdict.culprits[0].reason}",
        culprits=verdict.culprits, figures=figures)))
    return live


def _fates(c, store, dead: list[int]) -> dict[int, dict]:
    """How each dead rank ended: its node's word (posted with the forensics the judge has
    waited for), its launcher's, else its own last words in a shared report folder."""
    seen, ended = reads(store, keys.FATE, dead), reads(store, keys.EXIT, dead)
    out = {}
    for r in dead:
        got = {**(seen.get(r) or fate.said(c.report_dir, r)), "exit": ended.get(r)}
        if any(got.values()):
            out[r] = got
    return out


def first_error(c, store) -> dict:
    """The report's headline error: the culprit's, never a victim's. A rank blocked by a dead
    peer raises too ("Connection reset by peer"), often first; :func:`judge_abort` has just
    named who stopped the run (the last judged result): its error, else its reason, leads. With
    no rank named: the first rank that raised, else the stage the run stopped at."""
    errors = {r: e for r, e in sorted(posted(store, keys.ABORT).items())
              if e.get("kind") == keys.ERROR}
    culprits = [k for k in c.judged[-1][1].culprits if k.rank is not None] if c.judged else []
    named = [k.rank for k in culprits]
    for r in [r for r in named if r in errors] or ([] if named else list(errors)):
        e = errors[r]
        return {"rank": r, "host": c.host(r), "type": e.get("type"),
                "message": e.get("message"), "stage": e["stage"]}
    if culprits:
        return {"rank": culprits[0].rank, "host": culprits[0].host, "type": "Culprit",
                "message": culprits[0].reason, "stage": c.stage}
    return {"rank": None, "host": None, "type": "Aborted",
            "message": f"run aborted at {c.stage}", "stage": c.stage}


def forensics_of(c, found: dict[int, dict]) -> list[dict]:
    """The report's forensics list: each rank's, with its host."""
    return [{"rank": r, "host": c.host(r), **f} for r, f in sorted(found.items())]
