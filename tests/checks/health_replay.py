"""Reading a recorded node in this process: the real readers (NVML through the replay
binding, sysfs, procfs, /dev/kmsg from the recording's tree) and the real judging.

Shared by tests/checks/test_health*.py; no mock: a recording is a file the replay serves.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from ddp_smoke import config
from ddp_smoke.checks import health
from ddp_smoke.checks.health.finding import FAIL, Limits
from ddp_smoke.checks.health.readers import REPLAY_ENV, Node

DATA = Path(__file__).parents[1] / "data" / "health"
THRESHOLDS = config.defaults()["health"]


def recording(tmp_path: Path, base: str, patch: dict | None = None, **top) -> str:
    """A recording: ``base`` (a file in tests/data/health) with ``patch`` applied."""
    if not patch and not top:
        return str(DATA / f"{base}.json")
    path = tmp_path / f"{base}-{len(list(tmp_path.glob('*.json')))}.json"
    path.write_text(json.dumps({"source": [], "excerpt": [], "transcribed": "test patch",
                                "base": str(DATA / f"{base}.json"), "patch": patch or {},
                                **top}))
    return str(path)


def read(path: str, seconds: float = 0.15, period: float = 0.03, during=None,
         env: dict | None = None) -> dict:
    """One window of the node's readers on the recording at ``path``; ``during(root)`` runs
    inside the window (e.g. a counter rising in the recording's sysfs tree)."""
    node = Node(period, environ={REPLAY_ENV: path, **(env or {})})
    try:
        node.start()
        time.sleep(seconds / 2)
        if during:
            during(node.root)
        time.sleep(seconds / 2)
        return node.finish()
    finally:
        node.close()


def judged(reading: dict, expect: dict | None = None, gpu_run: bool = False,
           run_pids: tuple = (), **thresholds) -> list:
    lim = Limits({**THRESHOLDS, **thresholds}, expect or {}, gpu_run=gpu_run,
                 gpu_ranks=0, run_pids=run_pids)
    return health.judge_node(reading, lim)


def fails(findings: list) -> list[tuple]:
    """(GPU index or port or None, what) of every failure, in order."""
    return [(f.gpu.index if f.gpu else f.port, f.what) for f in findings if f.level == FAIL]


def level(findings: list, lvl: str) -> list[str]:
    return [f.line() for f in findings if f.level == lvl]
