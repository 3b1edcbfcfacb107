"""The protocol between ranks on a real TCPStore, ranks as threads of this process.

No process group, no torchrun: each simulated rank is a real Coordinator with its one store
connection, as the harness makes it, so arrival, deadlines, aborts, judging and the takeover
are tested here alone (the worker tests run them end to end).
"""
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from ddp_smoke.coordination import ending, fate, keys, records, stopped_run
from ddp_smoke.coordination import protocol as protocol_module
from ddp_smoke.coordination.protocol import Stop
from ddp_smoke.coordination.store import Silence, beat_of


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
    c.abort(c.store, records.ErrorAbort, type="ValueError", message="")
    c.abort(c.store, records.TerminatedAbort, signal="SIGTERM")
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


def _entered(coords, ranks=None):
    """Every rank inside check alpha, its identity posted, one heartbeat; the writer's run,
    with a 0.3 s silence that has seen that beat."""
    for c in coords:
        if ranks:
            c.met(ranks)
        c.enter("alpha", 5.0)
        c.store.set(f"rank/{c.env.rank}", json.dumps(c.run.ranks[c.env.rank]))
        c.liveness.beat(c.store)
    run = coords[0].run.replace(silence=Silence(0.3))
    run.silence.update({r: beat_of(coords[0].store, r)["n"] for r in range(len(coords))})
    return run


def _stopped_result(coords, run, meanwhile, me=None):
    """Rank 0 blames the stopped run while ``meanwhile()`` runs every 0.05 s (the live
    ranks' heartbeats); the stopped run, its result appended, and the ranks found alive."""
    stopped = run.with_identities(coords[0].store).stopped()
    done = threading.Event()

    def loop():
        while not done.is_set():
            meanwhile()
            done.wait(0.05)
    beating = threading.Thread(target=loop)
    beating.start()
    try:
        live = stopped_run.add_stopped_result_as_a_rank(coords[0].store, stopped, run.silence, me)
    finally:
        done.set()
        beating.join()
    return stopped, live


def _beat(coords):
    return lambda: [c.liveness.beat(c.store) for c in coords]


def test_the_writer_names_the_rank_whose_heartbeat_stopped(world):
    coords = world(3, checks=("alpha",))
    run = _entered(coords)
    _threads(lambda c: c.arrive(c.store, "arrive/alpha/0", "all"), coords)
    time.sleep(0.4)
    coords[0].abort(coords[0].store, records.LostAbort, silent=[2], waiting_for="alpha")
    # ranks 0 and 1 beat on while the writer looks; rank 2 is gone
    stopped, live = _stopped_result(coords, run, _beat(coords[:2]))
    result = stopped.judged[-1][1]
    assert live == {0, 1} and result.name == "alpha" and result.status == "fail"
    assert [k.rank for k in result.culprits] == [2] and result.culprits[0].host == "h2"


def test_the_writer_looks_itself_at_a_dead_node_mate_nobody_had_a_word_on(world):
    """Its node mates looked as they saw the abort, maybe while it was still exiting, and
    posted no word on it: the writer, on that node, sees now that its process is gone."""
    fate.mark_kernel_log()  # as a rank does at its start: an older OOM line may name this PID
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    coords = world(3, checks=("alpha",))
    host = os.uname().nodename
    run = _entered(coords, [{"rank": r, "host": host, "group_rank": 0, "pid": pid}
                            for r, pid in enumerate((os.getpid(), os.getpid(), gone.pid))])
    coords[0].abort(coords[0].store, records.LostAbort, silent=[2], waiting_for="alpha")
    stopped, _ = _stopped_result(coords, run, _beat(coords[:2]), me=0)
    [culprit] = stopped.judged[-1][1].culprits
    assert culprit.rank == 2 and f"its process {gone.pid} is gone from {host}" in \
        culprit.reason, culprit


def test_a_rank_terminated_while_the_writer_waits_is_a_victim_not_dead(world):
    """torchrun stops the others when one rank dies, the writer too: it blames at once, and a
    loaded peer, its heartbeat already still, says it was terminated only while the writer
    waits on the heartbeats. That peer is a victim; the rank that died first is the culprit,
    alone."""
    coords = world(3, checks=("alpha",))
    run = _entered(coords)
    time.sleep(0.05)  # rank 2 is gone; the launcher signals ranks 0 and 1
    coords[0].abort(coords[0].store, records.TerminatedAbort, signal="SIGTERM")
    t0 = time.monotonic()

    def meanwhile():  # the writer beats on; rank 1 says it was terminated after 0.1 s
        coords[0].liveness.beat(coords[0].store)
        if time.monotonic() - t0 > 0.1 and not coords[1].store.check(["abort/1"]):
            coords[1].abort(coords[1].store, records.TerminatedAbort, signal="SIGTERM")
    stopped, _ = _stopped_result(coords, run, meanwhile, me=0)
    result = stopped.judged[-1][1]
    assert [k.rank for k in result.culprits] == [2], result.culprits
    assert [v["rank"] for v in result.figures["victims"]] == [0, 1]


class _Left(Exception):
    """ending.leave, which would end this process, raises this instead."""


def test_a_survivor_claims_the_report_when_rank_0_never_writes(world, monkeypatch):
    """Rank 0 never beats: the lowest waiting rank claims the writer key, once; the other
    waits for that writer's heartbeat, then leaves saying so."""
    monkeypatch.setattr(ending, "TAKEOVER_SILENCES", 0.5 / 1.5)  # 0.5 s of rank 0's silence
    monkeypatch.setattr(ending, "leave", lambda message, code: (_ for _ in ()).throw(
        _Left(message)))
    coords = world(3)
    got = _threads(lambda c: ending.await_report(c, c.store, 1.5), coords[1:])
    assert got[1] == ending.TAKE_OVER and coords[1].store.get("writer") == b"1"
    assert isinstance(got[2], _Left) and "no rank wrote the report" in str(got[2])


# -- one connection per rank (issue 34) -------------------------------------------------------

def test_each_rank_holds_one_connection_and_its_threads_take_turns(world):
    """While the main thread waits (a key that never comes, in slices), another thread's
    calls on the same connection go through between the slices, in order."""
    c = world(2)[1]
    assert len(world.connections) == 2  # one per rank: 16,384 ranks, 16,384 sockets

    def wait():
        with pytest.raises(dist.DistStoreError, match="timeout"):
            c.store.raw.wait(["never"], datetime.timedelta(seconds=1.5), slice_s=0.25)
    waiting = threading.Thread(target=wait, daemon=True)
    t = time.monotonic()
    waiting.start()
    time.sleep(0.05)
    for i in range(3):
        c.store.set(f"k{i}", str(i))
    passed = time.monotonic() - t
    assert c.store.get("k2") == b"2" and waiting.is_alive()
    assert passed < 1.2, passed  # within slices, not after the whole wait
    waiting.join(5)


def test_an_abort_wakes_a_rank_blocked_on_rank_0s_flag(world):
    """Rank 1 blocks on rank 0's arrival flag (one read, in long slices); rank 2 aborts:
    rank 1 stops at once, and a flag rank 0 raised before stays as it was."""
    coords = world(3, timeout=30.0, checks=("alpha", "beta"))
    for c in coords:
        c.enter("alpha", 30.0)
    coords[0].store.set(keys.every(keys.of(keys.ARRIVE, keys.stage("alpha", 0))), "1")
    got = {}

    def block(c=coords[1]):
        t = time.monotonic()
        try:
            c.await_flag(c.store, keys.every(keys.of(keys.ARRIVE, keys.stage("beta", 0))),
                         "every rank to arrive at beta")
        except Stop:
            got["stopped_after_s"] = time.monotonic() - t
    blocked = threading.Thread(target=block, daemon=True)
    blocked.start()
    time.sleep(0.3)
    coords[2].abort(coords[2].store, records.ErrorAbort, type="ValueError", message="x")
    blocked.join(10)
    assert got["stopped_after_s"] < coords[1].follow_slice + 0.5, got
    assert coords[0].store.get(keys.every(keys.of(keys.ARRIVE, keys.stage("alpha", 0)))) == b"1"
    assert json.loads(coords[0].store.get("abort/2"))["kind"] == "error"


def test_a_rank_reads_its_nodes_and_rank_0s_nodes_identities_and_the_writer_the_rest(world):
    coords = world(6, per_node=2)
    for c in coords:
        c.store.set(keys.of(keys.RANK, c.env.rank),
                    json.dumps({"rank": c.env.rank, "host": f"n{c.env.rank // 2}"}))
    for c in coords:
        c.meet(c.store)
    assert {c.env.rank: [r["rank"] for r in c.run.ranks if r] for c in coords} == {
        0: [0, 1, 2, 3, 4, 5], 1: [0, 1], 2: [0, 1, 2, 3], 3: [0, 1, 2, 3], 4: [0, 1, 4, 5],
        5: [0, 1, 4, 5]}
    assert [c.run.host(3) for c in coords] == ["n1", None, "n1", "n1", None, None]
    writer = coords[5].run.with_identities(coords[5].store)  # a survivor about to write
    assert [r["host"] for r in writer.ranks] == ["n0", "n0", "n1", "n1", "n2", "n2"]


def test_records_have_one_shape_per_kind():
    """Every abort kind of the wire table has its record type, and reads back as it."""
    assert tuple(records.ABORTS) == keys.ABORT_KINDS
    lost = records.LostAbort(rank=0, stage="ddp_step", at=1.0, silent=[3], waiting_for="x")
    assert records.abort_of(json.loads(records.text(lost))) == lost
    with pytest.raises(ValueError, match="unknown abort kind"):
        records.abort_of({"kind": "write"})
    with pytest.raises(TypeError):
        records.TimeoutAbort(rank=0, stage="s", at=1.0, signal="SIGTERM")


def test_the_run_is_the_main_threads_and_the_writer_works_on_a_frozen_copy(world):
    """Issue 31 item 2: the writer of the report takes the run as it stood and works on that;
    the main thread's later steps (a result judged meanwhile) do not reach it."""
    c = world(2, checks=("alpha", "beta"))[0]
    c.enter("alpha", 5.0)
    taken = c.run
    from ddp_smoke.model import CheckResult
    c.post_result(c.store, CheckResult("alpha", "pass", summary="ok"))
    c.enter("beta", 5.0)
    assert taken.judged == () and taken.stage == "alpha"
    assert [r.name for _, r in c.run.judged] == ["alpha"] and c.run.stage == "beta"
    with pytest.raises(dataclasses.FrozenInstanceError):
        taken.stage = "beta"


def test_no_module_but_the_protocol_writes_a_coordinators_state():
    """Before: the watchdog thread wrote `judged`, `timings` and `ranks`, and four other
    modules wrote a Coordinator's attributes fifteen times. Now only its own methods do."""
    import ast
    from pathlib import Path
    package = Path(protocol_module.__file__).parent.parent
    writes = []
    for path in package.rglob("*.py"):
        if path.name == "protocol.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for t in targets:
                base = t.value if isinstance(t, (ast.Attribute, ast.Subscript)) else None
                base = base.value if isinstance(base, ast.Attribute) and \
                    isinstance(t, ast.Subscript) else base
                if isinstance(base, ast.Name) and base.id in ("c", "coord"):
                    writes.append(f"{path.name}:{node.lineno}")
    assert writes == []


def test_a_rank_whose_own_transport_cannot_start_is_no_victim():
    """gloo's device on a node without the interface it is told to use raises from
    gloo/transport, as a peer's disappearance does; that rank is the culprit (seen in the
    campaign's missing_interface cell: every rank named "did not finish init" instead)."""
    def raised(message):
        try:
            raise RuntimeError(message)
        except RuntimeError as e:
            return records.error_detail(e)
    own = raised("[enforce fail at /__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
                 "device.cc:84] ifa != nullptr. Unable to find address for: eth0")
    assert own["comm"] is False and own["message"].endswith("Unable to find address for: eth0")
    peer = raised("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by "
                  "peer [10.231.9.3]:4242")
    assert peer["comm"] is True and peer["type"] == "RuntimeError"
