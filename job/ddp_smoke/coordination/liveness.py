"""Liveness: the heartbeat every rank publishes, and the watchdog that acts on deadlines,
signals, aborts and (on rank 0) silent ranks, even while the main thread is stuck in C++."""
from __future__ import annotations

import json
import os
import select
import signal
import threading
import time

import torch.distributed as dist

from . import keys, progress
from .ending import exit_aborted, give_up
from .store import BEAT_S, beat_of, look_period, read_beats, try_get

TERMINATING = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "SIGINT", signal.SIGUSR1: "SIGUSR1",
               signal.SIGUSR2: "SIGUSR2"}


def beat(c) -> None:
    """Heartbeat thread: proves this process is alive, and publishes where it is. Heartbeats
    and the watchdog's looks, two calls per period per rank, stay within the store's budget."""
    store, n, period = c.beat_store, 0, look_period(c.env.world_size, 2)
    try:
        while not c.stop.is_set():
            n += 1
            beat_once(c, store, n)
            c.stop.wait(period)
    except Exception:  # noqa: BLE001 — the store is gone; the watchdog reports that
        return


def beat_once(c, store, n: int) -> None:
    store.set(keys.of(keys.BEAT, c.env.rank),
              json.dumps({"n": n, "t": time.time(), "stage": c.stage, **progress.progress()}))


class Watchdog(threading.Thread):
    """Enforces the deadline, reacts to aborts and signals even while main is stuck."""

    WATCH_S = 1.0  # rank 0 reads every heartbeat about this often while it waits for all

    def __init__(self, coord, wakeup_fd: int):
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
            exit_aborted(c, store)  # returns only when the main thread owns the exit
        except Exception as e:  # noqa: BLE001 — never die silently (the store is gone?)
            if c.leaving:
                return
            give_up(c, e)

    def step(self, store, wait_s: float) -> bool:
        """One look: signals (waiting up to ``wait_s`` for one), the deadline, on rank 0 the
        heartbeats of the ranks it waits for, the abort list. True when aborted."""
        c = self.coord
        if select.select([self.wakeup_fd], [], [], wait_s)[0]:
            got = [s for s in os.read(self.wakeup_fd, 64) if s in TERMINATING]
            if got:
                c.abort(store, keys.TERMINATED, {"signal": TERMINATING[got[0]]})
        if c.expired():
            c.abort(store, keys.TIMEOUT, {"waiting_for": c.stage})
        if c.awaiting is not None:
            self.watch(store, *c.awaiting)
        if c.following is not None:
            self.follow(store, c.following)
        return c.aborted(store)

    def follow(self, store, what: str) -> None:
        """Another rank, while it waits for rank 0 to say that every rank arrived: rank 0
        silent for DEAD_AFTER_S (killed, its node lost) stops the run now, not at the
        deadline, and the lowest survivor writes the report. One read of rank 0's heartbeat
        a period: at 4,096 ranks a fifth of the store's budget."""
        c = self.coord
        if time.monotonic() - self.looked < max(self.WATCH_S,
                                                look_period(c.env.world_size, 4)):
            return
        self.looked = time.monotonic()
        beat = beat_of(store, 0)
        if beat is not None and c.silence.update({0: beat.get("n")}) == [0]:
            c.abort(store, keys.LOST, {"silent": [0], "waiting_for": what})

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
        forged: set[int] = set()  # heartbeats written from outside: no sign of death
        beats = read_beats(store, world, forged)
        silent = self.coord.silence.update({r: (beats.get(r) or {}).get("n") for r in world},
                                           forged)
        gone = [r for r in silent if r in beats and try_get(store, keys.of(prefix, r)) is None]
        if gone:
            self.coord.abort(store, keys.LOST, {"silent": gone, "waiting_for": what})


def start(c) -> None:
    """Heartbeat and watchdog threads; a terminating signal wakes the watchdog through a
    pipe, wherever the main thread is (Python handlers run only between bytecodes)."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    for sig in TERMINATING:
        signal.signal(sig, lambda *_: None)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    c.threads = [threading.Thread(target=beat, daemon=True, name="ddp-smoke-heartbeat",
                                  args=(c,)),
                 Watchdog(c, r)]
    for t in c.threads:
        t.start()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, TERMINATING)  # one that came while torch loaded


def shut_down(c) -> None:
    """A clean exit: stop our threads before the interpreter does (a thread caught inside a
    store call at exit aborts the process), then tear the process group down."""
    c.leaving = True
    c.stop.set()
    for t in c.threads:
        t.join(timeout=2 * BEAT_S + 1)
    if dist.is_initialized():
        dist.destroy_process_group()
