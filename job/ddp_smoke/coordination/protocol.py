"""A rank's side of the protocol: stages and deadlines, arrival, observations, aborts.

Every rank posts to the store and waits on it; nothing polls. For every check each rank
arrives (it posts a key of its own; rank 0 waits for all of them in one blocking store wait
and raises a flag the others wait for), runs the check and posts its observation; rank 0 waits
for all observations in one call, reads them in one more and judges. Three store calls per rank
per check, however long the check takes. The keys are :mod:`.keys`.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import threading
import time
import traceback
from typing import Any, Callable

import torch.distributed as dist

from ..model import CheckResult, check_from_dict
from . import fate, forensics, judge, keys, reach, runtime, signing
from .store import DEAD_AFTER_S, POLL_MAX_S, STORE_OPS_PER_S, Silence, listed, try_get

GRACE_S = 5.0  # the main thread's waits outlast the deadline by this: the watchdog acts first
# Messages of backend errors seen by a rank whose peer vanished: the rank is a victim.
_COMM_MARKERS = ("Connection closed by peer", "Connection reset by peer", "gloo/transport",
                 "Broken pipe", "NCCL communicator was aborted", "Timed out waiting")


class Stop(Exception):
    """The run is being aborted; the reason is already posted to the store."""


class Coordinator:
    """One rank's state in the run, shared by its main, watchdog and heartbeat threads.

    Each thread has its own store connection (a call blocked on one must not block another).
    ``stage`` and ``deadline`` are read as one snapshot under a lock; the rest is written by
    the main thread only, except ``finishing`` (see :meth:`claim_finish`).

    Args:
        env: the rank's launch environment.
        cfg: the effective configuration.
        connect: ``connect(may_host) -> store``; rank 0's main connection may host the store.
        publish: ``publish(coordinator, store, error, forensics) -> verdict``, the writer's
            outputs (the harness wires :mod:`ddp_smoke.outputs`).
    """

    def __init__(self, env, cfg: dict[str, Any], connect: Callable, publish: Callable,
                 started_at: str, t0: float):
        self.env, self.cfg, self.checks = env, cfg, cfg["checks"]
        self.publish, self.started_at, self.t0 = publish, started_at, t0
        self.store = connect(may_host=True)        # main thread's
        self.wd_store = connect(may_host=False)    # watchdog's
        self.beat_store = connect(may_host=False)  # heartbeat's: it beats until the process ends
        self._lock = threading.Lock()
        self._stage, self._deadline = "init", None
        self.iteration = 0  # repeat mode: which pass over the checks (0-based)
        self.judged: list[tuple[int, CheckResult]] = []  # (iteration, result), in order
        self.timings: dict[str, float] = {}
        self.ranks: list[dict] = []
        self.backend = "?"
        self.report_dir = ""
        self._finishing = False
        self.leaving = False  # set once this rank has its verdict: store errors are expected now
        self.stop = threading.Event()  # ends the heartbeat and watchdog threads on a clean exit
        self.threads: list[threading.Thread] = []
        # the verdict's pollers use a quarter of the store's budget: 0.82 s apart at 4,096
        self.poll_max = max(POLL_MAX_S, 4 * env.world_size / STORE_OPS_PER_S)
        # rank 0, while it waits for every rank's prefix/<rank>: (what it waits for, prefix)
        self.awaiting: tuple[str, str] | None = None
        # another rank, while it waits for rank 0's prefix/all: what it waits for
        self.following: str | None = None
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

    def claim_finish(self) -> bool:
        """True for the one thread of this process that writes the report and ends it."""
        with self._lock:
            first, self._finishing = not self._finishing, True
            return first

    def key(self, stage: str) -> str:
        """A stage's store key: the check name and the iteration."""
        return keys.stage(stage, self.iteration)

    # -- posting -------------------------------------------------------------------------
    def abort(self, store, kind: str, detail: dict | None = None) -> None:
        """Tell everyone the run stops, and why, from this rank's point of view."""
        body = {"rank": self.env.rank, "kind": kind, "stage": self.stage, "at": time.time(),
                **(detail or {})}
        text = json.dumps(body)
        try:  # the first reason stands: a SIGTERM after an error must not hide the error
            if store.compare_set(keys.of(keys.ABORT, self.env.rank), "", text) == text.encode():
                store.append(keys.listed(keys.ABORT), f"{self.env.rank},")  # aborted now
        except Exception:  # noqa: BLE001 — the store host may be gone; nothing left to tell
            pass

    def aborted(self, store) -> bool:
        """A rank listed a genuine abort (a list written from outside the run is no abort)."""
        return store.check([keys.listed(keys.ABORT)]) and bool(listed(store, keys.ABORT))

    def arrive(self, store, prefix: str, what: str, mine: str = "1") -> None:
        """Post ``prefix/<rank>`` (``mine``) and wait until every rank has (or raise Stop). Rank 0
        waits for all of them in one call and then raises ``prefix/all``, which every other
        rank waits for: two store calls per rank, whatever the world size."""
        store.set(keys.of(prefix, self.env.rank), mine)
        if self.env.rank == 0:
            self.await_all(store, prefix, what)
            store.set(keys.every(prefix), "1")
            return
        with self._lock:  # meanwhile the watchdog watches rank 0's heartbeat
            self.following = what
        try:
            self.wait_for(store, [keys.every(prefix)], what)
        finally:
            with self._lock:
                self.following = None

    def await_all(self, store, prefix: str, what: str) -> None:
        """Rank 0: wait until every rank has posted ``prefix/<rank>``. Meanwhile its
        watchdog watches the heartbeats of the ranks still missing
        (:meth:`ddp_smoke.coordination.liveness.Watchdog.watch`)."""
        with self._lock:
            self.awaiting = (what, prefix)
        try:
            self.wait_for(store, [keys.of(prefix, r) for r in range(self.env.world_size)], what)
        finally:
            with self._lock:
                self.awaiting = None

    def wait_for(self, store, wanted: list[str], what: str) -> None:
        """Block until every key in ``wanted`` exists: the store's own wait, one call.

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
                store.wait(wanted, datetime.timedelta(seconds=bound))
                return
            except dist.DistStoreError:  # timed out (a lost store raises DistNetworkError)
                if time.monotonic() - t < bound / 2:
                    raise  # not a timeout: an error of the store's, not to be waited out
                if self.aborted(store):
                    raise Stop from None
                if self.expired():
                    self.abort(store, keys.TIMEOUT, {"waiting_for": what})
                    raise Stop from None

    def gather(self, store, stage: str) -> list[dict]:
        """Rank 0: every rank's observation of ``stage``, read in one call once all are in."""
        prefix = keys.of(keys.OBS, self.key(stage))
        self.await_all(store, prefix, f"every rank to finish {stage}")
        return [json.loads(v) for v in
                store.multi_get([keys.of(prefix, r) for r in range(self.env.world_size)])]

    def post_observation(self, store, stage: str, obs: dict) -> None:
        store.set(keys.of(keys.of(keys.OBS, self.key(stage)), self.env.rank), json.dumps(obs))

    def post_result(self, store, result: CheckResult) -> None:
        """Rank 0 keeps each judged result in the store too: a survivor may have to write."""
        self.judged.append((self.iteration, result))
        try:
            store.set(keys.of(keys.RESULT, self.key(result.name)),
                      json.dumps(dataclasses.asdict(result)))
        except Exception:  # noqa: BLE001 — the report is still written from memory
            pass

    def adopt_results(self, store) -> None:
        """A survivor that writes the report takes rank 0's judged results from the store."""
        if self.env.rank == 0:
            return
        self.judged = [(it, check_from_dict(json.loads(got)))
                       for it in range(self.iteration + 1) for name in self.checks
                       if (got := try_get(store, keys.of(keys.RESULT, keys.stage(name, it))))]
        unjudged = [n for n in self.checks if (self.iteration, n) not in
                    {(it, r.name) for it, r in self.judged}]
        if unjudged and self.stage not in unjudged:  # rank 0 died before judging it
            self.enter(unjudged[0], None)

    def identities(self, store) -> list[dict]:
        """Every rank's identity record; a rank that never posted one says so."""
        if len(self.ranks) != self.env.world_size:
            self.ranks = judge.identities(store, self.env.world_size)
        return self.ranks

    def stopped(self) -> judge.Stopped:
        """What this rank knows of the run, for judging it (:mod:`.judge`); the stopped
        stage's result is appended to this rank's ``judged``."""
        me = self.env.rank
        return judge.Stopped(
            stage=self.stage, iteration=self.iteration, world_size=self.env.world_size,
            checks=self.checks, timeout_s=float(self.cfg["timeout"]), ranks=self.ranks,
            judged=self.judged, store_address=self.env.store_address,
            writer="rank 0" if me == 0 else f"rank {me} (took over from rank 0)",
            report_dir=self.report_dir)

    def agree_backend(self, store, requested: str, pick: str, picks: list) -> str:
        """Every rank runs the backend all agree on; with ``auto``, a node without usable CUDA
        among GPU nodes is named, not left to hang in NCCL's rendezvous. Rank 0 counts the NCCL
        picks in the signed connect records and posts the count (a store counter is unsigned)."""
        if self.env.rank == 0:
            signing.forget_local_secret()  # every rank read it before it connected
            store.set(keys.BACKEND, str(cuda_ranks := sum(p == b"nccl" for p in picks)))
        else:
            cuda_ranks = int(store.get(keys.BACKEND))
        world = self.env.world_size
        backend, problem = runtime.agree_backend(requested, pick, cuda_ranks, world)
        if problem is None:
            return backend
        if pick != backend:  # this rank is the odd one out
            self.abort(store, keys.ERROR, {"type": "BackendMismatch", "message": problem,
                                           "reason": problem.format(host=runtime.hostname())})
        else:
            self.abort(store, keys.STOPPED, {"why": "another rank cannot use the agreed backend"})
        raise Stop

    def host(self, rank: int) -> str | None:
        return self.ranks[rank].get("host") if 0 <= rank < len(self.ranks) else None

    def leave_forensics(self, store) -> None:
        """Once per process: stacks, Flight Recorder, where the main thread is."""
        with self._lock:
            if self._forensics is not None:
                return
            self._forensics = {}
        fate.note(self, store)  # before the forensics: the judge waits for those
        found = forensics.dump(self.report_dir or ".", self.env.rank)
        self._forensics = found
        try:
            store.set(keys.of(keys.FORENSICS, self.env.rank), json.dumps(found))
            store.append(keys.listed(keys.FORENSICS), f"{self.env.rank},")
        except Exception:  # noqa: BLE001 — the store is gone; the files are still there
            pass
        reach.survey(store, self.env.rank)  # a node's leader: who it can still connect to


def error_detail(e: BaseException) -> dict:
    """An exception as an abort's detail; ``comm`` marks a rank that saw its peer vanish."""
    message = str(e)
    comm_error = isinstance(e, getattr(dist, "DistError", ())) or any(m in message
                                                                      for m in _COMM_MARKERS)
    return {"type": type(e).__name__, "message": message.splitlines()[0][:500] if message else "",
            "traceback": traceback.format_exc(limit=6), "comm": comm_error}
