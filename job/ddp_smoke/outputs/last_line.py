"""One line that says how a run ended, for places that keep only a little text.

Kubernetes keeps at most 4096 bytes of a container's termination message (``kubectl describe
pod``, the job's events); its fallback, the log's tail, cuts the one-line JSON report in the
middle. The manifests in ``k8s/`` therefore write this line to ``/dev/termination-log``::

    python3 -m ddp_smoke last-line REPORT_DIR/report.json > /dev/termination-log

Example: ``ddp-smoke FAIL · run ddp-smoke-1b2c · 16 ranks on 2 nodes · failed: bandwidth
(rank 8 gpu-b: slow pair …)``. Reads only the JSON file: no torch, quick in any pod.
Exit status 0 when it could read the report, 2 (with a one-line error) when not.

A launcher that may find no report (the sbatch's last line, ``submit``) asks for the folder::

    python3 -m ddp_smoke last-line --dir REPORT_DIR [--run-id ID]

which prints the report's line when there is one (of run ID, when given); else, when ranks
that lost the coordination store left their word in ``REPORT_DIR/lost/`` (see
:mod:`ddp_smoke.coordination.lost`), a FAIL line built from those files naming the ranks and
nodes that went silent; exit 2 when neither is there.

``python -m ddp_smoke launch-report …`` is the launchers' side (the sbatch, the image's
entrypoint): it writes the report when the worker never started and prints the job log's last
line; see :mod:`ddp_smoke.outputs.launch_report`.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any

from ..coordination import lost
from ..model import injected

MAX_CHARS = 1024  # well inside the kubelet's 4096-byte limit, whole words never needed


def line(report: dict[str, Any], max_chars: int = MAX_CHARS) -> str:
    """The report as one line: verdict, run id, shape, failed checks with their culprits."""
    ranks = report.get("ranks") or []
    nodes = report.get("nodes", len({r.get("host") for r in ranks}))
    practice = injected(report)
    parts = [f"ddp-smoke {str(report.get('verdict', 'none')).upper()}"
             + (f" (PRACTICE: --fault {practice})" if practice else ""),
             f"run {report.get('run_id', '?')}",
             f"{report.get('world_size', len(ranks))} ranks on {nodes} nodes"]
    failed = []
    for check in report.get("checks", []):
        if check.get("status") != "fail":
            continue
        who = "; ".join(f"rank {c.get('rank')} {c.get('host')}: {c.get('reason', '')}"
                        for c in check.get("culprits", []))
        failed.append(f"{check.get('name')} ({who})" if who else str(check.get("name")))
    if failed:
        parts.append("failed: " + ", ".join(failed))
    error = report.get("error")
    if error:
        parts.append(f"error: {error.get('message', error) if isinstance(error, dict) else error}")
    text = " · ".join(parts).replace("\n", " ")
    return text if len(text) <= max_chars else text[:max_chars - 1] + "…"


def from_lost(records: dict[int, dict], max_chars: int = MAX_CHARS) -> str:
    """A FAIL line from what the ranks that lost the store left: which store went silent,
    during which stage, and which ranks (on which nodes) said nothing: they, or the node
    hosting the store, are gone."""
    any_record = records[min(records)]
    world = int(any_record.get("world_size") or 0)
    hosts = lost.hosts(records)
    silent = [r for r in range(world) if r not in records]
    stages = sorted({str(r.get("stage")) for r in records.values()})
    store = any_record.get("store", "?")

    def where(rank: int) -> str:
        host = hosts.get(rank)
        return f"rank {rank} {host}" if host else f"rank {rank}"
    silent_nodes = sorted({hosts[r] for r in silent if r in hosts})
    parts = ["ddp-smoke FAIL", f"run {any_record.get('run_id', '?')}",
             f"{world} ranks" if world else "? ranks",
             f"no report: the coordination store at {store} went silent during "
             f"{'/'.join(stages)}",
             f"silent: {', '.join(where(r) for r in silent) or 'none'}"
             + (f" (node {', '.join(silent_nodes)})" if silent_nodes else ""),
             f"lost the store: {', '.join(where(r) for r in sorted(records))}"]
    text = " · ".join(parts).replace("\n", " ")
    return text if len(text) <= max_chars else text[:max_chars - 1] + "…"


def from_folder(report_dir: str, run_id: str | None = None) -> str | None:
    """The line for a report folder: the report's, else the lost ranks', else None."""
    try:
        with open(os.path.join(report_dir, "report.json")) as f:
            report = json.load(f)
        if isinstance(report, dict) and (run_id is None or report.get("run_id") == run_id):
            return line(report)
    except (OSError, ValueError):
        pass
    records = lost.read(report_dir, run_id)
    return from_lost(records) if records else None


def main(argv: list[str] | None = None) -> int:
    """``ddp-smoke last-line REPORT.json``: print the line; 2 when unreadable.
    ``--dir REPORT_DIR [--run-id ID]``: the folder's line (see above); 2 when none."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--dir"] and len(args) in (2, 4) and (len(args) == 2
                                                         or args[2] == "--run-id"):
        got = from_folder(args[1], args[3] if len(args) == 4 else None)
        if got is None:
            print(f"ddp-smoke: error: no report and no lost ranks' records in {args[1]}",
                  file=sys.stderr)
            return 2
        print(got)
        return 0
    if len(args) != 1:
        print("ddp-smoke: error: usage: ddp-smoke last-line REPORT.json | --dir REPORT_DIR "
              "[--run-id ID]", file=sys.stderr)
        return 2
    try:
        with open(args[0]) as f:
            report = json.load(f)
    except (OSError, ValueError) as e:
        print(f"ddp-smoke: error: cannot read report {args[0]}: {e}", file=sys.stderr)
        return 2
    print(line(report))
    return 0
