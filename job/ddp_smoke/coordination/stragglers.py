"""Who kept the others waiting: stragglers from how long each rank spent inside each collective.

A world collective holds every rank until the last one has contributed. The rank that arrives
last therefore spends the least time inside it, and each other rank spends about the time it
waited for the last one more. Durations are measured on each rank's own monotonic clock, so no
clock agreement between hosts is needed (the measure of Alibaba's C4D and of ByteDance's
straggler study: who waits for whom).

For every collective k of a check (the k-th world collective is the same call on every rank,
:mod:`ddp_smoke.coordination.progress`), with each rank's time inside ``t[r]``:

* the last arriver is the rank with the smallest ``t``;
* the wait it caused is the median of the others' ``t`` minus its own: what the job lost;
* the collective counts when that wait is at least ``MIN_WAIT_S`` (below it, who is "last" is
  scheduling noise).

A rank is named a straggler of the check when it was the last arriver in at least ``share(n)``
of the counted collectives (50 % with 4 ranks or more; 67 % with 3; 85 % with 2, where a coin
would be last half the time), of at least ``MIN_COUNTED`` counted collectives, and the waits it
caused add up to at least ``MIN_TOTAL_S``, ``MIN_FRACTION`` of the time the others spent
inside collectives, and half of all the waits of the check. In a healthy run the last arriver
changes from one collective to the next (about 1/n each) and the waits are small and spread:
one rank's hiccup gives it most of the waiting but few of the collectives (16 healthy ranks
under load: 3 of 21, 0.3 s); a rank held back for the whole run arrives last in most
collectives and causes most of the waiting (a CPU quota of 15 % of a core on one of 4 ranks,
the collectives check: 9 of 15 and 9 of 16 counted, 1.35 s and 0.48 s, 94 % and 68 % of the
waits).

Pure: the harness posts each rank's durations with its observation and calls :func:`judge`
when it judges the check on rank 0.
"""
from __future__ import annotations

import statistics

MIN_WAIT_S = 0.001   # a collective's wait below this says nothing about who was late
MIN_COUNTED = 10     # fewer counted collectives: no verdict (the figure is still given)
MIN_TOTAL_S = 0.25   # waits caused by a straggler add up to at least this ...
MIN_FRACTION = 0.1   # ... and to this share of the others' time inside collectives
BUDGET = 4_000_000   # durations kept per check over all ranks, at most (bounds rank 0's work)


def keep_per_rank(world_size: int) -> int:
    """How many collectives' durations each rank keeps per check: 2,048 up to ~2,000 ranks,
    then fewer, so rank 0 reads a bounded amount at any world size (976 each at 4,096)."""
    return max(64, min(2048, BUDGET // max(1, world_size)))


def share(n: int) -> float:
    """The share of counted collectives a rank must arrive last in to be named, by world size."""
    return {2: 0.85, 3: 0.67}.get(n, 0.5)


def judge(spent: list[list | None]) -> tuple[dict, list[tuple[int, str]]]:
    """The waits figure of a check and its stragglers as ``(rank, reason)``.

    ``spent[r]`` is rank r's list of seconds inside each collective (None entries: not
    comparable, e.g. a broadcast), or None when the rank sent none.
    """
    n = len(spent)
    rows = [s or [] for s in spent]
    total = min(len(s) for s in rows) if rows else 0
    last = [0] * n
    caused = [0.0] * n
    inside = 0.0
    counted = 0
    for k in range(total if n > 1 else 0):
        t = [s[k] for s in rows]
        if any(v is None for v in t):
            continue
        r = min(range(n), key=t.__getitem__)
        others = t[:r] + t[r + 1:]
        wait = statistics.median(others) - t[r]
        inside += statistics.median(others)
        if wait < MIN_WAIT_S:
            continue
        counted += 1
        last[r] += 1
        caused[r] += wait
    figure = {"collectives": total, "counted": counted, "min_wait_s": MIN_WAIT_S,
              "share_to_name": share(n) if n > 1 else None,
              "legend": "per collective, the last rank to arrive is the one that spent the "
                        "least time inside; counted: collectives whose wait (the others' median "
                        "time inside minus the last one's) was at least min_wait_s; last: how "
                        "often each rank was the last of the counted; wait_s: the waits it "
                        "caused, added up",
              "most_last": [{"rank": r, "last": last[r], "wait_s": round(caused[r], 4)}
                            for r in sorted(range(n), key=lambda r: (-last[r], r))[:8]
                            if last[r]]}
    culprits = []
    for r in range(n):
        if (counted >= MIN_COUNTED and last[r] >= share(n) * counted
                and caused[r] >= max(MIN_TOTAL_S, MIN_FRACTION * inside, sum(caused) / 2)):
            others = [q for q in range(n) if q != r]
            culprits.append((r, f"ranks {_ranks(others)} waited for rank {r} in "
                                f"{100 * last[r] / counted:.0f} % of {counted} collectives, "
                                f"{caused[r]:.1f} s in all (it arrived last; the others' time "
                                f"inside collectives: {inside:.1f} s)"))
    return figure, culprits


def attach(result, spent: list[list | None], culprit) -> None:
    """Add the waits figure to a judged check's result, and its stragglers as culprits
    (``culprit(rank, reason)`` makes one with the rank's host). A skipped check stays skipped."""
    figure, slow = judge(spent)
    result.figures["waits"] = figure
    if slow and result.status != "skip":
        result.culprits += [culprit(r, reason) for r, reason in slow]
        result.status = "fail"
        result.summary = f"straggler: {slow[0][1]}; {result.summary}"


def line(figure: dict) -> str | None:
    """The figure in a few words, for the human summary (None for a check with too few
    collectives to judge: a line under every check would be noise)."""
    if figure.get("collectives", 0) < MIN_COUNTED:
        return None
    top = figure["most_last"][0] if figure["most_last"] else None
    most = (f"last most often: rank {top['rank']}, {top['last']} times, "
            f"{top['wait_s']:.2f} s of waits" if top else "no rank kept the others waiting")
    return (f"waits: {figure['counted']} of {figure['collectives']} collectives had a wait "
            f">= {figure['min_wait_s'] * 1e3:.0f} ms; {most}")


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" … ({len(ranks)} ranks)" if len(ranks) > 8
                                              else "")
