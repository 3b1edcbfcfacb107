"""``make smoke-local``: check the input once, then ``torchrun --standalone``, ending on the kit's
own last line with the workers' own exit status.

    python -m ddp_smoke.launch_local [--nproc-per-node N] [-- WORKER OPTIONS]
    python -m ddp_smoke.launch_local --check [--nproc-per-node N] [--nnodes N] [-- WORKER …]

Why not the plain ``torchrun`` command: torchrun raises ``ChildFailedError`` when any worker
exits non-zero, so a clean FAIL verdict (or one bad flag) ended in its 30-line traceback block,
and its own exit status is 1 whatever the workers said (2 for bad input never reached the
user). Here torchrun runs in this process through its own launcher API (the configuration
``torch.distributed.run`` makes from the same options, given to ``elastic_launch``), so the
exception is caught: its failures carry each worker's exit status. Nothing the workers print is
filtered; they write straight to the terminal as under torchrun.

Before any rank starts, the worker's options are checked as every rank would check them (flags,
config file, faults against the world size, each check's own options, the report folder
writable and held by no other live run): bad input is one line and exit 2, from here, once,
before torch is imported. ``--check`` does only that and starts nothing (exit 0 or 2): the
image's entrypoint runs it once before its torchrun, for the same reason. There ``--nnodes``
gives the world size with ``--nproc-per-node``; a count torchrun resolves itself (``gpu``,
``auto``, ``MIN:MAX``) leaves what depends on it to the ranks, and on several nodes the folder's
claim is not tested (a shared folder may already be held by another node's rank 0 of this run).

Time to verdict: nothing runs before the first rank that the bare tutorial under torchrun does
not do. This process is the store host (:class:`ddp_smoke.store_host.Hosted`: the coordination
store and its report of last resort, in a process that outlives every rank, as torchrun's agent
here does), and the ranks are forked from it (torchrun's ``fork`` start method, for a Python
function) once it has imported torch and the checks: each rank starts with what a spawned one
would spend seconds importing. A forked rank first closes its copies of this process's store
sockets, so that this process's death still closes every rank's connection to the store.

Each run gets its own id ``local-<UTC time>-<random>`` (``DDP_SMOKE_RUN_ID``, unless given) and
so its own default folder ``reports/<run id>``: two runs started in the same second no longer
share one folder and lose a report.
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import os
import secrets
import signal
import socket
import sys
import time
import uuid

from . import checks, cli, outputs, store_host
from .config.args import parse_config
from .config import prelaunch, report_dir
from .config.launchenv import run_id as launcher_run_id
from .coordination import fate, hosting, signing, store
from .errors import ConfigError, say_once

USAGE = ("usage: python -m ddp_smoke.launch_local [--check [--nnodes N]] [--nproc-per-node N] "
         "[--oversubscribe] [-- WORKER OPTIONS]")
# Ranks per usable core beyond which a local run is refused without --oversubscribe. Each rank
# is a whole Python process with torch (measured: 0.39-0.41 GB resident at its peak in a quick
# 2-rank run; seconds of CPU to import): 64 ranks on 2 cores would ask ~25 GB and a minute of
# imports before the first check, and their figures would be the scheduler's. Up to this many
# the run goes on, with a warning (2 ranks on a 1-core CI machine; 8 on a 2-core laptop).
RANKS_PER_CORE_MAX = 4


def _split(argv: list[str]) -> tuple[int | None, int | None, bool, list[str]]:
    """Processes per node, nodes (None: torchrun resolves it), check only, worker options."""
    given, check, rest = {}, False, list(argv)
    oversubscribe = False
    while rest and rest[0] != "--":
        arg = rest.pop(0)
        name, eq, value = arg.partition("=")
        name = name.replace("_", "-")
        if name == "--check" and not eq:
            check = True
            continue
        if name == "--oversubscribe" and not eq:
            oversubscribe = True
            continue
        if name not in ("--nproc-per-node", "--nnodes"):
            raise ConfigError(f"{arg}: unknown launcher option; {USAGE}")
        given[name] = value if eq else (rest.pop(0) if rest else "")
    if "--nnodes" in given and not check:
        raise ConfigError(f"--nnodes: only with --check (this launcher runs one node); {USAGE}")
    counts: list[int | None] = []
    for name, default in (("--nproc-per-node", "2"), ("--nnodes", "1")):
        value = given.get(name, default)
        if value.isdigit() and int(value) >= 1:
            counts.append(int(value))
        elif check and value:  # gpu, auto, 1:4 …: torchrun's to resolve on each node
            counts.append(None)
        else:
            raise ConfigError(f"{name} {value!r}: expected a whole number >= 1")
    if counts[0] and not check and not oversubscribe \
            and counts[0] > RANKS_PER_CORE_MAX * _cores():
        raise ConfigError(f"--nproc-per-node {counts[0]} on {_cores()} CPU core(s): more than "
                          f"{RANKS_PER_CORE_MAX} ranks per core (each a Python process with "
                          f"torch, ~0.4 GB): choose at most {RANKS_PER_CORE_MAX * _cores()}, or "
                          "add --oversubscribe (make smoke-local OVERSUBSCRIBE=1) to run it")
    return counts[0], counts[1], check, rest[1:]


def _run_id() -> str:
    given = os.environ.get("DDP_SMOKE_RUN_ID")
    if given:
        return launcher_run_id(os.environ)[0]  # checked as the workers will check it
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"local-{now}-{secrets.token_hex(3)}"


def prepare(argv: list[str]) -> tuple[int | None, list[str], str, bool, dict, str]:
    """Check everything a rank would check before it connects; return the rank count per
    node, the worker's options, the run id, whether only to check, the configuration and the
    report folder. Raises ConfigError."""
    nproc, nodes, check, worker_args = _split(argv)
    cfg = parse_config(worker_args)
    rid = _run_id()
    prelaunch.check_run(cfg, nproc * nodes if nproc and nodes else None)
    folder = report_dir(cfg, rid)
    outputs.check_writable(folder)
    if nodes == 1:  # another live run's folder: refused now
        prelaunch.hold(folder, rid, keep=False)
    return nproc, worker_args, rid, check, cfg, folder


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def main(argv: list[str] | None = None) -> int:
    try:
        nproc, worker_args, rid, check, cfg, folder = prepare(
            sys.argv[1:] if argv is None else argv)
        short = None if check else hosting.raise_nofile(nproc)
        if short:
            raise ConfigError(short)
    except ConfigError as e:
        say_once(f"ddp-smoke: error: {e}")
        return 2
    if check:  # the image's entrypoint: its torchrun starts the ranks
        return 0
    os.environ["DDP_SMOKE_RUN_ID"] = rid
    # the run's signing secret (coordination/signing.py): every rank's, in their environment
    secret = os.environ.setdefault(signing.ENV, secrets.token_hex(32))
    # torchrun sets 1 itself when unset, after a four-line banner saying so; the same value,
    # here before this process imports torch (the forked ranks inherit its thread pool size).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cores = _cores()
    if nproc > cores:
        print(f"# warning: {nproc} ranks on {cores} CPU core(s): they take turns, so times, "
              "bandwidth and compute figures are lower than this machine can do", flush=True)
    store.quiet_slices()  # before torch is imported: the forked ranks inherit it
    # torch, the worker and its checks, imported once: every forked rank starts with them
    from . import harness  # noqa: F401
    checks.load_all(cfg["checks"])
    # What torch and the checks made is kept for good: no collection walks it again, neither
    # here (the last one, at exit, took 0.85 s of this process's ~5.4 s) nor in the forked
    # ranks, whose copies of it stay shared (Python's gc.freeze, for a fork without exec)
    gc.freeze()
    try:
        hosted = store_host.Hosted("127.0.0.1", 0, secret, folder, store_host.MAX_S)
    except OSError as e:
        say_once(f"ddp-smoke: error: cannot host the coordination store on 127.0.0.1: {e}")
        return 1
    os.environ[hosting.ENV] = hosted.address
    hosting.publish_address(hosting.address_file(folder, rid), hosted.address)  # for a look
    try:
        status, said = _torchrun(nproc, worker_args, hosted.raw.port)
    finally:
        own = hosted.close()  # every rank has ended: a report of last resort if none wrote
    # One rank's death makes the agent stop the others, which may have reached the verdict
    # already (the store holds it final, own == 0): that verdict line stays the last.
    if said and not (own == 0 and said.startswith(NO_VERDICT)):
        say_once(said)
    return status or own


# torch's loggers that speak of the ranks' ends, after their verdict
QUIET_LOGGERS = ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn")
NO_VERDICT = "ddp-smoke: no verdict: "


def _torchrun(nproc: int, worker_args: list[str], store_port: int) -> tuple[int, str | None]:
    """``torchrun --standalone --nproc-per-node=N`` in this process, the ranks forked from it;
    the workers' exit status, and what to say last when no worker reached a verdict."""
    from torch.distributed import run as torchrun
    witness = fate.watch_workers()  # each worker's signal or exit status, for the culprits
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher import api as launcher_api

    # The agent's "failed (exitcode …)", "closing signal SIGTERM" and "Terminating process …"
    # lines come after the kit's verdict; the exit status below says the same.
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    # One node: everything on loopback. Without --local-addr the agent advertises the host's
    # name, which does not resolve in every container (a DaemonSet's pod here), and its store
    # then stalls for its 300 s connect timeout (as docker/entrypoint.sh says for torchrun).
    args = torchrun.parse_args(["--standalone", f"--nproc-per-node={nproc}",
                                "--local-addr=127.0.0.1", "--start-method=fork", "-m",
                                "ddp_smoke"])
    # what torchrun.run does for --standalone: a c10d rendezvous on a free local port
    args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    config, _, _ = torchrun.config_from_args(args)
    try:
        with _reaps_told(witness):
            launcher_api.elastic_launch(config=config, entrypoint=_rank)(store_port, *worker_args)
    except ChildFailedError as e:
        codes = sorted({f.exitcode for f in e.failures.values()})
        if 2 in codes:
            return 2, None  # bad input a rank found (its line is above)
        if 1 in codes:
            return 1, None
        # No worker reached its own verdict: say how they ended. The agent reports the first
        # rank it found failed; the Witness saw each end, and a rank killed by another signal
        # than the agent's own stop (SIGTERM) ended by itself too (two ranks killed at once).
        ends = {r: _how(f) for r, f in e.failures.items()}
        ends |= {r: f"killed by {end['signal']}" for r, end in
                 (dict(witness.ended) if witness else {}).items()
                 if r not in ends and end.get("signal") not in (None, "SIGTERM")}
        return 1, NO_VERDICT + ", ".join(f"rank {r} {how}" for r, how in sorted(ends.items()))
    except (SignalException, KeyboardInterrupt) as e:  # Ctrl-C, or a kill of this launcher:
        # torchrun stopped the ranks; the status a shell expects from that signal
        sig = getattr(e, "sigval", signal.SIGINT)
        return 128 + int(sig), (f"ddp-smoke: stopped by {signal.Signals(sig).name}; the ranks "
                                "were stopped too")
    return 0, None


@contextlib.contextmanager
def _reaps_told(witness: fate.Witness | None):
    """While the agent runs: each worker's end it reaps is told to the Witness too, at the
    reap, before the agent stops the other workers. A status the agent reaped before the
    Witness's thread woke is otherwise lost to it (a loaded machine, the agent's 0.1 s look
    first), and the report's writer waits for it in vain, naming the rank "gone" without its
    signal. The agent's forked workers are reaped by ``multiprocessing``'s ``Popen.poll``."""
    if witness is None:  # (no store host here: nobody to tell)
        yield
        return
    from multiprocessing import popen_fork
    stock, launcher = popen_fork.Popen.poll, os.getpid()

    def poll(self, *flag):
        known = self.returncode is not None
        code = stock(self, *flag)
        if code and not known and os.getpid() == launcher:  # (not in a worker)
            witness.reaped(self.pid, code)
        return code

    popen_fork.Popen.poll = poll
    try:
        yield
    finally:
        popen_fork.Popen.poll = stock


def _rank(store_port: int, *worker_args: str) -> int:
    """One rank, forked by torchrun's agent in this process: the worker, with its exit status
    as torchrun reads it (a return value for 0, the process's status otherwise)."""
    _close_inherited(store_port)
    fate.name_rank(int(os.environ["RANK"]))  # torchrun set it in this process, after the fork
    _siblings_forked(int(os.environ["LOCAL_WORLD_SIZE"]))
    for stream in (sys.stdout, sys.stderr):  # as torchrun's `python -u`: lines as they come
        stream.reconfigure(line_buffering=True)
    code = cli.worker(list(worker_args))
    if code:
        sys.exit(code)
    return 0


def _siblings_forked(nproc: int, bound_s: float = 5.0) -> None:
    """Wait (``bound_s`` at most) until the agent has forked every rank of this node, before
    this rank's first connection. A rank's connection wakes the launcher's store threads
    (each accepted connection's address is looked up): a fork taken while one of them holds
    a C library lock gives the new rank that lock held, forever (suspected of a forked rank
    that never connected, in two CI-like runs of 8 ranks). With no connection until the last
    fork, the launcher's threads are idle while it forks."""
    parent, end = os.getppid(), time.monotonic() + bound_s
    while time.monotonic() < end:
        forked = fate.children(parent)
        if forked is None or len(forked) >= nproc:  # (None: nothing to wait for)
            return
        time.sleep(0.002)


def _close_inherited(port: int) -> None:
    """Close this forked rank's copies of the launcher's store sockets (the listening one,
    those it accepted, its own client's): the launcher's death must close every rank's
    connection to the store, as a store host process's death does."""
    for name in os.listdir("/proc/self/fd"):
        try:
            sock = socket.socket(fileno=int(name))
        except (OSError, ValueError):
            continue  # not a socket
        try:
            ours = sock.family in (socket.AF_INET, socket.AF_INET6) and port in (
                sock.getsockname()[1], _peer_port(sock))
        except OSError:
            ours = False
        if ours:
            sock.close()
        else:
            sock.detach()


def _peer_port(sock: socket.socket) -> int | None:
    try:
        return sock.getpeername()[1]
    except OSError:  # not connected (a listening socket)
        return None


def _how(failure) -> str:
    if failure.exitcode < 0:
        return f"killed by {failure.signal_name()}"
    return f"exited {failure.exitcode}"


if __name__ == "__main__":
    sys.exit(main())
