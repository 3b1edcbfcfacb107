"""The kit's own errors: the bottom of the package, importing nothing of it.

Every layer raises these; the CLI and the launchers turn :class:`ConfigError` into one line and
exit status 2, and the harness turns :class:`ReportWriteError` into the report on stderr.
"""
from __future__ import annotations

import errno


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
