"""Health's own cost per node: start readings, end readings, judging, and the sampler's CPU.

The budget is 1 s per node (issue 33). On this machine the node is the recorded 8x H200
(``DDP_SMOKE_HEALTH_REPLAY``, the default below): the figures are the kit's own Python work
plus the replay's, and the number of NVML calls each snapshot makes, so that a GPU machine's
per-call cost (tens of microseconds) turns it into that machine's figure. On a GPU machine,
``--live`` reads the real node instead (``make gpu-check``'s nvml step prints the same).
Printed, never asserted (a loaded 2-core machine):

    python bench/health_cost.py [ROUNDS] [--live]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "job"))

from ddp_smoke import config  # noqa: E402 — after the path above
from ddp_smoke.checks import health  # noqa: E402
from ddp_smoke.checks.health.finding import Limits  # noqa: E402
from ddp_smoke.checks.health.readers import REPLAY_ENV, Node  # noqa: E402

RECORDING = REPO / "tests" / "data" / "health" / "h200_8gpu_healthy.json"
BUDGET_S = 1.0


def _count_calls(node: Node) -> dict:
    """Wrap the binding's NVML calls with counters (bench only)."""
    counts = {"n": 0}
    nv = node.gpu.nv
    for name in dir(nv):
        fn = getattr(nv, name)
        if name.startswith(("nvmlDevice", "nvmlSystem", "nvmlEvent")) and callable(fn):
            def counted(*args, _fn=fn, **kwargs):
                counts["n"] += 1
                return _fn(*args, **kwargs)
            setattr(nv, name, counted)
    return counts


def one_round(environ: dict, window_s: float, period_s: float) -> dict:
    node = Node(period_s, environ=environ)
    if node.gpu is None:
        raise SystemExit(f"health_cost: NVML not readable here: {node.unavailable}")
    calls = _count_calls(node)
    cpu0, t = time.process_time(), time.perf_counter()
    node.start()
    start_s, start_calls = time.perf_counter() - t, calls["n"]
    time.sleep(window_s)
    sampler_cpu_s = time.process_time() - cpu0
    t, before = time.perf_counter(), calls["n"]
    reading = node.finish()
    finish_s, finish_calls = time.perf_counter() - t, calls["n"] - before
    node.close()
    t = time.perf_counter()
    health.judge_node(reading, Limits(config.defaults()["health"], {}))
    judge_s = time.perf_counter() - t
    gpus = len((reading["gpu"].get("end") or {}).get("gpus", []))
    return {"start_s": start_s, "finish_s": finish_s, "judge_s": judge_s, "gpus": gpus,
            "snapshot_calls": start_calls, "finish_calls": finish_calls,
            "sampler_cpu_per_s": sampler_cpu_s / window_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rounds", nargs="?", type=int, default=3)
    parser.add_argument("--live", action="store_true", help="read this machine's GPUs")
    parser.add_argument("--window", type=float, default=2.0, help="seconds between readings")
    args = parser.parse_args()
    environ = {k: v for k, v in os.environ.items() if k != REPLAY_ENV}
    if not args.live:
        environ[REPLAY_ENV] = str(RECORDING)
    rows = [one_round(environ, args.window, 0.5) for _ in range(args.rounds)]

    def med(key):
        return statistics.median(r[key] for r in rows)
    total = med("start_s") + med("finish_s") + med("judge_s")
    print(f"# health cost per node, {'live NVML' if args.live else 'replayed ' + RECORDING.name}"
          f", {rows[0]['gpus']} GPUs, {args.rounds} round(s), medians; budget {BUDGET_S:g} s")
    print(f"  start readings {med('start_s') * 1e3:8.1f} ms   ({rows[0]['snapshot_calls']} "
          "NVML calls: snapshot + event registration)")
    print(f"  end readings   {med('finish_s') * 1e3:8.1f} ms   ({rows[0]['finish_calls']} NVML "
          "calls: snapshot + one sample, sysfs, kernel log)")
    print(f"  judging        {med('judge_s') * 1e3:8.1f} ms")
    print(f"  sampler        {med('sampler_cpu_per_s') * 1e3:8.1f} ms of CPU per second of run "
          "(0.5 s period)")
    print(f"  health's own cost: {total:.3f} s per node = {total / BUDGET_S:.1%} of the budget "
          "(+ the sampler's share over the run)")
    if not args.live:  # arithmetic, not a measurement: what a GPU's per-call cost would add
        calls = rows[0]["snapshot_calls"] + rows[0]["finish_calls"]
        print("  on a GPU, NVML's own time adds " + ", ".join(
            f"{calls * c:.2f} s at {c * 1e3:g} ms per call" for c in (1e-4, 1e-3))
              + " (measure it: --live, or make gpu-check)")


if __name__ == "__main__":
    main()
