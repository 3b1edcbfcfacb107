"""The coordination store in a process of its own, which no rank's death takes down.

    python -m ddp_smoke.store_host --host ADDR [--port P] [--report-dir DIR]
    python -m ddp_smoke.store_host --host ADDR --report-dir DIR -- COMMAND …
    python -m ddp_smoke.store_host --plan TORCHRUN_OPTIONS…   (see plan())

Hosts a c10d TCPStore (the server; plain TCPStore calls only) and prints ``ADDR:PORT`` as its
first line on stdout. The workers use it when DDP_SMOKE_STORE=ADDR:PORT is in their
environment; without it they use torchrun's agent store or rank 0's, as before. With a
COMMAND (torchrun, srun …) it runs the command with DDP_SMOKE_STORE exported, passes SIGTERM
and SIGINT on to it, and exits with its status; without one it serves until SIGTERM (the
launcher's "the run is over").

Why, and what it watches: :mod:`ddp_smoke.coordination.hosting`.

It exits when the run is final (the ``final`` key: the report is written), after the ranks had a
moment to read the verdict (LINGER_S, or at once when every live rank said goodbye, or the
launcher says the run is over). When no rank can write (every heartbeat silent for 3 x 1.5 s and
no ``final``, or the launcher ended with none) it writes the report of last resort from the
store (:func:`ddp_smoke.coordination.stopped_run.last_resort`) and exits 1. Bounded by
``--max-s`` in any case. Exit status: the command's (0 without one), or 1 when it wrote the
report of last resort, or 2 for bad input (one line).
"""
from __future__ import annotations

import argparse
import datetime
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time

from . import outputs
from .coordination import hosting, keys, signing, stopped_run

MAX_S = 86400.0


class Hosted:
    """A coordination store served by this process, and the watcher of the run it serves.

    The server listens on every address (``host`` is what the workers are told); records are
    read with the run's secret (``secret``, 64 hex digits; None: unsigned records only). The
    watcher thread (:func:`ddp_smoke.coordination.hosting.serve`) writes the report of last
    resort when no rank can (into ``report_dir``, else where the ranks said they write).
    Raises OSError when the port cannot be listened on.
    """

    def __init__(self, host: str, port: int, secret: str | None, report_dir: str | None,
                 max_s: float):
        import torch.distributed as dist
        try:
            self.raw = dist.TCPStore("127.0.0.1", port, 1, True,
                                     datetime.timedelta(seconds=30), wait_for_workers=False)
        except RuntimeError as e:  # c10d's bind errors are RuntimeErrors
            raise OSError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
        self.address = f"{host}:{self.raw.port}"
        # (the server is a client of itself too: the watcher reads through it)
        self.store = signing.SignedStore(dist.PrefixStore(hosting.PREFIX, self.raw),
                                         hosting.PREFIX,
                                         bytes.fromhex(secret) if secret else None, rank=-1)
        self.watch = hosting.Watch(self.store)
        self.over = threading.Event()   # the launcher says the run is over here
        self.gone = threading.Event()   # and no rank of it is left anywhere
        self._result: list[int] = []
        self._watcher = threading.Thread(target=lambda: self._result.append(hosting.serve(
            self.watch, max_s, self.over,
            lambda w, why: write_last_resort(w, self.address, report_dir, why), self.gone)),
            daemon=True, name="ddp-smoke-store-watch")
        self._watcher.start()

    def wait(self) -> int:
        """Until the watcher is done: 0, or 1 when it wrote the report of last resort."""
        while self._watcher.is_alive():
            self._watcher.join(0.5)  # a join with a timeout lets the signal handlers run
        return self._result[0] if self._result else 1

    def close(self) -> int:
        """Every rank of the run has ended (a one-node launcher's torchrun returned): decide
        now, without waiting for heartbeats to go quiet; return :meth:`wait`'s status."""
        self.over.set()
        self.gone.set()
        return self.wait()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--plan"]:  # the image's entrypoint: where is this node's store host?
        try:
            print(*hosting.plan(argv[1:]))
        except ValueError as e:
            print(f"ddp-smoke: error: store host: {e}", file=sys.stderr)
            return 2
        return 0
    command = argv[argv.index("--") + 1:] if "--" in argv else []
    ours = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(prog="python -m ddp_smoke.store_host",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default=socket.gethostname(),
                    help="the address the workers reach this host at (default: hostname)")
    ap.add_argument("--port", type=int, default=0, help="0: a free port")
    ap.add_argument("--report-dir", help="where the report of last resort goes (default: the "
                                         "folder the ranks posted)")
    ap.add_argument("--world-size", type=int, metavar="N",
                    help="the run's ranks, where the launcher knows them: one connection "
                         "each, so fewer file descriptors than that here is said before any "
                         "rank starts (exit 2)")
    ap.add_argument("--max-s", type=float, default=MAX_S, help="exit after this long, at most")
    ap.add_argument("--new-secret", action="store_true",
                    help="make the run's signing secret (DDP_SMOKE_SECRET) when none is given, "
                         "and hand it to COMMAND: only for a COMMAND that is the whole run; "
                         "across nodes the launcher gives every node one")
    a = ap.parse_args(ours)
    if not 0 <= a.port <= 65535 or not 0 < a.max_s <= MAX_S or (a.world_size or 1) < 1:
        print(f"ddp-smoke: error: store host: --port {a.port} / --max-s {a.max_s} / "
              f"--world-size {a.world_size}: expected 0..65535, (0, {MAX_S:g}] and >= 1",
              file=sys.stderr)
        return 2
    # The run's records are signed (coordination/signing.py): this process reads them with the
    # run's secret; without one it reads unsigned records only.
    secret = os.environ.get(signing.ENV) or (secrets.token_hex(32) if a.new_secret else None)
    if secret is not None and not signing.HEX64.match(secret):
        print(f"ddp-smoke: error: store host: {signing.ENV}: expected 64 hex digits",
              file=sys.stderr)
        return 2
    short = hosting.raise_nofile(a.world_size)
    if short:
        print(f"ddp-smoke: error: store host: {short}", file=sys.stderr)
        return 2
    try:
        hosted = Hosted(a.host, a.port, secret, a.report_dir, a.max_s)
    except OSError as e:
        print(f"ddp-smoke: error: store host: cannot listen on port {a.port}: {e}",
              file=sys.stderr)
        return 2
    print(hosted.address, flush=True)
    hosting.say(f"serving the coordination store at {hosted.address} (pid {os.getpid()})")
    child = None
    if command:
        try:
            child = subprocess.Popen(command, env={**os.environ, hosting.ENV: hosted.address,
                                                   **({signing.ENV: secret} if secret else {})})
        except OSError as e:
            print(f"ddp-smoke: error: store host: cannot run {command[0]}: {e.strerror}",
                  file=sys.stderr)
            return 2

    def on_signal(sig, _frame):
        if child is not None and child.poll() is None:
            child.send_signal(sig)  # the command (torchrun) stops its workers; we watch on
        else:
            hosted.over.set()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    # The reader of the address line (the sbatch, submit) reads that one line and no more:
    # whatever this process says later (the report of last resort's summary) goes to stderr,
    # never into a pipe that nobody drains. (COMMAND, started above, keeps the real stdout.)
    os.dup2(2, 1)
    if child is None:
        return hosted.wait()
    rc = child.wait()
    # The command (this node's torchrun) ended; other nodes' ranks may still run and read the
    # store: the watcher decides when the run is over (final, or every heartbeat silent). A
    # run no rank ever joined (bad input: exit 2) has nothing to wait for.
    time.sleep(2 * hosting.LOOK_S)  # the watcher's next look has seen what the ranks posted
    if hosted.watch.meta is None and not hosted.watch.moved:
        hosted.over.set()
    own = hosted.wait()
    return rc if own == 0 else own


def write_last_resort(watch: hosting.Watch, address: str, report_dir: str | None, why: str) -> int:
    """No rank can write the report: make it from what the store holds, as a rank
    would (:func:`ddp_smoke.coordination.stopped_run.last_resort`), publish it as a rank would,
    and set ``final`` so that a rank still waiting leaves. Returns 1 (the run failed, and no
    rank said so)."""
    report = stopped_run.last_resort(watch.store, watch.meta, dict(watch.moved), address, why)
    try:  # a rank that still lives waits for `final` instead of taking over: no rank number
        watch.store.compare_set(keys.WRITER, "", str(watch.meta["world_size"]))
    except (RuntimeError, OSError):
        pass
    hosting.say(f"no rank wrote the report ({why}); writing it from the store")
    verdict = outputs.publish(report, report_dir or watch.meta.get("report_dir") or ".",
                              report.run_id).verdict
    try:
        watch.store.set(keys.FINAL, verdict)  # the ranks still waiting leave now
    except (RuntimeError, OSError):
        pass
    return 1


if __name__ == "__main__":
    sys.exit(main())
