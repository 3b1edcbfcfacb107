"""A node's network interfaces, read without torch (preflight runs before torch imports):
their addresses, the ones NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME name, and their MTUs."""
from __future__ import annotations

import collections
import fcntl
import os
import socket
import struct


def ipv4_addresses() -> dict[str, str]:
    """The IPv4 address (SIOCGIFADDR) of every interface that has one, loopback included."""
    out = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue  # no IPv4 address
            out[name] = socket.inet_ntoa(packed[20:24])
    return out


def interface_addresses() -> dict[str, list[str]]:
    """Every interface's addresses, IPv4 (:func:`ipv4_addresses`) then IPv6 (/proc)."""
    ipv4 = ipv4_addresses()
    out = {name: [ipv4[name]] if name in ipv4 else [] for _, name in socket.if_nameindex()}
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                fields = line.split()
                if len(fields) == 6 and fields[5] in out:
                    raw = bytes.fromhex(fields[0])
                    out[fields[5]].append(socket.inet_ntop(socket.AF_INET6, raw))
    except OSError:
        pass  # no IPv6 on this kernel
    return out


def nccl_matches(spec: str, names: list[str]) -> list[str]:
    """The interfaces NCCL_SOCKET_IFNAME selects, in NCCL's syntax: a comma list of prefixes,
    ``=`` before the list for exact names, ``^`` for the ones to leave out (NCCL's env docs)."""
    exclude = spec.startswith("^")
    spec = spec[1:] if exclude else spec
    exact = spec.startswith("=")
    spec = spec[1:] if exact else spec
    items = [s for s in spec.split(",") if s]

    def hit(name: str) -> bool:
        return any(name == s if exact else name.startswith(s) for s in items)

    return [n for n in names if hit(n) != exclude]


def check_interfaces(environ=os.environ, addresses: dict | None = None) -> tuple[bool, str]:
    """Every named interface exists and carries an address."""
    have = interface_addresses() if addresses is None else addresses
    usable = {n: a for n, a in have.items() if a}
    shown = ", ".join(f"{n} {a[0]}" for n, a in usable.items()) or "none with an address"
    problems, seen = [], []
    gloo = environ.get("GLOO_SOCKET_IFNAME", "")
    for name in [s for s in gloo.split(",") if s]:
        if name not in have:
            problems.append(f"GLOO_SOCKET_IFNAME={gloo}: no interface {name} on this node")
        elif not have[name]:
            problems.append(f"GLOO_SOCKET_IFNAME={gloo}: {name} has no address")
        else:
            seen.append(f"GLOO_SOCKET_IFNAME {name} {have[name][0]}")
    nccl = environ.get("NCCL_SOCKET_IFNAME", "")
    if nccl:
        picked = [n for n in nccl_matches(nccl, list(have)) if have[n]]
        if picked:
            seen.append(f"NCCL_SOCKET_IFNAME={nccl} -> {','.join(picked)}")
        else:
            problems.append(f"NCCL_SOCKET_IFNAME={nccl}: matches no interface with an address")
    if problems:
        return False, "; ".join(problems) + f" (interfaces here: {shown})"
    return True, "; ".join(seen) or "no interface named (NCCL_/GLOO_SOCKET_IFNAME unset)"


def interface_mtu(addr: str) -> int | None:
    """The MTU of the interface holding ``addr``, or None: the kernel's (SIOCGIFMTU)."""
    name = next((n for n, a in interface_addresses().items() if addr in a), "")  # "": ENODEV
    ifreq = name.encode().ljust(40, b"\0")  # struct ifreq: the name, then ifr_mtu
    try:  # not /sys/class/net: a process entering a network namespace keeps its old /sys
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            return struct.unpack("16si20x", fcntl.ioctl(s.fileno(), 0x8921, ifreq))[1]
    except OSError:
        return None


def compare_mtus(mtus: dict[str, int]) -> tuple[bool, str, list[str]]:
    """Nodes whose MTU differs from most nodes' (all of a tie): ok, the words, the nodes."""
    counts = collections.Counter(mtus.values()).most_common()
    if len(counts) < 2:
        return True, f"{len(mtus)} node(s) alike, MTU {counts[0][0] if counts else '?'}", []
    usual = None if counts[0][1] == counts[1][1] else counts[0][0]  # a tie: every node
    odd = sorted(n for n, m in mtus.items() if m != usual)
    named = ", ".join(f"{n} {mtus[n]}" for n in odd)
    return False, (f"interface MTU differs between nodes: {named} (the others: {usual or '-'}); "
                   "a link between hosts of different MTU passes small packets and drops large "
                   "ones (jumbo frames behind a port without them): one MTU everywhere"), odd
