"""HCA readings from sysfs: every InfiniBand/RoCE port's state, rate and error counters.

``/sys/class/infiniband/<dev>/ports/<port>/`` holds ``state`` ("4: ACTIVE"), ``phys_state``
("5: LinkUp"), ``rate`` ("400 Gb/sec (4X NDR)"), ``link_layer`` and ``counters/<name>`` (the
IBTA PortCounters, plain integers). The files are world-readable on standard kernels; the
reader takes the filesystem ``root`` it reads under, so tests point it at a tree they make
(as :mod:`ddp_smoke.identity`'s readers do). No tool, no root, a few ms per port.
"""
from __future__ import annotations

import os
import re

IB_CLASS = "sys/class/infiniband"
# Counters whose increase across the run is judged (_health_rules.HCA_COUNTERS says how).
COUNTERS = ("link_downed", "symbol_error", "link_error_recovery", "port_rcv_errors",
            "local_link_integrity_errors", "excessive_buffer_overrun_errors")
_RATE = re.compile(r"^\s*([\d.]+)\s*Gb/sec")


def _text(path: str) -> str | None:
    try:
        with open(path, errors="replace") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _int(path: str) -> int | None:
    text = _text(path)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def rate_gbps(text: str | None) -> float | None:
    """``"400 Gb/sec (4X NDR)"`` → 400.0; None when absent or unparsable."""
    m = _RATE.match(text or "")
    return float(m.group(1)) if m else None


def read_ports(root: str = "/") -> dict | None:
    """Every port under root/sys/class/infiniband, keyed ``"<dev>/<port>"``; None when the
    class directory does not exist (no RDMA stack: nothing to judge, said as such)."""
    base = os.path.join(root, IB_CLASS)
    if not os.path.isdir(base):
        return None
    ports = {}
    for dev in sorted(os.listdir(base)):
        pdir = os.path.join(base, dev, "ports")
        try:
            numbers = sorted(os.listdir(pdir), key=lambda p: (len(p), p))
        except OSError:
            continue
        for port in numbers:
            p = os.path.join(pdir, port)
            ports[f"{dev}/{port}"] = {
                "state": _text(os.path.join(p, "state")),
                "phys_state": _text(os.path.join(p, "phys_state")),
                "rate": _text(os.path.join(p, "rate")),
                "rate_gbps": rate_gbps(_text(os.path.join(p, "rate"))),
                "link_layer": _text(os.path.join(p, "link_layer")),
                "counters": {c: _int(os.path.join(p, "counters", c)) for c in COUNTERS},
            }
    return ports
