"""Launch the real worker the way users do, and read what it leaves behind."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests import report_schema

# How many times a fault test repeats where a race hides. In `make test` (the suite's
# 20-minute budget; the fault campaign adds breadth): twice for the faults that race the
# launcher (a rank killed, stalled or terminated: its end, the writer's look and torchrun's
# SIGTERMs come in either order; sigkill/sigsegv named right 6 times in 12 once), once for
# the faults held for the whole run (a link, node or rail cut or throttled, a CPU quota:
# 20-40 s a run between namespaces). Every one more before a release:
# `DDP_SMOKE_TEST_REPEAT=5 make test`.
_ASKED = os.environ.get("DDP_SMOKE_TEST_REPEAT")
REPEAT = int(_ASKED or 2)
HELD_REPEAT = int(_ASKED or 1)

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parent.parent


@dataclass
class Run:
    """A finished launch: exit status, output, wall time and rank 0's report (if written)."""

    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    report_dir: Path

    @property
    def report(self) -> dict | None:
        path = self.report_dir / "report.json"
        return report_schema.read(path) if path.exists() else None

    def check(self, name: str) -> dict:
        return next(c for c in self.report["checks"] if c["name"] == name)

    def why(self) -> str:
        """What a failed assertion should show: the exit, each check's word and culprits, and
        the output's tail (a flake in CI is read from this alone)."""
        lines = [f"exit {self.returncode} after {self.wall_s:.1f} s"]
        for c in (self.report or {}).get("checks", []):
            lines.append(f"{c['name']}: {c['status']}: {c['summary'][:300]}")
            lines += [f"  culprit rank {k.get('rank')}: {k['reason'][:300]}"
                      for k in c.get("culprits", [])]
        return "\n".join(lines + ["stdout:", self.stdout[-2000:], "stderr:",
                                   self.stderr[-2000:]])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, *args: str, report_dir: Path, timeout_s: float = 120,
             env: dict | None = None, launcher: tuple[str, ...] = ()) -> Run:
    """``torchrun --standalone --nproc-per-node=N [LAUNCHER] -m ddp_smoke ARGS --report-dir
    DIR``."""
    cmd = [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={nproc}", *launcher,
           "-m", "ddp_smoke", "--report-dir", str(report_dir), *args]
    return _run(cmd, report_dir, timeout_s, env)


def smoke_local(nproc: int, *args: str, report_dir: Path, timeout_s: float = 120,
                env: dict | None = None, oversubscribe: bool = False) -> Run:
    """``make smoke-local``'s launcher: torchrun's agent in-process, the ranks forked with the
    worker imported (one torch import for the whole run, not one per rank)."""
    cmd = [sys.executable, "-m", "ddp_smoke.launch_local", f"--nproc-per-node={nproc}",
           *(["--oversubscribe"] if oversubscribe else []), "--",
           "--report-dir", str(report_dir), *args]
    return _run(cmd, report_dir, timeout_s, env)


def single(*args: str, report_dir: Path, timeout_s: float = 60, env: dict | None = None) -> Run:
    """One process with the plain env contract (as submitit exports it), no torchrun agent."""
    contract = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    cmd = [sys.executable, "-m", "ddp_smoke", "--report-dir", str(report_dir), *args]
    return _run(cmd, report_dir, timeout_s, {**contract, **(env or {})})


def _run(cmd, report_dir, timeout_s, env) -> Run:
    t = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=REPO,
                       env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)
    return Run(p.returncode, p.stdout, p.stderr, time.monotonic() - t, Path(report_dir))


class Spawned:
    """A torchrun launch in the background whose ranks a test can watch and signal.

    Static rendezvous on a chosen port (``--master-port``): the agent hosts the store there,
    so the test reads each rank's heartbeat (stage, collective progress) like rank 0 does.
    """

    def __init__(self, nproc: int, *args: str, report_dir: Path, env: dict | None = None):
        self.port, self.report_dir, self.nproc = free_port(), Path(report_dir), nproc
        cmd = [str(BIN / "torchrun"), "--nnodes=1", f"--nproc-per-node={nproc}",
               "--master-addr=127.0.0.1", f"--master-port={self.port}",
               "-m", "ddp_smoke", "--report-dir", str(report_dir), *args]
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **(env or {})},
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self._store = None

    def wait_until(self, predicate, timeout_s: float = 90) -> None:
        """Poll ``predicate(beats)`` (every rank's heartbeat) until true."""
        if self._store is None:
            self._store = Heartbeats("127.0.0.1", self.port, self.nproc)
        self._store.wait_until(predicate, timeout_s, self.proc)

    def worker_pid(self, rank: int) -> int:
        """PID of the worker process of ``rank`` (a child of the torchrun agent)."""
        for child in Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split():
            try:
                env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in env:
                return int(child)
        raise AssertionError(f"no worker of rank {rank} under agent {self.proc.pid}")

    def finish(self, timeout_s: float = 120) -> Run:
        """Wait for the launch to end by itself; the run as :class:`Run`."""
        try:
            out, err = self.proc.communicate(timeout=timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.communicate()
        return Run(self.proc.returncode, out, err, time.monotonic() - self.t0, self.report_dir)


def record_value(raw: bytes) -> bytes:
    """A store record's value. The kit signs its records (``value.`` + an 8-hex fingerprint
    and a 32-hex MAC, coordination/signing.py); an observer without the run's secret reads the
    value and cannot check it."""
    cut = len(raw) - 41
    return raw[:cut] if cut >= 0 and raw[cut:cut + 1] == b"." else raw


class Heartbeats:
    """Read the ranks' heartbeats (stage, collective progress) from the coordination store,
    as rank 0 does: how a test knows a run is mid-check before it strikes."""

    def __init__(self, addr: str, port: int, world_size: int):
        self.addr, self.port, self.world_size = addr, port, world_size
        self._store = None

    def _client(self):
        import datetime

        import torch.distributed as dist
        if self._store is None:
            self._store = dist.TCPStore(self.addr, self.port, is_master=False,
                                        timeout=datetime.timedelta(seconds=10),
                                        wait_for_workers=False)
        return self._store

    def beat(self, rank: int) -> dict | None:
        store, key = self._client(), f"ddp_smoke/0/beat/{rank}"
        if store.check([key]):
            return json.loads(record_value(store.get(key)))
        return self.node_beats().get(rank)  # a rank that beats through its node's speaker

    def node_beats(self) -> dict[int, dict]:
        """Every rank's beat in the node records (coordination/node.py), by rank."""
        listed, store = "ddp_smoke/0/nodebeat/listed", self._client()
        if not store.check([listed]):
            return {}
        raw = store.get(listed)  # signed: an item a line; unsigned: "0,1,"
        items = raw.split(b"\n") if b"\n" in raw else raw.split(b",")
        nodes = {int(i.split(b",")[0]) for i in items if i[:1].isdigit()}
        beats = {}
        for n in nodes:
            record = json.loads(record_value(store.get(f"ddp_smoke/0/nodebeat/{n}")))
            beats.update({int(r): b for r, b in record.items()})
        return beats

    def wait_until(self, predicate, timeout_s: float = 90, proc=None) -> list[dict]:
        """Poll ``predicate(beats)`` (every rank's last heartbeat) until true; return them."""
        end, beats = time.monotonic() + timeout_s, []
        while time.monotonic() < end:
            if proc is not None and proc.poll() is not None:
                raise AssertionError(f"launch ended early ({proc.returncode})")
            try:
                beats = [self.beat(r) for r in range(self.world_size)]
            except Exception:  # noqa: BLE001 — the store is not up yet
                self._store, beats = None, []
            if beats and all(beats) and predicate(beats):
                return beats
            time.sleep(0.1)
        raise AssertionError(f"condition not reached in {timeout_s} s: {beats}")


def paced(report: dict) -> set[str]:
    """The checks a report failed on pace alone: every culprit a rank the others waited for
    (coordination/stragglers.py). Printed when there are any. On this project's two shared
    cores a healthy run's ranks take turns with another test's (measured: a 2-pod job, rank 1
    named for 0.6 s of waits in 11 collectives; 16 ranks, rank 0 for 0.9 s): the tests of a
    launcher's plumbing take those for a pass; the tests of pace do not use this."""
    slow = {c["name"] for c in report["checks"] if c["status"] == "fail" and c["culprits"]
            and all(" waited for rank " in k["reason"] for k in c["culprits"])}
    if slow:
        print(f"\nfailed on pace alone, taken for a pass: "
              f"{[(c['name'], c['summary']) for c in report['checks'] if c['name'] in slow]}")
    return slow

