"""The allowed range of every key in ``defaults.yaml``: one table, checked before any rank connects.

``config`` checks each value's type against its default; this module checks what the type
cannot say: numbers finite and inside bounds (positive where zero or less would divide by zero
or loop forever, upper bounds where memory, the store or ``datetime.timedelta`` would suffer),
names among those the checks know, lists non-empty and without repeats, and the few rules that
tie two keys together. It imports no torch, so bad input is answered in a fraction of a second.

Each rule's error is one line: ``key 'K' = V: expected WHAT``. Every key of ``defaults.yaml``
has exactly one rule here (a test holds the two together).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError

BACKENDS = ("auto", "gloo", "nccl")
# The checks in their default order (checks/__init__.py imports each by this name).
CHECKS = ("environment", "ddp_step", "sampler_epochs", "collectives", "storage", "bandwidth",
          "transport", "rails", "compute", "training", "health")
NODE_SPEAKER = ("auto", "on", "off")  # --node-speaker: coordination.node
PROGRESS = ("auto", "plain", "none")  # --progress: coordination.telling
LAYOUTS = ("auto", "fsdp", "hsdp")  # training.layout: checks/training.py
ACTS = ("slurm-drain",)  # --act: what rank 0 may do itself after the verdict

GIB = 1 << 30
DAY_S = 86400.0

# The names the checks accept, with what each check needs to know of them: the one table
# (the checks map a name to its torch dtype with getattr(torch, name)).
# collectives: dtype -> the largest integer it holds exactly (and all below it): what an exact
# sum may reach.
COLLECTIVE_DTYPES = {"float32": 2**24, "float64": 2**53, "bfloat16": 2**8, "float16": 2**11,
                     "int32": 2**31 - 1, "int64": 2**62}
SWEPT = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
BANDWIDTH_DTYPES = ("float32", "bfloat16", "float16")
# compute on a GPU: name -> (torch dtype, float32 matmul precision); "high" lets fp32 products
# use TF32 tensor cores
GPU_MATMUL_DTYPES = {"bf16": ("bfloat16", "high"), "fp16": ("float16", "high"),
                     "tf32": ("float32", "high"), "fp32": ("float32", "highest")}


@dataclass(frozen=True)
class Int:
    lo: int
    hi: int

    def problem(self, v: Any) -> str | None:
        return None if self.lo <= v <= self.hi else f"an integer >= {self.lo} and <= {self.hi}"


@dataclass(frozen=True)
class Real:
    """A finite number in [lo, hi] (``lo_open``: lo itself excluded)."""

    lo: float
    hi: float
    lo_open: bool = False

    def problem(self, v: Any) -> str | None:
        ok = math.isfinite(v) and (v > self.lo if self.lo_open else v >= self.lo) and v <= self.hi
        return None if ok else (f"a finite number {'>' if self.lo_open else '>='} {self.lo:g} "
                                f"and <= {self.hi:g}")


@dataclass(frozen=True)
class OneOf:
    names: tuple[str, ...]

    def problem(self, v: Any) -> str | None:
        return None if v in self.names else f"one of {', '.join(self.names)}"


@dataclass(frozen=True)
class Names:
    """A list of names from ``names``, each once; ``empty`` allows []."""

    names: tuple[str, ...]
    empty: bool = False

    def problem(self, v: Any) -> str | tuple[Any, str] | None:
        expected = (f"a list of distinct names from {', '.join(self.names)}"
                    + ("" if self.empty else " (at least one)"))
        unknown = [n for n in v if n not in self.names]
        if unknown:  # name the offending item, not the whole list
            return unknown[0], expected
        return None if (v or self.empty) and len(set(v)) == len(v) else expected


@dataclass(frozen=True)
class Sizes:
    """A non-empty list of distinct integers in lo..hi."""

    lo: int
    hi: int

    def problem(self, v: Any) -> str | None:
        ok = v and all(self.lo <= n <= self.hi for n in v) and len(set(v)) == len(v)
        return None if ok else f"a non-empty list of distinct integers in {self.lo}..{self.hi}"


@dataclass(frozen=True)
class Path:
    """A path or name: not empty, no NUL byte (the OS rejects it with a traceback)."""

    def problem(self, v: Any) -> str | None:
        return None if v and "\0" not in v else "a non-empty path without NUL bytes"


@dataclass(frozen=True)
class Devices:
    """Network device names (``eth1``, ``mlx5_0``, ``mlx5_0:1``): 1 to ``most`` distinct, each
    1-64 characters without whitespace, ``/`` or NUL (what a kernel device name can hold)."""

    most: int

    def problem(self, v: Any) -> str | tuple[Any, str] | None:
        expected = (f"a list of 1 to {self.most} distinct network device names (eth0, mlx5_0 "
                    "…: no spaces, '/' or NUL)")
        bad = [d for d in v if not isinstance(d, str) or not 0 < len(d) <= 64
               or any(c.isspace() or c in "/\0" for c in d)]
        if bad:
            return bad[0], expected
        return None if 0 < len(v) <= self.most and len(set(v)) == len(v) else expected


class Any_:
    """Checked elsewhere (the type alone, or a parser of its own: checks, fault, profile)."""

    def problem(self, v: Any) -> str | None:
        return None


SEED = Int(0, 2**32 - 1)        # torch and DistributedSampler take any of these
MARGIN = Real(0.0, 1.0)         # a fraction below a reference: 1 would flag nothing ever
BYTES_CPU = Int(1, 16 * GIB)    # one buffer in host memory (several exist at once)
BYTES_GPU = Int(1, 64 * GIB)

RULES: dict[str, Any] = {
    "checks": Any_(),  # config._validate: CHECKS, no repeats
    "timeout": Real(0.0, DAY_S, lo_open=True),  # beyond a day: a mistake, and timedelta's range
    "backend": OneOf(BACKENDS),
    "report_dir": Path(),
    "storage_dir": Path(),
    "expect_nodes": Int(1, 1 << 20),
    "expect_world_size": Int(1, 1 << 24),
    "profile": Path(),
    "fault": Any_(),   # faults.parse_faults
    "expect_transport": Path(),  # ib, socket or a net plugin's name (transport check)
    "level": Any_(),   # config.resolve: the names in levels.LEVELS
    "repeat": Int(1, 100000),
    "duration": Real(0.0, 7 * DAY_S, lo_open=True),  # with repeat: config._validate
    "act": OneOf(ACTS),
    "node_speaker": OneOf(NODE_SPEAKER),
    "progress": OneOf(PROGRESS),
    "prometheus": Path(),
    "rails": Devices(64),  # a node has at most a few dozen NICs
    # >= 8: with fewer, two epochs may draw the same order by chance (1 in 8! at 8);
    # bounded: every rank posts its shards to the store
    "sampler_epochs.samples": Int(8, 1 << 20),
    "sampler_epochs.epochs": Int(2, 100),
    "sampler_epochs.seed": SEED,
    "sampler_epochs.set_epoch": Any_(),
    "collectives.dtypes": Names(COLLECTIVE_DTYPES),
    "collectives.cuda_dtypes": Names(COLLECTIVE_DTYPES, empty=True),
    "collectives.sizes_bytes": Sizes(1, GIB),  # all_gather holds world_size x this
    "collectives.seed": SEED,
    "storage.file_bytes": Int(1, GIB),         # held in memory twice per rank
    "storage.model_width": Int(1, 16384),      # width^2 x 4 B: 1 GiB at the top
    "storage.seed": SEED,
    "bandwidth.collectives": Names(SWEPT),
    "bandwidth.dtype": OneOf(BANDWIDTH_DTYPES),
    "bandwidth.min_bytes": BYTES_CPU,
    "bandwidth.max_bytes_cpu": BYTES_CPU,
    "bandwidth.max_bytes_gpu": BYTES_GPU,
    "bandwidth.step_factor": Int(2, 1024),
    "bandwidth.warmup_iters": Int(0, 1000),
    "bandwidth.iters": Int(1, 100000),
    "bandwidth.min_iters": Int(1, 100000),
    "bandwidth.time_per_size_s": Real(0.0, 3600.0, lo_open=True),
    "bandwidth.pair_rounds": Int(1, 1000),
    "bandwidth.pair_bytes_cpu": BYTES_CPU,
    "bandwidth.pair_bytes_gpu": BYTES_GPU,
    "bandwidth.pair_iters": Int(1, 100000),
    "bandwidth.pair_margin": MARGIN,
    "bandwidth.pair_margin_cpu": MARGIN,
    "bandwidth.pair_reference_percentile": Int(50, 100),
    "diagnosis.waits_min_s": Real(0.0, 60.0),
    "diagnosis.waits_min_counted": Int(1, 1 << 20),
    "diagnosis.waits_min_total_s": Real(0.0, DAY_S),
    "diagnosis.waits_min_fraction": Real(0.0, 1.0),
    "diagnosis.waits_share_of_2": Real(0.5, 1.0),
    "diagnosis.waits_share_of_3": Real(1 / 3, 1.0),
    "diagnosis.waits_share": Real(0.0, 1.0, lo_open=True),
    "diagnosis.stuck_after_s": Real(0.0, DAY_S),
    "diagnosis.dead_after_s": Real(0.5, 3600.0),
    "diagnosis.probe_s": Real(0.05, 600.0),
    "diagnosis.probe_rounds": Int(1, 100),
    "links.retransmits_min": Int(1, 1 << 30),
    "links.retransmit_share": Real(0.0, 1.0, lo_open=True),
    "links.rto_min": Int(1, 1 << 16),
    "links.factor": Real(1.0, 1e6),
    "links.beacon_s": Real(0.0, 60.0),
    "links.latency_iters": Int(0, 100000),
    "links.latency_factor": Real(1.0, 1e6),
    "links.latency_p99_floor_ms": Real(0.0, 3.6e6),
    "links.latency_p99_floor_ms_cpu": Real(0.0, 3.6e6),
    "links.latency_stall_ms": Real(0.0, 3.6e6, lo_open=True),
    "links.collapse_share": Real(0.0, 1.0),
    "compute.straggler_margin": MARGIN,
    "compute.straggler_margin_cpu": MARGIN,
    "compute.straggler_margin_cpu_shared": MARGIN,
    "compute.matrix_size_cpu": Int(1, 16384),
    "compute.matrix_size_gpu": Int(1, 32768),  # three n x n fp32 matrices: 12 GiB at the top
    "compute.dtypes_gpu": Names(GPU_MATMUL_DTYPES),
    "compute.blocks": Int(1, 1000),
    "compute.block_s": Real(0.0, 600.0, lo_open=True),
    "compute.hbm": Any_(),
    "training.layout": OneOf(LAYOUTS),
    "training.steps": Int(0, 10000),
    "training.warmup_steps": Int(0, 10000),
    "training.lr": Real(0.0, 1.0, lo_open=True),
    "training.seed": SEED,
    "training.tolerance_cpu": Real(0.0, 1.0, lo_open=True),
    "training.tolerance_gpu": Real(0.0, 1.0, lo_open=True),
    **{f"training.{device}.{key}": rule for device in ("cpu", "gpu")
       for key, rule in (("vocab", Int(2, 1 << 20)), ("dim", Int(2, 65536)),
                         ("layers", Int(1, 1024)), ("heads", Int(1, 1024)),
                         ("ffn", Int(1, 1 << 20)), ("seq_len", Int(1, 1 << 20)),
                         ("micro_batch", Int(1, 1 << 16)))},
    "history.margin": MARGIN,
    "history.margin_cpu": MARGIN,
    "history.window": Int(1, 10000),
    "history.min_runs": Int(1, 10000),
    "fleet.drain_max_share": Real(0.0, 1.0),  # 1: the breaker never trips
    "fleet.lemon_failures": Int(1, 10000),
    "fleet.lemon_runs": Int(1, 10000),
    "health.sdc_seed": SEED,
    "health.sdc_size_cpu": Int(1, 16384),
    "health.sdc_size_gpu": Int(1, 32768),
    "health.sdc_repeats": Int(1, 100),
    "health.sample_period_s": Real(0.05, 10.0),  # NVML event waits take whole milliseconds
    "health.ecc_uncorrected_volatile_max": Int(0, 1 << 31),
    "health.row_remap_uncorrectable_limit": Int(1, 1 << 20),
    "health.retired_pages_limit": Int(1, 1 << 20),
    "health.xid_critical": Sizes(1, 1023),
    "health.xid_ignored": Sizes(1, 1023),
    "health.xid_window_s": Real(0.0, 365 * DAY_S),
    "health.hw_slowdown_fraction": Real(0.0, 1.0, lo_open=True),
    "health.pcie_replay_ber": Real(0.0, 1.0, lo_open=True),
    "health.nvlink_replay_recovery_max": Int(0, 1 << 31),
    "health.nvlink_crc_per_s_max": Real(0.0, 1e9, lo_open=True),
    "health.hca_symbol_error_per_s": Real(0.0, 1e9),
    "health.hca_port_rcv_errors_per_s": Real(0.0, 1e9),
    "health.hca_link_error_recovery_per_s": Real(0.0, 1e9),
    "health.hca_port_xmit_discards_per_s": Real(0.0, 1e9),
    "health.hca_local_ack_timeout_err_per_s": Real(0.0, 1e9),
    "health.hca_flaps_max": Int(0, 1 << 31),
    "health.temp_warn_margin_c": Int(0, 100),
    "health.require_persistence_mode": Any_(),
    "health.cpu_throttled_fraction": Real(0.0, 1.0, lo_open=True),
}

# (key, other key): key must be >= the other.
_AT_LEAST = (("bandwidth.max_bytes_cpu", "bandwidth.min_bytes"),
             ("bandwidth.max_bytes_gpu", "bandwidth.min_bytes"),
             ("bandwidth.iters", "bandwidth.min_iters"),
             ("fleet.lemon_runs", "fleet.lemon_failures"))


def flat(cfg: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    out = {}
    for key, value in cfg.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def check(cfg: dict[str, Any]) -> None:
    """Raise ConfigError (one line) for the first value out of its range."""
    values = flat(cfg)
    for key, value in values.items():
        rule = RULES.get(key)
        if rule is None:
            raise ConfigError(f"key {key!r} has no range rule (a bug in ddp-smoke)")
        problem = None if value is None else rule.problem(value)
        if isinstance(problem, tuple):
            value, problem = problem
        if problem:
            raise ConfigError(f"key {key!r} = {value!r}: expected {problem}")
    for key, other in _AT_LEAST:
        if values[key] < values[other]:
            raise ConfigError(f"key {key!r} = {values[key]!r}: expected >= {other!r} "
                              f"({values[other]!r})")
