"""Measurement levels: how much the performance checks measure, and so how long a run takes.

Every level runs every selected check but training (not at the quick level: a real step
costs seconds), and every check proves the same things at every level it runs
(exact collectives, the DDP step, the sampler, storage, correct data at each swept size); the
levels differ in how many sizes, iterations and blocks the measurements take (DCGM's
diagnostic levels, ``dcgmi diag -r 1..4``, trade depth for time too, by choosing tests). A level is a set of config values laid over ``defaults.yaml``, under a user's
``--config`` file and flags (``config.resolve``), so any single key can still be set by hand.

``quick``
    The local default (``make smoke-local``): a bandwidth sweep of four sizes (512 B, 16 KiB,
    512 KiB, 16 MiB on CPU; and 512 MiB on a GPU), each timed as many times as fit 0.02 s at
    the pace of its checked first run, at least 3 and at most 10; no separate warm-up (the
    checked run warms the size up); three compute blocks of 0.05 s (shorter blocks than half a
    CFS quota period, 100 ms, let a throttled rank's bursts decide a block); no busbw.png; no
    training steps (the training check skips). About a second of checks on two CPU ranks.
``standard``
    The worker's default, what the cluster launchers run: ``defaults.yaml`` as written — sizes
    1 KiB … 64 MiB (CPU) / 1 GiB (GPU) by ×4, up to 20 iterations or 0.25 s per size; five
    0.1 s compute blocks; five measured training steps.
``long``
    nccl-tests' full sweep: sizes by ×2 over the same range, all five swept collectives, up to
    100 iterations or 1 s per size, ten 0.2 s compute blocks, twenty training steps, more node-pair rounds, every
    collectives dtype. Minutes on a large cluster: for acceptance, not for a quick look.

A profile's floor sizes (``--profile``) are measured at every level.
"""
from __future__ import annotations

from typing import Any

LEVELS: dict[str, dict[str, Any]] = {
    "quick": {
        "bandwidth": {"min_bytes": 512, "step_factor": 32, "max_bytes_cpu": 16 << 20,
                      "max_bytes_gpu": 512 << 20, "warmup_iters": 0, "min_iters": 3,
                      "iters": 10, "time_per_size_s": 0.02, "pair_iters": 3},
        "compute": {"blocks": 3, "block_s": 0.05},
        "training": {"steps": 0},
    },
    "standard": {},
    "long": {
        "bandwidth": {"collectives": ["all_reduce", "all_gather", "reduce_scatter", "broadcast",
                                      "all_to_all"],
                      "step_factor": 2, "warmup_iters": 5, "min_iters": 5, "iters": 100,
                      "time_per_size_s": 1.0, "pair_rounds": 6, "pair_iters": 10},
        "compute": {"blocks": 10, "block_s": 0.2},
        "training": {"steps": 20, "warmup_steps": 3},
        "collectives": {"dtypes": ["float32", "float64", "int32", "int64", "bfloat16",
                                   "float16"]},
    },
}


def overlay(name: str) -> dict[str, Any]:
    """The config values level ``name`` sets over the defaults (KeyError if unknown)."""
    return LEVELS[name]
