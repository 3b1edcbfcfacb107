"""Node beats: a large world's ranks beat through one rank of their node, the speaker.

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

The slots are files on the node, written by replace (a reader sees a whole beat or the one
before) and not signed: they never leave the node unless the speaker signs them into its
record. ``node_beats`` in the configuration: ``auto`` (beyond 2,500 ranks), ``on`` (any
world with more than one rank a node), ``off``.
"""
from __future__ import annotations

import hashlib
import json
import os
import time

from . import keys, proc

SHM = "/dev/shm"
AUTO_FROM = 2500  # ranks: where two calls a rank a period would stretch the look period


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
        self._slot = self._path(env.local_rank)
        self._aborted = os.path.join(self.dir, "aborted")

    def _path(self, local_rank: int) -> str:
        return os.path.join(self.dir, f"{local_rank}.beat")

    def post(self, beat: str) -> None:
        """This rank's heartbeat (a :class:`.records.Beat`'s JSON) into its slot."""
        tmp, text = self._slot + ".tmp", f"{self.env.rank} {os.getpid()}\n{beat}"
        try:
            _write(tmp, text)
        except FileNotFoundError:  # the folder went with a rank that left: make it again
            os.makedirs(self.dir, exist_ok=True)
            _write(tmp, text)
        os.replace(tmp, self._slot)

    def speaks(self) -> bool:
        """Whether this rank speaks for its node now: no lower local rank is running and
        beating."""
        return not any(_running(self._path(lr), 2 * self.period)
                       for lr in range(self.env.local_rank))

    def record(self) -> str:
        """Every slot of the node as one record: ``{"<rank>": beat, …}``."""
        parts = []
        for lr in range(self.env.local_world_size):
            try:
                with open(self._path(lr)) as f:
                    head, beat = f.read().split("\n", 1)
            except (OSError, ValueError):
                continue  # not started yet, or a slot being replaced
            parts.append(f'"{head.split()[0]}":{beat}')
        return "{" + ",".join(parts) + "}"

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
        """A clean exit: this rank's slot goes, those of ranks whose process is gone too,
        and the node's folder with the last one out."""
        try:
            os.remove(self._slot)
            for name in os.listdir(self.dir):
                path = os.path.join(self.dir, name)
                if name.endswith(".beat") and not _alive(_pid(path)):
                    os.remove(path)
            left = os.listdir(self.dir)
            if set(left) <= {"aborted"}:
                for name in left:
                    os.remove(os.path.join(self.dir, name))
                os.rmdir(self.dir)
                os.rmdir(os.path.dirname(self.dir))
        except OSError:
            pass  # another rank's slot, or a rank leaving at the same moment


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
    try:
        with open(slot) as f:
            return int(f.readline().split()[1])
    except (OSError, ValueError, IndexError):
        return None


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
