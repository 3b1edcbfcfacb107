"""bench/gpu_check.py on this CPU machine: a recorded node through the replay, a CPU torch,
and a Python that cannot see the installed package (``-S``: no site-packages, no editable
install) — the script must find its package, python and torchrun itself, count only SDC
culprits in its sdc step, and report the CUDA-only steps as skipped with the reason."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

from ddp_smoke.checks.health.readers import REPLAY_ENV

from tests.checks.health_replay import DATA

REPO = Path(__file__).parents[2]


def test_gpu_check_runs_bare_on_cpu_with_a_faulty_recorded_node(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = sysconfig.get_paths()["purelib"]  # torch, yaml, numpy: not ddp_smoke
    env[REPLAY_ENV] = str(DATA / "h200_faults_per_gpu.json")
    done = subprocess.run([sys.executable, "-S", str(REPO / "bench" / "gpu_check.py"), "--out",
                           str(tmp_path)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=400)
    rows = {r["step"]: r for r in json.loads((tmp_path / "summary.json").read_text())}
    assert done.returncode == 1, done.stdout + done.stderr  # one failed step: nvml
    assert [(s, rows[s]["status"]) for s in rows] == [
        ("deps", "PASS"), ("nvml", "FAIL"), ("health", "SKIP"), ("sdc", "PASS"),
        ("all", "SKIP"), ("training", "SKIP"), ("hang", "SKIP"), ("compute", "SKIP")]
    assert re.search(r"^8 GPU\(s\) read in 0\.\d+ s \(start \+ end readings\) \(replayed from",
                     rows["nvml"]["result"])
    assert "8 failure(s)" in rows["nvml"]["result"]
    assert rows["sdc"]["result"] == "SDC culprits [1] (want [1])"  # the node's 8 not counted
    assert all(rows[s]["result"] == "needs CUDA: torch.cuda.is_available() is False here"
               for s in ("health", "all", "training", "hang", "compute"))
    assert "  nvml     FAIL" in done.stdout and "gpu-check: 2 pass, 1 fail, 5 skip" in done.stdout
    findings = json.loads((tmp_path / "nvml.json").read_text())["findings"]
    assert sorted(f["gpu"]["index"] for f in findings if f["level"] == "fail") == list(range(8))
