"""The coordination store: one connection per rank, and its keys read back in a few calls
whatever the world size.

Every rank posts to one TCPStore (the launcher's, or rank 0's); the harness waits on it and,
after an abort, the report's writer reads it as evidence. Here: the rank's one connection,
shared by its threads (:class:`Connection`: 16,384 ranks are 16,384 sockets on the store's
host, not three times that); how many calls a rank may spend on the store (a budget that
stretches the periods of large worlds); how groups of per-rank keys are searched (halving, and
lists a rank appends itself to); and what the heartbeats say about who is alive. Evidence
gathering never raises: the store may be going away.

The store is a :class:`ddp_smoke.coordination.signing.SignedStore`: evidence is read with
``peek``, which drops a record that fails its check (it reads as absent and is reported); a key
that merely exists proves nothing until its record is read.
"""
from __future__ import annotations

import datetime
import json
import os
import threading
import time
from typing import Callable

from ..config import DIAGNOSIS
from . import keys
from .node import unpack

BEAT_S = 0.25          # heartbeat period (stretched for large worlds: look_period); a rank
                       # silent for diagnosis.dead_after_s is dead (dead_after)
POLL_MAX_S = 0.05      # longest pause between two looks for a key, at small scale ...
STORE_OPS_PER_S = 20000  # ... within a budget on the one store: pauses grow with the world
BEAT_CALLS = 2         # a rank's calls per look period: its heartbeat and its watchdog's look
TAKEOVER_SILENCES = 3  # rank 0 silent this many dead-after silences, before writing: a
                       # survivor writes (ending); the store host waits as long for one (hosting)


class Stop(Exception):
    """The run is being aborted; the reason is already posted to the store."""


class Connection:
    """One connection to the coordination store, shared by all threads of a rank.

    c10d's client serves one call at a time, and a blocking wait or read holds it until its
    keys appear. So calls take turns, first come first served (:meth:`hold`; a thread that
    holds the connection may call again), and a wait or a read of a key that may not exist
    yet holds it for one slice at most: between two slices the other threads' calls go
    first, and the waiting thread does what is due (``between(True)``: the heartbeat and the
    watchdog's look; ``between(False)`` after a wait that ended in time: the heartbeat) and
    stops waiting once told. Each slice that times out would make c10d log two warning
    lines: the worker raises c10's log level to errors before it imports torch
    (:func:`quiet_slices`). Everything else is one call, as on the c10d store it wraps; a
    read (``multi_get``) is of keys that exist.
    """

    def __init__(self, raw, slice_s: float):
        self.raw, self.slice_s = raw, slice_s
        self.timeout: datetime.timedelta = raw.timeout  # the store's own: any one call
        self._lock = threading.Lock()
        self._turned = threading.Condition(self._lock)
        self._next = self._serving = self._queued = 0  # tickets given, served; waiting
        self._holder: int | None = None

    def hold(self, blocking: bool = True) -> "_Turn":
        """Hold the connection for some calls, in the order the threads asked for it (``with
        conn.hold() as held``): held is True, or False at once when not ``blocking`` and
        another thread has it or waits for it."""
        return _Turn(self, blocking)

    def set(self, key: str, value) -> None:  # (the frequent calls, without __getattr__)
        with self.hold():
            self.raw.set(key, value)

    def check(self, wanted: list[str]) -> bool:
        with self.hold():
            return self.raw.check(wanted)

    def multi_get(self, wanted: list[str]) -> list[bytes]:
        with self.hold():
            return self.raw.multi_get(wanted)

    def _sliced(self, call: Callable, timeout: datetime.timedelta | None,
                between: Callable[[bool], bool] | None, slice_s: float | None):
        """``call(seconds)``, a c10d wait or read bounded by ``seconds``, in slices of
        ``slice_s`` (default: the connection's) until ``timeout`` (default: the store's)."""
        from torch.distributed import DistStoreError
        bound = (timeout or self.timeout).total_seconds()
        end = time.monotonic() + bound
        while True:
            left = end - time.monotonic()
            piece = max(0.001, min(slice_s or self.slice_s, left))
            t = time.monotonic()
            try:
                with self.hold():
                    got = call(piece)
                if between is not None:
                    between(False)  # (a wait that ended may be followed at once by
                    # another: the heartbeat must not wait for one to time out)
                return got
            except DistStoreError:
                if time.monotonic() - t < piece / 2:
                    raise  # not a timeout: an error of the store's, not to be waited out
            if left <= piece:
                raise DistStoreError(f"wait timeout after {bound * 1000:.0f}ms")
            if between is not None and between(True):
                raise Stop

    def wait(self, wanted: list[str], timeout: datetime.timedelta | None = None,
             between: Callable[[bool], bool] | None = None,
             slice_s: float | None = None) -> None:
        """Until every key in ``wanted`` exists; after each slice that ends without them
        ``between(True)`` runs, and :class:`Stop` is raised when it returns True (after the
        one that ends with them, ``between(False)``). c10d's DistStoreError after
        ``timeout``."""
        self._sliced(lambda s: self.raw.wait(wanted, datetime.timedelta(seconds=s)),
                     timeout, between, slice_s)

    def get(self, key: str, timeout: datetime.timedelta | None = None,
            between: Callable[[bool], bool] | None = None,
            slice_s: float | None = None) -> bytes:
        """The value at ``key`` once it exists: one blocking read a slice, as :meth:`wait`."""
        def read(seconds: float) -> bytes:
            self.raw.set_timeout(datetime.timedelta(seconds=seconds))
            try:
                return self.raw.get(key)
            finally:
                self.raw.set_timeout(self.timeout)
        return self._sliced(read, timeout, between, slice_s)

    def busy(self) -> bool:
        """Whether a call holds the connection or waits for it."""
        with self._lock:
            return self._next != self._serving

    def __getattr__(self, name):
        """Every other call (set, check, add, append, compare_set …): one turn each."""
        call = getattr(self.raw, name)
        if not callable(call):
            return call

        def in_turn(*args, **kwargs):
            with self.hold():
                return call(*args, **kwargs)
        return in_turn


class _Turn:
    """One thread's turn on a :class:`Connection` (re-entrant: a thread that holds it may
    call again)."""

    __slots__ = ("conn", "blocking", "mine")

    def __init__(self, conn: Connection, blocking: bool):
        self.conn, self.blocking, self.mine = conn, blocking, False

    def __enter__(self) -> bool:
        conn, me = self.conn, threading.get_ident()
        with conn._lock:
            if conn._holder == me:
                return True
            if conn._next != conn._serving:  # taken, or others wait: a ticket, in order
                if not self.blocking:
                    return False
                ticket, conn._next, conn._queued = conn._next, conn._next + 1, conn._queued + 1
                while conn._serving != ticket:
                    conn._turned.wait()
                conn._queued -= 1
            else:
                conn._next += 1
            conn._holder, self.mine = me, True
            return True

    def __exit__(self, *exc) -> None:
        if self.mine:
            conn = self.conn
            with conn._lock:
                conn._holder, conn._serving = None, conn._serving + 1
                if conn._queued:
                    conn._turned.notify_all()


def quiet_slices(environ=os.environ) -> None:
    """Before torch is imported: c10's C++ log level to errors, unless the user chose one
    (``TORCH_CPP_LOG_LEVEL``). Each slice of a :class:`Connection` wait that ends would make
    c10d log two warning lines, and a slow run would drown in them."""
    environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def try_get(store, key: str) -> bytes | None:
    """The genuine record at ``key``, or None (absent, failed its check, or no store)."""
    try:
        return store.peek([key])[0] if store.check([key]) else None
    except Exception:  # noqa: BLE001 — evidence gathering never raises
        return None


def beat_of(store, rank: int) -> dict | None:
    """One rank's heartbeat: its own key, else its node's record (:mod:`.node`)."""
    got = try_get(store, keys.of(keys.BEAT, rank))
    return json.loads(got) if got else read_beats(store, [rank]).get(rank)


class Silence:
    """What every look at the heartbeat counters showed: which ranks' counters have not
    moved for ``after_s`` (silent), and which moved within it (alive). Kept across looks,
    from any thread: rank 0's watchdog looks while it waits for all ranks, and the report's
    writer goes on from there."""

    def __init__(self, after_s: float):
        self.after_s, self.last, self.moved = after_s, {}, {}
        self.looked: dict[int, float] = {}  # rank -> when its counter was last read
        self._lock = threading.Lock()

    def update(self, beats: dict, tampered=(), relayed=(), lag_s: float = 0.0) -> list[int]:
        """Record one look (rank -> counter); return the silent ranks among them. A rank in
        ``tampered`` (its heartbeat record was written from outside the run) counts as moving:
        a forger must not make a live rank look dead. A counter that could not be read (None
        after a value) is no news: a failed read is not a beat. A rank in ``relayed`` beats
        through its node's speaker, whose record reaches the store up to ``lag_s`` after the
        beat: its move proves a beat since the look before, less that lag (measured: a rank
        killed just after it beat had that beat posted after the abort, and was taken for
        alive)."""
        now = time.monotonic()
        with self._lock:
            for r, n in beats.items():
                before = self.looked.get(r, now)
                if r in tampered:
                    self.last[r] = (n, now)
                    self.moved[r] = (n, now, now)
                elif r not in self.last:
                    self.last[r] = (n, now)
                elif n is None and self.last[r][0] is not None:
                    continue
                elif self.last[r][0] != n:
                    self.last[r] = (n, now)
                    # it beat between those two looks (a relayed beat: up to lag_s before)
                    self.moved[r] = (n, now, before - lag_s * (r in relayed))
                self.looked[r] = now
            return sorted(r for r in beats if now - self.last[r][1] > self.after_s)

    def last_moved(self, ranks) -> float | None:
        """When the counters of ``ranks`` were last seen moving (the earliest; monotonic)."""
        with self._lock:
            seen = [self.last[r][1] for r in ranks if r in self.last]
        return min(seen) if seen else None

    def undecided(self, ranks, since: float) -> list[int]:
        """Ranks neither silent nor seen beating after ``since`` (monotonic): look again to
        know. A move proves life after ``since`` only when the look before it was after
        ``since`` too: a counter read once long ago and again now may have moved long ago,
        and the rank died since (a rank killed mid-collective, its last beat read first by
        the writer, was taken for alive and its two victims named: issue 32). Costs a live rank
        one heartbeat period more."""
        now = time.monotonic()
        with self._lock:
            return [r for r in ranks if now - self.last[r][1] <= self.after_s
                    and self.moved.get(r, (None, -1e9, -1e9))[2] < since]


def look_period(world: int, calls: float = BEAT_CALLS) -> float:
    """Seconds between one rank's looks at the store, when each look costs ``calls`` store
    calls and every rank looks: BEAT_S, or longer where the world would exceed the budget
    (1,000 ranks stay at BEAT_S; 4,096 beat every 0.41 s, 16,384 every 1.64 s)."""
    return max(BEAT_S, calls * world / STORE_OPS_PER_S)


def dead_after(world: int, rules: dict | None = None) -> float:
    """Heartbeat silence that counts as dead: the run's ``dead_after_s`` (``rules``, its
    ``diagnosis`` thresholds; None: the package's), or three heartbeat periods where the world
    stretches them (beyond 5,000 ranks; 16,384 ranks: 4.9 s)."""
    return max((rules or DIAGNOSIS)["dead_after_s"], 3 * look_period(world))


def wait_key(store, key: str, timeout_s: float, pause_max: float) -> bool:
    """Whether ``key`` exists within ``timeout_s``: one ``check`` at a time, the pause
    doubling from 1 ms to ``pause_max`` (a key set during a short wait is seen within a few
    ms; a long one costs one call per ``pause_max``). For the waits that must look at
    something else between looks, where the store's blocking ``wait`` would time out again
    and again, and c10d logs two warning lines each time."""
    end, pause = time.monotonic() + timeout_s, 0.001
    while not store.check([key]):
        left = end - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 2, pause_max)
    return True


def existing(store, wanted: list[str]) -> list[str]:
    """The keys that exist. One ``check`` answers for a whole group when all of it exists;
    a group with a key missing is halved, so k missing keys among n cost about
    2·k·log2(n/k) calls, and small groups are asked key by key (when few exist, about 1.5·n
    calls: the store has no "any of these" question)."""
    if not wanted:
        return []
    if store.check(wanted):
        return wanted
    if len(wanted) <= 4:
        return [k for k in wanted if store.check([k])]
    half = len(wanted) // 2
    return existing(store, wanted[:half]) + existing(store, wanted[half:])


def _genuine(store, prefix: str, ranks, forged: set | None = None) -> dict[int, bytes]:
    """The genuine record at ``prefix/r`` of each rank r in ``ranks`` that has one: the keys
    that exist, then their records in one read. Ranks whose record failed its check are
    added to ``forged``."""
    found = existing(store, [keys.of(prefix, r) for r in ranks])
    got = store.peek(found) if found else []
    if forged is not None:
        forged.update(int(k.rsplit("/", 1)[1]) for k, g in zip(found, got) if g is None)
    return {int(k.rsplit("/", 1)[1]): g for k, g in zip(found, got) if g is not None}


def ranks_with(store, prefix: str, ranks) -> set[int]:
    """Ranks r in ``ranks`` that posted ``prefix/r`` (a genuine record, not just the key)."""
    return set(_genuine(store, prefix, ranks))


def reads(store, prefix: str, ranks, forged: set | None = None) -> dict[int, dict]:
    """The JSON posted at ``prefix/r`` by each rank in ``ranks`` that posted one, in one
    read (evidence gathering never raises); ranks whose record failed, into ``forged``."""
    try:
        return {r: json.loads(g)
                for r, g in sorted(_genuine(store, prefix, ranks, forged).items())}
    except Exception:  # noqa: BLE001
        return {}


def read_beats(store, ranks, forged: set | None = None,
               relayed: set | None = None) -> dict[int, dict]:
    """Every heartbeat of ``ranks`` there is: the ranks that beat list themselves once
    (``beat/listed``), and so do the nodes whose ranks beat through a speaker
    (``nodebeat/listed``, :mod:`.node`), so four reads answer whatever the world size,
    however many have not beaten yet (a search among 16,384 keys, half of them missing,
    costs thousands). A node record that fails its check is no news of its ranks. The ranks
    whose beat came in a node's record, into ``relayed``."""
    try:
        ranks = set(ranks)
        beaten = sorted(set(listed(store, keys.BEAT)).intersection(ranks))
        got = store.peek([keys.of(keys.BEAT, r) for r in beaten]) if beaten else []
        if forged is not None:
            forged.update(r for r, g in zip(beaten, got) if g is None)
        beats = {r: json.loads(g) for r, g in zip(beaten, got) if g is not None}
        nodes = listed(store, keys.NODE_BEAT) if len(beats) < len(ranks) else []
        for record in store.peek([keys.of(keys.NODE_BEAT, n) for n in nodes]) if nodes else []:
            for r, beat in unpack(record).items():
                if r in ranks and beat.get("n", 0) > beats.get(r, {}).get("n", 0):
                    beats[r] = beat
                    if relayed is not None:
                        relayed.add(r)
        return beats
    except Exception:  # noqa: BLE001 — evidence gathering never raises
        return {}


def dead_ranks(store, ranks, silence: Silence,
               since: float | None = None) -> tuple[list[int], dict[int, dict]]:
    """Ranks whose heartbeat has not moved for ``silence.after_s``, and every rank's last
    published progress. A rank is alive when seen moving after
    ``since`` (monotonic; default: now): looks every BEAT_S until each rank is silent or seen
    moving — at once when rank 0's watchdog was watching since the trouble began, after the
    silence when a rank is dead and nobody was. A silent rank is then looked at until that
    bound (one silence and a beat after the first look) for a beat more, unless a witness or
    a node mate said how it ended: a link down for a second between a rank and the store (a
    flapping port, and TCP's backoff after it) holds its heartbeats as long as death would
    (measured: a port down 1 s in 2 named a live rank dead in 2 runs of 4)."""
    start = time.monotonic()
    since = start if since is None else since
    end, latest = start + silence.after_s + BEAT_S, {}
    decided = None  # the silent ranks once every rank was silent or seen moving
    while True:
        forged, relayed = set(), set()
        latest.update(read_beats(store, ranks, forged, relayed))
        silent = silence.update({r: (latest.get(r) or {}).get("n") for r in ranks}, forged,
                                relayed, look_period(max(ranks, default=0) + 1))
        if decided is None and not silence.undecided(ranks, since):
            decided = set(silent)
        if decided is not None:  # a witness's or a mate's word ends the wait for that rank
            waiting = decided & set(silent)
            if not waiting or not waiting - {*reads(store, keys.EXIT, waiting),
                                             *reads(store, keys.FATE, waiting)}:
                break
        if time.monotonic() > end:
            break
        time.sleep(BEAT_S)
    # (a rank that fell silent during the wait is leaving after the abort, not its cause)
    return [r for r in silent if decided is None or r in decided], \
        {r: p for r, p in latest.items() if p}


def posted(store, prefix: str, wait_for=(), timeout_s: float = 0.0) -> dict[int, dict]:
    """The JSON each rank posted at ``prefix/<rank>``, for the kinds of key a rank posts
    once and lists itself under ``prefix/listed`` (aborts, forensics): one list to read
    instead of a look per rank. First waits, up to ``timeout_s``, for the ranks in
    ``wait_for`` to be listed. Evidence gathering never raises."""
    try:
        end, pause = time.monotonic() + timeout_s, 0.01
        while True:
            ranks = listed(store, prefix)
            if set(wait_for) <= set(ranks) or time.monotonic() > end:
                break
            time.sleep(pause)
            pause = min(2 * pause, 0.2)
        got = store.peek([keys.of(prefix, r) for r in ranks]) if ranks else []
        return {r: json.loads(g) for r, g in zip(ranks, got) if g is not None}
    except Exception:  # noqa: BLE001
        return {}


def listed(store, prefix: str) -> list[int]:
    """The ranks that listed themselves under ``prefix/listed`` (signed items only)."""
    key = keys.listed(prefix)
    text = store.get(key).decode() if store.check([key]) else ""
    return sorted({int(r) for r in text.split(",") if r.strip().isdigit()})


def next_waiting(store, rank: int, world: int) -> int:
    """The lowest rank above ``rank`` that is waiting for the report (alive)."""
    return next((r for r in range(rank + 1, world)
                 if store.check([keys.of(keys.WAITING, r)])), world)
