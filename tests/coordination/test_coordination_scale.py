"""The store protocol's cost grows linearly with the world size (bench/coordination_scale.py).

Simulated ranks (real ``Coordinator``s with their liveness looks, no process group) on one
TCPStore, 32 then 64 of them: the store calls per check and the store host's file descriptors
are counted, never timed. A protocol where every rank polls every rank's key (the old arrival
barrier) grows 4× from 32 to 64; one with a connection per thread holds 3 descriptors a rank;
one where a node speaker missed a rank would name its node.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench(*args) -> dict[int, dict]:
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "coordination_scale.py"), "--checks", "3",
         "--procs", "2", "--steady-s", "0.5", "--json", *args],
        capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    return {r["N"]: r for r in map(json.loads, (line for line in done.stdout.splitlines()
                                                if line.startswith("{")))}


@pytest.mark.timeout(300)
def test_store_calls_per_check_grow_linearly_and_the_dead_rank_is_named():
    got = _bench("--sizes", "32,64")
    assert set(got) == {32, 64}, got
    for r in got.values():
        assert r["stuck_threads"] == 0 and r["error"] is None, r
        # two ranks died (the last, and the first of the node a quarter in); the middle
        # node's stalled rank (alive) is a victim
        assert r["culprits"] == r["expected_culprits"] == [r["N"] // 4, r["N"] - 1], r
        assert r["victims"] == r["N"] - 2, r
        # Per check: each rank sets its key and reads rank 0's flag once to arrive, and sets
        # once to post; rank 0 also raises the arrival flag (two calls: the shared key, and
        # each other rank's own key in one multi_set), waits for the observations and reads
        # them. Blocking waits make it a count, not a time: a poll would add calls the longer
        # the slowest rank takes (a wait longer than a slice adds one call a slice).
        assert r["fixed_ops_per_check"] == 3 * r["N"] + 4, r
        # one store connection per rank (issue 34): the store host's descriptors, less a few
        # of its own (the listening socket, the event loop, the workers' pipes)
        assert r["store_fds_per_rank"] <= 1 + 24 / r["N"], r
    growth = got[64]["fixed_ops_per_check"] / got[32]["fixed_ops_per_check"]
    assert growth <= 2.5, (growth, got[32]["fixed_ops_per_check"], got[64]["fixed_ops_per_check"])
    # judging reads aggregates: its store calls do not double with the world
    assert got[64]["judge_ops"] < 1.5 * got[32]["judge_ops"] + 20, (got[32], got[64])


@pytest.mark.timeout(300)
def test_with_node_speakers_a_check_costs_three_calls_a_node_and_the_dead_are_exact():
    """The same run through node speakers (8 ranks a node): a node's arrivals and observations
    are one call each of its relayer, rank 0's flag one read a node; the dead rank (a node
    mate) and the dead speaker are named, not their nodes, and the stalled rank is a victim as
    above."""
    r = _bench("--sizes", "64", "--node-speaker", "on")[64]
    assert r["node_speakers"] and r["stuck_threads"] == 0 and r["error"] is None, r
    assert r["culprits"] == r["expected_culprits"] == [16, 63], r
    assert r["victims"] == 62, r
    # 3 calls a node (rank 0's node: its ranks 1-7), and rank 0's own 3 + 4, as above
    assert r["fixed_ops_per_check"] == 3 * r["nodes"] + 7, r
