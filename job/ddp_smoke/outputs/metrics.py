"""``--prometheus FILE``: the verdict and key figures for node_exporter's textfile collector.

Rank 0 writes FILE atomically (temp file in the same directory, then rename; the temp name does
not end in ``.prom``, so the collector never reads half a file) after the report. Point FILE
into the collector's directory (``--collector.textfile.directory``) on rank 0's node, with a
name ending in ``.prom``. Each run replaces the file; series (all gauges)::

    ddp_smoke_pass                                  1 verdict pass, 0 fail
    ddp_smoke_info{run_id,version,backend}          1; the run's identity
    ddp_smoke_world_size, ddp_smoke_nodes           ranks and hosts
    ddp_smoke_check_pass{check,host}                1 the check passed on this host, 0 it
                                                    failed there (named by it, or a failure
                                                    that names no host); skipped checks absent
    ddp_smoke_host_status{host,status}              1 for the host's status (good, suspect,
                                                    bad; see ddp_smoke.outputs.hosts), 0 for the others
    ddp_smoke_busbw_gbps{collective,size_bytes}     bandwidth sweep, nccl-tests' busbw, GB = 1e9 B
    ddp_smoke_pair_busbw_gbps{host_a,host_b[,rail]} bandwidth node pairs (sendrecv), per rail
    ddp_smoke_tflops{host,gpu,local_rank,dtype}     compute, best block; gpu = the CUDA device
                                                    index, empty for a CPU rank
    ddp_smoke_training_tokens_per_second{host,gpu,local_rank}  training, the median step
    ddp_smoke_training_mfu{host,gpu,local_rank}     training, against the profile's peak (GPU)
    ddp_smoke_run_duration_seconds                  the run's wall time
    ddp_smoke_last_run_timestamp_seconds            when this file was written (Unix time)

Labels hold no run id except ``ddp_smoke_info``'s, so the other series stay the same series
from one run to the next.

A practice run (``--fault``: failures made on purpose, to test the alerting path) adds the label
``practice="true"`` to every series, and ``ddp_smoke_info`` carries the spec as ``fault``:
an alert rule can route it as a drill (``ddp_smoke_pass{practice!="true"} == 0`` pages only
for real failures) and a dashboard can tell it from a real failure. A real run's series carry
no such label.
"""
from __future__ import annotations

import os
import sys
import time

from ..model import get_field, injected
from .hosts import HOST_STATUSES, culprit_hosts, hosts_section
from .files import write_atomic

_HELP = {
    "pass": "1 when the last ddp-smoke run's verdict was pass, else 0.",
    "info": "Identity of the last ddp-smoke run (value always 1).",
    "world_size": "Ranks in the last ddp-smoke run.",
    "nodes": "Hosts in the last ddp-smoke run.",
    "check_pass": "1 when the check passed on the host, 0 when it failed there.",
    "host_status": "1 for the host's status in the last run (good, suspect or bad), else 0.",
    "busbw_gbps": "Bus bandwidth of a collective at a message size, GB/s (1e9 B/s), nccl-tests "
                  "definition.",
    "pair_busbw_gbps": "Bandwidth between two hosts' leader ranks (sendrecv), GB/s (1e9 B/s).",
    "tflops": "Dense matmul throughput of a rank's device, TFLOPS (1e12 FLOP/s), best block.",
    "training_tokens_per_second": "Tokens a rank trained per second in the training check "
                                  "(its median step).",
    "training_mfu": "Model FLOPs utilisation of a rank in the training check (0..1) against "
                    "the profile's dense peak.",
    "run_duration_seconds": "Wall time of the last ddp-smoke run.",
    "last_run_timestamp_seconds": "When the last ddp-smoke run wrote this file (Unix time).",
}


def _escape(value) -> str:
    """A label value as the text format wants it: backslash, quote and newline escaped."""
    return str(value).replace("\\", r"\\").replace('"', r"\"").replace("\n", r"\n")


def _sample(name: str, labels: dict, value: float) -> str:
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    return f"ddp_smoke_{name}{{{inner}}} {float(value)!r}" if inner else \
        f"ddp_smoke_{name} {float(value)!r}"


def _check_pass(report, hosts: list[dict]) -> list[tuple[dict, float]]:
    ranks = list(get_field(report, "ranks") or [])
    out = []
    for check in get_field(report, "checks") or []:
        status = get_field(check, "status")
        if status == "skip":
            continue
        named = {h for c in get_field(check, "culprits") or []
                 for h in culprit_hosts(c, ranks)[0]}
        for h in hosts:
            failed = status != "pass" and (h["host"] in named or not named)
            out.append(({"check": get_field(check, "name"), "host": h["host"]}, 0 if failed else 1))
    return out


def _figures(report, name: str) -> dict:
    check = next((c for c in get_field(report, "checks") or [] if get_field(c, "name") == name), None)
    return (get_field(check, "figures") or {}) if check is not None else {}


def _bandwidth(report) -> tuple[list, list]:
    figures = _figures(report, "bandwidth")
    busbw = [({"collective": r["collective"], "size_bytes": r["size_bytes"]}, r["busbw_gbps"])
             for r in figures.get("results", [])]
    pairs = [({"host_a": p["host_a"], "host_b": p["host_b"],
               **({"rail": p["rail"]} if "rail" in p else {})}, p["busbw_gbps"])
             for p in (figures.get("pairs") or {}).get("results", [])]
    return busbw, pairs


def _slot(ranks: list, rank) -> dict:
    """A rank's device labels: its host's GPU index (empty for a CPU rank: never "0", it read
    as GPU 0) and its local rank."""
    known = isinstance(rank, int) and 0 <= rank < len(ranks)
    local = ranks[rank].get("local_rank") if known else None
    device = str(ranks[rank].get("device") or "") if known else ""
    return {"gpu": device.partition("cuda:")[2], "local_rank": local if local is not None
            else rank}


def _tflops(report) -> list:
    ranks = list(get_field(report, "ranks") or [])
    return [({"host": r.get("host"), **_slot(ranks, r.get("rank")), "dtype": dtype},
             m["tflops"])
            for r in _figures(report, "compute").get("ranks", [])
            for dtype, m in (r.get("matmul") or {}).items()]


def _training(report, key: str) -> list:
    ranks = list(get_field(report, "ranks") or [])
    return [({"host": r.get("host"), **_slot(ranks, r.get("rank"))}, r[key])
            for r in _figures(report, "training").get("ranks", []) if r.get(key) is not None]


def render(report, run_id: str, now_s: float) -> str:
    """The whole textfile (pure): HELP and TYPE once per metric, then its samples."""
    d = report if isinstance(report, dict) else report.to_dict()
    hosts = d.get("hosts") or hosts_section(report)
    busbw, pairs = _bandwidth(d)
    series = {
        "pass": [({}, d["verdict"] == "pass")],
        "info": [({"run_id": run_id, "version": d.get("version"), "backend": d.get("backend")},
                  1)],
        "world_size": [({}, d["world_size"])],
        "nodes": [({}, d["nodes"])],
        "check_pass": _check_pass(d, hosts),
        "host_status": [({"host": h["host"], "status": v}, h["status"] == v)
                        for h in hosts for v in HOST_STATUSES],
        "busbw_gbps": busbw,
        "pair_busbw_gbps": pairs,
        "tflops": _tflops(d),
        "training_tokens_per_second": _training(d, "tokens_per_s"),
        "training_mfu": _training(d, "mfu"),
        "run_duration_seconds": [({}, (d.get("timings") or {}).get("total_s", 0.0))],
        "last_run_timestamp_seconds": [({}, now_s)],
    }
    practice = injected(d)
    if practice:
        series["info"][0][0]["fault"] = practice
    mark = {"practice": "true"} if practice else {}
    lines = []
    for name, samples in series.items():
        if not samples:
            continue
        lines += [f"# HELP ddp_smoke_{name} {_HELP[name]}", f"# TYPE ddp_smoke_{name} gauge"]
        lines += [_sample(name, {**labels, **mark}, value) for labels, value in samples]
    return "\n".join(lines) + "\n"


def write(report, run_id: str) -> str | None:
    """Rank 0: write ``--prometheus FILE`` when set; return its path once written. Never
    raises: the report is written and the verdict must still reach every rank; a failure is
    one line on stderr."""
    config = get_field(report, "config") or {}
    path = config.get("prometheus")
    if not path:
        return None
    try:
        write_atomic(path, render(report, run_id, time.time()))
    except Exception as e:  # noqa: BLE001
        print(f"ddp-smoke: --prometheus {path}: not written: {type(e).__name__}: {e}",
              file=sys.stderr)
        return None
    return os.path.abspath(path)
