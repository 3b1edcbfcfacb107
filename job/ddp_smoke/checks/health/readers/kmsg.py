"""The NVIDIA driver's messages in the kernel log (``/dev/kmsg``), read whether or not NVML
opened: the node most likely to hold an XID 79 is the one whose NVML fails.

One ``/dev/kmsg`` read returns one record, ``"<prio>,<seq>,<usec since boot>,<flags>;text"``
(Documentation/ABI/testing/dev-kmsg); a message's own newlines arrive escaped as ``\\x0a``,
so the driver's three-line "fallen off the bus" notice is one record. What is kept:

* ``xids``: ``NVRM: Xid (PCI:0000:44:00): 79, GPU has fallen off the bus`` (and every XID);
* ``recovery``: XID 154 ``GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot
  Required)`` — the driver's own word on what the GPU needs;
* ``fallen``: ``NVRM: The NVIDIA GPU 0000:b3:00.0 … has fallen off the bus`` with no XID line
  (NVIDIA/NVSentinel#155) and ``NVRM: GPU 0000:01:00.0: GPU has fallen off the bus.``;
* ``sxids``: NVSwitch errors, ``nvidia-nvswitch3: SXid (PCI:0000:04:00.0): 22013, Non-fatal,
  Link 44 …`` (NVIDIA/nvtrust#124), fatal or not;
* ``nvrm``: whether any record comes from the driver at all. A log without a single NVRM line
  on a GPU node is not this host's kernel log (gVisor and some containers serve their own):
  the rules count it as not measured rather than as a clean log.

Unreadable (``dmesg_restrict``, no CAP_SYSLOG, no /dev/kmsg in the container) is said as such.
"""
from __future__ import annotations

import os
import re
import time

from ....coordination import proc

_BUS = r"([0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})"
_XID = re.compile(r"NVRM: Xid \(PCI:" + _BUS + r"[^)]*\): (\d+)")
_RECOVERY = re.compile(r"recovery action changed from 0x[0-9a-fA-F]+ \([^)]*\) to "
                       r"0x([0-9a-fA-F]+) \(([^)]*)\)")
_FALLEN = re.compile(r"NVRM: (?:The NVIDIA )?GPU (?:at PCI:)?" + _BUS + r"[.\d]*\b(.*)",
                     re.S)
_SXID = re.compile(r"SXid \(PCI:" + _BUS + r"[^)]*\): (\d+), (.*)")


def bus_key(bus: str | None) -> tuple[int, int, int] | None:
    """(domain, bus, device) of "00000000:18:00.0", "0000:18:00" or "0000:18:00.0": one key
    for NVML's, sysfs's and the kernel log's spellings of a PCI address."""
    parts = re.split(r"[:.]", (bus or "").strip())
    try:
        return int(parts[0], 16), int(parts[1], 16), int(parts[2], 16)
    except (IndexError, ValueError):
        return None


def parse(record: str, uptime_s: float) -> dict:
    """What one record says: {"kind": "xid"|"recovery"|"fallen"|"sxid"|"nvrm"|"", …}."""
    head, _, text = record.partition(";")
    text = text.split("\n ", 1)[0].replace("\\x0a", "\n")  # drop dictionary lines, unescape
    fields = head.split(",")
    try:
        age = round(uptime_s - int(fields[2]) / 1e6, 3)
    except (IndexError, ValueError):
        age = None
    m = _XID.search(text)
    if m:
        xid, bus = int(m.group(2)), m.group(1).lower()
        r = _RECOVERY.search(text) if xid == 154 else None
        if r:
            return {"kind": "recovery", "bus": bus, "action": int(r.group(1), 16),
                    "action_name": r.group(2), "age_s": age, "text": text[:200]}
        return {"kind": "xid", "bus": bus, "xid": xid, "age_s": age, "text": text[:200]}
    m = _SXID.search(text)
    if m:
        return {"kind": "sxid", "bus": m.group(1).lower(), "sxid": int(m.group(2)),
                "fatal": m.group(3).lstrip().lower().startswith("fatal"), "age_s": age,
                "text": text[:200]}
    m = _FALLEN.search(text)
    if m and "fallen off the bus" in m.group(2):
        return {"kind": "fallen", "bus": m.group(1).lower(), "age_s": age, "text": text[:200]}
    return {"kind": "nvrm" if "NVRM:" in text or "nvidia-nvswitch" in text else "",
            "age_s": age, "text": text[:200]}


class KmsgReader:
    """The kernel log's NVIDIA records, read once when the node is judged (the log already
    holds what happened before the run; what happened during it is appended)."""

    name = "kmsg"

    def __init__(self, root: str = "/", limit_s: float = 0.3):
        self.path = os.path.join(root, "dev/kmsg")
        self.uptime_path = os.path.join(root, "proc/uptime")
        self.limit_s = limit_s

    def start(self) -> None:
        pass

    def sample(self) -> None:
        pass

    def finish(self) -> dict:
        try:
            with open(self.uptime_path) as f:
                uptime_s = float(f.read().split()[0])
            log = proc.kernel_log(self.path)
        except OSError as e:
            return {"unavailable": f"kernel log /dev/kmsg not readable here ({e.strerror})"}
        try:
            return self._read(log, uptime_s)
        except OSError as e:
            return {"unavailable": f"kernel log /dev/kmsg: {e.strerror}"}
        finally:
            log.close()

    def _read(self, log, uptime_s: float) -> dict:
        out = {"records": 0, "nvrm": False, "oldest_age_s": None, "xids": [], "recovery": [],
               "fallen": [], "sxids": [], "partial": None}
        end = time.monotonic() + self.limit_s
        for record in log:
            if time.monotonic() > end:  # the newest records, the ones that matter, not reached
                out["partial"] = f"not read to its end within {self.limit_s} s"
                break
            got = parse(record, uptime_s)
            out["records"] += 1
            if out["oldest_age_s"] is None:
                out["oldest_age_s"] = got["age_s"]
            if got["kind"]:
                out["nvrm"] = True
            if got["kind"] in ("xid", "recovery", "fallen", "sxid"):
                out[{"xid": "xids", "sxid": "sxids"}.get(got["kind"], got["kind"])].append(got)
        return out
