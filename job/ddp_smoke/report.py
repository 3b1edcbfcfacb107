"""The report's data model: pure dataclasses, JSON in and out, atomic writes, JUnit XML.

Every field has exactly one shape. Nothing here touches ``torch.distributed``; the harness
fills these records and rank 0 writes them.

``report.json`` (the contract other tools rely on)::

    {
      "verdict": "pass" | "fail", "run_id": str (the run that wrote it),
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

The report is strict JSON: a figure that is NaN or infinite is written as null. Every string
passes through :mod:`ddp_smoke.redact` when the report is built, so no secret reaches the file,
the human summary or a log line. Files are created with the user's umask (0666 & ~umask).
"""
from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import secrets
from dataclasses import dataclass, field
from typing import Any
from xml.sax.saxutils import escape, quoteattr

from . import redact, triage
from .config import ConfigError

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
    run_id: str = ""

    def __post_init__(self):
        # Copies: the config and the results are the harness's own objects.
        self.config, self.ranks, self.error = (redact.tree(self.config),
                                               redact.tree(self.ranks), redact.tree(self.error))
        self.checks = [dataclasses.replace(
            c, summary=redact.scrub(c.summary), figures=redact.tree(c.figures),
            notes=redact.tree(c.notes),
            culprits=[dataclasses.replace(k, reason=redact.scrub(k.reason)) for k in c.culprits])
            for c in self.checks]

    @property
    def nodes(self) -> int:
        return len({r["host"] for r in self.ranks if r.get("host")})

    @property
    def verdict(self) -> str:
        ran_all = self.checks and all(c.status in (PASS, SKIP) for c in self.checks)
        return PASS if ran_all and self.error is None else FAIL

    def to_dict(self) -> dict[str, Any]:
        body = dataclasses.asdict(self)
        return {"verdict": self.verdict, "run_id": self.run_id, "world_size": self.world_size,
                "nodes": self.nodes, "backend": self.backend, **body,
                "hosts": triage.hosts_section(self)}

    def to_json(self) -> str:
        return json.dumps(finite(self.to_dict()), indent=2, allow_nan=False) + "\n"

    def to_json_line(self) -> str:
        """The report on one line (the fallback on stderr when the file cannot be written)."""
        return json.dumps(finite(self.to_dict()), separators=(",", ":"), allow_nan=False)


def finite(data: Any) -> Any:
    """A copy of JSON-like ``data`` with NaN and infinities as None: strict JSON, one shape
    (a number or null) per figure."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: finite(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [finite(v) for v in data]
    return data


def check_from_dict(data: dict[str, Any]) -> CheckResult:
    """Rebuild a CheckResult from its JSON form."""
    culprits = [Culprit(**c) for c in data.get("culprits", [])]
    return CheckResult(**{**data, "culprits": culprits})


class ReportWriteError(RuntimeError):
    """A report file could not be written (ENOSPC, EDQUOT, EACCES, EROFS, ESTALE …).

    ``str()`` is one line naming the path and the system's reason; ``path``, ``errno`` and
    ``strerror`` hold them apart.
    """

    def __init__(self, path: str, error: OSError):
        self.path, self.errno = path, error.errno
        self.strerror = error.strerror or str(error)
        name = errno.errorcode.get(error.errno, "") if error.errno else ""
        super().__init__(f"cannot write {path}: {self.strerror}" + (f" ({name})" if name else ""))


def write_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file in the same directory and a rename.

    Readers (a CI gate polling the report, a second rank) never see a half-written file. The
    file is fsynced before the rename and the directory after it, so a crash right after
    leaves the old file or the new one, never an empty one. The temp file is created with
    mode 0666, which the kernel masks with the user's umask (and default ACLs), like any file
    the user creates: a team that wants the report readable sets its umask so.

    Raises:
        ReportWriteError: for any OSError, naming the path.
    """
    directory = os.path.dirname(os.path.abspath(path))
    # The temp name must not end like the real one: node_exporter reads every *.prom in its
    # directory, a half-written .tmp-…x.prom included.
    tmp = os.path.join(directory, f".tmp-{os.path.basename(path)}.{secrets.token_hex(6)}")
    try:
        os.makedirs(directory, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o666)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            _unlink(tmp)
            raise
        fsync_dir(directory)
    except OSError as e:
        raise ReportWriteError(path, e) from None


def fsync_dir(directory: str) -> None:
    """Make a rename or a new name in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


REPORT_FILES = ("report.json", "junit.xml", "busbw.png", "report.html")


def clear_stale(report_dir: str) -> list[str]:
    """Remove the report files in ``report_dir`` before a run starts; return what went.

    Rank 0 calls this before it connects: nothing there was written by this run, and a report
    left by an earlier one (the same ``--report-dir`` or ``--folder`` twice, a requeued Slurm
    job, a fixed folder on a persistent volume) must never be read as this run's verdict if
    this run dies before writing its own.

    Raises:
        ConfigError: when a stale file cannot be removed (another user's, in a sticky
            folder; a read-only one): the run must not start, exit 2 naming the folder.
    """
    gone = []
    for name in REPORT_FILES:
        path = os.path.join(report_dir, name)
        try:
            os.unlink(path)  # a symlink is removed, never followed
        except FileNotFoundError:
            continue
        except OSError as e:
            raise ConfigError(f"--report-dir {report_dir}: cannot remove {name} left by another "
                              f"run ({e.strerror}); remove it or choose another folder") from None
        gone.append(path)
    return gone


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
    """Write ``report.json``, then ``junit.xml``, each atomically; return the JSON path.

    The two never disagree: report.json goes first, and when it cannot be written junit.xml
    is not written either (a junit.xml left from before is removed, if it can be).

    Raises:
        ReportWriteError: naming the file that could not be written and why.
    """
    path = os.path.join(report_dir, "report.json")
    junit = os.path.join(report_dir, "junit.xml")
    try:
        write_atomic(path, report.to_json())
    except ReportWriteError:
        _unlink(junit)
        raise
    write_atomic(junit, to_junit(report))
    return path
