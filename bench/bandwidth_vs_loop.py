"""Benchmark: the bandwidth check's busbw at one size against an independent timing loop.

Not a test: it prints numbers. In one torchrun invocation it alternates, ``--rounds`` times,
(a) the bandwidth check's own measurement (``ddp_smoke.checks.bandwidth``, run and judged as
the worker does, sweep limited to ``--size-bytes``) and (b) a loop written here from nccl-tests'
definitions alone: barrier, ``perf_counter``, the collective; busbw = S / t × factor, GB = 1e9 B.
Alternating puts both under the same load on a shared machine. Then it times the check's
default sweep once. Rank 0 prints medians, the ratio check / loop, and the sweep's time.

    .venv/bin/torchrun --standalone --nproc-per-node=2 bench/bandwidth_vs_loop.py
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist

from ddp_smoke import config, runtime
from ddp_smoke.checks import bandwidth
from ddp_smoke.faults import Injector
from ddp_smoke.harness import Context, Evidence

# Written out again on purpose (not imported from ddp_smoke.perf): an independent reference.
_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n}


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


def check_figures(ctx: Context, cfg: dict) -> dict:
    """Run the check on every rank as the worker does; rank 0 judges. Figures on rank 0."""
    ctx.config = cfg
    obs = bandwidth.run(ctx)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obs)
    ranks = [{"rank": r, "host": socket.gethostname()} for r in range(len(gathered))]
    return bandwidth.judge(Evidence("bandwidth", gathered, ranks, cfg)).figures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-bytes", type=int, default=64 << 20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--loop-iters", type=int, default=5)
    args = p.parse_args()
    dist.init_process_group("gloo")
    env = runtime.LaunchEnv.from_environ()
    ctx = Context(env, "gloo", torch.device("cpu"), {}, Injector([], env.rank), "", "")
    one_size = config.resolve({"bandwidth": {"min_bytes": args.size_bytes,
                                             "max_bytes_cpu": args.size_bytes}}, {})
    samples = {c: {"check": [], "loop": []} for c in _FACTOR}
    for _ in range(args.rounds):
        figures = check_figures(ctx, one_size)
        for c in _FACTOR:
            row = next(r for r in figures["results"] if r["collective"] == c)
            samples[c]["check"].append(row["busbw_gbps"])
            samples[c]["loop"].append(independent_busbw_gbps(c, args.size_bytes, args.loop_iters))
    t = time.monotonic()
    sweep = check_figures(ctx, config.resolve({}, {}))
    sweep_wall_s = time.monotonic() - t
    if env.rank == 0:
        out = {"world_size": env.world_size, "size_bytes": args.size_bytes,
               "load_avg_1min": os.getloadavg()[0]}
        for c, s in samples.items():
            check, loop = statistics.median(s["check"]), statistics.median(s["loop"])
            out[c] = {"check_busbw_gbps": check, "loop_busbw_gbps": loop,
                      "ratio_check_over_loop": check / loop, "samples": s}
        out["default_sweep"] = {"sizes": len(sweep["results"]), "sweep_s": sweep["sweep_s"],
                                "wall_s_with_judge": sweep_wall_s}
        print(json.dumps(out, indent=2), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
