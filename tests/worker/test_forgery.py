"""Nobody outside the run writes its verdict (issue 27): real torchrun runs of three ranks with a
second process (tests/forger.py) that connects to the run's store and forges records in the
ranks' names. No culprit is taken from them, and the report carries a security finding for
each kind read. Ranks of another secret or build stop at once with a one-line error.

--act slurm-drain with a forger beside a real Slurm job: tests/launchers/test_hosts_slurm.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from .. import launch
from ..forger import Forger, abort

BASE = ["--backend", "gloo", "--checks", "environment,compute"]
ENV = {"OMP_NUM_THREADS": "1"}


def _static(port: int, nproc: int, args: list[str], report_dir: Path, nnodes: int = 1,
            node_rank: int = 0, env: dict | None = None) -> subprocess.Popen:
    """torchrun with a static rendezvous on a port the test (and so the forger) knows."""
    cmd = [str(launch.BIN / "torchrun"), f"--nnodes={nnodes}", f"--node-rank={node_rank}",
           f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1", f"--master-port={port}",
           "-m", "ddp_smoke", "--report-dir", str(report_dir), *args]
    environ = {k: v for k, v in os.environ.items() if k != "DDP_SMOKE_SECRET"}
    return subprocess.Popen(cmd, cwd=launch.REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL,
                            env={**environ, **ENV, **(env or {})})


def _forged_run(tmp_path: Path, args: list[str], plan, beats=None, timeout_s: float = 150):
    port = launch.free_port()
    forger = Forger("127.0.0.1", port, plan, beats)
    forger.start()
    t = time.monotonic()
    proc = _static(port, 3, BASE + args, tmp_path)
    out = proc.communicate(timeout=timeout_s)[0]
    forger.stop.set()
    forger.join(5)
    report_file = tmp_path / "report.json"
    assert report_file.exists(), out[-4000:]
    report = json.loads(report_file.read_text())
    print(f"\n{time.monotonic() - t:.1f} s; forged {forger.done}; security "
          f"{json.dumps(report['security'])[:1500]}")
    assert forger.error is None and forger.done, (forger.error, out[-3000:])
    return proc.returncode, out, report


def _culprit_ranks(report) -> set:
    return {r for c in report["checks"] for k in c["culprits"]
            for r in [k.get("rank"), *(k.get("ranks") or [])] if r is not None}


def _found(report) -> dict[str, set]:
    """key -> the ranks the findings say the record claimed to be from."""
    out: dict[str, set] = {}
    for f in report["security"]["findings"]:
        out.setdefault(f["key"], set()).add(f["rank"])
    return out


@pytest.mark.timeout(200)
def test_forged_abort_arrival_observation_and_heartbeats_name_no_one(tmp_path):
    """Rank 1 hangs before it arrives at compute (the genuine culprit). The forger posts, in
    the ranks' names: rank 2 "terminated by SIGTERM" (the issue's report), rank 1's arrival and
    observation at compute (which would clear it), and heartbeats for ranks 1 and 2."""
    plan = abort(2, "compute") + [
        (None, "arrive/compute/0/1", "1", "set"),
        (None, "obs/compute/0/1", {"ok": True, "data": {}, "duration_s": 0.1}, "set")]
    beats = {r: {"t": time.time(), "stage": "compute", "rank": r} for r in (1, 2)}
    rc, out, report = _forged_run(tmp_path, ["--timeout", "12", "--fault", "1:hang@compute"],
                                  plan, beats)
    assert rc != 0 and report["verdict"] == "fail"
    stopped = next(c for c in report["checks"] if c["status"] == "fail")
    assert [k["rank"] for k in stopped["culprits"]] == [1], stopped
    assert _culprit_ranks(report) == {1}
    figures = stopped["figures"]
    assert 1 not in figures["arrived"] and 1 not in figures["finished"], figures
    assert all(a["rank"] != 2 for a in figures["aborts"]), figures["aborts"]
    found = _found(report)
    assert report["security"]["signed"] is True
    assert found.get("abort/listed") == {2}, found
    assert found.get("arrive/compute/0/1") == {1}, found
    assert found.get("obs/compute/0/1") == {1}, found
    assert {"beat/1", "beat/2"} & set(found), found
    assert "SECURITY: a record for rank 2 under abort/listed was not written by this run" in out


@pytest.mark.timeout(200)
def test_a_forged_result_is_not_taken_over_by_the_survivor_that_writes(tmp_path):
    """Rank 0 dies at compute; rank 1 writes the report from the results rank 0 left in the
    store, one of which the forger replaced with a failure naming rank 2."""
    forged = {"name": "environment", "status": "fail", "summary": "forged",
              "culprits": [{"rank": 2, "host": "x", "reason": "forged: torch differs"}],
              "figures": {}, "notes": [], "duration_s": 0.1}
    plan = [("result/environment/0", "result/environment/0", forged, "set")] + abort(2, "compute")
    rc, out, report = _forged_run(tmp_path, ["--timeout", "20", "--fault", "0:crash@compute"],
                                  plan)
    assert rc != 0 and report["verdict"] == "fail"
    assert _culprit_ranks(report) == {0}, report["checks"]
    # The forged result reads as absent, as if rank 0 died before judging environment: the
    # run stops there, with rank 0 named; nothing of the forgery is in it.
    env = next(c for c in report["checks"] if c["name"] == "environment")
    assert env["summary"] != "forged" and "forged" not in json.dumps(env["culprits"]), env
    found = _found(report)
    assert found.get("result/environment/0") == {0}, found
    assert found.get("abort/listed") == {2}, found


@pytest.mark.timeout(120)
@pytest.mark.parametrize("second", ["another secret", "no secret"])
def test_ranks_of_another_secret_stop_at_once_with_one_line(tmp_path, second):
    """Two "nodes" (two torchrun agents, one rank each): the second with another secret, or
    with none (a build or launcher that does not sign). Both ranks say so and stop: exit 2,
    no wait for records that can never be accepted."""
    port = launch.free_port()
    env = [{"DDP_SMOKE_SECRET": "ab" * 32},
           {"DDP_SMOKE_SECRET": "cd" * 32} if second == "another secret" else {}]
    t = time.monotonic()
    procs = [_static(port, 1, BASE + ["--timeout", "60"], tmp_path / f"n{i}", nnodes=2,
                     node_rank=i, env=env[i]) for i in range(2)]
    outs = [p.communicate(timeout=100)[0] for p in procs]
    took = time.monotonic() - t
    print(f"\n{second}: both agents out in {took:.1f} s")
    assert all(p.returncode != 0 for p in procs), outs
    both = "\n".join(outs)
    errors = [line for line in both.splitlines() if "ddp-smoke: error:" in line]
    assert errors, both[-3000:]
    if second == "another secret":
        assert "rank 1's records are signed with another secret" in both, both[-3000:]
    else:
        assert ("rank 1's records are not signed" in both
                or "rank 0's records are signed, and this rank has no secret" in both), \
            both[-3000:]
    assert "ab" * 32 not in both and "cd" * 32 not in both
    assert took < 45, took  # the store timeout (60 s) was not waited out
