"""Collectives give exact, known answers; a wrong element is traced to the rank that sent it.

Ops: all_reduce (sum, max), all_gather, reduce_scatter, broadcast from the last rank (a
non-zero root), all_to_all, a send/recv ring (rank r → r+1) and a barrier. Each runs per dtype
(``dtypes``, plus ``cuda_dtypes`` on GPUs) and per size (``sizes_bytes``: the whole array as
nccl-tests counts it; the largest crosses NCCL's 4 MiB buffer and gloo's chunking).

Data: rank r's contribution is a counter-based hash of (seed, case, r, element index), reduced
to small integers, so every rank computes every other rank's contribution (and so every exact
answer) locally, and sums stay exact in every dtype (bfloat16 holds integers up to 256: with
many ranks each element draws from fewer of them). Each rank checks its own contribution as
handed to the backend, then its output, block by block for the ops whose blocks each come from
one known rank (all_gather, all_to_all, broadcast, send/recv).
Culprit: the rank whose contribution was wrong (self-check, or its block wrong on two or more
receivers); a single receiver that alone got wrong data; no single rank when every input was
right and a reduction still came out wrong everywhere.
Skips: an op the backend does not support is skipped per op with the backend's reason in
figures (torch 2.13's gloo supports all of them on CPU, bfloat16 and float16 included).
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import rules
from ..coordination import progress
from ..model import FAIL, PASS, SKIP, CheckResult

OPS = ("all_reduce_sum", "all_reduce_max", "all_gather", "reduce_scatter", "broadcast",
       "all_to_all", "send_recv")
_MAX_VALUE = 2**20      # values stay readable in the report, whatever the dtype allows
_MASK31 = 2**31 - 1     # hash lanes: products of two 31-bit values stay inside int64
_MIX = (0x9E3779B1 & _MASK31, 48_271, 69_621)  # odd multipliers of the data hash
_UNSUPPORTED = ("not supported", "unsupported", "does not support", "not implemented")
_SENTINEL = -1          # what receive buffers hold before the op: never a valid value


@dataclass(frozen=True)
class Case:
    """One (op, dtype, size) run; ``count`` elements in all, ``block`` per rank-block."""

    index: int
    op: str
    dtype: str
    size_bytes: int
    count: int
    block: int


def plan(dtypes: list[str], sizes_bytes: list[int], world: int) -> list[Case]:
    """Every (op, dtype, size) case; counts are whole multiples of the world size."""
    cases = []
    for dtype in dtypes:
        itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
        for size in sizes_bytes:
            block = max(1, size // itemsize // world)
            for op in OPS:
                cases.append(Case(len(cases), op, dtype, size, block * world, block))
    return cases


def values(seed: int, case: Case, rank: int, world: int, start: int, count: int,
           device="cpu") -> torch.Tensor:
    """Rank ``rank``'s contribution to ``case`` at elements ``start..start+count-1``."""
    limit = rules.COLLECTIVE_DTYPES[case.dtype] // 2  # half: room for a corrupted +1 and the sum
    cap = max(1, min(_MAX_VALUE, limit // world))
    high = (1 << ((cap + 1).bit_length() - 1)) - 1  # the largest 2**k - 1 <= cap: a mask
    stride = -(-world // limit) if world > limit else 1  # ≤ limit ranks feed each element
    i = torch.arange(start, start + count, dtype=torch.int64, device=device)
    key = ((seed * 1_000_003 + case.index * 10_007 + rank * 101 + 1) * _MIX[0]) & _MASK31
    # Multiply-xorshift on 31-bit lanes: masks instead of modulo, which on a CPU made data
    # generation most of this check's time; every product stays below 2**62 (no overflow).
    h = i * _MIX[1]
    h.add_(key).bitwise_and_(_MASK31)
    h.bitwise_xor_(h >> 15).mul_(_MIX[2]).bitwise_and_(_MASK31)
    v = h.bitwise_xor_(h >> 13).bitwise_and_(high)  # high + 1 is a power of two
    if stride > 1:
        v = v * ((i + rank) % stride == 0)
    return v.to(getattr(torch, case.dtype))


def _first_wrong(got: torch.Tensor, want: torch.Tensor, offset: int = 0) -> dict | None:
    bad = (got != want).nonzero()
    if not len(bad):
        return None
    i = int(bad[0, 0])
    return {"index": offset + i, "got": got[i].item(), "expected": want[i].item(),
            "count": len(bad)}


class _Runner:
    """Runs one case on this rank: contribution, the collective, the comparison."""

    def __init__(self, ctx, seed: int):
        self.ctx, self.seed = ctx, seed
        self.me, self.world, self.device = ctx.rank, ctx.world_size, ctx.device

    def gen(self, case, rank, start, count):
        return values(self.seed, case, rank, self.world, start, count, self.device)

    def contribute(self, case, start, count):
        """This rank's input as handed to the backend, and whether it differs from the plan."""
        want = self.gen(case, self.me, start, count)
        x = self.ctx.faults.corrupt(want.clone())
        return x, _first_wrong(x, want)

    def empty(self, case, count):
        return torch.full((count,), _SENTINEL, dtype=getattr(torch, case.dtype),
                          device=self.device)

    def total(self, case, start, count, reduce):
        """The exact reduction of every rank's contribution, one rank at a time (O(count))."""
        acc = self.gen(case, 0, start, count)
        for r in range(1, self.world):
            acc = reduce(acc, self.gen(case, r, start, count))
        return acc


@dataclass
class _Plan:
    """One case ready to run: what this rank sent, where the answer lands, the call, the
    exact answer, and ``sources`` — ``[(rank, start, stop)]`` when each output block comes
    from one known rank, else None (a reduction)."""

    sent_wrong: dict | None
    out: torch.Tensor
    call: object
    want: torch.Tensor
    sources: list[tuple[int, int, int]] | None = None


def _all_reduce(run: _Runner, case: Case) -> _Plan:
    x, sent = run.contribute(case, 0, case.count)
    is_sum = case.op == "all_reduce_sum"
    red = dist.ReduceOp.SUM if is_sum else dist.ReduceOp.MAX
    want = run.total(case, 0, case.count, torch.add if is_sum else torch.maximum)
    return _Plan(sent, x, lambda: progress.all_reduce(x, op=red), want)


def _all_gather(run: _Runner, case: Case) -> _Plan:
    b = case.block
    x, sent = run.contribute(case, 0, b)
    out = run.empty(case, case.count)
    want = torch.cat([run.gen(case, r, 0, b) for r in range(run.world)])
    return _Plan(sent, out, lambda: progress.all_gather_into(out, x), want,
                 [(r, r * b, r * b + b) for r in range(run.world)])


def _reduce_scatter(run: _Runner, case: Case) -> _Plan:
    b = case.block
    x, sent = run.contribute(case, 0, case.count)
    out = run.empty(case, b)
    return _Plan(sent, out, lambda: progress.reduce_scatter_into(out, x), run.total(case, run.me * b, b, torch.add))


def _broadcast(run: _Runner, case: Case) -> _Plan:
    root, n = run.world - 1, case.count  # the last rank: a root other than 0 when world > 1
    x, sent = run.contribute(case, 0, n) if run.me == root else (run.empty(case, n), None)
    return _Plan(sent, x, lambda: progress.broadcast(x, src=root), run.gen(case, root, 0, n),
                 [(root, 0, n)])


def _all_to_all(run: _Runner, case: Case) -> _Plan:
    b = case.block
    x, sent = run.contribute(case, 0, case.count)
    out = run.empty(case, case.count)
    want = torch.cat([run.gen(case, r, run.me * b, b) for r in range(run.world)])
    return _Plan(sent, out, lambda: progress.all_to_all_single(out, x), want,
                 [(r, r * b, r * b + b) for r in range(run.world)])


def _send_recv(run: _Runner, case: Case) -> _Plan:
    n, right, left = case.count, (run.me + 1) % run.world, (run.me - 1) % run.world
    x, sent = run.contribute(case, 0, n)
    out = run.empty(case, n)

    def ring():
        progress.sendrecv(x, out, right, left)
    return _Plan(sent, out, ring, run.gen(case, left, 0, n), [(left, 0, n)])


_PREPARE = {"all_reduce_sum": _all_reduce, "all_reduce_max": _all_reduce,
            "all_gather": _all_gather, "reduce_scatter": _reduce_scatter,
            "broadcast": _broadcast, "all_to_all": _all_to_all, "send_recv": _send_recv}


def _run_case(run: _Runner, case: Case) -> dict:
    row = {"case": case.index, "time_s": 0.0, "skip": None, "sent_wrong": None, "wrong": []}
    if case.op == "send_recv" and run.world == 1:
        return {**row, "skip": "send/recv needs 2 or more ranks"}
    p = _PREPARE[case.op](run, case)
    t = time.perf_counter()
    try:
        p.call()
    except (RuntimeError, NotImplementedError, ValueError) as e:
        # Raised before any byte moves, the same on every rank: skipping keeps ranks in step.
        if not any(m in str(e).lower() for m in _UNSUPPORTED):
            raise
        return {**row, "skip": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)
    row["time_s"] = round(time.perf_counter() - t, 6)
    row["sent_wrong"] = p.sent_wrong
    for src, start, stop in p.sources or [(None, 0, len(p.want))]:
        found = _first_wrong(p.out[start:stop], p.want[start:stop], start)
        if found:
            row["wrong"].append({"source": src, **found})
    return row


def _dtypes(ctx, opts) -> list[str]:
    names = list(opts["dtypes"]) + (list(opts["cuda_dtypes"]) if ctx.device.type == "cuda"
                                    else [])
    return list(dict.fromkeys(names))




def run(ctx) -> dict:
    """Run every case on this rank; return per-case timings and what came out wrong."""
    opts = ctx.section("collectives")
    cases = plan(_dtypes(ctx, opts), opts["sizes_bytes"], ctx.world_size)
    runner = _Runner(ctx, opts["seed"])
    rows = [_run_case(runner, case) for case in cases]
    t = time.perf_counter()
    progress.barrier()
    return {"cases": [c.__dict__ for c in cases], "rows": rows,
            "barrier_s": round(time.perf_counter() - t, 6)}


def blame(case: dict, rows: list[dict]) -> list[tuple[int | None, str]]:
    """(rank or None, reason) for one case, from every rank's row of it."""
    label = f"{case['op']} {case['dtype']} {case['size_bytes']} B"
    world, out = len(rows), {}
    for r, row in enumerate(rows):
        if row["sent_wrong"]:
            out[r] = f"{label}: its contribution was wrong {_where(row['sent_wrong'])}"
    by_source = collections.defaultdict(list)
    for q, row in enumerate(rows):
        for w in row["wrong"]:
            by_source[w["source"]].append((q, w))
    for src, seen in by_source.items():
        if src is None or src in out:
            continue
        receivers = [q for q, _ in seen]
        possible = 1 if case["op"] == "send_recv" else world
        if len(receivers) >= 2 or len(receivers) == possible:
            out[src] = (f"{label}: its data arrived wrong at rank(s) {receivers} "
                        f"{_where(seen[0][1])}")
        else:
            out[receivers[0]] = (f"{label}: received wrong data from rank {src} "
                                 f"{_where(seen[0][1])} (the other receivers got it right)")
    reduced = by_source.get(None, [])
    if reduced and not any(row["sent_wrong"] for row in rows):
        receivers = [q for q, _ in reduced]
        if 2 * len(receivers) < world:
            out.update({q: f"{label}: its result was wrong {_where(w)} while every "
                           "contribution was right" for q, w in reduced})
        else:
            out[None] = (f"{label}: result wrong on rank(s) {receivers} {_where(reduced[0][1])} "
                         "while every contribution was right (the backend's reduction?)")
    return list(out.items())


def _where(w: dict) -> str:
    return (f"at element {w['index']} ({w['got']} instead of {w['expected']}; "
            f"{w['count']} element(s) wrong)")


def judge(ev) -> CheckResult:
    obs, world = ev.observations, ev.world_size
    cases = obs[0]["cases"]
    table, blamed = [], collections.defaultdict(list)
    for k, case in enumerate(cases):
        rows = [o["rows"][k] for o in obs]
        skip = next((row["skip"] for row in rows if row["skip"]), None)
        found = [] if skip else blame(case, rows)
        for rank, reason in found:
            blamed[rank].append(reason)
        table.append({"op": case["op"], "dtype": case["dtype"], "size_bytes": case["size_bytes"],
                      "count": case["count"], "status": SKIP if skip else FAIL if found else PASS,
                      "time_s": max(row["time_s"] for row in rows), "reason": skip or ""})
    culprits = [ev.culprit(rank, reasons[0] + (f" (and {len(reasons) - 1} more case(s))"
                                               if len(reasons) > 1 else ""))
                for rank, reasons in sorted(blamed.items(), key=lambda kv: (kv[0] is None, kv[0]))]
    failed = sum(row["status"] == FAIL for row in table)
    skipped = sum(row["status"] == SKIP for row in table)
    exact = len(table) - failed - skipped
    summary = (f"{exact}/{len(table)} cases exact on {world} ranks"
               + (f", {skipped} skipped (see figures)" if skipped else "")
               + (f", {failed} wrong" if failed else ""))
    return CheckResult("collectives", FAIL if culprits else PASS, summary=summary,
                       culprits=culprits,
                       figures={"cases": table, "cases_failed": failed, "cases_skipped": skipped,
                                "barrier_s": max(o["barrier_s"] for o in obs)})
