"""Node speakers: a large world's ranks beat, arrive and post their observations through
their node.

Every rank beats once a look period, and a beat through the store costs two calls (the
heartbeat, and the look at the abort list): at 16,384 ranks the store's whole budget, before
any check asks for anything. Where the world would stretch the look period
(:func:`.store.look_period`: beyond 2,500 ranks), a rank other than rank 0 writes its
heartbeat to its node's shared memory instead (``/dev/shm``, a slot a rank); the speaker, the
lowest local rank still running, posts all of its node's slots in one record
(``nodebeat/<node>``) and looks at the abort list for them, and the others look at a file
the speaker raises once it sees the run aborted. A node's looks cost two calls, not two a
rank. Rank 0, whose heartbeat every other rank follows, still beats for itself.

What rank 0's watchdog reads is unchanged: every rank's counter, with a dead rank's slot
left as it was (its counter stops; it is named, not its node). The speaker gone (killed,
its process a zombie) or stopped (SIGSTOP) is seen at the next rank's look, from its process
state, and that rank speaks from then on: the node's record misses at most one period. A
speaker that is running but silent (its slot not written for two periods) is passed over
too. A whole node lost stops its record: all its ranks fall silent together, as before.

A check costs each rank three calls too (its arrival, rank 0's flag, its observation): 49,152
at 16,384 ranks. Through the node (:meth:`NodeBeats.relay`) each rank leaves its arrival and
its observation in a slot, and the node's relayer, the lowest local rank that has left one
and runs, posts them in one call and reads rank 0's flag for the node: three calls a node.
The relayer posts the same per-rank keys (``arrive/<stage>/<r>``, ``obs/<stage>/<r>``) in
one ``multi_set``, so that rank 0's wait, its watchdog's "silent and not posted" and the
blame read exactly what they read when every rank posts for itself: a rank that never
arrives is named alone (its node posts the others after :data:`PARTIAL_S`), a relayer that
dies or stops is replaced by the next rank (its slot's process is gone or frozen).

The slots are files on the node, written by replace (a reader sees a whole value or the one
before) and not signed: they never leave the node unless a rank of it signs them into a
record. ``node_speaker`` in the configuration: ``auto`` (beyond 2,500 ranks), ``on`` (any
world with more than one rank a node), ``off``.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time

from . import keys, proc, records

SHM = "/dev/shm"
AUTO_FROM = 2500  # ranks: where two calls a rank a period would stretch the look period
PARTIAL_S = 0.2  # a relayer posts the values it has after this, not the whole node's only
WOKEN = keys.WOKEN


def wanted(env, setting: str) -> bool:
    """Whether this rank beats through its node: never rank 0 or a rank alone on its node."""
    if env.rank == 0 or env.local_world_size < 2 or setting == "off":
        return False
    return setting == "on" or env.world_size > AUTO_FROM


def run_folder(store_address: str, run_id: str, restart: str = "0", root: str = SHM) -> str:
    """Where a run's nodes keep their slots: one folder a run and restart."""
    run = f"{store_address}/{run_id}/{restart}".encode()
    return os.path.join(root, f"ddp-smoke-{hashlib.blake2b(run, digest_size=8).hexdigest()}")


class NodeBeats:
    """One rank's slot in its node's folder, and the speaker's part when it is its turn.

    Args:
        env: the rank's launch environment (its node: ``group_rank``, ``local_rank``).
        period: the look period; a speaker whose slot is older than two is passed over.
        root: where the node's folder is made (shared memory by default).
    """

    def __init__(self, env, period: float, root: str = SHM):
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.dir = os.path.join(run_folder(env.store_address, env.run_id, restart, root),
                                f"node-{env.group_rank}")
        os.makedirs(self.dir, exist_ok=True)
        self.env, self.period, self.listed = env, period, False
        self._told: list[str] = []  # the stage whose flag this rank posted last (relays)
        self._slot = self._path(env.local_rank)
        self._aborted = os.path.join(self.dir, "aborted")
        self._forget_earlier_runs()

    def _forget_earlier_runs(self) -> None:
        """A run killed whole leaves its folder, and a run of the same id, store and restart
        gets the same one: this rank's own slots from then go, and the flags and the abort
        mark older than now (this run writes those only after every rank has started), lest
        a stale flag let a rank past a stage or a stale mark stop it."""
        now, mine = time.time(), f"{self.env.local_rank}."
        for name in os.listdir(self.dir):
            path = os.path.join(self.dir, name)
            try:
                if name.startswith(mine) or (name.startswith("flag.") or name == "aborted") \
                        and os.stat(path).st_mtime < now:
                    os.remove(path)
            except OSError:
                pass  # another rank of the node removed it first

    def _path(self, local_rank: int) -> str:
        return os.path.join(self.dir, f"{local_rank}.beat")

    def post(self, beat: str) -> None:
        """This rank's heartbeat (a :class:`.records.Beat`'s JSON) into its slot."""
        self._put(os.path.basename(self._slot), f"{self.env.rank} {os.getpid()}\n{beat}")

    def speaks(self) -> bool:
        """Whether this rank speaks for its node now: no lower local rank is running and
        beating."""
        return not any(_running(self._path(lr), 2 * self.period)
                       for lr in range(self.env.local_rank))

    def record(self) -> str:
        """Every slot of the node as one record: ``{"<rank>": beat, …}``."""
        slots = [_parse(_read(self._path(lr))) for lr in range(self.env.local_world_size)]
        return "{" + ",".join(f'"{rank}":{beat}' for rank, _, beat in filter(None, slots)) + "}"

    def speak(self, store) -> None:
        """The speaker's part of a beat: post the node's record (the first time, list the
        node)."""
        node = self.env.group_rank
        store.set(keys.of(keys.NODE_BEAT, node), self.record())
        if not self.listed:
            store.append(keys.listed(keys.NODE_BEAT), f"{node},")
            self.listed = True

    def tell_aborted(self) -> None:
        """The speaker saw the run aborted: the node's other ranks look for this file."""
        with open(self._aborted, "w"):
            pass

    def told_aborted(self) -> bool:
        return os.path.exists(self._aborted)

    def leave(self) -> None:
        """A clean exit: this rank's slots go, those of ranks whose process is gone too,
        and the node's folder with the last one out."""
        try:
            mine = f"{self.env.local_rank}."
            for name in os.listdir(self.dir):
                path = os.path.join(self.dir, name)
                if name.startswith(mine) or name.endswith(".beat") and not _alive(_pid(path)):
                    os.remove(path)
            left = os.listdir(self.dir)
            if not any(name.endswith(".beat") for name in left):
                for name in left:  # the flags and relayed values of the last stages
                    os.remove(os.path.join(self.dir, name))
                os.rmdir(self.dir)
                os.rmdir(os.path.dirname(self.dir))
        except OSError:
            pass  # another rank's slot, or a rank leaving at the same moment

    # -- relays: a node's arrivals and observations, one store call a node ---------------
    def relay(self, coord, store, prefix: str, value: str, what: str,
              flag: str | None = None) -> bool:
        """Post this rank's ``prefix/<rank>`` through its node: every rank of the node leaves
        its value in a slot; the relayer, the lowest local rank that is running and has left
        one, posts the node's values in one call (``multi_set``: the same per-rank keys, so
        that every reader of them, rank 0's wait and the blame alike, is unchanged) and then
        reads rank 0's ``flag`` for the node (one blocking read, :meth:`.protocol.Coordinator.
        await_flag`); the others wait for the node's flag file. A node whose values are not
        all in after :data:`PARTIAL_S` posts those that are, so that a rank that never
        arrives is named alone, not with its node. A relayer that dies or stops is replaced
        by the next (its slot's process is gone or stopped). False when the run is aborted:
        rank 0's flag says so, the node was told (:meth:`tell_aborted`), or this rank's
        deadline passed (it aborts)."""
        token = self.offer(prefix, value)
        posted: set[int] = set()
        since, pause = time.monotonic(), 0.0005
        while True:
            said = self._get(f"flag.{token}")
            if said is not None:
                return said != WOKEN
            got = self._values(token)  # (first: whole, then every lower one is seen)
            if self._relays(token):
                fresh = {r: v for r, v in got.items() if r not in posted}
                whole = len(got) == len(self.mates)
                if fresh and (whole or time.monotonic() - since > PARTIAL_S):
                    store.multi_set([keys.of(prefix, r) for r in fresh], list(fresh.values()))
                    posted |= set(fresh)
                    since = time.monotonic()
                if whole:
                    said = WOKEN
                    try:  # (Stop, when rank 0's flag says the run aborted)
                        said = coord.await_flag(store, flag, what).decode() if flag else "1"
                    finally:
                        self._put(f"flag.{token}", said)
                        self._forget(token)
                        if said == WOKEN:  # the node's ranks need not wait for a look
                            self.tell_aborted()
                    return True
            if self.told_aborted():
                return False
            if coord.expired(grace=True):  # the watchdog had its chance first
                coord.abort(store, records.TimeoutAbort, waiting_for=what)
                return False
            time.sleep(pause)
            pause = min(2 * pause, 0.01)

    def offer(self, prefix: str, value: str) -> str:
        """This rank's value of ``prefix/<rank>`` into its slot, for the relayer; the slot's
        name."""
        token = prefix.replace("/", "~")
        self._put(f"{self.env.local_rank}.{token}", f"{self.env.rank} {os.getpid()}\n{value}")
        return token

    @property
    def mates(self) -> list[int]:
        """The node's local ranks that relay: every one but rank 0 (which speaks for itself)."""
        first = self.env.rank - self.env.local_rank
        return [lr for lr in range(self.env.local_world_size) if first + lr != 0]

    def _relays(self, token: str) -> bool:
        """Whether this rank posts the node's values now: no lower local rank that runs has
        left one."""
        return not any(_alive(_pid(os.path.join(self.dir, f"{lr}.{token}")))
                       for lr in self.mates if lr < self.env.local_rank)

    def _values(self, token: str) -> dict[int, str]:
        slots = [_parse(self._get(f"{lr}.{token}")) for lr in self.mates]
        return {rank: value for rank, _, value in filter(None, slots)}

    def _forget(self, token: str) -> None:
        """The relayer, once it posted a stage's flag: the flag and the values of the stage
        before (every node mate has left that stage's wait: it left a value of this one).
        This stage's stay: a mate still in its wait must see them as they were."""
        for old in self._told:
            for name in ("flag", *self.mates):
                _remove(os.path.join(self.dir, f"{name}.{old}"))
        self._told = [token]

    def _put(self, name: str, text: str) -> None:
        """``name`` replaced whole (two relayers may raise one flag at once: a file each)."""
        path = os.path.join(self.dir, name)
        tmp = f"{path}.{os.getpid()}-{threading.get_ident()}.tmp"
        try:
            _write(tmp, text)
        except FileNotFoundError:  # the folder went with a rank that left: make it again
            os.makedirs(self.dir, exist_ok=True)
            _write(tmp, text)
        os.replace(tmp, path)

    def _get(self, name: str) -> str | None:
        return _read(os.path.join(self.dir, name))


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _parse(slot: str | None) -> tuple[int, int, str] | None:
    """A slot's ``"<rank> <pid>\\n<value>"`` as ``(rank, pid, value)``; None for a slot not
    written yet or not whole."""
    try:
        head, value = slot.split("\n", 1)
        rank, pid = head.split()[:2]
        return int(rank), int(pid), value
    except (AttributeError, ValueError):
        return None


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _running(slot: str, fresh_s: float) -> bool:
    """Whether the rank of ``slot`` can speak: its slot written within ``fresh_s`` and its
    process running."""
    try:
        fresh = time.time() - os.stat(slot).st_mtime <= fresh_s
    except OSError:
        return False
    return fresh and _alive(_pid(slot))


def _pid(slot: str) -> int | None:
    got = _parse(_read(slot))
    return got[1] if got else None


def _alive(pid: int | None) -> bool:
    """Whether ``pid`` runs: neither gone, a zombie, nor stopped (SIGSTOP). A process of
    another PID namespace reads as gone: its rank's successor speaks too (the record is the
    same either way)."""
    return proc.state(proc.stat(pid)) not in (None, "Z", "X", "T", "t")


def unpack(record: bytes | None) -> dict[int, dict]:
    """A node record's beats, by rank; nothing from a record that failed its check or does
    not parse (no news of its ranks, and no harm to the other nodes' news)."""
    try:
        return {int(r): beat for r, beat in json.loads(record).items() if isinstance(beat, dict)}
    except (TypeError, ValueError, AttributeError):
        return {}
