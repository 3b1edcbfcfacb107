"""What a node-check costs: its wall time against its budget and against the bare tutorial.

``ddp-smoke node-check`` on this machine (2 CPU ranks; a GPU machine: one rank per GPU), timed
from the command's start to its exit, its report written; timed alongside, in a rotating order,
the two-rank DDP tutorial under torchrun (bench/tutorial.py), the least a torchrun job costs
here. Prints medians, their ratio, the phases of the last node-check (preflight, the worker's
checks, from its report) and the budget the issue sets: <= 10 s on CPU, <= 30 s on a GPU node
(LBNL NHC's default 30 s; Slurm kills a HealthCheckProgram at 60 s). No assert: on a shared
machine the figures move with the load, printed before and after.

    .venv/bin/python bench/node_check.py [ROUNDS]     # from the repo root, after make venv
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

PY = ".venv/bin/python"
BUDGET_S = {"cpu": 10.0, "gpu": 30.0}


def node_check(root: str) -> tuple[float, dict]:
    t0 = time.monotonic()
    run = subprocess.run([PY, "-m", "ddp_smoke", "node-check", "--report-root", root],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.monotonic() - t0
    if run.returncode != 0:
        raise SystemExit(f"node-check failed ({run.returncode}):\n{run.stdout}{run.stderr}")
    path = run.stdout.strip().splitlines()[-1].rsplit(" report ", 1)[1]
    with open(path) as f:
        return wall, json.load(f)


def tutorial(round_: int) -> float:
    """Seconds of one tutorial run; NaN, said, when it failed (torch 2.13's gloo aborts at the
    tutorial's exit now and then: 1 run in 3 here, "terminate called without an active
    exception"), left out of the median as bench/smoke_vs_tutorial.py leaves it."""
    t0 = time.monotonic()
    run = subprocess.run([".venv/bin/torchrun", "--standalone", "--nproc-per-node=2",
                          "bench/tutorial.py"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    if run.returncode:
        tail = (run.stderr.strip().splitlines() or ["(no output)"])[-1]
        print(f"# tutorial failed in round {round_} (exit {run.returncode}): {tail[:200]}")
        return float("nan")
    return time.monotonic() - t0


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    print(f"# node-check cost, {rounds} rounds; load {os.getloadavg()[0]:.2f}")
    times: dict[str, list[float]] = {"node-check": [], "tutorial": []}
    with tempfile.TemporaryDirectory(prefix="ddp-smoke-bench-nc-") as root:
        for i in range(rounds):
            for name in (("node-check", "tutorial") if i % 2 == 0 else
                         ("tutorial", "node-check")):
                if name == "tutorial":
                    times[name].append(tutorial(i))
                else:
                    wall, report = node_check(root)
                    times[name].append(wall)
    nc, tut = (statistics.median([t for t in times[k] if t == t] or [float("nan")])
               for k in ("node-check", "tutorial"))
    kind = "gpu" if any(str(r.get("device", "")).startswith("cuda")
                        for r in report["ranks"]) else "cpu"
    print(f"node-check, {report['world_size']} {kind} rank(s)   median {nc:6.2f} s  "
          f"({' '.join(f'{t:.2f}' for t in times['node-check'])})  budget {BUDGET_S[kind]:g} s: "
          f"{'within' if nc <= BUDGET_S[kind] else 'OVER'}")
    print(f"tutorial, 2 ranks under torchrun median {tut:6.2f} s  "
          f"({' '.join(f'{t:.2f}' for t in times['tutorial'])})")
    print(f"node-check / tutorial: {nc / tut:.2f}")
    checks = ", ".join(f"{c['name']} {c['duration_s']:.2f} s" for c in report["checks"])
    print(f"# last node-check: worker checks {report['timings'].get('checks_s', 0):.2f} s "
          f"({checks}); rest = torch imports, process group, report")
    print(f"# load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
