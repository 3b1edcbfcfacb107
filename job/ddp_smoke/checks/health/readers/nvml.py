"""The GPUs of a node through NVML (nvidia-ml-py's ``pynvml``), or a recorded node.

:class:`GpuReader` takes a snapshot of every GPU when the run starts and again when the
health check runs (counters are judged as increases across the run), samples clock-event
reasons, utilisation, PCIe link and temperatures while the other checks load the GPUs, and
waits on NVML's XID events in between. Every reading is plain JSON. A reading NVML refuses is
recorded under ``errors`` with NVML's own return code (``NVML_ERROR_NOT_SUPPORTED``, …), never
as a zero: the rule decides what each code means (:mod:`..presence`). A function the binding
or the driver lacks is recorded as such (``NO_BINDING:<name>``, ``NVML_ERROR_FUNCTION_NOT_FOUND``).

Return codes as nvidia-ml-py 13.x raises them (``pynvml.NVMLError`` subclasses, ``.value``
the ``nvmlReturn_t``); the calls and what the driver answers them with:

* ``nvmlInit``: ``LIBRARY_NOT_FOUND`` (no libnvidia-ml.so.1: a container without the
  ``utility`` capability), ``DRIVER_NOT_LOADED``, ``LIB_RM_VERSION_MISMATCH``,
  ``NO_PERMISSION`` → :class:`Unavailable`, with the cause and the fix in one line.
* ``nvmlDeviceGetHandleByIndex``: ``UNKNOWN`` or ``GPU_IS_LOST`` for a GPU that fell off the
  bus ("Unable to determine the device handle for GPU…: Unknown Error",
  NVIDIA/open-gpu-kernel-modules#387), ``INSUFFICIENT_POWER``, ``IRQ_ISSUE``,
  ``NO_PERMISSION`` (nvml.h): the GPU is unreachable, the others are still read.
* any per-GPU call: ``GPU_IS_LOST``, ``RESET_REQUIRED``, ``CORRUPTED_INFOROM`` (judged),
  ``NOT_SUPPORTED``, ``NO_PERMISSION`` (not measured), ``ARGUMENT_VERSION_MISMATCH`` (a
  versioned struct newer than the driver: the older version is asked).
* ``nvmlEventSetWait_v2``: ``TIMEOUT`` is "no event"; any other code ends the event channel
  (said as such, the kernel log still covers XIDs), never a busy loop.

The binding is imported on first use only (``--help`` stays fast).
"""
from __future__ import annotations

import ctypes
import threading
import time
from importlib import metadata

# The binding range the project tests (pyproject.toml, the Makefile's venv, the image): 13.x
# has every call below (the fabric health summary, the recovery-action field).
TESTED_BINDING = "nvidia-ml-py>=13.580.65,<14"
# clock-event reason bits (nvml.h nvmlClocksEventReason*)
IDLE, HW_SLOWDOWN, SW_THERMAL, HW_THERMAL, HW_POWER_BRAKE = 0x1, 0x8, 0x20, 0x40, 0x80
REASON_BITS = {"hw_slowdown": HW_SLOWDOWN, "hw_thermal": HW_THERMAL,
               "hw_power_brake": HW_POWER_BRAKE, "sw_thermal": SW_THERMAL}
# nvmlDeviceGetFieldValues ids (nvml.h), asked by number: an older binding may lack the name
FI_MEMORY_TEMP, FI_NVLINK_LINK_COUNT, FI_PCIE_REPLAY, FI_RECOVERY_ACTION = 82, 91, 94, 230
_SNAPSHOT_FIELDS = {FI_PCIE_REPLAY: "pcie_replay", FI_RECOVERY_ACTION: "recovery_action",
                    FI_NVLINK_LINK_COUNT: "nvlink_count"}
# nvmlNvLinkErrorCounter_t: per link, as nvidia-smi nvlink -e reads them; the all-link totals
# (field ids 38/52/59) read 0 on Hopper (DataDog/datadog-agent#55966)
NVLINK_COUNTERS = {"replay": 0, "recovery": 1, "crc_flit": 2}
_INIT_FIXES = {
    "NVML_ERROR_LIBRARY_NOT_FOUND": (
        "libnvidia-ml.so.1 is not in this process's library path",
        "in a container, the NVIDIA runtime mounts it only when NVIDIA_DRIVER_CAPABILITIES "
        "includes utility (set compute,utility); on a host, install the driver's NVML library"),
    "NVML_ERROR_DRIVER_NOT_LOADED": (
        "the nvidia kernel module is not loaded",
        "load it (modprobe nvidia) or reinstall the driver; the kernel log says why it failed"),
    "NVML_ERROR_LIB_RM_VERSION_MISMATCH": (
        "libnvidia-ml and the loaded nvidia kernel module are different driver versions (a "
        "driver updated without a reboot, or a container's own copy of the library)",
        "reboot the node; in a container, do not ship libnvidia-ml in the image"),
    "NVML_ERROR_NO_PERMISSION": (
        "this process may not open /dev/nvidiactl",
        "give the job the NVIDIA device files (device cgroup, video group, --gpus)"),
}


class Unavailable(Exception):
    """NVML cannot be used on this node: ``cause`` and ``fix``, NVML's ``code``."""

    def __init__(self, code: str, cause: str, fix: str):
        super().__init__(f"{cause} ({code}); fix: {fix}")
        self.code, self.cause, self.fix = code, cause, fix


def error_names(nv) -> dict[int, str]:
    """``nvmlReturn_t`` value → its name, from the binding's own constants."""
    return {getattr(nv, n): n for n in dir(nv) if n.startswith("NVML_ERROR_") or
            n == "NVML_SUCCESS"}


def open_binding(nv=None):
    """The initialised binding (``pynvml``, or ``nv``: a replay), or Unavailable."""
    if nv is None:
        try:
            import pynvml as nv
        except ImportError:
            raise Unavailable("NO_BINDING", "nvidia-ml-py is not installed in this Python",
                              f"pip install '{TESTED_BINDING}'") from None
    try:
        nv.nvmlInit()
    except nv.NVMLError as e:
        code = error_names(nv).get(e.value, f"NVML_ERROR_{e.value}")
        cause, fix = _INIT_FIXES.get(code, (f"nvmlInit failed: {e}", "see the driver's "
                                            "kernel log; reboot the node if it persists"))
        raise Unavailable(code, cause, fix) from None
    return nv


def binding_version(nv) -> str:
    replayed = getattr(nv, "REPLAY_BINDING", None)
    if replayed:
        return replayed
    try:
        return metadata.version("nvidia-ml-py")
    except metadata.PackageNotFoundError:
        return "unknown (pynvml without nvidia-ml-py metadata)"


def _text(v):
    return v.decode(errors="replace") if isinstance(v, bytes) else v


def handle_key(h) -> int | None:
    """The address an ``nvmlDevice_t`` holds: an event names its GPU by handle, and this is
    how it is matched without another call into NVML (a lost GPU answers none)."""
    try:
        return ctypes.cast(h, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None


class _Reads:
    """Calls into the binding for one GPU; a failed reading leaves its code in ``errors``."""

    def __init__(self, nv, names: dict, errors: dict):
        self.nv, self.names, self.errors = nv, names, errors

    def code(self, e) -> str:
        return self.names.get(e.value, f"NVML_ERROR_{e.value}")

    def __call__(self, what: str, fn: str, *args):
        return self.first(what, [(fn, args)])

    def first(self, what: str, calls):
        """The first of several calls that the binding and the driver both have."""
        for fn, args in calls:
            f = getattr(self.nv, fn, None)
            if f is None:
                self.errors[what] = f"NO_BINDING:{fn}"
                continue
            try:
                value = f(*args)
            except self.nv.NVMLError as e:
                self.errors[what] = self.code(e)
                if self.errors[what] == "NVML_ERROR_FUNCTION_NOT_FOUND":
                    continue  # a driver older than the call: the older call
                return None
            self.errors.pop(what, None)
            return value
        return None


class GpuReader:
    """Every GPU of the node: snapshots at start and end, samples and XID events between."""

    name = "gpu"

    def __init__(self, nv):
        self.nv, self.names = nv, error_names(nv)
        self.lock = threading.Lock()
        self.handles: dict[int, object] = {}
        self.t0 = time.monotonic()
        self.start_snap: dict = {}
        self.summaries: dict[int, dict] = {}
        self.xids: list[dict] = []
        self.events = None
        self.events_status: dict = {}

    # -- snapshots -------------------------------------------------------------------------

    def start(self) -> None:
        self.t0 = time.monotonic()
        self.start_snap = self.snapshot()
        self.summaries = {i: empty_summary() for i in self.handles}
        self._register_events()

    def finish(self) -> dict:
        """The reading of the window since start (or the last finish: repeat mode)."""
        for i in list(self.handles):
            self._sample_one(i)  # at least one sample now, whatever the period
        end, window = self.snapshot(), time.monotonic() - self.t0
        with self.lock:
            reading = {"binding": binding_version(self.nv), "window_s": round(window, 3),
                       "start": self.start_snap, "end": end,
                       "samples": {str(i): s for i, s in self.summaries.items()},
                       "xids": self.xids, "events": dict(self.events_status)}
            self.summaries = {i: empty_summary() for i in self.handles}
            self.xids = []
        self.start_snap, self.t0 = end, time.monotonic()
        return reading

    def snapshot(self) -> dict:
        errors: dict = {}
        read = _Reads(self.nv, self.names, errors)
        node = {"driver": _text(read("driver", "nvmlSystemGetDriverVersion")),
                "count": read("gpu count", "nvmlDeviceGetCount"), "errors": errors}
        node["gpus"] = [self._gpu(i) for i in range(node["count"] or 0)]
        return node

    def _gpu(self, i: int) -> dict:
        nv, g = self.nv, {"index": i, "errors": {}}
        read = _Reads(nv, self.names, g["errors"])
        h = read("handle", "nvmlDeviceGetHandleByIndex", i)
        if h is None:
            return g
        with self.lock:
            self.handles.setdefault(i, h)
        g["name"] = _text(read("name", "nvmlDeviceGetName", h))
        g["uuid"] = _text(read("uuid", "nvmlDeviceGetUUID", h))
        g["serial"] = _text(read("serial", "nvmlDeviceGetSerial", h))
        pci = read("bus id", "nvmlDeviceGetPciInfo", h)
        g["bus_id"] = _text(pci.busId) if pci is not None else None
        g["vbios"] = _text(read("vbios", "nvmlDeviceGetVbiosVersion", h))
        mig = read("mig mode", "nvmlDeviceGetMigMode", h)
        g["mig"] = None if mig is None else [int(mig[0]), int(mig[1])]
        _memory(nv, read, h, g)
        persistence = read("persistence mode", "nvmlDeviceGetPersistenceMode", h)
        g["persistence"] = None if persistence is None else bool(persistence)
        read("inforom", "nvmlDeviceValidateInforom", h)  # raises CORRUPTED_INFOROM if not
        code = g["errors"].get("inforom")
        g["inforom_valid"] = (True if code is None else
                              False if code == "NVML_ERROR_CORRUPTED_INFOROM" else None)
        g["fabric"] = _fabric(nv, read, h)
        procs = read("compute processes", "nvmlDeviceGetComputeRunningProcesses", h)
        g["processes"] = None if procs is None else [
            {"pid": p.pid, "used_mib": (p.usedGpuMemory or 0) // (1 << 20)} for p in procs]
        g["pcie_max_gen"] = read("pcie max generation", "nvmlDeviceGetMaxPcieLinkGeneration", h)
        g["pcie_max_width"] = read("pcie max width", "nvmlDeviceGetMaxPcieLinkWidth", h)
        g["temp_slowdown_c"] = read("slowdown temperature", "nvmlDeviceGetTemperatureThreshold",
                                    h, nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)
        g["temp_mem_max_c"] = read("memory max temperature",
                                   "nvmlDeviceGetTemperatureThreshold", h,
                                   nv.NVML_TEMPERATURE_THRESHOLD_MEM_MAX)
        g["violation_ns"] = {
            k: getattr(read(f"{k} violation", "nvmlDeviceGetViolationStatus", h, policy),
                       "violationTime", None)
            for k, policy in (("power", nv.NVML_PERF_POLICY_POWER),
                              ("thermal", nv.NVML_PERF_POLICY_THERMAL))}
        g.update(_fields(nv, read, h, _SNAPSHOT_FIELDS))
        g["nvlink"] = _nvlink(nv, read, h, g.pop("nvlink_count"))
        return g

    # -- the sampler's side ----------------------------------------------------------------

    def sample(self) -> None:
        for i in list(self.handles):
            self._sample_one(i)

    def _sample_one(self, i: int) -> None:
        s = self.summaries.get(i)
        if s is None or s["lost"]:
            return  # a lost GPU is not asked again every period
        errors: dict = {}
        read, h = _Reads(self.nv, self.names, errors), self.handles[i]
        reasons = read.first("reasons", [("nvmlDeviceGetCurrentClocksEventReasons", (h,)),
                                         ("nvmlDeviceGetCurrentClocksThrottleReasons", (h,))])
        util = read("utilization", "nvmlDeviceGetUtilizationRates", h)
        gen = read("pcie generation", "nvmlDeviceGetCurrPcieLinkGeneration", h)
        width = read("pcie width", "nvmlDeviceGetCurrPcieLinkWidth", h)
        temp = read.first("temperature", [("nvmlDeviceGetTemperatureV", (h, 0)),
                                          ("nvmlDeviceGetTemperature", (h, 0))])
        mem_temp = None
        if not s["mem_temp_unsupported"]:
            mem_temp = _fields(self.nv, read, h, {FI_MEMORY_TEMP: "mem_temp"})["mem_temp"]
        with self.lock:
            for what, code in errors.items():
                s["errors"][f"{what}: {code}"] = s["errors"].get(f"{what}: {code}", 0) + 1
            s["lost"] = "NVML_ERROR_GPU_IS_LOST" in errors.values()
            s["mem_temp_unsupported"] = "mem_temp" in errors
            if None not in (reasons, util, gen, width):
                add_sample(s, reasons, util.gpu, gen, width, temp, mem_temp)

    def _register_events(self) -> None:
        nv, types = self.nv, getattr(self.nv, "nvmlEventTypeXidCriticalError", 0x8)
        try:
            self.events = nv.nvmlEventSetCreate()
        except nv.NVMLError as e:
            self.events_status = {"ok": False, "why": f"nvmlEventSetCreate: {self._code(e)}"}
            return
        registered, refused = [], {}
        for i, h in self.handles.items():
            try:  # only the kinds this GPU supports (else the call fails NOT_SUPPORTED)
                kinds = nv.nvmlDeviceGetSupportedEventTypes(h) & types
                if not kinds:
                    refused[str(i)] = "XID events not supported"
                    continue
                nv.nvmlDeviceRegisterEvents(h, kinds, self.events)
                registered.append(i)
            except nv.NVMLError as e:
                refused[str(i)] = self._code(e)
        self.events_status = {"ok": bool(registered), "registered": registered,
                              "refused": refused, "why": None if registered else
                              "no GPU accepted XID event registration"}

    def wait(self, seconds: float, stop: threading.Event) -> bool:
        """Wait up to ``seconds`` (the sampling period) for an XID event; True if one came.
        Once the event channel fails, plain waiting: the failure is recorded and the channel
        closed, never retried in a loop (a dead channel answers at once, every time)."""
        if self.events is None or not self.events_status.get("ok"):
            stop.wait(seconds)
            return False
        nv = self.nv
        try:
            data = nv.nvmlEventSetWait_v2(self.events, max(1, int(seconds * 1000)))
        except nv.NVMLError as e:
            code = self._code(e)
            if code != "NVML_ERROR_TIMEOUT":
                self._close_events(f"nvmlEventSetWait_v2 returned {code} after "
                                   f"{time.monotonic() - self.t0:.1f} s")
            return False
        keys = {handle_key(h): i for i, h in self.handles.items()}
        with self.lock:
            self.xids.append({"xid": int(data.eventData), "type": int(data.eventType),
                              "index": keys.get(handle_key(data.device)),
                              "at_s": round(time.monotonic() - self.t0, 3)})
        return True

    def _close_events(self, why: str) -> None:
        with self.lock:
            self.events_status = {**self.events_status, "ok": False, "why": why}
        try:
            self.nv.nvmlEventSetFree(self.events)
        except self.nv.NVMLError:
            pass  # the set is dropped either way
        self.events = None

    def _code(self, e) -> str:
        return self.names.get(e.value, f"NVML_ERROR_{e.value}")


def _memory(nv, read, h, g: dict) -> None:
    ecc = read("ecc mode", "nvmlDeviceGetEccMode", h)
    g["ecc_enabled"] = None if ecc is None else bool(ecc[0])
    g["ecc_uncorrected_volatile"] = read(
        "volatile uncorrected ecc", "nvmlDeviceGetTotalEccErrors", h,
        nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)
    rows = read("remapped rows", "nvmlDeviceGetRemappedRows", h)
    g["remapped_rows"] = None if rows is None else dict(zip(
        ("correctable", "uncorrectable", "pending", "failure"), map(int, rows)))
    g["retired_pages"] = None
    if g["errors"].get("remapped rows") == "NVML_ERROR_NOT_SUPPORTED" and \
            not (g["mig"] or [0])[0]:  # pre-Ampere GPUs retire pages (MIG: rows unsupported)
        pending = read("retired pages pending", "nvmlDeviceGetRetiredPagesPendingStatus", h)
        sbe = read("retired pages (sbe)", "nvmlDeviceGetRetiredPages", h,
                   nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
        dbe = read("retired pages (dbe)", "nvmlDeviceGetRetiredPages", h,
                   nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
        if pending is not None:
            g["retired_pages"] = {"pending": bool(pending), "sbe": len(sbe or ()),
                                  "dbe": len(dbe or ())}


def _fields(nv, read, h, wanted: dict[int, str]) -> dict:
    """Field values in one call; each value, or its own return code in ``errors``."""
    got = read("field values", "nvmlDeviceGetFieldValues", h, list(wanted))
    out = dict.fromkeys(wanted.values())
    for v in got or ():
        name = wanted.get(v.fieldId)
        if name is None:
            continue
        if v.nvmlReturn != nv.NVML_SUCCESS:
            read.errors[name] = read.names.get(v.nvmlReturn, f"NVML_ERROR_{v.nvmlReturn}")
            continue
        kind = {nv.NVML_VALUE_TYPE_DOUBLE: "dVal", nv.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
                nv.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
                nv.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal"}.get(v.valueType, "ullVal")
        out[name] = int(getattr(v.value, kind))
    return out


def _nvlink(nv, read, h, count) -> dict | None:
    """Every link's state and error counters, for the links the GPU has (the link-count
    field); None when the GPU has no NVLink at all (PCIe cards: their links are not "down",
    NVIDIA/NVSentinel#1481)."""
    if not count:
        return None  # NOT_SUPPORTED or 0: no NVLink (the code stays in errors)
    links = {"count": count, "up": [], "down": [], "unsupported": [], "unreadable": {},
             "counters": {}}
    for link in range(count):
        try:
            up = nv.nvmlDeviceGetNvLinkState(h, link) == nv.NVML_FEATURE_ENABLED
        except nv.NVMLError as e:
            code = read.code(e)
            if code == "NVML_ERROR_NOT_SUPPORTED":
                links["unsupported"].append(link)  # not wired on this part: by design
            else:
                links["unreadable"][str(link)] = code
            continue
        links["up" if up else "down"].append(link)
        if up:
            links["counters"][str(link)] = {
                name: read(f"nvlink {name} counter", "nvmlDeviceGetNvLinkErrorCounter", h,
                           link, counter)
                for name, counter in NVLINK_COUNTERS.items()}
    return links


def _fabric(nv, read, h) -> dict | None:
    """NVSwitch fabric registration (HGX H100/H200 and later): the v3 struct (health
    summary), else v2 on a driver that does not know v3; None where not supported (PCIe
    GPUs, a single GPU: leptonai/gpud#1140)."""
    for struct, version in (("c_nvmlGpuFabricInfo_v3_t", 3), ("c_nvmlGpuFabricInfoV_t", 2)):
        cls = getattr(nv, struct, None)
        if cls is None or not hasattr(nv, "nvmlDeviceGetGpuFabricInfoV"):
            read.errors["fabric"] = f"NO_BINDING:{struct}"
            continue
        info = cls()
        read("fabric", "nvmlDeviceGetGpuFabricInfoV", h, ctypes.byref(info))
        code = read.errors.get("fabric")
        if code == "NVML_ERROR_ARGUMENT_VERSION_MISMATCH":
            continue  # a driver before the v3 struct
        if code is not None or info.state == nv.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED:
            return None
        return {"version": version, "state": int(info.state), "status": int(info.status),
                "status_name": read.names.get(int(info.status), str(info.status)),
                "health_mask": int(info.healthMask),
                "health_summary": int(info.healthSummary) if version == 3 else None}
    return None


def empty_summary() -> dict:
    return {"n": 0, "busy": 0, **dict.fromkeys(REASON_BITS, 0), "pcie_gen_busy_max": None,
            "pcie_width_busy_max": None, "temp_max_c": None, "mem_temp_max_c": None,
            "errors": {}, "lost": False, "mem_temp_unsupported": False}


def add_sample(s: dict, reasons: int, util: int, gen: int, width: int, temp=None,
               mem_temp=None) -> None:
    """Fold one sample into a summary. Only samples of a busy GPU count for the load rules
    (idle GPUs clock down and train their PCIe link down: NVIDIA/open-gpu-kernel-modules#731);
    temperatures count in every sample."""
    s["n"] += 1
    for key, value in (("temp_max_c", temp), ("mem_temp_max_c", mem_temp)):
        if value is not None:
            s[key] = max(value, s[key] if s[key] is not None else value)
    if reasons & IDLE or util == 0:
        return
    s["busy"] += 1
    for name, bit in REASON_BITS.items():
        s[name] += bool(reasons & bit)
    s["pcie_gen_busy_max"] = max(gen, s["pcie_gen_busy_max"] or 0)
    s["pcie_width_busy_max"] = max(width, s["pcie_width_busy_max"] or 0)
