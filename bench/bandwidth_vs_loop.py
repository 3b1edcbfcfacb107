"""Benchmark: the bandwidth check's busbw at every size it measures, against an independent loop.

Not a test: it prints numbers. In one torchrun invocation it alternates, ``--rounds`` times,
(a) the bandwidth check's own sweep at a level (``ddp_smoke.checks.bandwidth``, run and judged
as the worker does it, with that level's sizes and iteration rules) and (b) a loop written here
from nccl-tests' definitions alone, over the same sizes: two warm-ups, then ``--loop-iters``
calls each after a barrier, ``perf_counter`` around the collective, busbw = S / t × factor,
GB = 1e9 B. The order flips every round (ABBA), so drift on a shared machine hits both alike.
Per size, rank 0 prints both medians and the median of the per-round ratios check / loop
(each round's pair ran back to back); a ratio outside 1 ± 5 % is marked. Each round also runs
the loop a second time: the median ratio of the two loop runs is the noise floor of this
comparison on this machine at this load (printed beside; on a busy two-core machine small
sizes vary by tens of percent from one loop run to the next). Load is printed.

    .venv/bin/torchrun --standalone --nproc-per-node=2 bench/bandwidth_vs_loop.py [--level quick]
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist

from ddp_smoke import config
from ddp_smoke.coordination import runtime
from ddp_smoke.checks import bandwidth
from ddp_smoke.config.faults import Injector
from ddp_smoke.checks.api import Context, Evidence

# Written out again on purpose (not imported from ddp_smoke.perf): an independent reference.
_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n}
TOLERANCE = 0.05


def independent_busbw_gbps(collective: str, size_bytes: int, iters: int) -> float:
    """Mean over ``iters`` barrier-separated calls, after two warm-ups; busbw in GB/s."""
    n = dist.get_world_size()
    if collective == "all_reduce":
        buf = torch.zeros(size_bytes // 4)
        call = lambda: dist.all_reduce(buf)  # noqa: E731
    else:
        out = torch.zeros(size_bytes // 4)
        inp = torch.zeros(size_bytes // 4 // n)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        call = lambda: gather(out, inp)  # noqa: E731
    for _ in range(2):
        call()
    total_s = 0.0
    for _ in range(iters):
        dist.barrier()
        t = time.perf_counter()
        call()
        total_s += time.perf_counter() - t
    mean_s = torch.tensor([total_s / iters], dtype=torch.float64)
    dist.all_reduce(mean_s)  # nccl-tests' default: the time averaged over ranks
    return size_bytes / (mean_s.item() / n) / 1e9 * _FACTOR[collective](n)


def check_rows(ctx: Context, cfg: dict) -> dict:
    """Run the check on every rank as the worker does; rank 0 judges. busbw by (coll, size)."""
    ctx.config = cfg
    obs = bandwidth.run(ctx)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obs)
    ranks = [{"rank": r, "host": socket.gethostname()} for r in range(len(gathered))]
    figures = bandwidth.judge(Evidence("bandwidth", gathered, ranks, cfg)).figures
    return {(r["collective"], r["size_bytes"]): r["busbw_gbps"] for r in figures["results"]}


def loop_rows(keys, iters: int) -> dict:
    return {(c, s): independent_busbw_gbps(c, s, iters) for c, s in keys}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--level", default="quick", choices=("quick", "standard", "long"))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--loop-iters", type=int, default=10)
    args = p.parse_args()
    dist.init_process_group("gloo")
    env = runtime.LaunchEnv.from_environ()
    ctx = Context(env, "gloo", torch.device("cpu"), {}, Injector([], env.rank), "", "")
    cfg = config.resolve({"level": args.level,
                          "bandwidth": {"collectives": list(_FACTOR)}}, {})
    load_before = os.getloadavg()[0]
    keys = list(check_rows(ctx, cfg))  # one untimed sweep: the sizes, and everything warm
    samples = {k: {"check": [], "loop": [], "again": []} for k in keys}
    sweep_s = []
    for i in range(args.rounds):
        for side in (("check", "loop", "again") if i % 2 == 0 else ("again", "loop", "check")):
            t = time.monotonic()
            got = check_rows(ctx, cfg) if side == "check" else loop_rows(keys, args.loop_iters)
            if side == "check":
                sweep_s.append(time.monotonic() - t)
            for k, v in got.items():
                samples[k][side].append(v)
    if env.rank == 0:
        print(f"# busbw: the bandwidth check at level {args.level} vs an independent loop; "
              f"{env.world_size} gloo ranks, {args.rounds} ABBA rounds, loop {args.loop_iters} "
              f"iterations; load (1 min) {load_before:.2f} before, {os.getloadavg()[0]:.2f} "
              f"after; GB = 1e9 B")
        print("# ratio: median over rounds of check / loop; noise: the same of a second loop "
              "run / loop, the machine's noise floor for this comparison")
        print(f"# {'collective':<12} {'size (B)':>10} {'check':>9} {'loop':>9} {'ratio':>7} "
              f"{'noise':>7}")
        print(f"# {'':<12} {'':>10} {'(GB/s)':>9} {'(GB/s)':>9} {'':>7} {'':>7}")
        worst = floor = 0.0
        for (c, s), v in samples.items():
            ratio = statistics.median(a / b for a, b in zip(v["check"], v["loop"]))
            noise = statistics.median(a / b for a, b in zip(v["again"], v["loop"]))
            worst, floor = max(worst, abs(ratio - 1)), max(floor, abs(noise - 1))
            flag = "" if abs(ratio - 1) <= TOLERANCE else "  outside ±5 %"
            print(f"  {c:<12} {s:>10} {statistics.median(v['check']):>9.4f} "
                  f"{statistics.median(v['loop']):>9.4f} {ratio:>7.3f} {noise:>7.3f}{flag}")
        largest = {c: s for c, s in keys}  # sizes ascend per collective
        big = [statistics.median(a / b for a, b in zip(samples[(c, s)]["check"],
                                                       samples[(c, s)]["loop"]))
               for c, s in largest.items()]
        print(f"busbw ratio (check / independent loop, medians): largest size "
              + ", ".join(f"{c} {r:.3f}" for c, r in zip(largest, big))
              + f"; worst |ratio - 1| over all sizes {100 * worst:.0f} % (target 5 %), "
              f"loop against itself {100 * floor:.0f} %; "
              f"check sweep {statistics.median(sweep_s):.2f} s (median)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
