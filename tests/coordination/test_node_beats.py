"""Node beats (coordination/node.py): a node's ranks beat through its lowest running rank.

The speaker's choice is tested against real processes in each state a rank can be in
(running, stopped, a zombie, gone, silent); the protocol on a real TCPStore with ranks as
threads (tests/coordination/test_protocol.py's ``world``); the worker tests strike a real
speaker under torchrun (tests/worker/test_node_beats.py).
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ddp_smoke.config.launchenv import LaunchEnv
from ddp_smoke.coordination import keys, node, records
from ddp_smoke.coordination.store import Silence, dead_after, listed, read_beats
from tests.coordination.test_protocol import _stopped_result

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
    coords = world(4, per_node=4, node_beats="on")
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
