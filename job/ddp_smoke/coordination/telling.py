"""What rank 0 says while the run runs, on stderr: the report's summary (stdout) comes at the end.

A job log, a pod's log or a terminal would otherwise stay empty until the verdict, and an
operator watching a hung run cannot tell a slow check from a dead node (and kills it, losing
the report). Rank 0 says, as ``ddp-smoke: …`` lines:

- the join: the run id, how many ranks on how many nodes, the backend, the checks to come and
  where the report will be;
- each check as it is judged: its place, status, duration and one-line summary, as the
  summary's row will say it (a later iteration of ``--repeat`` has a line of its own);
- during a wait longer than :data:`EVERY_S`, every :data:`EVERY_S`, whom it waits for: the
  ranks whose key is missing, found by halving the key list with the store's ``check`` (a few
  calls for a few missing ranks, at any world size), :data:`NAMED` of them at most;
- the moment the run stopped, before the seconds spent judging who stopped it.

``progress``: ``plain`` says lines only (a file or a pipe: no control characters); ``auto``
is ``plain``, except that on a terminal the waiting lines are one status line rewritten in
place (the check, ranks arrived of the world, the time left), cleared before any other line;
``none`` says nothing.
"""
from __future__ import annotations

import os
import sys
import time

from . import keys
from .ending import at_leave

EVERY_S = 5.0  # the first waiting line after this long, then one this often
NAMED = 8      # missing ranks named on a waiting line; more are "and more"
COUNTED = 64   # missing ranks counted on a terminal's status line; beyond, "at most"


class Teller:
    """Rank 0's lines; silent on the other ranks and with ``progress: none``."""

    def __init__(self, cfg: dict, rank: int, stream=None):
        mode = cfg.get("progress", "auto") if rank == 0 else "none"
        self.stream = stream or sys.stderr
        self.on = mode != "none"
        self.in_place = mode == "auto" and _is_terminal(self.stream)
        self._said_at = 0.0      # when the last waiting line was said (monotonic)
        self._status = False     # a status line stands on the terminal now
        if self.in_place:
            at_leave(self.clear)

    def say(self, text: str) -> None:
        if self.on:
            self.clear()
            print(f"ddp-smoke: {text}", file=self.stream, flush=True)

    def clear(self) -> None:
        """Take the status line off the terminal (before any other output)."""
        if self._status:
            self._status = False
            self.stream.write("\r\033[K")
            self.stream.flush()

    def joined(self, run_id: str, ranks: list[dict], backend: str, checks: list[str],
               took_s: float, report_dir: str) -> None:
        nodes = len({r.get("host") for r in ranks if r})
        self.say(f"run {run_id}: {_many(len(ranks), 'rank')} on {_many(nodes, 'node')} joined "
                 f"in {took_s:.1f} s ({backend}); checks: {', '.join(checks)}; report "
                 f"{os.path.join(report_dir, 'report.json')} at the end")

    def judged(self, result, place: int, count: int, iteration: int | None) -> None:
        again = f" (iteration {iteration + 1})" if iteration is not None else ""
        self.say(f"[{place}/{count}] {result.name}{again} {result.status.upper()} in "
                 f"{result.duration_s or 0:.2f} s: {result.summary}")

    def stopped(self, stage: str) -> None:
        self.say(f"{stage}: the run stopped; finding who stopped it, then the report")

    def waiting(self, store, what: str, stage: str, prefix: str, world: int, since: float,
                deadline: float | None, ranks: tuple) -> None:
        """Rank 0, at a look during a wait for every rank's ``prefix/<rank>`` that began at
        ``since`` (monotonic): once every EVERY_S a line naming the ranks still missing; on
        a terminal, at every look, the status line."""
        now = time.monotonic()
        waited, left = now - since, None if deadline is None else max(0.0, deadline - now)
        if not self.on or waited < (1.0 if self.in_place else EVERY_S) or (
                not self.in_place and now - self._said_at < EVERY_S):
            return
        self._said_at = now
        wanted = [keys.of(prefix, r) for r in range(world)]
        missing = _missing(store, list(range(world)), wanted,
                           COUNTED + 1 if self.in_place else NAMED + 1)
        if not missing:
            return  # every rank posted meanwhile: the wait is over
        named = ", ".join(f"rank {r}" + (f" ({ranks[r]['host']})" if r < len(ranks) and
                                         ranks[r] and ranks[r].get("host") else "")
                          for r in missing[:NAMED])
        more = " and more" if len(missing) > NAMED else ""
        until = "" if left is None else f"; {left:.0f} s to the deadline"
        if not self.in_place:
            self.say(f"{stage}: waited {waited:.0f} s for {what}: {named}{more} "
                     f"{'has' if len(missing) == 1 else 'have'} not{until}")
            return
        arrived = world - len(missing)
        count = f"{'at most ' if len(missing) > COUNTED else ''}{arrived}/{world} in"
        text = (f"ddp-smoke: {stage}: {count} · {waited:.0f} s"
                f"{'' if left is None else f' · {left:.0f} s left'} · waiting for {named}{more}")
        width = _width(self.stream)
        self.stream.write("\r\033[K" + text[:width - 1])
        self.stream.flush()
        self._status = True


def _many(n: int, what: str) -> str:
    return f"{n} {what}{'s' * (n != 1)}"


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False


def _width(stream) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):
        return 80


def _missing(store, ranks: list[int], wanted: list[str], limit: int) -> list[int]:
    """The ranks among ``ranks`` whose key in ``wanted`` is absent, in order, ``limit`` at
    most: one ``check`` for a half where every key is present."""
    if not ranks or store.check([wanted[r] for r in ranks]):
        return []
    if len(ranks) == 1:
        return ranks
    half = len(ranks) // 2
    first = _missing(store, ranks[:half], wanted, limit)
    if len(first) >= limit:
        return first
    return first + _missing(store, ranks[half:], wanted, limit - len(first))
