"""torchrun on several namespace "nodes" at once, as a cluster launcher would run it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.sandbox.hosts import Host, HostSandbox, netns_pids

KILL_GRACE_S = 5  # what srun --kill-on-bad-exit leaves the others before SIGKILL


def torchrun_argv(host: Host, nnodes: int, nproc: int, endpoint: str, run_id: str,
                  rdzv_conf: str, worker: list[str], local_addr: str | None = None) -> list[str]:
    """The torchrun command line for one node (torch.distributed.run is torchrun's module)."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
            f"--nproc-per-node={nproc}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={run_id}", f"--local-addr={local_addr or host.addr}",
            f"--rdzv-conf={rdzv_conf}", "--max-restarts=0", "-m", "ddp_smoke", *worker]


def sh(*argv: str) -> None:
    """A short root command (tc, iptables, ip): it must succeed within 10 s."""
    subprocess.run(list(argv), check=True, capture_output=True, timeout=10)


def in_host(host: Host, *argv: str) -> None:
    """:func:`sh` inside a host's network namespace (a fault made there)."""
    sh("ip", "netns", "exec", host.netns, *argv)


def node_env() -> dict[str, str]:
    # One thread per rank: six ranks on two cores otherwise spend their time in contention.
    return {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1"}


class Nodes:
    """torchrun on several hosts; each node's output goes to a file under logs."""

    def __init__(self, sandbox: HostSandbox, logs: Path):
        self.sandbox, self.logs = sandbox, logs
        self.procs: dict[str, subprocess.Popen] = {}
        self.t0 = time.monotonic()

    def start(self, host: Host, argv: list[str]) -> None:
        """Starts argv on host, output to logs/<host>.log."""
        with open(self.logs / f"{host.name}.log", "wb") as out:
            self.procs[host.name] = self.sandbox.popen(host, argv, env=node_env(), stdout=out,
                                                       stderr=subprocess.STDOUT)

    def wait(self, timeout_s: float) -> dict[str, int]:
        """Waits for every node; once one fails, stops the rest (like srun --kill-on-bad-exit).

        Raises:
            AssertionError: when timeout_s passes first (a hang), with each node's log tail.
        """
        deadline, killed_at = self.t0 + timeout_s, None
        while time.monotonic() < deadline:
            codes = {n: p.poll() for n, p in self.procs.items()}
            if all(c is not None for c in codes.values()):
                return codes
            if killed_at is None and any(c not in (None, 0) for c in codes.values()):
                killed_at = time.monotonic()
                self._signal(signal.SIGTERM)
            elif killed_at and time.monotonic() - killed_at > KILL_GRACE_S:
                self._signal(signal.SIGKILL)
            time.sleep(0.1)
        self._signal(signal.SIGKILL)
        pytest.fail(f"nodes still running after {timeout_s} s (a hang):\n{self.tails()}")

    def _signal(self, sig: int) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, sig)  # our own session leader and its children, by PID

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def tails(self, lines: int = 25) -> str:
        return "\n".join(f"--- {n}\n" + "\n".join(self.log(n).splitlines()[-lines:])
                         for n in self.procs)


def store_of(host: Host) -> tuple[str, int]:
    """MASTER_ADDR/PORT of the run, read from the environment of a worker on ``host`` (the
    agent's store, on a port torchrun picks).

    Raises:
        LookupError: no worker there yet.
    """
    for pid in netns_pids(host.netns):
        try:
            env = dict(v.split("=", 1) for v in
                       Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in v)
        except OSError:
            continue
        if "RANK" in env and "MASTER_PORT" in env:
            return env["MASTER_ADDR"], int(env["MASTER_PORT"])
    raise LookupError("no worker yet")
