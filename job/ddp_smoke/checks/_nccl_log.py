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
        ``plugin``: the line that names a loaded net plugin, or None.
    """
    out = {"network": None, "devices": {}, "gdr": None, "fallback": None, "plugin": None}
    gdr_seen = {True: False, False: False}
    for line in lines:
        if "NCCL" not in line:
            continue
        if (m := _NETWORK.search(line)) and out["network"] is None:
            out["network"] = m.group(1)
        if m := _DEVICES.search(line):
            out["devices"].setdefault(m.group(1), m.group(2))
        if m := _NO_VERBS.search(line):
            out["fallback"] = out["fallback"] or m.group(1)
        if m := _PLUGIN.search(line):
            out["plugin"] = out["plugin"] or m.group(1)
        gdr_seen[True] |= bool(_GDR_ON.search(line))
        gdr_seen[False] |= bool(_GDR_OFF.search(line))
    if gdr_seen[True] or gdr_seen[False]:
        out["gdr"] = gdr_seen[True]
    return out


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


def read_own_log(pattern: str, pid: int | None = None) -> tuple[dict, list[str]]:
    """Parse this process's NCCL log files; returns the facts and the files read."""
    files = log_files(pattern, os.getpid() if pid is None else pid)
    lines: list[str] = []
    for path in files:
        with open(path, errors="replace") as f:
            lines += f.read().splitlines()
    return parse(lines), files
