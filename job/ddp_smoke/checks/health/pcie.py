"""PCIe: the link each GPU trained to under load, and its replay counter over the run.

Rules:

* The best busy sample's generation and width below the profile's ``pcie_gen``/``pcie_width``
  (else the device-and-system maximum NVML reports) fail: a Gen5 x16 GPU trained down to
  Gen4 x8 by a retimer or a badly seated riser (NVIDIA/NVSentinel#890). Idle links train down
  by design (NVIDIA/open-gpu-kernel-modules#731): only busy samples count (:mod:`.clocks`
  says when a GPU was never busy).
* Replays (field ``NVML_FI_DEV_PCIE_REPLAY_COUNTER``) rising faster than
  ⌈``pcie_replay_ber`` × line rate × lanes⌉ per minute (Gen5 x16: 31/min) fail: DCGM health
  ``GetExpectedPcieReplayRate``.
"""
from __future__ import annotations

import math

from .finding import Finding, Limits, fail
from .reading import delta, gpus, ref, samples, start_gpu, window_s

GT_PER_S = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}  # line rate per lane
_RESEAT = "reseat the GPU (riser, retimer, cable); if it persists, drain and RMA"


def judge(node: dict, lim: Limits) -> list[Finding]:
    out = []
    for g in gpus(node):
        gpu, s = ref(node, g["index"]), samples(node, g["index"]) or {}
        gen_want = lim.expect.get("pcie_gen") or g.get("pcie_max_gen")
        width_want = lim.expect.get("pcie_width") or g.get("pcie_max_width")
        gen, width = s.get("pcie_gen_busy_max"), s.get("pcie_width_busy_max")
        if s.get("busy") and ((gen_want and gen < gen_want) or
                              (width_want and width < width_want)):
            out.append(fail(f"PCIe link at Gen{gen} x{width} under load, expected "
                            f"Gen{gen_want} x{width_want}", f"best of {s['busy']} busy samples; "
                            f"device/system maximum Gen{g.get('pcie_max_gen')} "
                            f"x{g.get('pcie_max_width')}", _RESEAT, "NVIDIA/NVSentinel#890",
                            gpu=gpu))
        out += _replays(g, start_gpu(node, g["index"]), window_s(node), lim.thresholds, gpu)
    return out


def _replays(g: dict, g0: dict | None, window: float, t: dict, gpu) -> list[Finding]:
    rise = delta(g.get("pcie_replay"), (g0 or {}).get("pcie_replay"))
    gen, width = g.get("pcie_max_gen"), g.get("pcie_max_width")
    if rise is None or gen not in GT_PER_S or not width or window <= 0:
        return []
    per_min = math.ceil(t["pcie_replay_ber"] * GT_PER_S[gen] * 1e9 * 60 * width)
    allowed = per_min * max(1.0, window / 60)
    if rise <= allowed:
        return []
    return [fail(f"{rise} PCIe replays in {window:.0f} s", f"allowed {allowed:.0f} at "
                 f"Gen{gen} x{width} (BER {t['pcie_replay_ber']:g})", _RESEAT,
                 "DCGM health GetExpectedPcieReplayRate", gpu=gpu)]
