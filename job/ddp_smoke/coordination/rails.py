"""Rails on gloo: the interface each rank sends on, chosen before the process group exists.

A rail-optimized cluster gives each GPU of a node its own NIC, cabled to its own leaf switch:
GPU i of every node meets GPU i of every other over rail i (docs/rails.md). With the site
setting ``rails`` (``[eth0, eth1]``) and the gloo backend, local rank i sends on
``rails[i % len(rails)]``: the kit sets ``GLOO_SOCKET_IFNAME`` for that rank, over whatever the
launcher set, before the process group reads it (gloo reads it once, when the group is
created). On NCCL nothing is set here: NCCL picks each GPU's NIC itself, and the rails check
compares its choice with the setting.

A dead rail. gloo connects every pair of ranks when the process group is created: a rank whose
interface carries nothing would hold every rank there until the deadline, and no evidence
would say why. So first, outside the process group, each rank opens a probe port on its rail's
address (:class:`.reach.Probe`) and posts it (``rail/<r>``); it tries its rail's peers, the
ranks of its local rank on the other nodes (all at once, ``diagnosis.probe_s``, again for
those it missed; beyond 64 nodes :func:`.reach.targets` picks them), and posts those it could
not reach (``railreach/<r>``). Every rank of the rail then decides alike (:func:`cut_off`, pure,
the rule of :mod:`.reach` on one rail): a rank that two or more of its peers, and most of them,
fail with is cut off; a pair failing while neither end is explains the failure (two nodes
alone cannot tell which end) cuts both ends. A cut-off rank sends on the interface of its route
to the store instead, and says so (:func:`chosen`): the bandwidth check names the rail dead and
measures it no more. Cost: two arrivals and a few ms of connects; ``2 x probe_s`` more when a
rail is dead.
"""
from __future__ import annotations

import json
import os

from ..config import DIAGNOSIS
from ..errors import ConfigError
from ..interfaces import ipv4_addresses
from . import keys, reach, runtime

_CHOSEN: dict | None = None  # this rank's rail, once bound (see chosen())


def interface(rails: list[str], local_rank: int) -> str:
    """The rail device of a local rank: ``rails[local_rank % len(rails)]``."""
    return rails[local_rank % len(rails)]


def check(cfg: dict, env) -> None:
    """Before connecting: a rank that will bind a rail has that interface, with an IPv4
    address. Raises ConfigError (one line, exit 2) naming the key, the rank and the host."""
    if not cfg["rails"] or runtime.pick_backend(cfg["backend"]) != "gloo":
        return
    name, found = interface(cfg["rails"], env.local_rank), ipv4_addresses()
    if name not in found:
        raise ConfigError(
            f"key 'rails' = {cfg['rails']!r}: local rank {env.local_rank}'s interface {name!r} "
            f"has no IPv4 address on {runtime.hostname()} (interfaces with one: "
            f"{', '.join(sorted(found)) or 'none'}); list this node's rail interfaces")


def chosen() -> dict | None:
    """This rank's rail as bound: ``index`` (its local rank), ``interface``, ``address``,
    ``sent_on`` (the interface gloo was given), ``dead`` (None, or who could not be reached);
    None when no rail was bound (no ``rails`` setting, or NCCL)."""
    return _CHOSEN


def bind(c, store, rails: list[str] | None, backend: str) -> None:
    """Probe this rank's rail, decide with its peers who is cut off, then point gloo at it (or
    not)."""
    global _CHOSEN
    if not rails or backend != "gloo":
        return
    env = c.env
    name = interface(rails, env.local_rank)
    addr = ipv4_addresses().get(name)
    records, group, found = _survey(c, store, name, addr)
    dead = _dead(env.rank, records, group, found)
    sent_on = runtime.store_route(env)[1] if dead else name
    if sent_on:
        os.environ["GLOO_SOCKET_IFNAME"] = sent_on
    else:  # no interface found for the store's route: gloo's own default (the hostname)
        os.environ.pop("GLOO_SOCKET_IFNAME", None)
    _CHOSEN = {"index": env.local_rank, "interface": name, "address": addr,
               "sent_on": sent_on, "dead": dead}


def _survey(c, store, name: str, addr: str) -> tuple[list[dict], list[int], dict]:
    """Every rank's rail record, this rank's rail group (itself and its peers on the other
    nodes), and each group member's probe findings ``{"tried", "failed"}``."""
    rules = c.cfg.get("diagnosis") or DIAGNOSIS
    env, probe = c.env, reach.Probe(addr, rules["probe_s"])
    node = f"{runtime.hostname()}/{env.group_rank}"
    try:
        mine = {"node": node, "local_rank": env.local_rank, "interface": name,
                "address": addr, "port": probe.port}
        c.arrive(store, keys.RAIL, "every rank to post its rail", mine=json.dumps(mine))
        records = [json.loads(v) for v in
                   store.multi_get([keys.of(keys.RAIL, r) for r in range(env.world_size)])]
        group = [r for r, x in enumerate(records)
                 if x["local_rank"] == env.local_rank and (x["node"] != node or r == env.rank)]
        tried = reach.targets(env.rank, group)
        failed = set(tried)
        for _ in range(rules["probe_rounds"]):  # a lost SYN is no dead rail: again if missed
            failed = reach.connect_all({r: (records[r]["address"], records[r]["port"])
                                        for r in failed}, rules["probe_s"])
            if not failed:
                break
        c.arrive(store, keys.RAIL_REACH, "every rank to probe its rail",
                 mine=json.dumps({"tried": tried, "failed": sorted(failed)}))
    finally:
        probe.sock.close()
    found = dict(zip(group, map(json.loads, store.multi_get(
        [keys.of(keys.RAIL_REACH, r) for r in group]))))
    return records, group, found


def _dead(rank: int, records: list[dict], group: list[int], found: dict) -> dict | None:
    """Why this rank's rail is dead (:func:`cut_off`) and whom it did not reach; None if it
    is not."""
    why = cut_off(found).get(rank)
    if why is None:
        return None
    unreached = sorted({records[r]["node"].rpartition("/")[0] for r in group
                        if rank in found[r]["failed"] or r in found[rank]["failed"]})
    return {"why": why, "unreached": unreached, "tried": len(found[rank]["tried"])}




def cut_off(found: dict[int, dict]) -> dict[int, str]:
    """The ranks of one rail that cannot carry it, from each one's ``{"tried", "failed"}``:
    :func:`.reach.culprits`'s rule, on the rail's ranks instead of the nodes' leaders.

    Returns:
        ``{rank: "cut off"}`` for a rank that two or more of its peers, and most, fail with,
        and ``{rank: "unresolved"}`` for both ends of each failing pair left over (neither
        end explains it, or two nodes alone cannot tell): gloo would connect neither.
    """
    named = reach.culprits(found, [])
    out = {c.rank: "cut off" for c in named if c.rank is not None}
    for c in named:
        out.update({n: "unresolved" for n in c.ranks or [] if n not in out})
    return out
