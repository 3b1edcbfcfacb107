"""A rank's side of the protocol: stages and deadlines, arrival, observations, aborts.

Every rank posts to the store and waits on it. For every check each rank arrives (it posts a
key of its own; rank 0 waits for all of them in one store wait and raises a flag the others
read, blocking, in one call), runs the check and posts its observation; rank 0 waits for all
observations in one wait, reads them in one more call and judges. Three store calls per rank
(with node speakers, a node: :mod:`.node`) per check, however long the check takes (a longer
wait is cut in slices, one call each: rank 0's a look period long, the others' half a
heartbeat silence). Rank 0 writes what the others block on once per rank, each reading a key
of its own, and the first aborting rank wakes them (:data:`.keys.WOKEN`). The keys are
:mod:`.keys`, the records :mod:`.records`.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import threading
import time
from typing import Any, Callable

import torch.distributed as dist

from ..config.launchenv import LaunchEnv
from ..model import CheckResult, check_from_dict
from . import (fate, forensics, keys, liveness, progress, reach, records, retransmits, runtime,
               signing, stopped_run, telling)
from .store import POLL_MAX_S, STORE_OPS_PER_S, Silence, Stop, dead_after, listed, try_get

GRACE_S = 5.0  # the main thread's waits outlast the deadline by this: the watchdog acts first

__all__ = ["Coordinator", "Run", "Stop"]


@dataclasses.dataclass(frozen=True)
class Run:
    """What a rank knows of the run at one moment, frozen.

    The main thread makes a new one at each step that changes it (:class:`Coordinator` swaps
    it in whole); any other thread reads a copy and never sees half a step. The thread that
    writes the report works on the one it took when it began, and only on that.
    """

    env: LaunchEnv
    cfg: dict
    started_at: str
    t0: float
    silence: Silence               # every look at the heartbeats (thread-safe), for blame
    stage: str = "init"            # (the copy's: the stage changes too often to swap the run)
    iteration: int = 0             # repeat mode: which pass over the checks (0-based)
    backend: str = "?"
    report_dir: str = ""
    ranks: tuple = ()              # every rank's identity record, once known
    judged: tuple = ()             # (iteration, CheckResult), in order
    timings: tuple = ()            # (phase, seconds or count), in order

    @property
    def checks(self) -> list[str]:
        return self.cfg["checks"]

    def key(self, stage: str) -> str:
        """A stage's store key: the check name and the iteration."""
        return keys.stage(stage, self.iteration)

    def host(self, rank: int) -> str | None:
        return self.ranks[rank].get("host") if 0 <= rank < len(self.ranks) else None

    def replace(self, **changes) -> "Run":
        return dataclasses.replace(self, **changes)

    def with_identities(self, store) -> "Run":
        """Every rank's identity record; a rank that never posted one says so."""
        if len(self.ranks) == self.env.world_size and all(self.ranks):
            return self
        return self.replace(ranks=tuple(stopped_run.identities(store, self.env.world_size)))

    def stopped(self) -> stopped_run.Stopped:
        """What this rank knows of the run, for its report (:mod:`.stopped_run`): a copy, whose
        ``judged`` the stopped stage's result is appended to."""
        me = self.env.rank
        return stopped_run.Stopped(
            stage=self.stage, iteration=self.iteration, world_size=self.env.world_size,
            checks=self.checks, timeout_s=float(self.cfg["timeout"]), ranks=list(self.ranks),
            judged=list(self.judged), store_address=self.env.store_address,
            writer="rank 0" if me == 0 else f"rank {me} (took over from rank 0)",
            report_dir=self.report_dir, link_rules=self.cfg.get("links"),
            rules=self.cfg.get("diagnosis"), rails=self.cfg.get("rails"))

    def with_results(self, store) -> "Run":
        """A survivor that writes the report takes rank 0's judged results from the store."""
        if self.env.rank == 0:
            return self
        judged = tuple((it, check_from_dict(json.loads(got)))
                       for it in range(self.iteration + 1) for name in self.checks
                       if (got := try_get(store, keys.of(keys.RESULT, keys.stage(name, it)))))
        done = {(it, r.name) for it, r in judged}
        unjudged = [n for n in self.checks if (self.iteration, n) not in done]
        stage = unjudged[0] if unjudged and self.stage not in unjudged else self.stage
        return self.replace(judged=judged, stage=stage)  # (rank 0 died before judging it)


class Coordinator:
    """One rank's side of the run, shared by its main thread and its liveness thread.

    The rank has one store connection (``store``, a :class:`.store.Connection` under the
    signing): its threads take turns on it. The run's state is a frozen :class:`Run`
    (:attr:`run` is a copy) that only the main thread replaces, through the methods below;
    the stage with its deadline, and what the main thread waits for, are tuples it swaps
    whole (:meth:`enter`, :meth:`waiting`). The liveness thread (heartbeat and watchdog,
    :mod:`.liveness`) only reads them. Whichever
    thread ends an aborted run claims that once (:meth:`claim_finish`) and works on the
    :class:`Run` of that moment (:mod:`.ending`). Shared by design, under a lock: who leaves
    an aborted run (:meth:`claim_exit`; the other thread keeps the heartbeat), who writes the
    report (:meth:`claim_finish`) and this rank's forensics (left once).

    Args:
        env: the rank's launch environment.
        cfg: the effective configuration.
        connect: ``connect(may_host) -> store``; rank 0's connection may host the store.
        publish: ``publish(run, store, error, forensics) -> verdict``, the writer's outputs
            (the harness wires :mod:`ddp_smoke.outputs`).
    """

    def __init__(self, env: LaunchEnv, cfg: dict[str, Any], connect: Callable,
                 publish: Callable, started_at: str, t0: float):
        self.cfg, self.publish = cfg, publish
        self.store = connect(may_host=True)  # the rank's one connection
        self._run = Run(env=env, cfg=cfg, started_at=started_at, t0=t0,
                        silence=Silence(dead_after(env.world_size, cfg.get("diagnosis"))))
        self._phase: tuple[str, float | None] = ("init", None)  # stage, deadline (monotonic)
        # (what rank 0 waits for every rank to post, its prefix) or (None, what another rank
        # reads of rank 0's, following rank 0's heartbeat meanwhile)
        self._waiting: tuple = (None, None)
        self._lock = threading.Lock()
        self._finishing = self._exiting = False
        self._forensics: dict | None = None  # this rank's own
        self._stopped_in: tuple[dict, list] | None = None  # (progress, waits) at the abort
        # the verdict's pollers use a quarter of the store's budget: 0.82 s apart at 4,096
        self.poll_max = max(POLL_MAX_S, 4 * env.world_size / STORE_OPS_PER_S)
        # another rank's blocking read of rank 0's flag looks every half heartbeat silence:
        # it beats, and follows rank 0's heartbeat, in time; fewer wake-ups than a look period
        self.follow_slice = self._run.silence.after_s / 2
        self.liveness = liveness.Liveness(self)
        self.teller = telling.Teller(cfg, env.rank)
        self.waiting_since = 0.0  # when await_all began its wait (monotonic)

    # -- the run's state: read by any thread, changed by the main thread --------------------
    @property
    def run(self) -> Run:
        """The run as it stands, frozen: what a thread that leaves the run works on."""
        return self._run.replace(stage=self._phase[0])

    @property
    def env(self) -> LaunchEnv:
        return self._run.env

    @property
    def stage(self) -> str:
        return self._phase[0]

    @property
    def iteration(self) -> int:
        return self._run.iteration

    @property
    def checks(self) -> list[str]:
        return self._run.checks

    @property
    def silence(self) -> Silence:
        return self._run.silence

    def _change(self, **changes) -> None:
        self._run = self._run.replace(**changes)  # one reference, swapped whole

    def enter(self, stage: str, deadline_s: float | None) -> None:
        self._phase = (stage, None if deadline_s is None else time.monotonic() + deadline_s)

    @property
    def deadline(self) -> float | None:
        """The stage's deadline (monotonic), or None."""
        return self._phase[1]

    def expired(self, grace: bool = False) -> bool:
        """The stage's deadline passed (with ``grace``, GRACE_S ago: the watchdog's turn)."""
        deadline = self._phase[1]
        return deadline is not None and time.monotonic() > deadline + grace * GRACE_S

    def waiting(self) -> tuple:
        """What the main thread waits for now: ``(awaiting, following)``, either ``(what,
        prefix)`` and None (rank 0, every rank's ``prefix/<rank>``) or None and ``what``
        (another rank, a value of rank 0's)."""
        return self._waiting

    def locate(self, env: LaunchEnv, report_dir: str) -> None:
        """The run's id and report folder (a rank other than 0 adopts rank 0's id once every
        rank connected, and the default folder is named after it)."""
        self._change(env=env, report_dir=report_dir)

    def met(self, ranks: list[dict]) -> None:
        """The identity records this rank holds (``{}`` for a rank it did not read)."""
        self._change(ranks=tuple(ranks))

    def meet(self, store) -> None:
        """Read the identity records this rank needs, once the process group is up: rank 0
        (which judges and writes the report) every rank's; another rank those of its own
        node and rank 0's node (what it names when the store is lost with rank 0's node; what
        its node shows of its neighbours), as torchrun numbers a node's ranks. Every rank
        reading every record would move world² records through one store: 268 million at
        16,384 ranks. A rank that writes the report reads the rest then
        (:meth:`Run.with_identities`)."""
        env = self.env
        if env.rank == 0:
            wanted = range(env.world_size)
        else:  # rank 0's node: as many ranks as this one's (torchrun's --nproc-per-node)
            size = min(env.local_world_size, env.world_size)
            wanted = sorted({*range(size), *env.node_ranks})
        ranks: list[dict] = [{}] * env.world_size
        for r, value in zip(wanted, store.multi_get([keys.of(keys.RANK, r) for r in wanted])):
            ranks[r] = json.loads(value)
        self.met(ranks)
        reach.beacon(store, env.rank, self.cfg.get("links", {}).get("beacon_s", 0))  # leaders
        self.teller.joined(env.run_id, ranks, self._run.backend, self.checks,
                           time.monotonic() - self._run.t0, self._run.report_dir)

    def timed(self, phase: str, value: float) -> None:
        self._change(timings=self._run.timings + ((phase, value),))

    def next_iteration(self) -> None:
        self._change(iteration=self._run.iteration + 1)

    def claim_finish(self) -> bool:
        """True for the one thread of this process that writes the report and ends it."""
        with self._lock:
            first, self._finishing = not self._finishing, True
            return first

    def claim_exit(self) -> bool:
        """True for the one thread of this process that leaves an aborted run
        (:func:`.ending.exit_aborted`); the other keeps the heartbeat going meanwhile."""
        with self._lock:
            first, self._exiting = not self._exiting, True
            return first

    def key(self, stage: str) -> str:
        """A stage's store key: the check name and the iteration."""
        return self._run.key(stage)

    # -- posting -------------------------------------------------------------------------
    def abort(self, store, kind: type[records.Abort], **detail) -> None:
        """Tell everyone the run stops, and why, from this rank's point of view: an abort
        record of ``kind`` (:mod:`.records`), with its own fields in ``detail``."""
        text = records.text(kind(rank=self.env.rank, stage=self.stage, at=time.time(),
                                 **detail))
        try:  # the first reason stands: a SIGTERM after an error must not hide the error
            if store.compare_set(keys.of(keys.ABORT, self.env.rank), "", text) == text.encode():
                store.append(keys.listed(keys.ABORT), f"{self.env.rank},")  # aborted now
                me = str(self.env.rank)  # the first to abort wakes every rank that waits
                if store.compare_set(keys.WOKE, "", me) == me.encode():
                    for key in self._flags_read():
                        self.tell_all(store, key, keys.WOKEN, shared=False)
        except Exception:  # noqa: BLE001 — the store host may be gone; nothing left to tell
            pass

    def tell_all(self, store, key: str, value: str, shared: bool = True) -> None:
        """Rank 0's ``value`` at ``key`` (evidence, and what the store host reads) and at
        ``key/<r>`` for each other rank, the one it blocks on (:meth:`await_flag`): two
        calls."""
        if shared:
            store.set(key, value)
        others = range(1, self.env.world_size)
        if others:
            store.multi_set([keys.of(key, r) for r in others], [value] * len(others))

    def _flags_read(self) -> list[str]:
        """What another rank may be blocked reading now (:meth:`await_flag`): rank 0's flag
        of this stage or of the next (ranks are at most a stage apart), or its values of the
        start."""
        stage, checks, it = self.stage, self.checks, self.iteration
        if stage == "init":
            return [keys.every(keys.CONNECT), keys.RUN_ID, keys.BACKEND]
        if stage not in checks:
            return []
        i = checks.index(stage)
        after = (checks[i + 1], it) if i + 1 < len(checks) else (checks[0], it + 1)
        return [keys.every(keys.of(keys.ARRIVE, keys.stage(stage, it))),
                keys.every(keys.of(keys.ARRIVE, keys.stage(*after))), keys.of(keys.NEXT, it)]

    def aborted(self, store) -> bool:
        """A rank listed a genuine abort (a list written from outside the run is no abort).
        The first time it is seen, this rank's collective progress is held as it stands."""
        if not (store.check([keys.listed(keys.ABORT)]) and bool(listed(store, keys.ABORT))):
            return False
        with self._lock:
            if self._stopped_in is None:
                self._stopped_in = (progress.progress(), progress.RECORDER.spent_so_far())
        return True

    def progress(self) -> dict:
        """This rank's collective progress for its heartbeat: as it was when the rank learnt
        that the run stopped, from then on. What its collectives do afterwards (one that
        completes, or fails, as the other ranks leave) is the abort's consequence, not
        evidence of who stopped the run (measured: a rank inside the collective a slow rank
        had not entered was read, after the slow rank entered it, as "not in a collective"
        and named with it)."""
        held = self._stopped_in
        return held[0] if held else progress.progress()

    def arrive(self, store, prefix: str, what: str, mine: str = "1") -> None:
        """Post ``prefix/<rank>`` (``mine``) and wait until every rank has (or raise Stop). Rank 0
        waits for all of them in one call and then raises ``prefix/all``, which every other
        rank waits for: two store calls per rank, whatever the world size."""
        node = self.liveness.node
        if node is not None and prefix.startswith(keys.ARRIVE + "/"):  # a check's, by its node
            if not node.relay(self, store, prefix, mine, what, flag=keys.every(prefix)):
                raise Stop
            return
        store.set(keys.of(prefix, self.env.rank), mine)
        if self.env.rank == 0:
            self.await_all(store, prefix, what)
            self.tell_all(store, keys.every(prefix), "1")
            return
        self.await_flag(store, keys.every(prefix), what)

    def await_all(self, store, prefix: str, what: str) -> None:
        """Rank 0: wait until every rank has posted ``prefix/<rank>``. Meanwhile its
        watchdog watches the heartbeats of the ranks still missing
        (:meth:`ddp_smoke.coordination.liveness.Liveness.watch`)."""
        self._waiting, self.waiting_since = ((what, prefix), None), time.monotonic()
        try:
            self.wait_for(store, [keys.of(prefix, r) for r in range(self.env.world_size)], what)
        finally:
            self._waiting = (None, None)

    def wait_for(self, store, wanted: list[str], what: str) -> None:
        """Block until every key in ``wanted`` exists: the store's own wait, in slices of a
        look period (:meth:`_until_deadline`)."""
        self._until_deadline(store, what, lambda bound: store.wait(
            wanted, bound, between=lambda look: self.liveness.tick(store, look)))

    def await_flag(self, store, key: str, what: str) -> bytes:
        """Another rank: rank 0's value at ``key`` (a flag, the run id, the NCCL count, a
        decision: :meth:`tell_all`), read at this rank's own ``key/<rank>`` in one blocking
        read, cut in slices of half a heartbeat silence: between two, this rank beats and
        its watchdog follows rank 0's heartbeat. Stop when an aborting rank wrote
        :data:`.keys.WOKEN` there instead."""
        self._waiting = (None, what)  # meanwhile the watchdog watches rank 0's heartbeat
        mine = keys.of(key, self.env.rank)
        try:
            value = self._until_deadline(store, what, lambda bound: store.get(
                mine, timeout=bound, between=lambda full: self.liveness.tick(store, full),
                slice_s=self.follow_slice))
        finally:
            self._waiting = (None, None)
        if value == keys.WOKEN.encode():
            raise Stop
        return value

    def _until_deadline(self, store, what: str, call: Callable):
        """``call(bound)``, a blocking store call, bounded by the stage's deadline and
        GRACE_S more.

        Between its slices this thread does what is due on the connection it holds (the
        heartbeat, the watchdog's look) and stops once the run is aborted. The watchdog sees
        the abort, the deadline or a silent rank, and ends the process itself; only if it
        has not when the bound passes does this thread abort.
        """
        while True:
            deadline = self._phase[1]
            left = float(self.cfg["timeout"]) if deadline is None else deadline - time.monotonic()
            try:
                return call(datetime.timedelta(seconds=max(0.0, left) + GRACE_S))
            except dist.DistStoreError:  # timed out (a lost store raises DistNetworkError)
                if self.aborted(store):
                    raise Stop from None
                if self.expired():
                    self.abort(store, records.TimeoutAbort, waiting_for=what)
                    raise Stop from None

    def gather(self, store, stage: str) -> list[dict]:
        """Rank 0: every rank's observation of ``stage``, read in one call once all are in."""
        prefix = keys.of(keys.OBS, self.key(stage))
        self.await_all(store, prefix, f"every rank to finish {stage}")
        return [json.loads(v) for v in
                store.multi_get([keys.of(prefix, r) for r in range(self.env.world_size)])]

    def post_observation(self, store, stage: str, obs: records.Observation) -> None:
        prefix, node = keys.of(keys.OBS, self.key(stage)), self.liveness.node
        if node is not None:  # through the node's relayer (:meth:`.node.NodeBeats.relay`)
            if not node.relay(self, store, prefix, records.text(obs),
                              f"every rank to finish {stage}"):
                raise Stop
        else:
            store.set(keys.of(prefix, self.env.rank), records.text(obs))

    def post_result(self, store, result: CheckResult) -> None:
        """Rank 0 keeps each judged result in the store too: a survivor may have to write."""
        self._change(judged=self._run.judged + ((self.iteration, result),))
        self.teller.judged(result, self.checks.index(result.name) + 1, len(self.checks),
                           self.iteration if self.cfg.get("repeat", 1) > 1
                           or self.cfg.get("duration") else None)
        try:
            store.set(keys.of(keys.RESULT, self.key(result.name)),
                      json.dumps(dataclasses.asdict(result)))
        except Exception:  # noqa: BLE001 — the report is still written from memory
            pass

    def agree_backend(self, store, requested: str, pick: str, picks: list) -> str:
        """Every rank runs the backend all agree on; with ``auto``, a node without usable CUDA
        among GPU nodes is named, not left to hang in NCCL's rendezvous. Rank 0 counts the NCCL
        picks in the signed connect records and posts the count (a store counter is unsigned)."""
        if self.env.rank == 0:
            signing.forget_local_secret()  # every rank read it before it connected
            self.tell_all(store, keys.BACKEND, str(cuda_ranks := sum(p == b"nccl"
                                                                       for p in picks)))
        else:
            cuda_ranks = int(self.await_flag(store, keys.BACKEND,
                                             "rank 0's count of the ranks with CUDA"))
        world = self.env.world_size
        backend, problem = runtime.agree_backend(requested, pick, cuda_ranks, world)
        if problem is None:
            self._change(backend=backend)
            return backend
        if pick != backend:  # this rank is the odd one out
            self.abort(store, records.ErrorAbort, type="BackendMismatch", message=problem,
                       reason=problem.format(host=runtime.hostname()))
        else:
            self.abort(store, records.StoppedAbort,
                       why="another rank cannot use the agreed backend")
        raise Stop

    def leave_forensics(self, store) -> None:
        """Once per process: stacks, Flight Recorder, where the main thread is."""
        with self._lock:
            if self._forensics is not None:
                return
            self._forensics = {}
        fate.note(self, store)  # before the forensics: the writer waits for those
        # with this check's collective durations until the abort: who the others waited for
        waits = (self._stopped_in or (None, progress.RECORDER.spent_so_far()))[1]
        self._forensics = found = records.wire(dataclasses.replace(
            forensics.dump(self._run.report_dir or ".", self.env.rank), waits=waits,
            tcp=retransmits.COUNTER.so_far()))
        try:
            store.set(keys.of(keys.FORENSICS, self.env.rank), json.dumps(found))
            store.append(keys.listed(keys.FORENSICS), f"{self.env.rank},")
        except Exception:  # noqa: BLE001 — the store is gone; the files are still there
            pass
        reach.survey(store, self.env.rank, self.cfg.get("diagnosis"))  # leaders: who is reached
