"""The human summary rank 0 prints, laid out like nccl-tests: header, per-rank lines, notes,
one row per check with its culprits, what else was written, then the verdict: the verdict is the
last line, whatever else the run prints (a log's tail, a job's last line)."""
from __future__ import annotations

from ..coordination import stragglers
from ..model import FAIL, PASS, Report, injected, rail_label


def render(report: Report, path: str, before_verdict: list[str] = ()) -> str:
    """The whole summary as text (pure, for tests and for printing); ``before_verdict``: the
    other outputs' lines (hosts, next steps, files written), printed just before the verdict."""
    d = report.to_dict()
    cfg = report.config
    lines = [f"# ddp-smoke {report.version} · backend {report.backend} · world_size "
             f"{report.world_size} · nodes {d['nodes']} · timeout {cfg['timeout']} s",
             f"# checks: {','.join(cfg['checks'])}",
             f"# {'rank':>5} {'local':>5}  {'host':<20} {'pid':>8}  {'device':<8} route_address"]
    for r in report.ranks:
        lines.append(f"# {r['rank']:>5} {str(r.get('local_rank')):>5}  {str(r.get('host')):<20} "
                     f"{str(r.get('pid', '-')):>8}  {str(r.get('device', '-')):<8} "
                     f"{r.get('route_address') or '-'}"
                     f"{'  ' + r['gpu_name'] + ' ' + str(r.get('gpu_bus_id')) if r.get('gpu_name') else ''}")
    for c in report.checks:
        lines.extend(c.notes)
    lines.append(f"# {'check':<16} {'status':<6} {'time_s':>8}  result")
    for c in report.checks:
        lines.append(f"  {c.name:<16} {c.status.upper():<6} {c.duration_s:>8.3f}  {c.summary}")
        waits = stragglers.line(c.figures.get("waits") or {})
        if waits:
            lines.append(f"  {'':<16} {waits}")
        for k in c.culprits:
            who = (f"rank {k.rank} ({k.host})" if k.rank is not None else
                   f"link ranks {k.ranks[0]}-{k.ranks[1]} ({k.hosts[0]} <-> {k.hosts[1]})"
                   if k.ranks else f"host {k.host}" if k.host else
                   "every node" if k.rail else "no single rank")
            who += f", {rail_label(k.rail)}" if k.rail else ""
            at = f" [{k.where}]" if k.where else ""
            lines.append(f"  {'':<16} culprit: {who}: {k.reason}{at}")
        victims = c.figures.get("victims") if c.status == FAIL else None
        if victims:
            lines.append(f"  {'':<16} victims (stopped by the culprit, not at fault): ranks "
                         f"{', '.join(str(v['rank']) for v in victims[:16])}"
                         f"{' …' if len(victims) > 16 else ''}")
    lines.extend(security_lines(report.security))
    practice = injected(report)
    if practice:
        lines.append(f"# injected on purpose (--fault {practice}): the failures it causes "
                     "test the alerting path, not this cluster")
    lines.extend(before_verdict)
    passed = sum(c.status == PASS for c in report.checks)
    failed = [c.name for c in report.checks if c.status == FAIL]
    tail = f"; failed: {', '.join(failed)}" if failed else ""
    mark = f" (PRACTICE: --fault {practice})" if practice else ""
    lines.append(f"verdict: {report.verdict.upper()}{mark} — {passed}/{len(report.checks)} "
                 f"checks passed in {report.timings.get('total_s', 0):.2f} s{tail} · report "
                 f"{path}")
    return "\n".join(lines)


def security_lines(security: dict) -> list[str]:
    """What the store's signature checks found: records written from outside the run (never
    evidence), or a run whose records were not signed."""
    out = [f"# SECURITY: a record for rank {f.get('rank')} under {f.get('key')} was not "
           f"written by this run ({f.get('why')}; seen by rank {f.get('seen_by')}); it was "
           "ignored" for f in security.get("findings", [])[:20]]
    if security and not security.get("signed"):
        out.append("# SECURITY: this run's store records were not signed (several nodes and no "
                   "DDP_SMOKE_SECRET from the launcher): anyone who reaches the store could have "
                   "written them")
    return out


def print_report(report: Report, path: str, before_verdict: list[str] = ()) -> None:
    print(render(report, path, before_verdict), flush=True)
