"""The report's data model: pure dataclasses, JSON in and out, atomic writes, JUnit XML.

Every field has exactly one shape. Nothing here touches ``torch.distributed``; the harness
fills these records and rank 0 writes them.

``report.json`` (the contract other tools rely on)::

    {
      "verdict": "pass" | "fail",
      "world_size": int, "nodes": int, "backend": "gloo" | "nccl",
      "version": str, "started_at": ISO-8601 str, "config": {...effective config...},
      "ranks":  [{"rank", "local_rank", "group_rank", "host", "addresses", "pid", "device", ...}],
      "checks": [{"name", "status": "pass"|"fail"|"skip", "duration_s", "summary",
                  "culprits": [{"rank": int|null, "host": str|null, "reason": str,
                                "ranks": [int, int]|null, "hosts": [str, str]|null,
                                "where": str|null}],
                  "figures": {...}, "notes": [str]}],
      "timings": {"<phase>_s": float, ...},
      "error": null | {"rank", "host", "type", "message"},
      "forensics": [{"rank", "host", "where", "stacks": path, "flight_recorder": path}],
      "hosts": [{"host", "verdict": "good"|"suspect"|"bad", "ranks", "reasons": [...]}]
    }

``hosts`` is derived from ``ranks`` and the culprits on every write (``ddp_smoke.triage``).
"""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any
from xml.sax.saxutils import escape, quoteattr

from . import triage

PASS = "pass"
FAIL = "fail"
SKIP = "skip"
STATUSES = (PASS, FAIL, SKIP)


@dataclass
class Culprit:
    """Who is to blame and why.

    ``rank``/``host`` are None when the evidence names no single rank. A link culprit names
    both ends in ``ranks``/``hosts`` (its ``rank`` stays None: neither end is convicted).
    ``where`` is the innermost frame of the kit's code on the culprit's main thread, when the
    run was aborted and the rank could still say.
    """

    rank: int | None
    host: str | None
    reason: str
    ranks: list[int] | None = None
    hosts: list[str | None] | None = None
    where: str | None = None


@dataclass
class CheckResult:
    """One check's outcome, judged on rank 0 from every rank's observation.

    Attributes:
        name: the check's registered name.
        status: one of ``STATUSES``.
        summary: the key figure, in a few words, for the human table.
        culprits: evidence-based blame; empty when the check passed.
        figures: measured numbers, every quantity with its unit in its key.
        notes: lines rank 0 prints verbatim before the table (e.g. the tutorial's lines).
        duration_s: wall time of the slowest rank, set by the harness.
    """

    name: str
    status: str
    summary: str = ""
    culprits: list[Culprit] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    duration_s: float = 0.0

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"check {self.name!r}: status {self.status!r} not in {STATUSES}")


@dataclass
class Report:
    """What rank 0 writes: the run's identity, per-rank records, per-check results."""

    version: str
    started_at: str
    backend: str
    world_size: int
    ranks: list[dict[str, Any]]
    checks: list[CheckResult]
    config: dict[str, Any]
    timings: dict[str, float] = field(default_factory=dict)
    error: dict[str, Any] | None = None
    forensics: list[dict[str, Any]] = field(default_factory=list)  # per rank, after an abort

    @property
    def nodes(self) -> int:
        return len({r["host"] for r in self.ranks if r.get("host")})

    @property
    def verdict(self) -> str:
        ran_all = self.checks and all(c.status in (PASS, SKIP) for c in self.checks)
        return PASS if ran_all and self.error is None else FAIL

    def to_dict(self) -> dict[str, Any]:
        body = dataclasses.asdict(self)
        return {"verdict": self.verdict, "world_size": self.world_size, "nodes": self.nodes,
                "backend": self.backend, **body, "hosts": triage.hosts_section(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n"


def check_from_dict(data: dict[str, Any]) -> CheckResult:
    """Rebuild a CheckResult from its JSON form."""
    culprits = [Culprit(**c) for c in data.get("culprits", [])]
    return CheckResult(**{**data, "culprits": culprits})


def write_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file in the same directory and a rename.

    Readers (a CI gate polling the report, a second rank) never see a half-written file.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    # The temp name must not end like the real one: node_exporter reads every *.prom in its
    # directory, a half-written .tmp-…x.prom included.
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".tmp-{os.path.basename(path)}.")
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the report from the rest of the team
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def to_junit(report: Report) -> str:
    """JUnit XML: one testcase per check, so CI systems can gate on an acceptance run."""
    failures = sum(c.status == FAIL for c in report.checks) + (report.error is not None)
    skipped = sum(c.status == SKIP for c in report.checks)
    total = len(report.checks) + (report.error is not None)
    lines = ['<?xml version="1.0" encoding="UTF-8"?>',
             f'<testsuite name="ddp-smoke" tests="{total}" failures="{failures}" '
             f'skipped="{skipped}" time="{report.timings.get("total_s", 0.0):.3f}">']
    for c in report.checks:
        lines.append(f'  <testcase classname="ddp_smoke" name={quoteattr(c.name)} '
                     f'time="{c.duration_s:.3f}">')
        text = "\n".join(f"rank {k.rank} host {k.host}: {k.reason}" for k in c.culprits)
        if c.status == FAIL:
            lines.append(f"    <failure message={quoteattr(c.summary)}>{escape(text)}</failure>")
        elif c.status == SKIP:
            lines.append(f"    <skipped message={quoteattr(c.summary)}/>")
        lines.append("  </testcase>")
    if report.error is not None:
        message = f'{report.error.get("type")}: {report.error.get("message")}'
        lines.append('  <testcase classname="ddp_smoke" name="run">')
        lines.append(f"    <failure message={quoteattr(message)}/>")
        lines.append("  </testcase>")
    lines.append("</testsuite>")
    return "\n".join(lines) + "\n"


def write_report(report: Report, report_dir: str) -> str:
    """Write ``report.json`` and ``junit.xml`` atomically; return the JSON path."""
    path = os.path.join(report_dir, "report.json")
    write_atomic(os.path.join(report_dir, "junit.xml"), to_junit(report))
    write_atomic(path, report.to_json())
    return path
