"""Repeat mode: real torchrun runs with a fault in some iterations only, and the fold itself."""
from __future__ import annotations

import pytest

from ddp_smoke.coordination import repeat
from ddp_smoke.model import FAIL, PASS, CheckResult, Culprit
from tests.launch import smoke_local


@pytest.mark.timeout(240)
def test_fault_in_some_iterations_is_flagged_intermittent(tmp_path):
    run = smoke_local(2, "--checks", "environment,ddp_step,collectives", "--repeat", "4",
                      "--fault", "1:corrupt@collectives#2-3", report_dir=tmp_path)
    assert run.returncode != 0
    report = run.report
    assert report["timings"]["iterations"] == 4
    coll = run.check("collectives")
    assert coll["status"] == "fail"
    assert coll["summary"].startswith("intermittent: failed in 2 of 4 iterations")
    assert [c["rank"] for c in coll["culprits"]] == [1]
    assert coll["culprits"][0]["reason"].endswith("[intermittent: 2 of 4 iterations (2, 3)]")
    assert coll["figures"]["failed_iterations"] == [2, 3]
    assert coll["figures"]["failures_by_rank"] == {"1": 2}
    assert [i["status"] for i in coll["figures"]["iterations"]] == ["pass", "fail", "fail",
                                                                    "pass"]
    step = run.check("ddp_step")
    assert step["status"] == "pass", step["summary"]
    params = [i["figures"]["params"] for i in step["figures"]["iterations"]]
    assert len(params) == 4 and all(p == params[0] for p in params)  # bit-identical
    assert run.stdout.count("ddp_step_complete=True") == 1  # the tutorial lines, once


@pytest.mark.timeout(240)
def test_duration_keeps_starting_iterations_until_it_has_passed(tmp_path):
    run = smoke_local(2, "--checks", "environment,ddp_step", "--duration", "2",
                      report_dir=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.report["timings"]["iterations"] >= 2
    assert run.check("ddp_step")["summary"].startswith(
        f"passed in {run.report['timings']['iterations']} of")


def _sweep(busbw: float, status=PASS, culprits=()) -> CheckResult:
    rows = [{"collective": "all_reduce", "size_bytes": 1024, "busbw_gbps": busbw}]
    return CheckResult("bandwidth", status, summary="s", culprits=list(culprits),
                       figures={"results": rows})


def test_sweep_percentiles_and_spread_per_size():
    runs = [(i, _sweep(b)) for i, b in enumerate([1.0, 2.0, 3.0, 4.0])]
    [row] = repeat.merge("bandwidth", runs, ["a", "b"]).figures["busbw_by_size"]
    assert (row["busbw_gbps_p50"], row["busbw_gbps_p99"], row["runs"]) == (2.0, 4.0, 4)
    assert row["busbw_cv"] == pytest.approx(0.4472, abs=1e-4)


def test_culprit_in_every_iteration_is_not_intermittent():
    bad = Culprit(1, "b", "slow")
    runs = [(i, _sweep(1.0, FAIL, [bad])) for i in range(3)]
    merged = repeat.merge("bandwidth", runs, ["a", "b"])
    assert merged.summary.startswith("failed in all 3 iterations")
    assert merged.culprits[0].reason == "slow [in every iteration]"


def test_weights_that_drift_between_iterations_fail_ddp_step():
    def step(params):
        return CheckResult("ddp_step", PASS, summary="ok", figures={"params": params})
    runs = [(0, step([[1.0, 2.0], [1.0, 2.0]])), (1, step([[1.0, 2.0], [1.0, 2.5]]))]
    merged = repeat.merge("ddp_step", runs, ["a", "b"])
    assert merged.status == FAIL
    assert [(c.rank, c.host) for c in merged.culprits] == [(1, "b")]
    assert "not bit-identical" in merged.culprits[0].reason


def test_a_single_iteration_is_left_as_it_was():
    result = _sweep(1.0)
    assert repeat.combine([(0, result)], ["a"]) == [result]


@pytest.mark.parametrize("argv, words", [
    (["--repeat", "0"], "key 'repeat' = 0"),
    (["--duration", "-1"], "key 'duration' = -1.0"),
    (["--repeat", "3", "--duration", "5"], "give one, not both"),
    (["--fault", "1:corrupt@environment#3-2"], "iterations are 1-based"),
])
def test_bad_repeat_options_are_one_line_errors(argv, words):
    from ddp_smoke.config.args import parse_config
    from ddp_smoke.errors import ConfigError
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        parse_config(argv)


def test_the_printed_tables_are_labelled_with_their_iteration():
    """Issue 25: the tables were iteration 1's, unlabelled, under a summary saying "last"."""
    runs = [(i, CheckResult("compute", PASS, summary=f"run {i + 1}", notes=[f"# table {i + 1}"]))
            for i in range(3)]
    [result] = repeat.combine(runs, ["a"])
    assert result.summary == "passed in 3 of 3 iterations; iteration 3 (last): run 3"
    assert result.notes == ["# compute, iteration 3 of 3 (last; all in report.json)",
                            "# table 3"]
