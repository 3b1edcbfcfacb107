"""What a health rule says, and what it judges against.

Every signal family (:mod:`.presence`, :mod:`.memory`, :mod:`.xid`, …) has one function
``judge(node, lim) -> list[Finding]``: ``node`` is one node's readings as the readers record
them (plain JSON, so a recorded node judges the same way as a live one), ``lim`` the
:class:`Limits`. A :class:`Finding` has one of four levels:

``fail``          the node, GPU or port is at fault: a culprit, with the action to take;
``warn``          printed and kept, never fails the check;
``not_measured``  what could not be judged and why (never read as a pass);
``checked``       what was read and judged (the report lists it: a pass says what it covers).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

FAIL, WARN, NOT_MEASURED, CHECKED = "fail", "warn", "not_measured", "checked"
LEVELS = (FAIL, WARN, NOT_MEASURED, CHECKED)


@dataclass(frozen=True)
class GpuRef:
    """A GPU as a repair ticket names it: NVML index, PCI bus id, board serial, UUID."""

    index: int | None
    bus_id: str | None = None
    serial: str | None = None
    uuid: str | None = None

    @classmethod
    def of(cls, g: dict[str, Any]) -> GpuRef:
        return cls(g.get("index"), g.get("bus_id"), g.get("serial"), g.get("uuid"))

    def __str__(self) -> str:
        return (f"GPU {'?' if self.index is None else self.index} (bus {self.bus_id or '?'}, "
                f"serial {self.serial or 'unreadable'})")


@dataclass(frozen=True)
class Finding:
    """One statement of a rule: what, the evidence, the operator's action, the rule's source.

    ``gpu`` or ``port`` names the part at fault; neither: the node itself.
    """

    what: str
    evidence: str = ""
    action: str = ""
    source: str = ""
    level: str = FAIL
    gpu: GpuRef | None = None
    port: str | None = None

    @property
    def subject(self) -> str:
        return str(self.gpu) if self.gpu else f"HCA port {self.port}" if self.port else ""

    def line(self) -> str:
        """The culprit's reason: "GPU 3 (bus …, serial …): what; evidence: …; action: …"."""
        text = f"{self.subject}: {self.what}" if self.subject else self.what
        if self.level == NOT_MEASURED:
            return f"{text}: {self.evidence}"
        text += f"; evidence: {self.evidence}" if self.evidence else ""
        return text + (f"; action: {self.action}" if self.action else "")

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if v not in (None, "")}
        if self.gpu:
            out["gpu"] = {k: v for k, v in asdict(self.gpu).items() if v is not None}
        return out


def fail(what: str, evidence: str, action: str, source: str, **subject) -> Finding:
    return Finding(what, evidence, action, source, FAIL, **subject)


def warn(what: str, evidence: str = "", source: str = "", **subject) -> Finding:
    return Finding(what, evidence, "", source, WARN, **subject)


def unmeasured(what: str, why: str, **subject) -> Finding:
    return Finding(what, why, "", "", NOT_MEASURED, **subject)


def checked(what: str) -> Finding:
    return Finding(what, level=CHECKED)


@dataclass(frozen=True)
class Limits:
    """What a node is judged against.

    Attributes:
        thresholds: the ``health`` section of defaults.yaml (each with its source).
        expect: what the node should have, the profile's ``health`` section (absent: not
            judged); HCA expectations only on runs of two or more nodes.
        gpu_run: ranks on this node use CUDA, or the profile expects GPUs: a GPU that cannot
            be read here fails the node instead of being "not measured".
        gpu_ranks: ranks on this node that use a GPU.
        run_pids: the process ids of this run's ranks on this node (stray-process rule).
    """

    thresholds: dict[str, Any]
    expect: dict[str, Any] = field(default_factory=dict)
    gpu_run: bool = False
    gpu_ranks: int = 0
    run_pids: tuple[int, ...] = ()
