"""Fault injection, for checking that an operator's alerting path catches each failure.

Off by default. ``--fault RANK:KIND@CHECK`` (several separated by commas) makes rank RANK
misbehave at check CHECK; in repeat mode ``@CHECK#I`` or ``@CHECK#I-J`` limits it to those
iterations (1-based), to test that an intermittent fault is flagged as one:

  crash    the process dies at once (``os._exit(13)``), as after a segfault or an OOM kill;
           the others must name it from what they observe.
  raise    the check raises RuntimeError on that rank; the rank reports it before leaving.
  hang     the rank stops before arriving at the check and sleeps until it is killed.
  stall    the rank enters the check's first collective and its call never returns: its own
           count says inside, its backend never got the call (as a rank whose GPU kernel or
           communication thread hung); the others wait inside it. In training: the first
           training step, after the set-up's collectives.
  slow     the rank's timed loops run ``SLOWDOWN``× slower (compute, bandwidth); default 4.
           Written ``slow=2.5`` to choose the factor.
  corrupt  the rank's contribution to the check is wrong by one element (checks that
           exchange or compare data: ddp_step, collectives, storage, bandwidth …).
  sdc      silent data corruption: the rank's seeded matrix product (health) is off by one
           unit in the last place in one element, as a marginal GPU's would be; in training,
           one element of the first block's feed-forward product is off by 1.0 in every
           forward pass (one unit in the last place there is below a step's own rounding).
"""
from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import ConfigError

KINDS = ("crash", "raise", "hang", "stall", "slow", "corrupt", "sdc")
_SPEC = re.compile(r"^(\d+):(crash|raise|hang|stall|slow(?:=(\d+(?:\.\d+)?))?|corrupt|sdc)@([a-z_]+)"
                   r"(?:#(\d+)(?:-(\d+))?)?$")
MAX_SLOWDOWN = 1000.0  # beyond this a "slow" rank is a hung one: use hang
CRASH_EXIT_CODE = 13


@dataclass(frozen=True)
class Fault:
    """One injected fault."""

    rank: int
    kind: str
    check: str
    slowdown: float = 4.0
    iterations: tuple[int, int] | None = None  # first and last (1-based); None: every one


def parse_faults(spec: str | None, checks: list[str]) -> list[Fault]:
    """Parse ``RANK:KIND@CHECK[,…]``; the check must be one of those selected."""
    faults, seen = [], set()
    for part in (spec or "").split(","):
        if not part.strip():
            continue
        m = _SPEC.match(part.strip())
        if not m:
            raise ConfigError(f"key 'fault' = {part!r}: expected RANK:KIND@CHECK with KIND one "
                              f"of {', '.join(KINDS)} (e.g. 1:hang@collectives, 0:slow=3@compute)")
        rank, kind, factor, check, first, last = m.groups()
        if check not in checks:
            raise ConfigError(f"key 'fault' = {part!r}: check {check!r} is not among the "
                              f"selected checks ({', '.join(checks)})")
        slowdown = float(factor) if factor else 4.0
        if not 1 <= slowdown <= MAX_SLOWDOWN:
            raise ConfigError(f"key 'fault' = {part!r}: slow factor must be in 1..{MAX_SLOWDOWN:g}")
        if (int(rank), check) in seen:  # the injector keeps one fault per (rank, check)
            raise ConfigError(f"key 'fault' = {spec!r}: two faults for rank {int(rank)} at "
                              f"{check}; expected at most one per (rank, check)")
        seen.add((int(rank), check))
        iterations = None
        if first:
            iterations = (int(first), int(last or first))
            if not 1 <= iterations[0] <= iterations[1]:
                raise ConfigError(f"key 'fault' = {part!r}: iterations are 1-based, first <= "
                                  "last (e.g. #2 or #2-4)")
        faults.append(Fault(int(rank), kind.split("=")[0], check, slowdown, iterations))
    return faults


class Injector:
    """This rank's faults, consulted by the harness and by the checks' contribution points."""

    def __init__(self, faults: list[Fault], rank: int,
                 before_crash: Callable[[], None] = lambda: None):
        self._mine = {f.check: f for f in faults if f.rank == rank}
        self._before_crash = before_crash  # the kit's own empty files: a practice run leaves none
        self.check: str | None = None  # set by the harness as each check starts
        self.iteration = 0  # repeat mode: the pass over the checks (0-based), set likewise

    def _active(self, kind: str) -> Fault | None:
        fault = self._mine.get(self.check)
        if fault is None or fault.kind != kind:
            return None
        first, last = fault.iterations or (1, float("inf"))
        return fault if first <= self.iteration + 1 <= last else None

    def before_arrival(self) -> None:
        """``hang``: never arrive (the watchdog thread still beats and obeys the abort)."""
        if self._active("hang"):
            while True:
                time.sleep(3600)

    def at_start(self) -> None:
        """``crash`` and ``raise`` strike as the check's work begins, after arrival."""
        if self._active("crash"):
            self._before_crash()
            os._exit(CRASH_EXIT_CODE)
        if self._active("raise"):
            raise RuntimeError(f"injected fault: raise at check {self.check!r}")

    @property
    def stalling(self) -> bool:
        """``stall``: this rank's next collective in the current check never returns."""
        return self._active("stall") is not None

    @property
    def corrupting(self) -> bool:
        """True when this rank must make its contribution to the current check wrong."""
        return self._active("corrupt") is not None

    def corrupt(self, tensor):
        """Perturb one element of ``tensor`` in place when corrupting; return the tensor."""
        if self.corrupting and tensor.numel():
            tensor.view(-1)[0] += 1
        return tensor

    @property
    def sdc_active(self) -> bool:
        """``sdc``: this rank's products in the current check are silently off."""
        return self._active("sdc") is not None

    def perturb_product(self, tensor):
        """``sdc``: move one element of a product by one unit in the last place (in place)."""
        if self.sdc_active and tensor.numel():
            first = tensor.view(-1)[:1]
            first.copy_(first.nextafter(first + 1))
        return tensor

    def throttle(self, elapsed_s: float) -> None:
        """``slow``: stretch a timed section that took ``elapsed_s`` by the slowdown factor."""
        fault = self._active("slow")
        if fault:
            time.sleep(elapsed_s * (fault.slowdown - 1))
