"""Bandwidth of collectives by message size, with nccl-tests' algbw and busbw; slow node pairs.

Sweep: for each collective (``bandwidth.collectives``: all_reduce, all_gather; optionally
reduce_scatter, broadcast, all_to_all) and each size from ``min_bytes`` to ``max_bytes_cpu`` /
``max_bytes_gpu`` (× ``step_factor``), every rank first runs the collective once on known data
and counts wrong elements (which also warms the size up), then ``warmup_iters`` untimed runs,
then timed ones, each after a barrier (synchronised per iteration like all_reduce_bench); CUDA
events time a GPU. Timed iterations: as many as fit ``time_per_size_s`` at the slowest rank's
untimed run (its slowest warm-up, else the checked run), within ``min_iters`` … ``iters``; fixed
before the first timed call, and agreed across ranks. ``level`` (``ddp_smoke.config.levels``) sets
these.
Per size, as nccl-tests (its JSON name in brackets): size_bytes [size], count, type,
time_us [time] = mean over ranks of each rank's mean (+ time_us_min/max across ranks),
algbw_gbps [alg_bw] = S / time, busbw_gbps [bus_bw] = algbw × factor, nwrong; GB = 1e9 B.
Definitions: ``ddp_smoke.checks.perf``. A profile (``--profile``) may set busbw floors; the sweep then
reaches their sizes, and a run below a floor fails, saying by how much.

Pairs (multi-node): the first rank of each node (its leader) exchanges ``pair_bytes_*`` with
one leader of another node per round (sendrecv, busbw = algbw), ``pair_rounds`` rounds of a
round-robin; then each suspect (a node in a slow pair) meets a known-good node. Culprit: a node
slow with every partner, two known-good ones among them; a link whose two nodes are fast with
everyone else; else both ends, unresolved. Skipped, with the reason in the figures, when all
ranks share one node. Rails: when a node's ranks send on two or more network devices, the
pairs are measured inside every rail (the ranks of one local rank), the rails at once, and a
slow or dead rail is named as that node's rail, a rail slow everywhere as the rail
(:mod:`ddp_smoke.checks._pairs`, :mod:`ddp_smoke.checks._rail_blame`).
Culprits: the source rank of wrong all_gather / all_to_all data; slow nodes and links; slow or
dead rails.
"""
from __future__ import annotations

import socket
import statistics
import time
import zlib

import torch
import torch.distributed as dist

from ..config import profiles
from ..coordination import progress
from ..model import FAIL, PASS, CheckResult
from . import _pairs, _rails, perf
from ._timing import Clock



def run(ctx) -> dict:
    """Sweep the sizes, then test node pairs; return this rank's timings."""
    cfg = ctx.section("bandwidth")
    profile = profiles.load(profiles.selected(ctx.config))
    clock = Clock(ctx.device, ctx.faults)
    nodes = _node_of_each_rank(ctx)
    t = time.monotonic()
    rows = _sweep(ctx, cfg, _sizes(ctx, cfg, profile, max(nodes) + 1), clock)
    sweep_s, t = time.monotonic() - t, time.monotonic()
    rail = _rails.mine(ctx)  # after the sweep: NCCL's network channels exist by now
    rails = _rail_layout(ctx, nodes, rail) if max(nodes) else None
    pairs = _pairs.measure(ctx, cfg, nodes, rails, clock)
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()  # give the next check the memory of the largest buffers
        rail = _rails.mine(ctx)  # the pairs' own channels name a NIC the sweep left unnamed
    return {"rows": rows, "pairs": pairs, "nodes": max(nodes) + 1, "profile": profile,
            "sweep_s": sweep_s, "pairs_s": time.monotonic() - t, "rail": rail}




def _sizes(ctx, cfg: dict, profile: dict, nodes: int) -> list[int]:
    top = cfg["max_bytes_gpu" if ctx.device.type == "cuda" else "max_bytes_cpu"]
    extra = profiles.floor_sizes(profile, cfg["collectives"], ctx.world_size, nodes)
    return perf.sweep_sizes(cfg["min_bytes"], top, cfg["step_factor"], extra)


def _node_of_each_rank(ctx) -> list[int]:
    """Node index of every rank, numbered by first rank: same host and same agent = one node."""
    host = zlib.crc32(socket.gethostname().encode())
    key = torch.tensor([ctx.env.group_rank, host], dtype=torch.int64, device=ctx.device)
    out = torch.empty(2 * ctx.world_size, dtype=torch.int64, device=ctx.device)
    progress.all_gather_into(out, key)
    index: dict = {}
    return [index.setdefault(tuple(k), len(index)) for k in out.view(-1, 2).tolist()]


def _rail_layout(ctx, nodes: list[int], rail: dict) -> list[dict] | None:
    """Every rank's local rank, device and dead flag, gathered: the rails to measure, if any."""
    device = zlib.crc32(rail["device"].encode()) if rail.get("device") else 0
    key = torch.tensor([ctx.local_rank, device, bool(rail.get("dead"))], dtype=torch.int64,
                       device=ctx.device)
    out = torch.empty(3 * ctx.world_size, dtype=torch.int64, device=ctx.device)
    progress.all_gather_into(out, key)
    local, devices, dead = zip(*out.view(-1, 3).tolist())
    return _pairs.layout(nodes, list(local), list(devices), list(dead))


# -- the sweep ------------------------------------------------------------------------------

def _sweep(ctx, cfg: dict, sizes: list[int], clock: Clock) -> list[dict]:
    dtype = getattr(torch, cfg["dtype"])
    warm = torch.ones(1, device=ctx.device)
    progress.all_reduce(warm)  # the first collective sets up connections: keep it out of the sweep
    progress.barrier()
    typesize = torch.empty(0, dtype=dtype).element_size()
    rows = []
    for collective in cfg["collectives"]:
        shapes = [perf.layout(collective, size, ctx.world_size, typesize) for size in sizes]
        shapes = [(count, size_bytes) for count, size_bytes in shapes if count]
        # One allocation per collective, sliced per size: allocating (and first touching)
        # fresh buffers at every size costs more than the smaller sizes' collectives.
        lengths = _lengths(collective, max(c for c, _ in shapes), ctx.world_size)
        pool = [None if n is None else torch.zeros(n, dtype=dtype, device=ctx.device)
                for n in lengths]
        for count, size_bytes in shapes:
            rows.append(_measure(ctx, cfg, collective, size_bytes, count, pool, clock))
        del pool
    return rows


def _measure(ctx, cfg: dict, collective: str, size_bytes: int, count: int, pool,
             clock: Clock) -> dict:
    in_len, out_len = _lengths(collective, count, ctx.world_size)
    inp = pool[0][:in_len]
    out = inp if out_len is None else pool[1][:out_len]
    op = _operation(collective, inp, out)

    def once() -> float:
        progress.barrier()  # every iteration starts together, as in all_reduce_bench
        return clock(op)

    # The first run is on known data and checked; it also warms this size up (buffers,
    # connections), so that a quick sweep needs no separate warm-up.
    nwrong, sources, first_s = _verify(ctx, collective, inp, out, op, clock)
    warm = [once() for _ in range(cfg["warmup_iters"])]
    warm_s = max(warm) if warm else first_s
    agreed = torch.tensor([warm_s], dtype=torch.float64, device=ctx.device)
    progress.all_reduce(agreed, op=dist.ReduceOp.MAX)  # one iteration count on every rank
    iters = perf.timed_iterations(agreed.item(), cfg["time_per_size_s"], cfg["min_iters"],
                                  cfg["iters"])
    times = [once() for _ in range(iters)]
    return {"collective": collective, "size_bytes": size_bytes, "count": count,
            "type": cfg["dtype"],
            "redop": "sum" if collective in ("all_reduce", "reduce_scatter") else "none",
            "root": 0 if collective == "broadcast" else -1, "iterations": iters,
            "time_us": statistics.fmean(times) * 1e6, "nwrong": nwrong, "wrong_from": sources}


def _lengths(collective: str, count: int, n: int) -> tuple[int, int | None]:
    """Elements of input and output (None: in place); count is per rank for the
    whole-array collectives, as ``perf.layout`` returns it."""
    return {"all_reduce": (count, None), "broadcast": (count, None),
            "all_gather": (count, count * n), "reduce_scatter": (count * n, count),
            "all_to_all": (count * n, count * n)}[collective]


def _operation(collective: str, inp, out):
    return {"all_reduce": lambda: progress.all_reduce(inp),
            "broadcast": lambda: progress.broadcast(inp, 0),
            "all_gather": lambda: progress.all_gather_into(out, inp),
            "reduce_scatter": lambda: progress.reduce_scatter_into(out, inp),
            "all_to_all": lambda: progress.all_to_all_single(out, inp)}[collective]


def _verify(ctx, collective: str, inp, out, op, clock: Clock) -> tuple[int, list[int], float]:
    """Run once on data whose answer is known; count wrong elements, name their sources, and
    return the run's seconds too (it sizes the timed iterations when there is no warm-up).

    Rank r contributes r + 1 everywhere (small integers: exact in float32), so a sum is
    n(n + 1)/2, a broadcast from rank 0 is 1, and the chunk gathered from rank j is j + 1.
    """
    n, rank = ctx.world_size, ctx.rank
    inp.fill_(rank + 1)
    ctx.faults.corrupt(inp)  # a `corrupt` rank's contribution is wrong by one element
    progress.barrier()
    first_s = clock.measure(op)
    if collective in ("all_gather", "all_to_all"):
        expected = torch.arange(1, n + 1, device=out.device, dtype=out.dtype).view(n, 1)
        wrong = _mismatches(out.view(n, -1), expected, n).sum(dim=1)
        found = int(wrong.sum()), [j for j, w in enumerate(wrong.tolist()) if w]
    else:
        expected = 1.0 if collective == "broadcast" else n * (n + 1) / 2
        found = int(_mismatches(out, expected, n).sum()), []
    inp.zero_()  # the timed runs are in place on this buffer: keep its sums from growing
    return (*found, first_s)


def _mismatches(got, expected, n: int):
    """Elementwise "wrong": exact in float32 (one pass, no temporaries), else beyond the
    rounding a 16-bit sum of n terms may pick up."""
    if got.dtype == torch.float32:
        return got.ne(expected)
    return (got - expected).abs().gt(torch.finfo(got.dtype).eps * n * expected)


# -- judging (rank 0, pure) ----------------------------------------------------------------

def judge(ev) -> CheckResult:
    obs, cfg, profile = ev.observations, ev.section(), ev.observations[0]["profile"]
    rows = _merge(obs, ev.world_size)
    floors, floor_culprits = _floors(ev, profile, rows, obs[0]["nodes"])
    pairs, pair_culprits = _pairs.figures_and_culprits(ev, cfg)
    culprits = _wrong(ev, rows) + floor_culprits + pair_culprits
    culprits += _collapsed(ev, rows, pairs) if not pair_culprits else []
    avg = {c: statistics.fmean(r["busbw_gbps"] for r in rows if r["collective"] == c)
           for c in dict.fromkeys(r["collective"] for r in rows)}
    figures = {"legend": LEGEND, "profile": profile["name"], "world_size": ev.world_size,
               "results": rows, "avg_busbw_gbps": avg, "floors": floors, "pairs": pairs,
               "sweep_s": max(o["sweep_s"] for o in obs),
               "pairs_s": max(o["pairs_s"] for o in obs)}
    largest = {r["collective"]: r for r in rows}  # rows ascend in size per collective
    summary = ", ".join(f"{c} {r['busbw_gbps']:.3g} GB/s busbw at {_human(r['size_bytes'])}"
                        for c, r in largest.items())
    if ev.world_size == 1:
        summary += " (1 rank: nothing crosses a link, busbw is 0 by definition)"
    if culprits:
        summary = f"{len(culprits)} problem(s): {culprits[0].reason}"
    return CheckResult("bandwidth", FAIL if culprits else PASS, summary=summary,
                       culprits=culprits, figures=figures,
                       notes=_table(rows, ev.world_size, avg, figures))


LEGEND = ("size_bytes: S as nccl-tests counts it (the whole array for all_gather, "
          "reduce_scatter, all_to_all; count is then per rank); time_us: mean over ranks of "
          "each rank's mean iteration (min/max across ranks); algbw_gbps = S / time; "
          "busbw_gbps = algbw x factor (all_reduce 2(n-1)/n; all_gather, reduce_scatter, "
          "all_to_all (n-1)/n; broadcast, sendrecv 1); GB = 1e9 B")


def _merge(obs: list[dict], n: int) -> list[dict]:
    """One row per (collective, size) across ranks: every rank swept the same list."""
    merged = []
    for i, row in enumerate(obs[0]["rows"]):
        times = [o["rows"][i]["time_us"] for o in obs]
        t_us = statistics.fmean(times)
        kind, size = row["collective"], row["size_bytes"]
        merged.append({**{k: row[k] for k in ("collective", "size_bytes", "count", "type",
                                              "redop", "root", "iterations")},
                       "time_us": t_us, "time_us_min": min(times), "time_us_max": max(times),
                       "slowest_rank": times.index(max(times)),
                       "algbw_gbps": perf.algbw_gbps(size, t_us / 1e6),
                       "busbw_gbps": perf.busbw_gbps(kind, size, t_us / 1e6, n),
                       "nwrong": sum(o["rows"][i]["nwrong"] for o in obs),
                       "wrong_from": sorted({j for o in obs for j in o["rows"][i]["wrong_from"]})})
    return merged


def _wrong(ev, rows: list[dict]) -> list:
    by_source: dict = {}
    reduced = [r for r in rows if r["nwrong"] and not r["wrong_from"]]
    for r in rows:
        for j in r["wrong_from"]:
            by_source.setdefault(j, []).append(f"{r['collective']}@{_human(r['size_bytes'])}")
    out = [ev.culprit(j, f"data from this rank arrived wrong in {len(w)} run(s): "
                         f"{', '.join(w[:4])}{' …' if len(w) > 4 else ''}")
           for j, w in sorted(by_source.items())]
    if reduced:
        first = f"{reduced[0]['collective']}@{_human(reduced[0]['size_bytes'])}"
        out.append(ev.culprit(None, f"{sum(r['nwrong'] for r in reduced)} wrong element(s) in "
                                    f"{len(reduced)} reduced run(s) (first: {first}); a sum "
                                    "hides its contributor: run the collectives check"))
    return out


def _collapsed(ev, rows: list[dict], pairs: dict) -> list:
    """Every node pair fine alone, yet the all-rank sweep collapsed: its largest all_reduce, at
    least the pairs' size, below ``links.collapse_share`` of the pairs' reference busbw (a
    ring's busbw is about one link's bandwidth). Nothing measured names a link (a port that flapped between the pair
    rounds, congestion only all ranks together make): the run fails with the evidence rather
    than pass. Retransmitting links, the other evidence, are named beside it by the harness."""
    ref, share = pairs.get("reference_busbw_gbps"), ev.section("links")["collapse_share"]
    top = next((r for r in reversed(rows) if r["collective"] == "all_reduce"), None)
    if not ref or top is None or top["size_bytes"] < pairs["size_bytes"] \
            or top["busbw_gbps"] >= share * ref:
        return []  # (a smaller size is bound by latency, not by the links' bandwidth)
    return [ev.culprit(None, (
        f"all_reduce at {_human(top['size_bytes'])} reached {top['busbw_gbps']:.3g} GB/s busbw, "
        f"{100 * top['busbw_gbps'] / ref:.0f} % of the node pairs' {ref:.3g} GB/s (under "
        f"{100 * share:.0f} %): every pair is fine alone and no link's retransmissions or "
        "round trips name one; a port that flaps between the pair rounds and congestion only "
        "all ranks together make cannot be told apart here (--repeat measures again)"))]


def _floors(ev, profile: dict, rows: list[dict], nodes: int) -> tuple[dict, list]:
    floors, reason = profiles.bandwidth_floors(profile, ev.world_size, nodes)
    if reason:
        # A profile that gates bandwidth but has no floor for this shape: no data, no pass.
        missing = [ev.culprit(None, f"{reason}: no floor to judge this run by; add a "
                                    "multi_node (or matching) section to a profile file, or "
                                    "run without --profile")]
        return {"applied": False, "reason": reason}, missing if profiles.has_floors(profile) else []
    results, culprits = [], []
    for f in floors:
        row = next((r for r in rows if (r["collective"], r["size_bytes"]) ==
                    (f["collective"], f["size_bytes"])), None)
        got = row["busbw_gbps"] if row else None
        ok = got is not None and got >= f["min_busbw_gbps"]
        results.append({**f, "busbw_gbps": got, "ok": ok})
        where = f"{f['collective']} busbw at {_human(f['size_bytes'])}"
        if got is None:
            culprits.append(ev.culprit(None, f"{where}: not measured (is {f['collective']} in "
                                             "bandwidth.collectives?)"))
        elif not ok:
            culprits.append(ev.culprit(None, (
                f"{where} is {got:.1f} GB/s, {perf.shortfall_pct(got, f['min_busbw_gbps']):.1f} % "
                f"below the {profile['name']} floor {f['min_busbw_gbps']:.1f} GB/s")))
    return {"applied": True, "results": results}, culprits


def _table(rows: list[dict], n: int, avg: dict, figures: dict) -> list[str]:
    """nccl-tests' table: a header with units, one line per size, the average busbw."""
    lines = [f"# bandwidth: {n} rank(s), profile {figures['profile']}; GB = 1e9 B; busbw as "
             "nccl-tests (github.com/NVIDIA/nccl-tests, doc/PERFORMANCE.md)",
             f"# {'collective':<14} {'size':>12} {'count':>11} {'type':>8} {'time':>10} "
             f"{'min':>10} {'max':>10} {'algbw':>8} {'busbw':>8} {'#wrong':>6}",
             f"# {'':<14} {'(B)':>12} {'(elements)':>11} {'':>8} {'(us)':>10} {'(us)':>10} "
             f"{'(us)':>10} {'(GB/s)':>8} {'(GB/s)':>8} {'':>6}"]
    lines += [f"  {r['collective']:<14} {r['size_bytes']:>12} {r['count']:>11} {r['type']:>8} "
              f"{r['time_us']:>10.1f} {r['time_us_min']:>10.1f} {r['time_us_max']:>10.1f} "
              f"{r['algbw_gbps']:>8.3f} {r['busbw_gbps']:>8.3f} {r['nwrong']:>6}" for r in rows]
    lines += [f"# Avg bus bandwidth : {c} {v:.3f} GB/s" for c, v in avg.items()]
    pairs = figures["pairs"]
    on = f" on {len(pairs['rails'])} rails at once" if pairs.get("rails") else ""
    lines.append(f"# pairs: skipped: {pairs['skipped']}" if "skipped" in pairs else
                 f"# pairs: {len(pairs['results'])} measured among {pairs['nodes']} nodes{on}, "
                 f"reference {pairs['reference_busbw_gbps']:.2f} GB/s")
    return lines


def _human(size_bytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size_bytes >= scale and size_bytes % scale == 0:
            return f"{size_bytes // scale} {unit}"
    return f"{size_bytes} B"
