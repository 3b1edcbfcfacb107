"""A recorded node, served as NVML and as a file tree: the whole GPU path without a GPU.

``DDP_SMOKE_HEALTH_REPLAY=tests/data/health/h200_8gpu_healthy.json torchrun … -m ddp_smoke``
runs the real worker on CPUs while the health check reads the recorded node: NVML through
:func:`binding` — a module shaped like ``pynvml``, with the installed binding's own constants,
structs and ``NVMLError`` classes, whose calls answer from the recording (values, or the
return codes the driver gave, raised exactly as the binding raises them) — and sysfs, procfs
and ``/dev/kmsg`` from a tree :func:`materialise` writes. The sampler thread, the event wait,
the kernel log, the judging, the report and the page all run as on a GPU node.

A recording (JSON; tests/data/health/PROVENANCE.md says where each comes from)::

    {"source": [urls], "excerpt": [lines], "transcribed": "what was read how, what is made",
     "base": "other.json", "patch": {"nvml.gpus.1.remapped_rows": [0, 2, 0, 1],
                                     "files": {"sys/…/config": "hex:ffff"}},
     "nvml": {"init": "NVML_SUCCESS", "driver": "570.195.03",
              "binding": null | "11.525.150", "binding_lacks": [names that binding lacks],
              "gpus": [{"name", "uuid", "serial", "bus_id", "vbios", "ecc_mode": [1, 1], …,
                        "calls": {"nvmlDeviceGetX": "NVML_ERROR_…"}, "all": null}],
              "events": [{"after_s": 0.05, "gpu": 3, "xid": 79}],
              "event_wait": {"after_s": 0.05, "error": "NVML_ERROR_UNKNOWN"},
              "changes": [{"after_s": 0.05, "set": {"gpus.3.all": "NVML_ERROR_GPU_IS_LOST"}}]},
     "files": {"sys/class/infiniband/mlx5_0/ports/1/state": "4: ACTIVE", …},
     "kmsg": {"uptime_s": 86400.0, "records": ["6,1,38174242,-;NVRM: loading …"]}}

Any recorded value may be a return-code name (``"NVML_ERROR_NOT_SUPPORTED"``): the call
raises it. Time starts when the reader starts watching (``nvmlEventSetCreate``, right after
its start readings, however long they took): ``changes`` and ``events`` whose ``after_s`` has
passed apply from then (a GPU falls off the bus during the run, a counter rises). A call the recording does not
serve raises ``NVML_ERROR_FUNCTION_NOT_FOUND``, as a driver without that function does.
The process that reads (local rank 0) holds a context on GPU 0, as the kit binds it.
"""
from __future__ import annotations

import atexit
import copy
import ctypes
import json
import os
import shutil
import tempfile
import threading
import time
import types
from importlib import metadata
from pathlib import Path

_NA = "NVML_ERROR_NOT_SUPPORTED"
_FAMILIES = ("nvmlInit", "nvmlShutdown", "nvmlSystem", "nvmlDevice", "nvmlEvent")


def load(path: str) -> dict:
    """The recording at ``path``, its ``base`` applied first (a fault is its patch)."""
    p = Path(path)
    rec = json.loads(p.read_text())
    if rec.get("base"):
        base = load(str(p.parent / rec["base"]))
        for key in ("source", "excerpt", "transcribed"):
            base[key] = rec.get(key, base.get(key))
        for dotted, value in rec.get("patch", {}).items():
            _set(base, dotted, value)
        rec = base
    # files alone (an HCA-only or CPU node's sysfs): a node without NVIDIA's library, as NVML
    # says it, not a KeyError in the health check
    rec.setdefault("nvml", {"init": "NVML_ERROR_LIBRARY_NOT_FOUND"})
    rec["path"] = str(p)
    return rec


def _set(obj, dotted: str, value) -> None:
    """Set ``a.b.3.c`` (list items by index); a mapping merges into the mapping it meets."""
    *path, last = dotted.split(".")
    for key in path:
        obj = obj[int(key)] if isinstance(obj, list) else obj.setdefault(key, {})
    key = int(last) if isinstance(obj, list) else last
    here = obj[key] if isinstance(obj, list) else obj.get(key)
    if isinstance(here, dict) and isinstance(value, dict):
        here.update(value)
    else:
        obj[key] = value


def rank_gpu_uuid(path: str, local_rank: int) -> str | None:
    """The UUID of the GPU the rank with this local rank would use (the kit binds local rank
    i to GPU i): how a replayed run's CPU ranks own the recorded GPUs."""
    gpus = load(path)["nvml"].get("gpus", [])
    return gpus[local_rank].get("uuid") if local_rank < len(gpus) else None


def materialise(rec: dict) -> str:
    """Write the recording's files, /dev/kmsg and /proc/uptime under a new root; its path."""
    root = tempfile.mkdtemp(prefix="ddp-smoke-replay-")
    atexit.register(shutil.rmtree, root, True)
    files = dict(rec.get("files", {}))
    kmsg = rec.get("kmsg")
    if kmsg is not None:
        files["dev/kmsg"] = "".join(r + "\n" for r in kmsg.get("records", []))
        files["proc/uptime"] = f"{kmsg.get('uptime_s', 0.0):.2f} 0.00\n"
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if text.startswith("hex:"):
            with open(path, "wb") as f:
                f.write(bytes.fromhex(text[4:]))
        else:
            with open(path, "w") as f:
                f.write(text if text.endswith("\n") or rel == "dev/kmsg" else text + "\n")
    for rel in rec.get("dirs", []):  # empty directories (a GPU's procfs entry)
        os.makedirs(os.path.join(root, rel), exist_ok=True)
    return root


def binding(rec: dict):
    """A module shaped like ``pynvml`` that answers from the recording."""
    import pynvml as real
    m = types.ModuleType("pynvml_replay")
    for name in dir(real):
        if not name.startswith("__"):
            value = getattr(real, name)
            calls = name.startswith(_FAMILIES) and isinstance(value, types.FunctionType)
            setattr(m, name, _missing(real, name) if calls else value)
    node = _Node(real, rec["nvml"])
    for name in dir(node):
        if name.startswith("nvml"):
            setattr(m, name, getattr(node, name))
    for name in rec["nvml"].get("binding_lacks", []):
        if hasattr(m, name):
            delattr(m, name)
    m.REPLAY_BINDING = rec["nvml"].get("binding") or metadata.version("nvidia-ml-py")
    return m


def _missing(real, name):
    def call(*_args, **_kwargs):
        raise real.NVMLError(real.NVML_ERROR_FUNCTION_NOT_FOUND)
    call.__name__ = name
    return call


class _Node:
    """The recorded node's answers; every method is an NVML call of the same name."""

    def __init__(self, real, nvml: dict):
        self.real, self.rec = real, nvml
        self.t0: float | None = None  # when the watch began; before it, nothing is due
        self.delivered = 0
        self.lock = threading.Lock()
        self.handles = [ctypes.cast(ctypes.c_void_p(0x10000 + 0x100 * i), real.c_nvmlDevice_t)
                        for i in range(len(nvml.get("gpus", [])))]
        self._cache: tuple[int, dict] | None = None

    # -- time, state, errors ---------------------------------------------------------------

    def _elapsed(self) -> float:
        return -1.0 if self.t0 is None else time.monotonic() - self.t0

    def _state(self) -> dict:
        """The recording with every change whose time has come applied."""
        due = [c for c in self.rec.get("changes", []) if c["after_s"] <= self._elapsed()]
        with self.lock:
            if self._cache is None or self._cache[0] != len(due):
                state = copy.deepcopy(self.rec)
                for change in due:
                    for dotted, value in change["set"].items():
                        _set(state, dotted, value)
                self._cache = (len(due), state)
            return self._cache[1]

    def _v(self, value):
        """A recorded value, or the recorded return code raised as the binding raises it."""
        if isinstance(value, str) and value.startswith("NVML_ERROR_"):
            raise self.real.NVMLError(getattr(self.real, value))
        return value

    def _gpu(self, h, call: str) -> dict:
        key = ctypes.cast(h, ctypes.c_void_p).value
        index = next(i for i, x in enumerate(self.handles)
                     if ctypes.cast(x, ctypes.c_void_p).value == key)
        g = self._state()["gpus"][index]
        self._v(g.get("all"))
        self._v(g.get("calls", {}).get(call))
        return g

    def _get(self, h, call: str, *path):
        """A recorded per-GPU value; one the recording does not hold reads NOT_SUPPORTED
        (what nvidia-smi prints as N/A)."""
        value = self._gpu(h, call)
        for key in path:
            value = value.get(key, _NA) if isinstance(value, dict) else _NA
        return self._v(value)

    # -- the calls -------------------------------------------------------------------------

    def nvmlInit(self):
        self._v(self.rec.get("init"))

    def nvmlShutdown(self):
        pass

    def nvmlSystemGetDriverVersion(self):
        return self._v(self.rec.get("driver", "NVML_ERROR_NOT_SUPPORTED"))

    def nvmlDeviceGetCount(self):
        return self._v(self._state().get("count", len(self.rec.get("gpus", []))))

    def nvmlDeviceGetHandleByIndex(self, index):
        gpus = self._state()["gpus"]
        if index >= len(gpus):
            raise self.real.NVMLError(self.real.NVML_ERROR_INVALID_ARGUMENT)
        self._v(gpus[index].get("handle"))
        return self.handles[index]

    def nvmlDeviceGetName(self, h):
        return self._get(h, "nvmlDeviceGetName", "name")

    def nvmlDeviceGetUUID(self, h):
        return self._get(h, "nvmlDeviceGetUUID", "uuid")

    def nvmlDeviceGetSerial(self, h):
        return self._get(h, "nvmlDeviceGetSerial", "serial")

    def nvmlDeviceGetPciInfo(self, h):
        info = self.real.nvmlPciInfo_t()
        info.busId = self._get(h, "nvmlDeviceGetPciInfo", "bus_id").encode()
        return info

    def nvmlDeviceGetVbiosVersion(self, h):
        return self._get(h, "nvmlDeviceGetVbiosVersion", "vbios")

    def nvmlDeviceGetEccMode(self, h):
        return tuple(self._get(h, "nvmlDeviceGetEccMode", "ecc_mode"))

    def nvmlDeviceGetTotalEccErrors(self, h, kind, counter):
        return self._get(h, "nvmlDeviceGetTotalEccErrors", "ecc_uncorrected_volatile")

    def nvmlDeviceGetRemappedRows(self, h):
        return tuple(self._get(h, "nvmlDeviceGetRemappedRows", "remapped_rows"))

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h):
        return self._get(h, "nvmlDeviceGetRetiredPagesPendingStatus", "retired_pending")

    def nvmlDeviceGetRetiredPages(self, h, cause):
        return self._get(h, "nvmlDeviceGetRetiredPages", "retired_pages", str(cause))

    def nvmlDeviceGetPersistenceMode(self, h):
        return self._get(h, "nvmlDeviceGetPersistenceMode", "persistence")

    def nvmlDeviceGetMigMode(self, h):
        return tuple(self._get(h, "nvmlDeviceGetMigMode", "mig"))

    def nvmlDeviceValidateInforom(self, h):
        self._v(self._gpu(h, "nvmlDeviceValidateInforom").get("inforom"))  # absent: valid

    def nvmlDeviceGetGpuFabricInfoV(self, h, ref):
        fabric, info = self._get(h, "nvmlDeviceGetGpuFabricInfoV", "fabric"), ref._obj
        if info.version == self.real.nvmlGpuFabricInfo_v3 and fabric.get("max_version", 3) < 3:
            raise self.real.NVMLError(self.real.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        info.state, info.status = fabric["state"], fabric["status"]
        info.healthMask = fabric["health_mask"]
        if hasattr(info, "healthSummary"):
            info.healthSummary = fabric["health_summary"]

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        procs = [types.SimpleNamespace(pid=p["pid"], usedGpuMemory=p["used_mib"] << 20)
                 for p in self._get(h, "nvmlDeviceGetComputeRunningProcesses", "processes")]
        if ctypes.cast(h, ctypes.c_void_p).value == 0x10000:  # GPU 0: the reader's own
            procs.append(types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=512 << 20))
        return procs

    def _pcie(self, h, call, key):
        return self._get(h, call, "pcie", key)

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return self._pcie(h, "nvmlDeviceGetMaxPcieLinkGeneration", "max_gen")

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return self._pcie(h, "nvmlDeviceGetMaxPcieLinkWidth", "max_width")

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        return self._pcie(h, "nvmlDeviceGetCurrPcieLinkGeneration", "gen")

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return self._pcie(h, "nvmlDeviceGetCurrPcieLinkWidth", "width")

    def nvmlDeviceGetTemperatureThreshold(self, h, kind):
        names = {self.real.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: "slowdown",
                 self.real.NVML_TEMPERATURE_THRESHOLD_MEM_MAX: "mem_max"}
        return self._get(h, "nvmlDeviceGetTemperatureThreshold", "thresholds", names.get(kind))

    def nvmlDeviceGetViolationStatus(self, h, policy):
        key = {self.real.NVML_PERF_POLICY_POWER: "power",
               self.real.NVML_PERF_POLICY_THERMAL: "thermal"}.get(policy)
        out = self.real.c_nvmlViolationTime_t()
        out.violationTime = self._get(h, "nvmlDeviceGetViolationStatus", "violation_ns", key)
        return out

    def nvmlDeviceGetFieldValues(self, h, ids):
        fields, real = self._gpu(h, "nvmlDeviceGetFieldValues").get("fields", {}), self.real
        out = (real.c_nvmlFieldValue_t * len(ids))()
        for v, fid in zip(out, ids):
            value = fields.get(str(fid), "NVML_ERROR_NOT_SUPPORTED")
            v.fieldId, v.valueType = fid, real.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
            if isinstance(value, str):
                v.nvmlReturn = getattr(real, value)
            else:
                v.nvmlReturn, v.value.ullVal = real.NVML_SUCCESS, value
        return out

    def nvmlDeviceGetNvLinkState(self, h, link):
        states = self._get(h, "nvmlDeviceGetNvLinkState", "nvlink", "state")
        if link >= len(states):
            raise self.real.NVMLError(self.real.NVML_ERROR_INVALID_ARGUMENT)
        return self._v(states[link])

    def nvmlDeviceGetNvLinkErrorCounter(self, h, link, counter):
        errors = self._get(h, "nvmlDeviceGetNvLinkErrorCounter", "nvlink").get("errors", {})
        name = {0: "replay", 1: "recovery", 2: "crc_flit", 3: "crc_data"}[counter]
        return self._v(errors.get(str(link), {}).get(name, 0))

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return self._get(h, "nvmlDeviceGetCurrentClocksEventReasons", "reasons")

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
        return self._get(h, "nvmlDeviceGetCurrentClocksThrottleReasons", "reasons")

    def nvmlDeviceGetUtilizationRates(self, h):
        out = self.real.c_nvmlUtilization_t()
        out.gpu = self._get(h, "nvmlDeviceGetUtilizationRates", "util")
        return out

    def nvmlDeviceGetTemperatureV(self, h, sensor):
        return self._get(h, "nvmlDeviceGetTemperatureV", "temp_c")

    def nvmlDeviceGetTemperature(self, h, sensor):
        return self._get(h, "nvmlDeviceGetTemperature", "temp_c")

    def nvmlEventSetCreate(self):
        if self.t0 is None:
            self.t0 = time.monotonic()
        return object()

    def nvmlDeviceGetSupportedEventTypes(self, h):
        return self._v(self._gpu(h, "nvmlDeviceGetSupportedEventTypes")
                       .get("event_types", 0xFFFF))

    def nvmlDeviceRegisterEvents(self, h, kinds, events):
        self._gpu(h, "nvmlDeviceRegisterEvents")

    def nvmlEventSetFree(self, events):
        pass

    def nvmlEventSetWait_v2(self, events, timeout_ms):
        """Deliver the next recorded event once its time has come, else wait: TIMEOUT."""
        deadline = self._elapsed() + timeout_ms / 1000
        pending = self.rec.get("events", [])[self.delivered:]
        broken = self.rec.get("event_wait")
        while True:
            now = self._elapsed()
            if broken and broken["after_s"] <= now:
                self._v(broken["error"])
            if pending and pending[0]["after_s"] <= now:
                self.delivered += 1
                data = self.real.c_nvmlEventData_t()
                data.device = self.handles[pending[0]["gpu"]]
                data.eventType = self.real.nvmlEventTypeXidCriticalError
                data.eventData = pending[0]["xid"]
                return data
            if now >= deadline:
                raise self.real.NVMLError(self.real.NVML_ERROR_TIMEOUT)
            time.sleep(min(0.01, deadline - now))
