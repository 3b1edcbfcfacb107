"""The report's data model: pure dataclasses, JSON in and out.

Every field has exactly one shape. Nothing here touches ``torch.distributed`` or a file; the
harness fills these records and :mod:`ddp_smoke.outputs` writes them. The one description of
``report.json`` is ``outputs/report.schema.json``: every field, its type and meaning.

``hosts`` is derived from ``ranks`` and the culprits on every write (:mod:`ddp_smoke.outputs.hosts`).

The report is strict JSON: a figure that is NaN or infinite is written as null. Every string
passes through :mod:`ddp_smoke.redact` when the report is built, so no secret reaches the file,
the human summary or a log line. Files are created with the user's umask (0666 & ~umask).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from . import redact

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
    run was aborted and the rank could still say. ``rail`` names the rail when the evidence
    is one rail's (``{"index", "device", "port"}``: a node's rail with its rank and host, a
    rail of every node with neither).
    """

    rank: int | None
    host: str | None
    reason: str
    ranks: list[int] | None = None
    hosts: list[str | None] | None = None
    where: str | None = None
    rail: dict[str, Any] | None = None


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
    # {"signed": bool, "findings": [{"key", "rank", "why", "seen_by", "value"}]}: records in
    # the store that failed their signature check (ddp_smoke.coordination.signing)
    security: dict[str, Any] = field(default_factory=dict)
    # who wrote it: "rank 0", "rank N (took over from rank 0)", "store host", "launcher …"
    written_by: str = ""

    def __post_init__(self):
        # Copies: the config and the results are the harness's own objects.
        self.config, self.ranks, self.error = (redact.tree(self.config),
                                               redact.tree(self.ranks), redact.tree(self.error))
        self.security = redact.tree(self.security)  # findings quote what a forger wrote
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
        """The report's own fields, the derived ones first (``hosts`` is added by outputs)."""
        body = dataclasses.asdict(self)
        return {"verdict": self.verdict, "run_id": self.run_id, "world_size": self.world_size,
                "nodes": self.nodes, "backend": self.backend,
                # the --fault spec when faults were injected on purpose (null: none were)
                "injected": self.config.get("fault"), **body}


def rail_label(rail: dict | None) -> str:
    """A rail as every output names it: ``rail 1 (eth1)``, ``rail 3 (mlx5_3, port 1)``;
    ``rail 1`` when its device is unknown."""
    if not isinstance(rail, dict):
        return "rail ?"
    device = rail.get("device")
    port = f", port {rail['port']}" if rail.get("port") is not None else ""
    return f"rail {rail.get('index', '?')}" + (f" ({device}{port})" if device else "")


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


def percentile(values, q: float) -> float:
    """The q-th percentile by nearest rank (q in 0..100), as nccl-tests computes its p95/p99."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(len(ordered) * q / 100) - 1))]


def nodes_or_links(bad, pairs) -> tuple[list, list]:
    """Bad node pairs blamed on nodes or links: a node whose every pair is bad, two or more,
    each partner fine in some other pair, is the node; the other bad pairs are links (those
    touching a named node are its). ``bad`` and ``pairs``: iterables of sorted pairs."""
    bad, pairs = set(bad), list(pairs)
    fine = {n for p in pairs if p not in bad for n in p}
    nodes = sorted(n for n in {n for p in bad for n in p}
                   if len(mine := [p for p in pairs if n in p]) >= 2
                   and all(p in bad for p in mine)
                   and all((p[0] if p[1] == n else p[1]) in fine for p in mine))
    named = set(nodes)
    return nodes, sorted(p for p in bad if not set(p) & named)


def get_field(obj, key: str, default=None):
    """A field of a Report, CheckResult or Culprit, or of its JSON dict, alike; fields another
    version may lack (a culprit's ``ranks``/``hosts``) read as ``default``."""
    if isinstance(obj, dict):
        return obj.get(key, default)
    return getattr(obj, key, default)


def injected(report) -> str | None:
    """The ``--fault`` spec of a practice run (a Report or its JSON dict), or None for a real
    one. Every output marks a practice run as such: its failures were made on purpose."""
    if isinstance(report, dict):
        config = report.get("config") if isinstance(report.get("config"), dict) else {}
        spec = report.get("injected") or config.get("fault")
        return str(spec) if spec else None
    return report.config.get("fault") or None


def check_from_dict(data: dict[str, Any]) -> CheckResult:
    """Rebuild a CheckResult from its JSON form."""
    culprits = [Culprit(**c) for c in data.get("culprits", [])]
    return CheckResult(**{**data, "culprits": culprits})
