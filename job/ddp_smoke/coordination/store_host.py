"""The coordination store in a process of its own, which no rank's death takes down.

    python -m ddp_smoke.coordination.store_host --host ADDR [--port P] [--report-dir DIR]
    python -m ddp_smoke.coordination.store_host --host ADDR --report-dir DIR -- COMMAND …
    python -m ddp_smoke.coordination.store_host --plan TORCHRUN_OPTIONS…   (see plan())

Hosts a c10d TCPStore (the server; plain TCPStore calls only) and prints ``ADDR:PORT`` as its
first line on stdout. The workers use it when DDP_SMOKE_STORE=ADDR:PORT is in their
environment; without it they use torchrun's agent store or rank 0's, as before. With a
COMMAND (torchrun, srun …) it runs the command with DDP_SMOKE_STORE exported, passes SIGTERM
and SIGINT on to it, and exits with its status; without one it serves until SIGTERM (the
launcher's "the run is over").

Why: when rank 0's process (submitit, plain env) or its torchrun agent hosts the store, the
store dies with it, and no survivor can take over the report. Here the store stays up, a lost
rank 0 is judged like any lost rank, and the lowest survivor writes the report.

It exits when the run is final (the ``final`` key: the report is written), after the ranks
had a moment to read the verdict (LINGER_S, or at once when every live rank said goodbye, or
the launcher says the run is over). When no rank can write (every heartbeat silent for
SILENT_S and no ``final``, or the launcher ended with none) it writes the report of last
resort from the store (:mod:`ddp_smoke.coordination.last_resort`) and exits 1. Bounded by
``--max-s`` in any case. Exit status: the command's (0 without one), or 1 when it wrote the
report of last resort, or 2 for bad input (one line).
"""
from __future__ import annotations

import argparse
import datetime
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from . import keys

ENV = "DDP_SMOKE_STORE"
PREFIX = "ddp_smoke/0"  # the harness's PrefixStore (TORCHELASTIC_RESTART_COUNT 0: no restarts)
LOOK_S = 0.25           # a look at the store: final, meta and every heartbeat, in ~4 calls
LINGER_S = 10.0         # after final: the ranks read the verdict and add themselves to "bye"
MAX_S = 86400.0


def _say(message: str) -> None:
    print(f"ddp-smoke store host: {message}", file=sys.stderr, flush=True)


class Watch:
    """What the store host sees of the run: final or not, and when each heartbeat last moved."""

    def __init__(self, store):
        from .store import DEAD_AFTER_S, Silence
        self.store, self.meta = store, None
        self.silence = Silence(DEAD_AFTER_S)
        self.moved: dict[int, float] = {}  # rank -> monotonic time its counter last moved

    def look(self) -> str | None:
        """One look; returns the final verdict when set."""
        from .store import read_beats, try_get
        from . import last_resort
        final = try_get(self.store, keys.FINAL)
        if final is not None:
            return final.decode()
        if self.meta is None:
            self.meta = last_resort.read_meta(self.store)
        if self.meta is not None:
            beats = read_beats(self.store, range(int(self.meta["world_size"])))
            self.silence.update({r: b.get("n") for r, b in beats.items()})
            self.moved = {r: t for r, (_, t) in self.silence.last.items()}
        return None

    def all_silent_for(self) -> float | None:
        """Seconds since the last heartbeat of any rank moved; None before any beat."""
        if not self.moved:
            return None
        return time.monotonic() - max(self.moved.values())

    def bye(self) -> bool:
        from .store import try_get
        return try_get(self.store, keys.every(keys.BYE)) is not None


def serve(watch: Watch, address: str, report_dir: str | None, max_s: float,
          over: threading.Event) -> int:
    """Watch the run until it is final (0) or no rank can write (last resort: 1)."""
    from .store import DEAD_AFTER_S
    silent_s = 3 * DEAD_AFTER_S  # the harness's TAKEOVER_S: survivors had their chance
    end, over_at = time.monotonic() + max_s, None
    while time.monotonic() < end:
        final = watch.look()
        if final is not None:
            _say(f"the run is final ({final})")
            linger = time.monotonic() + LINGER_S
            while not over.is_set() and not watch.bye() and time.monotonic() < linger:
                over.wait(LOOK_S)
            return 0
        quiet = watch.all_silent_for()
        if over.is_set() and over_at is None:
            over_at = time.monotonic()
        # The launcher says the run is over (srun ended, or the job is being cancelled): a
        # rank still beating may be writing the report; it gets DEAD_AFTER_S of silence, or
        # LINGER_S at most, before this host writes instead.
        ended = over_at is not None and (quiet is None or quiet > DEAD_AFTER_S
                                         or time.monotonic() - over_at > LINGER_S)
        if ended or (quiet is not None and quiet > silent_s):
            if watch.meta is None:
                _say("no rank ever posted the run's shape: nothing to report")
                return 0 if over.is_set() else 1
            why = ("the launcher ended with no report written" if ended else
                   f"every heartbeat silent for {quiet:.1f} s and no report written")
            return _last_resort(watch, address, report_dir, why)
        time.sleep(LOOK_S)  # (over.wait would return at once once set)
    _say(f"no verdict within --max-s {max_s:g} s")
    return _last_resort(watch, address, report_dir, f"no verdict within {max_s:g} s") \
        if watch.meta is not None else 1


def _last_resort(watch: Watch, address: str, report_dir: str | None, why: str) -> int:
    from ..errors import ReportWriteError
    from ..outputs.report import write_report
    from ..verdict import line
    from . import last_resort
    report = last_resort.build(watch.store, watch.meta, dict(watch.moved), address, why)
    try:  # a rank that still lives waits for `final` instead of taking over: no rank number
        watch.store.compare_set(keys.WRITER, "", str(watch.meta["world_size"]))
    except (RuntimeError, OSError):
        pass
    folder = report_dir or watch.meta.get("report_dir") or "."
    try:
        path = write_report(report, folder)
    except (ReportWriteError, OSError) as e:
        _say(f"error: {e}; the report follows as one JSON line")
        print(report.to_json_line(), file=sys.stderr, flush=True)
        return 1
    _say(f"no rank wrote the report ({why}); wrote {path}")
    watch.store.set(keys.FINAL, report.verdict)  # the ranks still waiting leave now
    _say(line(report.to_dict()))
    return 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--plan"]:  # the image's entrypoint: where is this node's store host?
        try:
            print(*plan(argv[1:]))
        except ValueError as e:
            print(f"ddp-smoke: error: store host: {e}", file=sys.stderr)
            return 2
        return 0
    command = argv[argv.index("--") + 1:] if "--" in argv else []
    ours = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(prog="python -m ddp_smoke.coordination.store_host",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default=socket.gethostname(),
                    help="the address the workers reach this host at (default: hostname)")
    ap.add_argument("--port", type=int, default=0, help="0: a free port")
    ap.add_argument("--report-dir", help="where the report of last resort goes (default: the "
                                         "folder the ranks posted)")
    ap.add_argument("--max-s", type=float, default=MAX_S, help="exit after this long, at most")
    a = ap.parse_args(ours)
    if not 0 <= a.port <= 65535 or not 0 < a.max_s <= MAX_S:
        print(f"ddp-smoke: error: store host: --port {a.port} / --max-s {a.max_s}: expected "
              f"0..65535 and (0, {MAX_S:g}]", file=sys.stderr)
        return 2
    import torch.distributed as dist
    try:  # the server listens on every address; --host is what the workers are told
        raw = dist.TCPStore("127.0.0.1", a.port, 1, True, datetime.timedelta(seconds=30),
                            wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        print(f"ddp-smoke: error: store host: cannot listen on port {a.port}: "
              f"{str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    address = f"{a.host}:{raw.port}"
    store = dist.PrefixStore(PREFIX, raw)
    print(address, flush=True)
    _say(f"serving the coordination store at {address} (pid {os.getpid()})")
    over = threading.Event()  # the launcher says the run is over: no rank is left
    child = None
    if command:
        try:
            child = subprocess.Popen(command, env={**os.environ, ENV: address})
        except OSError as e:
            print(f"ddp-smoke: error: store host: cannot run {command[0]}: {e.strerror}",
                  file=sys.stderr)
            return 2

    def on_signal(sig, _frame):
        if child is not None and child.poll() is None:
            child.send_signal(sig)  # the command (torchrun) stops its workers; we watch on
        else:
            over.set()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    result: list[int] = []
    watch = Watch(store)
    watcher = threading.Thread(target=lambda: result.append(
        serve(watch, address, a.report_dir, a.max_s, over)), daemon=True)
    watcher.start()
    if child is None:
        while watcher.is_alive():
            watcher.join(0.5)  # a join with a timeout lets the signal handlers run
        return result[0]
    rc = child.wait()
    # The command (this node's torchrun) ended; other nodes' ranks may still run and read the
    # store: the watcher decides when the run is over (final, or every heartbeat silent). A
    # run no rank ever joined (bad input: exit 2) has nothing to wait for.
    time.sleep(2 * LOOK_S)  # the watcher's next look has seen what the ranks posted
    if watch.meta is None and not watch.moved:
        over.set()
    while watcher.is_alive():
        watcher.join(0.5)
    own = result[0] if result else 1
    return rc if own == 0 else own


def start_detached(host: str, report_dir: str, max_s: float, timeout_s: float = 60.0) -> str:
    """Start a store host in a session of its own (a launcher that is itself one of the ranks'
    processes: submit's task 0); return its address once it listens. It outlives the caller:
    the caller's death is what it is for. Raises RuntimeError when it does not start."""
    import select
    proc = subprocess.Popen([sys.executable, "-m", "ddp_smoke.coordination.store_host",
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
    from .runtime import interface_addresses  # torch is imported here anyway
    return set(interface_addresses().values())


if __name__ == "__main__":
    sys.exit(main())
