"""Injected faults in real processes: fail fast, name the culprit, always leave a report.

Each run uses a 10 s timeout; the worker must end within timeout + 10 s of its start (the
report's total_s) and the launch as a whole within a generous bound for a loaded machine.
"""
import pytest

from tests.launch import torchrun

TIMEOUT_S = 10
CHECKS = ("--checks", "environment,ddp_step", "--timeout", str(TIMEOUT_S))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("nproc, fault, reason", [
    (2, "1:raise@ddp_step", "raised RuntimeError: injected fault"),
    (2, "1:crash@ddp_step", "died"),
    # (2, "1:hang@ddp_step"): tests/worker/test_progress_lines.py, read as it runs
    (2, "0:hang@ddp_step", "did not arrive at ddp_step"),
    (2, "1:corrupt@ddp_step", "post-step weights differ"),
    (4, "2:crash@environment", "died"),
    (4, "3:hang@environment", "did not arrive at environment"),
])
def test_fault_names_its_rank_and_the_report_is_written(tmp_path, nproc, fault, reason):
    run = torchrun(nproc, *CHECKS, "--fault", fault, report_dir=tmp_path)
    rank, check = int(fault.split(":")[0]), fault.split("@")[1]
    assert run.returncode != 0
    report = run.report
    assert report is not None, run.stderr[-3000:]
    assert report["verdict"] == "fail"
    failed = run.check(check)
    assert failed["status"] == "fail"
    assert [c["rank"] for c in failed["culprits"]] == [rank], failed["culprits"]
    assert reason in failed["culprits"][0]["reason"]
    assert failed["culprits"][0]["host"] == report["ranks"][rank]["host"]
    assert report["timings"]["total_s"] < TIMEOUT_S + 10
    assert run.wall_s < TIMEOUT_S + 60, run.wall_s  # start-up on a loaded 2-core machine included
    assert "culprit: rank %d" % rank in run.stdout
    later = [c for c in report["checks"] if c["name"] not in ("environment", check)]
    assert all(c["status"] == "skip" for c in later if check == "environment")


@pytest.mark.timeout(180)
def test_rank_0_death_is_reported_by_the_survivor(tmp_path):
    run = torchrun(2, *CHECKS, "--fault", "0:crash@ddp_step", report_dir=tmp_path)
    assert run.returncode != 0
    report = run.report
    assert report is not None, run.stderr[-3000:]  # rank 1 wrote it: the store is the agent's
    failed = run.check("ddp_step")
    assert [c["rank"] for c in failed["culprits"]] == [0], failed["culprits"]
    assert "no heartbeat" in failed["culprits"][0]["reason"]
    assert [v["rank"] for v in failed["figures"]["victims"]] == [1]
    assert run.check("environment")["status"] == "pass"  # rank 0's judged result survives
