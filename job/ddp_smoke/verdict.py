"""One line that says how a run ended, for places that keep only a little text.

Kubernetes keeps at most 4096 bytes of a container's termination message (``kubectl describe
pod``, the job's events); its fallback, the log's tail, cuts the one-line JSON report in the
middle. The manifests in ``k8s/`` therefore write this line to ``/dev/termination-log``::

    python3 -m ddp_smoke.verdict REPORT_DIR/report.json > /dev/termination-log

Example: ``ddp-smoke FAIL · run ddp-smoke-1b2c · 16 ranks on 2 nodes · failed: bandwidth
(rank 8 gpu-b: slow pair …)``. Reads only the JSON file: no torch, quick in any pod.
Exit status 0 when it could read the report, 2 (with a one-line error) when not.

``python -m ddp_smoke.verdict --launcher …`` is the launchers' side (the sbatch, the image's
entrypoint): it writes the report when the worker never started and prints the job log's last
line; see :mod:`ddp_smoke.outputs.launch_report`.
"""
from __future__ import annotations

import json
import sys
from typing import Any

from .outputs import launch_report

MAX_CHARS = 1024  # well inside the kubelet's 4096-byte limit, whole words never needed


def line(report: dict[str, Any], max_chars: int = MAX_CHARS) -> str:
    """The report as one line: verdict, run id, shape, failed checks with their culprits."""
    ranks = report.get("ranks") or []
    nodes = report.get("nodes", len({r.get("host") for r in ranks}))
    parts = [f"ddp-smoke {str(report.get('verdict', 'none')).upper()}",
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


def main(argv: list[str] | None = None) -> int:
    """``python -m ddp_smoke.verdict REPORT.json``: print the line; 2 when unreadable."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--launcher"]:  # a launcher's verdict when no worker wrote one
        return launch_report.main(args[1:])
    if len(args) != 1:
        print("ddp-smoke: error: usage: python -m ddp_smoke.verdict REPORT.json", file=sys.stderr)
        return 2
    try:
        with open(args[0]) as f:
            report = json.load(f)
    except (OSError, ValueError) as e:
        print(f"ddp-smoke: error: cannot read report {args[0]}: {e}", file=sys.stderr)
        return 2
    print(line(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
