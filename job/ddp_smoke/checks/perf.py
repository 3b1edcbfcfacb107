"""Performance arithmetic in one place, pure: nccl-tests' bandwidths, sweeps, stragglers, pairs.

Definitions (nccl-tests ``doc/PERFORMANCE.md``), with GB = 1e9 B throughout:

* ``algbw = S / t`` with S in bytes and t the mean time of one operation;
* ``busbw = algbw × factor``: all_reduce 2(n−1)/n; reduce_scatter, all_gather, all_to_all
  (n−1)/n; broadcast, reduce, sendrecv 1;
* S is ``count × typesize`` for all_reduce, broadcast and sendrecv, and the whole array
  (``count × typesize × n``, count per rank) for reduce_scatter, all_gather and all_to_all.

Nothing here touches torch: the checks measure, these functions compute and compare.
"""
from __future__ import annotations

import math
import statistics

from ..model import percentile

GB = 1e9  # bytes; nccl-tests' and the field's unit for GB/s

# collective -> (busbw factor as a function of n, S counts the whole array)
_COLLECTIVES = {
    "all_reduce": (lambda n: 2 * (n - 1) / n, False),
    "reduce_scatter": (lambda n: (n - 1) / n, True),
    "all_gather": (lambda n: (n - 1) / n, True),
    "all_to_all": (lambda n: (n - 1) / n, True),
    "broadcast": (lambda n: 1.0, False),
    "reduce": (lambda n: 1.0, False),
    "sendrecv": (lambda n: 1.0, False),
}


def bus_factor(collective: str, n: int) -> float:
    """nccl-tests' busbw/algbw factor for ``collective`` on ``n`` ranks."""
    return _COLLECTIVES[collective][0](n)


def layout(collective: str, size_bytes: int, n: int, typesize: int) -> tuple[int, int]:
    """``(count, S)`` as nccl-tests prints them for a nominal size.

    ``count`` is per rank for the whole-array collectives (their buffers split evenly), else
    the total; ``S`` is the bytes the bandwidths use, rounded down to whole elements per rank.
    """
    total = size_bytes // typesize
    if _COLLECTIVES[collective][1]:
        per_rank = total // n
        return per_rank, per_rank * n * typesize
    return total, total * typesize


def algbw_gbps(size_bytes: int, time_s: float) -> float:
    """Algorithm bandwidth S / t in GB/s (1e9 B/s)."""
    return size_bytes / time_s / GB


def busbw_gbps(collective: str, size_bytes: int, time_s: float, n: int) -> float:
    """Bus bandwidth: algbw × nccl-tests' factor, in GB/s (1e9 B/s)."""
    return algbw_gbps(size_bytes, time_s) * bus_factor(collective, n)


def sweep_sizes(min_bytes: int, max_bytes: int, factor: int, extra=()) -> list[int]:
    """min, min·f, min·f², … up to max (inclusive), plus ``extra`` sizes, sorted, unique."""
    sizes, size = set(extra), min_bytes
    while size <= max_bytes:
        sizes.add(size)
        size *= factor
    return sorted(sizes)


def timed_iterations(warm_s: float, budget_s: float, least: int, most: int) -> int:
    """Timed iterations for one size: as many as fit ``budget_s`` at ``warm_s`` each, clamped.

    Fixed before the first timed call, from an untimed one: a count that depended on the
    timed samples themselves (stop once they agree, stop once the budget is spent) biases
    their mean, because whether to go on then depends on whether a stall was just seen
    (bench/bandwidth_vs_loop.py measured 1.5-2x too high a busbw at small sizes that way).
    """
    fit = math.ceil(budget_s / warm_s) if warm_s > 0 else most
    return max(least, min(most, fit))


def matmul_tflops(n: int, iterations: int, time_s: float) -> float:
    """Dense n×n×n matrix products: 2n³ floating-point operations each, in TFLOP/s."""
    return 2 * n ** 3 * iterations / time_s / 1e12


def shortfall_pct(value: float, reference: float) -> float:
    """How far ``value`` falls below ``reference``, in percent of the reference."""
    return 100.0 * (reference - value) / reference


def pace(blocks: dict[int, list[float]]) -> dict[int, float]:
    """Each rank's pace against the others: per block k (the k-th of the same number on every rank, run at about the same time),
    its rate over the median of all ranks' rates in block k; the median over k (1.0: the
    ranks' median). A rank behind in most blocks is below 1 however fast its best block."""
    k = min(len(b) for b in blocks.values())
    ref = [statistics.median(b[i] for b in blocks.values()) for i in range(k)]
    return {r: statistics.median(b[i] / ref[i] if ref[i] else 1.0 for i in range(k))
            for r, b in blocks.items()}


def slow_paced(blocks: dict[int, list[float]], margin: float) -> tuple[dict, list[int]]:
    """``(pace, ranks)``: every rank's :func:`pace`, and the ranks behind in both views: a
    pace below 1 − margin, and a median block below 1 − margin of the ranks' median (which
    of many ranks sharing cores a block's turn on a core falls to is the scheduler's: a rank
    is named only when its median block is behind too; checks/compute.py)."""
    got = pace(blocks)
    medians = {r: statistics.median(b) for r, b in blocks.items()}
    typical = statistics.median(medians.values())
    return got, sorted(r for r, p in got.items()
                       if p < 1 - margin and medians[r] < (1 - margin) * typical)



# -- node pairs ---------------------------------------------------------------------------

def round_robin(k: int, rounds: int) -> list[list[tuple[int, int]]]:
    """The first ``rounds`` rounds of a round-robin among k nodes (circle method).

    Every node meets a different partner each round (one sits out when k is odd); k−1 rounds
    would meet every pair, so ``rounds`` bounds the time at O(rounds), not O(k²).
    """
    ring = list(range(k)) + ([None] if k % 2 else [])
    m, out = len(ring), []
    for _ in range(min(rounds, m - 1)):
        pairs = [(ring[i], ring[m - 1 - i]) for i in range(m // 2)]
        if any(None not in p for p in pairs):
            out.append([tuple(sorted(p)) for p in pairs if None not in p])
        ring = [ring[0], ring[-1], *ring[1:-1]]  # keep the first, rotate the rest
    return out


def slow_pairs(busbw: dict[tuple[int, int], float], margin: float,
               reference: float | None = None) -> tuple[float, set]:
    """``(reference, slow)``: pairs below (1 − margin) × the 90th-percentile pair.

    The reference is a high percentile, not the median, so that one bad node, which makes
    most of its few pairs slow, cannot drag the reference down to its own level. A given
    ``reference`` is used instead: the rails' common one, so that a rail slow everywhere is
    slow against the others.
    """
    if reference is None:
        reference = percentile(busbw.values(), 90)
    return reference, {p for p, v in busbw.items() if v < reference * (1 - margin)}


def second_pass(k: int, busbw: dict[tuple[int, int], float], margin: float,
                rounds: int, reference: float | None = None) -> list[list[tuple[int, int]]]:
    """Pair each suspect (a node in a slow pair) with a known-good node it has not met, and
    measure again each slow pair whose two nodes were fine with someone else (a link
    suspect: a real slow link is slow every time, a busy moment is not).

    Known-good: every pair it took part in was fine. Suspects that already met one are left
    alone. At most ``rounds`` rounds, each node in at most one pair per round. ``reference``:
    as for :func:`slow_pairs`.
    """
    if not busbw:
        return []
    _, slow = slow_pairs(busbw, margin, reference)
    suspects = sorted({n for p in slow for n in p})
    flagged = set(suspects)
    seen = {n for p in busbw for n in p}
    good = [n for n in range(k) if n in seen and n not in flagged]
    met_good = {n for p in busbw for n, m in (p, p[::-1]) if m in seen and m not in flagged}
    pending = [s for s in suspects if s not in met_good]
    # Only suspects' partners are taken within a round and each pending suspect has met no
    # known-good node yet, so round i pairs the next pending suspects with good[0], good[1] …
    # in order: O(pairs) work, not O(suspects × good), which counts at thousands of nodes.
    fine = {n for p in busbw if p not in slow for n in p}
    retest = sorted(p for p in slow if set(p) <= fine)
    plan = []
    for _ in range(rounds):
        this = [tuple(sorted((s, g))) for s, g in zip(pending, good)]
        busy = {n for p in this for n in p}
        for p in list(retest):  # link suspects, measured again where both ends are free
            if not set(p) & busy:
                this.append(p)
                busy |= set(p)
                retest.remove(p)
        if not this:
            break
        plan.append(this)
        pending = pending[len(this):]
    return plan


def attribute(busbw: dict[tuple[int, int], float], margin: float,
              reference: float | None = None) -> dict:
    """Blame slow pairs on nodes or links, from every pair measured.

    A node is healthy once one of its pairs is fine. A node with no fine pair, slow with two
    or more healthy partners, is the culprit (slow with every partner). With one healthy
    partner only, its slow pair may as well be a slow link (its other partners being slow
    nodes themselves): a healthy node is never named on one pair. A slow pair of two healthy
    nodes is a link (slow only together). Any other slow pair is unresolved.

    Returns:
        ``{"reference", "slow", "nodes", "links", "unresolved"}``: the reference busbw (the
        given one, else :func:`slow_pairs`'), then lists of pairs (a, b) with a < b, except
        ``nodes``, a list of node indices.
    """
    if not busbw:
        return {"reference": reference, "slow": [], "nodes": [], "links": [], "unresolved": []}
    reference, slow = slow_pairs(busbw, margin, reference)
    healthy = {n for p in busbw if p not in slow for n in p}
    witnesses: dict[int, set] = {}  # a node with no fine pair -> its healthy partners
    for a, b in slow:
        for n, m in ((a, b), (b, a)):
            if n not in healthy and m in healthy:
                witnesses.setdefault(n, set()).add(m)
    nodes = sorted(n for n, w in witnesses.items() if len(w) >= 2)
    links = sorted(p for p in slow if p[0] in healthy and p[1] in healthy)
    named, linked = set(nodes), set(links)  # sets: thousands of nodes, thousands of pairs
    unresolved = sorted(p for p in slow if p not in linked and not set(p) & named)
    return {"reference": reference, "slow": sorted(slow), "nodes": nodes, "links": links,
            "unresolved": unresolved}
