"""The harness: runs the selected checks on every rank, bounds every wait, gathers the report.

Coordination goes through the launcher's TCPStore, never through the backend under test, so it
works the same for gloo and NCCL and still works when a collective is stuck:

* each rank posts its identity; the ranks agree on the backend; then for every check each
  rank arrives (it posts a key of its own; rank 0 waits for all of them in one blocking
  store wait and raises a flag the others wait for), runs the check and posts its
  observation as JSON; rank 0 waits for all observations in one call, reads them in one
  more and judges. Three store calls per rank per check, however long the check takes;
  nothing polls;
* a heartbeat thread per rank publishes, on its own store connection, a beat counter, the
  stage and the rank's collective progress (:mod:`ddp_smoke.comm`);
* a watchdog thread per rank, on its own connection, watches the deadline, the shared abort
  flag and termination signals (SIGTERM, SIGINT, SIGUSR1, SIGUSR2 arrive through a wakeup fd,
  because the main thread may sit inside a C++ collective or a store wait, where Python
  handlers cannot run); rank 0's also watches the heartbeats of the ranks it waits for.
  The watchdog finishes an aborted run itself, so nothing ever has to wake the main thread;
* any rank that errs, times out or is terminated posts an abort with its reason; every live
  rank then leaves its forensics (:mod:`ddp_smoke.forensics`), and the report's writer judges
  from the evidence (:mod:`ddp_smoke.blame`), writes the report with what was measured, and
  every rank exits 1.

How the store's keys are searched and read back, and what the heartbeats say about who is
alive, is :mod:`ddp_smoke.storekeys`.

The writer is rank 0; when rank 0 is gone (its heartbeat stopped) the lowest surviving rank
takes over, from the results rank 0 posted to the store as it judged each check. When the
store itself is gone, each surviving rank prints one JSON line of what it knows on stderr.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import select
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import (__version__, blame, checks, comm, forensics, metrics, plot, repeat, runtime,
               summary, triage)
from .config import ConfigError, report_dir as default_report_dir
from .faults import Injector, parse_faults
from .outputs import page
from .report import (FAIL, SKIP, CheckResult, Culprit, Report, ReportWriteError,
                     check_from_dict, clear_stale, write_report)
from .storekeys import (BEAT_S, DEAD_AFTER_S, POLL_MAX_S, STORE_OPS_PER_S, Silence, beat_of,
                        dead_ranks, look_period, next_waiting, posted, ranks_with, read_beats,
                        reads, try_get, wait_key)

FINAL_WAIT_S = 10.0    # how long a rank waits for the report after an abort, beyond judging
TAKEOVER_S = 3 * DEAD_AFTER_S  # rank 0 silent this long, before writing: a survivor writes
FORENSICS_WAIT_S = 2.0  # the writer waits this long at most for the live ranks' forensics
GRACE_S = 5.0          # the main thread's waits outlast the deadline by this: the watchdog acts
TERMINATING = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "SIGINT", signal.SIGUSR1: "SIGUSR1",
               signal.SIGUSR2: "SIGUSR2"}
# Messages of backend errors seen by a rank whose peer vanished: the rank is a victim.
_COMM_MARKERS = ("Connection closed by peer", "Connection reset by peer", "gloo/transport",
                 "Broken pipe", "NCCL communicator was aborted", "Timed out waiting")


@dataclass
class Context:
    """What a check's ``run(ctx)`` may use on its rank."""

    env: runtime.LaunchEnv
    backend: str
    device: torch.device
    config: dict[str, Any]
    faults: Injector
    report_dir: str
    storage_dir: str

    rank = property(lambda self: self.env.rank)
    world_size = property(lambda self: self.env.world_size)
    local_rank = property(lambda self: self.env.local_rank)
    timeout_s = property(lambda self: float(self.config["timeout"]))

    def section(self, name: str) -> dict[str, Any]:
        """The check's own options (its section in defaults.yaml)."""
        return self.config.get(name, {})


@dataclass
class Evidence:
    """What a check's ``judge(ev)`` sees on rank 0: every rank's observation, by rank."""

    name: str
    observations: list[dict[str, Any]]
    ranks: list[dict[str, Any]]
    config: dict[str, Any]

    world_size = property(lambda self: len(self.observations))

    def host(self, rank: int) -> str | None:
        return self.ranks[rank].get("host") if rank < len(self.ranks) else None

    def culprit(self, rank: int | None, reason: str) -> Culprit:
        """A culprit with the host filled in from the rank's identity."""
        return Culprit(rank, None if rank is None else self.host(rank), reason)

    def link_culprit(self, a: int, b: int, reason: str) -> Culprit:
        """The link between ranks ``a`` and ``b``: both ends named, neither convicted."""
        return Culprit(None, None, reason, ranks=[a, b], hosts=[self.host(a), self.host(b)])

    def section(self, name: str | None = None) -> dict[str, Any]:
        return self.config.get(name or self.name, {})


class _Stop(Exception):
    """The run is being aborted; the reason is already posted to the store."""


class _Coordinator:
    """Store protocol and the once-only finalisation shared by the main and watchdog threads."""

    def __init__(self, env, cfg, connect, started_at, t0):
        self.env, self.cfg, self.checks = env, cfg, cfg["checks"]
        self.started_at, self.t0 = started_at, t0
        self.store = connect(may_host=True)        # main thread's (rank 0 may host the store)
        self.wd_store = connect(may_host=False)    # watchdog's: a blocked call must not block it
        self.beat_store = connect(may_host=False)  # heartbeat's: it beats until the process ends
        self._lock = threading.Lock()  # guards stage/deadline: read as one snapshot
        self._stage, self._deadline = "init", None
        self.iteration = 0  # repeat mode: which pass over the checks (0-based)
        self.judged: list[tuple[int, CheckResult]] = []  # (iteration, result), in order
        self.timings: dict[str, float] = {}
        self.ranks: list[dict] = []
        self.backend = "?"
        self.report_dir = ""
        self.finalized = False
        self.report_lost = False  # the report could not be written (it went to stderr)
        self.leaving = False  # set once this rank has its verdict: store errors are expected now
        self.stop = threading.Event()  # ends the heartbeat and watchdog threads on a clean exit
        self.threads: list[threading.Thread] = []
        # the verdict's pollers use a quarter of the store's budget: 0.82 s apart at 4,096
        self.poll_max = max(POLL_MAX_S, 4 * env.world_size / STORE_OPS_PER_S)
        # rank 0, while it waits for every rank's prefix/<rank>: (what it waits for, prefix)
        self.awaiting: tuple[str, str] | None = None
        self.silence = Silence(DEAD_AFTER_S)  # every look at the heartbeats, kept: the judge
        self._forensics: dict | None = None  # this rank's own

    # -- phase, read as one snapshot by the watchdog -------------------------------------
    def enter(self, stage: str, deadline_s: float | None) -> None:
        with self._lock:
            self._stage = stage
            self._deadline = None if deadline_s is None else time.monotonic() + deadline_s

    def phase(self) -> tuple[str, float | None]:
        with self._lock:
            return self._stage, self._deadline

    @property
    def stage(self) -> str:
        return self.phase()[0]

    def expired(self) -> bool:
        deadline = self.phase()[1]
        return deadline is not None and time.monotonic() > deadline

    # -- posting -------------------------------------------------------------------------
    def abort(self, store, kind: str, detail: dict | None = None) -> None:
        """Tell everyone the run stops, and why, from this rank's point of view."""
        body = {"rank": self.env.rank, "kind": kind, "stage": self.stage, "at": time.time(),
                **(detail or {})}
        text = json.dumps(body)
        try:  # the first reason stands: a SIGTERM after an error must not hide the error
            if store.compare_set(f"abort/{self.env.rank}", "", text) == text.encode():
                store.append("abort/listed", f"{self.env.rank},")  # the run is aborted now
        except Exception:  # noqa: BLE001 — the store host may be gone; nothing left to tell
            pass

    def aborted(self, store) -> bool:
        return store.check(["abort/listed"])

    def key(self, stage: str) -> str:
        """A stage's store key: the check name and the iteration."""
        return f"{stage}/{self.iteration}"

    def arrive(self, store, prefix: str, what: str) -> None:
        """Post ``prefix/<rank>`` and wait until every rank has (or raise _Stop). Rank 0
        waits for all of them in one call and then raises ``prefix/all``, which every other
        rank waits for: two store calls per rank, whatever the world size."""
        store.set(f"{prefix}/{self.env.rank}", "1")
        if self.env.rank == 0:
            self.await_all(store, prefix, what)
            store.set(f"{prefix}/all", "1")
        else:
            self.wait_for(store, [f"{prefix}/all"], what)

    def await_all(self, store, prefix: str, what: str) -> None:
        """Rank 0: wait until every rank has posted ``prefix/<rank>``. Meanwhile its
        watchdog watches the heartbeats of the ranks still missing (:meth:`_Watchdog.watch`)."""
        with self._lock:
            self.awaiting = (what, prefix)
        try:
            self.wait_for(store, [f"{prefix}/{r}" for r in range(self.env.world_size)], what)
        finally:
            with self._lock:
                self.awaiting = None

    def wait_for(self, store, keys: list[str], what: str) -> None:
        """Block until every key in ``keys`` exists: the store's own wait, one call, no
        polling.

        Nothing has to wake this thread when the run is aborted: the watchdog sees the abort,
        the deadline or a silent rank, and ends the process itself. The wait is bounded by
        the stage's deadline and GRACE_S more, for the watchdog to act first; only if it has
        not does this thread abort. (A bounded wait that times out makes c10d log two
        warning lines: slices of a few seconds flooded a slow run's output with them.)
        """
        while True:
            deadline = self.phase()[1]
            left = float(self.cfg["timeout"]) if deadline is None else deadline - time.monotonic()
            bound, t = max(0.0, left) + GRACE_S, time.monotonic()
            try:
                store.wait(keys, datetime.timedelta(seconds=bound))
                return
            except dist.DistStoreError:  # timed out (a lost store raises DistNetworkError)
                if time.monotonic() - t < bound / 2:
                    raise  # not a timeout: an error of the store's, not to be waited out
                if self.aborted(store):
                    raise _Stop from None
                if self.expired():
                    self.abort(store, "timeout", {"waiting_for": what})
                    raise _Stop from None

    def gather(self, store, stage: str) -> list[dict]:
        """Rank 0: every rank's observation of ``stage``, read in one call once all are in."""
        prefix = f"obs/{self.key(stage)}"
        self.await_all(store, prefix, f"every rank to finish {stage}")
        return [json.loads(v) for v in
                store.multi_get([f"{prefix}/{r}" for r in range(self.env.world_size)])]

    def post_observation(self, store, stage: str, obs: dict) -> None:
        store.set(f"obs/{self.key(stage)}/{self.env.rank}", json.dumps(obs))

    # -- the report's writer ---------------------------------------------------------------
    def finalize(self, store, aborted: bool) -> Report | None:
        """Write the report once; returns it, or None if this process already wrote it."""
        with self._lock:
            if self.finalized:
                return None
            self.finalized = True
        try:
            store.compare_set("writer", "", str(self.env.rank))
        except Exception:  # noqa: BLE001 — the store is gone; write what this rank knows
            pass
        found = {}
        if aborted:
            live = self._judge_abort(store)
            # the report lists every live rank's forensics: the last ones may still come
            found = posted(store, "forensics", live, FORENSICS_WAIT_S)
        self.timings["total_s"] = round(time.monotonic() - self.t0, 4)
        report = Report(version=__version__, started_at=self.started_at, backend=self.backend,
                        world_size=self.env.world_size, ranks=self._identities(store),
                        checks=self._with_unrun(), config=self.cfg, timings=self.timings,
                        error=self._first_error(store) if aborted else None,
                        forensics=self._all_forensics(found),
                        run_id=self.env.run_id)
        try:
            path = write_report(report, self.report_dir)
            plot.write_busbw_png(report, self.report_dir)  # only with matplotlib installed
            page.write(report, self.report_dir)  # report.html; never raises
        except (ReportWriteError, OSError) as e:  # full, over quota, read-only, stale NFS
            path, self.report_lost = f"(not written: {e})", True
            print(f"ddp-smoke: error: {e}; the report follows as one JSON line",
                  file=sys.stderr)
            print(report.to_json_line(), file=sys.stderr)
        summary.print_report(report, path)
        triage.finish(report, self.report_dir, self.env.run_id)  # host lists, next steps, --act
        metrics.write(report, self.env.run_id)  # --prometheus FILE, when set
        try:  # always, so that the other ranks leave now; a lost report is no pass
            store.set("final", "fail" if self.report_lost else report.verdict)
        except Exception:  # noqa: BLE001
            pass
        return report

    def post_result(self, store, result: CheckResult) -> None:
        """Rank 0 keeps each judged result in the store too: a survivor may have to write."""
        self.judged.append((self.iteration, result))
        try:
            store.set(f"result/{self.key(result.name)}", json.dumps(dataclasses.asdict(result)))
        except Exception:  # noqa: BLE001 — the report is still written from memory
            pass

    def adopt_results(self, store) -> None:
        """A survivor that writes the report takes rank 0's judged results from the store."""
        if self.env.rank == 0:
            return
        self.judged = [(it, check_from_dict(json.loads(got)))
                       for it in range(self.iteration + 1) for name in self.checks
                       if (got := try_get(store, f"result/{name}/{it}"))]
        unjudged = [n for n in self.checks if (self.iteration, n) not in
                    {(it, r.name) for it, r in self.judged}]
        if unjudged and self.stage not in unjudged:  # rank 0 died before judging it
            self.enter(unjudged[0], None)

    def _identities(self, store) -> list[dict]:
        if len(self.ranks) == self.env.world_size:
            return self.ranks
        got = reads(store, "rank", range(self.env.world_size))
        self.ranks = [got.get(r) or {"rank": r, "local_rank": None, "host": None,
                                        "missing": "never connected to the store"}
                      for r in range(self.env.world_size)]
        return self.ranks

    def _with_unrun(self) -> list[CheckResult]:
        results = repeat.combine(self.judged, [r.get("host") for r in self.ranks])
        done = {c.name for c in results}
        rest = [CheckResult(n, SKIP, summary=f"not run: the run stopped at {self.stage}")
                for n in self.checks if n not in done]
        return results + rest

    def _first_error(self, store) -> dict | None:
        for r, e in sorted(posted(store, "abort").items()):
            if e.get("kind") == "error":
                return {"rank": r, "host": self.ranks[r]["host"] if r < len(self.ranks) else None,
                        "type": e.get("type"), "message": e.get("message"), "stage": e["stage"]}
        return {"rank": None, "host": None, "type": "Aborted",
                "message": f"run aborted at {self.stage}", "stage": self.stage}

    def _all_forensics(self, found: dict[int, dict]) -> list[dict]:
        return [{"rank": r, "host": self.ranks[r].get("host") if r < len(self.ranks) else None,
                 **f} for r, f in sorted(found.items())]

    def _judge_abort(self, store) -> set[int]:
        """Name the culprits of the stage where the run stopped (:mod:`ddp_smoke.blame`);
        return the ranks found alive."""
        stage = self.stage
        world = range(self.env.world_size)
        ids = self._identities(store)
        # A few store calls per kind of key, not one per rank: 4,096 ranks are judged in
        # 0.15 s after a watched abort (bench/coordination_scale.py).
        connected = ranks_with(store, "rank", world)
        reasons = posted(store, "abort")
        terminated = {r for r, a in reasons.items() if a["kind"] == "terminated"}
        dead, beats = dead_ranks(store, sorted(connected), terminated, self.silence)
        reasons = {**posted(store, "abort"), **reasons}  # and those posted while we looked
        live = connected - set(dead)
        found = posted(store, "forensics")
        arrive = "connect" if stage == "init" else f"arrive/{self.key(stage)}"
        obs = f"obs/{self.key(stage)}"
        snap = blame.Snapshot(
            stage=stage, world_size=self.env.world_size, timeout_s=float(self.cfg["timeout"]),
            hosts=[i.get("host") for i in ids], connected=connected,
            arrived=ranks_with(store, arrive, world), finished=ranks_with(store, obs, world),
            dead=set(dead), aborts={r: a for r, a in reasons.items() if a["kind"] != "stopped"},
            progress=beats,
            where={r: f["where"] for r, f in found.items() if f.get("where")},
            store=f"{self.env.master_addr}:{self.env.master_port}", dead_after_s=DEAD_AFTER_S)
        verdict = blame.judge(snap)
        # Each live rank leaves its forensics once it sees the abort, maybe after this judge
        # began: a culprit's innermost frame is worth a short wait.
        unsaid = {c.rank for c in verdict.culprits if c.rank in live and c.where is None}
        if unsaid - set(found):
            found = posted(store, "forensics", unsaid, FORENSICS_WAIT_S)
            for c in verdict.culprits:
                c.where = c.where or found.get(c.rank, {}).get("where")
        figures = {"arrived": sorted(snap.arrived), "finished": sorted(snap.finished),
                   "dead": sorted(dead), "victims": verdict.victims,
                   "progress": {str(r): p for r, p in sorted(beats.items())},
                   "aborts": [reasons[r] for r in sorted(reasons)]}
        judged = {c.name for it, c in self.judged if it == self.iteration}
        # Outside a check (process-group init, between checks) the run itself failed: "launch".
        name = stage if stage in self.checks and stage not in judged else "launch"
        culprits = verdict.culprits
        self.judged.append((self.iteration, CheckResult(
            name, FAIL, summary=f"stopped at {stage}: {culprits[0].reason}", culprits=culprits,
            figures=figures)))
        return live

    # -- every live rank, on an abort ------------------------------------------------------
    def leave_forensics(self, store) -> None:
        """Once per process: stacks, Flight Recorder, where the main thread is."""
        with self._lock:
            if self._forensics is not None:
                return
            self._forensics = {}
        found = forensics.dump(self.report_dir or ".", self.env.rank)
        self._forensics = found
        try:
            store.set(f"forensics/{self.env.rank}", json.dumps(found))
            store.append("forensics/listed", f"{self.env.rank},")
        except Exception:  # noqa: BLE001 — the store is gone; the files are still there
            pass


def _beat(c: _Coordinator) -> None:
    """Heartbeat thread: proves this process is alive, and publishes where it is. Heartbeats
    and the watchdog's polls, two calls per period per rank, stay within STORE_OPS_PER_S."""
    store, n, period = c.beat_store, 0, look_period(c.env.world_size, 2)
    try:
        while not c.stop.is_set():
            n += 1
            _beat_once(c, store, n)
            c.stop.wait(period)
    except Exception:  # noqa: BLE001 — the store is gone; the watchdog reports that
        return


def _beat_once(c: _Coordinator, store, n: int) -> None:
    store.set(f"beat/{c.env.rank}", json.dumps({"n": n, "t": time.time(), "stage": c.stage,
                                                 **comm.progress()}))


class _Watchdog(threading.Thread):
    """Enforces the deadline, reacts to aborts and signals even while main is stuck."""

    WATCH_S = 1.0  # rank 0 reads every heartbeat about this often while it waits for all

    def __init__(self, coord: _Coordinator, wakeup_fd: int):
        super().__init__(name="ddp-smoke-watchdog", daemon=True)
        self.coord, self.wakeup_fd = coord, wakeup_fd
        self.looked = 0.0  # when watch() last read the heartbeats

    def run(self) -> None:
        c, store = self.coord, self.coord.wd_store
        period = look_period(c.env.world_size, 2)
        try:
            while not c.stop.is_set():
                if self.step(store, period):
                    break
            else:
                return  # clean exit: the main thread stopped us
            # A launcher stopping the job signals every rank at once: another rank's abort
            # may be seen a moment before this rank's own signal is read. Read it now, so a
            # whole-job termination is known as one (the first reason still stands).
            self.step(store, 0.1)
            _exit_aborted(c, store)  # returns only when the main thread owns the exit
        except Exception as e:  # noqa: BLE001 — never die silently (the store is gone?)
            if c.leaving:
                return
            _give_up(c, e)

    def step(self, store, wait_s: float) -> bool:
        """One look: signals (waiting up to ``wait_s`` for one), the deadline, on rank 0 the
        heartbeats of the ranks it waits for, the abort list. True when aborted."""
        c = self.coord
        if select.select([self.wakeup_fd], [], [], wait_s)[0]:
            got = [s for s in os.read(self.wakeup_fd, 64) if s in TERMINATING]
            if got:
                c.abort(store, "terminated", {"signal": TERMINATING[got[0]]})
        if c.expired():
            c.abort(store, "timeout", {"waiting_for": c.stage})
        if c.awaiting is not None:
            self.watch(store, *c.awaiting)
        return c.aborted(store)

    def watch(self, store, what: str, prefix: str) -> None:
        """Rank 0, while its main thread waits for every rank's ``prefix/<rank>``: a rank
        that has beaten, whose heartbeat has been still for DEAD_AFTER_S since (killed,
        frozen, cut off) and that has not posted stops the run now, not at the deadline. A
        rank not yet started is waited for. All heartbeats are read in one call, about once
        WATCH_S, whatever the world size."""
        if time.monotonic() - self.looked < self.WATCH_S:
            return
        self.looked = time.monotonic()
        world = range(self.coord.env.world_size)
        beats = read_beats(store, world)
        silent = self.coord.silence.update({r: (beats.get(r) or {}).get("n") for r in world})
        gone = [r for r in silent if r in beats and not store.check([f"{prefix}/{r}"])]
        if gone:
            self.coord.abort(store, "lost", {"silent": gone, "waiting_for": what})


def _give_up(c: _Coordinator, e: BaseException) -> None:
    """The coordination store is gone (rank 0 hosted it, or its node is lost), or leaving
    failed otherwise: say what this rank knows as one JSON line on stderr, and leave."""
    stage, store = c.stage, f"{c.env.master_addr}:{c.env.master_port}"
    lost = isinstance(e, (RuntimeError, OSError))  # c10d's store errors are RuntimeErrors
    print(json.dumps({"ddp_smoke_rank": c.env.rank, "run_id": c.env.run_id, "stage": stage,
                      "progress": comm.progress(), "error": f"{type(e).__name__}: {e}"[:300],
                      "store": store, "aborted": True}), file=sys.stderr)
    _leave(f"lost the coordination store at {store} during {stage} ({type(e).__name__}); "
           "rank 0 or its node is gone" if lost else
           f"could not finish the aborted run at {stage}: {type(e).__name__}: {e}", code=1)


def _exit_aborted(c: _Coordinator, store) -> None:
    """Leave an aborted run with status 1, from the main thread or the watchdog.

    Every live rank leaves its forensics first. The writer (rank 0, or the lowest survivor
    when rank 0 is gone) writes the report; it returns instead when the other thread of this
    process is writing it (that thread then owns the exit).
    """
    try:
        c.leave_forensics(store)
        if c.env.rank == 0 or _await_report(c, store, FINAL_WAIT_S) == "write":
            c.adopt_results(store)
            if c.finalize(store, aborted=True) is not None:
                _leave(None, code=1)
            return
    except Exception as e:  # noqa: BLE001 — the store went away while leaving
        _give_up(c, e)
    _leave(f"run aborted at {c.stage}; the report was written", code=1)


def _await_report(c: _Coordinator, store, timeout_s: float) -> str | None:
    """Wait for the report's verdict; return it, or ``"write"`` when this rank must write
    the report itself.

    Rank 0 writes, and claims the ``writer`` key when it starts. A rank that has not claimed
    it and whose heartbeat stopped for TAKEOVER_S is gone: the lowest rank still waiting
    here claims it instead (one compare-and-set decides). A claimed writer is waited for as
    long as its heartbeat moves, then ``timeout_s`` more; after that this rank leaves with
    status 1, saying so.
    """
    me = c.env.rank
    store.set(f"waiting/{me}", "1")  # alive and waiting: a candidate writer
    watch, seen, seen_at = 0, None, time.monotonic()
    end = seen_at + timeout_s
    # The verdict is seen within poll_max of being set; the writer's heartbeat is looked at
    # once a period: ~5 calls per period on each of up to 2 threads of every rank, within
    # the store's budget at any world size, and still a few looks per TAKEOVER_S.
    period = min(TAKEOVER_S / 3, look_period(c.env.world_size, 10))
    while time.monotonic() < end:
        if wait_key(store, "final", period, c.poll_max):
            if store.add("bye", 1) == c.env.world_size - 1:
                store.set("bye/all", "1")  # rank 0, if it hosts the store, may leave now
            return store.get("final").decode()
        writer = try_get(store, "writer")
        if writer is not None and int(writer) != watch:
            watch, seen = int(writer), None
        beat = (beat_of(store, watch) or {}).get("n")
        now = time.monotonic()
        if beat != seen:
            seen, seen_at, end = beat, now, max(end, now + timeout_s)
        elif now - seen_at > TAKEOVER_S and writer is None:
            watch = next_waiting(store, watch, c.env.world_size)
            seen, seen_at = None, now
            if watch == me:
                claimed = store.compare_set("writer", "", str(me)).decode()
                if claimed == str(me):
                    return "write"
                watch = int(claimed)
    _leave(f"run aborted at {c.stage}, and no rank wrote the report within {timeout_s} s of "
           f"rank {watch}'s last heartbeat", code=1)
    return None


def _leave(message: str | None, code: int) -> None:
    """Exit now, from any thread, after flushing; the main thread may be stuck in C++.
    What the storage check made on this rank goes first, on every way out."""
    storage = sys.modules.get("ddp_smoke.checks.storage")
    if storage is not None:
        storage.cleanup()
    if message:
        print(f"ddp-smoke rank {os.environ.get('RANK', '?')}: {message}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(cfg: dict[str, Any]) -> int:
    """Run the configured checks on this rank; return the process exit status."""
    t0 = time.monotonic()
    started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    env = runtime.LaunchEnv.from_environ()
    faults = parse_faults(cfg["fault"], cfg["checks"])
    if any(f.rank >= env.world_size for f in faults):
        raise ConfigError(f"key 'fault' = {cfg['fault']!r}: rank out of range for "
                          f"WORLD_SIZE={env.world_size}")
    for name in cfg["checks"]:  # imports cost seconds (DDP pulls in torch._dynamo): not timed
        validate = getattr(checks.load(name), "validate", None)
        if validate:  # bad options: exit 2 on every rank, before anyone waits for anyone
            validate(cfg.get(name, {}))
    coord_t0 = time.monotonic()
    timeout = float(cfg["timeout"])
    rdir = default_report_dir(cfg, env.run_id)
    if env.rank == 0:
        _check_writable(rdir)
        clear_stale(rdir)  # a report left by another run must never read as this run's

    try:
        coord = _Coordinator(env, cfg, lambda may_host: _store(env, timeout, may_host),
                             started_at, t0)
    except (RuntimeError, OSError) as e:  # DistStoreError/DistNetworkError are RuntimeErrors
        _leave(f"cannot reach the coordination store at {env.master_addr}:{env.master_port} "
               f"within {timeout} s: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
               code=1)
    coord.report_dir = rdir
    coord.timings["load_checks_s"] = round(coord_t0 - t0, 4)
    coord.timings["connect_store_s"] = round(time.monotonic() - coord_t0, 4)
    _start_threads(coord)

    store = coord.store
    ctx = None
    try:
        coord.enter("init", timeout)
        t = time.monotonic()
        pick = runtime.pick_backend(cfg["backend"])
        device, device_error = _bind(pick, env)
        store.set(f"rank/{env.rank}", json.dumps(runtime.rank_record(env, device)))
        if pick == "nccl":
            store.add("backend/nccl", 1)
        coord.arrive(store, "connect", "every rank to connect")
        rdir, env = _adopt_run_id(coord, store), coord.env
        coord.backend = _agree_backend(coord, store, cfg["backend"], pick)
        runtime.nccl_log_env(coord.backend, rdir)  # before NCCL's first init: transport check
        if device_error:
            coord.abort(store, "error", {"type": "DeviceError", "message": device_error,
                                         "reason": device_error})
            raise _Stop
        forensics.flight_recorder_env(rdir)  # before the process group is created
        runtime.init_process_group(env, coord.backend, device, store, timeout + 15)
        coord.timings["rendezvous_s"] = round(time.monotonic() - t, 4)
        coord.ranks = [json.loads(v) for v in
                       store.multi_get([f"rank/{r}" for r in range(env.world_size)])]
        ctx = Context(env, coord.backend, device, cfg, Injector(faults, env.rank), rdir,
                      cfg["storage_dir"] or os.path.join(rdir, "storage"))
        t = time.monotonic()
        while True:
            ctx.faults.iteration = coord.iteration
            for name in cfg["checks"]:
                _run_check(coord, ctx, name)
            if not _another_iteration(coord, store, t):
                break
            coord.iteration += 1
        coord.timings["checks_s"] = round(time.monotonic() - t, 4)
        coord.timings["iterations"] = coord.iteration + 1
        coord.enter("finish", None)
    except _Stop:
        pass
    except Exception as e:  # noqa: BLE001 — init or harness failure on this rank
        coord.abort(store, "error", _error_detail(e))
    if coord.aborted(store):
        _exit_aborted(coord, store)
        time.sleep(FINAL_WAIT_S + 2 * DEAD_AFTER_S)  # the watchdog owns the exit
        return 1
    if env.rank != 0:
        verdict = _await_report(coord, store, timeout + FINAL_WAIT_S)
        if verdict == "write":  # rank 0 died after the checks: write what it judged
            coord.abort(store, "stopped", {"why": "rank 0 stopped before writing the report"})
            coord.adopt_results(store)
            if coord.finalize(store, aborted=True) is None:
                time.sleep(FINAL_WAIT_S)  # the watchdog is writing it and owns the exit
            return 1
        _shut_down(coord)
        return 0 if verdict == "pass" else 1
    report = coord.finalize(store, aborted=False)
    if report is None:  # the watchdog is finishing an abort and owns the exit
        time.sleep(FINAL_WAIT_S)
    if not env.agent_store:  # rank 0 hosts the store: let the others read the verdict first
        wait_key(store, "bye/all", 5.0, coord.poll_max)
    _shut_down(coord)
    return 0 if report is not None and report.verdict == "pass" and not coord.report_lost else 1


def _another_iteration(coord: _Coordinator, store, started: float) -> bool:
    """Repeat mode: rank 0 decides whether another pass over the checks starts (``--repeat``
    counts them, ``--duration`` watches the clock); every rank follows its decision."""
    cfg = coord.cfg
    if cfg["duration"] is None:
        return coord.iteration + 1 < cfg["repeat"]
    key = f"next/{coord.iteration}"
    if coord.env.rank == 0:
        store.set(key, "1" if time.monotonic() - started < cfg["duration"] else "0")
    coord.wait_for(store, [key], "rank 0 to decide on another iteration")
    return store.get(key) == b"1"


def _bind(pick: str, env: runtime.LaunchEnv) -> tuple[torch.device, str | None]:
    """This rank's device, or CPU and the reason it could not have its GPU."""
    try:
        return runtime.bind_device(pick, env.local_rank), None
    except runtime.DeviceError as e:
        return torch.device("cpu"), str(e)


def _agree_backend(coord: _Coordinator, store, requested: str, pick: str) -> str:
    """Every rank runs the backend all agree on; with ``auto``, a node without usable CUDA
    among GPU nodes is named, not left to hang in NCCL's rendezvous."""
    cuda_ranks = store.add("backend/nccl", 0)
    backend, problem = runtime.agree_backend(requested, pick, cuda_ranks, coord.env.world_size)
    if problem is None:
        return backend
    if pick != backend:  # this rank is the odd one out
        coord.abort(store, "error", {"type": "BackendMismatch", "message": problem,
                                     "reason": problem.format(host=runtime.hostname())})
    else:
        coord.abort(store, "stopped", {"why": "another rank cannot use the agreed backend"})
    raise _Stop


def _adopt_run_id(coord: _Coordinator, store) -> str:
    """Rank 0's run id on every rank (drawn there when the launcher gave none); returns the
    report folder named after it (the default folder is, on ranks other than 0)."""
    coord.env = runtime.share_run_id(coord.env, store)
    coord.report_dir = default_report_dir(coord.cfg, coord.env.run_id)
    return coord.report_dir


def _run_check(coord: _Coordinator, ctx: Context, name: str) -> None:
    env, store, timeout = ctx.env, coord.store, ctx.timeout_s
    module = checks.load(name)  # imported already by run(): a cache hit
    coord.enter(name, timeout)
    ctx.faults.check = name
    ctx.faults.before_arrival()
    coord.arrive(store, f"arrive/{coord.key(name)}", f"every rank to arrive at {name}")
    coord.enter(name, timeout)  # a fresh bound for the work and the gather
    t = time.monotonic()
    try:
        ctx.faults.at_start()
        obs = {"ok": True, "data": module.run(ctx)}
    except Exception as e:  # noqa: BLE001 — a check that raises fails with its rank named
        coord.abort(store, "error", _error_detail(e))
        raise _Stop from None
    obs["duration_s"] = round(time.monotonic() - t, 6)
    coord.post_observation(store, name, obs)
    if env.rank == 0:
        coord.post_result(store, _judge(module, name, coord.gather(store, name), coord))


def _judge(module, name: str, got: list[dict], coord: _Coordinator) -> CheckResult:
    ev = Evidence(name, [g["data"] for g in got], coord.ranks, coord.cfg)
    try:
        # The JSON round trip makes a figure that cannot be written fail here, named.
        result = check_from_dict(json.loads(json.dumps(dataclasses.asdict(module.judge(ev)))))
    except Exception as e:  # noqa: BLE001 — a bug in the kit, not in the cluster
        result = CheckResult(name, FAIL, summary=f"judge raised {type(e).__name__}: {e}",
                             culprits=[Culprit(None, None, traceback.format_exc(limit=3))])
    result.duration_s = max(g["duration_s"] for g in got)
    return result


def _error_detail(e: BaseException) -> dict:
    message = str(e)
    comm_error = isinstance(e, getattr(dist, "DistError", ())) or any(m in message
                                                                      for m in _COMM_MARKERS)
    return {"type": type(e).__name__, "message": message.splitlines()[0][:500] if message else "",
            "traceback": traceback.format_exc(limit=6), "comm": comm_error}


def _store(env: runtime.LaunchEnv, timeout: float, may_host: bool):
    raw = runtime.connect_store(env, timeout, may_host=may_host)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"ddp_smoke/{restart}", raw)


def _start_threads(coord: _Coordinator) -> None:
    """Heartbeat and watchdog threads; a terminating signal wakes the watchdog through a
    pipe, wherever the main thread is (Python handlers run only between bytecodes)."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    for sig in TERMINATING:
        signal.signal(sig, lambda *_: None)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    coord.threads = [threading.Thread(target=_beat, daemon=True, name="ddp-smoke-heartbeat",
                                      args=(coord,)),
                     _Watchdog(coord, r)]
    for t in coord.threads:
        t.start()


def _shut_down(coord: _Coordinator) -> None:
    """A clean exit: stop our threads before the interpreter does (a thread caught inside a
    store call at exit aborts the process), then tear the process group down."""
    coord.leaving = True
    coord.stop.set()
    for t in coord.threads:
        t.join(timeout=2 * BEAT_S + 1)
    if dist.is_initialized():
        dist.destroy_process_group()


def _check_writable(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write-test-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"--report-dir {path}: not writable ({e.strerror})") from None
