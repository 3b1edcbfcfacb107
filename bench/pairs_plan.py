"""The node-pair planner at scale, simulated: rounds and pairs for 512 nodes, both passes.

Not a test: it prints the plan's shape. It runs the bandwidth check's own pure planner
(``perf.round_robin``, ``perf.second_pass``, ``perf.attribute``, as ``checks/_pairs.py`` calls
them) on K simulated nodes, with a fabric model instead of measurements: every pair runs at
10 GB/s except pairs that touch a slow node (3 GB/s) and a few slow links between two healthy
nodes (3 GB/s). Network time is proportional to rounds (each round one exchange per leader,
all in parallel), so the rounds must stay bounded as K grows; pairs per round are at most K/2.

For each K and each fault mix it prints the first pass (rounds, pairs), the second pass
(suspects, rounds, pairs, suspects left without a known-good partner), what attribution names,
and the planner's own CPU time. Defaults: K = 512 and pair_rounds as the levels set them.

    .venv/bin/python bench/pairs_plan.py [--nodes 512] [--rounds 3]
"""
from __future__ import annotations

import argparse
import random
import time

from ddp_smoke.checks import perf
from ddp_smoke.checks._pairs import margin

GOOD_GBPS, SLOW_GBPS = 10.0, 3.0


def fabric(slow_nodes: set[int], slow_links: set[tuple[int, int]]):
    def busbw(pair: tuple[int, int]) -> float:
        return SLOW_GBPS if set(pair) & slow_nodes or pair in slow_links else GOOD_GBPS
    return busbw


def simulate(k: int, rounds: int, slow_nodes: set[int], link_count: int, seed: int) -> dict:
    rng = random.Random(seed)
    t = time.perf_counter()
    first = perf.round_robin(k, rounds)
    first_pairs = [p for r in first for p in r]
    # slow links among first-pass pairs of healthy nodes, so that pass 1 sees them
    healthy_pairs = [p for p in first_pairs if not set(p) & slow_nodes]
    links = set(rng.sample(healthy_pairs, min(link_count, len(healthy_pairs))))
    speed = fabric(slow_nodes, links)
    measured = {p: speed(p) for p in first_pairs}
    cut = margin("cuda", {"pair_margin": 0.25})
    second = perf.second_pass(k, measured, cut, rounds)
    second_pairs = [p for r in second for p in r]
    measured.update({p: speed(p) for p in second_pairs})
    blame = perf.attribute(measured, cut)
    plan_s = time.perf_counter() - t
    suspects = {n for p, v in measured.items() if v < GOOD_GBPS for n in p}
    for r in first + second:  # every round: each node in one pair at most
        nodes = [n for p in r for n in p]
        assert len(nodes) == len(set(nodes))
    return {"first_rounds": len(first), "first_pairs": len(first_pairs),
            "max_pairs_per_round": max((len(r) for r in first + second), default=0),
            "suspects": len(suspects), "second_rounds": len(second),
            "second_pairs": len(second_pairs),
            "named_nodes": sorted(blame["nodes"]), "named_links": len(blame["links"]),
            "unresolved": len(blame["unresolved"]), "injected_links": len(links),
            "plan_s": plan_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[512])
    p.add_argument("--rounds", type=int, nargs="+", default=[3, 6],
                   help="pair_rounds: 3 (quick, standard), 6 (long)")
    args = p.parse_args()
    print("# pair planner (perf.round_robin + perf.second_pass), simulated fabric: "
          f"{GOOD_GBPS:g} GB/s, slow node / slow link pairs {SLOW_GBPS:g} GB/s")
    print(f"# {'nodes':>6} {'rounds':>6} {'slow':>5} {'links':>5} | {'pass1':>5} {'pairs':>6} "
          f"{'/round':>6} | {'suspects':>8} {'pass2':>5} {'pairs':>6} | {'named':>5} "
          f"{'links':>5} {'unres':>5} | {'plan_ms':>7}")
    for k in args.nodes:
        for rounds in args.rounds:
            for slow, links in ((0, 0), (1, 0), (8, 4), (k // 8, k // 16), (k // 3, 0)):
                slow_nodes = set(random.Random(k + slow).sample(range(k), slow))
                r = simulate(k, rounds, slow_nodes, links, seed=k)
                hit = "" if set(r["named_nodes"]) <= slow_nodes else " (named a healthy node!)"
                print(f"  {k:>6} {rounds:>6} {slow:>5} {r['injected_links']:>5} | "
                      f"{r['first_rounds']:>5} {r['first_pairs']:>6} "
                      f"{r['max_pairs_per_round']:>6} | {r['suspects']:>8} "
                      f"{r['second_rounds']:>5} {r['second_pairs']:>6} | "
                      f"{len(r['named_nodes']):>5} {r['named_links']:>5} {r['unresolved']:>5} | "
                      f"{r['plan_s'] * 1e3:>7.1f}{hit}")
    print("pair rounds: pass 1 = pair_rounds, pass 2 <= pair_rounds, whatever the node count; "
          "pairs per round <= nodes / 2")


if __name__ == "__main__":
    main()
