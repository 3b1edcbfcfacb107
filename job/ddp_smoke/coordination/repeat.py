"""Repeat mode: the selected checks again and again in one process group, one result per check.

``--repeat N`` runs every check N times; ``--duration S`` keeps starting new iterations until
S seconds have passed since the first (rank 0 decides, every rank follows). An intermittent
fault — a flaky link, a GPU that throttles now and then — shows in some iterations only; this
module folds each check's iterations into one result (pure, on the report's writer):

* status: fail when any iteration failed; the summary says in how many ("intermittent: failed
  in 2 of 20 iterations") or that it failed every time;
* culprits: one per rank or link named in any iteration, with the count of iterations;
* figures: every iteration's figures, failures per rank, and for the bandwidth sweep per
  (collective, size) the p50 and p99 busbw and its coefficient of variation;
* ddp_step: the post-step weights must be bit-identical across iterations (same seed, same
  data, same reduction order): determinism is part of what the step proves.
"""
from __future__ import annotations

import statistics

from ..model import percentile
from ..model import FAIL, PASS, SKIP, CheckResult, Culprit


def combine(judged: list[tuple[int, CheckResult]], hosts: list) -> list[CheckResult]:
    """One result per check name, in first-seen order; a single iteration passes unchanged.
    ``hosts`` is every rank's host, for culprits this module adds."""
    if all(it == 0 for it, _ in judged):
        return [r for _, r in judged]
    by_name: dict[str, list[tuple[int, CheckResult]]] = {}
    for it, r in judged:
        by_name.setdefault(r.name, []).append((it, r))
    return [merge(name, runs, hosts) for name, runs in by_name.items()]


def merge(name: str, runs: list[tuple[int, CheckResult]], hosts: list) -> CheckResult:
    """Fold one check's iterations (``(iteration, result)``, in order) into one result."""
    n = len(runs)
    failed = [(it, r) for it, r in runs if r.status == FAIL]
    culprits = _culprits(failed, n)
    figures = {"runs": n, "failures": len(failed),
               "failed_iterations": [it + 1 for it, _ in failed],
               "failures_by_rank": _by_rank(failed),
               "iterations": [{"iteration": it + 1, "status": r.status, "summary": r.summary,
                               "duration_s": r.duration_s, "culprits": [c.__dict__ for c in
                                                                        r.culprits],
                               "figures": r.figures} for it, r in runs]}
    sweep = _sweep_stats([r for _, r in runs])
    if sweep:
        figures["busbw_by_size"] = sweep
    if name == "ddp_step":
        drift = _weights_drift(runs, hosts)
        if drift:
            culprits.append(drift)
    if all(r.status == SKIP for _, r in runs):
        status, summary = SKIP, runs[0][1].summary
    elif culprits:
        status = FAIL
        first = failed[0][1].summary if failed else culprits[0].reason
        summary = (f"intermittent: failed in {len(failed)} of {n} iterations: {first}"
                   if 0 < len(failed) < n else
                   f"failed in all {n} iterations: {first}" if failed else first)
    else:
        status, summary = PASS, (f"passed in {n} of {n} iterations; iteration {n} (last): "
                                 f"{runs[-1][1].summary}")
    # The tables printed are the last iteration's, labelled as such (the summary's "last");
    # every iteration's figures are in the report.
    last = runs[-1][1].notes
    notes = [f"# {name}, iteration {n} of {n} (last; all in report.json)", *last] if last \
        else []
    return CheckResult(name, status, summary=summary, culprits=culprits, figures=figures,
                       notes=notes, duration_s=sum(r.duration_s for _, r in runs))


def _culprits(failed: list[tuple[int, CheckResult]], n: int) -> list[Culprit]:
    """One culprit per rank (or link) seen in any failed iteration, with how often."""
    seen: dict[tuple, tuple[Culprit, list[int]]] = {}
    for it, r in failed:
        for c in r.culprits:
            key = (c.rank, tuple(c.ranks or ()), c.host if c.rank is None else None)
            if key not in seen:
                seen[key] = (c, [])
            if it + 1 not in seen[key][1]:
                seen[key][1].append(it + 1)
    out = []
    for c, iters in seen.values():
        how = ("in every iteration" if len(iters) == n else
               f"intermittent: {len(iters)} of {n} iterations ({_list(iters)})")
        out.append(Culprit(c.rank, c.host, f"{c.reason} [{how}]", ranks=c.ranks,
                           hosts=c.hosts, where=c.where))
    return out


def _by_rank(failed: list[tuple[int, CheckResult]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for _, r in failed:
        for rank in {c.rank for c in r.culprits if c.rank is not None}:
            counts[str(rank)] = counts.get(str(rank), 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: int(kv[0])))


def _sweep_stats(results: list[CheckResult]) -> list[dict]:
    """Per (collective, size): p50/p99 busbw over the iterations and its spread."""
    series: dict[tuple, list[float]] = {}
    for r in results:
        for row in r.figures.get("results", []) if isinstance(r.figures, dict) else []:
            if isinstance(row, dict) and {"collective", "size_bytes", "busbw_gbps"} <= set(row):
                series.setdefault((row["collective"], row["size_bytes"]), []).append(
                    row["busbw_gbps"])
    out = []
    for (collective, size), values in series.items():
        mean = statistics.fmean(values)
        out.append({"collective": collective, "size_bytes": size, "runs": len(values),
                    "busbw_gbps_p50": percentile(values, 50),
                    "busbw_gbps_p99": percentile(values, 99),
                    "busbw_cv": statistics.pstdev(values) / mean if mean > 0 else None})
    return out




def _weights_drift(runs: list[tuple[int, CheckResult]], hosts: list) -> Culprit | None:
    """A culprit when some rank's post-step weights differ between iterations."""
    first = next((r.figures.get("params") for _, r in runs if r.figures.get("params")), None)
    if first is None:
        return None
    for it, r in runs:
        params = r.figures.get("params")
        if params is None:
            continue
        for rank, (a, b) in enumerate(zip(first, params)):
            if a != b:
                host = hosts[rank] if rank < len(hosts) else None
                return Culprit(rank, host, f"post-step weights in iteration {it + 1} differ from "
                                           f"iteration 1 (not bit-identical: {a} != {b})")
    return None


def _list(iters: list[int]) -> str:
    return ", ".join(map(str, iters[:10])) + (" …" if len(iters) > 10 else "")
