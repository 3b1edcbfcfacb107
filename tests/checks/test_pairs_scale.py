"""The node-pair planner at scale (pure, no processes): rounds stay bounded as nodes grow.

Network time of the pairs pass is proportional to its rounds (every leader exchanges with one
partner per round, all at once), so the bound that matters is on rounds, not pairs: pass 1 is
``pair_rounds`` rounds of a round-robin, pass 2 at most ``pair_rounds`` more, at any node count.
Counts only, never timings (bench/pairs_plan.py prints the planner's time).
"""
from __future__ import annotations

import random

import pytest

from ddp_smoke.checks import perf


def _disjoint(round_pairs) -> bool:
    nodes = [n for p in round_pairs for n in p]
    return len(nodes) == len(set(nodes))


def _reference_second_pass(k, busbw, margin, rounds):
    """The planner's rule spelled out naively (quadratic), to compare plans with."""
    _, slow = perf.slow_pairs(busbw, margin)
    suspects = sorted({n for p in slow for n in p})
    good = [n for n in range(k) if n not in suspects and any(n in p for p in busbw)]
    pending = [s for s in suspects
               if not any(tuple(sorted((s, g))) in busbw for g in good)]
    plan = []
    for _ in range(rounds):
        busy, this = set(), []
        for s in list(pending):
            g = next((g for g in good if g not in busy), None)
            if g is not None:
                this.append(tuple(sorted((s, g))))
                busy |= {s, g}
                pending.remove(s)
        if not this:
            break
        plan.append(this)
    return plan


def _measured(k, rounds, slow_nodes, rng, slow_links=0):
    first = [p for r in perf.round_robin(k, rounds) for p in r]
    links = set(rng.sample([p for p in first if not set(p) & slow_nodes],
                           slow_links))
    return {p: 3.0 if set(p) & slow_nodes or p in links else 10.0 for p in first}


@pytest.mark.parametrize("k", [2, 3, 5, 16, 512, 4096])
@pytest.mark.parametrize("rounds", [1, 3, 6])
def test_first_pass_is_pair_rounds_rounds_of_at_most_half_the_nodes(k, rounds):
    plan = perf.round_robin(k, rounds)
    assert len(plan) == min(rounds, k - 1 if k % 2 == 0 else k)
    assert all(0 < len(r) <= k // 2 and _disjoint(r) for r in plan)
    pairs = [p for r in plan for p in r]
    assert len(pairs) == len(set(pairs))  # nobody meets the same partner twice


@pytest.mark.parametrize("k, slow", [(512, 1), (512, 8), (512, 64), (512, 170), (4096, 512)])
def test_second_pass_is_bounded_by_pair_rounds_and_pairs_suspects_with_good_nodes(k, slow):
    rng = random.Random(k * 1000 + slow)
    slow_nodes = set(rng.sample(range(k), slow))
    busbw = _measured(k, 3, slow_nodes, rng, slow_links=min(slow, 32))
    _, flagged = perf.slow_pairs(busbw, 0.25)
    suspects = {n for p in flagged for n in p}
    plan = perf.second_pass(k, busbw, 0.25, 3)
    assert len(plan) <= 3
    for r in plan:
        assert _disjoint(r)
        # one suspect with one known-good node, or a link suspect measured again
        assert all(len(set(p) & suspects) == 1 or p in flagged for p in r)
    measured = busbw | {p: 3.0 if set(p) & slow_nodes else 10.0 for r in plan for p in r}
    # never a healthy node, even with a third of the nodes slow and slow links among them:
    # a node is named only when slow with two healthy partners
    assert set(perf.attribute(measured, 0.25)["nodes"]) <= slow_nodes


def test_second_pass_plans_as_the_naive_rule_does():
    rng = random.Random(7)
    for _ in range(200):
        k = rng.randrange(2, 40)
        slow_nodes = set(rng.sample(range(k), rng.randrange(0, k // 2 + 1)))
        rounds = rng.randrange(1, 5)
        busbw = _measured(k, rounds, slow_nodes, rng)
        assert (perf.second_pass(k, busbw, 0.25, rounds)
                == _reference_second_pass(k, busbw, 0.25, rounds))


def test_one_slow_node_among_512_is_named_after_both_passes():
    rng = random.Random(1)
    busbw = _measured(512, 3, {137}, rng)
    plan = perf.second_pass(512, busbw, 0.25, 3)
    assert len(plan) == 1  # 137 met three partners, all suspects; it meets one good node
    measured = busbw | {p: 3.0 if 137 in p else 10.0 for r in plan for p in r}
    assert perf.attribute(measured, 0.25)["nodes"] == [137]
