"""The protocol between ranks on a real TCPStore, ranks as threads of this process.

No process group, no torchrun: each simulated rank is a real Coordinator with its own store
connections, as the harness makes them, so arrival, deadlines, aborts, judging and the takeover
are tested here alone (the worker tests run them end to end).
"""
import datetime
import json
import threading
import time

import pytest
import torch.distributed as dist

from ddp_smoke.config.launchenv import LaunchEnv
from ddp_smoke.coordination import ending, judge, keys, liveness, signing
from ddp_smoke.coordination.protocol import Coordinator, Stop
from ddp_smoke.coordination.store import Silence
from tests.launch import free_port


@pytest.fixture
def world():
    """``make(n, timeout)`` → n Coordinators on one fresh store (rank 0's hosts it)."""
    port, made = free_port(), []

    def make(n: int, timeout: float = 5.0, checks=("alpha",)):
        cfg = {"checks": list(checks), "timeout": timeout}
        master = dist.TCPStore("127.0.0.1", port, n, True, datetime.timedelta(seconds=10),
                               wait_for_workers=False)
        made.append(master)

        def connect(may_host):
            raw = dist.TCPStore("127.0.0.1", port, n, False, datetime.timedelta(seconds=10),
                                wait_for_workers=False)
            # as the harness connects: every record signed with the run's one secret
            return signing.SignedStore(dist.PrefixStore("ddp_smoke/0", raw), "ddp_smoke/0",
                                       b"t" * 32, 0)

        coords = []
        for r in range(n):
            env = LaunchEnv(rank=r, world_size=n, local_rank=r, local_world_size=n,
                            group_rank=0, master_addr="127.0.0.1", master_port=port,
                            agent_store=True, launcher="test", run_id="t")
            c = Coordinator(env, cfg, connect, lambda *a: "fail", "now", time.monotonic())
            c.ranks = [{"rank": i, "host": f"h{i}"} for i in range(n)]
            coords.append(c)
        return coords
    return make


def _threads(fn, coords):
    out, threads = {}, []
    for c in coords:
        def body(c=c):
            try:
                out[c.env.rank] = fn(c)
            except BaseException as e:  # noqa: BLE001 — the test looks at it
                out[c.env.rank] = e
        threads.append(threading.Thread(target=body, daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_the_wire_format_is_unchanged():
    """Ranks of different builds share one store: these strings never change."""
    assert keys.of(keys.ARRIVE, keys.stage("compute", 2)) == "arrive/compute/2"
    assert keys.every(keys.of(keys.ARRIVE, keys.stage("compute", 2))) == "arrive/compute/2/all"
    assert keys.listed(keys.ABORT) == "abort/listed"
    assert keys.listed(keys.FORENSICS) == "forensics/listed"
    assert keys.of(keys.OBS, keys.stage("bandwidth", 0)) + "/3" == "obs/bandwidth/0/3"
    assert (keys.FINAL, keys.WRITER, keys.every(keys.BYE), keys.BACKEND, keys.RUN_ID) == (
        "final", "writer", "bye/all", "backend", "run_id")
    assert keys.ABORT_KINDS == ("error", "timeout", "terminated", "lost", "stopped")


def test_every_rank_arrives_and_rank_0_raises_the_flag(world):
    coords = world(3)
    out = _threads(lambda c: c.arrive(c.store, "arrive/alpha/0", "all"), coords)
    assert out == {0: None, 1: None, 2: None}
    assert coords[0].store.check(["arrive/alpha/0/all"])


def test_a_missing_rank_times_out_into_one_abort_and_stop(world):
    coords = world(2, timeout=0.5)
    c = coords[0]
    c.enter("alpha", 0.5)
    t = time.monotonic()
    with pytest.raises(Stop):
        c.arrive(c.store, "arrive/alpha/0", "every rank to arrive at alpha")
    assert time.monotonic() - t < 10
    abort = json.loads(c.store.get("abort/0"))
    assert abort["kind"] == "timeout" and abort["waiting_for"] == "every rank to arrive at alpha"
    assert c.aborted(c.store) and c.store.get("abort/listed") == b"0,"


def test_the_first_reason_stands_and_is_listed_once(world):
    c = world(2)[1]
    c.enter("alpha", None)
    c.abort(c.store, keys.ERROR, {"type": "ValueError"})
    c.abort(c.store, keys.TERMINATED, {"signal": "SIGTERM"})
    assert json.loads(c.store.get("abort/1"))["kind"] == "error"
    assert c.store.get("abort/listed") == b"1,"


def test_silence_tells_silent_moving_and_undecided_ranks(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    s = Silence(1.5)
    assert s.update({0: 1, 1: 1}) == []
    now[0] += 1.0
    assert s.update({0: 2, 1: 1}) == [] and s.undecided([0, 1], since=99.5) == [1]
    # a move proves life after `since` only when the look before it was after `since` too:
    # rank 0 beat somewhere between 100 and 101, and may have died since
    assert s.undecided([0, 1], since=100.5) == [0, 1]
    # a read that failed (None) is no beat
    now[0] += 0.25
    assert s.update({0: None, 1: None}) == [] and s.undecided([0, 1], since=100.5) == [0, 1]
    now[0] += 0.75
    assert s.update({0: 3, 1: 1}) == [1] and s.undecided([0, 1], since=100.5) == []


def test_the_judge_names_the_rank_whose_heartbeat_stopped(world):
    coords = world(3, checks=("alpha",))
    for c in coords:
        c.enter("alpha", 5.0)
        c.store.set(f"rank/{c.env.rank}", json.dumps(c.ranks[c.env.rank]))
        liveness.beat_once(c, c.beat_store, 1)
    _threads(lambda c: c.arrive(c.store, "arrive/alpha/0", "all"), coords)
    coords[0].silence = Silence(0.3)
    coords[0].silence.update({0: 1, 1: 1, 2: 1})
    time.sleep(0.4)
    done = threading.Event()

    def beat_on():  # ranks 0 and 1 beat on while the judge looks; rank 2 is gone
        n = 2
        while not done.is_set():
            for c in coords[:2]:
                liveness.beat_once(c, c.beat_store, n)
            n += 1
            done.wait(0.1)
    beating = threading.Thread(target=beat_on)
    beating.start()
    coords[0].abort(coords[0].store, keys.LOST, {"silent": [2]})
    coords[0].identities(coords[0].store)
    try:
        live = judge.judge_as_a_rank(coords[0].store, coords[0].stopped(), coords[0].silence)
    finally:
        done.set()
        beating.join()
    result = coords[0].judged[-1][1]
    assert live == {0, 1} and result.name == "alpha" and result.status == "fail"
    assert [k.rank for k in result.culprits] == [2] and result.culprits[0].host == "h2"


class _Left(Exception):
    """ending.leave, which would end this process, raises this instead."""


def test_a_survivor_claims_the_report_when_rank_0_never_writes(world, monkeypatch):
    """Rank 0 never beats: the lowest waiting rank claims the writer key, once; the other
    waits for that writer's heartbeat, then leaves saying so."""
    monkeypatch.setattr(ending, "TAKEOVER_S", 0.5)
    monkeypatch.setattr(ending, "leave", lambda message, code: (_ for _ in ()).throw(
        _Left(message)))
    coords = world(3)
    got = _threads(lambda c: ending.await_report(c, c.store, 1.5), coords[1:])
    assert got[1] == ending.TAKE_OVER and coords[1].store.get("writer") == b"1"
    assert isinstance(got[2], _Left) and "no rank wrote the report" in str(got[2])
