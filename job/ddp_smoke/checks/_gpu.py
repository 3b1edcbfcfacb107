"""GPU readings through NVML (nvidia-ml-py's ``pynvml``), one node at a time.

Three kinds of reading, all plain JSON-able dicts so that recorded ones judge the same way:

* :func:`snapshot` — every GPU's state and cumulative counters: identity (index, bus id, UUID,
  serial, VBIOS), ECC mode and volatile uncorrected count, remapped rows, retired pages, the
  recovery-action field, persistence, MIG, NVSwitch fabric, compute processes, PCIe maximum
  and replay counter, NVLink state per link and the NVLink error totals. Taken at
  :class:`Sampler` start and again when the health check runs: counters are judged as
  increases across the run (DCGM health and NVSentinel judge rates, not lifetime totals).
* :class:`Sampler` — a thread sampling clock-event reasons, utilisation and the PCIe link
  while the other checks (compute, bandwidth) load the GPUs, and registering critical XID
  events for the whole run (NVML sees only events after registration).
* :func:`kernel_xids` — past XIDs from the kernel log (/dev/kmsg), or why it is unreadable.

A reading the driver does not support is recorded under ``not_measured`` with NVML's own
words, never as a zero. ``pynvml`` is imported on first use only (``--help`` stays fast).
"""
from __future__ import annotations

import os
import re
import threading
import time

# clock-event reason bits (nvml.h nvmlClocksEventReason*)
IDLE, HW_SLOWDOWN, SW_THERMAL, HW_THERMAL, HW_POWER_BRAKE = 0x1, 0x8, 0x20, 0x40, 0x80
REASON_BITS = {"hw_slowdown": HW_SLOWDOWN, "hw_thermal": HW_THERMAL,
               "hw_power_brake": HW_POWER_BRAKE, "sw_thermal": SW_THERMAL}
# nvmlDeviceGetFieldValues ids (nvml.h): NVLink error totals over all links, PCIe replays,
# recovery action
FI_NVLINK_CRC_FLIT_TOTAL, FI_NVLINK_REPLAY_TOTAL, FI_NVLINK_RECOVERY_TOTAL = 38, 52, 59
FI_PCIE_REPLAY, FI_RECOVERY_ACTION = 94, 230
_FIELDS = {FI_NVLINK_CRC_FLIT_TOTAL: "nvlink_crc_flit", FI_NVLINK_REPLAY_TOTAL: "nvlink_replay",
           FI_NVLINK_RECOVERY_TOTAL: "nvlink_recovery", FI_PCIE_REPLAY: "pcie_replay",
           FI_RECOVERY_ACTION: "recovery_action"}
_XID_LINE = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)"
                       r"[^)]*\): (\d+)")


class Unavailable(Exception):
    """NVML cannot be used on this node; the message says why (shown as "not measured")."""


def open_nvml():
    """The initialised ``pynvml`` module, or Unavailable with the reason."""
    try:
        import pynvml
    except ImportError as e:
        raise Unavailable(f"nvidia-ml-py is not installed ({e})") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:  # LibraryNotFound, DriverNotLoaded, NoPermission …
        raise Unavailable(f"{type(e).__name__}: {e}") from None
    return pynvml


def bus_key(bus_id: str) -> tuple[int, int, int] | None:
    """(domain, bus, device) of "00000000:18:00.0" or "0000:18:00": one key for NVML's, torch's,
    sysfs's and the kernel log's spellings of a PCI address."""
    parts = re.split(r"[:.]", bus_id.strip())
    try:
        return int(parts[0], 16), int(parts[1], 16), int(parts[2], 16)
    except (IndexError, ValueError):
        return None


class _Reader:
    """Calls into NVML for one GPU, keeping what was unsupported and whether the GPU is lost."""

    def __init__(self, nv, out: dict):
        self.nv, self.out = nv, out

    def __call__(self, what: str, fn, *args):
        try:
            return fn(*args)
        except self.nv.NVMLError as e:
            if getattr(e, "value", None) == self.nv.NVML_ERROR_GPU_IS_LOST:
                self.out["lost"] = True
            self.out.setdefault("not_measured", {})[what] = str(e)
            return None


def _text(v):
    return v.decode(errors="replace") if isinstance(v, bytes) else v


def snapshot(nv) -> dict:
    """Every GPU's state and counters on this node, and the driver version."""
    node = {"driver": None, "gpus": [], "not_measured": {}}
    node_read = _Reader(nv, node)
    node["driver"] = _text(node_read("driver", nv.nvmlSystemGetDriverVersion))
    count = node_read("gpu count", nv.nvmlDeviceGetCount)
    node["count"] = count
    for i in range(count or 0):
        node["gpus"].append(_gpu(nv, i))
    return node


def _gpu(nv, index: int) -> dict:
    g: dict = {"index": index}
    read = _Reader(nv, g)
    h = read("handle", nv.nvmlDeviceGetHandleByIndex, index)
    if h is None:
        return g
    g["name"] = _text(read("name", nv.nvmlDeviceGetName, h))
    g["uuid"] = _text(read("uuid", nv.nvmlDeviceGetUUID, h))
    g["serial"] = _text(read("serial", nv.nvmlDeviceGetSerial, h))
    pci = read("bus id", nv.nvmlDeviceGetPciInfo, h)
    g["bus_id"] = _text(pci.busId) if pci is not None else None
    g["vbios"] = _text(read("vbios", nv.nvmlDeviceGetVbiosVersion, h))
    ecc = read("ecc mode", nv.nvmlDeviceGetEccMode, h)
    g["ecc_enabled"] = None if ecc is None else bool(ecc[0])
    g["ecc_uncorrected_volatile"] = read(
        "volatile uncorrected ecc", nv.nvmlDeviceGetTotalEccErrors, h,
        nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)
    rows = read("remapped rows", nv.nvmlDeviceGetRemappedRows, h)
    g["remapped_rows"] = None if rows is None else dict(zip(
        ("correctable", "uncorrectable", "pending", "failure"), map(int, rows)))
    if rows is None:  # pre-Ampere GPUs retire pages instead of remapping rows
        pending = read("retired pages pending", nv.nvmlDeviceGetRetiredPagesPendingStatus, h)
        sbe = read("retired pages (sbe)", nv.nvmlDeviceGetRetiredPages, h,
                   nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
        dbe = read("retired pages (dbe)", nv.nvmlDeviceGetRetiredPages, h,
                   nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
        g["retired_pages"] = None if pending is None else {
            "pending": bool(pending), "sbe": len(sbe or ()), "dbe": len(dbe or ())}
    g["persistence"] = _flag(read("persistence mode", nv.nvmlDeviceGetPersistenceMode, h))
    mig = read("mig mode", nv.nvmlDeviceGetMigMode, h)
    g["mig_enabled"] = None if mig is None else mig[0] == nv.NVML_DEVICE_MIG_ENABLE
    g["fabric"] = _fabric(nv, read, h)
    procs = read("compute processes", nv.nvmlDeviceGetComputeRunningProcesses, h)
    g["processes"] = None if procs is None else [
        {"pid": p.pid, "used_mib": (p.usedGpuMemory or 0) // (1 << 20)} for p in procs]
    g["pcie_max_gen"] = read("pcie max generation", nv.nvmlDeviceGetMaxPcieLinkGeneration, h)
    g["pcie_max_width"] = read("pcie max width", nv.nvmlDeviceGetMaxPcieLinkWidth, h)
    g.update(_fields(nv, read, h))
    g["nvlink_up"] = _links(nv, h)
    return g


def _flag(v):
    return None if v is None else bool(v)


def _fields(nv, read, h) -> dict:
    """The counters and the recovery action, in one NVML call; each value or why not."""
    got = read("field values", nv.nvmlDeviceGetFieldValues, h, list(_FIELDS))
    out = dict.fromkeys(_FIELDS.values())
    for v in got or ():
        name = _FIELDS.get(v.fieldId)
        if name is None:
            continue
        if v.nvmlReturn != nv.NVML_SUCCESS:
            read.out.setdefault("not_measured", {})[name] = str(nv.NVMLError(v.nvmlReturn))
        else:
            out[name] = int(_field_value(nv, v))
    return out


def _field_value(nv, v):
    kinds = {nv.NVML_VALUE_TYPE_DOUBLE: "dVal", nv.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
             nv.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
             nv.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
             nv.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal"}
    return getattr(v.value, kinds.get(v.valueType, "ullVal"))


def _links(nv, h) -> dict | None:
    """NVLink state per link, ``{"0": true, …}``; None when the GPU has no NVLink (the first
    link is unsupported: PCIe GPUs, whose links are not "down", NVIDIA/NVSentinel#1481)."""
    links = {}
    for link in range(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            links[str(link)] = nv.nvmlDeviceGetNvLinkState(h, link) == nv.NVML_FEATURE_ENABLED
        except nv.NVMLError:
            break  # past the GPU's last link (invalid argument) or no NVLink at all
    return links or None


def _fabric(nv, read, h) -> dict | None:
    """NVSwitch fabric registration (HGX H100/H200 and later); None where not supported."""
    if not hasattr(nv, "c_nvmlGpuFabricInfoV_t"):  # nvidia-ml-py before the fabric API
        read.out.setdefault("not_measured", {})["fabric"] = "nvidia-ml-py has no fabric API"
        return None
    info = nv.c_nvmlGpuFabricInfoV_t()
    if read("fabric", nv.nvmlDeviceGetGpuFabricInfoV, h, nv.byref(info)) is None and \
            "fabric" in read.out.get("not_measured", {}):
        return None
    if info.state == nv.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED:
        return None
    return {"state": int(info.state), "status": int(info.status),
            "health_mask": int(info.healthMask)}


class Sampler(threading.Thread):
    """Samples every GPU of the node every ``period_s`` while the run goes on, and registers
    critical XID events for its whole length. Summaries only: the judge needs counts and
    maxima, not a time series (a sample is ~0.1 ms per GPU)."""

    def __init__(self, nv, period_s: float):
        super().__init__(name="ddp-smoke-health-sampler", daemon=True)
        self.nv, self.period_s = nv, period_s
        self.stop_event = threading.Event()
        self.lock = threading.Lock()
        count = nv.nvmlDeviceGetCount()
        self.handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        self.summary = [_empty_summary() for _ in self.handles]
        self.xids: list[dict] = []

        self.events, self.events_why = None, None
        try:
            self.events = nv.nvmlEventSetCreate()
            for h in self.handles:
                nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, self.events)
        except nv.NVMLError as e:
            self.events_why = f"XID events: {e}"

    def run(self) -> None:
        while not self.stop_event.is_set():
            self.sample()
            self._wait_events()

    def sample(self) -> None:
        nv = self.nv
        for h, s in zip(self.handles, self.summary):
            try:
                reasons = self._reasons(h)
                util = nv.nvmlDeviceGetUtilizationRates(h).gpu
                gen = nv.nvmlDeviceGetCurrPcieLinkGeneration(h)
                width = nv.nvmlDeviceGetCurrPcieLinkWidth(h)
            except nv.NVMLError as e:
                with self.lock:
                    s["errors"] = str(e)
                continue
            with self.lock:
                add_sample(s, reasons, util, gen, width)

    def _reasons(self, h) -> int:
        try:
            return self.nv.nvmlDeviceGetCurrentClocksEventReasons(h)
        except self.nv.NVMLError_FunctionNotFound:  # drivers before 535: the older name
            return self.nv.nvmlDeviceGetCurrentClocksThrottleReasons(h)

    def _wait_events(self) -> None:
        if self.events is None:
            self.stop_event.wait(self.period_s)
            return
        try:  # the wait doubles as the sampling period
            data = self.nv.nvmlEventSetWait_v2(self.events, int(self.period_s * 1000))
        except self.nv.NVMLError:  # timeout: no event in this period
            return
        with self.lock:
            self.xids.append({"xid": int(data.eventData), "at": time.time(),
                              "uuid": _text(self.nv.nvmlDeviceGetUUID(data.device))})

    def take(self) -> dict:
        """The summaries and XIDs so far, and start afresh (repeat mode: per iteration)."""
        with self.lock:
            out = {"samples": self.summary, "xids": self.xids, "xid_events": self.events_why}
            self.summary, self.xids = [_empty_summary() for _ in self.handles], []
        return out


def _empty_summary() -> dict:
    return {"n": 0, "busy": 0, **dict.fromkeys(REASON_BITS, 0), "pcie_gen_busy_max": None,
            "pcie_width_busy_max": None}


def add_sample(s: dict, reasons: int, util: int, gen: int, width: int) -> None:
    """Fold one sample into a summary: only samples of a busy GPU count for the load rules
    (idle GPUs clock down and train their PCIe link down: NVIDIA/open-gpu-kernel-modules#731)."""
    s["n"] += 1
    if reasons & IDLE or util == 0:
        return
    s["busy"] += 1
    for name, bit in REASON_BITS.items():
        s[name] += bool(reasons & bit)
    s["pcie_gen_busy_max"] = max(gen, s["pcie_gen_busy_max"] or 0)
    s["pcie_width_busy_max"] = max(width, s["pcie_width_busy_max"] or 0)


def kernel_xids(path: str = "/dev/kmsg", limit_s: float = 0.3) -> tuple[list[dict] | None, str]:
    """XIDs in the kernel log: ``([{"bus": "0000:18:00", "xid": 79, "age_s": 812.5}], "")``,
    or ``(None, why)`` when the log cannot be read here (containers, dmesg_restrict). A log
    too long to read in ``limit_s`` (one record per read, oldest first) gives what was read
    and says so: the newest records, the ones that matter, were not reached."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        return None, f"kernel log {path} not readable here ({e.strerror})"
    found, end = [], time.monotonic() + limit_s
    try:
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
        while True:
            if time.monotonic() > end:
                return found, f"kernel log {path}: not read to its end within {limit_s} s"
            try:
                record = os.read(fd, 8192).decode(errors="replace")
            except BlockingIOError:
                break  # the end of the buffer
            except OSError as e:  # EPIPE: a record was overwritten while reading; go on
                if e.errno == 32:
                    continue
                return None, f"kernel log {path}: {e.strerror}"
            if not record:  # end of a plain file (tests); /dev/kmsg says EAGAIN instead
                break
            found += parse_kmsg(record, uptime_s)
    finally:
        os.close(fd)
    return found, ""


def parse_kmsg(record: str, uptime_s: float) -> list[dict]:
    """XIDs of one /dev/kmsg record ``"<prio>,<seq>,<usec since boot>,…;NVRM: Xid (…): N, …"``."""
    head, _, text = record.partition(";")
    fields = head.split(",")
    m = _XID_LINE.search(text)
    if not m or len(fields) < 3:
        return []
    try:
        age = uptime_s - int(fields[2]) / 1e6
    except ValueError:
        age = None
    return [{"bus": f"{int(m.group(1), 16):04x}:{m.group(2).lower()}:{m.group(3).lower()}",
             "xid": int(m.group(4)), "age_s": age}]
