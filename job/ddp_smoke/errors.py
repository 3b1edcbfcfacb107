"""The kit's own errors: the bottom of the package, importing nothing of it.

Every layer raises these; the CLI and the launchers turn :class:`ConfigError` into one line and
exit status 2, and the harness turns :class:`ReportWriteError` into the report on stderr.
"""
from __future__ import annotations

import errno
import os
import sys
import time


class ConfigError(ValueError):
    """Bad input: reported as one line, exit status 2."""


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


# A quiet rank's exit reaches torchrun's agent, which stops the node's ranks and prints its own
# lines: the quiet ranks wait this long first, so the speaking rank's line comes before them
# (under torchrun on a loaded node, the agent's lines came first).
QUIET_RANK_WAIT_S = 3.0


def say_once(line: str) -> None:
    """Bad flags or config are the same on every rank: only the first local rank of each node
    says so (one line per node, not one per rank), in one write, so no two lines run
    together; the node's other ranks wait up to QUIET_RANK_WAIT_S (torchrun stops them as
    soon as the first leaves)."""
    local = os.environ.get("LOCAL_RANK", "0")
    if local == "0" or not local.isdigit():
        os.write(2, (line.replace("\n", " ") + "\n").encode())
    else:
        time.sleep(QUIET_RANK_WAIT_S)


class LossyStream:
    """A text stream whose writes never raise: under ``torchrun --tee`` (the Slurm template)
    a rank's stdout and stderr are files in the report folder, and when that filesystem fills
    or turns read-only every print raised OSError — the rank died on its next line, torchrun's
    error file for it stayed empty, and torchrun's agent died parsing it. Lines are lost
    instead; the report itself has its own fallbacks (stderr, the store host)."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except OSError:
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError:
            pass

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def lossy_output() -> None:
    """sys.stdout and sys.stderr as :class:`LossyStream`, once."""
    if not isinstance(sys.stdout, LossyStream):
        sys.stdout = LossyStream(sys.stdout)
    if not isinstance(sys.stderr, LossyStream):
        sys.stderr = LossyStream(sys.stderr)
