"""Node speakers (coordination/node.py): a node's ranks beat, arrive and post their
observations through one of them.

The speaker's and the relayer's choice are tested against real processes in each state a rank
can be in (running, stopped, a zombie, gone, silent); the protocol on a real TCPStore with
ranks as threads (tests/coordination/test_protocol.py's ``world``); the worker tests strike a
real speaker under torchrun (tests/worker/test_node_beats.py).
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from ddp_smoke.config.launchenv import LaunchEnv
from ddp_smoke.coordination import keys, node, records, stopped_run
from ddp_smoke.coordination.store import Silence, dead_after, listed, read_beats
from ddp_smoke.coordination.protocol import Stop
from tests.coordination.test_protocol import _stopped_result, _threads

PERIOD = 0.25


def _env(local_rank: int, size: int = 4, world_size: int = 8) -> LaunchEnv:
    return LaunchEnv(rank=4 + local_rank, world_size=world_size, local_rank=local_rank,
                     local_world_size=size, group_rank=1, master_addr="127.0.0.1",
                     master_port=1, agent_store=True, launcher="test", run_id="nb")


def _slot(beats: node.NodeBeats, pid: int, age_s: float = 0.0) -> None:
    """A slot as another process would have written it, ``age_s`` ago."""
    with open(beats._slot, "w") as f:
        f.write(f"{beats.env.rank} {pid}\n" + json.dumps({"n": 1, "t": 0, "stage": "x"}))
    then = time.time() - age_s
    os.utime(beats._slot, (then, then))


@pytest.fixture
def processes():
    """``start()`` → a real process to put in a state; all killed and reaped at the end."""
    made = []

    def start():
        made.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
        return made[-1]
    yield start
    for p in made:
        p.kill()
        p.wait()


def test_the_lowest_running_local_rank_speaks(tmp_path, processes):
    lower, me = node.NodeBeats(_env(0), PERIOD, str(tmp_path)), \
        node.NodeBeats(_env(1), PERIOD, str(tmp_path))
    me.post(json.dumps({"n": 1, "t": 0, "stage": "x"}))
    assert me.speaks() is True  # no slot below: rank 0's not started (or it left)
    running = processes()
    _slot(lower, running.pid)
    assert me.speaks() is False
    _slot(lower, running.pid, age_s=3 * PERIOD)  # running, but silent two periods and more
    assert me.speaks() is True
    os.kill(running.pid, signal.SIGSTOP)  # frozen: passed over at once
    _slot(lower, running.pid)
    for _ in range(50):
        if me.speaks():
            break
        time.sleep(0.01)
    assert me.speaks() is True
    zombie = processes()
    zombie.kill()
    time.sleep(0.3)  # killed, not reaped: its PID still exists
    _slot(lower, zombie.pid)
    assert os.path.exists(f"/proc/{zombie.pid}") and me.speaks() is True
    zombie.wait()  # gone
    assert me.speaks() is True
    os.kill(running.pid, signal.SIGCONT)
    _slot(lower, running.pid)
    assert me.speaks() is False
    # the record holds every slot, by rank, as posted
    assert node.unpack(me.record().encode()) == {4: {"n": 1, "t": 0, "stage": "x"},
                                                  5: {"n": 1, "t": 0, "stage": "x"}}


def test_the_relayer_is_the_lowest_rank_that_left_a_value_and_runs(tmp_path, processes):
    """A node's values go through the lowest local rank that left one and runs: a lower rank
    that has not arrived is passed over (so that it is named alone), and so is one whose
    process is frozen or gone once it left its value (the next one posts in its place)."""
    lower, me = node.NodeBeats(_env(0), PERIOD, str(tmp_path)), \
        node.NodeBeats(_env(1), PERIOD, str(tmp_path))
    token = me.offer("arrive/alpha/0", "1")
    assert me._relays(token) is True  # rank 4 (local 0) has not arrived
    running = processes()
    lower._put(f"0.{token}", f"4 {running.pid}\n1")  # as its own process would leave it
    assert me._relays(token) is False
    assert me._values(token) == {4: "1", 5: "1"}
    os.kill(running.pid, signal.SIGSTOP)
    for _ in range(50):
        if me._relays(token):
            break
        time.sleep(0.01)
    assert me._relays(token) is True  # frozen
    os.kill(running.pid, signal.SIGCONT)
    for _ in range(50):
        if not me._relays(token):
            break
        time.sleep(0.01)
    assert me._relays(token) is False
    running.kill()
    running.wait()
    assert me._relays(token) is True  # gone


def test_a_run_of_the_same_id_forgets_what_a_killed_one_left(tmp_path):
    """A run killed whole leaves its node folder; the next run of the same id, store and
    restart gets the same one. A stale flag would let a rank past a stage before its node
    arrived, a stale abort mark would stop it: each rank forgets its own slots when it starts,
    and the flags and the mark older than that."""
    first = node.NodeBeats(_env(1), PERIOD, str(tmp_path))
    left = ["1.arrive~alpha~0", "1.beat", "2.arrive~alpha~0", "flag.arrive~alpha~0", "aborted"]
    for name in left:
        path = os.path.join(first.dir, name)
        with open(path, "w") as f:
            f.write("5 1\n1")
        os.utime(path, (time.time() - 10, time.time() - 10))
    again = node.NodeBeats(_env(1), PERIOD, str(tmp_path))
    assert again.dir == first.dir
    assert sorted(os.listdir(again.dir)) == ["2.arrive~alpha~0"]  # local rank 2's: its own
    assert not again.told_aborted()
    node.NodeBeats(_env(2), PERIOD, str(tmp_path))
    assert os.listdir(again.dir) == []


def test_a_clean_exit_takes_the_slots_of_gone_ranks_and_the_last_one_the_folder(tmp_path,
                                                                                  processes):
    gone = processes()
    a, b, c = (node.NodeBeats(_env(i), PERIOD, str(tmp_path)) for i in range(3))
    _slot(a, (p := processes()).pid)
    b.post("{}")
    _slot(c, gone.pid)
    gone.kill()
    gone.wait()
    b.leave()  # its own slot and the gone rank's; a's process runs: the folder stays
    assert sorted(os.listdir(b.dir)) == ["0.beat"]
    p.kill()
    p.wait()
    b.post("{}")
    b.leave()
    assert os.listdir(tmp_path) == []


def test_auto_is_for_worlds_beyond_the_store_budget_and_never_for_rank_0():
    assert node.wanted(_env(1, world_size=2501), "auto") is True
    assert node.wanted(_env(1, world_size=2500), "auto") is False
    assert node.wanted(_env(1), "on") is True and node.wanted(_env(1), "off") is False
    rank0 = LaunchEnv(rank=0, world_size=9000, local_rank=0, local_world_size=8, group_rank=0,
                      master_addr="h", master_port=1, agent_store=True, launcher="t", run_id="r")
    alone = _env(0, size=1, world_size=9000)
    assert not node.wanted(rank0, "on") and not node.wanted(alone, "on")


def test_a_silent_speaker_is_named_alone_and_its_node_beats_on(world):
    """Ranks 1-3 share a node; rank 1 speaks until it falls silent; rank 2 takes over and
    rank 0 sees exactly rank 1 silent, as it would see a rank beating for itself."""
    coords = world(4, per_node=4, node_speaker="on")
    try:
        assert [c.liveness.node is not None for c in coords] == [False, True, True, True]
        store = coords[0].store
        silence = Silence(dead_after(4))
        for _ in range(2):  # (the speaker posts what its node's slots hold when it beats)
            for c in coords:
                c.enter("alpha", 5.0)
                c.store.set(f"rank/{c.env.rank}", json.dumps(c.run.ranks[c.env.rank]))
                c.liveness.beat(c.store)
        assert not store.check([keys.of(keys.BEAT, 1)]) and listed(store, keys.NODE_BEAT) == [0]
        beats = read_beats(store, range(4))
        assert {r: b["n"] for r, b in beats.items()} == {0: 2, 1: 2, 2: 1, 3: 1}
        silent, end = [], time.monotonic() + 3 * silence.after_s
        silence.update({r: b["n"] for r, b in beats.items()})
        while time.monotonic() < end and not silent:
            for c in (coords[0], coords[2], coords[3]):  # rank 1 fell silent
                c.liveness.beat(c.store)
            silent = silence.update({r: b["n"] for r, b in read_beats(store, range(4)).items()})
            time.sleep(PERIOD)
        assert silent == [1]
        assert coords[2].liveness._speaks and read_beats(store, [3])[3]["n"] > 2
        # the abort reaches the node through its speaker: a rank beside it reads no list
        coords[0].abort(store, records.LostAbort, silent=[1], waiting_for="alpha")
        assert coords[3].liveness._look(coords[3].store) is False  # not told yet
        assert coords[2].liveness._look(coords[2].store) is True
        assert coords[3].liveness._look(coords[3].store) is True
        stopped, live = _stopped_result(coords, coords[0].run.replace(silence=silence),
                               lambda: [c.liveness.beat(c.store) for c in coords if c is not
                                        coords[1]])
        assert [k.rank for k in stopped.judged[-1][1].culprits] == [1] and live == {0, 2, 3}
    finally:
        for c in coords:
            if c.liveness.node is not None:
                c.liveness.node.leave()


class _Calls:
    """A rank's store, passed through, with the calls its main thread makes listed."""

    def __init__(self, store):
        self._store, self.made = store, []

    def __getattr__(self, name):
        attr = getattr(self._store, name)
        if callable(attr):
            self.made.append(name)
        return attr


def _arrive_and_post(c, store, stage="alpha"):
    c.enter(stage, 5.0)
    c.arrive(store, keys.of(keys.ARRIVE, c.key(stage)), f"every rank to arrive at {stage}")
    c.post_observation(store, stage, records.Observation(data={"r": c.env.rank},
                                                         duration_s=0.0, waits=[]))
    return c.gather(store, stage) if c.env.rank == 0 else None


def test_a_nodes_arrivals_and_observations_are_one_call_each_of_its_relayer(world, monkeypatch):
    """Ranks 1-3 share a node: each leaves its arrival and its observation in a slot, and the
    lowest of them posts the node's in one call (the same per-rank keys rank 0 waits for and
    the blame reads) and reads rank 0's flag for the node; ranks 2 and 3 make no store call.
    Two checks in a row: a stage's flag is not taken for the next one's."""
    monkeypatch.setattr(node, "PARTIAL_S", 30.0)  # the whole node at once, whoever is first
    coords = world(4, per_node=4, node_speaker="on", checks=("alpha", "beta"))
    spies = {c.env.rank: _Calls(c.store) for c in coords}
    try:
        for stage in ("alpha", "beta"):
            out = _threads(lambda c: _arrive_and_post(c, spies[c.env.rank], stage),
                           coords[::-1])
            assert [o["data"]["r"] for o in out[0]] == [0, 1, 2, 3], out
            assert out[1] is None and out[2] is None and out[3] is None, out
            store = coords[0].store
            assert all(store.check([f"arrive/{stage}/0/{r}", f"obs/{stage}/0/{r}"])
                       for r in range(4))
        # (between the slices of its flag's read the relayer beats: its liveness look)
        assert spies[1].made.count("multi_set") == 4, spies[1].made
        assert spies[2].made == spies[3].made == []
        # the relayer keeps the last stage's flag and values only
        left = sorted(os.listdir(coords[1].liveness.node.dir))
        assert [n for n in left if not n.endswith(".beat")] == [
            "1.obs~beta~0", "2.obs~beta~0", "3.obs~beta~0", "flag.obs~beta~0"], left
    finally:
        for c in coords[1:]:
            c.liveness.node.leave()
    assert not os.path.exists(coords[1].liveness.node.dir)


def test_an_abort_wakes_the_relayer_and_through_it_its_node_at_once(world):
    """Ranks 1-3 arrived; their relayer blocks on rank 0's flag. Rank 3 aborts: the relayer
    wakes (the first aborting rank writes WOKEN where ranks block), raises the node's flag as
    WOKEN and tells the node, so that every rank of it stops now, not a look later."""
    coords = world(4, per_node=4, node_speaker="on", timeout=30.0)
    try:
        out = {}

        def arrive(c):
            try:
                c.arrive(c.store, "arrive/alpha/0", "every rank to arrive at alpha")
            except BaseException as e:  # noqa: BLE001
                out[c.env.rank] = e
        for c in coords:
            c.enter("alpha", 30.0)
        threads = [threading.Thread(target=arrive, args=(coords[r],)) for r in (1, 2, 3)]
        for t in threads:
            t.start()
        store, end = coords[0].store, time.monotonic() + 10
        while not store.check([f"arrive/alpha/0/{r}" for r in (1, 2, 3)]):
            assert time.monotonic() < end, "the node's arrivals not posted"
            time.sleep(0.02)
        time.sleep(0.2)  # the relayer is in its blocking read
        t = time.monotonic()
        coords[3].abort(coords[3].store, records.ErrorAbort, type="ValueError", message="x")
        for th in threads:
            th.join(10)
        assert all(isinstance(out.get(r), Stop) for r in (1, 2, 3)), out
        assert time.monotonic() - t < coords[1].follow_slice + 0.5
        assert coords[2].liveness.node.told_aborted()
    finally:
        for c in coords[1:]:
            c.liveness.node.leave()


def test_a_rank_that_never_arrives_is_named_alone_not_its_node(world, monkeypatch):
    """Rank 2 never arrives: after PARTIAL_S its node posts ranks 1 and 3, so rank 0's blame
    names rank 2 alone, not its node; the relayer, waiting for rank 2, stops once its node is
    told the run aborted."""
    monkeypatch.setattr(stopped_run, "FORENSICS_WAIT_S", 0.2)  # (none are left here)
    coords = world(4, per_node=4, node_speaker="on", timeout=1.0)
    for c in coords:
        c.enter("alpha", 1.0)
        c.store.set(f"rank/{c.env.rank}", json.dumps(c.run.ranks[c.env.rank]))
        c.liveness.beat(c.store)
    run = coords[0].run
    try:
        out = {}

        def relayed(c):  # a thread that lets its exception out of relay
            try:
                c.arrive(c.store, "arrive/alpha/0", "every rank to arrive at alpha")
            except BaseException as e:  # noqa: BLE001
                out[c.env.rank] = e
        threads = [threading.Thread(target=relayed, args=(coords[r],)) for r in (1, 3)]
        for t in threads:
            t.start()
        store, end = coords[0].store, time.monotonic() + 10
        arrived = [1, 3]
        while not store.check([f"arrive/alpha/0/{r}" for r in arrived]):
            assert time.monotonic() < end, "ranks 1 and 3 not posted"
            time.sleep(0.05)
        assert not store.check(["arrive/alpha/0/2"])
        store.set("arrive/alpha/0/0", "1")  # rank 0 arrived; its deadline passes, it aborts
        coords[0].abort(store, records.TimeoutAbort, waiting_for="every rank to arrive at alpha")
        coords[1].liveness.beat(coords[1].store)  # the node's speaker looks, and tells it
        assert coords[1].liveness._look(coords[1].store) is True
        for t in threads:
            t.join(10)
        assert not any(t.is_alive() for t in threads)
        assert isinstance(out[1], Stop) and isinstance(out[3], Stop), out
        stopped, live = _stopped_result(coords, run.replace(silence=Silence(30.0)),
                                        lambda: [c.liveness.beat(c.store) for c in coords])
        result = stopped.judged[-1][1]
        assert [k.rank for k in result.culprits] == [2], result
        assert result.figures["arrived"] == [0, 1, 3]
    finally:
        for c in coords[1:]:
            c.liveness.node.leave()


@pytest.mark.parametrize("relayed", [False, True], ids=["own", "relayed"])
def test_a_relayed_beat_posted_after_the_abort_proves_no_life(relayed):
    """A node's speaker posts its mates' beats up to a period after they wrote them: a rank
    killed just after it beat has that beat reach the store after the abort. Seen then, the
    move proves nothing (measured in the campaign with --node-speaker on: a rank killed by
    SIGABRT was taken for alive in 2 runs of 4, and its two node mates named instead); a rank
    that beats for itself, seen moving between two looks after the abort, is alive."""
    silence, lag = Silence(0.3), 0.25
    look = dict(relayed={2} if relayed else set(), lag_s=lag)
    silence.update({2: 6}, **look)
    since = time.monotonic()  # the abort
    time.sleep(0.01)
    silence.update({2: 6}, **look)  # the first look after it: not moved yet
    time.sleep(0.01)
    silence.update({2: 7}, **look)  # the beat it wrote before it died, posted now
    assert silence.undecided([2], since) == ([2] if relayed else [])
