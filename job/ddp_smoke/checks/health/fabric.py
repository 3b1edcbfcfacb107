"""NVSwitch fabric: each GPU's registration with the fabric (HGX H100/H200 and later).

``nvmlDeviceGetGpuFabricInfoV`` (v3 struct, v2 on older drivers) gives state, status, a
health mask and, from v3, a health summary. Rules (gpud ``fabric_state.go``; DCGM level 1
"Fabric Manager"; nvml.h ``NVML_GPU_FABRIC_HEALTH_MASK_*``):

* state ≠ COMPLETED, or COMPLETED with a status ≠ SUCCESS ("must be checked only if state
  returns complete", nvml.h): fails. On every GPU of the node at once it is one finding for
  the node: nvidia-fabricmanager is not running or failed (CUDA error 802 "system not yet
  initialized", NVIDIA/gpu-operator#1043).
* health mask: degraded bandwidth or route unhealthy fails; route recovery or access-timeout
  recovery in progress warns. Health summary UNHEALTHY or LIMITED_CAPACITY fails. "Not
  supported" fields (all of them on Hopper drivers that predate them) are not judged.
"""
from __future__ import annotations

from .finding import Finding, Limits, checked, fail, warn
from .reading import gpus, ref

COMPLETED, SUCCESS = 3, 0
STATES = {0: "not supported", 1: "not started", 2: "in progress", 3: "completed"}
# (shift, what): a 2-bit field whose value 1 means TRUE (nvml.h)
_BAD_BITS = ((0, "degraded bandwidth"), (4, "route unhealthy"))
_WARN_BITS = ((2, "route recovery in progress"), (6, "access-timeout recovery in progress"))
_BAD_SUMMARY = {2: "unhealthy", 3: "limited capacity"}
_SOURCE = "leptonai/gpud fabric_state.go; DCGM level 1 Fabric Manager; nvml.h"
_FM = ("restart nvidia-fabricmanager (systemctl restart nvidia-fabricmanager) and read its "
       "log; if it persists, reboot the node")


def judge(node: dict, lim: Limits) -> list[Finding]:
    fabric = [(g, g["fabric"]) for g in gpus(node) if g.get("fabric")]
    if not fabric:
        return []
    unregistered = [(g, f) for g, f in fabric if f["state"] != COMPLETED]
    if len(fabric) > 1 and len(unregistered) == len(fabric):
        states = sorted({STATES.get(f["state"], str(f["state"])) for _, f in fabric})
        return [fail(f"NVSwitch fabric not completed on all {len(fabric)} GPUs",
                     f"fabric state {', '.join(states)} on every GPU", _FM, _SOURCE)]
    out = [checked(f"NVSwitch fabric registration of {len(fabric)} GPU(s)")]
    for g, f in fabric:
        gpu = ref(node, g["index"])
        evidence = (f"state {STATES.get(f['state'], f['state'])}, status {f.get('status_name')}"
                    f", health mask {f['health_mask']:#x}, summary {f.get('health_summary')}")
        bad = ([f"state {STATES.get(f['state'], f['state'])}"] if f["state"] != COMPLETED else
               [f"status {f.get('status_name')}"] if f["status"] != SUCCESS else [])
        bad += [what for shift, what in _BAD_BITS if (f["health_mask"] >> shift) & 0x3 == 1]
        if f.get("health_summary") in _BAD_SUMMARY:
            bad.append(f"health summary {_BAD_SUMMARY[f['health_summary']]}")
        if bad:
            out.append(fail(f"NVSwitch fabric: {', '.join(bad)}", evidence, _FM, _SOURCE,
                            gpu=gpu))
        for shift, what in _WARN_BITS:
            if (f["health_mask"] >> shift) & 0x3 == 1:
                out.append(warn(f"NVSwitch fabric: {what}", evidence, _SOURCE, gpu=gpu))
    return out
