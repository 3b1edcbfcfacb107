"""Training: real steps of a small Llama-style transformer, sharded as large jobs shard it.

The model (``checks/_transformer.py``: RMSNorm, rotary positions, SwiGLU, causal attention
through ``scaled_dot_product_attention``) is sized by the ``training`` section: about two
million parameters in fp32 on CPU; on a GPU a model of about a billion parameters in bf16
with fp32 gradient reduction (FSDP2's ``MixedPrecisionPolicy``). It is sharded with FSDP2
(``fully_shard`` on every block and the root) over all ranks of one node, and as HSDP on
several nodes — a 2-D device mesh, shard within a node, replicate across nodes (``layout``:
auto, fsdp or hsdp) — and trained with AdamW on synthetic tokens drawn from the seed.

Not run at the quick level (``steps`` 0 there): the standard and long levels run it.

**Correct, not only fast.** The first step trains every rank on the *same* batch, and every
rank also runs it on an unsharded copy of the same weights (the single-process reference,
its cost independent of the world size). Then, per rank:

* the reference itself (its loss, the squared norm of its gradients, the sum of its weights
  after AdamW) must agree with every other rank's: the same arithmetic on the same numbers,
  so a rank whose products are off (silent data corruption) is the odd one out;
* the sharded step's loss must equal the reference's, and each rank's gradient shard and
  weight shard after the step the reference's slice of them (``tolerance_cpu``: fp32 on both
  sides, equal up to the reduction's rounding; ``tolerance_gpu``: bf16 compute against
  autocast, relative to the tensor's largest value).

A rank that disagrees is named; a sharded step that differs on every rank while every
reference agrees names no rank (the reduction is wrong, not one rank).
The job's loss (all ranks' mean, every step after the first on each rank's own batch) must fall
from the first step to the last.

**Figures**, per rank: step time (median, p90 over ``steps`` measured steps after
``warmup_steps``), tokens/s, model FLOPs per token by PaLM's formula (``_transformer``), MFU
against the profile's dense peak (``training.peak_tflops``; none on CPU), the compute-only
time (forward and backward of the rank's own batch on its unsharded copy, no communication)
and the exposed communication (the step's median minus the compute-only median: what the
step waits for the network, plus the sharded optimizer step), and peak memory (CUDA's peak
allocation on a GPU; the process's peak resident set on CPU).

**Judged**: the rank the step waits for, by its compute-only blocks against the others' (the
compute check's pace rule and margins, the shared-core margin where ranks share cores), and
the profile's ``min_mfu`` floor where it sets one. Where ranks share their host's cores, a
rank behind is named only when a CPU quota (or an injected ``slow`` fault) held it back for
``diagnosis.waits_min_total_s`` in the check, as the waits rule does: otherwise its turn on
the cores was the scheduler's (measured: a healthy rank at 51 % of the others' pace, 4 ranks
on 2 cores beside a test suite in three workers). A rank that hangs inside a step is named by
the kit's usual abort path (each step counts as one collective in the flight recorder).
"""
from __future__ import annotations

import copy
import resource
import statistics
import time

import torch
import torch._dynamo  # noqa: F401 — FSDP2's first DTensor imports it; seconds, not the check
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from ..config import profiles
from ..coordination import progress, stragglers
from ..model import FAIL, PASS, SKIP, CheckResult, percentile
from . import _transformer as tf
from . import perf
from .api import pace_margin, usable_cores

_MESHES: dict = {}  # (device type, shape) -> DeviceMesh: made once per process (repeat mode)


def run(ctx) -> dict:
    cfg = ctx.section("training")
    if not cfg["steps"]:
        return {"skipped": "not run at the quick level (--level standard runs it)"}
    gpu = ctx.device.type == "cuda"
    size = cfg["gpu" if gpu else "cpu"]
    # an injected stall strikes in a training step, not in the set-up's collectives
    stall, progress.RECORDER.stall = progress.RECORDER.stall, False
    layout, shape, note = _layout(ctx, cfg["layout"])
    mesh = _mesh(ctx.device.type, shape, layout)
    model = tf.build(size, cfg["seed"], ctx.device)
    reference = copy.deepcopy(model)
    _shard(model, mesh, gpu)
    params, non_embedding = tf.parameters(reference)
    perm = tf.language(size["vocab"], cfg["seed"])
    rows, seq = size["micro_batch"], size["seq_len"]
    if ctx.faults.sdc_active:
        for m in (model, reference):  # "the hardware": both copies on this rank are off
            m.layers[0].w2.register_forward_hook(lambda _m, _i, out: out.view(-1)[:1].add_(1.0))
    if gpu:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    progress.RECORDER.stall = stall
    held = _Held(ctx)
    checked = _checked_step(ctx, model, reference, perm, rows, seq, cfg, gpu)
    optimizer = _optimizer(model, cfg)  # after the checked step: its own optimizer stepped
    losses, step_s = [], []
    for step in range(cfg["warmup_steps"] + cfg["steps"]):
        x, y = (t.to(ctx.device) for t in tf.batch(perm, rows, seq, cfg["seed"], step + 1,
                                                   ctx.rank))
        t = time.perf_counter()
        with progress.tracked("training_step"):
            loss = tf.loss_of(model, x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            _sync(ctx.device)
        held.throttle(time.perf_counter() - t)
        losses.append(loss.detach())
        if step >= cfg["warmup_steps"]:
            step_s.append(time.perf_counter() - t)
    compute_s = _compute_only(ctx, reference, perm, rows, seq, cfg, gpu, held)
    mean = torch.stack([checked.pop("loss_t")] + losses).float()
    progress.all_reduce(mean)
    mean /= ctx.world_size
    peak = (torch.cuda.max_memory_allocated(ctx.device) if gpu else
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    del model, reference, optimizer
    if gpu:
        torch.cuda.empty_cache()
    return {"device_type": ctx.device.type, "layout": layout, "mesh": list(shape),
            "layout_note": note, "model": {**size, "params": params,
                                           "params_non_embedding": non_embedding},
            "flops_per_token": tf.flops_per_token(size, non_embedding),
            "tokens_per_step": rows * seq, "step_s": step_s, "compute_s": compute_s,
            "job_losses": mean.tolist(), "checked": checked, "held_s": held.seconds(),
            "peak_memory_bytes": int(peak), "threads": torch.get_num_threads(),
            "cores": usable_cores(), "profile": profiles.load(profiles.selected(ctx.config))}


def _layout(ctx, asked: str) -> tuple[str, tuple[int, ...], str]:
    """``(layout, mesh shape, note)``: HSDP's (nodes, ranks per node) needs every node to hold
    the same number of consecutive ranks; the ranks agree on that in one all_gather."""
    env = ctx.env
    mine = torch.tensor([env.group_rank, env.local_rank, env.local_world_size],
                        dtype=torch.int64, device=ctx.device)
    every = torch.empty(ctx.world_size * 3, dtype=torch.int64, device=ctx.device)
    progress.all_gather_into(every, mine)
    rows = every.view(-1, 3).tolist()
    lws = rows[0][2]
    nodes = ctx.world_size // lws
    regular = (ctx.world_size % lws == 0 and all(
        lw == lws and r == g * lws + lr for r, (g, lr, lw) in enumerate(rows)))
    if asked == "fsdp" or (asked == "auto" and nodes == 1):
        return "fsdp", (ctx.world_size,), ""
    if not regular:
        return "fsdp", (ctx.world_size,), ("HSDP needs the same number of consecutive ranks "
                                           "on every node: sharded over all ranks instead")
    if nodes == 1:
        return "fsdp", (ctx.world_size,), "one node: HSDP is FSDP"
    return "hsdp", (nodes, lws), ""


def _mesh(device_type: str, shape: tuple[int, ...], layout: str):
    key = (device_type, shape)
    if key not in _MESHES:
        names = ("replicate", "shard") if layout == "hsdp" else ("shard",)
        with progress.tracked("device_mesh"):  # a 2-D mesh makes its groups: collectives
            _MESHES[key] = init_device_mesh(device_type, shape, mesh_dim_names=names)
    return _MESHES[key]


def _shard(model, mesh, gpu: bool) -> None:
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if gpu else MixedPrecisionPolicy())
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def _optimizer(model, cfg: dict):
    return torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.1,
                             betas=(0.9, 0.95), foreach=True)


def _checked_step(ctx, model, reference, perm, rows, seq, cfg, gpu) -> dict:
    """The first step, on the same batch everywhere: the sharded model against the reference
    (gradients, then weights after one AdamW step), and the reference's fingerprint."""
    x, y = (t.to(ctx.device) for t in tf.batch(perm, rows, seq, cfg["seed"], 0, 0))
    with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=gpu):
        ref_loss = tf.loss_of(reference, x, y)
    ref_loss.backward()
    with progress.tracked("training_step"):
        loss = tf.loss_of(model, x, y)
        loss.backward()
        _sync(ctx.device)
    grad_diff = _diff(model, reference, lambda p: p.grad)
    opt, ref_opt = _optimizer(model, cfg), _optimizer(reference, cfg)
    opt.step()
    ref_opt.step()
    if ctx.faults.corrupting:  # a rank whose weights drifted out of step with the others
        with torch.no_grad():
            next(model.parameters()).to_local().view(-1)[:1].add_(1.0)
    param_diff = _diff(model, reference, lambda p: p)
    with torch.no_grad():
        grads = [p.grad.float() for p in reference.parameters()]
        fingerprint = [ref_loss.item(), sum(g.pow(2).sum() for g in grads).item(),
                       sum(p.float().sum() for p in reference.parameters()).item()]
    opt.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    del opt, ref_opt  # the measured steps start with a fresh optimizer (see run)
    return {"loss": loss.item(), "loss_t": loss.detach(), "reference": fingerprint,
            "grad_diff": grad_diff, "param_diff": param_diff}


def _diff(model, reference, pick) -> float | None:
    """The largest difference between this rank's shards of ``pick(parameter)`` and the same
    slice of the reference's, relative to the reference tensor's largest value: FSDP2 shards
    every parameter along dim 0 as ``torch.chunk`` does, the mesh's shard coordinate picking
    the chunk."""
    worst = 0.0
    with torch.no_grad():
        for p, r in zip(model.parameters(), reference.parameters()):
            mine, full = pick(p), pick(r)
            if mine is None or full is None:
                return None
            local = mine.to_local().float()
            mesh = p.device_mesh
            index = mesh.get_local_rank(mesh.ndim - 1)
            chunks = torch.chunk(full.float(), mesh.size(mesh.ndim - 1), dim=0)
            want = chunks[index] if index < len(chunks) else full.float()[:0]
            if local.shape != want.shape:
                return float("inf")
            scale = full.float().abs().max().item() or 1.0
            if local.numel():
                worst = max(worst, (local - want).abs().max().item() / scale)
    return worst


class _Held:
    """The seconds this rank was held back in the check: what a CPU quota throttled (its
    cgroup's counter, 0 on a GPU) and what an injected ``slow`` fault slept (it stands in for
    a throttled device)."""

    def __init__(self, ctx):
        self.ctx, self.before, self.injected = ctx, ctx.held_s(), 0.0

    def throttle(self, elapsed_s: float) -> None:
        t = time.perf_counter()
        self.ctx.faults.throttle(elapsed_s)
        self.injected += time.perf_counter() - t

    def seconds(self) -> float:
        now = self.ctx.held_s()
        quota = now - self.before if now is not None and self.before is not None else 0.0
        return round(quota + self.injected, 3)


def _compute_only(ctx, reference, perm, rows, seq, cfg, gpu, held: _Held) -> list[float]:
    """Forward and backward of this rank's batches on its unsharded copy, one block each: what
    the step costs without communication (no collective here: the ranks run side by side)."""
    out = []
    for step in range(cfg["steps"]):
        x, y = (t.to(ctx.device) for t in tf.batch(perm, rows, seq, cfg["seed"],
                                                   cfg["warmup_steps"] + step + 1, ctx.rank))
        t = time.perf_counter()
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=gpu):
            loss = tf.loss_of(reference, x, y)
        loss.backward()
        reference.zero_grad(set_to_none=True)
        _sync(ctx.device)
        held.throttle(time.perf_counter() - t)
        out.append(time.perf_counter() - t)
    return out


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- judging (rank 0, pure) ----------------------------------------------------------------

def judge(ev) -> CheckResult:
    obs = ev.observations
    if "skipped" in obs[0]:
        return CheckResult("training", SKIP, summary=obs[0]["skipped"])
    cfg, first = ev.section(), obs[0]
    cpu = first["device_type"] == "cpu"
    tolerance = cfg["tolerance_cpu" if cpu else "tolerance_gpu"]
    margin, shared = pace_margin(ev, cpu)
    culprits = _correctness(ev, tolerance)
    tokens = first["tokens_per_step"]
    paces, behind = perf.slow_paced({r: [tokens / s for s in o["compute_s"]]
                                     for r, o in enumerate(obs)}, margin)
    spared = [r for r in behind if stragglers.scheduler_chose(
        {"shared": ev.host(r) in shared, "held_s": obs[r].get("held_s")}, ev.config["diagnosis"])]
    culprits += [ev.culprit(r, _slow_reason(obs[r], paces[r], margin, shared))
                 for r in behind if r not in spared]
    peak = first["profile"].get("training", {}).get("peak_tflops")
    ranks = [_rank_figures(ev, r, o, paces[r], None if cpu else peak) for r, o in enumerate(obs)]
    floor = first["profile"].get("training", {}).get("min_mfu")
    if floor and not cpu:
        culprits += [ev.culprit(k["rank"], f"MFU {k['mfu']:.1%} is below the profile "
                                           f"{first['profile']['name']}'s floor {floor:.0%}")
                     for k in ranks if k["mfu"] is not None and k["mfu"] < floor]
    losses = first["job_losses"]
    if not losses[-1] < losses[0]:
        culprits.append(ev.culprit(None, f"the job's loss did not fall: {losses[0]:.4f} at the "
                                         f"first step, {losses[-1]:.4f} at the last"))
    job_tps = sum(k["tokens_per_s"] for k in ranks)
    figures = {"legend": _LEGEND, "profile": first["profile"]["name"],
               "layout": first["layout"], "mesh": first["mesh"],
               "layout_note": first["layout_note"], "model": first["model"],
               "flops_per_token": first["flops_per_token"], "tokens_per_step": tokens,
               "peak_tflops": None if cpu else peak, "tolerance": tolerance,
               "straggler_margin": margin, "shared_cores": shared, "scheduler_chose": spared,
               "job_losses": losses,
               "tokens_per_s": job_tps, "mfu_median": _median([k["mfu"] for k in ranks]),
               "min_mfu": floor, "ranks": ranks}
    summary = (f"{first['layout'].upper()} {'x'.join(map(str, first['mesh']))}, "
               f"{first['model']['params'] / 1e6:.1f} M parameters: {job_tps:,.0f} tokens/s "
               f"({statistics.median(k['tokens_per_s'] for k in ranks):,.0f} per rank)"
               + (f", MFU {figures['mfu_median']:.1%}" if figures["mfu_median"] else "")
               + f"; loss {losses[0]:.3f} -> {losses[-1]:.3f}; step equal to the reference")
    if culprits:
        summary = f"{len(culprits)} problem(s): {culprits[0].reason}"
    return CheckResult("training", FAIL if culprits else PASS, summary=summary,
                       culprits=culprits, figures=figures, notes=_table(ranks, figures, cpu))


_LEGEND = ("step_s: wall time of a measured step (forward, backward, AdamW, sharded), median "
           "and p90; compute_s: forward and backward of the same batch on the rank's unsharded "
           "copy, no communication (median); exposed_comm_s: step minus compute; tokens_per_s: "
           "tokens of the rank's batch over its median step; model FLOPs per token 6N + "
           "12*L*H*Q*T (PaLM, arXiv 2204.02311 appendix B; TorchTitan); mfu: tokens/s x FLOPs "
           "per token over the profile's dense peak (peak_tflops, 1e12 FLOP/s); pace (judged "
           "against the straggler margin): the rank's compute blocks against the ranks' "
           "median, as the compute check; grad_diff/param_diff/loss_diff: the first step "
           "against the single-process reference, relative; peak_memory_bytes: CUDA peak "
           "allocation, or the process's peak resident set on CPU")


def _correctness(ev, tolerance: float) -> list:
    """Ranks whose reference or sharded first step disagrees (see the module)."""
    obs = ev.observations
    consensus = [statistics.median(o["checked"]["reference"][i] for o in obs) for i in range(3)]
    what = ("loss", "squared gradient norm", "weight sum after AdamW")
    odd = {}
    for r, o in enumerate(obs):
        c = o["checked"]
        for i, (mine, want) in enumerate(zip(c["reference"], consensus)):
            if _off(mine, want, tolerance):
                odd.setdefault(r, []).append(
                    f"its single-process reference step disagrees with the other ranks' "
                    f"(same weights, same batch): {what[i]} {mine:.8g} against {want:.8g} "
                    "(silent data corruption?)")
                break
        if _off(c["loss"], consensus[0], tolerance):
            odd.setdefault(r, []).append(f"its sharded first step's loss {c['loss']:.8g} is "
                                         f"not the reference's {consensus[0]:.8g}")
    if odd:
        return [ev.culprit(r, "; ".join(why)) for r, why in sorted(odd.items())]
    bad = {r: o["checked"] for r, o in enumerate(obs)
           if not all(d is not None and d <= tolerance
                      for d in (o["checked"]["grad_diff"], o["checked"]["param_diff"]))}
    if len(bad) == len(obs) and len(obs) > 1:
        worst = max(bad.values(), key=lambda c: c["grad_diff"] or float("inf"))
        return [ev.culprit(None, f"the sharded step differs from the single-process reference "
                                 f"on every rank (gradients {_g(worst['grad_diff'])}, weights "
                                 f"{_g(worst['param_diff'])} relative, tolerance "
                                 f"{tolerance:g}) while every rank's reference agrees: the "
                                 "gradient reduction is wrong, not one rank")]
    return [ev.culprit(r, f"its shards differ from the single-process reference after the "
                          f"first step: gradients {_g(c['grad_diff'])}, weights "
                          f"{_g(c['param_diff'])} relative (tolerance {tolerance:g})")
            for r, c in sorted(bad.items())]


def _g(diff: float | None) -> str:
    return "missing" if diff is None else f"{diff:.3g}"


def _off(mine: float, want: float, tolerance: float) -> bool:
    return not abs(mine - want) <= tolerance * max(abs(want), 1e-12)  # NaN is off


def _rank_figures(ev, r: int, o: dict, pace: float, peak: float | None) -> dict:
    step = statistics.median(o["step_s"])
    compute = statistics.median(o["compute_s"])
    tps = o["tokens_per_step"] / step
    return {"rank": r, "host": ev.host(r), "step_s_median": round(step, 6),
            "step_s_p90": round(percentile(o["step_s"], 90), 6), "step_s": o["step_s"],
            "compute_s_median": round(compute, 6),
            "exposed_comm_s": round(max(0.0, step - compute), 6),
            "tokens_per_s": round(tps, 3),
            "mfu": round(tps * o["flops_per_token"] / (peak * 1e12), 6) if peak else None,
            "pace": round(pace, 4), "held_s": o.get("held_s"),
            "peak_memory_bytes": o["peak_memory_bytes"],
            "loss_diff": o["checked"]["loss"] - o["checked"]["reference"][0],
            "grad_diff": o["checked"]["grad_diff"], "param_diff": o["checked"]["param_diff"]}


def _slow_reason(o: dict, pace: float, margin: float, shared: list) -> str:
    where = f"; ranks share cores on {', '.join(map(str, shared[:4]))}" if shared else ""
    held = f"; held back {o['held_s']:.1f} s in the check" if shared and o.get("held_s") else ""
    return (f"the training step waits for it: its forward and backward alone kept {pace:.0%} "
            f"of the other ranks' pace ({len(o['compute_s'])} blocks, each against the ranks' "
            f"median block; straggler margin {margin:.0%}{where}{held}), median "
            f"{statistics.median(o['compute_s']) * 1e3:.1f} ms a step")


def _median(values: list) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def _table(ranks: list[dict], figures: dict, cpu: bool) -> list[str]:
    m = figures["model"]
    lines = [f"# training: {figures['layout']} mesh {figures['mesh']}, Llama-style "
             f"{m['layers']} layers x {m['dim']} ({m['params'] / 1e6:.2f} M parameters), "
             f"{figures['tokens_per_step']} tokens a rank a step, "
             f"{figures['flops_per_token'] / 1e6:.1f} MFLOP a token (6N + 12LHQT); "
             f"MFU against {figures['peak_tflops'] or '-'} TFLOPS; profile {figures['profile']}",
             f"# {'rank':>5} {'host':<20} {'step ms':>8} {'p90 ms':>8} {'compute':>8} "
             f"{'exposed':>8} {'tokens/s':>10} {'MFU':>6} {'pace':>5} {'peak MB':>8}"]
    for k in ranks:
        mfu = "-" if k["mfu"] is None else f"{k['mfu']:.1%}"
        lines.append(f"  {k['rank']:>5} {str(k['host']):<20} {k['step_s_median'] * 1e3:>8.1f} "
                     f"{k['step_s_p90'] * 1e3:>8.1f} {k['compute_s_median'] * 1e3:>8.1f} "
                     f"{k['exposed_comm_s'] * 1e3:>8.1f} {k['tokens_per_s']:>10,.0f} "
                     f"{mfu:>6} {k['pace']:>5.0%} {k['peak_memory_bytes'] / 1e6:>8.0f}")
    return lines
