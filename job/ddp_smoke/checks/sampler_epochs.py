"""Shuffled epochs: each epoch's shards partition the data, and the order changes every epoch.

Every rank iterates a DataLoader over a DistributedSampler(shuffle=True, seed) of ``samples``
items for ``epochs`` epochs, calling ``sampler.set_epoch(epoch)`` before each, and reports the
samples it loaded; it also reports the full permutation its own sampler draws for each epoch.
Rank 0 reconstructs each epoch from the shards and asserts: every sample is on some rank, the
padding (when the world size does not divide ``samples``) repeats only the permutation's first
items, each shard is its rank's slice of the permutation all ranks agree on, and no epoch
repeats an earlier epoch's order.
``set_epoch: false`` demonstrates the classic bug (the loop never calls ``set_epoch``): every
epoch then replays the first epoch's order, and this check fails saying so.
Culprit: the rank whose permutation differs from the others' (seed or torch version), or whose
shard is not its slice; no single rank for an order that repeats across epochs.
"""
from __future__ import annotations

import collections
import math

import torch
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from ..model import FAIL, PASS, CheckResult

_BATCH = 4


def _sampler(samples: int, replicas: int, rank: int, seed: int) -> DistributedSampler:
    return DistributedSampler(range(samples), num_replicas=replicas, rank=rank, shuffle=True,
                              seed=seed, drop_last=False)


def permutation(samples: int, seed: int, epoch: int | None) -> list[int]:
    """The whole order a sampler draws for ``epoch`` (None: set_epoch never called)."""
    whole = _sampler(samples, 1, 0, seed)
    if epoch is not None:
        whole.set_epoch(epoch)
    return list(whole)


def expected_shards(order: list[int], world: int) -> list[list[int]]:
    """DistributedSampler's split of ``order``: pad by repeating its start, then stride."""
    total = math.ceil(len(order) / world) * world
    padded = (order * math.ceil(total / len(order)))[:total]
    return [padded[r:total:world] for r in range(world)]


def partition_problem(shards: list[list[int]], samples: int) -> str | None:
    """What is wrong with ``shards`` as a padded partition of ``range(samples)``, if anything."""
    lengths = sorted({len(s) for s in shards})
    if len(lengths) > 1:
        return f"shard lengths differ ({lengths})"
    seen = collections.Counter(i for s in shards for i in s)
    stray = sorted(i for i in seen if not 0 <= i < samples)
    unseen = sorted(set(range(samples)) - set(seen))
    padding = sum(len(s) for s in shards) - samples
    extra = sum(c - 1 for i, c in seen.items() if 0 <= i < samples)
    if stray or unseen or extra != padding:
        return (f"not a partition: samples {unseen} on no rank, {stray} out of range, "
                f"{extra} repeated where the padding is {padding}")
    return None




def run(ctx) -> dict:
    """Load every epoch's shard through a DataLoader; return shards and permutations."""
    opts = ctx.section("sampler_epochs")
    samples, epochs, seed, set_epoch = (opts["samples"], opts["epochs"], opts["seed"],
                                        opts["set_epoch"])
    data = TensorDataset(torch.arange(samples))
    sampler = _sampler(samples, ctx.world_size, ctx.rank, seed)
    loader = DataLoader(data, batch_size=_BATCH, sampler=sampler)
    shards, orders = [], []
    for epoch in range(epochs):
        if set_epoch:
            sampler.set_epoch(epoch)
        loaded = torch.cat([batch for (batch,) in loader])
        shards.append(ctx.faults.corrupt(loaded).tolist())  # a rank that loads the wrong items
        orders.append(permutation(samples, seed, epoch if set_epoch else None))
    return {"samples": samples, "epochs": epochs, "set_epoch": set_epoch, "shards": shards,
            "orders": orders}


def _epoch_culprits(ev, epoch: int) -> tuple[list, list[int]]:
    """Culprits of one epoch and the permutation most ranks drew for it."""
    obs, world = ev.observations, ev.world_size
    views = [tuple(o["orders"][epoch]) for o in obs]
    common, count = collections.Counter(views).most_common(1)[0]
    out = [ev.culprit(r, f"epoch {epoch}: its sampler draws another permutation than {count} "
                         f"of {world} ranks (different seed or torch version?)")
           for r, v in enumerate(views) if v != common]
    slices = expected_shards(list(common), world)
    out += [ev.culprit(r, f"epoch {epoch}: loaded samples {o['shards'][epoch]}, not its slice "
                          f"{slices[r]} of the common permutation")
            for r, o in enumerate(obs) if o["shards"][epoch] != slices[r]]
    problem = partition_problem([o["shards"][epoch] for o in obs], obs[0]["samples"])
    if problem and not out:
        out.append(ev.culprit(None, f"epoch {epoch}: {problem}"))
    return out, list(common)


def _one_per_rank(ev, culprits: list) -> list:
    """One culprit per rank: its first reason, and how many more findings name it."""
    by_rank = {}
    for c in culprits:
        by_rank.setdefault(c.rank, []).append(c.reason)
    return [ev.culprit(rank, reasons[0] + (f" (and {len(reasons) - 1} more finding(s))"
                                           if len(reasons) > 1 else ""))
            for rank, reasons in by_rank.items()]


def _repeats(orders: list[list[int]]) -> list[tuple[int, int]]:
    """(first epoch, later epoch) for each epoch whose order an earlier epoch already drew."""
    first, out = {}, []
    for epoch, order in enumerate(orders):
        earlier = first.setdefault(tuple(order), epoch)
        if earlier != epoch:
            out.append((earlier, epoch))
    return out


def judge(ev) -> CheckResult:
    obs, world = ev.observations, ev.world_size
    samples, epochs, set_epoch = obs[0]["samples"], obs[0]["epochs"], obs[0]["set_epoch"]
    found, orders = [], []
    for epoch in range(epochs):
        culprits, order = _epoch_culprits(ev, epoch)
        found += culprits
        orders.append(order)
    culprits = _one_per_rank(ev, found)
    repeats = _repeats(orders)
    if repeats:
        pairs = ", ".join(f"{a} and {b}" for a, b in repeats)
        why = ("set_epoch: false demonstrates it" if not set_epoch
               else "is sampler.set_epoch(epoch) called?")
        culprits.append(ev.culprit(None, f"epochs {pairs} draw the same order: without "
                                         f"set_epoch every epoch replays one shuffle ({why})"))
    padding = math.ceil(samples / world) * world - samples
    if not culprits:
        summary = (f"{epochs} epochs × {world} shards partition {samples} samples "
                   f"(padding {padding}); order changes every epoch")
    elif repeats and not set_epoch:
        summary = f"missing set_epoch detected: {epochs} epochs replay one order"
    else:
        summary = f"{len(culprits)} culprit(s)"
    return CheckResult("sampler_epochs", FAIL if culprits else PASS, summary=summary,
                       culprits=culprits,
                       figures={"samples": samples, "epochs": epochs, "set_epoch": set_epoch,
                                "padding_samples": padding, "orders": orders,
                                "repeated_epochs": [list(p) for p in repeats]})
