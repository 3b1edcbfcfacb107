"""Who can reach whom, outside the process group: the link nobody can cross, the node nobody reaches.

When every rank is alive and waiting — a collective or the process group's set-up stuck past
its deadline — the heartbeats and the collective progress cannot say why: both ends of a dead
link wait, and so do the ranks waiting for them. A fresh TCP connection between the nodes can:

* at start, each node's leader (local rank 0) opens a small TCP probe port, on the address it
  uses to reach the coordination store, and posts it (``probe/<rank>``, listed in
  ``probe/listed``). It reads what a prober sends and answers with the byte count;
* when the run is aborted, each live leader connects to other leaders' probes, all at once
  with a short timeout (``diagnosis.probe_s``), and again to those it missed,
  ``probe_rounds`` tries in all (a lost SYN is not a dead link); then it sends each probe
  it reached one byte and, once that is counted,
  ``PAYLOAD_BYTES``, dozens of full frames written one at a time (so they leave as frames,
  not as one offloaded super-packet), and waits ``probe_s`` for the count: a link that passes
  small packets and drops large ones (jumbo frames behind a port without them, a cable
  corrupting long frames) opens a connection, carries the byte and never the payload. A probe
  that does not count even the byte is no link's doing: its process is stopped or frozen
  (its kernel still accepts and acknowledges), which the heartbeats tell. At most
  ``4 × probe_s`` whatever the world size. Up to ``ALL_PAIRS_UP_TO``
  nodes every leader tries every other; beyond, its ``RING`` neighbours on each side and
  ``SAMPLE`` more drawn at random (seeded by its rank), so each node is still tried by about
  ``2·RING + SAMPLE`` others at thousands of nodes. It posts what it tried, what it could
  not reach and what took no payload (``reach/<rank>``: ``tried``, ``failed``, ``large``); a
  refused connection counts as reached (the network delivered it; the process is another
  matter, the heartbeats tell);
* once every rank met, each leader keeps a connection open to each leader it would probe and
  sends one byte every ``BEACON_S`` (``links.beacon_s``; :func:`beacon`): traffic on every
  probed link for the whole run, so a port that goes down for a moment costs TCP a
  retransmission timeout that :mod:`.retransmits` counts in the check it fell in, whatever
  the checks sent and when;
* the rule (:func:`culprits`, pure) names a **node** when it and the nodes it was tried with
  mostly fail each other (nobody reaches it), and a **link** — both ends, neither convicted —
  when two nodes fail each other and each reaches others; a link that carries a connection
  and not a payload is named as such, with the MTU hint. Nodes whose every probe went
  through are never named.
"""
from __future__ import annotations

import errno
import fcntl
import json
import random
import selectors
import socket
import struct
import termios
import threading
import time

from ..config import DIAGNOSIS
from ..model import Culprit
from . import keys

PAYLOAD_BYTES = 1 << 16  # 64 KiB: 44 full 1500-byte frames, 7 jumbo ones; ms on any link
ALL_PAIRS_UP_TO = 64   # nodes: every leader tries every other
RING, SAMPLE = 4, 16   # beyond: neighbours each side in rank order, and a random sample
_REACHED = {0, errno.ECONNREFUSED}  # the host answered: the path is there
BEACON_S = 0.2         # a byte on every beacon link this often: an outage of 0.4 s times out
BEACON = b"B"          # a beacon's first byte (a prober's is b"\0")


def wait_s(rules: dict | None = None) -> float:
    """How long the report's writer waits for the live leaders' findings: the connects, the
    byte, the payload (``rules``: the run's ``diagnosis`` thresholds; None: the package's)."""
    r = rules or DIAGNOSIS
    return (r["probe_rounds"] + 2) * r["probe_s"] + 1.5


def tries(rules: dict | None = None) -> str:
    """What a probe tried, as reasons quote it."""
    r = rules or DIAGNOSIS
    return f"probe port, {r['probe_rounds']} tries of {r['probe_s']:g} s each"


class Probe:
    """A listening TCP socket on a daemon thread: it reads what a prober sends and answers
    with the count of bytes (8 bytes, big-endian); a prober that sends nothing is answered
    nothing (accepting was the answer). A prober silent for 2 x ``probe_s`` is let go."""

    def __init__(self, addr: str, probe_s: float = DIAGNOSIS["probe_s"]):
        self.probe_s = probe_s
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind((addr, 0))
        self.sock.listen(128)
        self.addr, self.port = addr, self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True, name="ddp-smoke-probe").start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=_count, args=(conn, 2 * self.probe_s), daemon=True).start()


def _count(conn: socket.socket, timeout_s: float) -> None:
    """Read until the prober stops sending; answer with the count. A beacon (its first byte
    ``BEACON``) is read for as long as it sends, however long a link outage keeps it silent."""
    got = 0
    with conn:
        conn.settimeout(timeout_s)
        try:
            while got < PAYLOAD_BYTES and (chunk := conn.recv(65536)):
                if not got and chunk[:1] == BEACON:
                    conn.settimeout(None)
                    while conn.recv(4096):
                        pass
                    return
                got += len(chunk)
            if got:
                conn.sendall(got.to_bytes(8, "big"))
        except OSError:
            pass


def route_address(host: str, port: int) -> str | None:
    """This machine's address on the route to ``host`` (a name or an address; a UDP
    socket's connect only picks the route, no packet is sent); None without a route."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host), port))
            return s.getsockname()[0]
    except OSError:
        return None


_PROBE: Probe | None = None


def listen(env, store, rules: dict | None = None) -> None:
    """On a node's leader: open the probe port and post it. Never raises: without a probe
    the run goes on, and an abort is blamed without this evidence."""
    global _PROBE
    if env.local_rank != 0:
        return
    addr = route_address(env.master_addr, env.master_port)
    if addr is None:  # no route to the store's host: nothing to listen on
        return
    try:
        _PROBE = Probe(addr, (rules or DIAGNOSIS)["probe_s"])
        store.set(keys.of(keys.PROBE, env.rank), json.dumps({"addr": _PROBE.addr, "port": _PROBE.port}))
        store.append(keys.listed(keys.PROBE), f"{env.rank},")
    except Exception:  # noqa: BLE001 — no route, no socket, or the store is gone
        _PROBE = None


def beacon(store, rank: int, every_s: float = BEACON_S) -> None:
    """On a node's leader, once every rank met: keep one TCP connection open to each leader it
    would probe (:func:`targets`) and send one byte on each every ``every_s``
    (``links.beacon_s``; 0: none) for the rest of the run. A link down for a moment (a
    flapping port) leaves those bytes unacknowledged and TCP counts a retransmission timeout,
    read with every other connection of the process by :mod:`.retransmits` at each check's
    end, whatever the checks sent over that link and when: measured on namespaced nodes, a
    port down 1 s in 2 gave 17 timeouts in 12 s, a healthy link none. Never raises."""
    if _PROBE is None or not every_s:
        return
    try:
        tried = targets(rank, leaders(store))
        got = store.multi_get([keys.of(keys.PROBE, r) for r in tried]) if tried else []
    except Exception:  # noqa: BLE001 — the store went away: the run is ending
        return
    addrs = [(p["addr"], p["port"]) for p in map(json.loads, got)]
    if addrs:
        threading.Thread(target=_beat, args=(addrs, every_s), daemon=True,
                         name="ddp-smoke-beacon").start()


def _beat(addrs: list[tuple[str, int]], every_s: float,
          stop: threading.Event | None = None) -> None:
    """Connect to every address at once and send each a byte every ``every_s`` (the first
    one ``BEACON``) until its peer goes (or ``stop`` is set); a connection still opening (a
    SYN lost to an outage is sent again by the kernel) waits its turn. Sends never block."""
    socks = []
    for addr in addrs:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # each byte its own segment
        s.connect_ex(addr)
        socks.append([s, BEACON])
    stop = stop or threading.Event()
    while socks:
        for one in list(socks):
            try:
                one[0].send(one[1])
                one[1] = b"."
            except BlockingIOError:  # still connecting, or bytes queued behind an outage
                pass
            except OSError:  # refused or reset: the peer's process ended
                one[0].close()
                socks.remove(one)
        if stop.wait(every_s):
            break
    for one in socks:
        one[0].close()


def targets(me: int, leaders: list[int]) -> list[int]:
    """The leaders ``me`` tries: all others up to ALL_PAIRS_UP_TO + 1 nodes; beyond, RING
    neighbours on each side in rank order and SAMPLE more at random (seeded by ``me``)."""
    others = [r for r in leaders if r != me]
    if len(others) <= ALL_PAIRS_UP_TO:
        return others
    ring = sorted(leaders)
    i = ring.index(me)
    near = {ring[(i + d) % len(ring)] for d in range(-RING, RING + 1) if d}
    rest = [r for r in others if r not in near]
    return sorted(near | set(random.Random(me).sample(rest, min(SAMPLE, len(rest)))))


def connect_all(addrs: dict[int, tuple[str, int]], timeout_s: float) -> set[int]:
    """The keys of ``addrs`` whose address could not be connected to within ``timeout_s``
    (all connects at once; a refusal counts as reached)."""
    sel, failed, end = selectors.DefaultSelector(), set(), time.monotonic() + timeout_s
    try:
        for key, (addr, port) in addrs.items():
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            code = s.connect_ex((addr, port))
            if code in _REACHED:
                s.close()
            elif code in (errno.EINPROGRESS, errno.EWOULDBLOCK):
                sel.register(s, selectors.EVENT_WRITE, key)
            else:
                s.close()
                failed.add(key)
        while sel.get_map() and (left := end - time.monotonic()) > 0:
            for k, _ in sel.select(left):
                if k.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) not in _REACHED:
                    failed.add(k.data)
                sel.unregister(k.fileobj)
                k.fileobj.close()
        for k in list(sel.get_map().values()):  # no answer at all: dropped on the way
            failed.add(k.data)
            k.fileobj.close()
    finally:
        sel.close()
    return failed


def carry_all(addrs: dict, timeout_s: float) -> set:
    """The keys of ``addrs`` (each reached) whose probe counted one byte and not
    PAYLOAD_BYTES, each within ``timeout_s``, all at once. A probe that counts not even the
    byte (refused; its process stopped or frozen) is left out: a payload cannot tell there."""
    dropped: dict = {}

    def one(key, addr):
        if _counted(addr, 1, timeout_s):
            dropped[key] = True  # until the payload is counted
            dropped[key] = not _counted(addr, PAYLOAD_BYTES, timeout_s)

    threads = [threading.Thread(target=one, args=(k, a), daemon=True) for k, a in addrs.items()]
    for t in threads:
        t.start()
    end = time.monotonic() + 2 * timeout_s + 0.5
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    return {k for k, v in dict(dropped).items() if v}


def _counted(addr: tuple[str, int], size: int, timeout_s: float) -> bool:
    """Whether the probe at ``addr`` took ``size`` bytes and answered with their count, within
    ``timeout_s`` for the connection, each segment and the answer."""
    try:
        with socket.create_connection(addr, timeout=timeout_s) as s:
            s.settimeout(timeout_s)
            _send_frames(s, size, timeout_s)
            s.shutdown(socket.SHUT_WR)  # the probe counts until the end of what is sent
            answer = b""
            while len(answer) < 8 and (chunk := s.recv(8 - len(answer))):
                answer += chunk
            return int.from_bytes(answer, "big") == size
    except OSError:
        return False


def _send_frames(s: socket.socket, size: int, timeout_s: float) -> None:
    """Send ``size`` bytes one full segment at a time, each alone on the wire (the next one
    only once the peer acknowledged it), so that each leaves as one frame of the path's MSS.
    Written at once, or while earlier segments wait in the queue, they would leave as
    segmentation-offload super-packets, which a virtual switch (a bridge, veths) forwards
    whatever its ports' MTU: the jumbo-frame fault would not show. A segment not
    acknowledged within ``timeout_s`` raises (socket.timeout): it was dropped on the way."""
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    mss = max(536, s.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG))
    end = time.monotonic() + timeout_s
    for at in range(0, size, mss):
        s.sendall(b"\0" * min(mss, size - at))
        while _unacknowledged(s):
            if time.monotonic() > end:
                raise socket.timeout(f"a {mss} B segment was never acknowledged")
            time.sleep(0.001)


def _unacknowledged(s: socket.socket) -> int:
    """Bytes of ``s`` sent or queued and not yet acknowledged (SIOCOUTQ)."""
    return struct.unpack("i", fcntl.ioctl(s.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]


def leaders(store) -> list[int]:
    """The ranks that opened a probe (one per node)."""
    try:
        key = keys.listed(keys.PROBE)
        listed = store.get(key).decode() if store.check([key]) else ""
    except Exception:  # noqa: BLE001 — evidence gathering never raises
        return []
    return sorted({int(r) for r in listed.split(",") if r})


def survey(store, rank: int, rules: dict | None = None) -> None:
    """On a node's leader, once, when the run is aborted: try the other leaders' probes and
    post what could not be reached. Never raises."""
    if _PROBE is None:
        return
    try:
        tried = targets(rank, leaders(store))
        got = store.multi_get([keys.of(keys.PROBE, r) for r in tried]) if tried else []
        addrs = {r: (p["addr"], p["port"]) for r, p in zip(tried, map(json.loads, got))}
        failed = set(addrs)
        rule = rules or DIAGNOSIS
        for _ in range(rule["probe_rounds"]):
            failed = connect_all({r: addrs[r] for r in failed}, rule["probe_s"])
            if not failed:
                break
        large = carry_all({r: a for r, a in addrs.items() if r not in failed}, rule["probe_s"])
        store.set(keys.of(keys.REACH, rank), json.dumps({"tried": tried, "failed": sorted(failed),
                                                         "large": sorted(large)}))
        store.append(keys.listed(keys.REACH), f"{rank},")
    except Exception:  # noqa: BLE001 — the store went away: nothing to tell
        pass


# -- the culprits (pure) ------------------------------------------------------------------------

def culprits(found: dict[int, dict], hosts: list, rules: dict | None = None) -> list[Culprit]:
    """Nodes nobody reaches and links nobody crosses, from each leader's ``{"tried",
    "failed", "large"}``; healthy nodes never appear. ``rules``: the run's ``diagnosis``
    thresholds the probes used (None: the package's), as the reasons quote them."""
    pairs: dict[frozenset, str | None] = {}  # unordered pair -> None, "large" or "cut"
    for a, f in found.items():
        bad, large = set(f.get("failed") or []), set(f.get("large") or [])
        for b in f.get("tried") or []:
            key = frozenset((a, b))
            was = pairs.get(key)
            now = "cut" if b in bad else "large" if b in large else None
            pairs[key] = "cut" if "cut" in (was, now) else was or now
    out = []
    while True:  # the node failing the largest share of its pairs first, then again without it
        tally: dict[int, list[int]] = {}
        for key, bad in pairs.items():
            for n in key:
                tally.setdefault(n, [0, 0])[0 if bad else 1] += 1
        worst = [(bad / (bad + ok), bad, -n) for n, (bad, ok) in tally.items()
                 if bad >= 2 and bad > ok]
        if not worst:
            break
        _, bad, n = max(worst)
        n = -n
        total = sum(tally[n])
        large = all(v == "large" for k, v in pairs.items() if n in k and v)
        out.append(Culprit(n, _host(hosts, n), (
            f"node {_host(hosts, n)} drops large packets: {bad} of the {total} nodes tried "
            f"with it opened a connection and could not deliver {PAYLOAD_BYTES // 1024} KiB "
            f"through it, outside the process group ({_MTU_HINT})" if large else
            f"node {_host(hosts, n)} is cut off: {bad} of the {total} nodes tried with it "
            f"could not connect to it or be connected to from it, outside the process group "
            f"({tries(rules)})")))
        pairs = {k: v for k, v in pairs.items() if n not in k}
    for key, bad in sorted(pairs.items(), key=lambda kv: sorted(kv[0])):
        if bad:
            out.append(_link(found, hosts, pairs, key, bad, rules))
    return out


_MTU_HINT = ("an MTU mismatch: jumbo frames on hosts behind a switch port without them, or a "
             "cable or port corrupting long frames; compare `ip link` MTU on both hosts and "
             "the ports between them")


def _link(found: dict, hosts: list, pairs: dict, key: frozenset, bad: str,
          rules: dict | None) -> Culprit:
    a, b = sorted(key)
    why = "failed" if bad == "cut" else "large"
    ways = [x for x, y in ((a, b), (b, a)) if y in set((found.get(x) or {}).get(why) or [])]
    reached = all(any(n in k and not v for k, v in pairs.items()) for n in (a, b))
    also = "while each reaches other nodes" if reached else \
        "and no third node tells the link from either end"
    ends = f"link {_host(hosts, a)} (rank {a}) <-> {_host(hosts, b)} (rank {b})"
    if bad == "large":
        how = ("neither could deliver it to the other" if len(ways) == 2 else
               f"rank {ways[0]} could not deliver it to rank {b if ways[0] == a else a}")
        reason = (f"{ends} passes small packets and drops large ones: a connection opens and "
                  f"a {PAYLOAD_BYTES // 1024} KiB payload never arrives ({how}, outside the "
                  f"process group), {also}: {_MTU_HINT}")
    else:
        how = ("neither could connect to the other" if len(ways) == 2 else
               f"rank {ways[0]} could not connect to rank {b if ways[0] == a else a}")
        reason = (f"{ends} does not carry a connection: {how} outside the process group "
                  f"({tries(rules)}), {also}")
    return Culprit(None, None, reason, ranks=[a, b], hosts=[_host(hosts, a), _host(hosts, b)])


def _host(hosts: list, rank: int):
    return hosts[rank] if 0 <= rank < len(hosts) else None
