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
* the collective counts when that wait is at least ``waits_min_s`` (below it, who is "last" is
  scheduling noise).

A rank is named a straggler of the check by the time the others waited for it, not by how
often it came last: the waits it caused add up to at least ``waits_min_fraction`` of the time the
others spent inside collectives and :func:`wait_share` of all the waits of the check (half with
4 ranks or more; 67 % with 3; 85 % with 2, where one of the two always has half), and, without
the longest of them, to at least ``waits_min_total_s``; over at least ``waits_min_counted`` counted
collectives, in at least its fair share (1/n) of which it came last. One long hiccup (a GC
pause, a stopped process: 0.64 s in one collective among 16 healthy ranks) is not a straggler.
The thresholds are the configuration's ``diagnosis`` keys (``waits_*``), the run's own.

Why time and not the count: a rank held back by a CPU quota runs in bursts (15 ms of every
100 ms), so it comes last only in the collectives that fall into its throttled stretches
(40–70 % of them), but each of those costs the others up to 85 ms; a healthy rank's turns at
being last cost a few milliseconds. Measured on this project's 2-core test machine, 4 ranks of
the straggler test (tests/worker/test_diagnosis_straggler.py, quick level), the collectives
check (14–21 counted collectives), 41 runs (tests/data/waits holds some of them):

* rank 2 held to 15 % of a core, alone or beside a busy process (8 runs): it caused the most
  waiting in every run; in 7 runs 0.61–1.30 s (0.39–0.91 s without the longest wait), 66–99 %
  of the waits, 46–74 % of the others' time inside, last in 9–13; in the eighth its quota
  barely bit during the check (0.34 s, 0.10 s without the longest, 65 %, last in 5 of 20;
  compute named it);
* no quota, one or two busy processes beside the ranks (33 runs): at most 0.27 s (0.16 s
  without the longest), 83 % of the waits and 50 % of the time inside (ranks the scheduler
  kept on the crowded core: last in 8 of 14), the most often last 10 of 20 (rank 0, 0.21 s);
  in the bandwidth sweep at most 0.17 s and 60 %. 16 healthy ranks (tests/worker/test_scale16.py): one rank's single 0.64 s
  hiccup, 34 % of the collectives check's waits, last once in 21.

The rule before (last in half the counted collectives, 0.25 s) named that crowded-core rank,
a false positive; 0.3 s without the longest wait lies between the healthy ranks' 0.16 s at
most and the throttled rank's 0.39 s at least (when its quota bit).

CPU ranks that share their node's cores, or their kernel's (namespaces or containers as the
nodes of one machine: :func:`shared_kernels`), are named only when a CPU quota held them back
(:func:`scheduler_chose`): each such rank posts, beside its durations, the seconds its cgroup's
quota throttled it in the check.

Pure: the harness posts each rank's durations with its observation and calls :func:`attach`
(:func:`waits_and_stragglers`) when it judges the check on rank 0.
"""
from __future__ import annotations

import statistics

from ..config import DIAGNOSIS
from ..config.launchenv import NODE_RUN_PREFIX

# The rule's thresholds: the configuration's ``diagnosis`` section (defaults.yaml says why
# each has its value); a run's own settings where the caller knows the run's config.
RULES = DIAGNOSIS
BUDGET = 4_000_000   # durations kept per check over all ranks, at most (bounds rank 0's work)


def keep_per_rank(world_size: int) -> int:
    """How many collectives' durations each rank keeps per check: 2,048 up to ~2,000 ranks,
    then fewer, so rank 0 reads a bounded amount at any world size (976 each at 4,096)."""
    return max(64, min(2048, BUDGET // max(1, world_size)))


def wait_share(n: int, rules: dict = RULES) -> float:
    """The share of all the check's waits a rank must have caused to be named, by world size."""
    return {2: rules["waits_share_of_2"], 3: rules["waits_share_of_3"]}.get(n, rules["waits_share"])


def waits_and_stragglers(spent: list[list | None],
                         rules: dict | None = None) -> tuple[dict, list[tuple[int, str]]]:
    """The waits figure of a check and its stragglers as ``(rank, reason)``.

    ``spent[r]`` is rank r's list of seconds inside each collective (None entries: not
    comparable, e.g. a broadcast), or None when the rank sent none; ``rules``: the run's
    ``diagnosis`` settings (default: the package's).
    """
    rules = rules or RULES
    n = len(spent)
    rows = [s or [] for s in spent]
    total = min(len(s) for s in rows) if rows else 0
    last = [0] * n
    caused = [0.0] * n
    longest = [0.0] * n
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
        if wait < rules["waits_min_s"]:
            continue
        counted += 1
        last[r] += 1
        caused[r] += wait
        longest[r] = max(longest[r], wait)
    waits = sum(caused)
    figure = {"collectives": total, "counted": counted, "min_wait_s": rules["waits_min_s"],
              "min_counted": rules["waits_min_counted"], "wait_s": round(waits, 4),
              "wait_share_to_name": wait_share(n, rules) if n > 1 else None,
              "legend": "per collective, the last rank to arrive is the one that spent the "
                        "least time inside; counted: collectives whose wait (the others' median "
                        "time inside minus the last one's) was at least min_wait_s; wait_s: "
                        "all their waits; most_last: the ranks the others waited for longest, "
                        "with how often each was the last (last), the waits it caused "
                        "(wait_s, share of all) and the longest of them (longest_s)",
              "most_last": [{"rank": r, "last": last[r], "wait_s": round(caused[r], 4),
                             "share": round(caused[r] / waits, 3),
                             "longest_s": round(longest[r], 4)}
                            for r in sorted(range(n), key=lambda r: (-caused[r], r))[:8]
                            if last[r]]}
    culprits = []
    for r in range(n):
        if (counted >= rules["waits_min_counted"] and caused[r] >= wait_share(n, rules) * waits
                and caused[r] - longest[r] >= rules["waits_min_total_s"]
                and caused[r] >= rules["waits_min_fraction"] * inside and last[r] * n >= counted):
            others = [q for q in range(n) if q != r]
            culprits.append((r, f"ranks {_ranks(others)} waited for rank {r} "
                                f"{caused[r]:.1f} s in all, {100 * caused[r] / waits:.0f} % of "
                                f"the waits of {counted} collectives (it arrived last in "
                                f"{last[r]}; the others' time inside collectives: "
                                f"{inside:.1f} s)"))
    return figure, culprits


def attach(result, spent: list[list | None], culprit, run=None,
           cpu: list[dict | None] | None = None) -> None:
    """Add the waits figure to a judged check's result, and its stragglers as culprits
    (``culprit(rank, reason)`` makes one with the rank's host) unless ``run`` (the
    :class:`~ddp_smoke.coordination.protocol.Run`) is a node-check on CPU ranks
    (:func:`scheduler_paced`). A skipped check stays skipped.
    A rank the check's own evidence already names, alone, as an end of a slow link or on a rail
    named as a whole, is not named again: the others waited for it because of what the check
    found (a throttled link makes its two ends arrive last). Nor is any rank of a check that
    names a link: a ring or tree carries a link's delay on to the ranks after it, which then
    arrive last (measured: a port flapping between nodes 1 and 2 of three made ranks 0 and 1
    wait 3.4 s for rank 2, 73 % of the waits; the figure keeps them, ``link_named``). Nor is
    a CPU rank sharing its node's (or its kernel's: :func:`shared_kernels`) cores that no CPU
    quota held back (``cpu[r]``, :func:`scheduler_chose`)."""
    rules = (run.cfg.get("diagnosis") if run is not None else None) or RULES
    figure, slow = waits_and_stragglers(spent, rules)
    result.figures["waits"] = figure
    named = {r for k in result.culprits for r in [k.rank, *(k.ranks or []),
                                                   *((k.rail or {}).get("ranks") or [])]
             if r is not None}  # a rail slow on every node: its ranks are what was found
    pace = shared_kernels(cpu or [None] * len(spent))
    slow = [(r, reason) for r, reason in slow if r not in named]
    if slow and any(k.rank is None and len(k.ranks or []) == 2 for k in result.culprits):
        figure["link_named"], slow = [r for r, _ in slow], []
    spared = [r for r, _ in slow if scheduler_chose(pace[r], rules)]
    if spared:  # the figure says who would have been named, and why not
        figure["scheduler_chose"] = spared
    slow = [(r, reason + _held(pace[r], rules)) for r, reason in slow if r not in spared]
    if slow and result.status != "skip" and not scheduler_paced(run):
        result.culprits += [culprit(r, reason) for r, reason in slow]
        result.status = "fail"
        result.summary = f"straggler: {slow[0][1]}; {result.summary}"


def oversubscribed(members) -> set:
    """The groups (a host, a kernel) whose members' threads are as many as the fewest usable
    cores among them, or more; ``members``: ``(group, threads, cores)`` each."""
    threads: dict = {}
    cores: dict = {}
    for group, n, usable in members:
        threads[group] = threads.get(group, 0) + n
        cores[group] = min(cores.get(group, usable), usable)
    return {g for g in threads if threads[g] >= cores[g]}


def shared_kernels(pace: list[dict | None]) -> list[dict | None]:
    """Each CPU rank's ``pace`` with ``shared`` also true where the ranks of every launcher
    node on its kernel (the same boot id: network namespaces or containers as nodes of one
    machine) hold as many threads as the fewest usable cores among them, or more. Measured: 4
    namespaced "nodes" of one rank each on 2 cores beside two busy loops in CI named a healthy
    rank that the others waited for 1.3 s (0.33 s without its longest wait)."""
    shared = oversubscribed((p["kernel"], p["threads"], p["cores"]) for p in pace
                            if p and p.get("kernel") and p.get("threads") and p.get("cores"))
    return [{**p, "shared": True} if p and p.get("kernel") in shared else p for p in pace]


def scheduler_paced(run) -> bool:
    """A node-check (the node tier: its run id) on CPU ranks. They all share this node's
    cores, so which of them arrives last is the OS scheduler's choice under whatever else runs
    there, not a finding about the node: the waits stay a figure, and the node's CPU is judged
    by the health check's cgroup quota reading. On GPUs the ranks are the node's GPUs, and one
    the others wait for is the node's fault: named as in any run."""
    return run is not None and run.env.run_id.startswith(NODE_RUN_PREFIX) and \
        all(str(r.get("device", "")).startswith("cpu") for r in run.ranks)


def scheduler_chose(pace: dict | None, rules: dict = RULES) -> bool:
    """A CPU rank on a node whose ranks share its cores, and no CPU quota held it back for
    ``waits_min_total_s`` in the check: which rank the others waited for was the OS scheduler's
    choice under whatever else ran there, not a finding about the rank. Measured: a healthy
    4-rank run on 2 cores beside another test's Slurm and Docker work in CI named a rank;
    three busy processes beside it (12 runs) brought a healthy rank to 0.19 s without its
    longest wait.
    A quota that held it (a pod's CPU limit, a cgroup's: the CPU's power cap) is a finding."""
    return bool(pace and pace.get("shared") and
                (pace.get("held_s") or 0.0) < rules["waits_min_total_s"])


def _held(pace: dict | None, rules: dict) -> str:
    held = (pace or {}).get("held_s") or 0.0
    return (f"; a CPU quota held it back {held:.1f} s in the check"
            if held >= rules["waits_min_total_s"] else "")


def line(figure: dict) -> str | None:
    """The figure in a few words, for the human summary (None for a check with too few
    collectives to count: a line under every check would be noise)."""
    if figure.get("collectives", 0) < figure.get("min_counted", RULES["waits_min_counted"]):
        return None
    top = figure["most_last"][0] if figure["most_last"] else None
    most = (f"waited for longest: rank {top['rank']}, {top['wait_s']:.2f} s "
            f"({top.get('share', 0):.0%} of the waits), last {top['last']} times"
            if top else "no rank kept the others waiting")
    spared = (f" (not named: CPU ranks that share their node's cores, no CPU quota held "
              f"rank {_ranks(figure['scheduler_chose'])})" if figure.get("scheduler_chose")
              else "")
    return (f"waits: {figure['counted']} of {figure['collectives']} collectives had a wait "
            f">= {figure['min_wait_s'] * 1e3:.0f} ms; {most}{spared}")


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" … ({len(ranks)} ranks)" if len(ranks) > 8
                                              else "")
