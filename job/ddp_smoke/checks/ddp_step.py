"""One DDP training step: the sampler partitions the data, gradients are averaged.

The tutorial this kit grows out of, exactly: ``torch.manual_seed(17)``, ``nn.Linear(2, 1)`` in
DDP, features ``[[0,0],[1,1],[2,2],[3,3]]``, targets ``[[0],[2],[4],[6]]``, DistributedSampler
without shuffling, batch 2, SGD lr 0.1, one step of ``mse_loss``. Rank 0 prints each rank's
tutorial line. Asserted, not printed: the shards are the sampler's partition (with padding
when the world size does not divide the data), every rank holds the same weights after the
step, and they equal a single-process step on all ranks' batches together.
Culprit: the rank whose shard or whose post-step weights differ.
"""
from __future__ import annotations

import math

import torch
import torch._dynamo  # noqa: F401 — DDP imports it on first construction; seconds, not the step
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from ..coordination import progress
from ..model import FAIL, PASS, CheckResult

SEED, LR, BATCH = 17, 0.1, 2
FEATURES = [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]
TARGETS = [[0.0], [2.0], [4.0], [6.0]]
TOLERANCE = 1e-6  # float32 all-reduce of two numbers: equal up to rounding


def _model() -> nn.Linear:
    torch.manual_seed(SEED)
    return nn.Linear(2, 1)


def run(ctx) -> dict:
    """Train one step on this rank's shard; return shard, loss and post-step parameters."""
    model = _model().to(ctx.device)
    with progress.tracked("ddp_broadcast_parameters"):
        ddp = DistributedDataParallel(model, device_ids=[ctx.device.index]
                                      if ctx.device.type == "cuda" else None)
    data = TensorDataset(torch.tensor(FEATURES), torch.tensor(TARGETS))
    sampler = DistributedSampler(data, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=False)
    x, y = next(iter(DataLoader(data, batch_size=BATCH, sampler=sampler)))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)
    loss = F.mse_loss(ddp(x.to(ctx.device)), y.to(ctx.device))
    with progress.tracked("ddp_gradient_all_reduce"):
        loss.backward()
        if loss.is_cuda:
            torch.cuda.synchronize(ctx.device)
    optimizer.step()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    ctx.faults.corrupt(params)  # a rank whose weights drifted out of sync
    return {"local_rank": ctx.local_rank, "samples": list(sampler), "batch": len(x),
            "loss": loss.item(), "params": params.tolist()}


def expected_shards(n: int, world: int) -> list[list[int]]:
    """DistributedSampler's documented split without shuffling: pad by wrapping, then stride."""
    total = math.ceil(n / world) * world
    padded = (list(range(n)) * math.ceil(total / n))[:total]
    return [padded[r:total:world] for r in range(world)]


def reference_params(batches: list[list[int]]) -> list[float]:
    """One single-process SGD step on every rank's batch together (what DDP must equal)."""
    model = _model()
    index = [i for batch in batches for i in batch]
    x, y = torch.tensor(FEATURES)[index], torch.tensor(TARGETS)[index]
    F.mse_loss(model(x), y).backward()
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def judge(ev) -> CheckResult:
    obs, world = ev.observations, ev.world_size
    shards = expected_shards(len(FEATURES), world)
    culprits = [ev.culprit(r, f"sampler shard {o['samples']} != expected {shards[r]}")
                for r, o in enumerate(obs) if o["samples"] != shards[r]]
    unseen = set(range(len(FEATURES))) - {i for o in obs for i in o["samples"]}
    if unseen:
        culprits.append(ev.culprit(None, f"samples {sorted(unseen)} are on no rank"))
    reference = reference_params([o["samples"][:o["batch"]] for o in obs])
    for r, o in enumerate(obs):
        if not all(math.isfinite(p) for p in o["params"]):  # NaN compares False with anything
            culprits.append(ev.culprit(r, f"post-step weights are not finite: {o['params']} "
                                          "(NaN/inf gradients or a corrupt all-reduce)"))
            continue
        diff = max(abs(a - b) for a, b in zip(o["params"], reference))
        if diff > TOLERANCE:
            culprits.append(ev.culprit(r, f"post-step weights differ from the single-process "
                                          f"reference by {diff:.3g} (gradients not averaged?)"))
    ok = not culprits
    notes = [f"rank={r} local_rank={o['local_rank']} world_size={world} samples={o['samples']} "
             f"loss={o['loss']:.4f} weight={o['params'][0]:.4f}" for r, o in enumerate(obs)]
    notes.append(f"ddp_step_complete={ok}")
    # DistributedSampler pads by repeating samples when the ranks outnumber them: say so
    padding = sum(map(len, shards)) - len(FEATURES)
    split = (f"shards partition {len(FEATURES)} samples" if not padding else
             f"shards cover {len(FEATURES)} samples, {padding} repeated as padding "
             f"({world} ranks)")
    summary = (f"{split}; weight {reference[0]:.4f} equal on {world} ranks and to the "
               "reference" if ok else f"{len(culprits)} culprit(s)")
    return CheckResult("ddp_step", PASS if ok else FAIL, summary=summary, culprits=culprits,
                       notes=notes, figures={"reference_params": reference,
                                             "params": [o["params"] for o in obs],
                                             "expected_shards": shards,
                                             "losses": [o["loss"] for o in obs]})
