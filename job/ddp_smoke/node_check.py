"""ddp-smoke node-check: one node in seconds, no rendezvous — the node tier of continuous use.

    python -m ddp_smoke node-check [--report-root ROOT | --report-dir DIR] [--node NAME]
        [--timeout S] [--cpu-ranks N] [--act slurm-drain|k8s-label] [--every S] [--keep N]
        [--skip-if-busy] [-- WORKER OPTIONS]

What it runs, all bounded by ``--timeout`` (default 45 s; Slurm kills a HealthCheckProgram
after 60 s):

1. preflight's node checks (:mod:`ddp_smoke.preflight`, in this process, no torch): the
   interfaces ``NCCL_SOCKET_IFNAME``/``GLOO_SOCKET_IFNAME`` name, the report folder;
2. the worker on this node alone (``torchrun --standalone`` through
   :mod:`ddp_smoke.launch_local`): one rank per GPU (``--cpu-ranks``, default 2, on a node
   without one), checks ``environment,collectives,bandwidth,health`` at the quick level — the
   health check's readers and judges (NVML, HCA ports, kernel log, the CPU quota), silent data
   corruption across the ranks, exact collectives and an all_reduce/all_gather sweep among
   them. Worker options after ``--`` (``--profile h200-8gpu``, ``--config FILE``) go to it.
   On CPU ranks, who kept whom waiting is a figure, not a finding: they share this node's
   cores (:func:`ddp_smoke.coordination.stragglers.scheduler_paced`).

The node's report is a report like any other, written through ``outputs.publish()`` into
``ROOT/<run id>/`` (or ``--report-dir``): report.json, junit.xml, the host lists, and
``node-check.log`` (everything the worker printed). It is told apart by its run id,
``node-check-<node>-<UTC time>-<random>`` (:func:`ddp_smoke.outputs.fleet.tier`). When the
worker never ran (preflight failed), never wrote a report (it crashed) or was stopped past the
timeout (a report it wrote as it went says only that it was terminated), node-check writes one
itself, naming this node with why.

Output, as node health checkers print it: one line per finding, then one line with the verdict::

    ddp-smoke node-check: node2 FAIL preflight: interfaces: GLOO_SOCKET_IFNAME=eth0: no …
    ddp-smoke node-check: node2 FAIL in 0.1 s · 1 finding(s) · report reports/node-check-…

A check that could not run here is named on that line with why (a CPU node:
``· health skipped: …; hardware not read: GPUs: no NVIDIA driver …``).

``--act slurm-drain`` (run as root or SlurmUser: a HealthCheckProgram or a Prolog): a failing
node is drained with the reason ``ddp-smoke node-check: <check>: <finding>`` — unless someone
else drained it already, or the circuit breaker holds (more than ``fleet.drain_max_share`` of
the cluster's nodes drained by the kit: a shared cause); a passing node is resumed only when
its drain reason is node-check's own; a lemon due for RMA stays drained
(:mod:`ddp_smoke.outputs.fleet`). ``--act k8s-label`` (a DaemonSet's pod, k8s/node-check/):
the node's label ``ddp-smoke/health=pass|fail`` and annotations ``ddp-smoke/health-checked-at``,
``ddp-smoke/health-run`` and ``ddp-smoke/health-finding``. Every action is recorded in the
run's ``actions.json``. ``--every S`` repeats the check every S seconds until SIGTERM (each run
its own folder; ``--keep`` of this node's newest are kept). ``--skip-if-busy``: a node whose
GPUs run another job's processes is not checked this time (its label or state stays).

Exit status: 0 pass (or skipped), 1 a finding, 2 bad input (one line).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time

from . import preflight
from .checks.health import cpu
from .checks.health.finding import FAIL, Limits
from .checks.health.readers import REPLAY_ENV, Node, cgroup
from .config.args import Parser, parse_config, worker_parser
from .errors import ConfigError
from .model import Culprit
from .outputs import act as acts, fleet, launch_report, publish
from .outputs.hosts import hosts_section
from .outputs.runs import host_runs

CHECKS = "environment,collectives,bandwidth,health"
DEFAULT_TIMEOUT_S = 45.0  # Slurm kills a HealthCheckProgram at 60 s: time left to act
LABEL, CHECKED_AT, FINDING, RUN = ("ddp-smoke/health", "ddp-smoke/health-checked-at",
                                   "ddp-smoke/health-finding", "ddp-smoke/health-run")
LOG = "node-check.log"
_MARGIN_S = 4.0  # kept back from --timeout: our own report and the act after a hung worker
_STOP_S = 3.0    # SIGTERM to SIGKILL for a worker past its time
_stop = {"now": False}


def run_id(node: str) -> str:
    """``node-check-<node>-<UTC time>-<random>``: sortable by time per node."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", node)[:64]
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"{fleet.NODE_RUN_PREFIX}{safe}-{now}-{secrets.token_hex(3)}"


def findings(report: dict) -> list[str]:
    """``check: reason`` for every culprit of every failed check (the node is the subject)."""
    out = [f"{c.get('name')}: {k.get('reason')}" for c in report.get("checks", [])
           if c.get("status") == "fail" for k in c.get("culprits", [])]
    error = report.get("error")
    if error and not out:
        out.append(f"error: {error.get('message') if isinstance(error, dict) else error}")
    return out


# -- one check ------------------------------------------------------------------------------

def _preflight(node: str, rid: str, report_dir: str, timeout_s: float) -> dict:
    """preflight's record for this node (its interface checks), the report folder checked
    (written there when it can be)."""
    args = argparse.Namespace(report_dir=None, rdzv=None, serve=False, nodes=0, gpus=0,
                              timeout=timeout_s, node=node, run_id=rid, skip_torch=True)
    record = preflight.run(args)
    ok, detail = preflight.check_report_dir(report_dir)
    record["checks"].insert(1, {"name": "report_dir", "ok": ok, "detail": detail})
    failed = [c for c in record["checks"] if not c["ok"]]
    record["ok"] = not failed
    record["reason"] = "; ".join(f"{c['name']}: {c['detail']}" for c in failed)
    if ok:
        preflight.write_record(record, report_dir)
    return record


def _worker(node: str, rid: str, report_dir: str, nproc: int, worker_args: list[str],
            deadline: float, log) -> tuple[int | None, str]:
    """The worker on this node; (its exit status or None when it ran past the deadline, why)."""
    argv = [sys.executable, "-m", "ddp_smoke.launch_local", f"--nproc-per-node={nproc}", "--",
            *worker_args]
    env = {**os.environ, "DDP_SMOKE_RUN_ID": rid}
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)  # its group: all of it can end
    while proc.poll() is None and time.monotonic() < deadline and not _stop["now"]:
        try:
            proc.wait(timeout=min(0.2, max(0.01, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            pass
    if proc.returncode is not None:
        return proc.returncode, ""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=_STOP_S)
            break
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            break
    proc.wait()
    return None, "stopped" if _stop["now"] else "timeout"


def _throttle(before: dict | None, after: dict | None, health: dict) -> str:
    """The CPU quota's evidence over the check (the health check's own rule, with the run's
    ``health`` settings), or ""."""
    node = {"cpu": {"start": before, "end": after}}
    return "; ".join(f.line() for f in cpu.judge(node, Limits(health)) if f.level == FAIL)


def check(args, node: str, cfg_args: list[str], nproc: int,
          cfg: dict) -> tuple[dict, str, float]:
    """One node-check: (the report as written, its folder, seconds taken); ``cfg``: the
    worker options' effective config, whose thresholds node-check's own findings use too."""
    t0 = time.monotonic()
    deadline = t0 + args.timeout - _MARGIN_S
    rid = run_id(node)
    report_dir = args.report_dir or os.path.join(args.report_root, rid)
    quota_before = cgroup.read()
    record = _preflight(node, rid, report_dir, min(10.0, args.timeout / 4))
    report, stage, culprits = None, "preflight", []
    log_path = os.path.join(report_dir, LOG)
    if record["ok"]:
        stage = "run"
        worker_args = ["--checks", CHECKS, "--level", "quick", "--report-dir", report_dir,
                       "--timeout", f"{max(5.0, 0.6 * args.timeout):g}", *cfg_args]
        with open(log_path, "ab") as log:
            code, why = _worker(node, rid, report_dir, nproc, worker_args, deadline, log)
        # A worker node-check stopped (past its time, or on its own SIGTERM) may still write
        # a report, saying only that it was terminated: the finding is why, node-check's own
        # (its bound, the CPU quota's evidence). The worker's words stay in node-check.log.
        report = launch_report.own_report(report_dir, rid) if code is not None else None
        if report is None:
            culprits = [_no_report(node, code, why, args.timeout, log_path,
                                   _throttle(quota_before, cgroup.read(), cfg["health"]))]
    else:
        culprits, _ = launch_report.preflight_culprits([node], {node: record}, {}, report_dir)
    if report is None:
        built = launch_report.build(stage, [node], culprits, [], report_dir, rid, "node-check",
                                    {node: record})
        # publish() prints the hosts' lines: node-check's own output is its findings only
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            publish(built, report_dir, rid, print_summary=False)
        report = {**built.to_dict(), "hosts": hosts_section(built)}
    return report, report_dir, time.monotonic() - t0


def _no_report(node: str, code: int | None, why: str, timeout_s: float, log_path: str,
               throttle: str) -> Culprit:
    if code is None:
        text = (f"the worker did not finish within the node-check's {timeout_s:g} s" +
                (f": {throttle}" if throttle else "") if why == "timeout" else
                "stopped by a signal before the worker finished")
    else:
        try:
            with open(log_path, errors="replace") as f:
                tail = f.read()[-20000:].splitlines()
        except OSError:
            tail = []
        text = (f"the worker ended (exit {code}) without a report: "
                f"{launch_report.error_line(tail) or 'it printed nothing'}")
    return Culprit(None, node, " ".join(text.split())[:launch_report.REASON_CHARS])


# -- the node's memory and what the kit does ------------------------------------------------

def lemon(root: str, node: str, report: dict, settings: dict) -> dict | None:
    """This node's lemon record (:func:`.outputs.fleet.lemons`) over its latest node-check runs
    under ``root`` (this one included), or None. Only its own folders are read: a few small
    files, not the root."""
    rows = []
    names = own_runs(root, node)
    for name in names[-settings["lemon_runs"]:]:
        got = launch_report.own_report(os.path.join(root, name), "")
        if name == report.get("run_id"):
            got = report  # this run's, whether or not it could be written
        rows += [{"run_id": (got or {}).get("run_id"), "status": status, "reason": reason,
                  "boot_id": boot} for _, status, reason, boot in host_runs(got or {})[:1]]
    found = fleet.lemons({node: rows}, settings["lemon_failures"], settings["lemon_runs"])
    return found[0] if found else None


def act_slurm(node: str, report: dict, share: float, bad_lemon: dict | None) -> tuple[
        list[str], list[dict]]:
    """``--act slurm-drain``: (lines to print, actions to record)."""
    try:
        nodes = acts.slurm_nodes()
    except acts.ActError as e:
        return [f"not acted: {e}"], []
    if node not in nodes:
        return [f"not acted: Slurm has no node {node} (give --node the NodeName)"], []
    host = (report.get("hosts") or [{}])[0]
    failed = report.get("verdict") != "pass" or (bad_lemon or {}).get("action") == fleet.RMA
    why = fleet.drain_reason(_lemon_reasons(host, bad_lemon), fleet.NODE_CHECK)
    action, line, reason = fleet.slurm_decision(node, nodes, failed, why,
                                                host.get("reasons") or [], share)
    if action == fleet.RESUME:
        return _do(node, action, reason, lambda: acts.slurm_resume(node), line)
    if action == fleet.DRAIN:
        return _do(node, action, reason, lambda: acts.slurm_drain(node, why), line)
    if action == fleet.HOLD:
        return [line], [fleet.entry(node, action, reason, True)]
    return [line] if line else [], []


def _lemon_reasons(host: dict, bad_lemon: dict | None) -> dict:
    """The hosts entry whose first reason is the drain's: a lemon says so first."""
    reasons = list(host.get("reasons") or [])
    if bad_lemon:
        reasons.insert(0, {"check": "lemon", "reason": f"failed {bad_lemon['failed']} of its "
                           f"last {bad_lemon['of']} runs: {bad_lemon['action']}"})
    return {**host, "reasons": reasons}


def _do(node: str, action: str, reason: str, call, said: str) -> tuple[list[str], list[dict]]:
    try:
        call()
    except acts.ActError as e:
        return [f"NOT {action}ed: {e}"], [fleet.entry(node, action, reason, False, str(e))]
    return [said], [fleet.entry(node, action, reason, True, "ok")]


def act_k8s(node: str, report: dict) -> tuple[list[str], list[dict]]:
    """``--act k8s-label``: the node's health label and its annotations."""
    verdict = "pass" if report.get("verdict") == "pass" else "fail"
    found = findings(report)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    annotations = {CHECKED_AT: now, RUN: str(report.get("run_id")),
                   FINDING: found[0][:1000] if found else None}  # null: removed on a pass
    why = f"{LABEL}={verdict}" + (f": {found[0]}" if found else "")
    return _do(node, fleet.LABEL, why[:300], lambda: acts.label_node(
        node, {LABEL: verdict}, annotations), f"labelled {LABEL}={verdict}")


def own_runs(root: str, node: str) -> list[str]:
    """This node's node-check folders under ``root``, oldest first (their names sort by time)."""
    mine = re.compile(re.escape(run_id(node).rsplit("-", 3)[0]) + r"-\d{8}-\d{6}-[0-9a-f]{6}$")
    try:
        return sorted(n for n in os.listdir(root) if mine.match(n))
    except OSError:
        return []


def prune(root: str, node: str, keep: int) -> None:
    """Remove this node's oldest node-check folders beyond the newest ``keep``."""
    names = own_runs(root, node)
    for name in names[:-keep] if keep else []:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)


# -- the command ----------------------------------------------------------------------------

def once(args, node: str, worker_args: list[str], cfg: dict) -> int:
    """One node-check with its lines and actions; its exit status."""
    said = f"ddp-smoke node-check: {node}"
    busy, gpus = _gpus()
    if busy and args.skip_if_busy:
        print(f"{said} skipped: {busy}; checked when idle", flush=True)
        return 0
    # a replayed node's GPUs are a recording's: the ranks are this machine's CPUs
    nproc = gpus if gpus and not os.environ.get(REPLAY_ENV) else args.cpu_ranks
    report, report_dir, took = check(args, node, worker_args, nproc, cfg)
    root = os.path.dirname(os.path.abspath(report_dir))
    if _stop["now"]:  # stopped, not judged: no verdict, no act, no run in the node's memory
        shutil.rmtree(report_dir, ignore_errors=True)
        print(f"{said} stopped by SIGTERM before the check ended; nothing judged", flush=True)
        return 128 + signal.SIGTERM
    found = findings(report)
    for line in found:
        print(f"{said} FAIL {line}", flush=True)
    path = os.path.join(report_dir, "report.json")
    # what was not read stays on the line: a CPU node's PASS is no word on GPUs or HCAs
    skipped = "".join(f" · {c.get('name')} skipped: {c.get('summary')}"
                      for c in report.get("checks", []) if c.get("status") == "skip")
    print(f"{said} {'PASS' if report.get('verdict') == 'pass' else 'FAIL'} in {took:.1f} s · "
          f"{len(found)} finding(s){skipped} · report {path}", flush=True)
    settings = cfg["fleet"]
    bad = lemon(root, node, report, settings)
    if bad:
        print(f"{said} LEMON {fleet.lemon_line(bad).split(': ', 1)[1]}", flush=True)
    lines, done = [], []
    if args.act == "slurm-drain":
        lines, done = act_slurm(node, report, settings["drain_max_share"], bad)
    elif args.act == "k8s-label":
        lines, done = act_k8s(node, report)
    for line in lines:
        print(f"{said} {line}", flush=True)
    try:
        fleet.record(report_dir, str(report.get("run_id")), done)
    except OSError as e:
        print(f"{said} actions not recorded: {e}", file=sys.stderr, flush=True)
    if args.keep and not args.report_dir:
        prune(root, node, args.keep)
    return 0 if report.get("verdict") == "pass" else 1


def _gpus() -> tuple[str, int]:
    """(what keeps the GPUs busy, "" when nothing; how many GPUs NVML sees), through the
    health check's reader; (``""``, 0) on a node without NVIDIA's driver."""
    reader = Node(1.0).gpu
    if reader is None:
        return "", 0
    snap = reader.snapshot()
    # (not this process: it is no other job, and a reader holding a context shows itself)
    procs = [p for g in snap.get("gpus", []) for p in g.get("processes") or ()
             if p.get("pid") != os.getpid()]
    busy = (f"{len(procs)} process(es) of another job on its GPUs (pid "
            f"{', '.join(str(p['pid']) for p in procs[:4])})") if procs else ""
    return busy, int(snap.get("count") or 0)


def _parser() -> Parser:
    p = Parser(prog="ddp-smoke node-check", description=__doc__,
               after_dashes=lambda: list(worker_parser()._option_string_actions))
    where = p.add_mutually_exclusive_group()
    where.add_argument("--report-root", default="reports", metavar="ROOT",
                       help="each run in ROOT/<run id>/ (default: reports)")
    where.add_argument("--report-dir", metavar="DIR", help="this one folder instead")
    p.add_argument("--node", help="this node's name: Slurm's NodeName, the Kubernetes node "
                                  "(default: SLURMD_NODENAME, NODE_NAME, else the hostname)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help=f"bound on the whole check (default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--cpu-ranks", type=int, default=2, metavar="N",
                   help="ranks on a node without GPUs (default 2: SDC and all_reduce need two)")
    p.add_argument("--act", choices=("slurm-drain", "k8s-label"),
                   help="drain/resume this Slurm node, or label this Kubernetes node")
    p.add_argument("--every", type=float, metavar="SECONDS",
                   help="check again every SECONDS until SIGTERM")
    p.add_argument("--keep", type=int, default=100, metavar="N",
                   help="this node's newest N run folders under ROOT are kept (default 100; "
                        "0: all)")
    p.add_argument("--skip-if-busy", action="store_true",
                   help="leave a node whose GPUs run another job's processes unchecked")
    return p


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str], dict]:
    """(node-check's options, the worker's options, the worker's effective config)."""
    ours, worker = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [])
    args = _parser().parse_args(ours)
    if not 5 <= args.timeout <= 3600:
        raise ConfigError(f"--timeout {args.timeout:g}: expected seconds in [5, 3600]")
    if args.every is not None and not 1 <= args.every <= 7 * 86400:
        raise ConfigError(f"--every {args.every:g}: expected seconds in [1, 604800] (a check "
                          "that takes longer starts the next one at once)")
    if not 1 <= args.cpu_ranks <= 64 or args.keep < 0:
        raise ConfigError("--cpu-ranks: expected 1..64; --keep: expected >= 0")
    taken = [a for a in worker if a.split("=")[0] in ("--report-dir", "--act", "--checks",
                                                      "--repeat", "--duration", "--fault")]
    if taken:
        raise ConfigError(f"{taken[0].split('=')[0]} after --: node-check sets it (give "
                          "node-check's own --report-dir/--act before --)")
    cfg = parse_config(["--checks", CHECKS, *worker])
    return args, worker, cfg


def _term(signum, frame) -> None:
    _stop["now"] = True


def main(argv: list[str]) -> int:
    """``ddp-smoke node-check …`` (see the module docstring): 0 pass, 1 fail, 2 bad input."""
    args, worker_args, cfg = parse(argv)  # ConfigError: the CLI says it in one line, exit 2
    node = args.node or os.environ.get("SLURMD_NODENAME") or os.environ.get("NODE_NAME") \
        or socket.gethostname()
    signal.signal(signal.SIGTERM, _term)  # the worker's group ends with us
    if args.every is None:
        return once(args, node, worker_args, cfg)
    while not _stop["now"]:
        start = time.monotonic()
        once(args, node, worker_args, cfg)
        while not _stop["now"] and time.monotonic() - start < args.every:
            time.sleep(min(1.0, args.every - (time.monotonic() - start)))
    return 128 + signal.SIGTERM
