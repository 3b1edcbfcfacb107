"""Bad input found before any rank waits for another: what every rank checks (and the local
launcher checks once, before it starts any) on the flags, the world size, the machine and the
report folder. Each raises ConfigError (one line, exit 2). Nothing here imports torch.
"""
from __future__ import annotations

import errno
import fcntl
import os
from typing import Any

from ..errors import ConfigError
from . import profiles
from .faults import parse_faults

LOCK_NAME = ".ddp-smoke.lock"
_held: list = []  # the open lock file: held until this process exits, whichever way


def check_run(cfg: dict[str, Any], world_size: int | None) -> None:
    """What depends on the world size (None: not known yet, the ranks check it), and whether
    the profile fits the machine."""
    faults = parse_faults(cfg["fault"], cfg["checks"])
    if world_size is not None and any(f.rank >= world_size for f in faults):
        raise ConfigError(f"key 'fault' = {cfg['fault']!r}: rank out of range for "
                          f"WORLD_SIZE={world_size}")
    check_machine(cfg)


def has_nvidia_gpu() -> bool:
    """An NVIDIA GPU on this machine, as its driver shows it (whether CUDA works is the checks'
    question: a GPU node whose CUDA is broken is a bad host, not the wrong profile)."""
    return os.path.exists("/proc/driver/nvidia") or os.path.exists("/dev/nvidiactl")


def check_machine(cfg: dict[str, Any], gpu_present: bool | None = None) -> None:
    """A GPU profile on a run that has no GPUs is the wrong profile for this machine, said as
    such: not a compute failure that marks the host bad and prints drain lines."""
    if not cfg["profile"]:
        return
    want = profiles.load(cfg["profile"]).get("device_name")
    if not want:
        return
    present = has_nvidia_gpu() if gpu_present is None else gpu_present
    why = ("--backend gloo runs the checks on CPUs" if cfg["backend"] == "gloo" else
           None if present else "this machine has no NVIDIA GPU")
    if why:
        raise ConfigError(f"--profile {cfg['profile']} does not fit this run: it is for "
                          f"{want} GPUs and {why}; use --profile cpu (figures only), or run "
                          "it on the GPU nodes")


def hold(path: str, run_id: str, keep: bool = True) -> None:
    """Claim the report folder for this run: an flock on ``.ddp-smoke.lock``, which the kernel
    releases when the process ends however it ends (no stale lock after a crash). A folder
    another live run holds is refused: two runs in one folder lose one report. ``keep=False``
    only tests the claim (the local launcher, before it starts the ranks)."""
    lock = os.path.join(path, LOCK_NAME)
    try:
        f = open(lock, "a+")
    except OSError as e:
        raise ConfigError(f"--report-dir {path}: cannot create {LOCK_NAME} ({e.strerror})") \
            from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        f.seek(0)
        holder = f.read().strip() or "another run"
        f.close()
        if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
            raise ConfigError(f"--report-dir {path}: in use by run {holder}; give each run "
                              "its own folder (the default reports/<run id> is)") from None
        return  # a filesystem without flock (some NFS set-ups): no claim, as before
    if not keep:
        f.close()
        return
    f.truncate(0)
    f.write(f"{run_id} (pid {os.getpid()} on {os.uname().nodename})\n")
    f.flush()
    _held.append(f)
