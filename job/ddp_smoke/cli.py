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
  node-check [--act slurm-drain|k8s-label] [--every S] [-- worker options]
            one node alone in seconds: preflight, hardware health, SDC and an all_reduce
            among its GPUs; one line per finding; drains or labels the node (Slurm
            HealthCheckProgram/Prolog, a Kubernetes DaemonSet): docs/continuous.md

Reading runs (no torch, no launcher; the first word picks the command):
  ddp-smoke render REPORT.json [-o OUT.html]   rebuild report.html from any report.json
  ddp-smoke history ROOT [--margin F] [--window N] [--min-runs N] [--include-practice]
            every run under ROOT: per host and GPU each figure across runs (compute: the
            sustained rate its verdict judges), its trend, and the ones degrading (more than
            history.margin below their own median); practice runs (--fault) left out; the
            nodes the kit drained and why, and the lemons (failing again and again)
  ddp-smoke last-line REPORT.json | --dir REPORT_DIR [--run-id ID]
            the run as one line (a pod's termination message, a job log's last line)
  ddp-smoke launch-report --stage preflight|run --report-dir DIR --nodes "A B" …
            the launchers' report when no worker wrote one (the sbatch, the image)

Checks (in default order):
{checks}

Report: rank 0 writes REPORT_DIR/report.json (atomically), REPORT_DIR/junit.xml and
  REPORT_DIR/report.html (one self-contained page; ddp-smoke render rebuilds it). Every
  field of report.json is described in the JSON Schema this package ships,
  ddp_smoke/outputs/report.schema.json. Strict JSON (NaN/inf figures are null); secrets
  redacted by name and shape; files made with your umask. Beside it: bad_hosts.txt,
  suspect_hosts.txt, good_hosts.txt (one host a line), bad_rails.txt (one bad rail of a host a
  line: "gpu07 rail 3 mlx5_3"); rank 0 prints the drain/exclude/cordon
  commands for hosts that are not good, and runs the scontrol ones only with --act slurm-drain.

Environment read: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (set by torchrun or
  submitit's TorchDistributedEnvironment), LOCAL_WORLD_SIZE, GROUP_RANK, TORCHELASTIC_*,
  SLURM_* (SLURMD_NODENAME names the node to drain), NODE_NAME in a pod (spec.nodeName, for
  kubectl), DDP_SMOKE_RUN_ID (the run id, when the launcher knows one unique per run: letters,
  digits, . _ -, up to 128), DDP_SMOKE_SECRET (the run's signing secret, 64 hex digits, the same
  on every rank: set by the kit's launchers; one node makes its own; see docs/security.md);
  NCCL_* and GLOO_SOCKET_IFNAME pass through to the backends, except that with --rails on
  gloo each rank's GLOO_SOCKET_IFNAME is its rail (docs/rails.md).

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

import ast
import difflib
import importlib.util
import os
import signal
import sys

from . import __version__, checks, node_check, preflight
from .config.args import Parser, parse_config, worker_parser
from .config.launchenv import LaunchEnv
from .coordination import fate, store
from .errors import ConfigError, lossy_output, say_once
from .outputs import history, last_line, launch_report, page


def _manual() -> str:
    """The module docstring with each check's first docstring line, read without importing
    torch (bad input and --help answer in a fraction of a second)."""
    lines = []
    for name, module in checks.REGISTRY.items():
        with open(importlib.util.find_spec(module).origin) as f:
            doc = (ast.get_docstring(ast.parse(f.read())) or "").splitlines()
        lines.append(f"  {name:<15} {doc[0] if doc else ''}")
    return __doc__.format(checks="\n".join(lines))


def _parser() -> Parser:
    p = worker_parser(manual=_manual)
    p.add_argument("--version", action="version", version=f"ddp-smoke {__version__}")
    return p


def _render(argv: list[str]) -> int:
    p = Parser(prog="ddp-smoke render",
               description="Rebuild report.html from a report.json (any version, partial too); "
                           "with each host's history when its folder's parent holds other runs.")
    p.add_argument("report", metavar="REPORT.json")
    p.add_argument("-o", "--output", metavar="OUT.html",
                   help="where to write the page (default: report.html beside the report)")
    args = p.parse_args(argv)
    print(page.render_file(args.report, args.output), flush=True)
    return 0


def _history(argv: list[str]) -> int:
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
    p.add_argument("--include-practice", action="store_true",
                   help="count practice runs (--fault) too, each value and verdict marked * "
                        "(default: left out; a failure made on purpose is no drift)")
    args = p.parse_args(argv)
    print(history.run(args.root, args.margin, args.window, args.min_runs,
                      args.include_practice), flush=True)
    return 0


def _worker(cfg: dict) -> int:
    """The run on this rank; bad input a rank finds (the world size, the report folder) is its
    one line and status 2 here, inside ``@record``: an exception leaving it would be written to
    torchrun's error file, and torchrun would print it, traceback and all, once per rank in its
    failure box."""
    from . import harness
    try:
        return harness.run(cfg)
    except ConfigError as e:
        say_once(f"ddp-smoke: error: {e}")
        return 2


# The first word picks a command; none of them imports torch (reading runs anywhere, in any
# pod). Each returns its exit status.
COMMANDS = {"preflight": preflight.main, "node-check": node_check.main, "render": _render,
            "history": _history,
            "last-line": last_line.main, "launch-report": launch_report.main}


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m ddp_smoke`` and ``ddp-smoke``: the worker (flags only), or a
    command named by the first word (:data:`COMMANDS`); exits 0 (pass), 1 (fail) or 2 (bad
    input)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in COMMANDS:
        try:
            sys.exit(COMMANDS[argv[0]](argv[1:]))
        except ConfigError as e:
            print(f"ddp-smoke: error: {e}", file=sys.stderr)
            sys.exit(2)
    if argv and not argv[0].startswith("-"):  # the worker takes no word: a command mistyped
        close = difflib.get_close_matches(argv[0], COMMANDS, n=1)
        print(f"ddp-smoke: error: unknown command {argv[0]!r}"
              + (f" (did you mean {close[0]!r}?)" if close else "")
              + f"; commands: {', '.join(COMMANDS)}; the worker takes --options only",
              file=sys.stderr)
        sys.exit(2)
    code = worker(argv)
    # The verdict is written and every thread stopped: skip interpreter teardown, where C++
    # destructors of the backend's threads have aborted a passing rank (SIGABRT at exit).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def worker(argv: list[str]) -> int:
    """This rank's run, from its options; returns the exit status (0, 1, or 2 for bad input,
    said in one line). A launcher that forks its ranks calls it in each
    (:mod:`ddp_smoke.launch_local`)."""
    lossy_output()  # a log on a full or read-only filesystem loses lines, not the rank
    try:
        cfg = parse_config(argv, _parser())  # before importing torch: bad input fails fast
    except ConfigError as e:
        say_once(f"ddp-smoke: error: {e}")
        return 2
    try:
        # The launcher's variables (the harness reads them again) differ per rank, and so
        # does what is wrong with them: every rank says its own.
        LaunchEnv.from_environ()
    except ConfigError as e:
        os.write(2, f"ddp-smoke: error: {e}\n".encode())
        return 2
    # A launcher that stops the others the moment one rank dies may do it while torch loads:
    # the signal waits, blocked, and is answered once this rank is connected and can say so
    # (coordination/liveness.py Liveness.start), not by dying without a word.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGUSR1,
                                              signal.SIGUSR2})
    store.quiet_slices()  # before torch is imported
    from torch.distributed.elastic.multiprocessing.errors import record

    # record: an unexpected exception also lands in torchrun's error file and summary.
    code = record(_worker)(cfg)
    # Every rank leaves by os._exit (main's, or a forked rank's), which skips the atexit that
    # removes this rank's last-words file while it is empty: no empty files in the folder.
    fate.drop_current()
    return code
