"""XIDs and NVSwitch SXids: NVML events during the run and the kernel log of the last hours.

Rules:

* An XID in ``xid_critical`` (DCGM health's "devastating" set 48 74 79 95 119 120 140, plus
  64 and 92) during the run or within ``xid_window_s`` (Azure NHC ``azure_gpu_xid.nhc``: 2 h)
  fails its GPU with the XID's action (NVIDIA XID catalogue); ``xid_ignored`` (application
  XIDs, k8s-device-plugin's skip list) are dropped; any other XID warns.
* XID 154 names the recovery the driver requires ("GPU Reset Required", "Node Reboot
  Required", …): fails with that action (NVIDIA XID catalogue; open-gpu-kernel-modules#1134).
* "GPU … has fallen off the bus" without an XID line (NVIDIA/NVSentinel#155): fails like XID 79.
* An SXid marked Fatal fails the node, naming the NVSwitch: "Restart the system to reset the
  GPUs and NVSwitches" (NVIDIA Fabric Manager user guide, SXid errors); non-fatal SXids warn.
* An unreadable kernel log, or one without a single NVRM line on a GPU node (not this host's
  log: gVisor, some containers), is not measured; so is an event channel that failed.
"""
from __future__ import annotations

from .finding import Finding, GpuRef, Limits, checked, fail, unmeasured, warn
from .memory import RECOVERY_ACTIONS
from .readers.kmsg import bus_key
from .reading import by_bus, end_gpus, gpu_reading, ref

_REBOOT_RMA = "if it recurs, drain and RMA"
XID_ACTIONS = {79: f"reboot the node (the GPU fell off the bus); {_REBOOT_RMA}",
               74: f"reset the GPU and reseat its NVLink; {_REBOOT_RMA}",
               48: f"reset the GPU (double-bit ECC); {_REBOOT_RMA}",
               64: "reset the GPU (row remap failure); drain and RMA",
               92: "reset the GPU (high single-bit ECC rate)",
               95: f"reset the GPU (uncontained ECC error); {_REBOOT_RMA}",
               119: f"reset the GPU (GSP timeout); {_REBOOT_RMA}",
               120: f"reset the GPU (GSP error); {_REBOOT_RMA}",
               140: f"reset the GPU (unrecovered ECC error); {_REBOOT_RMA}"}
_SOURCE = "DCGM health devastating XIDs; NVIDIA XID catalogue; Azure NHC azure_gpu_xid.nhc"


def judge(node: dict, lim: Limits) -> list[Finding]:
    out: list[Finding] = []
    seen: dict[tuple, Finding] = {}
    out += _events(node, seen, lim)
    out += _kernel(node, seen, lim)
    return out + list(seen.values())


def _gpu(node: dict, index: int | None, bus: str | None) -> GpuRef:
    if index is None and bus is not None:
        index = by_bus(node).get(bus_key(bus))
    return ref(node, index, bus) if index is not None else GpuRef(None, bus)


def _xid(node, seen, lim, index, bus, xid: int, when: str) -> None:
    t = lim.thresholds
    gpu = _gpu(node, index, bus)
    key = (gpu.index if gpu.index is not None else bus_key(gpu.bus_id), xid)
    if xid in t["xid_ignored"]:
        return
    if key in seen:  # the same XID from the event and the kernel log: one finding, both said
        f = seen[key]
        seen[key] = Finding(f.what, f"{f.evidence}; {when}", f.action, f.source, f.level, f.gpu)
        return
    if xid in t["xid_critical"]:
        seen[key] = fail(f"XID {xid}", when, XID_ACTIONS.get(xid, f"reset the GPU; "
                                                             f"{_REBOOT_RMA}"), _SOURCE, gpu=gpu)
    else:
        seen[key] = warn(f"XID {xid}", when, "k8s-device-plugin xid skip list", gpu=gpu)


def _events(node: dict, seen: dict, lim: Limits) -> list[Finding]:
    g = gpu_reading(node)
    if not g:
        return []
    events = g.get("events") or {}
    out = []
    if events.get("ok"):
        out.append(checked(f"XID events during the run (NVML event set on GPU(s) "
                           f"{events.get('registered')})"))
    else:
        out.append(unmeasured("XID events during the run", events.get("why") or "not read"))
    for index, why in sorted((events.get("refused") or {}).items()):
        out.append(unmeasured(f"XID events on GPU {index}", why))
    if events.get("ok") is False and events.get("registered"):
        out.append(warn("the NVML event channel failed during the run: XIDs after it rely on "
                        "the kernel log", events.get("why") or "", "nvml.h nvmlEventSetWait"))
    for e in g.get("xids", []):
        _xid(node, seen, lim, e.get("index"), None, e["xid"],
             f"NVML XID event {e.get('at_s', '?')} s into the run")
    return out


def _gpu_node(node: dict, lim: Limits) -> bool:
    pci = node.get("pci") or {}
    return lim.gpu_run or bool(end_gpus(node)) or bool(pci.get("driver_gpus"))


def _kernel(node: dict, seen: dict, lim: Limits) -> list[Finding]:
    k, window = node.get("kmsg") or {}, lim.thresholds["xid_window_s"]
    if k.get("unavailable"):
        return [unmeasured("past XIDs", k["unavailable"])]
    if not k:
        return []
    if not k.get("nvrm") and _gpu_node(node, lim):
        return [unmeasured("past XIDs", f"the kernel log ({k.get('records')} records) holds no "
                           "NVRM line on a GPU node: not this host's log (gVisor, a container's "
                           "own /dev/kmsg) or the driver's messages rotated out")]
    out = [checked(f"kernel log ({k.get('records')} records): XIDs, SXids and fallen-off-the-"
                   f"bus messages of the last {window:.0f} s")]
    if k.get("partial"):
        out.append(unmeasured("past XIDs", f"kernel log {k['partial']}"))

    def recent(r):
        return r.get("age_s") is None or r["age_s"] <= window

    def when(r):
        age = r.get("age_s")
        return f"kernel log: {r['text'][:120]!r}" + ("" if age is None else f", {age:.0f} s ago")

    for r in filter(recent, k.get("xids", [])):
        _xid(node, seen, lim, None, r["bus"], r["xid"], when(r))
    for r in filter(recent, k.get("fallen", [])):
        gpu = _gpu(node, None, r["bus"])
        if (gpu.index if gpu.index is not None else bus_key(gpu.bus_id), 79) not in seen:
            out.append(fail("fell off the bus (no XID line)", when(r), XID_ACTIONS[79],
                            "NVIDIA/NVSentinel#155", gpu=gpu))
    for r in filter(recent, k.get("recovery", [])):
        if r["action"]:
            out.append(fail(f"the driver requires recovery: {r['action_name']} (XID 154)",
                            when(r), RECOVERY_ACTIONS.get(r["action"], r["action_name"]),
                            "NVIDIA XID catalogue (XID 154); open-gpu-kernel-modules#1134",
                            gpu=_gpu(node, None, r["bus"])))
    out += _sxids([r for r in k.get("sxids", []) if recent(r)], when)
    return out


def _sxids(records: list[dict], when) -> list[Finding]:
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["bus"], r["sxid"]), []).append(r)
    out = []
    for (bus, sxid), rs in sorted(groups.items()):
        what = f"NVSwitch at PCI {bus}: SXid {sxid}"
        if any(r["fatal"] for r in rs):
            out.append(fail(f"{what} (fatal)", when(next(r for r in rs if r["fatal"])),
                            "reboot the node (resets the GPUs and NVSwitches); if it recurs, "
                            "drain and RMA the baseboard", "NVIDIA Fabric Manager user guide, "
                            "SXid errors; leptonai/gpud sxid"))
        else:
            out.append(warn(f"{what} (non-fatal, {len(rs)} line(s))", when(rs[0]),
                            "NVIDIA Fabric Manager user guide, SXid errors"))
    return out
