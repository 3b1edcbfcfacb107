"""Where a GPU, a NIC and a rank's cores sit, read from sysfs: NUMA node and PCIe path.

No traffic, no tool, no root: ``/sys/bus/pci/devices/<bus id>`` is a link into the device
tree, whose path is the device's PCIe ancestry (``/sys/devices/pci0000:00/0000:00:01.0/
0000:01:00.0/0000:02:08.0/0000:18:00.0``: host bridge, root port, switch ports, device), and
holds ``numa_node`` (-1: the platform does not say). A network interface's PCI device is
``/sys/class/net/<if>/device``, an RDMA device's ``/sys/class/infiniband/<dev>/device``; a
virtual interface (veth, bridge) has none. A NUMA node's cores are
``/sys/devices/system/node/node<N>/cpulist``.

How far two devices are, in the words of ``nvidia-smi topo -m`` and NCCL's topology (the same
legend): **PIX** at most one PCIe switch between them, **PXB** several switches without the
host bridge, **PHB** through the PCIe host bridge (the CPU), **NODE** between host bridges of
one NUMA node, **SYS** across the interconnect between NUMA nodes. Every reader takes the
filesystem ``root`` it reads under, so tests point it at a tree they make
(``tests/data/topology/``). The health check reads the same tree for HCA ports and the
driver's GPUs (:mod:`ddp_smoke.checks.health.readers.sysfs`, whose port states the rails check
reuses); this module is the one place for locality, for any check to share.
"""
from __future__ import annotations

import os
import re

LINKS = ("PIX", "PXB", "PHB", "NODE", "SYS")  # nearest first
_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


def _text(root: str, path: str) -> str | None:
    try:
        with open(os.path.join(root, path), errors="replace") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _tree_path(root: str, link: str) -> list[str] | None:
    """The PCIe ancestry of the device a sysfs link points to, host bridge first; None when
    the link is absent or not a PCI device (a virtual interface)."""
    base = os.path.join(root, link)
    if not os.path.exists(base):
        return None
    real = os.path.realpath(base)
    devices = os.path.realpath(os.path.join(root, "sys/devices"))
    parts = os.path.relpath(real, devices).split(os.sep)
    if not parts or not parts[0].startswith("pci") or not _BDF.match(parts[-1]):
        return None
    return [parts[0]] + [p for p in parts[1:] if _BDF.match(p)]


def place(root: str, link: str) -> dict | None:
    """``{"pci": bus id, "path": [host bridge, …, bus id], "numa_node": int | None}`` of the
    PCI device behind a sysfs link; None when there is none."""
    path = _tree_path(root, link)
    if path is None:
        return None
    numa = _text(root, os.path.join("sys/bus/pci/devices", path[-1], "numa_node"))
    node = int(numa) if numa and numa.lstrip("-").isdigit() and int(numa) >= 0 else None
    return {"pci": path[-1], "path": path, "numa_node": node}


def gpu(root: str, bus_id: str) -> dict | None:
    """A GPU by its PCI bus id (``0000:18:00.0``)."""
    return place(root, os.path.join("sys/bus/pci/devices", bus_id.lower()))


def nic(root: str, name: str) -> dict | None:
    """A NIC by an RDMA device name (``mlx5_3``) or a network interface name (``eth1``),
    with ``kind`` (``rdma``/``net``); None when it has no PCI device or does not exist."""
    for kind, cls in (("rdma", "sys/class/infiniband"), ("net", "sys/class/net")):
        if os.path.exists(os.path.join(root, cls, name)):
            got = place(root, os.path.join(cls, name, "device"))
            return {**got, "kind": kind} if got else None
    return None


def rdma_devices(root: str) -> list[str]:
    """The node's RDMA devices (every NIC NCCL's IB transport could use)."""
    try:
        return sorted(os.listdir(os.path.join(root, "sys/class/infiniband")))
    except OSError:
        return []


def link(a: dict, b: dict) -> str:
    """How far two placed devices are: one of :data:`LINKS`."""
    if a["numa_node"] is not None and b["numa_node"] is not None and \
            a["numa_node"] != b["numa_node"]:
        return "SYS"
    if a["path"][0] != b["path"][0]:
        return "NODE"  # different host bridges of one NUMA node (or one the platform hides)
    common = 0
    for x, y in zip(a["path"], b["path"]):
        if x != y:
            break
        common += 1
    if common == 1:
        return "PHB"  # they meet only at the host bridge
    below = max(len(a["path"]), len(b["path"])) - common
    return "PIX" if below <= 2 else "PXB"  # one switch: its upstream port, a downstream port each


def cpulist(text: str | None) -> set[int]:
    """``"0-3,8,10-11"`` → {0, 1, 2, 3, 8, 10, 11}."""
    out: set[int] = set()
    for part in (text or "").split(","):
        lo, _, hi = part.strip().partition("-")
        if lo.isdigit():
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


def numa_of_cpus(root: str, cpus: set[int]) -> list[int]:
    """The NUMA nodes holding any of ``cpus``; empty when the node tree is absent."""
    base = "sys/devices/system/node"
    try:
        names = os.listdir(os.path.join(root, base))
    except OSError:
        return []
    nodes = sorted(int(n[4:]) for n in names if n.startswith("node") and n[4:].isdigit())
    return [n for n in nodes if cpulist(_text(root, f"{base}/node{n}/cpulist")) & cpus]
