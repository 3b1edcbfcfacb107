"""What the kernel says of processes: ``/proc/<pid>/stat``, the threads' ``schedstat``, and
the kernel log (``/dev/kmsg``); the one reader of each (no torch here).

The stat file's fields are read after the command name's closing parenthesis (a name may hold
spaces and parentheses); ``fields[0]`` is the file's field 3, the state letter (proc(5)).
"""
from __future__ import annotations

import errno
import os
import stat as _stat
import time

_PF_EXITING = 0x4  # field 9's flags (include/linux/sched.h): do_exit() has begun
_FLAGS, _STARTTIME = 6, 19  # fields 9 and 22, counted from field 3
KERNEL_LOG_MAX_BYTES = 4 << 20  # the kernel log's ring is a few MB at most


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


def cpu_wait_s(pid: int | str = "self") -> float | None:
    """Seconds the process's threads have spent runnable but waiting for a core, summed (each
    thread's ``schedstat`` run_delay): time the shared cores took, not the network. None where
    the kernel keeps no such count (no schedstat, no /proc)."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    total, read = 0, False
    for t in threads:
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                total += int(f.read().split()[1])
            read = True
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return total / 1e9 if read else None


def kernel_log(path: str = "/dev/kmsg", max_bytes: int = KERNEL_LOG_MAX_BYTES):
    """The kernel log's records, oldest first, each ``"<prio>,<seq>,<usec since boot>,
    <flags>;text"`` (Documentation/ABI/testing/dev-kmsg: one read, one record; a message's
    own newlines arrive escaped). A plain file (a replayed node's) holds one record a line,
    its dictionary lines starting with a space. Raises OSError at once when the log cannot be
    opened (no root or CAP_SYSLOG, no /dev/kmsg in a container): the caller says so."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    return _records(fd, max_bytes)


def _records(fd: int, max_bytes: int):
    try:
        if not _stat.S_ISCHR(os.fstat(fd).st_mode):
            with os.fdopen(os.dup(fd), errors="replace") as f:
                record = ""
                for line in f:
                    if not (line.startswith(" ") and record):
                        if record:
                            yield record
                        record = line.rstrip("\n")
                if record:
                    yield record
            return
        read = 0
        while read < max_bytes:
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:
                return  # the end of the log
            except OSError as e:
                if e.errno == errno.EPIPE:  # a record overwritten while we read: go on
                    continue
                raise
            if not record:
                return
            read += len(record)
            yield record.decode("utf-8", "replace")
    finally:
        os.close(fd)
