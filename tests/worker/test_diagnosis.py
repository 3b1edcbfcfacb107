"""Diagnosis under real faults on one machine: the exact culprit set, every time.

Each failure is produced for real on a real torchrun launch of 4 ranks (signals to worker
processes found under the agent, a rank stalled inside the bandwidth sweep), watched through
the ranks' own heartbeats in the store, and repeated to catch races. The report must name
exactly the faulty rank (or nobody, for the launcher stopping the whole job), list the others
as victims, and keep what was measured; the run must end by itself.
"""
from __future__ import annotations

import os
import signal
import time

import pytest

from tests.launch import REPEAT, Spawned

# A long compute phase (every rank alike, no collective in it) to strike in the middle of.
LONG_COMPUTE = ("--checks", "environment,compute", "--timeout", "30")


def _long_compute_config(tmp_path) -> str:
    path = tmp_path / "long-compute.yaml"
    path.write_text("compute:\n  blocks: 400\n  block_s: 0.1\n")
    return str(path)


def _in_compute(beats) -> bool:
    return all(b["stage"] == "compute" for b in beats)


def _culprits(report: dict, check: str) -> list:
    return next(c for c in report["checks"] if c["name"] == check)["culprits"]


def _victims(report: dict, check: str) -> list[int]:
    figures = next(c for c in report["checks"] if c["name"] == check)["figures"]
    return sorted(v["rank"] for v in figures["victims"])


def _finish_failed(run: Spawned, struck_at: float, what: str):
    """Wait for the launch to end by itself; it failed and left a report. Prints the time
    from the fault to the report on disk (for the notes; never asserted)."""
    done = run.finish()
    assert done.returncode != 0
    assert done.report is not None, done.stderr[-3000:]
    took = os.path.getmtime(done.report_dir / "report.json") - struck_at
    print(f"\n{what}: fault to report {took:.1f} s, launch total {done.wall_s:.1f} s")
    return done


def _spawn_long_compute(tmp_path):
    run = Spawned(4, *LONG_COMPUTE, "--config", _long_compute_config(tmp_path),
                  report_dir=tmp_path / "report", env={"OMP_NUM_THREADS": "1"})
    run.wait_until(_in_compute)
    return run


@pytest.mark.timeout(240)
@pytest.mark.parametrize("attempt", range(REPEAT))
def test_one_terminated_rank_is_the_culprit_not_the_ranks_it_stopped(tmp_path, attempt):
    run = _spawn_long_compute(tmp_path)
    os.kill(run.worker_pid(2), signal.SIGTERM)  # a node reclaimed, a container stopped
    done = _finish_failed(run, time.time(), "SIGTERM to rank 2 of 4")
    report = done.report
    culprits = _culprits(report, "compute")
    assert [c["rank"] for c in culprits] == [2], culprits
    assert culprits[0]["reason"] == "terminated by SIGTERM during compute"
    assert _victims(report, "compute") == [0, 1, 3]
    assert "within" not in " ".join(v["state"] for v in
                                    next(c for c in report["checks"]
                                         if c["name"] == "compute")["figures"]["victims"])
    assert report["checks"][0]["status"] == "pass"  # environment's result is kept


@pytest.mark.timeout(240)
@pytest.mark.parametrize("attempt", range(REPEAT))
def test_whole_job_terminated_names_the_launcher(tmp_path, attempt):
    run = _spawn_long_compute(tmp_path)
    run.proc.send_signal(signal.SIGTERM)  # scancel, a time limit, a pod deleted: to the agent
    done = _finish_failed(run, time.time(), "SIGTERM to the whole job")
    report = done.report
    culprits = _culprits(report, "compute")
    assert [(c["rank"], c["host"]) for c in culprits] == [(None, None)], culprits
    assert culprits[0]["reason"].startswith("terminated by the launcher (SIGTERM to all ranks)")
    assert report["verdict"] == "fail"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("attempt", range(REPEAT))
def test_rank_0_killed_mid_check_is_named_by_the_lowest_survivor(tmp_path, attempt):
    run = _spawn_long_compute(tmp_path)
    os.kill(run.worker_pid(0), signal.SIGKILL)  # an OOM kill of rank 0
    done = _finish_failed(run, time.time(), "SIGKILL to rank 0")
    report = done.report
    culprits = _culprits(report, "compute")
    assert [c["rank"] for c in culprits] == [0], culprits
    assert "no heartbeat" in culprits[0]["reason"]
    # Rank 1 wrote it: its forensics are in, rank 0's (dead) are not.
    assert 0 not in {f["rank"] for f in report["forensics"]}
    assert "no rank wrote" not in done.stderr


@pytest.mark.timeout(240)
@pytest.mark.parametrize("attempt", range(REPEAT))
def test_rank_stalled_inside_the_sweep_is_the_only_culprit(tmp_path, attempt):
    # The others wait in the next collective of the sweep; rank 1 sleeps between two.
    run = Spawned(4, "--checks", "environment,bandwidth", "--timeout", "10",
                  "--fault", "1:slow=1000@bandwidth", report_dir=tmp_path / "report",
                  env={"OMP_NUM_THREADS": "1"})
    run.wait_until(lambda beats: all(b["stage"] == "bandwidth" for b in beats))
    # the stall comes within the first sizes of the sweep
    done = _finish_failed(run, time.time(), "rank 1 stalled between collectives (timeout 10 s)")
    report = done.report
    culprits = _culprits(report, "bandwidth")
    assert [c["rank"] for c in culprits] == [1], culprits
    assert culprits[0]["reason"].startswith("never entered collective #")
    assert "bandwidth.py" in (culprits[0]["where"] or ""), culprits[0]
    assert _victims(report, "bandwidth") == [0, 2, 3]
    stacks = {f["rank"]: f.get("stacks") for f in report["forensics"]}
    assert sorted(stacks) == [0, 1, 2, 3]
    assert "bandwidth.py" in open(stacks[1]).read()
    flight = {f["rank"]: f.get("flight_recorder") for f in report["forensics"]}
    assert all(flight.values()) and "gloo:" in open(flight[0]).read()
    assert "culprit: rank 1" in done.stdout and "[in " in done.stdout
    # 10 s of waiting on 4 ranks: no store-wait timeout warnings from c10d in the output
    assert "waitForInput" not in done.stderr


@pytest.mark.timeout(240)
@pytest.mark.parametrize("attempt", range(2))
def test_rank_frozen_before_arriving_is_named_from_its_heartbeat(tmp_path, attempt):
    # Rank 2 holds back before compute, then freezes (SIGSTOP: a node wedged in the kernel,
    # a paused container) while the others wait at compute's arrival: the launcher sees
    # nothing wrong. Rank 0's watchdog names it from its heartbeat, long before the 60 s
    # deadline: the first abort is rank 0's "lost", not a timeout.
    run = Spawned(4, "--checks", "environment,compute", "--timeout", "60", "--fault",
                  "2:hang@compute", report_dir=tmp_path / "report",
                  env={"OMP_NUM_THREADS": "1"})
    run.wait_until(_in_compute)
    pid = run.worker_pid(2)
    os.kill(pid, signal.SIGSTOP)
    frozen_at = time.time()
    report = run.report_dir / "report.json"
    for _ in range(300):  # the report is written while rank 2 is still frozen
        if report.exists():
            break
        time.sleep(0.1)
    assert report.exists(), "no report 30 s after the freeze"
    # The node wakes up: the SIGTERM torchrun sent it meanwhile is delivered now, and the
    # launch ends by itself (frozen, it would end only at torchrun's SIGKILL, 30 s later).
    os.kill(pid, signal.SIGCONT)
    done = _finish_failed(run, frozen_at, "rank 2 frozen before arriving")
    report = done.report
    culprits = _culprits(report, "compute")
    assert [c["rank"] for c in culprits] == [2], culprits
    assert "no heartbeat" in culprits[0]["reason"], culprits[0]
    aborts = next(c for c in report["checks"] if c["name"] == "compute")["figures"]["aborts"]
    assert (aborts[0]["rank"], aborts[0]["kind"], aborts[0]["silent"]) == (0, "lost", [2])
    # the others sat in the store's blocking wait until the abort: not one wait timed out
    assert "waitForInput" not in done.stderr
    assert _victims(report, "compute") == [0, 1, 3]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("attempt", range(2))
def test_rank_0_paused_while_the_others_wait_is_still_a_pass(tmp_path, attempt):
    # Rank 0's heartbeat stops for 3 s (a GC pause, a slow disk, a stopped process) while
    # the others have finished and wait for the verdict: a passing run exits 0 everywhere.
    (tmp_path / "cfg.yaml").write_text("compute:\n  blocks: 30\n  block_s: 0.1\n")
    run = Spawned(4, "--checks", "environment,compute", "--timeout", "60", "--config",
                  str(tmp_path / "cfg.yaml"), report_dir=tmp_path / "report",
                  env={"OMP_NUM_THREADS": "1"})
    run.wait_until(_in_compute)
    pid = run.worker_pid(0)
    os.kill(pid, signal.SIGSTOP)  # one block of 30 paused: rank 0's median block does not move
    time.sleep(3)
    os.kill(pid, signal.SIGCONT)
    done = run.finish()
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    assert done.report["verdict"] == "pass"
