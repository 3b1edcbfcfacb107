"""The GPU's settings: persistence, MIG, InfoROM, VBIOS uniformity, stray processes.

Rules:

* Persistence mode off, when ``require_persistence_mode``: DCGM level 1 "Persistence Mode".
* MIG on: training needs the whole GPU, and row-remap and NVLink readings are unsupported
  under MIG (nvml.h); AWS runs its level-4 diagnostics only with MIG off. A MIG change pending
  the next reset warns.
* InfoROM invalid (``nvmlDeviceValidateInforom``, or ``CORRUPTED_INFOROM`` from any call):
  DCGM level 1 "Inforom"; GCM ``pynvml_errors.py`` (CRITICAL); nvidia-smi exit 14 (Azure NHC).
* A GPU whose VBIOS differs from the node's common one: GCM ``vbios_mismatch``.
* A compute process that is not this run's holds GPU memory: GCM ``running_procs``, DCGM
  level 1 "Graphics Processes" — judged only when NVML shows this run's own processes (in
  another PID namespace it shows none of them, and every PID would look stray).
"""
from __future__ import annotations

from .finding import Finding, Limits, fail, unmeasured, warn
from .reading import gpus, ref

_SOURCE_MIG = "nvml.h (remapped rows, NVLink unsupported under MIG); AWS level-4 pre-flight"


def judge(node: dict, lim: Limits) -> list[Finding]:
    out, readable = [], list(gpus(node))
    pids = set(lim.run_pids)
    ours = bool(pids) and any(p["pid"] in pids for g in readable
                              for p in g.get("processes") or ())
    for g in readable:
        gpu = ref(node, g["index"])
        if g.get("persistence") is False and lim.thresholds["require_persistence_mode"]:
            out.append(fail("persistence mode is off", "nvmlDeviceGetPersistenceMode = "
                            "disabled", "enable persistence (nvidia-persistenced, or "
                            "nvidia-smi -pm 1)", "DCGM level 1 Persistence Mode", gpu=gpu))
        mig = g.get("mig")
        if mig and mig[0]:
            out.append(fail("MIG is on", "nvmlDeviceGetMigMode current = enabled",
                            "disable MIG (nvidia-smi -mig 0) and reset the GPU", _SOURCE_MIG,
                            gpu=gpu))
        elif mig and mig[1] != mig[0]:
            out.append(warn("a MIG mode change is pending the next GPU reset",
                            f"nvmlDeviceGetMigMode = {mig}", _SOURCE_MIG, gpu=gpu))
        if g.get("inforom_valid") is False or \
                "NVML_ERROR_CORRUPTED_INFOROM" in (g.get("errors") or {}).values():
            out.append(fail("InfoROM corrupted", "NVML_ERROR_CORRUPTED_INFOROM",
                            "drain and RMA (or reflash the InfoROM with NVIDIA support)",
                            "DCGM level 1 Inforom; GCM pynvml_errors.py", gpu=gpu))
        out += _stray(g, pids, ours, gpu)
    return out + _vbios(node, readable)


def _stray(g: dict, pids: set, ours: bool, gpu) -> list[Finding]:
    procs = g.get("processes")
    if procs is None or not pids:
        return []
    stray = [p for p in procs if p["pid"] not in pids]
    if stray and ours:
        return [fail(f"{len(stray)} process(es) of another job hold GPU memory",
                     "; ".join(f"pid {p['pid']} {p['used_mib']} MiB" for p in stray[:5]),
                     "stop the stray processes (or drain the node until they end)",
                     "GCM running_procs; DCGM level 1 Graphics Processes", gpu=gpu)]
    if stray:
        return [unmeasured(f"{gpu} stray processes", "NVML does not show this run's own "
                           "PIDs (another PID namespace)")]
    return []


def _vbios(node: dict, readable: list[dict]) -> list[Finding]:
    seen: dict[str, list[dict]] = {}
    for g in readable:
        if g.get("vbios"):
            seen.setdefault(g["vbios"], []).append(g)
    if len(seen) < 2:
        return []
    common = max(seen, key=lambda v: len(seen[v]))
    return [fail(f"VBIOS {v} differs from the node's {common}",
                 f"VBIOS versions on the node: {sorted(seen)}",
                 f"flash VBIOS {common} (the node's common one)", "GCM vbios_mismatch",
                 gpu=ref(node, g["index"]))
            for v, odd in seen.items() if v != common for g in odd]
