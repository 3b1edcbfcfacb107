"""What ``/proc/<pid>/stat`` says of a process: the one reader of that file (no torch here).

Its fields are read after the command name's closing parenthesis (a name may hold spaces and
parentheses); ``fields[0]`` is the file's field 3, the state letter (proc(5)).
"""
from __future__ import annotations

import os
import time

_PF_EXITING = 0x4  # field 9's flags (include/linux/sched.h): do_exit() has begun
_FLAGS, _STARTTIME = 6, 19  # fields 9 and 22, counted from field 3


def fields(stat: str) -> list[str] | None:
    """The fields of a ``/proc/<pid>/stat`` line from the state on; None if malformed."""
    try:
        return stat.rsplit(")", 1)[1].split() or None
    except IndexError:
        return None


def stat(pid: int | str) -> list[str] | None:
    """:func:`fields` of the process (``"self"``: this one); None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return fields(f.read())
    except OSError:
        return None


def state(got: list[str] | None) -> str | None:
    """The state letter (R, S, D, T, Z …), ``X`` when the flags hold PF_EXITING: a killed
    process stays "R" while the kernel frees its memory and closes its sockets (measured:
    9,288 looks at "R" over the exit of a 3 GB process after SIGKILL), and its peers see
    their connection reset in that time; None for no fields."""
    try:
        return "X" if int(got[_FLAGS]) & _PF_EXITING else got[0]
    except (TypeError, IndexError, ValueError):
        return None


def started(pid: int | str = "self") -> float:
    """When the process started, in epoch seconds; now where /proc cannot say."""
    got = stat(pid)
    try:
        with open("/proc/uptime") as f:
            up = float(f.read().split()[0])
        return time.time() - up + int(got[_STARTTIME]) / os.sysconf("SC_CLK_TCK")
    except (OSError, TypeError, IndexError, ValueError):
        return time.time()
