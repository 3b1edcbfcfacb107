"""``python -m tests.campaign``: run the fault campaign, or a slice of it, and write its table.

    python -m tests.campaign                      # the whole covering set (about 2 h here)
    python -m tests.campaign --part 3/14          # the 3rd of 14 parts of equal expected time
    python -m tests.campaign --slice kind=sigkill+sigsegv,launcher=torchrun
    python -m tests.campaign --cell sigkill.middle.collectives.torchrun.1x3 [--repeat 5]
    python -m tests.campaign --sample COMMIT --budget 300   # CI's sample for that commit
    python -m tests.campaign --list [--slice …]   # the cells, their expected outcome and cost
    python -m tests.campaign --table              # docs/campaign.md from the results so far

Each row goes to ``reports/campaign/results.jsonl`` as it finishes (the latest row of a cell
wins); ``--table`` renders every cell's latest row with the counts. Root only (namespaces,
cgroups, Slurm, Docker). Exit status 0 when every cell run was right, 1 otherwise, 2 for a
bad option.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

from tests.campaign import matrix

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "reports" / "campaign" / "results.jsonl"
TABLE = REPO / "docs" / "campaign.md"
# CI's sample, in the seconds the table measured its cells (a loaded CI worker takes about a
# third longer): part of the suite's 20 minutes (tests/conftest.py), where the whole suite
# left ~2 % to spare (45, not 60: tests/durations.json)
SAMPLE_BUDGET_S = 45.0


def covering() -> matrix.Cover:
    """The covering set, keeping the cells the committed table lists (:func:`matrix.cover`)."""
    return matrix.cover(kept=matrix.cells_in(TABLE.read_text() if TABLE.exists() else ""))


def parts_of(cells: list, part: str) -> list:
    """``K/N``: the K-th of N consecutive parts of about equal expected time."""
    k, _, n = part.partition("/")
    k, n = int(k), int(n)
    if not 1 <= k <= n:
        raise ValueError(f"--part {part}: expected K/N with 1 <= K <= N")
    total, acc, out = sum(map(matrix.cost_s, cells)), 0.0, []
    for c in cells:
        mid = acc + matrix.cost_s(c) / 2
        if (k - 1) * total / n <= mid < k * total / n:
            out.append(c)
        acc += matrix.cost_s(c)
    return out


def ci_sample(seed: str, budget_s: float) -> tuple[list, dict]:
    """CI's sample for ``seed``, and each sampled cell's time: among the cells docs/campaign.md
    shows right, each costed at its time there (a cell whose launcher waits out its own
    timeouts measured 131 s against the model's 49 s: the budget holds only on measured
    times). CI guards what the campaign has shown right (a cell that goes wrong fails the
    commit); `make campaign` runs the rest and finds what is still wrong, the table's WRONG
    and not-run rows."""
    text = TABLE.read_text() if TABLE.exists() else ""
    right, measured = matrix.right_in(text), matrix.measured_in(text)
    cover = covering().cells
    cost = {c.id: measured.get(c.id) or matrix.cost_s(c) for c in cover}
    cells = matrix.sample([c for c in cover if c.id in right], seed, budget_s,
                          lambda c: cost[c.id])
    return cells, {c.id: cost[c.id] for c in cells}


def choose(args) -> list:
    if args.cell:
        return [matrix.Cell.parse(c) for c in args.cell for _ in range(args.repeat)]
    cells = covering().cells
    if args.sample is not None:  # CI's: among the cells the committed table shows right
        cells = ci_sample(args.sample, args.budget)[0]
    if args.slice:
        cells = matrix.select(cells, args.slice)
    if args.part:
        cells = parts_of(cells, args.part)
    if args.missing or args.wrong:  # no row yet, or a wrong latest row
        rows = latest_rows()
        cells = [c for c in cells if (args.missing and c.id not in rows)
                 or (args.wrong and c.id in rows and not rows[c.id]["ok"])]
    for c in cells:
        if matrix.impossible(c):
            raise ValueError(f"{c.id}: {matrix.impossible(c)}")
    return [c for c in cells for _ in range(args.repeat)]


def describe(e: matrix.Expect) -> str:
    who = ", ".join(sorted(" ".join(map(str, c)) for c in e.culprits)) or "-"
    words = "; ".join(e.words)
    return (f"{e.verdict} {{{who}}}" + (f" '{words}'" if words else "")
            + (f", {e.lost} in lost/" if e.lost else ""))


def record(row) -> dict:
    g = row.got
    return {"cell": row.cell.id, "ok": row.ok, "problems": row.problems,
            "expected": describe(row.expect), "why": row.expect.why,
            "got": f"{g.verdict} {{{', '.join(sorted(' '.join(map(str, c)) for c in g.culprits)) or '-'}}}"
                   f" by {g.writer or '-'}, exit {g.status}",
            "report_s": g.report_s, "wall_s": round(row.wall_s, 1), "note": g.note,
            "reasons": g.text[:600], "at": time.strftime("%Y-%m-%dT%H:%M:%S")}


def run(cells: list, work: Path, stop_after_s: float | None = None) -> int:
    from tests.campaign import launchers, runner  # torch and the sandboxes: not for --list
    reason = launchers.missing()
    if reason:
        print(f"campaign: cannot run: {reason}", file=sys.stderr)
        return 2
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    parts = launchers.Parts(work)
    # a SIGTERM (a timeout around a slice) still takes the sandboxes down
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    wrong, t0 = 0, time.monotonic()
    try:
        for i, cell in enumerate(cells):
            if stop_after_s and time.monotonic() - t0 + matrix.cost_s(cell) > stop_after_s:
                print(f"campaign: stopped before {len(cells) - i} cell(s): --stop-after "
                      f"{stop_after_s:g} s", flush=True)
                cells = cells[:i]
                break
            row = runner.run(cell, parts, work / f"{i:03d}-{cell.id}")
            rec = record(row)
            with open(RESULTS, "a") as f:
                f.write(json.dumps(rec) + "\n")
            wrong += not row.ok
            mark = "ok  " if row.ok else "WRONG"
            print(f"{mark} {cell.id:50s} {row.wall_s:5.1f} s  got {rec['got']}"
                  + ("" if row.ok else f"  <- {'; '.join(row.problems)}"), flush=True)
    finally:
        parts.close()
    print(f"campaign: {len(cells)} cells, {len(cells) - wrong} right, {wrong} wrong, "
          f"{time.monotonic() - t0:.0f} s; results in {RESULTS}")
    return 1 if wrong else 0


def latest_rows() -> dict[str, dict]:
    """Each cell's latest row in RESULTS."""
    latest = {}
    if RESULTS.exists():
        for line in RESULTS.read_text().splitlines():
            rec = json.loads(line)
            latest[rec["cell"]] = rec
    return latest


def _counts(cells: list, rows: list, dim: str, value: str) -> str:
    """``value`` right/run of its cells (``/total`` where some are not run yet)."""
    mine = [r for c, r in zip(cells, rows) if getattr(c, dim) == value]
    ran = [r for r in mine if r]
    out = f"{value} {sum(r['ok'] for r in ran)}/{len(ran)}"
    return out + (f" of {len(mine)}" if len(ran) < len(mine) else "")


def table(path: Path = TABLE) -> str:
    """docs/campaign.md: every covering cell's latest row, the counts, the impossible pairs.
    A cell with no row here keeps the row the table had (run on another machine or day)."""
    latest, before = latest_rows(), path.read_text() if path.exists() else ""
    cov = covering()
    had = {cols[0]: cols for cols in matrix._rows(before) if cols[-1] and cols[2] != "not run"}
    for c in cov.cells:
        if c.id not in latest and c.id in had:
            e, g, report_s, wall_s, mark = had[c.id][1:]
            latest[c.id] = {"expected": e, "got": g, "report_s": report_s, "ok": mark == "right",
                            "wall_s": float(wall_s), "problems": [mark.split(": ", 1)[-1]]}
    rows = [latest.get(c.id) for c in cov.cells]
    ran = [r for r in rows if r]
    right = sum(r["ok"] for r in ran)
    out = [
        "# The fault campaign: its latest full table",
        "",
        "Trust that does not depend on which fault someone thought of: a matrix of real faults "
        "× where they land × stage × launcher × shape, each cell run for real and compared "
        "with its exact expected outcome (the culprit set, the reason's words, who wrote the "
        "report, the time from the fault to the report, the launcher's exit status). Generated "
        "by `python -m tests.campaign --table` from the rows `make campaign` leaves.",
        "",
        "- The cells, their generation and expectations: `tests/campaign/matrix.py` (pure); "
        "each launcher started as users start it (plain torchrun, `make smoke-local`, the "
        "Slurm template on a real Slurm cluster, the image on bare pods, `ddp-smoke-submit`, "
        "and the PyTorchJob, Indexed Job and TrainJob of `k8s/`, their pods as the "
        "controllers (the Training Operator, Trainer with JobSet, the Job controller) and the "
        "kubelet make them: `tests/k8s_operator.py`, `tests/kubelet.py`; the TrainJob's report "
        "read from its pod's log, where its users read it): "
        "`tests/campaign/launchers.py`; one cell run "
        "and judged: `tests/campaign/runner.py`; the real faults (cgroups, tc, iptables, a "
        "tmpfs folder): `tests/sandbox/faults.py`. Signals go to PIDs, the memory limit makes "
        "the kernel's OOM killer act, network faults live in the nodes' namespaces; only the "
        "kinds that are by nature in-process (exit with a status, hang in Python, stall "
        "inside a collective) and silent data corruption (no CPU corrupts a product on "
        "demand) use the worker's own `--fault`. The shape 2x2 (two nodes of two ranks) runs "
        "with `--node-speaker on`, the protocol of a large run (auto turns it on beyond 2,500 "
        "ranks): each node's ranks post through one of them.",
        "- `make campaign` runs the covering set (about 2 hours here); `SLICE=kind=sigkill+oom`, "
        "`PART=3/14` or `CELL=sigkill.middle.collectives.torchrun.1x3` run part of it; "
        "`python -m tests.campaign --cell ID --repeat 5` reruns one cell.",
        "- node_check: `slurm/node-check.sh` as the HealthCheckProgram of the campaign's Slurm "
        "cluster; NxM is N nodes each running `node-check --act slurm-drain --cpu-ranks M`, "
        "the outcome the nodes the kit drained (as hosts) and their drain reasons. daemonset: "
        "the DaemonSet of `k8s/node-check` in the pod emulation, each pod's node labelled "
        "through a stand-in API server (tests/k8s_api.py), the outcome the nodes labelled "
        "fail and their findings' annotations. The circuit "
        "breaker's refusal (more than `fleet.drain_max_share` of the cluster failing at once) "
        "is no position of one fault on one node: it is tested on recorded reasons "
        "(tests/outputs/test_fleet.py).",
        "- CI (`make test`) runs `tests/campaign/test_campaign.py`: a sample of the cells this "
        "table shows right, seeded by the commit (the seed is in pytest's header; `python -m "
        f"tests.campaign --sample SEED --list` shows the cells), within {SAMPLE_BUDGET_S:g} s of "
        "the times this table measured: a cell that goes wrong fails the commit that broke it. "
        "Each commit samples other cells; the WRONG and not-run rows are `make campaign`'s to "
        "run and fix.",
        "",
        "Dimensions: " + "; ".join(f"**{k}** ({len(v)}): {', '.join(v)}"
                                   for k, v in matrix.DIMENSIONS.items()) + ".",
        "",
        f"Covering set: **{len(cov.cells)} cells** hold all {cov.pairs} possible pairs of "
        f"values of any two dimensions; {len(cov.impossible_pairs)} pairs cannot exist "
        f"(listed below with why). Expected time {sum(map(matrix.cost_s, cov.cells)) / 60:.0f} "
        f"min; measured {sum(r['wall_s'] for r in ran) / 60:.0f} min over the {len(ran)} "
        "cells run.",
        "",
        f"**Counts: {len(ran)} of {len(cov.cells)} cells run, {right} right, "
        f"{len(ran) - right} wrong.**",
        "",
        *(f"- right/run per {dim}: " + ", ".join(_counts(cov.cells, rows, dim, v)
                                                 for v in matrix.DIMENSIONS[dim])
          for dim in ("launcher", "kind")),
        "",
        "| cell (kind.position.stage.launcher.shape) | expected | got | fault to report (s) "
        "| cell (s) | |",
        "|---|---|---|---|---|---|",
    ]
    for c, r in zip(cov.cells, rows):
        if r is None:
            out.append(f"| {c.id} | {describe(matrix.expect(c))} | not run | | | |")
            continue
        mark = "right" if r["ok"] else "WRONG: " + "; ".join(r["problems"])
        out.append(f"| {c.id} | {r['expected']} | {r['got']} | {r['report_s'] or '-'} "
                   f"| {r['wall_s']} | {mark} |")
    out += ["", "## Kinds", ""] + [f"- **{k}**: {d}" for k, d in matrix.DESCRIBE.items()]
    out += ["", "## Pairs that cannot exist", "", "| pair | why |", "|---|---|"]
    for (d1, v1, d2, v2), why in sorted(cov.impossible_pairs.items()):
        out.append(f"| {d1}={v1}, {d2}={v2} | {why} |")
    text = "\n".join(out) + "\n"
    path.write_text(text)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.campaign", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cell", action="append", help="one cell by id (repeatable)")
    ap.add_argument("--slice", help="dimension=value[+value],… of the covering set")
    ap.add_argument("--part", help="K/N: the K-th of N parts of equal expected time")
    ap.add_argument("--sample", metavar="SEED", help="CI's sample seeded by SEED (a commit)")
    ap.add_argument("--budget", type=float, default=SAMPLE_BUDGET_S,
                    help=f"the sample's measured seconds ({SAMPLE_BUDGET_S:g})")
    ap.add_argument("--repeat", type=int, default=1, help="run each cell N times")
    ap.add_argument("--missing", action="store_true", help="only cells with no row yet")
    ap.add_argument("--wrong", action="store_true", help="only cells whose latest row is wrong")
    ap.add_argument("--list", action="store_true", help="print the cells; run nothing")
    ap.add_argument("--table", action="store_true", help=f"write {TABLE.relative_to(REPO)}")
    ap.add_argument("--work", default="/tmp/ddp-smoke-campaign", help="cells' folders")
    ap.add_argument("--stop-after", type=float, metavar="SECONDS",
                    help="start no cell that would end past this (a slice under a time limit)")
    args = ap.parse_args(argv)
    if args.table:
        text = table()
        print(text.split("| cell", 1)[0].strip())
        return 0
    try:
        cells = choose(args)
    except ValueError as e:
        print(f"campaign: error: {e}", file=sys.stderr)
        return 2
    # a sample's cells at their measured times, the others at the model's
    cost = ci_sample(args.sample, args.budget)[1] if args.sample is not None else {}
    seconds = {c.id: cost.get(c.id) or matrix.cost_s(c) for c in cells}
    if args.sample is not None:
        print(f"campaign sample: seed {args.sample}, {len(cells)} cells, measured "
              f"{sum(seconds.values()):.0f} s of {args.budget:g}")
    if args.list:
        for c in cells:
            print(f"{c.id:50s} {seconds[c.id]:5.0f} s  {describe(matrix.expect(c))}")
        print(f"{len(cells)} cells, {sum(seconds.values()) / 60:.1f} min")
        return 0
    work = Path(args.work) / time.strftime("%Y%m%d-%H%M%S")
    return run(cells, work, args.stop_after)


if __name__ == "__main__":
    sys.exit(main())
