"""Blame as pure functions, on snapshots shaped like those the harness records.

The real faults behind each shape run in tests/test_diagnosis*.py; here every rule and its
order are pinned down one by one, including the cases a real run only hits by chance.
"""
from __future__ import annotations

import pytest

from ddp_smoke.coordination import blame
from ddp_smoke.coordination.runtime import agree_backend

HOSTS = ["n0", "n0", "n1", "n1"]
T = 1_000_000.0  # a wall-clock time


def snap(**kw) -> blame.Snapshot:
    base = dict(stage="bandwidth", world_size=4, timeout_s=10.0, hosts=HOSTS,
                connected={0, 1, 2, 3}, arrived={0, 1, 2, 3}, finished=set())
    return blame.Snapshot(**{**base, **kw})


def beat(seq, inside, op="barrier", peer=None, stage="bandwidth", t=T):
    return {"seq": seq, "inside": inside, "op": op, "bytes": 0, "peer": peer, "for_s": 3.0,
            "stage": stage, "t": t, "n": 10}


def culprits(s) -> list:
    return [(c.rank, c.ranks) for c in blame.assign(s).culprits]


def test_rank_that_never_entered_the_collective_is_the_only_culprit():
    s = snap(progress={0: beat(12, True), 1: beat(11, False, op="all_reduce"),
                       2: beat(12, True), 3: beat(12, True)},
             aborts={r: {"kind": "timeout", "at": T} for r in (0, 2, 3)},
             where={1: "in throttle, timing.py:44"})
    v = blame.assign(s)
    assert [c.rank for c in v.culprits] == [1]
    assert v.culprits[0].reason.startswith("never entered collective #12 (barrier)")
    assert v.culprits[0].where == "in throttle, timing.py:44"
    assert [x["rank"] for x in v.victims] == [0, 2, 3]
    assert all("blocked in barrier #12" in x["state"] for x in v.victims)


def test_rank_whose_own_deadline_fired_is_still_blamed_by_progress():
    # The stalled rank's watchdog posted "timeout" too: that must not excuse it.
    s = snap(progress={0: beat(5, True), 1: beat(4, False), 2: beat(5, True), 3: beat(5, True)},
             aborts={r: {"kind": "timeout", "at": T} for r in range(4)})
    assert culprits(s) == [(1, None)]


def test_everyone_inside_the_same_collective_blames_no_rank():
    s = snap(progress={r: beat(7, True, op="all_reduce") for r in range(4)},
             aborts={0: {"kind": "timeout", "at": T}})
    v = blame.assign(s)
    assert [c.rank for c in v.culprits] == [None]
    assert "no rank lagged" in v.culprits[0].reason


def test_peer_missing_from_an_exchange_is_blamed_not_the_rank_waiting_in_it():
    s = snap(progress={0: beat(9, True), 1: beat(9, True), 2: beat(8, True, "sendrecv", peer=3),
                       3: beat(8, False)},
             aborts={0: {"kind": "timeout", "at": T}})
    assert culprits(s) == [(3, None)]


def test_exchange_stuck_with_both_ends_inside_names_the_link():
    s = snap(progress={0: beat(9, True), 1: beat(9, True), 2: beat(8, True, "sendrecv", peer=3),
                       3: beat(8, True, "sendrecv", peer=2)},
             aborts={0: {"kind": "timeout", "at": T}})
    v = blame.assign(s)
    assert [(c.rank, c.ranks, c.hosts) for c in v.culprits] == [(None, [2, 3], ["n1", "n1"])]


def test_one_terminated_rank_is_the_culprit_and_the_rest_victims():
    s = snap(stage="compute", aborts={2: {"kind": "terminated", "signal": "SIGTERM", "at": T,
                                          "stage": "compute"}},
             progress={r: beat(3, False, stage="compute") for r in range(4)})
    v = blame.assign(s)
    assert [(c.rank, c.reason) for c in v.culprits] == [(2, "terminated by SIGTERM during compute")]
    assert [x["rank"] for x in v.victims] == [0, 1, 3]
    assert all("within" not in x["state"] for x in v.victims)


def test_every_rank_terminated_is_the_launcher():
    s = snap(stage="compute", aborts={r: {"kind": "terminated", "signal": "SIGTERM",
                                          "at": T + r / 100} for r in range(4)})
    v = blame.assign(s)
    assert [(c.rank, c.host) for c in v.culprits] == [(None, None)]
    assert v.culprits[0].reason == ("terminated by the launcher (SIGTERM to all ranks) during "
                                    "compute")


def test_terminations_after_a_death_are_the_launchers_reaction():
    # torchrun stops the whole local group when one worker dies: the death is the cause.
    s = snap(stage="ddp_step", dead={2},
             progress={2: beat(1, False, stage="ddp_step", t=T)},
             aborts={r: {"kind": "terminated", "signal": "SIGTERM", "at": T + 0.4}
                     for r in (0, 1, 3)})
    v = blame.assign(s)
    assert [c.rank for c in v.culprits] == [2]
    assert all(x["state"].startswith("in ddp_step; terminated by SIGTERM, stopped 0.4 s after "
                                     "rank 2 died") for x in v.victims), v.victims


def test_terminated_before_a_later_error_stays_the_culprit():
    s = snap(aborts={1: {"kind": "terminated", "signal": "SIGUSR1", "at": T},
                     3: {"kind": "error", "type": "RuntimeError", "message": "x", "at": T + 1}})
    assert culprits(s) == [(1, None)]


def test_raised_and_comm_errors():
    s = snap(aborts={1: {"kind": "error", "type": "RuntimeError", "message": "boom", "at": T},
                     0: {"kind": "error", "comm": True, "message": "Connection reset by peer",
                         "at": T + 0.1}})
    v = blame.assign(s)
    assert [c.rank for c in v.culprits] == [1]
    assert "communication error" in v.victims[0]["state"]


def test_communication_errors_alone_blame_no_rank():
    s = snap(aborts={0: {"kind": "error", "comm": True, "message": "Connection reset", "at": T}},
             progress={r: beat(3, True) for r in range(4)})
    # every rank inside the same collective, nobody dead: the collective itself is stuck
    assert culprits(s) == [(None, None)]


def test_absent_rank_says_within_only_when_the_deadline_passed():
    hung = snap(stage="ddp_step", arrived={0, 2, 3}, aborts={0: {"kind": "timeout", "at": T}})
    assert blame.assign(hung).culprits[0].reason == ("did not arrive at ddp_step within 10.0 s "
                                                    "(process alive: hung?)")
    early = snap(stage="ddp_step", arrived={0, 2, 3}, aborts={})
    assert "within" not in blame.assign(early).culprits[0].reason


def test_never_connected_and_dead_before_arrival():
    s = snap(stage="init", connected={0, 1, 2}, arrived={0, 1, 2}, dead={2})
    v = blame.assign(s)
    assert sorted(c.rank for c in v.culprits) == [2, 3]


def test_rank_busy_outside_collectives_past_the_deadline():
    s = snap(stage="compute", finished={0, 2, 3},
             progress={1: beat(2, False, stage="compute")},
             aborts={0: {"kind": "timeout", "at": T}})
    v = blame.assign(s)
    assert [(c.rank, c.reason) for c in v.culprits] == [
        (1, "did not finish compute within 10.0 s (process alive, not in a collective)")]


@pytest.mark.parametrize("requested, pick, cuda, world, backend, problem", [
    ("auto", "nccl", 4, 4, "nccl", False),
    ("auto", "gloo", 0, 4, "gloo", False),
    ("auto", "gloo", 3, 4, "nccl", True),   # the one node without CUDA is the odd one out
    ("auto", "nccl", 3, 4, "nccl", True),   # ... and the GPU ranks stop as victims
    ("gloo", "gloo", 3, 4, "gloo", False),  # an explicit choice is everyone's
])
def test_backend_agreement(requested, pick, cuda, world, backend, problem):
    got, why = agree_backend(requested, pick, cuda, world)
    assert got == backend and (why is not None) == problem
    if problem:
        assert why.format(host="gpu7").startswith("no usable CUDA on gpu7")


def test_a_rank_inside_a_collective_it_never_issued_holds_the_others_there():
    """The fault campaign's stall (issue 32): by its own count rank 2 is inside the storage
    check's broadcast; its Flight Recorder says it never handed it to the backend. The root
    (rank 0) is stuck sending to it; ranks 1 and 3 got their data and wait in the barrier."""
    inside = {"inside": True, "op": "broadcast", "peer": None}
    s = blame.Snapshot(stage="storage", world_size=4, timeout_s=15.0, hosts=["h"] * 4,
                       connected={0, 1, 2, 3}, arrived={0, 1, 2, 3},
                       aborts={1: {"kind": "timeout", "at": 1.0}},
                       progress={0: {"seq": 40, **inside}, 2: {"seq": 40, **inside},
                                 1: {"seq": 41, "inside": True, "op": "barrier"},
                                 3: {"seq": 41, "inside": True, "op": "barrier"}},
                       issued={0: 61, 1: 62, 2: 60, 3: 62})
    got = blame.assign(s).culprits
    assert [c.rank for c in got] == [2] and "never issued it" in got[0].reason
    # every rank inside one collective, one never issued it: that one
    s.progress = {r: {"seq": 7, **inside} for r in range(4)}
    s.issued = {0: 9, 1: 9, 2: 8, 3: 9}
    assert [c.rank for c in blame.assign(s).culprits] == [2]
    s.issued = {0: 9, 1: 9, 2: 9, 3: 9}  # all issued it: the collective itself is stuck
    assert [c.rank for c in blame.assign(s).culprits] == [None]


def test_rank_the_others_waited_for_until_the_deadline_is_named_when_none_is_blocked():
    """The fault campaign's slow rank (15 % of a core) past the collectives deadline, as
    blamed: rank 0 between two collectives, rank 1 one behind, neither inside one. Their waits
    until the abort say who held whom: rank 0 spent 0.45 s inside each, rank 1 a hundredth."""
    stopped = dict(world_size=2, hosts=["vm", "vm"], connected={0, 1}, arrived={0, 1},
                   stage="collectives",
                   progress={0: beat(38, False, op="all_to_all", stage="collectives"),
                             1: beat(37, False, op="broadcast", stage="collectives")},
                   aborts={r: {"kind": "timeout", "at": T} for r in (0, 1)})
    waits = {0: [0.45] * 21 + [None], 1: [0.01] * 21 + [None]}
    v = blame.assign(snap(**stopped, waits=waits))
    assert [c.rank for c in v.culprits] == [1]
    assert v.culprits[0].reason.startswith("did not finish collectives within 10.0 s: ranks 0 "
                                           "waited for rank 1 9.2 s in all")
    assert [x["rank"] for x in v.victims] == [0]
    # waits that name nobody, or a rank's missing: both unfinished, as before
    even = {0: [0.2, 0.01] * 11, 1: [0.01, 0.2] * 11}
    for w in (even, {0: waits[0]}):
        assert culprits(snap(**stopped, waits=w)) == [(0, None), (1, None)]
    # no deadline passed (a rank's abort stopped the check early): the waits are no verdict
    early = {**stopped, "aborts": {0: {"kind": "lost", "silent": [], "at": T}}}
    assert culprits(snap(**early, waits=waits)) == [(0, None), (1, None)]


def test_a_slow_ranks_ring_neighbour_behind_with_it_at_the_deadline_is_not_named():
    """The campaign's slow_rank.rank0.join.image.3x1 (rank 0 at 15 % of a core, three nodes):
    at the collectives deadline rank 1 waited inside all_reduce #34, and ranks 0 and 2 had both
    left #33 a tenth of a second before: rank 2 is rank 0's neighbour in the ring, held back
    with it. Both were named; the check's waits so far, or rank 0's node's CPU quota, say who
    held whom."""
    stopped = dict(world_size=3, hosts=["a", "b", "c"], connected={0, 1, 2},
                   arrived={0, 1, 2}, stage="collectives",
                   progress={0: beat(33, False, op="all_reduce", stage="collectives"),
                             1: beat(34, True, op="all_reduce", stage="collectives"),
                             2: beat(33, False, op="all_reduce", stage="collectives")},
                   aborts={r: {"kind": "timeout", "at": T} for r in (1, 2)})
    assert culprits(snap(**stopped)) == [(0, None), (2, None)]  # nothing to tell them apart
    waits = {0: [0.01] * 33, 1: [0.4] * 33, 2: [0.3] * 33}  # the others waited for rank 0
    assert culprits(snap(**stopped, waits=waits)) == [(0, None)]
    quota = "CPU quota: this node's processes were held back in 100% of the periods they could run"
    v = blame.assign(snap(**stopped, held={0: quota}))  # its node's word, without waits
    assert [(c.rank, c.host) for c in v.culprits] == [(0, "a"), (None, "a")]
    assert v.culprits[1].reason == quota
    assert v.culprits[0].reason == ("did not finish collectives within 10.0 s: its node's CPU "
                                    "quota held it back")
    # rank 1's node held back too, rank 1 the one blocked inside: the quota is the evidence
    assert culprits(snap(**stopped, waits=waits, held={1: quota})) == [(1, None), (None, None)]
    # no deadline passed (a rank's abort stopped the check): both stay, as before
    early = {**stopped, "aborts": {1: {"kind": "lost", "silent": [], "at": T}}}
    assert culprits(snap(**early, waits=waits)) == [(0, None), (2, None)]


def test_a_rank_moving_through_an_older_collective_is_not_named_beside_the_one_that_held():
    """Measured in a full parallel suite: rank 1 stalled before barrier #11 that ranks 0 and 3
    were blocked in; rank 2's progress at the abort showed it inside all_reduce #10 for 9 ms
    (moving, not stuck) and it was named too. A rank that held the others sat there for most
    of the deadline."""
    def snap(for_s):
        return blame.Snapshot(
            stage="bandwidth", world_size=4, timeout_s=10.0, hosts=["vm"] * 4,
            connected={0, 1, 2, 3}, arrived={0, 1, 2, 3}, finished=set(), dead=set(),
            aborts={0: {"kind": "timeout"}},
            progress={0: {"seq": 11, "op": "barrier", "inside": True, "for_s": 9.8},
                      3: {"seq": 11, "op": "barrier", "inside": True, "for_s": 9.8},
                      1: {"seq": 10, "op": "all_reduce", "bytes": 1024, "inside": False,
                          "for_s": 9.9},
                      2: {"seq": 10, "op": "all_reduce", "bytes": 1024, "inside": True,
                          "for_s": for_s}})
    assert [k.rank for k in blame.assign(snap(0.009)).culprits] == [1]
    assert [k.rank for k in blame.assign(snap(9.7)).culprits] == [1, 2]  # stuck: named
