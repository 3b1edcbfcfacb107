"""Presence: NVML opens, every GPU is there and answers, and what NVML could not read.

Rules (sources beside each):

* NVML not opened on a GPU run (ranks on CUDA here, or a profile expecting GPUs): the node
  fails with the cause and the fix in one line (a GPU that cannot be read is not healthy);
  elsewhere it is "not measured".
* GPU count ≠ the profile's ``gpus_per_node``, or fewer than the node's GPU ranks: Azure NHC
  ``check_gpu_count``, GCM ``gpu_num``.
* A GPU whose handle NVML refuses (``nvmlDeviceGetHandleByIndex``: ``UNKNOWN``,
  ``GPU_IS_LOST`` — fallen off the bus, NVIDIA/open-gpu-kernel-modules#387 —
  ``INSUFFICIENT_POWER``, ``IRQ_ISSUE``; nvml.h), or that answers ``GPU_IS_LOST`` to any call
  (GCM ``pynvml_errors.py``: CRITICAL), or ``RESET_REQUIRED`` (leptonai/gpud#1133): named,
  with its bus and serial from the start of the run when it fell off during it.
* A GPU the driver attached (``/proc/driver/nvidia/gpus``) that NVML does not enumerate, or
  whose PCI config space reads all ones: OCI ``check_bus`` ("rev ff").
* Every other refused reading: not measured, grouped by reading and code (``NOT_SUPPORTED``
  is a property of the part, never a pass nor a fault); ``UNKNOWN`` warns.
"""
from __future__ import annotations

from .finding import Finding, GpuRef, Limits, checked, fail, unmeasured, warn
from .readers.kmsg import bus_key
from .readers.nvml import TESTED_BINDING
from .reading import LOST, by_bus, end_gpus, lost, ref, samples, start_gpu, unreachable

_SOURCE_LOST = "nvml.h nvmlDeviceGetHandleByIndex; GCM pynvml_errors.py (GPU_IS_LOST: CRITICAL)"
_REBOOT = "reboot the node; if it recurs, reseat the GPU and its power cables, then drain and RMA"
HANDLE_FAULTS = {
    "NVML_ERROR_UNKNOWN": ("does not answer NVML (fallen off the bus)", _REBOOT),
    LOST: ("is lost (fallen off the bus)", _REBOOT),
    "NVML_ERROR_INSUFFICIENT_POWER": ("reports its external power cables improperly attached",
                                      "reseat the GPU's power cables"),
    "NVML_ERROR_IRQ_ISSUE": ("has an interrupt problem the kernel detected",
                             "reboot the node; if it recurs, drain and RMA"),
}
_QUIET = ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_NO_PERMISSION", "NVML_ERROR_FUNCTION_NOT_FOUND",
          "NVML_ERROR_ARGUMENT_VERSION_MISMATCH", "NVML_ERROR_INVALID_ARGUMENT")
_JUDGED_ELSEWHERE = (LOST, "NVML_ERROR_CORRUPTED_INFOROM", "NVML_ERROR_RESET_REQUIRED")


def judge(node: dict, lim: Limits) -> list[Finding]:
    g = node.get("gpu") or {}
    if g.get("unavailable"):
        return _unavailable(g["unavailable"], lim, (node.get("pci") or {}).get("driver_gpus"))
    if not g:
        return []
    end, out = g.get("end") or {}, []
    count = end.get("count")
    if count is None:
        why = (end.get("errors") or {}).get("gpu count", "no reading")
        return [fail("NVML cannot count the GPUs", f"nvmlDeviceGetCount: {why}",
                     "reboot the node; check the driver's kernel log", _SOURCE_LOST)
                if lim.gpu_run else unmeasured("GPUs", f"nvmlDeviceGetCount: {why}")]
    out.append(checked(f"{count} GPU(s) through NVML (driver {end.get('driver')}, "
                       f"nvidia-ml-py {g.get('binding')})"))
    out += _binding(g.get("binding"))
    expected = lim.expect.get("gpus_per_node")
    if expected is not None and count != expected:
        out.append(fail(f"{count} GPU(s) on the node, the profile expects {expected}",
                        f"nvmlDeviceGetCount = {count}", "reseat or replace the missing GPU; "
                        "reboot", "Azure NHC check_gpu_count; GCM gpu_num"))
    elif count < lim.gpu_ranks:
        out.append(fail(f"{count} GPU(s) visible to NVML for {lim.gpu_ranks} GPU ranks",
                        f"nvmlDeviceGetCount = {count}", "reseat or replace the missing GPU; "
                        "reboot", "GCM gpu_num"))
    out += _gpus(node)
    out += _driver_list(node)
    out += _refused(node)
    return out


def _unavailable(u: dict, lim: Limits, driver_gpus) -> list[Finding]:
    what = f"GPUs not read: {u['cause']} ({u['code']})"
    if lim.gpu_run:
        return [fail(what, "a GPU run (ranks on CUDA, or a profile that expects GPUs) must "
                     "read its GPUs", u["fix"], "issue 33: a GPU run never passes unread")]
    if driver_gpus is None:  # no /proc/driver/nvidia/gpus: a machine without NVIDIA GPUs
        return [unmeasured("GPUs", f"no NVIDIA driver on this node ({u['code']})")]
    return [unmeasured("GPUs", f"{u['cause']} ({u['code']}); fix: {u['fix']}")]


def _binding(version: str | None) -> list[Finding]:
    parts = (version or "").split(".")
    if not parts[0].isdigit():
        return []  # a replay names its recording here
    numbers = tuple(int(p) for p in parts[:3] if p.isdigit())
    if numbers[:1] == (13,) and numbers >= (13, 580, 65):
        return []
    return [warn(f"nvidia-ml-py {version} is outside the tested range: readings its API "
                 "lacks are not measured", f"pip install '{TESTED_BINDING}'",
                 "pyproject.toml pin")]


def _gpus(node: dict) -> list[Finding]:
    """Unreachable and lost GPUs, each named once, with what identifies it best."""
    out = []
    buses = _orphans(node)
    for g in end_gpus(node):
        i, code = g["index"], unreachable(g)
        s = samples(node, i) or {}
        if code in HANDLE_FAULTS or (code is None and lost(node, g)):
            code = code or LOST
            what, action = HANDLE_FAULTS[code]
            gref, first = ref(node, i, buses.get(i)), start_gpu(node, i)
            when = " during the run" if first and not unreachable(first) and \
                LOST not in (first.get("errors") or {}).values() else ""
            out.append(fail(f"{what}{when}", f"{code} from "
                            f"{'nvmlDeviceGetHandleByIndex' if unreachable(g) else 'NVML'}"
                            + (f"; sampler: {_errors(s)}" if s.get("errors") else ""),
                            action, _SOURCE_LOST, gpu=gref))
        elif code is not None:
            out.append(unmeasured("handle", f"nvmlDeviceGetHandleByIndex: {code}",
                                  gpu=ref(node, i)))
        reset = [w for w, c in (g.get("errors") or {}).items()
                 if c == "NVML_ERROR_RESET_REQUIRED"]
        if reset:
            out.append(fail("requires a reset", f"NVML_ERROR_RESET_REQUIRED from "
                            f"{', '.join(reset)}", "reset the GPU (nvidia-smi -r) or reboot "
                            "the node", "leptonai/gpud#1133", gpu=ref(node, i)))
    return out


def _errors(s: dict) -> str:
    """The sampler's refused calls by code: "NVML_ERROR_GPU_IS_LOST x5"."""
    codes: dict[str, int] = {}
    for what, n in s.get("errors", {}).items():
        code = what.rsplit(": ", 1)[-1]
        codes[code] = codes.get(code, 0) + n
    return ", ".join(f"{c} x{n}" for c, n in sorted(codes.items()))


def _orphans(node: dict) -> dict[int, str]:
    """Unreachable or lost GPUs without a bus from NVML, paired with the one bus the driver
    attached that NVML did not name (only when exactly one is left: never a guess)."""
    pci = node.get("pci") or {}
    known = by_bus(node)
    left = [b for b in pci.get("driver_gpus") or () if bus_key(b) not in known]
    nameless = [g["index"] for g in end_gpus(node)
                if (unreachable(g) or lost(node, g)) and not ref(node, g["index"]).bus_id]
    return {nameless[0]: left[0]} if len(left) == 1 and len(nameless) == 1 else {}


def _driver_list(node: dict) -> list[Finding]:
    pci, out = node.get("pci") or {}, []
    if pci.get("driver_gpus") is None:
        return []
    known = by_bus(node)
    paired = set(_orphans(node).values())
    for bus in pci["driver_gpus"]:
        if bus_key(bus) not in known and bus not in paired:
            out.append(fail("attached to the NVIDIA driver but not enumerated by NVML",
                            f"/proc/driver/nvidia/gpus/{bus} exists", _REBOOT,
                            "OCI check_gpu_setup.py check_bus", gpu=GpuRef(None, bus)))
    for bus in pci.get("unresponsive", []):
        index = known.get(bus_key(bus))
        out.append(fail("no longer answers on PCIe", f"config space of {bus} reads 0xffff "
                        "(lspci: rev ff)", _REBOOT, "OCI check_gpu_setup.py check_bus",
                        gpu=ref(node, index, bus) if index is not None else GpuRef(None, bus)))
    return out


def _refused(node: dict) -> list[Finding]:
    """Readings NVML refused on reachable GPUs, grouped by reading and code."""
    groups: dict[tuple[str, str], list[int]] = {}
    for g in end_gpus(node):
        if unreachable(g) or lost(node, g):
            continue
        for what, code in (g.get("errors") or {}).items():
            if code not in _JUDGED_ELSEWHERE:
                groups.setdefault((what, code), []).append(g["index"])
    out = []
    for (what, code), indices in sorted(groups.items()):
        who = f"GPU {indices[0]}" if len(indices) == 1 else f"GPUs {_span(indices)}"
        if code.startswith("NO_BINDING:"):
            out.append(unmeasured(f"{who} {what}", f"the installed nvidia-ml-py lacks "
                                  f"{code[11:]}; pip install '{TESTED_BINDING}'"))
        elif code in _QUIET:
            out.append(unmeasured(f"{who} {what}", code))
        else:
            out.append(warn(f"{who} {what}: NVML answered {code}", "", "nvml.h return codes"))
    return out


def _span(indices: list[int]) -> str:
    if indices == list(range(indices[0], indices[-1] + 1)) and len(indices) > 2:
        return f"{indices[0]}-{indices[-1]}"
    return ",".join(map(str, indices))

