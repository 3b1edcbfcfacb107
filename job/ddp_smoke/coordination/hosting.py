"""The store host's side of the protocol: where it runs, what it watches, when it is done.

The coordination store can live in a process of its own, the *store host*
(``python -m ddp_smoke.store_host``), which no rank's death takes down; the workers use it
when DDP_SMOKE_STORE=HOST:PORT is in their environment (:func:`ddp_smoke.coordination.runtime.
connect_store`), and without it the torchrun agent's store or rank 0's, as before.

Why: when rank 0's process (submitit, plain env) or its torchrun agent hosts the store, the
store dies with it, and no survivor can take over the report. With the store host the store
stays up, a lost rank 0 is blamed like any lost rank, and the lowest survivor writes the report;
when no rank can write at all, the store host writes the report of last resort.

Here: the run's shape each rank posts for it (:func:`post_meta`), what it watches
(:class:`Watch`, :func:`serve`), where each launcher's nodes find it (:func:`plan`, the
address file of :func:`publish_address`), and starting one detached (:func:`start_detached`).
Plain TCPStore calls only. No torch at import (submit's side imports this).
"""
from __future__ import annotations

import json
import os
import resource
import select
import socket
import subprocess
import sys
import threading
import time
from typing import Callable

from . import keys
from .store import TAKEOVER_SILENCES, Silence, dead_after, look_period, read_beats, try_get

ENV = "DDP_SMOKE_STORE"
PREFIX = "ddp_smoke/0"  # the harness's PrefixStore (TORCHELASTIC_RESTART_COUNT 0: no restarts)
LOOK_S = 0.25           # a look at the store: final, meta and every heartbeat, in ~4 calls
LINGER_S = 10.0         # after final: the ranks read the verdict and add themselves to "bye"
SPARE_FDS = 64          # beyond one connection per rank: the server's own, logs, the report


def say(message: str) -> None:
    print(f"ddp-smoke store host: {message}", file=sys.stderr, flush=True)


def raise_nofile(world_size: int | None) -> str | None:
    """Raise this process's open-file soft limit to its hard limit (the store host holds one
    connection per rank: 16,384 ranks need 16,384 descriptors, and many sites' default soft
    limit is 1,024). Returns the problem in one line when even the hard limit is too low
    for ``world_size`` ranks (None: not known), else None."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            hard = soft  # not allowed here: the soft limit is what there is
    need = (world_size or 0) + SPARE_FDS
    if world_size is None or hard >= need:
        return None
    return (f"preflight: {world_size} ranks need {need} file descriptors here (one store "
            f"connection per rank), and this host allows {hard} (ulimit -Hn): raise the hard "
            "limit (nofile in /etc/security/limits.conf, LimitNOFILE= for a service, the "
            "container's --ulimit nofile)")


def post_meta(store, world_size: int, cfg: dict, report_dir: str, started_at: str) -> None:
    """Each rank, once connected: the run's shape for the store host (one call; first wins)."""
    meta = {"world_size": world_size, "config": cfg, "report_dir": report_dir,
            "started_at": started_at, "posted_at": time.time()}
    store.compare_set(keys.META, "", json.dumps(meta, default=str))


def read_meta(store) -> dict | None:
    got = try_get(store, keys.META)
    try:
        return json.loads(got) if got else None
    except ValueError:
        return None


class Watch:
    """What the store host sees of the run: final or not, and when each heartbeat last moved."""

    def __init__(self, store):
        self.store, self.meta = store, None
        self.silence = Silence(dead_after(1))  # the package's, until the ranks post the run's
        self.moved: dict[int, float] = {}  # rank -> monotonic time its counter last moved
        self.beats_every, self._looked = LOOK_S, 0.0  # every heartbeat is read this often

    def look(self) -> str | None:
        """One look; returns the final verdict when set."""
        final = try_get(self.store, keys.FINAL)
        if final is not None:
            return final.decode()
        if time.monotonic() - self._looked >= self.beats_every:
            self.look_beats()
        return None

    def look_beats(self) -> None:
        if self.meta is None:
            self.meta = read_meta(self.store)
            world = int(self.meta["world_size"]) if self.meta else None
            if world:  # a large world's heartbeats are further apart, and costlier to read
                self.silence = Silence(dead_after(world, (self.meta.get("config") or {})
                                                  .get("diagnosis")))
                self.beats_every = look_period(world, 1)
            short = raise_nofile(world)
            if short:  # a launcher that did not say the world size: said as soon as known
                say(short)
        if self.meta is not None:
            self._looked = time.monotonic()
            beats = read_beats(self.store, range(int(self.meta["world_size"])))
            self.silence.update({r: b.get("n") for r, b in beats.items()})
            self.moved = {r: t for r, (_, t) in self.silence.last.items()}

    def all_silent_for(self) -> float | None:
        """Seconds since the last heartbeat of any rank moved; None before any beat."""
        if not self.moved:
            return None
        return time.monotonic() - max(self.moved.values())

    def bye(self) -> bool:
        return try_get(self.store, keys.every(keys.BYE)) is not None


def serve(watch: Watch, max_s: float, over: threading.Event,
          last_resort: Callable[[Watch, str], int], gone: threading.Event | None = None) -> int:
    """Watch the run until it is final (0) or no rank can write: then ``last_resort(watch,
    why)`` writes the report from the store and its status (1) is returned. ``over``: the
    launcher says the run is over on its node; ``gone``: no rank of the run is left at all
    (a one-node launcher whose torchrun returned), so nothing is waited for."""
    gone = gone or threading.Event()
    end, over_at = time.monotonic() + max_s, None
    while time.monotonic() < end:
        final = watch.look()
        if final is not None:
            # (nothing said: the writer's verdict stays the log's last line)
            linger = time.monotonic() + LINGER_S
            while not over.is_set() and not watch.bye() and time.monotonic() < linger:
                over.wait(LOOK_S)
                watch.look_beats()  # a dead rank never says bye: stop once nobody beats
                if (watch.all_silent_for() or 0) > watch.silence.after_s:
                    break
            return 0
        quiet = watch.all_silent_for()
        silent_s = TAKEOVER_SILENCES * watch.silence.after_s  # survivors had theirs
        if gone.is_set():
            watch.look_beats()
            if watch.meta is None:
                return 0  # no rank ever posted: it said why itself (bad input, killed early)
            return last_resort(watch, "every rank ended with no report written")
        if over.is_set() and over_at is None:
            over_at = time.monotonic()
        # The launcher says the run is over (srun ended, or the job is being cancelled): a
        # rank still beating may be writing the report; it gets a heartbeat silence, or
        # LINGER_S at most, before this host writes instead.
        ended = over_at is not None and (quiet is None or quiet > watch.silence.after_s
                                         or time.monotonic() - over_at > LINGER_S)
        if ended or (quiet is not None and quiet > silent_s):
            if watch.meta is None:
                say("no rank ever posted the run's shape: nothing to report")
                return 0 if over.is_set() else 1
            why = ("the launcher ended with no report written" if ended else
                   f"every heartbeat silent for {quiet:.1f} s and no report written")
            return last_resort(watch, why)
        gone.wait(LOOK_S)  # (over.wait would return at once once set)
    say(f"no verdict within --max-s {max_s:g} s")
    return last_resort(watch, f"no verdict within {max_s:g} s") if watch.meta is not None else 1


def start_detached(host: str, report_dir: str, max_s: float, timeout_s: float = 60.0) -> str:
    """Start a store host in a session of its own (a launcher that is itself one of the ranks'
    processes: submit's task 0); return its address once it listens. It outlives the caller:
    the caller's death is what it is for. Raises RuntimeError when it does not start."""
    proc = subprocess.Popen([sys.executable, "-m", "ddp_smoke.store_host",
                             "--host", host, "--report-dir", report_dir, "--max-s", str(max_s)],
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    if not select.select([proc.stdout], [], [], timeout_s)[0]:
        proc.kill()
        raise RuntimeError(f"the store host did not start within {timeout_s:g} s")
    line = proc.stdout.readline().decode().strip()
    if not line:
        raise RuntimeError(f"the store host exited with status {proc.wait()}")
    return line


def address_file(report_dir: str, run_id: str) -> str:
    """Where a launcher leaves its store host's address, for the other nodes' launchers and
    for anyone who looks into a run (submit's task 0: "none" when its node failed preflight;
    the local launcher, which is its own store host)."""
    return os.path.join(report_dir, "store", run_id)


def publish_address(path: str, address: str) -> None:
    """Leave the store host's address where the other ranks' launchers wait for it."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(address + "\n")
    os.replace(tmp, path)  # whole or absent


def await_address(path: str, timeout_s: float) -> str:
    """The address :func:`publish_address` left at ``path``; RuntimeError after ``timeout_s``."""
    end, pause = time.monotonic() + timeout_s, 0.05
    while time.monotonic() < end:
        try:
            with open(path) as f:
                got = f.read().strip()
            if got:
                return got
        except OSError:
            pass
        time.sleep(pause)
        pause = min(2 * pause, 1.0)
    raise RuntimeError(f"no store host address at {path} within {timeout_s:g} s (task 0 "
                       "starts the store host: did it start?)")


def plan(torchrun_args: list[str], hostname: str | None = None,
         addresses: set[str] | None = None) -> tuple[str, str]:
    """Where a node's store host is, from its torchrun options: ``("host", ADDR:PORT)`` on the
    node that hosts torchrun's rendezvous (it runs the store host), ``("join", ADDR:PORT)`` on
    the others. Every node derives the same address from the same ``--rdzv-endpoint``: the
    endpoint's host, its port + 1 (one more port the first node accepts). The rendezvous host
    is decided as torchrun decides it: ``is_host`` in ``--rdzv-conf``, else the endpoint names
    this machine (its hostname, FQDN, ``--local-addr`` or an address of its own).
    ``--standalone`` (one node): ``("host", "127.0.0.1:0")``, a free port. ValueError when
    the options say neither."""
    opts: dict[str, str] = {}
    it = iter(torchrun_args)
    for arg in it:
        if not arg.startswith("--"):
            continue
        name, eq, value = arg[2:].partition("=")
        name = name.replace("_", "-")  # torchrun takes --rdzv_endpoint and --rdzv-endpoint
        if not eq and name != "standalone":
            value = next(it, "")
        opts[name] = value
    if "standalone" in opts:
        return "host", "127.0.0.1:0"
    endpoint = opts.get("rdzv-endpoint") or (
        f"{opts['master-addr']}:{opts.get('master-port', '29500')}" if "master-addr" in opts
        else "")
    if not endpoint:
        raise ValueError("no --rdzv-endpoint (or --master-addr) among the torchrun options: "
                         "the nodes cannot agree on where the store host is")
    host, _, port = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", "29400")
    if not port.isdigit():
        raise ValueError(f"--rdzv-endpoint {endpoint!r}: expected HOST:PORT")
    conf = dict(kv.partition("=")[::2] for kv in opts.get("rdzv-conf", "").split(",") if kv)
    if "is-host" in opts or "is_host" in conf:
        here = str(conf.get("is_host", opts.get("is-host"))).lower() in ("1", "true")
    elif "node-rank" in opts and "rdzv-endpoint" not in opts:
        here = opts["node-rank"] == "0"  # static rendezvous: node 0 hosts the master
    else:
        name = hostname or socket.gethostname()
        mine = {"localhost", "127.0.0.1", name, socket.getfqdn(name), opts.get("local-addr")}
        here = host in mine | (addresses if addresses is not None else _own_addresses())
    return ("host" if here else "join"), f"{host}:{int(port) + 1}"


def _own_addresses() -> set[str]:
    """What this machine's name resolves to (as torchrun matches its endpoint)."""
    try:
        return {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    except OSError:
        return set()
