"""report.json and junit.xml: the report's two machine-read forms.

``report.schema.json`` beside this module is the one description of report.json.
"""
from __future__ import annotations

import json
import os
from typing import Any
from xml.sax.saxutils import escape, quoteattr

from ..errors import ReportWriteError
from ..model import FAIL, SKIP, Report, finite, injected
from .files import remove, write_atomic
from .hosts import hosts_section


def as_dict(report: Report) -> dict[str, Any]:
    """report.json's content: the report's fields and its ``hosts`` section."""
    return {**report.to_dict(), "hosts": hosts_section(report)}


def to_json(report: Report) -> str:
    return json.dumps(finite(as_dict(report)), indent=2, allow_nan=False) + "\n"


def to_json_line(report: Report) -> str:
    """The report on one line (the fallback on stderr when the file cannot be written)."""
    return json_line(as_dict(report))


def json_line(content: dict[str, Any]) -> str:
    """report.json's content on one line (a report read back from a rank's stderr, said again)."""
    return json.dumps(finite(content), separators=(",", ":"), allow_nan=False)


def practice_note(report) -> str:
    """What every output of a practice run says first: its failures were made on purpose."""
    spec = injected(report)
    return (f"PRACTICE, injected on purpose (--fault {spec}), not this cluster's fault"
            if spec else "")


def to_junit(report: Report) -> str:
    """JUnit XML: one testcase per check, so CI systems can gate on an acceptance run.
    In a practice run every failure message starts with :func:`practice_note`: a CI page
    shows the message, not the suite's properties."""
    note = practice_note(report)
    lead = f"{note}: " if note else ""
    failures = sum(c.status == FAIL for c in report.checks) + (report.error is not None)
    skipped = sum(c.status == SKIP for c in report.checks)
    total = len(report.checks) + (report.error is not None)
    lines = ['<?xml version="1.0" encoding="UTF-8"?>',
             f'<testsuite name="ddp-smoke" tests="{total}" failures="{failures}" '
             f'skipped="{skipped}" time="{report.timings.get("total_s", 0.0):.3f}">']
    if note:
        lines += ["  <properties>",
                  f'    <property name="injected" value={quoteattr(report.config["fault"])}/>',
                  "  </properties>"]
    for c in report.checks:
        lines.append(f'  <testcase classname="ddp_smoke" name={quoteattr(c.name)} '
                     f'time="{c.duration_s:.3f}">')
        text = "\n".join(f"rank {k.rank} host {k.host}: {k.reason}" for k in c.culprits)
        if c.status == FAIL:
            lines.append(f"    <failure message={quoteattr(lead + c.summary)}>"
                         f"{escape(lead + text)}</failure>")
        elif c.status == SKIP:
            lines.append(f"    <skipped message={quoteattr(c.summary)}/>")
        lines.append("  </testcase>")
    if report.error is not None:
        who = report.error.get("rank")  # the culprit's rank when one is named (stopped_run.py)
        message = lead + (f"rank {who} host {report.error.get('host')}: " if who is not None
                          else "") + f'{report.error.get("type")}: {report.error.get("message")}'
        lines.append('  <testcase classname="ddp_smoke" name="run">')
        lines.append(f"    <failure message={quoteattr(message)}/>")
        lines.append("  </testcase>")
    lines.append("</testsuite>")
    return "\n".join(lines) + "\n"


def write_report(report: Report, report_dir: str) -> str:
    """Write ``report.json``, then ``junit.xml``, each atomically; return the JSON path.

    The two never disagree: report.json goes first, and when it cannot be written junit.xml
    is not written either (a junit.xml left from before is removed, if it can be).

    Raises:
        ReportWriteError: naming the file that could not be written and why.
    """
    path = os.path.join(report_dir, "report.json")
    junit = os.path.join(report_dir, "junit.xml")
    try:
        write_atomic(path, to_json(report))
    except ReportWriteError:
        remove(junit)
        raise
    write_atomic(junit, to_junit(report))
    return path
