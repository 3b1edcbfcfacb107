"""Liveness: the heartbeat every rank publishes, and the watchdog that acts on deadlines,
signals, aborts and (on rank 0) silent ranks, even while the main thread is stuck in C++.

Both are one thread, on the rank's one store connection (:class:`.store.Connection`): each
look period it beats and looks (:meth:`Liveness.tick`: two store calls, within the store's
budget at any world size). While the main thread holds the connection in a long wait, it does
the same between the wait's slices, so the heartbeat never waits for the connection. Once the
run is aborted this thread owns the exit (:func:`.ending.exit_aborted`), and one thread keeps
the heartbeat going until the process ends, so that the rank (the writer too) is seen alive
while it leaves: the main thread when it finishes first, else one started for it (the main
thread may never return from C++).
"""
from __future__ import annotations

import os
import select
import signal
import threading
import time

import torch.distributed as dist

from . import keys, records
from .ending import at_leave, exit_aborted, give_up
from .node import NodeBeats, wanted as node_speaker
from .store import beat_of, look_period, read_beats, try_get

TERMINATING = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "SIGINT", signal.SIGUSR1: "SIGUSR1",
               signal.SIGUSR2: "SIGUSR2"}


class Liveness:
    """A rank's heartbeat and watchdog (one thread, :meth:`start`), and the look either
    thread takes when it is due (:meth:`tick`)."""

    WATCH_S = 1.0  # rank 0 reads every heartbeat about this often while it waits for all

    def __init__(self, coord):
        self.coord = coord
        self.period = look_period(coord.env.world_size)
        self.stop = threading.Event()  # a clean exit: the main thread stopped us
        self.leaving = False  # set once this rank has its verdict: store errors are expected
        self.looked = 0.0     # when watch() or follow() last read heartbeats
        self._n, self._aborted = 0, False
        self._due = self._beat_due = 0.0  # monotonic: the next look, the next heartbeat
        self._ticking = threading.Lock()
        self._keeping = threading.Lock()  # held by the one thread that keeps the heartbeat
        self._wake = (-1, -1)
        self._thread: threading.Thread | None = None
        self.node: NodeBeats | None = None  # node beats (:mod:`.node`), for a large world
        if node_speaker(coord.env, coord.cfg.get("node_speaker", "auto")):
            try:
                self.node = NodeBeats(coord.env, self.period)
                at_leave(self.node.leave)
            except OSError:
                pass  # no shared memory to write: this rank beats to the store itself
        self._speaks = False

    def start(self) -> None:
        """The thread; a terminating signal wakes it through a pipe, wherever the main thread
        is (Python handlers run only between bytecodes)."""
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._wake = (r, w)
        for sig in TERMINATING:
            signal.signal(sig, lambda *_: None)
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._run, daemon=True, name="ddp-smoke-liveness")
        self._thread.start()
        # a signal that came while torch loaded (cli.worker blocked them) is answered now
        signal.pthread_sigmask(signal.SIG_UNBLOCK, TERMINATING)

    # -- one look ------------------------------------------------------------------------
    def beat(self, store) -> None:
        """Prove this process is alive, and publish where it is (the first time, list it):
        to the store, or to the node's slots and, when this rank speaks, the node's record
        to the store."""
        self._beat_due = time.monotonic() + self.period
        self._n += 1
        rank = self.coord.env.rank
        beat = records.Beat(n=self._n, t=time.time(), stage=self.coord.stage,
                            progress=self.coord.progress()).to_json()
        if self.node is not None:
            self.node.post(beat)
            self._speaks = self.node.speaks()
            if self._speaks:
                self.node.speak(store)
            return
        store.set(keys.of(keys.BEAT, rank), beat)
        if self._n == 1:
            store.append(keys.listed(keys.BEAT), f"{rank},")

    def tick(self, store, look: bool = True) -> bool:
        """What is due, from whichever thread holds the connection: once a period the
        heartbeat, and, with ``look``, the deadline, on rank 0 the heartbeats of the ranks it
        waits for (else rank 0's) and the abort list. True once the run is aborted. (A main
        thread whose wait ended in time only beats: one call, no answer to wait for.)"""
        if self._aborted:
            return True
        # (a tenth of a period early still counts: whoever looks on a period's beat, not
        # one that lands a moment early and then waits a whole period more)
        now, early = time.monotonic(), self.period / 10
        due = now >= self._due - early if look else now >= self._beat_due - early
        if not due or not self._ticking.acquire(blocking=False):
            return False
        try:
            with store.raw.hold(blocking=False) as free:
                # taken: the main thread waits on it and looks between its slices
                if free:
                    self.beat(store)
                return self._look(store) if free and look else False
        finally:
            self._ticking.release()

    def _look(self, store) -> bool:
        self._due = time.monotonic() + self.period
        c = self.coord
        awaiting, following = c.waiting()
        if c.expired():  # what the main thread waits for, where it waits
            c.abort(store, records.TimeoutAbort,
                    waiting_for=awaiting[0] if awaiting else following or c.stage)
        if awaiting is not None:
            self.watch(store, *awaiting)
        if following is not None:
            self.follow(store, following)
        if self.node is None or self._speaks:
            self._aborted = c.aborted(store)
            if self._aborted and self.node is not None:
                self.node.tell_aborted()
        else:  # the speaker looks at the abort list for the node
            self._aborted = self.node.told_aborted() and c.aborted(store)
        return self._aborted

    def watch(self, store, what: str, prefix: str) -> None:
        """Rank 0, while its main thread waits for every rank's ``prefix/<rank>``: a rank
        that has beaten, whose heartbeat has been still since (killed, frozen, cut off) and
        that has not posted stops the run now, not at the deadline. A rank not yet started
        is waited for. All heartbeats are read in one call, about once WATCH_S."""
        if time.monotonic() - self.looked < self.WATCH_S:
            return
        self.looked = time.monotonic()
        c, world = self.coord, range(self.coord.env.world_size)
        forged: set[int] = set()  # heartbeats written from outside: no sign of death
        relayed: set[int] = set()  # (beats a node's speaker posts, up to a period late)
        beats = read_beats(store, world, forged, relayed)
        silent = c.silence.update({r: (beats.get(r) or {}).get("n") for r in world}, forged,
                                  relayed, self.period)
        gone = [r for r in silent if r in beats and try_get(store, keys.of(prefix, r)) is None]
        if gone:
            c.abort(store, records.LostAbort, silent=gone, waiting_for=what)
        else:
            c.teller.waiting(store, what, c.stage, prefix, len(world), c.waiting_since,
                             c.deadline, c.run.ranks)

    def follow(self, store, what: str) -> None:
        """Another rank, while it waits for rank 0 to say that every rank arrived: rank 0
        silent (killed, its node lost) stops the run now, not at the deadline, and the
        lowest survivor writes the report. One read of rank 0's heartbeat per half a
        heartbeat silence: at 16,384 ranks a fifth of the store's budget."""
        c = self.coord  # (once a slice of the main thread's read: half a heartbeat silence)
        if time.monotonic() - self.looked < 0.9 * c.follow_slice:
            return
        self.looked = time.monotonic()
        beat = beat_of(store, 0)
        if beat is not None and c.silence.update({0: beat.get("n")}) == [0]:
            c.abort(store, records.LostAbort, silent=[0], waiting_for=what)

    # -- the thread ----------------------------------------------------------------------
    def _signals(self, wait_s: float) -> None:
        """Wait up to ``wait_s`` for a terminating signal (or a wake-up); abort on one."""
        if select.select([self._wake[0]], [], [], max(0.0, wait_s))[0]:
            got = [s for s in os.read(self._wake[0], 64) if s in TERMINATING]
            if got:
                self.coord.abort(self.coord.store, records.TerminatedAbort,
                                 signal=TERMINATING[got[0]])
                self._due = 0.0  # look now

    def _run(self) -> None:
        c, store = self.coord, self.coord.store
        try:
            while not self.stop.is_set():
                # until the next look is due; if it is and the main thread holds the
                # connection (it looks between its wait's slices), a while
                due = self._due - time.monotonic()
                self._signals(due if due > 0 else self.period / 4)
                if self.stop.is_set():
                    return  # clean exit
                if self.tick(store):
                    break
            else:
                return
            # A launcher stopping the job signals every rank at once: another rank's abort
            # may be seen a moment before this rank's own signal is read. Read it now, so a
            # whole-job termination is known as one (the first reason still stands).
            self._signals(0.1)
            if c.claim_exit():
                # The main thread may never beat again: stuck in C++ (a collective whose peer
                # is gone) or in a wait of its own. Leaving takes seconds (forensics, probes,
                # blame, the report) and this rank must be seen alive meanwhile, or it would
                # be taken for dead — the writer itself, every rank of a cut link.
                threading.Thread(target=self.keep_beating, args=(store,), daemon=True,
                                 name="ddp-smoke-beat").start()
                exit_aborted(c, store)  # returns only when the main thread writes the report
            self.keep_beating(store)
        except Exception as e:  # noqa: BLE001 — never die silently (the store is gone?)
            if self.leaving:
                return
            give_up(c, e)

    def shut_down(self) -> None:
        """Stop the thread, now (a write to its pipe ends its wait), and wait for it."""
        self.leaving = True
        self.stop.set()
        if self._wake[1] >= 0:
            try:
                os.write(self._wake[1], b"\0")
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=2 * self.period + 1)
        if self.node is not None:
            self.node.leave()

    def keep_beating(self, store) -> None:
        """Beat until the process ends: the other thread writes the report and must be seen
        alive meanwhile. One thread beats; another that asks just waits as long. Never
        raises: the store may be going."""
        if not self._keeping.acquire(blocking=False):
            self.stop.wait()
            return
        try:
            while not self.stop.is_set():
                self.beat(store)
                self.stop.wait(self.period)
        except Exception:  # noqa: BLE001
            return
        finally:
            self._keeping.release()


def shut_down(c) -> None:
    """A clean exit: stop the liveness thread before the interpreter does (a thread caught
    inside a store call at exit aborts the process), then tear the process group down."""
    c.liveness.shut_down()
    if dist.is_initialized():
        dist.destroy_process_group()
