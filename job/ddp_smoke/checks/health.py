"""Health: every GPU and HCA read directly (NVML, sysfs) and judged; silent data corruption.

One rank per node (local rank 0) reads the node: through NVML (nvidia-ml-py) every GPU's
presence, ECC and remapped rows, recovery action, XIDs (events during the run; the kernel log
where readable), clock-event reasons and PCIe link sampled under the other checks' load,
PCIe replay and NVLink error increases, NVLink and NVSwitch fabric state, persistence, MIG,
VBIOS and stray processes; through sysfs every HCA port's state, rate and error-counter
increases. The harness calls :func:`begin` before the first check: it takes the start readings
and starts the sampler, so that ``health`` (last in the default order) judges the whole run.
Every rank also multiplies the same seeded matrices; ranks of the same device model and
software must agree bit for bit (cuBLAS: same bits on GPUs of one architecture and SM count).
Culprits: the GPU (index, bus id, serial; the rank that uses it) or HCA port, with the
evidence and the operator's action; the rank whose product disagrees. A reading the driver
does not support, or a node without NVIDIA driver or HCAs, is listed as not measured: the
check skips when no hardware could be read anywhere, and says why.
"""
from __future__ import annotations

import hashlib
import os
import time

import torch

from ..config import profiles
from ..model import FAIL, PASS, SKIP, CheckResult
from . import _gpu, _hca
from ._health_rules import judge_node

_STATE: dict = {}  # this process's node reader: NVML module, sampler, start readings


# -- on every rank ----------------------------------------------------------------------------

def begin(ctx) -> None:
    """Harness hook, before the first check: the node reader takes its start readings and
    starts sampling the GPUs. Cheap (a few ms per GPU) and never fatal."""
    if ctx.local_rank != 0 or _STATE:
        return
    _STATE["t0"] = time.monotonic()
    _STATE["hca"] = _hca.read_ports()
    try:
        nv = _gpu.open_nvml()
    except _gpu.Unavailable as e:
        _STATE["unavailable"] = str(e)
        return
    try:  # a driver or binding this code has not met must not stop an acceptance run
        _STATE["nv"], _STATE["gpu"] = nv, _gpu.snapshot(nv)
    except Exception as e:  # noqa: BLE001 — listed as not measured, with why
        _STATE["unavailable"] = f"reading NVML failed: {type(e).__name__}: {e}"
        return
    try:
        sampler = _gpu.Sampler(nv, ctx.section("health")["sample_period_s"])
    except nv.NVMLError as e:
        _STATE["sampler_why"] = f"sampler: {e}"
        return
    sampler.start()
    _STATE["sampler"] = sampler


def run(ctx) -> dict:
    cfg = ctx.section("health")
    t = time.monotonic()
    node = _read_node(ctx) if ctx.local_rank == 0 else None
    read_s = time.monotonic() - t
    return {"sdc": _sdc(ctx, cfg), "gpu_uuid": _gpu_uuid(ctx.device), "pid": os.getpid(),
            "node": node, "node_read_s": round(read_s, 4)}


def _read_node(ctx) -> dict:
    if not _STATE:
        begin(ctx)  # no hook ran (a caller outside the harness): counters start now
    now = time.monotonic()
    window = now - _STATE["t0"]
    hca_end = _hca.read_ports()
    hca = ({"absent": "no /sys/class/infiniband on this node"} if hca_end is None else
           {"start": _STATE["hca"] or {}, "end": hca_end, "window_s": window})
    if "unavailable" in _STATE:
        gpu = {"unavailable": _STATE["unavailable"]}
    else:
        nv = _STATE["nv"]
        end = _gpu.snapshot(nv)
        gpu = {"start": _STATE["gpu"], "end": end, "window_s": window}
        sampler = _STATE.get("sampler")
        if sampler is not None:
            sampler.sample()  # at least one sample now, whatever the period
            gpu.update(sampler.take())
        else:
            gpu["samples"], gpu["xid_events"] = None, _STATE.get("sampler_why")
        gpu["kernel_xids"], gpu["kernel_xids_why"] = _gpu.kernel_xids()
        _STATE["gpu"] = end
    _STATE["hca"], _STATE["t0"] = hca_end, now  # repeat mode: the next pass starts here
    return {"gpu": gpu, "hca": hca}


def _gpu_uuid(device) -> str | None:
    if device.type != "cuda":
        return None
    uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", "") or "")
    return None if not uuid else uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"  # NVML's


def _sdc(ctx, cfg: dict) -> dict:
    """The same seeded product on every rank; the digest of each repeat's result."""
    cuda = ctx.device.type == "cuda"
    n = cfg["sdc_size_gpu" if cuda else "sdc_size_cpu"]
    gen = torch.Generator(device="cpu").manual_seed(cfg["sdc_seed"])
    a = torch.randn(n, n, generator=gen).to(ctx.device)
    b = torch.randn(n, n, generator=gen).to(ctx.device)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # fp32 as written: no TF32, no choice
    digests = []
    try:
        for _ in range(cfg["sdc_repeats"]):
            c = ctx.faults.perturb_product(torch.matmul(a, b))
            digests.append(hashlib.sha256(c.cpu().numpy().tobytes()).hexdigest()[:16])
    finally:
        torch.set_float32_matmul_precision(precision)
    if cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        model = f"{props.name} ({props.multi_processor_count} SMs, CUDA {torch.version.cuda})"
    else:
        model = f"{_cpu_model()} ({torch.get_num_threads()} thread(s))"
    return {"model": f"{model}, torch {torch.__version__}", "n": n, "digests": digests}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                        "cpu")
    except OSError:
        return "cpu"


# -- judging (rank 0, pure) -----------------------------------------------------------------

def judge(ev) -> CheckResult:
    obs, lim = ev.observations, ev.section()
    want = _profile_health(ev.config)
    if len({ev.host(r) for r in range(ev.world_size)}) < 2:  # one node uses no fabric, as
        want = {k: v for k, v in want.items() if not k.startswith("hca")}  # its floors
    culprits, nodes = sdc_culprits(ev), []
    for r, o in enumerate(obs):
        if o.get("node") is None:
            continue
        host = ev.host(r)
        here = [q for q, other in enumerate(obs) if ev.host(q) == host]
        owners = {obs[q]["gpu_uuid"]: q for q in here if obs[q]["gpu_uuid"]}
        node = {**o["node"], "cuda_ranks": len(owners),
                "run_pids": [obs[q]["pid"] for q in here]}
        got = judge_node(node, lim, want)
        nodes.append({"host": host, "rank": r, "read_s": o["node_read_s"], **got})
        for f in got["findings"]:
            culprits.append(ev.culprit(owners.get(f["uuid"]), (
                f"{f['what']}; evidence: {f['evidence']}; action: {f['action']}")))
            culprits[-1].host = host  # a GPU no rank uses, an HCA port: the node is named
    measured = any(not o["node"]["gpu"].get("unavailable") or not o["node"]["hca"].get("absent")
                   for o in obs if o.get("node"))
    status = FAIL if culprits else PASS if measured else SKIP
    sdc = _sdc_summary(obs)
    unmeasured = sorted({m.split(":")[0] + ": " + m.split(":", 1)[1].strip()
                         for n in nodes for m in n["not_measured"]
                         if m.startswith(("GPUs:", "HCAs:"))})
    summary = (f"{len(culprits)} problem(s): {culprits[0].reason}" if culprits else
               f"{sdc}; " + ("; ".join(f"{len(n['checked'])} reading(s) on {n['host']}"
                                       for n in nodes) if measured else
                             "hardware not read: " + "; ".join(unmeasured)))
    figures = {"legend": "per node: checked = what was read and judged; not_measured = what "
                         "could not be, with why; warnings do not fail the check",
               "thresholds": lim, "profile": want, "nodes": nodes, "sdc": sdc,
               "node_read_s_max": max((n["read_s"] for n in nodes), default=0.0)}
    notes = [f"# health {n['host']}: not measured: {m}" for n in nodes
             for m in n["not_measured"][:20]]
    notes += [f"# health {n['host']}: warning: {w}" for n in nodes for w in n["warnings"][:20]]
    return CheckResult("health", status, summary=summary, culprits=culprits, figures=figures,
                       notes=notes)


def _profile_health(config: dict) -> dict:
    return profiles.load(profiles.selected(config)).get("health", {})


def sdc_culprits(ev) -> list:
    """Ranks whose product differs from the majority of their group (same device model and
    software), or from their own earlier repeats."""
    out, groups = [], {}
    for r, o in enumerate(ev.observations):
        d = o["sdc"]["digests"]
        if len(set(d)) > 1:
            out.append(ev.culprit(r, f"silent data corruption: the same product gave "
                                     f"{len(set(d))} different results in {len(d)} repeats "
                                     f"({o['sdc']['model']}); action: drain and RMA"))
        groups.setdefault(o["sdc"]["model"], {}).setdefault(d[0], []).append(r)
    for model, by_digest in groups.items():
        if len(by_digest) < 2:
            continue
        ranked = sorted(by_digest.values(), key=len, reverse=True)
        if len(ranked[0]) == len(ranked[1]):  # no majority: every side stays suspect
            ranks = sorted(r for rs in ranked for r in rs)
            out += [ev.culprit(r, (
                f"silent data corruption: ranks {ranks} of {model} disagree on the seeded "
                "product and no majority tells which is wrong; each is suspect: run the "
                "check with one of them beside a known-good device of the same model"))
                for r in ranks]
            continue
        for rs in ranked[1:]:
            out += [ev.culprit(r, f"silent data corruption: the seeded {model} product "
                                  f"differs from {len(ranked[0])} rank(s) of the same model "
                                  "(bit-exact expected); action: drain and RMA") for r in rs]
    return out


def _sdc_summary(obs: list[dict]) -> str:
    models = {o["sdc"]["model"] for o in obs}
    return (f"SDC: {len(obs)} rank(s), {len(models)} device model(s), "
            f"{obs[0]['sdc']['n']}^2 fp32 product x {len(obs[0]['sdc']['digests'])}")
