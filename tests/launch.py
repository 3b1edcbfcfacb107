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
        return json.loads(path.read_text()) if path.exists() else None

    def check(self, name: str) -> dict:
        return next(c for c in self.report["checks"] if c["name"] == name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, *args: str, report_dir: Path, timeout_s: float = 120,
             env: dict | None = None) -> Run:
    """``torchrun --standalone --nproc-per-node=N -m ddp_smoke ARGS --report-dir DIR``."""
    cmd = [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={nproc}",
           "-m", "ddp_smoke", "--report-dir", str(report_dir), *args]
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
