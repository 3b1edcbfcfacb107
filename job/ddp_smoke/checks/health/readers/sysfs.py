"""HCA ports and the driver's own list of GPUs, read from sysfs and procfs under a root.

``/sys/class/infiniband/<dev>/ports/<port>/`` holds ``state`` ("4: ACTIVE"), ``phys_state``
("5: LinkUp"), ``rate`` ("400 Gb/sec (4X NDR)"), ``link_layer``, ``counters/<name>`` (the
IBTA PortCounters; "N/A (no PMA)" where the device has no performance-management agent) and,
on mlx5 and others, ``hw_counters/<name>``. ``<dev>/device/net/<if>/carrier_changes`` counts
the link's carrier flaps. ``/proc/driver/nvidia/gpus/<bus id>/`` lists every GPU the driver
attached (in a container, the ones the runtime gave it); ``/sys/bus/pci/devices/<bus id>/config``
reads all ones (vendor 0xffff) for a device that no longer answers on the bus ("rev ff" in
lspci, OCI's check_bus). World-readable on standard kernels: no tool, no root, a few ms.
Every reader takes the filesystem ``root`` it reads under (a replayed node's tree in tests).
"""
from __future__ import annotations

import os
import re
import time

IB_CLASS = "sys/class/infiniband"
DRIVER_GPUS = "proc/driver/nvidia/gpus"
# PortCounters widths in bits (IBTA vol. 1, PortCounters; Linux drivers/infiniband/core/
# sysfs.c reads them at these widths): a counter at 2**bits - 1 is saturated and cannot rise
COUNTER_BITS = {"symbol_error": 16, "link_error_recovery": 8, "link_downed": 8,
                "port_rcv_errors": 16, "port_rcv_remote_physical_errors": 16,
                "port_xmit_discards": 16, "local_link_integrity_errors": 4,
                "excessive_buffer_overrun_errors": 4}
HW_COUNTERS = ("rnr_nak_retry_err", "local_ack_timeout_err")
_RATE = re.compile(r"^\s*([\d.]+)\s*Gb/sec")


def _text(path: str) -> str | None:
    try:
        with open(path, errors="replace") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _count(path: str) -> int | str | None:
    """An integer counter; its text where it is not one ("N/A (no PMA)"); None if absent."""
    text = _text(path)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        return text


def rate_gbps(text: str | None) -> float | None:
    """``"400 Gb/sec (4X NDR)"`` → 400.0; None when absent or unparsable."""
    m = _RATE.match(text or "")
    return float(m.group(1)) if m else None


def _ports(root: str) -> list[tuple[str, str, str]] | None:
    """(device, port, its directory) under root; None without an RDMA stack."""
    base = os.path.join(root, IB_CLASS)
    if not os.path.isdir(base):
        return None
    out = []
    for dev in sorted(os.listdir(base)):
        pdir = os.path.join(base, dev, "ports")
        try:
            numbers = sorted(os.listdir(pdir), key=lambda p: (len(p), p))
        except OSError:
            continue
        out += [(dev, port, os.path.join(pdir, port)) for port in numbers]
    return out


def _netdev(root: str, dev: str, port: str) -> str | None:
    """The network interface of an HCA port: the device's only one, or the one whose
    dev_port (0-based) is this port's."""
    ndir = os.path.join(root, IB_CLASS, dev, "device", "net")
    try:
        names = sorted(os.listdir(ndir))
    except OSError:
        return None
    if len(names) == 1:
        return names[0]
    return next((n for n in names if _text(os.path.join(ndir, n, "dev_port")) ==
                 str(int(port) - 1)), None)


def read_ports(root: str = "/") -> dict | None:
    """Every port, keyed ``"<dev>/<port>"``; None when there is no RDMA stack."""
    ports = _ports(root)
    if ports is None:
        return None
    out = {}
    for dev, port, p in ports:
        netdev = _netdev(root, dev, port)
        out[f"{dev}/{port}"] = {
            "state": _text(os.path.join(p, "state")),
            "phys_state": _text(os.path.join(p, "phys_state")),
            "rate": _text(os.path.join(p, "rate")),
            "rate_gbps": rate_gbps(_text(os.path.join(p, "rate"))),
            "link_layer": _text(os.path.join(p, "link_layer")),
            "counters": {c: _count(os.path.join(p, "counters", c)) for c in COUNTER_BITS},
            "hw_counters": {c: _count(os.path.join(p, "hw_counters", c)) for c in HW_COUNTERS},
            "netdev": netdev,
            "carrier_changes": None if netdev is None else _count(os.path.join(
                root, IB_CLASS, dev, "device", "net", netdev, "carrier_changes")),
        }
    return out


class HcaReader:
    """HCA ports at start and end, and every port state seen in between (link flaps)."""

    name = "hca"

    def __init__(self, root: str = "/", nccl_ib_hca: str | None = None):
        self.root, self.nccl_ib_hca = root, nccl_ib_hca
        self.first, self.t0, self.states = None, time.monotonic(), {}

    def start(self) -> None:
        self.first, self.t0 = read_ports(self.root), time.monotonic()
        self.states = {k: [p["state"]] for k, p in (self.first or {}).items()}

    def sample(self) -> None:
        for dev, port, p in _ports(self.root) or ():
            seen = self.states.setdefault(f"{dev}/{port}", [])
            state = _text(os.path.join(p, "state"))
            if not seen or seen[-1] != state:
                seen.append(state)

    def finish(self) -> dict:
        end = read_ports(self.root)
        if end is None:
            return {"absent": f"no {'/' + IB_CLASS} on this node"}
        for name, p in end.items():  # the end state is a sample too
            seen = self.states.setdefault(name, [])
            if not seen or seen[-1] != p["state"]:
                seen.append(p["state"])
        reading = {"start": self.first or {}, "end": end,
                   "window_s": round(time.monotonic() - self.t0, 3),
                   "states": self.states, "nccl_ib_hca": self.nccl_ib_hca}
        self.first, self.t0 = end, time.monotonic()
        self.states = {k: [p["state"]] for k, p in end.items()}
        return reading


class PciReader:
    """The GPUs the NVIDIA driver attached, and those of them that no longer answer on PCIe."""

    name = "pci"

    def __init__(self, root: str = "/"):
        self.root = root

    def start(self) -> None:
        pass  # a state, not a counter: read when judged

    def sample(self) -> None:
        pass

    def finish(self) -> dict:
        try:
            buses = sorted(os.listdir(os.path.join(self.root, DRIVER_GPUS)))
        except OSError as e:
            return {"driver_gpus": None, "why": f"/{DRIVER_GPUS}: {e.strerror}"}
        return {"driver_gpus": buses, "unresponsive": [b for b in buses if self._dead(b)]}

    def _dead(self, bus: str) -> bool:
        """Config space reads all ones: the device fell off the bus (its vendor id 0xffff)."""
        try:
            with open(os.path.join(self.root, "sys/bus/pci/devices", bus, "config"), "rb") as f:
                return f.read(2) == b"\xff\xff"
        except OSError:
            return False  # no such device file here: not evidence of anything
