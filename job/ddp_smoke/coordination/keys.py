"""The protocol between ranks, in one table: every store key and every abort kind.

All keys live under ``ddp_smoke/<restart>/`` (a PrefixStore per torchelastic restart). The key
strings are a wire format: ranks of different builds share one store, so they never change.
``<r>`` is a rank, ``<stage>`` is ``<check>/<iteration>`` (:func:`stage`).

======================  ===========  ==================================================
key                     written by   what it holds
======================  ===========  ==================================================
rank/<r>                every rank   its identity record (JSON); also "it connected"
backend/nccl            (retired)    was a counter of NCCL ranks: anyone could raise it
connect/<r>, /all       every rank   arrival at the start, holding the rank's backend pick;
                                     ``/all`` raised by rank 0
backend                 rank 0       how many connect records picked nccl
run_id                  rank 0       the run id every rank adopts
arrive/<stage>/<r>      every rank   arrival at a check; ``/all`` raised by rank 0 (with
                                     node speakers, a node's in one call: :mod:`.node`)
obs/<stage>/<r>         every rank   its observation of a check (JSON; the same)
result/<stage>          rank 0       its judgement of a check (JSON), for a survivor
next/<iteration>        rank 0       repeat mode: "1" for another pass, "0" to stop
beat/<r>                every rank   heartbeat: counter, time, stage, collective progress
beat/listed             every rank   "r," appended at its first heartbeat: who has beaten
nodebeat/<node>         a speaker    node beats (:mod:`.node`): the heartbeats of the node's
                                     ranks, by rank (JSON); its torchrun group rank
nodebeat/listed         a speaker    "node," appended when a speaker first posts the node's
abort/<r>               every rank   its first reason to stop (JSON), set once
abort/listed            every rank   "r," appended by each aborting rank: the run is aborted
forensics/<r>           every rank   where its files are, its innermost frame (JSON)
forensics/listed        every rank   "r," appended once the forensics are posted
waiting/<r>             every rank   alive and waiting for the verdict: a candidate writer
writer                  one rank     the rank writing the report (compare-and-set)
final                   the writer   the verdict: pass or fail
bye, bye/all            every rank   counter of ranks that read ``final``; ``/all`` when all did
probe/<r>               node leader  its reachability probe's address and port (JSON)
probe/listed            node leader  "r," appended once the probe is open: the node leaders
reach/<r>               node leader  after an abort: the leaders it tried and could not reach
reach/listed            node leader  "r," appended once its findings are posted
rail/<r>, /all          every rank   with a ``rails`` setting on gloo: its rail's interface,
                                     address and probe port (JSON), before the process group
railreach/<r>, /all     every rank   the rail peers it tried and could not reach (JSON)
fate/<r>                a rank       after an abort: how rank r ended, as its node shows it
                                     (gone, stopped, the OOM killer; first word stands)
exit/<r>                launcher     rank r's exit status or signal, as its parent saw it
meta                    first rank   the run's shape for the store host (JSON; compare-and-set)
security/listed         every rank   records that failed their signature check (JSON items)
woken                   one rank     the first aborting rank, which woke the others (set once)
======================  ===========  ==================================================

What another rank blocks on, rank 0 also writes once per rank: ``<key>/<r>`` beside each of
``connect/all``, ``run_id``, ``backend``, ``arrive/<stage>/all`` and ``next/<iteration>``, so
that each rank waits on a key of its own (c10d's server serves thousands of waiters of one key
poorly). The first aborting rank writes :data:`WOKEN` into those a rank may be blocked on
now: the reader wakes and stops, instead of waiting out a slice.

Every value is signed with the run's secret (:mod:`.signing`): ``value.<fingerprint><mac>``;
a ``/listed`` key holds one signed item per line. Counters (``bye``) cannot be signed and are
never evidence; existence alone (``check``, ``wait``) only ever decides timing.
"""
from __future__ import annotations

RANK, CONNECT, RUN_ID = "rank", "connect", "run_id"
ARRIVE, OBS, RESULT, NEXT = "arrive", "obs", "result", "next"
BEAT, ABORT, FORENSICS, WAITING = "beat", "abort", "forensics", "waiting"
NODE_BEAT = "nodebeat"
WRITER, FINAL, BYE, META = "writer", "final", "bye", "meta"
PROBE, REACH = "probe", "reach"
RAIL, RAIL_REACH = "rail", "railreach"
FATE, EXIT = "fate", "exit"
BACKEND, SECURITY, WOKE = "backend", "security", "woken"

# Abort kinds (``kind`` in abort/<r>), and what each means.
ERROR = "error"            # the check or the harness raised on that rank
TIMEOUT = "timeout"        # a deadline passed while the rank waited
TERMINATED = "terminated"  # the rank received SIGTERM, SIGINT, SIGUSR1 or SIGUSR2
LOST = "lost"              # rank 0's watchdog: ranks it waited for went silent (``silent``)
STOPPED = "stopped"        # the rank stops because of another's problem: never evidence
ABORT_KINDS = (ERROR, TIMEOUT, TERMINATED, LOST, STOPPED)
WOKEN = "aborted: see abort/listed"  # never a flag, a run id or a count


def of(prefix: str, rank: int | str) -> str:
    """A per-rank key: ``prefix/<rank>``."""
    return f"{prefix}/{rank}"


def every(prefix: str) -> str:
    """The flag that every rank has posted ``prefix/<rank>``: ``prefix/all``."""
    return f"{prefix}/all"


def listed(prefix: str) -> str:
    """The list each rank appends ``"<rank>,"`` to: ``prefix/listed``."""
    return f"{prefix}/listed"


def stage(check: str, iteration: int) -> str:
    """A check's stage key: ``<check>/<iteration>``."""
    return f"{check}/{iteration}"
