"""How a rank leaves a run: the report's writer, the takeover when rank 0 is gone, the exit.

The writer is rank 0; when rank 0 is gone (its heartbeat stopped) the lowest surviving rank
takes over, from the results rank 0 posted to the store as it judged each check. When the
store itself is gone, each surviving rank prints one JSON line of what it knows on stderr.
Which thread calls what is in the package docstring of :mod:`ddp_smoke.coordination`.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Callable

from . import keys, lost, records, runtime
from .stopped_run import FORENSICS_WAIT_S, add_stopped_result_as_a_rank, first_error
from .store import (TAKEOVER_SILENCES, beat_of, look_period, next_waiting, posted, try_get,
                    wait_key)

FINAL_WAIT_S = 10.0    # how long a rank waits for the report after an abort, beyond judging
TAKE_OVER = "take over"  # what await_report returns to the rank that must write the report
# Two threads (the watchdog and the main thread) may find the store gone at once: one says it
# and exits the process; the other waits this long for that, then leaves without a word.
_GIVING_UP = threading.Lock()
GIVE_UP_WAIT_S = 10.0
_AT_LEAVE: list[Callable[[], None]] = []


def at_leave(fn: Callable[[], None]) -> None:
    """Run ``fn`` on every way out of the process (e.g. the storage check's own files)."""
    if fn not in _AT_LEAVE:
        _AT_LEAVE.append(fn)


def finalize(c, store, aborted: bool) -> str | None:
    """Write the report once; return the verdict the others read (``fail`` when the report
    was lost), or None when another thread of this process is writing it. Works on the run
    as it stood when this thread claimed the writing (:class:`.protocol.Run`), and on that
    alone: the main thread may still be inside a check."""
    if not c.claim_finish():
        return None
    run = c.run
    try:
        store.compare_set(keys.WRITER, "", str(run.env.rank))
    except Exception:  # noqa: BLE001 — the store is gone; write what this rank knows
        pass
    found, error = {}, None
    c.teller.clear()  # the terminal's status line, before the summary
    if aborted:
        c.teller.stopped(run.stage)
        run = run.with_results(store).with_identities(store)  # a survivor: rank 0's results
        stopped = run.stopped()
        live = add_stopped_result_as_a_rank(store, stopped, run.silence, run.env.rank)
        run = run.replace(judged=tuple(stopped.judged))
        # the report lists every live rank's forensics: the last ones may still come
        found = posted(store, keys.FORENSICS, live, FORENSICS_WAIT_S)
        error = first_error(store, stopped)
    run = run.replace(timings=run.timings + (("total_s", round(time.monotonic() - run.t0, 4)),))
    verdict = c.publish(run.with_identities(store), store, error, found)  # this thread's
    try:  # always, so that the other ranks leave now; a lost report is no pass
        store.set(keys.FINAL, verdict)
    except Exception:  # noqa: BLE001
        pass
    return verdict


def exit_aborted(c, store) -> None:
    """Leave an aborted run with status 1, from the main thread or the watchdog.

    Every live rank leaves its forensics first. The writer (rank 0, or the lowest survivor
    when rank 0 is gone) writes the report; it returns instead when the other thread of this
    process is writing it (that thread then owns the exit).
    """
    try:
        c.leave_forensics(store)
        if c.env.rank == 0 or await_report(c, store, FINAL_WAIT_S) == TAKE_OVER:
            if finalize(c, store, aborted=True) is not None:
                leave(None, code=1)
            return
    except Exception as e:  # noqa: BLE001 — the store went away while leaving
        give_up(c, e)
    # The writer's verdict line says it all, and must stay the output's last line: silent.
    leave(None, code=1)


def await_report(c, store, timeout_s: float) -> str | None:
    """Wait for the report's verdict; return it, or :data:`TAKE_OVER` when this rank must
    write the report itself.

    Rank 0 writes, and claims the ``writer`` key when it starts. A rank that has not claimed
    it and whose heartbeat stopped for TAKEOVER_SILENCES dead-after silences is gone: the
    lowest rank still waiting here claims it instead (one compare-and-set decides). A
    claimed writer is waited for as long as its heartbeat moves, then ``timeout_s`` more;
    after that this rank leaves with status 1, saying so.
    """
    me = c.env.rank
    store.set(keys.of(keys.WAITING, me), "1")  # alive and waiting: a candidate writer
    watch, seen, seen_at = 0, None, time.monotonic()
    end = seen_at + timeout_s
    takeover_s = TAKEOVER_SILENCES * c.silence.after_s
    # The verdict is seen within poll_max of being set; the writer's heartbeat is looked at
    # once a period: ~5 calls per period on each of up to 2 threads of every rank, within
    # the store's budget at any world size, and still a few looks per takeover_s.
    period = min(takeover_s / 3, look_period(c.env.world_size, 10))
    while time.monotonic() < end:
        if wait_key(store, keys.FINAL, period, c.poll_max):
            if store.add(keys.BYE, 1) == c.env.world_size - 1:
                store.set(keys.every(keys.BYE), "1")  # rank 0, if it hosts the store, may go
            return store.get(keys.FINAL).decode()
        writer = try_get(store, keys.WRITER)
        if writer is not None and int(writer) != watch:
            watch, seen = int(writer), None
        beat = (beat_of(store, watch) or {}).get("n")
        now = time.monotonic()
        if beat != seen:
            seen, seen_at, end = beat, now, max(end, now + timeout_s)
        elif now - seen_at > takeover_s and writer is None:
            watch = next_waiting(store, watch, c.env.world_size)
            seen, seen_at = None, now
            if watch == me:
                claimed = store.compare_set(keys.WRITER, "", str(me)).decode()
                if claimed == str(me):
                    return TAKE_OVER
                watch = int(claimed)
    leave(f"run aborted at {c.stage}, and no rank wrote the report within {timeout_s} s of "
          f"rank {watch}'s last heartbeat", code=1)
    return None


def give_up(c, e: BaseException) -> None:
    """The coordination store is gone (its host, rank 0 or the store host, or that node is
    lost), or leaving failed otherwise: say what this rank knows as one JSON line on stderr,
    and leave it as REPORT_DIR/lost/<rank>.json too, for the launcher to read
    (:mod:`ddp_smoke.coordination.lost`)."""
    if not _GIVING_UP.acquire(blocking=False):  # the other thread is saying it (CI: twice)
        time.sleep(GIVE_UP_WAIT_S)
        leave(None, code=1)
    run, store = c.run, c.env.store_address
    gone = isinstance(e, (RuntimeError, OSError))  # c10d's store errors are RuntimeErrors
    stage = run.stage
    record = records.Lost(ddp_smoke_rank=run.env.rank, run_id=run.env.run_id, stage=stage,
                          progress=c.progress(), error=f"{type(e).__name__}: {e}"[:300],
                          store=store, host=runtime.hostname(), world_size=run.env.world_size,
                          hosts=[r.get("host") for r in run.ranks] if run.ranks else None
                          ).to_dict()
    print(json.dumps(record), file=sys.stderr)
    if run.report_dir:
        lost.write(run.report_dir, run.env.rank, record)
    holder = "the store host" if c.env.store else "rank 0"
    leave(f"lost the coordination store at {store} during {stage} ({type(e).__name__}); "
          f"{holder} or its node is gone" if gone else
          f"could not finish the aborted run at {stage}: {type(e).__name__}: {e}", code=1)


def leave(message: str | None, code: int) -> None:
    """Exit now, from any thread, after flushing; the main thread may be stuck in C++.
    The :func:`at_leave` hooks run first, on every way out."""
    for fn in _AT_LEAVE:
        fn()
    if message:
        print(f"ddp-smoke rank {os.environ.get('RANK', '?')}: {message}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
