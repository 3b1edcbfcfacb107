"""Report model: verdict rules, atomic writes, JUnit XML, the human summary."""
import json
import os
import xml.etree.ElementTree as ET

from ddp_smoke.model import FAIL, PASS, SKIP, CheckResult, Culprit, Report
from ddp_smoke.outputs.report import to_junit, write_report
from ddp_smoke.outputs.summary import render


NAMES = ("environment", "ddp_step", "collectives")  # real names: the report must validate


def _report(*statuses, error=None):
    checks = [CheckResult(NAMES[i], s, summary=f"s{i}",
                          culprits=[Culprit(1, "node2", "slow")] if s == FAIL else [])
              for i, s in enumerate(statuses)]
    ranks = [{"rank": 0, "local_rank": 0, "host": "node1"},
             {"rank": 1, "local_rank": 0, "host": "node2"}]
    return Report("0", "2026-11-30T12:00:00+00:00", "gloo", 2, ranks, checks,
                  {"timeout": 9, "checks": []}, {"total_s": 1.0}, error, run_id="run-1",
                  written_by="rank 0")


def test_verdict_passes_only_when_every_check_passes_or_skips():
    assert _report(PASS, SKIP).verdict == PASS
    assert _report(PASS, FAIL).verdict == FAIL
    assert _report().verdict == FAIL  # nothing ran: nothing was proven
    assert _report(PASS, error={"type": "X"}).verdict == FAIL


def test_contract_keys_and_nodes(tmp_path):
    path = write_report(_report(PASS, FAIL), str(tmp_path))
    data = json.loads(open(path).read())
    for key in ("verdict", "world_size", "nodes", "backend", "ranks", "checks", "timings"):
        assert key in data
    assert data["nodes"] == 2 and data["verdict"] == "fail"
    assert data["checks"][1]["culprits"] == [{"rank": 1, "host": "node2", "reason": "slow",
                                              "ranks": None, "hosts": None, "where": None,
                                              "rail": None}]
    assert sorted(os.listdir(tmp_path)) == ["junit.xml", "report.json"]  # no temp files left


def test_junit_counts_failures_and_skips():
    root = ET.fromstring(to_junit(_report(PASS, FAIL, SKIP)))
    assert (root.get("tests"), root.get("failures"), root.get("skipped")) == ("3", "1", "1")
    assert "rank 1 host node2: slow" in root.find("testcase[@name='ddp_step']/failure").text


def test_summary_names_culprits_and_ends_with_the_verdict():
    text = render(_report(PASS, FAIL), "r/report.json")
    assert "culprit: rank 1 (node2): slow" in text
    assert text.splitlines()[-1].startswith("verdict: FAIL")


def test_a_practice_run_says_so_in_every_junit_failure_and_in_the_verdict_line():
    """Issue 35: a CI page shows a failure's message, not the suite's properties."""
    report = _report(PASS, FAIL, error={"type": "Stopped", "message": "stopped", "rank": 1,
                                        "host": "node2"})
    report.config["fault"] = "1:slow=4@ddp_step"
    root = ET.fromstring(to_junit(report))
    note = "PRACTICE, injected on purpose (--fault 1:slow=4@ddp_step), not this cluster's fault: "
    failures = list(root.iter("failure"))
    assert len(failures) == 2 and all(f.get("message").startswith(note) for f in failures)
    assert failures[0].text.startswith(note + "rank 1 host node2: slow")
    lines = render(report, "r/report.json", ["# hosts: …"]).splitlines()
    assert lines[-2:] == ["# hosts: …", "verdict: FAIL (PRACTICE: --fault 1:slow=4@ddp_step) — "
                          "1/2 checks passed in 1.00 s; failed: ddp_step · report r/report.json"]
    plain = ET.fromstring(to_junit(_report(PASS, FAIL)))
    assert not any("PRACTICE" in (f.get("message") or "") for f in plain.iter("failure"))
