"""The report of last resort: written by the store host when no rank can write one.

Every rank posts the run's shape once, first one wins
(:func:`ddp_smoke.coordination.hosting.post_meta`: world size, config, report folder, start
time), so the store host, which knows nothing of the run by itself, can read the store back:
identities, heartbeats (stage and collective progress), results rank 0 judged, aborts and
forensics. :func:`build` judges the stage where the ranks went silent with the same rules as a
rank would (:mod:`ddp_smoke.coordination.blame`), naming the ranks whose heartbeats stopped
first as dead, and returns a Report of the worker's schema (:mod:`ddp_smoke.model`).
"""
from __future__ import annotations

import json
import sys
import time

from .. import __version__
from ..coordination import blame, keys
from ..coordination.store import DEAD_AFTER_S, dead_after, posted, ranks_with, reads, try_get
from ..errors import ReportWriteError
from ..model import FAIL, SKIP, CheckResult, Report, check_from_dict
from ..coordination import repeat
from .report import write_report

WRITER = "store host"  # the report's `writer` figure when this module wrote it



def first_silent(silent_at: dict[int, float], after_s: float = DEAD_AFTER_S) -> list[int]:
    """The ranks whose heartbeats stopped first: within ``after_s`` (the world's heartbeat
    silence) of the earliest (one beat lost to the look period); a whole job killed at once
    names every rank."""
    if not silent_at:
        return []
    first = min(silent_at.values())
    return sorted(r for r, t in silent_at.items() if t <= first + after_s)


def build(store, meta: dict, silent_at: dict[int, float], address: str,
          why: str) -> Report:
    """The report from what the store holds. ``silent_at``: each rank that beat, and when
    (the store host's own clock, seconds) its heartbeat last moved; ``why``: why no rank
    wrote (for the summary)."""
    world = int(meta["world_size"])
    cfg = meta.get("config") or {}
    checks = list(cfg.get("checks") or [])
    everyone = range(world)
    got = reads(store, keys.RANK, everyone)
    ranks = [got.get(r) or {"rank": r, "local_rank": None, "host": None,
                            "missing": "never connected to the store"} for r in everyone]
    hosts = [r.get("host") for r in ranks]
    beats = reads(store, keys.BEAT, everyone)
    gone = first_silent(silent_at, dead_after(world))
    iteration = _iteration(store, checks)
    stage = _stage(store, checks, iteration, everyone) or next(
        (beats[r]["stage"] for r in gone if beats.get(r, {}).get("stage")), "init")
    judged = [(it, check_from_dict(json.loads(g))) for it in range(iteration + 1)
              for name in checks
              if (g := try_get(store, keys.of(keys.RESULT, keys.stage(name, it))))]
    aborts = posted(store, keys.ABORT)
    found = posted(store, keys.FORENSICS)
    arrive = (keys.CONNECT if stage == "init" else
              keys.of(keys.ARRIVE, keys.stage(stage, iteration)))
    snap = blame.Snapshot(
        stage=stage, world_size=world, timeout_s=float(cfg.get("timeout") or 0), hosts=hosts,
        connected=ranks_with(store, keys.RANK, everyone),
        arrived=ranks_with(store, arrive, everyone),
        finished=ranks_with(store, keys.of(keys.OBS, keys.stage(stage, iteration)),
                            everyone), dead=set(gone),
        aborts={r: a for r, a in aborts.items() if a.get("kind") != keys.STOPPED},
        progress=beats, where={r: f["where"] for r, f in found.items() if f.get("where")},
        store=address, dead_after_s=dead_after(world))
    blamed = blame.judge(snap)
    last = max(silent_at.values(), default=0.0)
    figures = {"writer": WRITER, "why": why, "silent_first": gone,
               "silent_after_s": {str(r): round(t - min(silent_at.values()), 3)
                                  for r, t in sorted(silent_at.items())},
               "all_silent_for_s": round(time.monotonic() - last, 3) if silent_at else None,
               "arrived": sorted(snap.arrived), "finished": sorted(snap.finished),
               "victims": blamed.victims,
               "progress": {str(r): p for r, p in sorted(beats.items())},
               "aborts": [aborts[r] for r in sorted(aborts)]}
    done = {c.name for it, c in judged if it == iteration}
    name = stage if stage in checks and stage not in done else "launch"
    culprits = blamed.culprits
    judged.append((iteration, CheckResult(
        name, FAIL, summary=f"stopped at {stage}: {culprits[0].reason} (no rank could write "
                            "the report: the store host wrote it)",
        culprits=culprits, figures=figures)))
    results = repeat.combine(judged, hosts)
    named = {c.name for c in results}
    results += [CheckResult(n, SKIP, summary=f"not run: the run stopped at {stage}")
                for n in checks if n not in named]
    first = gone[0] if gone else None
    run_id = (try_get(store, keys.RUN_ID) or b"").decode() or str(meta.get("run_id") or "")
    return Report(
        version=__version__, started_at=str(meta.get("started_at") or ""),
        backend=_backend(store, cfg, world), world_size=world, ranks=ranks, checks=results,
        config=cfg, timings={"total_s": round(time.time() - float(meta.get("posted_at")
                                                                  or time.time()), 4)},
        error={"rank": first, "host": hosts[first] if first is not None else None,
               "type": "AllRanksLost", "stage": stage,
               "message": f"every rank went silent at {stage} ({why}); the store host wrote "
                          "this report from the store"},
        forensics=[{"rank": r, "host": hosts[r] if r < world else None, **f}
                   for r, f in sorted(found.items())],
        run_id=run_id)


def _iteration(store, checks: list[str]) -> int:
    """The last iteration any rank arrived at (repeat mode; 0 otherwise)."""
    it = 0
    while checks and try_get(
            store, keys.every(keys.of(keys.ARRIVE, keys.stage(checks[0], it + 1)))) is not None:
        it += 1
    return it


def _stage(store, checks: list[str], iteration: int, everyone) -> str | None:
    """The last check any rank arrived at: a heartbeat's stage may be a beat old, and a run
    that dies fast dies between two beats."""
    arrived = [n for n in checks
               if ranks_with(store, keys.of(keys.ARRIVE, keys.stage(n, iteration)), everyone)]
    return arrived[-1] if arrived else None


def _backend(store, cfg: dict, world: int) -> str:
    asked = cfg.get("backend") or "auto"
    if asked != "auto":
        return asked
    nccl = try_get(store, keys.BACKEND)  # rank 0's count of the ranks that can run NCCL
    return "nccl" if nccl is not None and int(nccl) == world else "gloo"


def write(watch, address: str, report_dir: str | None, why: str) -> int:
    """Build and write the report from what ``watch`` saw and the store holds; set ``final``
    so that a rank still waiting leaves. Returns 1 (the run failed, and no rank said so)."""
    report = build(watch.store, watch.meta, dict(watch.moved), address, why)
    try:  # a rank that still lives waits for `final` instead of taking over: no rank number
        watch.store.compare_set(keys.WRITER, "", str(watch.meta["world_size"]))
    except (RuntimeError, OSError):
        pass
    folder = report_dir or watch.meta.get("report_dir") or "."
    try:
        path = write_report(report, folder)
    except (ReportWriteError, OSError) as e:
        say(f"error: {e}; the report follows as one JSON line")
        print(report.to_json_line(), file=sys.stderr, flush=True)
        return 1
    say(f"no rank wrote the report ({why}); wrote {path}")
    watch.store.set(keys.FINAL, report.verdict)  # the ranks still waiting leave now
    return 1


def say(message: str) -> None:
    print(f"ddp-smoke store host: {message}", file=sys.stderr, flush=True)
