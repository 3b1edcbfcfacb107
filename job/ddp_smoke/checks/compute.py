"""Compute: every rank's sustained dense matmul throughput; stragglers against the median; floors.

Each rank multiplies two random n×n matrices (``compute.matrix_size_gpu``, bf16 and TF32 by
default, ``dtypes_gpu``; ``matrix_size_cpu`` in fp32 on CPU), 2n³ FLOP per product: warm-up,
one timed product to size a block of about ``block_s`` seconds, then a fixed amount of work,
``blocks`` blocks of that many products, timed as a whole and block by block.

No collective runs inside: a rank that dies or freezes here is named from its heartbeat while
the others wait at the gather (the kit's failure tests rely on that). Ranks start together
(they all arrived at the check) and run the same number of blocks, so block k of each rank
runs at about the same time; blocks are compared across ranks one by one.

Figures per rank and dtype (1 TFLOPS = 1e12 FLOP/s; the human table shows GFLOPS on CPU):

* ``tflops_median`` — the median block: the rate the rank kept up for at least half the time
  (sustained, not peak; the figure the profile's floors judge);
* ``pace`` — the rank against the others: per block, its rate over the median rate of all
  ranks in that same block; the median of that over the blocks (1.0 = the ranks' median).
  A rank throttled for much of the run (a thermally throttled GPU, a power cap, a CPU quota)
  is behind in most blocks, even when its best block is fine;
* ``tflops_sustained`` — the whole fixed work over the time its blocks took;
* ``spread`` — (best block − worst block) / median block: how unsteady the rank was;
* ``tflops`` — the best block: what the device can do (peak);
* ``block_tflops`` — every block, in order.

Blocks are timed with CUDA events on a GPU. On CPU all but the best block are wall-clock (what
a job gets: a rank held to a fraction of a core by a quota takes longer), and the best block is
in this process's CPU seconds (what a core delivers while it runs).
On a GPU, also the device-to-device copy bandwidth of 1 GiB (``hbm``; bytes read + written,
GB = 1e9 B).

Culprits: every rank whose pace, and its median block against the ranks' median, are both
more than the straggler margin below 1 — ``straggler_margin``
on GPUs (10 %: healthy GPUs of one node differ by about 5 %); on CPU ``straggler_margin_cpu``
(30 %) when every host has a core per rank thread, else ``straggler_margin_cpu_shared`` (45 %).
Ranks that share cores (as many rank threads on a host as its usable cores or more, e.g. 2 or 4
ranks on 2 cores; OMP_NUM_THREADS=1 under torchrun) get the scheduler's share of a core, not a core.
Measured on this project's 2-core test machine (the 4-rank launch of
tests/worker/test_diagnosis_straggler.py, quick level, with one or two busy processes beside
it; the 16-rank launch of tests/worker/test_scale16.py):

* before the blocks were compared one by one (the median block against the ranks' median),
  a healthy rank's median block fell up to 50 % below the ranks' median (19 runs, one or two busy processes; 23, 28
  and 50 % at the worst, the last named with the 30 % margin): a rank that finishes early
  frees a core for the others' later blocks, and one beside a busy process keeps less;
* paces now, quick level with blocks of 0.02 s: healthy ranks 0.74–2.6 (16 runs with busy
  processes, 64 ranks; 0.82–1.10 over 16 ranks), and once 0.61 with the machine's load
  average at 7–9 (rank 0 kept half a core in all three blocks, the others a whole one); a rank
  held to 15 % of a core by a CPU quota 0.27–0.35 alone, 0.32–0.53 beside a busy process
  (8 runs), behind in every block. Blocks that short let the quota's bursts (15 ms of every
  100 ms) decide a block, so the quick level's blocks are now 0.05 s: healthy 0.86–1.15 (8
  runs beside a busy process, load average 5; 0.91–1.07 over 16 ranks), the quota 0.32–0.44
  (4 runs). Those figures were measured with every block started by a one-element
  all_reduce; that collective was taken out again (a rank dying or cut off inside compute
  then held the others in a collective: partition → report 107 s instead of 24 s), and with
  it the quota rank's pace was 0.18–0.28 and no healthy rank was named (3 + 3 attempts);
* once, 16 healthy ranks on 2 cores gave a rank a pace of 0.55 while its median block was
  above the ranks' median (4.8 against 4.6 GFLOPS): which of 16 ranks a block's turn on a
  core falls to is the scheduler's, so a rank is named only when its median block is behind
  too (the quota rank's median block: 22–34 % of the ranks' median).

Also ranks whose median block is below the profile's ``min_tflops`` floor, or whose device is
not the profile's, with the shortfall in percent.
"""
from __future__ import annotations

import statistics
import time

import torch

from ..config import profiles, rules
from ..model import FAIL, PASS, CheckResult, Culprit
from . import perf
from ._timing import Clock
from .api import pace_margin, usable_cores

_HBM_BYTES = 1 << 30  # 1 GiB: many times any GPU's L2 cache, so the copy streams from HBM
_HBM_REPEATS = 10


def run(ctx) -> dict:
    """Measure this rank's matmul throughput (and HBM copy bandwidth on a GPU)."""
    cfg = ctx.section("compute")
    profile = profiles.load(profiles.selected(ctx.config))
    clock = Clock(ctx.device, ctx.faults, cpu_time=True)
    if ctx.device.type == "cuda":
        n = cfg["matrix_size_gpu"]  # dtypes_gpu: names of rules.GPU_MATMUL_DTYPES (checked)
        matmul = {d: _matmul(n, getattr(torch, rules.GPU_MATMUL_DTYPES[d][0]),
                             rules.GPU_MATMUL_DTYPES[d][1], ctx, cfg, clock)
                  for d in cfg["dtypes_gpu"]}
        hbm = _hbm_gbps(ctx.device, clock) if cfg["hbm"] else None
        name = torch.cuda.get_device_name(ctx.device)
        torch.cuda.empty_cache()
    else:
        n = cfg["matrix_size_cpu"]
        matmul = {"fp32": _matmul(n, torch.float32, None, ctx, cfg, clock)}
        hbm, name = None, _cpu_name()
    return {"device_type": ctx.device.type, "device_name": name, "matrix_size": n,
            "threads": torch.get_num_threads(), "cores": usable_cores(),
            "matmul": matmul, "hbm_gbps": hbm, "profile": profile}


def _matmul(n: int, dtype, precision, ctx, cfg: dict, clock: Clock) -> dict:
    """A fixed amount of n×n×n products, timed as a whole and per block (see the module)."""
    previous = torch.get_float32_matmul_precision()
    if precision:
        torch.set_float32_matmul_precision(precision)
    try:
        gen = torch.Generator(device=ctx.device).manual_seed(ctx.rank)
        a = torch.randn(n, n, generator=gen, device=ctx.device, dtype=dtype)
        b = torch.randn(n, n, generator=gen, device=ctx.device, dtype=dtype)
        c = torch.empty_like(a)  # random data: zeros run measurably faster on some GPUs

        def product():
            torch.matmul(a, b, out=c)

        def block():
            for _ in range(per_block):
                product()

        for _ in range(2):
            product()  # warm-up: library handles, kernel selection, clocks
        # Sized in the clock's own seconds (CPU seconds on CPU), so a throttled rank is given
        # as much work as the others, and takes longer over it.
        per_block = max(1, round(cfg["block_s"] / clock.measure(product)))
        best, walls = [], []
        for _ in range(cfg["blocks"]):
            w = time.perf_counter()
            best.append(clock(block))
            # on a GPU the events time the device; on CPU the wall clock what the job got
            walls.append(best[-1] if clock.cuda else time.perf_counter() - w)
    finally:
        torch.set_float32_matmul_precision(previous)
    rates = [perf.matmul_tflops(n, per_block, s) for s in walls]
    median = statistics.median(rates)
    return {"tflops": perf.matmul_tflops(n, per_block, min(best)), "tflops_median": median,
            "tflops_sustained": perf.matmul_tflops(n, per_block * len(walls), sum(walls)),
            "spread": round((max(rates) - min(rates)) / median, 4) if median else None,
            "block_tflops": rates, "products_per_block": per_block, "blocks": len(walls)}


def _hbm_gbps(device, clock: Clock) -> float:
    """Device-to-device copy: bytes read plus bytes written per second, best of a few."""
    src = torch.ones(_HBM_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best_s = min(clock.measure(lambda: dst.copy_(src)) for _ in range(_HBM_REPEATS))
    return 2 * _HBM_BYTES / best_s / perf.GB


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name")), "cpu")
    except OSError:
        return "cpu"


# -- judging (rank 0, pure) ----------------------------------------------------------------

def judge(ev) -> CheckResult:
    obs, cfg = ev.observations, ev.section()
    profile, cpu = obs[0]["profile"], obs[0]["device_type"] == "cpu"
    margin, shared = pace_margin(ev, cpu)
    medians, paces, culprits = {}, {}, []
    for dtype in obs[0]["matmul"]:
        medians[dtype] = statistics.median(_sustained(o["matmul"][dtype]) for o in obs)
        paces[dtype], slow = perf.slow_paced(
            {r: o["matmul"][dtype]["block_tflops"] for r, o in enumerate(obs)}, margin)
        culprits += [ev.culprit(r, _slow_reason(dtype, obs[r]["matmul"][dtype], paces[dtype][r],
                                                medians[dtype], margin, shared, cpu))
                     for r in slow]
    culprits += _floors(ev, profile, cpu)
    ranks = [{"rank": r, "host": ev.host(r), "device_name": o["device_name"],
              "threads": o["threads"], "cores": o["cores"], "matmul": o["matmul"],
              "pace": {d: round(p[r], 4) for d, p in paces.items()}, "hbm_gbps": o["hbm_gbps"]}
             for r, o in enumerate(obs)]
    figures = {"legend": "n x n x n products, 2n^3 FLOP each, 1 TFLOPS = 1e12 FLOP/s, a "
                         "fixed amount of work in blocks (every rank the same number); "
                         "pace (judged against the straggler margin): per block, the rank's "
                         "rate over the ranks' median rate of that block, the median over the "
                         "blocks; tflops_median (judged against floors): the median block, the "
                         "rate kept up at least half the time; tflops_sustained: all the work "
                         "over the time its blocks took; spread: (best - worst block) / median "
                         "block; tflops: the best block (peak); on CPU all but the best block "
                         "are wall-clock; hbm_gbps: device copy, bytes read + written, "
                         "GB = 1e9 B",
               "profile": profile["name"], "matrix_size": obs[0]["matrix_size"],
               "straggler_margin": margin, "shared_cores": shared,
               "median_tflops": medians, "ranks": ranks,
               "floors": profile["compute"].get("min_tflops", {})}
    summary = "; ".join(f"{d} sustained median {_rate(m, cpu)} over {len(obs)} rank(s) (min "
                        f"{_rate(min(_sustained(o['matmul'][d]) for o in obs), cpu)})"
                        for d, m in medians.items())
    if culprits:
        summary = f"{len(culprits)} problem(s): {culprits[0].reason}"
    return CheckResult("compute", FAIL if culprits else PASS, summary=summary,
                       culprits=culprits, figures=figures, notes=_table(ranks, cpu, figures))


def _floors(ev, profile: dict, cpu: bool) -> list:
    out, want = [], profile["device_name"]
    floors = profile["compute"].get("min_tflops", {})
    names = sorted({o["device_name"] for o in ev.observations})
    if want and not any(want.lower() in n.lower() for n in names):
        # No rank has the profile's device: the profile does not fit this machine, and no
        # rank is at fault (one odd GPU out among the right ones is, below).
        return [Culprit(None, None, f"profile {profile['name']} does not fit this machine: "
                                    f"its devices are {', '.join(map(repr, names))}, not "
                                    f"{want!r}; choose the --profile of this hardware")]
    for r, o in enumerate(ev.observations):
        if want and want.lower() not in o["device_name"].lower():
            out.append(ev.culprit(r, f"device {o['device_name']!r} is not the profile "
                                     f"{profile['name']}'s {want!r}"))
        for dtype, floor in floors.items():
            got = o["matmul"].get(dtype)
            if got is not None and _sustained(got) < floor:
                out.append(ev.culprit(r, (
                    f"{dtype} matmul sustains {_rate(_sustained(got), cpu)} (median block), "
                    f"{perf.shortfall_pct(_sustained(got), floor):.1f} % below the "
                    f"{profile['name']} floor {_rate(floor, cpu)}")))
    return out


def _slow_reason(dtype: str, m: dict, pace: float, median: float, margin: float,
                 shared: list, cpu: bool) -> str:
    where = (f"; ranks share cores on {', '.join(map(str, shared[:4]))}"
             f"{' …' if len(shared) > 4 else ''}" if shared else "")
    return (f"{dtype} matmul kept {pace:.0%} of the other ranks' pace ({100 * (1 - pace):.1f} % "
            f"below, the median of its {m['blocks']} blocks each against the ranks' median "
            f"block of the same index; straggler margin {margin:.0%}{where}): sustains "
            f"{_rate(_sustained(m), cpu)} (median block; best {_rate(m['tflops'], cpu)}), the "
            f"ranks' median {_rate(median, cpu)}")


def _sustained(m: dict) -> float:
    """The judged figure of one rank and dtype: its median block."""
    return m["tflops_median"]


def _rate(tflops: float, cpu: bool) -> str:
    return f"{tflops * 1e3:.1f} GFLOPS" if cpu else f"{tflops:.1f} TFLOPS"


def _table(ranks: list[dict], cpu: bool, figures: dict) -> list[str]:
    dtypes = list(ranks[0]["matmul"])
    unit, scale = ("GFLOPS", 1e3) if cpu else ("TFLOPS", 1)
    lines = [f"# compute: {figures['matrix_size']}^3 matmul per rank, "
             f"{ranks[0]['matmul'][dtypes[0]]['blocks']} blocks; pace = "
             "median of the rank's blocks over the ranks' median block (judged, margin "
             f"{figures['straggler_margin']:.0%}); sustained = median block; spread = (best - "
             f"worst) / median; profile {figures['profile']}; GB = 1e9 B",
             f"# {'rank':>5} {'host':<20} {'threads':>7} " + " ".join(
                 f"{d + ' sustained/best (' + unit + ')':>30} {'spread':>6} {'pace':>5}"
                 for d in dtypes) + f" {'hbm (GB/s)':>11}  device"]
    for r in ranks:
        rates = " ".join(f"{m['tflops_median'] * scale:>20.1f}/{m['tflops'] * scale:<9.1f} "
                         f"{_pct(m.get('spread')):>6} {_pct(r['pace'].get(d)):>5}"
                         for d, m in ((d, r["matmul"][d]) for d in dtypes))
        hbm = f"{r['hbm_gbps']:.0f}" if r["hbm_gbps"] else "-"
        lines.append(f"  {r['rank']:>5} {str(r['host']):<20} {r['threads']:>7} {rates} "
                     f"{hbm:>11}  {r['device_name']}")
    return lines


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"
