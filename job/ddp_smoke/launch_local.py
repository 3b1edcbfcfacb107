"""``make smoke-local``: check the input once, then ``torchrun --standalone``, ending on the kit's
own last line with the workers' own exit status.

    python -m ddp_smoke.launch_local [--nproc-per-node N] [-- WORKER OPTIONS]
    python -m ddp_smoke.launch_local --check [--nproc-per-node N] [--nnodes N] [-- WORKER …]

Why not the plain ``torchrun`` command: torchrun raises ``ChildFailedError`` when any worker
exits non-zero, so a clean FAIL verdict (or one bad flag) ended in its 30-line traceback block,
and its own exit status is 1 whatever the workers said (2 for bad input never reached the
user). Here torchrun runs in this process through its own entry point
(``torch.distributed.run.run``, the function the ``torchrun`` command calls), so the exception
is caught: its failures carry each worker's exit status. Nothing the workers print is
filtered; they write straight to the terminal as under torchrun.

Before any rank starts, the worker's options are checked as every rank would check them (flags,
config file, faults against the world size, each check's own options, the report folder
writable and held by no other live run): bad input is one line and exit 2, from here, once.
``--check`` does only that and starts nothing (exit 0 or 2): the image's entrypoint runs it
once before its torchrun, for the same reason. There ``--nnodes`` gives the world size with
``--nproc-per-node``; a count torchrun resolves itself (``gpu``, ``auto``, ``MIN:MAX``) leaves
what depends on it to the ranks, and on several nodes the folder's claim is not tested (a shared
folder may already be held by another node's rank 0 of this run).

Each run gets its own id ``local-<UTC time>-<random>`` (``DDP_SMOKE_RUN_ID``, unless given) and
so its own default folder ``reports/<run id>``: two runs started in the same second no longer
share one folder and lose a report.
"""
from __future__ import annotations

import datetime
import logging
import os
import secrets
import signal
import sys

from . import outputs
from .config.args import parse_config
from .errors import say_once
from .config import prelaunch, report_dir
from .config.launchenv import run_id as launcher_run_id
from .coordination import fate
from .errors import ConfigError

USAGE = ("usage: python -m ddp_smoke.launch_local [--check [--nnodes N]] [--nproc-per-node N] "
         "[-- WORKER OPTIONS]")


def _split(argv: list[str]) -> tuple[int | None, int | None, bool, list[str]]:
    """Processes per node, nodes (None: torchrun resolves it), check only, worker options."""
    given, check, rest = {}, False, list(argv)
    while rest and rest[0] != "--":
        arg = rest.pop(0)
        name, eq, value = arg.partition("=")
        name = name.replace("_", "-")
        if name == "--check" and not eq:
            check = True
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
    return counts[0], counts[1], check, rest[1:]


def _run_id() -> str:
    given = os.environ.get("DDP_SMOKE_RUN_ID")
    if given:
        return launcher_run_id(os.environ)[0]  # checked as the workers will check it
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"local-{now}-{secrets.token_hex(3)}"


def prepare(argv: list[str]) -> tuple[int | None, list[str], str, bool]:
    """Check everything a rank would check before it connects; return the rank count per
    node, the worker's options, the run id and whether only to check. Raises ConfigError."""
    nproc, nodes, check, worker_args = _split(argv)
    cfg = parse_config(worker_args)
    rid = _run_id()
    prelaunch.check_run(cfg, nproc * nodes if nproc and nodes else None)
    folder = report_dir(cfg, rid)
    outputs.check_writable(folder)
    if nodes == 1:  # another live run's folder: refused now
        prelaunch.hold(folder, rid, keep=False)
    return nproc, worker_args, rid, check


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def main(argv: list[str] | None = None) -> int:
    try:
        nproc, worker_args, rid, check = prepare(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        say_once(f"ddp-smoke: error: {e}")
        return 2
    if check:  # the image's entrypoint: its torchrun starts the ranks
        return 0
    os.environ["DDP_SMOKE_RUN_ID"] = rid
    # the run's signing secret (coordination/signing.py): every rank's, in their environment
    os.environ.setdefault("DDP_SMOKE_SECRET", secrets.token_hex(32))
    # torchrun sets 1 itself when unset, after a four-line banner saying so; the same value.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cores = _cores()
    if nproc > cores:
        print(f"# warning: {nproc} ranks on {cores} CPU core(s): they take turns, so times, "
              "bandwidth and compute figures are lower than this machine can do", flush=True)
    from torch.distributed import run as torchrun
    fate.watch_workers()  # each worker's signal or exit status, for the culprit's text
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # The agent's "failed (exitcode …)" and "closing signal SIGTERM" lines come after the
    # kit's verdict; the exit status below says the same.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    args = torchrun.parse_args(["--standalone", f"--nproc-per-node={nproc}",
                                "-m", "ddp_smoke", *worker_args])
    try:
        torchrun.run(args)
    except ChildFailedError as e:
        codes = sorted({f.exitcode for f in e.failures.values()})
        if 2 in codes:
            return 2  # bad input a rank found (its line is above)
        if 1 not in codes:  # no worker reached its own verdict: say how they ended
            ends = ", ".join(f"rank {r} {_how(f)}" for r, f in sorted(e.failures.items()))
            say_once(f"ddp-smoke: no verdict: {ends}")
        return 1
    except (SignalException, KeyboardInterrupt) as e:  # Ctrl-C, or a kill of this launcher:
        # torchrun stopped the ranks; the status a shell expects from that signal
        sig = getattr(e, "sigval", signal.SIGINT)
        say_once(f"ddp-smoke: stopped by {signal.Signals(sig).name}; the ranks were stopped too")
        return 128 + int(sig)
    return 0


def _how(failure) -> str:
    if failure.exitcode < 0:
        return f"killed by {failure.signal_name()}"
    return f"exited {failure.exitcode}"


if __name__ == "__main__":
    sys.exit(main())
