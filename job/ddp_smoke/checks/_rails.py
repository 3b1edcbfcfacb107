"""This rank's rail: the network device it sends on, and where the backend learnt it.

* gloo with the ``rails`` setting: the interface bound before the process group
  (:mod:`ddp_smoke.coordination.rails`), or the one it fell back to when its rail was dead;
* gloo without it: ``GLOO_SOCKET_IFNAME`` as the launcher set it (its first interface), else
  the interface of the route to the store (where gloo's default, the hostname, usually lands);
* NCCL: the NIC most of this process's network channels go through, from its own INFO log
  (:func:`ddp_smoke.checks._nccl_log.sending_nic`); known only once a collective has crossed
  a node, so the checks that need it read it after their traffic.

The rail's number is the rank's local rank: rail i is GPU (or rank) i of every node.
"""
from __future__ import annotations

import os

from ..coordination import rails, runtime
from ..interfaces import ipv4_addresses
from . import _nccl_log as nccl_log


def mine(ctx) -> dict:
    """``{"index", "device", "port", "source", "sent_on", "dead", …}`` for this rank."""
    out = {"index": ctx.local_rank, "device": None, "port": None, "dead": None}
    if ctx.backend == "nccl":
        facts = nccl_log.read_own_log()[0]
        nic = nccl_log.sending_nic(facts)
        if nic is None:
            return {**out, "source": "NCCL log: no channel through a network"}
        return {**out, **{k: nic.get(k) for k in ("device", "port", "link_layer", "address",
                                                 "transport", "channels")},
                "source": "NCCL log", "sent_on": nic.get("device")}
    bound = rails.chosen()
    if bound is not None:
        return {**out, "device": bound["interface"], "address": bound["address"],
                "sent_on": bound["sent_on"], "dead": bound["dead"], "source": "rails setting"}
    given = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if given:
        return {**out, "device": given, "sent_on": given, "source": "GLOO_SOCKET_IFNAME",
                "address": ipv4_addresses().get(given)}
    addr, name = runtime.store_route(ctx.env)
    return {**out, "device": name, "sent_on": name, "address": addr,
            "source": "route to the store"}

