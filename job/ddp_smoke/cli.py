"""ddp-smoke — does distributed PyTorch training really work on this cluster?

Run one process per GPU (or CPU slot) on every node under a launcher; every rank runs the
selected checks, rank 0 gathers one report that names the culprit rank, host, GPU or link.

Usage, per launcher:
  local     make smoke-local        (python -m ddp_smoke.launch_local: checks the options,
                                     then torchrun --standalone --nproc-per-node=2, gloo, CPU)
            torchrun --standalone --nproc-per-node=N -m ddp_smoke [options]
  multi-node torchrun --nnodes=N --nproc-per-node=G --rdzv-backend=c10d \\
              --rdzv-endpoint=HOST0:29500 --rdzv-id=ID --local-addr=THIS_NODE -m ddp_smoke …
  Slurm     sbatch slurm/ddp_smoke.sbatch
  Kubernetes kubectl apply -f k8s
  Python    ddp_smoke.submit.submit(...) / ddp-smoke-submit (submitit)
  preflight python -m ddp_smoke preflight [--rdzv HOST:PORT] [--gpus N] [--report-dir DIR]
            checks one node in seconds (kit, torch/CUDA, interfaces, rendezvous port, report
            folder); the launchers run it on every node before torchrun

Reading runs (no torch, no launcher; the first word picks the command):
  ddp-smoke render REPORT.json [-o OUT.html]   rebuild report.html from any report.json
  ddp-smoke history ROOT [--margin F] [--window N] [--min-runs N]
            every run under ROOT: per host and GPU each figure across runs, its trend, and
            the ones degrading (more than history.margin below their own median)

Checks (in default order):
{checks}

Report: rank 0 writes REPORT_DIR/report.json (atomically), REPORT_DIR/junit.xml and
  REPORT_DIR/report.html (one self-contained page; ddp-smoke render rebuilds it). Every
  field of report.json is described in the JSON Schema this package ships,
  ddp_smoke/outputs/report.schema.json. Strict JSON (NaN/inf figures are null); secrets
  redacted by name and shape; files made with your umask. Beside it: bad_hosts.txt,
  suspect_hosts.txt, good_hosts.txt (one host a line); rank 0 prints the drain/exclude/cordon
  commands for hosts that are not good, and runs the scontrol ones only with --act slurm-drain.

Environment read: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (set by torchrun or
  submitit's TorchDistributedEnvironment), LOCAL_WORLD_SIZE, GROUP_RANK, TORCHELASTIC_*,
  SLURM_* (SLURMD_NODENAME names the node to drain), NODE_NAME in a pod (spec.nodeName, for
  kubectl), DDP_SMOKE_RUN_ID (the run id, when the launcher knows one unique per run: letters,
  digits, . _ -, up to 128), DDP_SMOKE_SECRET (the run's signing secret, 64 hex digits, the same
  on every rank: set by the kit's launchers; one node makes its own; see README "Who can write
  the verdict"); NCCL_* and GLOO_SOCKET_IFNAME pass through to the backends.

Repeat mode: --repeat N or --duration S runs the checks again and again; each check's result
  then holds every iteration's figures, failures per rank, busbw p50/p99 per size, and says
  "intermittent: failed in 2 of 20 iterations" for a fault seen in some iterations only.

Exit status: 0 verdict pass · 1 verdict fail (the report says why) · 2 bad input (one line).
  Bad input is said by local rank 0 only (one line per node). Under plain torchrun the agent
  exits 1 whatever its workers' status: read the verdict from report.json, whose run_id names
  its run. make smoke-local (python -m ddp_smoke.launch_local) checks the options before any
  rank starts and exits with the workers' own status; the image's entrypoint checks them the
  same way (launch_local --check) before its torchrun.

Failure modes: a rank that raises, dies, hangs or never arrives is named in the report; every
wait is bounded by --timeout, after which each surviving rank exits 1 within a few seconds.
A rank the others wait for in most collectives of a check is that check's straggler (figures
  "waits"); when every rank waits, each node's leader probes the others outside the process
  group, and a node nobody reaches or a link nobody crosses (both ends) is named.
"""
from __future__ import annotations

import argparse
import ast
import difflib
import importlib.util
import os
import signal
import sys

from . import __version__, checks
from .config import load_file, resolve
from .config.launchenv import LaunchEnv
from .errors import ConfigError
from .outputs import history, page


def _manual() -> str:
    """The module docstring with each check's first docstring line, read without importing
    torch (bad input and --help answer in a fraction of a second)."""
    lines = []
    for name, module in checks.REGISTRY.items():
        with open(importlib.util.find_spec(module).origin) as f:
            doc = (ast.get_docstring(ast.parse(f.read())) or "").splitlines()
        lines.append(f"  {name:<15} {doc[0] if doc else ''}")
    return __doc__.format(checks="\n".join(lines))


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are ConfigErrors: one line and exit 2, like every other
    bad input, instead of argparse's usage block."""

    def __init__(self, **kwargs):
        super().__init__(formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)

    def error(self, message: str):
        raise ConfigError(message + did_you_mean(message, list(self._option_string_actions)))


def did_you_mean(message: str, options: list[str]) -> str:
    """'; did you mean --checks?' for the first unrecognized --option close to a real one."""
    if not message.startswith("unrecognized arguments: "):
        return ""
    for word in message.split(": ", 1)[1].split():
        if word.startswith("--"):
            close = difflib.get_close_matches(word.split("=")[0], options, n=1)
            if close:
                return f"; did you mean {close[0]}?"
    return ""


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m ddp_smoke", description=_manual())
    p.add_argument("--report-dir", metavar="DIR",
                   help="where rank 0 writes report.json and junit.xml (default reports/<run id>)")
    p.add_argument("--config", metavar="FILE.yaml",
                   help="YAML merged over the defaults; flags win over it")
    p.add_argument("--checks", metavar="A,B,…", help="checks to run, in order (default: all)")
    p.add_argument("--timeout", metavar="SECONDS", type=float,
                   help="bound on every wait: init, arrival, work, gather (default 90)")
    p.add_argument("--level", choices=("quick", "standard", "long"),
                   help="how much the performance checks measure: quick (make smoke-local), "
                        "standard (default), long (full sweep); every level runs every check")
    p.add_argument("--backend", choices=("auto", "nccl", "gloo"),
                   help="auto = nccl when CUDA is usable, else gloo (default auto)")
    p.add_argument("--expect-nodes", metavar="N", type=int,
                   help="fail unless the ranks span exactly N hosts")
    p.add_argument("--expect-world-size", metavar="N", type=int,
                   help="fail unless WORLD_SIZE is N")
    p.add_argument("--storage-dir", metavar="DIR",
                   help="directory every node should share (default REPORT_DIR/storage)")
    p.add_argument("--profile", metavar="NAME|FILE.yaml",
                   help="pass floors for bandwidth and compute: cpu (default, figures only), "
                        "a100-8gpu, h100-8gpu, h200-8gpu, b200-8gpu, p5-h100-efa, or a "
                        "profile file")
    p.add_argument("--expect-transport", metavar="ib|socket|PLUGIN",
                   help="fail a multi-node run whose NCCL used another network (transport "
                        "check; default: the profile's, else any one network on every node)")
    p.add_argument("--fault", metavar="RANK:KIND@CHECK",
                   help="inject a fault to test alerting: rank RANK crashes (exits 13), "
                        "raises, hangs before the check, stalls inside its first collective, "
                        "runs slow (slow=F: F times slower, default 4) or corrupts its contribution at CHECK; several separated "
                        "by commas; @CHECK#I or #I-J: only in those iterations of --repeat. "
                        "The report says the failure was injected")
    p.add_argument("--repeat", metavar="N", type=int,
                   help="run the checks N times in one process group; a fault seen in some "
                        "iterations only is flagged intermittent (default 1)")
    p.add_argument("--duration", metavar="SECONDS", type=float,
                   help="instead of --repeat: keep starting iterations for this long")
    p.add_argument("--act", metavar="slurm-drain",
                   help="after the report, drain the bad hosts' Slurm nodes with scontrol "
                        "(default: only print the commands)")
    p.add_argument("--prometheus", metavar="FILE",
                   help="also write the verdict and key figures as a node_exporter textfile")
    p.add_argument("--version", action="version", version=f"ddp-smoke {__version__}")
    return p


def parse_config(argv: list[str] | None = None) -> dict:
    """Flags and ``--config`` into the effective config; ConfigError on any mistake."""
    args = _parser().parse_args(argv)
    flags = {k: v for k, v in vars(args).items() if k != "config"}
    if flags["checks"] is not None:
        flags["checks"] = [c.strip() for c in flags["checks"].split(",") if c.strip()]
    file_values = load_file(args.config) if args.config else {}
    return resolve(file_values, flags, source=args.config or "config")


def _render(argv: list[str]) -> str:
    p = Parser(prog="ddp-smoke render",
               description="Rebuild report.html from a report.json (any version, partial too); "
                           "with each host's history when its folder's parent holds other runs.")
    p.add_argument("report", metavar="REPORT.json")
    p.add_argument("-o", "--output", metavar="OUT.html",
                   help="where to write the page (default: report.html beside the report)")
    args = p.parse_args(argv)
    return page.render_file(args.report, args.output)


def _history(argv: list[str]) -> str:
    d = history.defaults()
    p = Parser(prog="ddp-smoke history",
               description="Every report.json under ROOT (one folder per run): per host and per "
                           "GPU, each figure across runs, its trend, and those degrading. Keeps "
                           f"an SQLite index, ROOT/{history.INDEX_NAME}, rebuilt when stale.")
    p.add_argument("root", metavar="ROOT", help="the folder of runs (e.g. reports/)")
    p.add_argument("--margin", type=float, metavar="F",
                   help=f"fraction below its median that marks a figure degrading (default: "
                        f"each run's history.margin: {d['margin']} on GPU, {d['margin_cpu']} "
                        "on CPU)")
    p.add_argument("--window", type=int, metavar="N",
                   help=f"earlier runs the median is over (default {d['window']})")
    p.add_argument("--min-runs", type=int, metavar="N",
                   help=f"earlier runs needed to judge (default {d['min_runs']})")
    args = p.parse_args(argv)
    return history.run(args.root, args.margin, args.window, args.min_runs)


COMMANDS = {"render": _render, "history": _history}


def say_once(line: str) -> None:
    """Bad flags or config are the same on every rank: only the first local rank of each node
    says so (one line per node, not one per rank), in one write, so no two lines run
    together."""
    local = os.environ.get("LOCAL_RANK", "0")
    if local == "0" or not local.isdigit():
        os.write(2, (line.replace("\n", " ") + "\n").encode())


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m ddp_smoke`` and ``ddp-smoke``: the worker (flags only), or a
    command named by the first word (``render``, ``history``); exits 0 (pass), 1 (fail) or 2
    (bad input)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in COMMANDS:  # no torch, no launcher: reading runs anywhere
        try:
            print(COMMANDS[argv[0]](argv[1:]), flush=True)
        except ConfigError as e:
            print(f"ddp-smoke: error: {e}", file=sys.stderr)
            sys.exit(2)
        sys.exit(0)
    try:
        cfg = parse_config(argv)  # before importing torch: bad input fails fast
    except ConfigError as e:
        say_once(f"ddp-smoke: error: {e}")
        sys.exit(2)
    try:
        # The launcher's variables (the harness reads them again) differ per rank, and so
        # does what is wrong with them: every rank says its own.
        LaunchEnv.from_environ()
    except ConfigError as e:
        os.write(2, f"ddp-smoke: error: {e}\n".encode())
        sys.exit(2)
    # A launcher that stops the others the moment one rank dies may do it while torch loads:
    # the signal waits, blocked, and is answered once this rank is connected and can say so
    # (coordination/liveness.py start), not by dying without a word.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGUSR1,
                                              signal.SIGUSR2})
    try:
        from torch.distributed.elastic.multiprocessing.errors import record

        from . import harness
        # record: an unexpected exception also lands in torchrun's error file and summary.
        code = record(harness.run)(cfg)
    except ConfigError as e:
        say_once(f"ddp-smoke: error: {e}")
        sys.exit(2)
    # The verdict is written and every thread stopped: skip interpreter teardown, where C++
    # destructors of the backend's threads have aborted a passing rank (SIGABRT at exit).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
