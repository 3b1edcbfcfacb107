"""Files rank 0 writes: atomically, durably, with the user's umask."""
from __future__ import annotations

import os
import secrets

from ..errors import ReportWriteError


def write_atomic(path: str, data: str | bytes) -> None:
    """Write ``data`` (text or bytes) to ``path`` through a temp file in the same directory and a rename.

    Readers (a CI gate polling the report, a second rank) never see a half-written file. The
    file is fsynced before the rename and the directory after it, so a crash right after
    leaves the old file or the new one, never an empty one. The temp file is created with
    mode 0666, which the kernel masks with the user's umask (and default ACLs), like any file
    the user creates: a team that wants the report readable sets its umask so.

    Raises:
        ReportWriteError: for any OSError, naming the path.
    """
    directory = os.path.dirname(os.path.abspath(path))
    # The temp name must not end like the real one: node_exporter reads every *.prom in its
    # directory, a half-written .tmp-…x.prom included.
    tmp = os.path.join(directory, f".tmp-{os.path.basename(path)}.{secrets.token_hex(6)}")
    try:
        os.makedirs(directory, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o666)
        try:
            with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            remove(tmp)
            raise
        fsync_dir(directory)
    except OSError as e:
        raise ReportWriteError(path, e) from None


def fsync_dir(directory: str) -> None:
    """Make a rename or a new name in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: str) -> None:
    """Remove a file if it is there; a file that cannot be removed is left."""
    try:
        os.unlink(path)
    except OSError:
        pass


ROOM = ".ddp-smoke-room"  # in the report folder while the run goes on
ROOM_BYTES = 4 << 20      # a report, its junit.xml, plot and page, with room to spare


def hold_room(report_dir: str) -> bool:
    """Keep room for the report in its folder while the run goes on: a file of ROOM_BYTES,
    freed when the report finds the folder full (filled during the run: another job's
    checkpoints, logs; under the Slurm template the ranks' own output files are there too,
    so even the report put on stderr was cut). Best effort: a folder without that much room
    now keeps none (its report may still fit)."""
    path = os.path.join(report_dir, ROOM)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, ROOM_BYTES)
        finally:
            os.close(fd)
        return True
    except OSError:
        remove(path)
        return False


def free_room(report_dir: str) -> bool:
    """Free the room :func:`hold_room` kept; whether there was any."""
    try:
        os.unlink(os.path.join(report_dir, ROOM))
        return True
    except OSError:
        return False
