"""Which network NCCL used, read from its own INFO log lines. Pure: text in, facts out.

NCCL announces its transport once per process at communicator init (``NCCL_DEBUG=INFO``, the
INIT and NET subsystems), in lines such as::

    host:1234:1300 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/RoCE [RO]; OOB eth0:…
    host:1234:1300 [0] NCCL INFO Using network IB
    host:1234:1300 [0] NCCL INFO Failed to open libibverbs.so[.1]
    host:1234:1300 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.5<0>
    host:1234:1300 [0] NCCL INFO Using network Socket
    host:1234:1300 [0] NCCL INFO Using network AWS Libfabric          (a net plugin)
    host:1234:1300 [0] NCCL INFO NET/IB : GPU Direct RDMA Enabled for HCA 0 'mlx5_0'
    host:1234:1300 [0] NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/IB/0/GDRDMA

``Using network <name>`` is the decision: ``IB`` (InfiniBand and RoCE, NCCL's verbs
transport), ``Socket`` (TCP), or the name a plugin gives itself. The rest explains it. Real
excerpts of each kind, with their sources, are in ``tests/data/nccl/``.

The rail a process sends on is in its channel lines: ``via NET/IB/3`` is NIC 3 of the
``NET/IB : Using [0]mlx5_0:1/IB … [3]mlx5_3:1/IB`` list (``NET/IBext_v8/3`` from a plugin,
``NET/IB/3(5)/GDRDMA`` through a proxy, ``Ring 00 : … via NET/IB/0`` in older versions). A
log file holds one process's lines, so every channel line in it is one of its own links.
"""
from __future__ import annotations

import glob
import os
import re
from typing import Iterable

_NETWORK = re.compile(r"NCCL INFO Using network (.+?)\s*$")
_DEVICES = re.compile(r"NCCL INFO NET/(\w+) ?: Using (\[\d+\].+?)\s*$")
_GDR_ON = re.compile(r"GPU Direct RDMA Enabled for|via NET/\S+/GDRDMA")
_GDR_OFF = re.compile(r"GPU Direct RDMA Disabled for")
_NO_VERBS = re.compile(r"(Failed to open libibverbs\S*|NET/IB : No device found\.?)")
_CHANNEL = re.compile(r"NCCL INFO (?:Channel|Ring) \d+(?:/\d+)? : .*via NET/([A-Za-z]+)\w*/(\d+)")
_NIC = re.compile(r"\[(\d+)\]([^\s:\[\]]+):(\S+)")
_PLUGIN = re.compile(r"NCCL INFO (NET/OFI Using aws-ofi-nccl \S+|Plugin Path : \S+|"
                     r"NET/Plugin: Loaded net plugin \S+.*)$")


def parse(lines: Iterable[str]) -> dict:
    """What one process's NCCL log says about its network.

    Returns:
        ``network``: the name in ``Using network <name>`` (None if no such line);
        ``devices``: ``{transport: "[0]mlx5_0:1/IB …"}`` from ``NET/<x> : Using`` lines;
        ``gdr``: True when GPUDirect RDMA is enabled for some NIC (or a channel uses it), False
        when only "Disabled" lines appear, None when the log does not say;
        ``fallback``: why verbs were not used ("Failed to open libibverbs.so[.1]", …) or None;
        ``plugin``: the line that names a loaded net plugin, or None;
        ``net_channels``: ``{"IB/3": n}``, how many channel lines go through each NIC.
    """
    out = {"network": None, "devices": {}, "gdr": None, "fallback": None, "plugin": None,
           "net_channels": {}}
    gdr_seen = {True: False, False: False}
    for line in lines:
        if "NCCL" not in line:
            continue
        if (m := _NETWORK.search(line)) and out["network"] is None:
            out["network"] = m.group(1)
        if m := _DEVICES.search(line):
            out["devices"].setdefault(m.group(1), m.group(2))
        if m := _CHANNEL.search(line):
            key = f"{m.group(1)}/{m.group(2)}"
            out["net_channels"][key] = out["net_channels"].get(key, 0) + 1
        if m := _NO_VERBS.search(line):
            out["fallback"] = out["fallback"] or m.group(1)
        if m := _PLUGIN.search(line):
            out["plugin"] = out["plugin"] or m.group(1)
        gdr_seen[True] |= bool(_GDR_ON.search(line))
        gdr_seen[False] |= bool(_GDR_OFF.search(line))
    if gdr_seen[True] or gdr_seen[False]:
        out["gdr"] = gdr_seen[True]
    return out


def nics(devices: dict) -> dict:
    """The NIC lists of ``parse()["devices"]``, by transport and index: ``{"IB": {3:
    {"device": "mlx5_3", "port": 1, "link_layer": "IB"}}}``; a socket NIC has its
    ``address`` instead of a port (``[0]eth0:10.0.0.5<0>``)."""
    out: dict = {}
    for transport, listed in devices.items():
        for index, name, rest in _NIC.findall(listed):
            port, _, layer = rest.partition("/")
            nic = ({"device": name, "port": int(port), "link_layer": layer or None}
                   if port.isdigit() else {"device": name, "address": rest.split("<")[0]})
            out.setdefault(transport, {})[int(index)] = nic
    return out


def sending_nic(facts: dict) -> dict | None:
    """The NIC most of this process's network channels go through, with ``channels``
    ({"IB/3": n}); None when no channel crossed a network (one node, or no log)."""
    counted = facts.get("net_channels") or {}
    if not counted:
        return None
    key = max(sorted(counted), key=counted.get)
    transport, _, index = key.partition("/")
    listed = nics(facts.get("devices") or {})
    table = listed.get(transport) or next(
        (v for t, v in listed.items() if transport.startswith(t) or t.startswith(transport)), {})
    nic = table.get(int(index)) or {"device": None}
    return {**nic, "transport": transport, "index": int(index), "channels": dict(counted)}


def matches(network: str | None, expected: str) -> bool:
    """Whether NCCL's network name is the expected one: ``ib`` (IB, RoCE included),
    ``socket``, or any other word, matched case-insensitively inside a plugin's name
    (``libfabric`` matches "AWS Libfabric")."""
    if not network:
        return False
    want, got = expected.strip().lower(), network.strip().lower()
    if want in ("ib", "socket"):
        return got == want
    return want in got


def log_files(pattern: str, pid: int) -> list[str]:
    """This process's files for an ``NCCL_DEBUG_FILE`` pattern (``%h`` host, ``%p`` pid)."""
    return sorted(glob.glob(pattern.replace("%h", "*").replace("%p", str(pid))))


def read_own_log(pattern: str | None = None, pid: int | None = None) -> tuple[dict, list[str]]:
    """Parse this process's NCCL log files (``NCCL_DEBUG_FILE`` unless ``pattern`` is given;
    none set: no facts); returns the facts and the files read. The one reader of the log."""
    pattern = os.environ.get("NCCL_DEBUG_FILE", "") if pattern is None else pattern
    files = log_files(pattern, os.getpid() if pid is None else pid) if pattern else []
    lines: list[str] = []
    for path in files:
        with open(path, errors="replace") as f:
            lines += f.read().splitlines()
    return parse(lines), files
