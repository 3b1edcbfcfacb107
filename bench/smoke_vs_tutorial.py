"""Time to verdict: `make smoke-local` against the bare tutorial under the same torchrun command.

Alternates the commands ROUNDS times, in a rotating order (so drift on a shared machine hits
every command alike), and reports each command's median wall time, its ratio to the tutorial's
median, and the median of its per-round ratios (each round's pair ran back to back, under the
same load). No timed assert: the ratio is the result. The 1-minute load average before and
after is printed, because other work on the machine moves every figure.

`make smoke-local` is the local default (the quick level); the standard level (the cluster
launchers' default) and the tutorial's own two checks are timed alongside for scale.

    .venv/bin/python bench/smoke_vs_tutorial.py [ROUNDS]     # from the repo root, after make venv
"""
from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

TORCHRUN = [".venv/bin/torchrun", "--standalone", "--nproc-per-node=2"]
TARGET = 1.0  # issue 34's bound on the quick level's ratio, printed beside it (not asserted)


def commands(report_root: str) -> dict[str, list[str]]:
    def smoke(tag: str, *args: str) -> list[str]:
        return ["make", "-s", "smoke-local", f"REPORT_DIR={report_root}/{tag}", *args]
    return {
        "tutorial (bench/tutorial.py)": TORCHRUN + ["bench/tutorial.py"],
        "make smoke-local (quick)": smoke("quick"),
        "  --checks environment,ddp_step": smoke("two", "ARGS=--checks environment,ddp_step"),
        "  LEVEL=standard": smoke("standard", "LEVEL=standard"),
    }


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(rounds: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall seconds and CPU seconds (user + system, all processes) per command and round."""
    with tempfile.TemporaryDirectory(prefix="ddp-smoke-bench-") as root:
        cmds = commands(root)
        names = list(cmds)
        times: dict[str, list[float]] = {name: [] for name in names}
        cpu: dict[str, list[float]] = {name: [] for name in names}
        for i in range(rounds):
            for name in names[i % len(names):] + names[:i % len(names)]:  # rotate the order
                t, c = time.monotonic(), _children_cpu_s()
                p = subprocess.run(cmds[name], capture_output=True, text=True, timeout=300)
                if p.returncode:  # said, and left out of the medians (and the round's pairs)
                    tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
                    print(f"# {name.strip()} failed in round {i} (exit {p.returncode}): "
                          f"{tail[:200]}", flush=True)
                    times[name].append(float("nan"))
                    cpu[name].append(float("nan"))
                    continue
                times[name].append(time.monotonic() - t)
                cpu[name].append(_children_cpu_s() - c)
    return times, cpu


def _median(values) -> float:
    ok = [v for v in values if v == v]  # NaN marks a failed run
    return statistics.median(ok) if ok else float("nan")


def main(rounds: int) -> None:
    load_before = os.getloadavg()[0]
    times, cpu = measure(rounds)
    base = times[next(iter(times))]
    cpu_base = _median(cpu[next(iter(cpu))])
    print(f"# time to verdict: {rounds} rotating rounds, 2 gloo ranks; load (1 min) "
          f"{load_before:.2f} before, {os.getloadavg()[0]:.2f} after, on {os.cpu_count()} CPUs")
    print("# ratio: median / the tutorial's median; paired: median of per-round ratios; cpu: "
          "CPU seconds (user + system) of all its processes, less sensitive to load than wall")
    print(f"# {'command':<34} {'median_s':>9} {'ratio':>6} {'paired':>7} {'cpu_s':>6} "
          f"{'ratio':>6}   runs_s")
    for name, ts in times.items():
        med = _median(ts)
        paired = _median([t / b for t, b in zip(ts, base)])
        c = _median(cpu[name])
        print(f"  {name:<34} {med:>9.2f} {med / _median(base):>6.2f} {paired:>7.2f} "
              f"{c:>6.2f} {c / cpu_base:>6.2f}   " + " ".join(f"{t:.1f}" for t in ts))
    quick = _median(times["make smoke-local (quick)"]) / _median(base)
    print(f"time-to-verdict ratio (make smoke-local / tutorial, medians): {quick:.2f} "
          f"(target <= {TARGET})")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
