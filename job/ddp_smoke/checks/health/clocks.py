"""Clocks and temperatures under load: what the sampler saw while compute and bandwidth ran.

Rules:

* HW slowdown, HW thermal slowdown or HW power brake in ≥ ``hw_slowdown_fraction`` (60 %) of
  the busy samples: gpud ``hw-slowdown`` (constant HW slowdown: a failing PSU or a hot GPU,
  leptonai/gpud#330). SW thermal slowdown warns (Azure NHC: clock events warn only).
* Power or thermal violation time rising during the run (``nvmlDeviceGetViolationStatus``)
  warns: DCGM health ``DCGM_FR_CLOCKS_EVENT_POWER``/``THERMAL`` (MONITOR).
* The GPU's hottest sample ≥ its own slowdown threshold, or HBM ≥ its memory max operating
  temperature (``nvmlDeviceGetTemperatureThreshold`` SLOWDOWN / MEM_MAX: the limits
  nvidia-smi -q prints as "GPU Slowdown Temp", "Memory Max Operating Temp"): fails; within
  ``temp_warn_margin_c`` of either: warns. GCM ``gpu_temperature`` uses a fixed threshold
  instead; the GPU's own limits fit every SKU.
"""
from __future__ import annotations

from .finding import Finding, Limits, checked, fail, unmeasured, warn
from .reading import delta, gpus, ref, samples, start_gpu, window_s

HW_REASONS = {"hw_slowdown": "HW slowdown (clocks cut by half or more)",
              "hw_thermal": "HW thermal slowdown", "hw_power_brake": "HW power brake"}
_COOLING = "inspect cooling and power supply; if it persists, drain and RMA"


def judge(node: dict, lim: Limits) -> list[Finding]:
    out, t, judged = [], lim.thresholds, 0
    for g in gpus(node):
        gpu, s = ref(node, g["index"]), samples(node, g["index"])
        if s is None:
            continue
        if s["errors"]:
            out.append(unmeasured(f"{gpu} sampling", ", ".join(
                f"{k} x{n}" for k, n in sorted(s["errors"].items()))[:300]))
        out += _temperatures(g, s, t, gpu)
        out += _violations(g, start_gpu(node, g["index"]), window_s(node), gpu)
        if not s["busy"]:
            out.append(unmeasured(f"{gpu} under load", f"never busy in {s['n']} sample(s): "
                                  "clock-event reasons and PCIe link not judged"))
            continue
        judged += 1
        for name, words in HW_REASONS.items():
            share = s[name] / s["busy"]
            if share >= t["hw_slowdown_fraction"]:
                out.append(fail(f"{words} in {share:.0%} of busy samples",
                                f"{s[name]} of {s['busy']} busy samples (limit "
                                f"{t['hw_slowdown_fraction']:.0%}); explains a low compute or "
                                "bandwidth figure on this GPU", _COOLING,
                                "leptonai/gpud hw-slowdown", gpu=gpu))
        if s["sw_thermal"]:
            out.append(warn(f"SW thermal slowdown in {s['sw_thermal']} of {s['busy']} busy "
                            "samples", "", "Azure NHC azure_gpu_clock_throttling.nhc", gpu=gpu))
    if judged:
        out.append(checked(f"clock-event reasons under load on {judged} GPU(s)"))
    return out


def _temperatures(g: dict, s: dict, t: dict, gpu) -> list[Finding]:
    out, margin = [], t["temp_warn_margin_c"]
    for key, limit_key, name in (("temp_max_c", "temp_slowdown_c", "GPU slowdown"),
                                 ("mem_temp_max_c", "temp_mem_max_c", "memory max operating")):
        hot, limit = s.get(key), g.get(limit_key)
        if hot is None or not limit:
            continue
        evidence = f"hottest sample {hot} °C, the GPU's {name} temperature {limit} °C"
        source = "nvmlDeviceGetTemperatureThreshold (the GPU's own limit)"
        if hot >= limit:
            out.append(fail(f"{'HBM' if key.startswith('mem') else 'GPU'} at its {name} "
                            "temperature", evidence, _COOLING, source, gpu=gpu))
        elif hot >= limit - margin:
            out.append(warn(f"{'HBM' if key.startswith('mem') else 'GPU'} within {margin} °C "
                            f"of its {name} temperature", evidence, source, gpu=gpu))
    return out


def _violations(g: dict, g0: dict | None, window: float, gpu) -> list[Finding]:
    out = []
    for kind in ("power", "thermal"):
        rise = delta((g.get("violation_ns") or {}).get(kind),
                     ((g0 or {}).get("violation_ns") or {}).get(kind))
        if rise and rise > 0 and window > 0:
            out.append(warn(f"{kind} violation for {rise / 1e9:.2f} s of the {window:.0f} s run "
                            "(clocks held below the target)", "nvmlDeviceGetViolationStatus",
                            f"DCGM health DCGM_FR_CLOCKS_EVENT_{kind.upper()}", gpu=gpu))
    return out
