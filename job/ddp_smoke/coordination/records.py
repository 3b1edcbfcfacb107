"""What the keys of :mod:`.keys` hold: one record type per kind of record, in one place.

Each rank writes these as JSON into the store (the field names are a wire format, like the
keys: ranks of different builds share one store), and the report carries them on (the
identities as ``ranks``, aborts in a stopped check's ``figures.aborts``, forensics, the lost
ranks' lines). A record is built here, typed, and turned into JSON once (:func:`wire`);
readers that only pass a record on keep its JSON form, and :func:`abort_of` reads an abort
back as its type. An optional field (one with a default) left at None is not written; a
required one is, null included.
"""
from __future__ import annotations

import dataclasses
import json
import traceback
from dataclasses import dataclass, field
from typing import Any, ClassVar

from . import keys


def wire(record) -> dict:
    """A record as the JSON object the store and the report hold (optional fields at None
    left out)."""
    out = {f.name: getattr(record, f.name) for f in dataclasses.fields(record)
           if getattr(record, f.name) is not None or _required(f)}
    kind = getattr(record, "kind", None)
    return {**out, "kind": kind} if kind else out


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def text(record) -> str:
    """:func:`wire`, as the text a key holds."""
    return json.dumps(wire(record))


@dataclass(frozen=True, kw_only=True)
class Identity:
    """``rank/<r>``: who and where a rank is (the report's ``ranks``; also "it connected")."""
    rank: int
    local_rank: int | None
    host: str | None
    group_rank: int | None = None
    pid: int | None = None
    device: str | None = None
    route_address: str | None = None
    hostname_addresses: list[str] | None = None
    addresses: dict[str, str] | None = None
    gpu_name: str | None = None
    gpu_bus_id: str | None = None
    gpu_uuid: str | None = None
    gpu_memory_bytes: int | None = None
    slurm_node: str | None = None
    k8s_node: str | None = None
    identity: dict | None = None
    missing: str | None = None  # only for a rank that never posted one

    @classmethod
    def never_connected(cls, rank: int) -> dict:
        return wire(cls(rank=rank, local_rank=None, host=None,
                        missing="never connected to the store"))


@dataclass(frozen=True, kw_only=True)
class Observation:
    """``obs/<stage>/<r>``: a rank's part of a check, for rank 0 to judge; with the seconds
    inside each collective (``waits``: who waited for whom) and, on a CPU rank, whether its node's
    ranks share cores and how long a CPU quota held it (``cpu``): coordination/stragglers.py; and
what its TCP connections retransmitted, per peer address (``tcp``): coordination/retransmits.py."""
    data: Any
    duration_s: float
    waits: list
    cpu: dict | None = None
    tcp: dict | None = None


@dataclass(frozen=True, kw_only=True)
class Beat:
    """``beat/<r>``: the heartbeat, where the rank is, and its collective progress."""
    n: int
    t: float
    stage: str
    progress: dict = field(default_factory=dict)

    def to_json(self) -> str:  # progress sits at the top level of the record (wire format)
        return json.dumps({"n": self.n, "t": self.t, "stage": self.stage, **self.progress})


@dataclass(frozen=True, kw_only=True)
class Abort:
    """``abort/<r>``: a rank's first reason to stop; one type per kind (:data:`ABORTS`)."""
    kind: ClassVar[str]
    rank: int
    stage: str
    at: float  # wall time, the aborting rank's clock


@dataclass(frozen=True, kw_only=True)
class ErrorAbort(Abort):
    """The check or the harness raised on that rank (``comm``: it saw a peer vanish)."""
    kind: ClassVar[str] = keys.ERROR
    type: str
    message: str
    traceback: str | None = None
    comm: bool = False
    reason: str | None = None  # the culprit's reason, where the raiser knows it better


# Backend errors of a rank whose peer vanished: a victim; not one whose own transport could
# not start (_OWN: gloo finds no interface of the name it was given on this node).
_COMM_MARKERS = ("Connection closed by peer", "Connection reset by peer", "gloo/transport",
                 "Broken pipe", "NCCL communicator was aborted", "Timed out waiting")
_OWN = ("Unable to find address for",)


def error_detail(e: BaseException) -> dict:
    """An exception as an :class:`ErrorAbort`'s fields; ``comm`` marks a rank that saw its
    peer vanish."""
    import torch.distributed as dist  # only a rank that raised gets here: torch is loaded
    message = str(e)
    comm = (isinstance(e, getattr(dist, "DistError", ())) or any(
        m in message for m in _COMM_MARKERS)) and not any(m in message for m in _OWN)
    return {"type": type(e).__name__, "message": message.splitlines()[0][:500] if message else "",
            "traceback": traceback.format_exc(limit=6), "comm": comm}


@dataclass(frozen=True, kw_only=True)
class TimeoutAbort(Abort):
    """A deadline passed while the rank waited."""
    kind: ClassVar[str] = keys.TIMEOUT
    waiting_for: str


@dataclass(frozen=True, kw_only=True)
class TerminatedAbort(Abort):
    """The rank received a terminating signal."""
    kind: ClassVar[str] = keys.TERMINATED
    signal: str


@dataclass(frozen=True, kw_only=True)
class LostAbort(Abort):
    """A watchdog saw ranks it waited for go silent (rank 0's, or rank 0 itself silent)."""
    kind: ClassVar[str] = keys.LOST
    silent: list[int]
    waiting_for: str


@dataclass(frozen=True, kw_only=True)
class StoppedAbort(Abort):
    """The rank stops because of another's problem: never evidence."""
    kind: ClassVar[str] = keys.STOPPED
    why: str


ABORTS = {cls.kind: cls for cls in (ErrorAbort, TimeoutAbort, TerminatedAbort, LostAbort,
                                    StoppedAbort)}
assert tuple(ABORTS) == keys.ABORT_KINDS  # one list of kinds: the wire table's


def abort_of(obj: dict) -> Abort:
    """An abort record read back as its type; ValueError for an unknown kind or shape."""
    cls = ABORTS.get(obj.get("kind"))
    if cls is None:
        raise ValueError(f"unknown abort kind {obj.get('kind')!r}")
    try:
        return cls(**{k: v for k, v in obj.items() if k != "kind"})
    except TypeError as e:
        raise ValueError(f"abort of kind {cls.kind}: {e}") from None


@dataclass(frozen=True, kw_only=True)
class Forensics:
    """``forensics/<r>``: where a live rank left its files after an abort, and its innermost
    frame of the kit's code; a file that could not be written has its error instead."""
    where: str | None
    stacks: str | None = None
    stacks_error: str | None = None
    flight_recorder: str | None = None
    flight_recorder_error: str | None = None
    nccl_flight_recorder: str | None = None
    issued: int | None = None  # the last world collective its Flight Recorder handed over
    # seconds inside each world collective of the stopped check until the abort
    # (progress.Recorder.spent): evidence for blame, not kept in the report
    waits: list | None = None
    # its node's CPU quota held its ranks back over the run so far (local rank 0, the health
    # check's rule on its own cgroups: checks/health): evidence for blame
    held: str | None = None
    # what its TCP connections retransmitted since the stopped check began, per peer address
    # (coordination/retransmits.py): evidence for blame
    tcp: dict | None = None


@dataclass(frozen=True, kw_only=True)
class Lost:
    """A rank that lost the store says what it knows: one JSON line on stderr and
    ``REPORT_DIR/lost/<r>.json`` (:mod:`.lost`), not a store record."""
    ddp_smoke_rank: int
    run_id: str
    stage: str
    progress: dict
    error: str
    store: str
    host: str
    world_size: int
    hosts: list | None
    aborted: bool = True

    def to_dict(self) -> dict:  # hosts stays, as null, when the rank never learnt them
        return dataclasses.asdict(self)
