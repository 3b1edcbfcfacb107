"""Wall time of `make smoke-local` against the bare tutorial under the same torchrun command.

Alternates the commands ROUNDS times (so drift on a shared machine hits both alike) and
reports medians and the ratio to the tutorial. Run from the repo root after `make venv`:

    .venv/bin/python bench/smoke_vs_tutorial.py [ROUNDS]
"""
import statistics
import subprocess
import sys
import time

TORCHRUN = [".venv/bin/torchrun", "--standalone", "--nproc-per-node=2"]
COMMANDS = {
    "tutorial": TORCHRUN + ["bench/tutorial.py"],
    "smoke (environment,ddp_step)": ["make", "-s", "smoke-local",
                                     "ARGS=--checks environment,ddp_step"],
    "smoke (all checks)": ["make", "-s", "smoke-local"],
}


def main(rounds: int) -> None:
    times = {name: [] for name in COMMANDS}
    for _ in range(rounds):
        for name, cmd in COMMANDS.items():
            t = time.monotonic()
            subprocess.run(cmd, check=True, capture_output=True, timeout=300)
            times[name].append(time.monotonic() - t)
    base = statistics.median(times["tutorial"])
    print(f"{'command':<32} {'median_s':>9} {'ratio':>6}   runs_s")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<32} {med:>9.2f} {med / base:>6.2f}   "
              + " ".join(f"{t:.1f}" for t in ts))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
