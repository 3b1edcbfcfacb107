"""--prometheus FILE: node_exporter textfile output, read back with Prometheus' own parser."""
from __future__ import annotations

import os
import socket

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from ddp_smoke.outputs import metrics
from ddp_smoke.model import FAIL, PASS, CheckResult, Culprit, Report
from tests.launch import smoke_local

SMALL = {"bandwidth": {"min_bytes": 1024, "max_bytes_cpu": 65536, "iters": 3,
                       "time_per_size_s": 0.05}}


def parse(text: str) -> dict[str, list]:
    """Metric name -> samples, as a Prometheus server would read them."""
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def values(samples, *keys) -> dict:
    return {tuple(s.labels[k] for k in keys): s.value for s in samples}


def test_labels_with_quotes_backslashes_and_newlines_survive_the_parser():
    odd = 'gpu"07\\rack\n3'
    ranks = [{"rank": 0, "local_rank": 0, "host": odd}, {"rank": 1, "local_rank": 0, "host": "b"}]
    report = Report("0.1.0", "t", "gloo", 2, ranks,
                    [CheckResult("environment", PASS),
                     CheckResult("compute", FAIL, culprits=[Culprit(0, odd, "slow")]),
                     CheckResult("storage", "skip")], {"checks": []}, {"total_s": 3.5})
    got = parse(metrics.render(report, 'run "1"', 1e9))
    assert values(got["ddp_smoke_check_pass"], "check", "host") == {
        ("environment", odd): 1, ("environment", "b"): 1, ("compute", odd): 0,
        ("compute", "b"): 1}  # skipped storage proves nothing: absent
    assert values(got["ddp_smoke_host_status"], "host", "status") == {
        (odd, "good"): 0, (odd, "suspect"): 0, (odd, "bad"): 1,
        ("b", "good"): 1, ("b", "suspect"): 0, ("b", "bad"): 0}
    assert got["ddp_smoke_info"][0].labels["run_id"] == 'run "1"'
    assert got["ddp_smoke_pass"][0].value == 0
    assert got["ddp_smoke_last_run_timestamp_seconds"][0].value == 1e9
    assert got["ddp_smoke_run_duration_seconds"][0].value == 3.5


def test_a_failure_that_names_no_host_fails_the_check_on_every_host():
    ranks = [{"rank": r, "local_rank": 0, "host": f"n{r}"} for r in range(2)]
    report = Report("0", "t", "gloo", 2, ranks, [CheckResult("bandwidth", FAIL, culprits=[
        Culprit(None, None, "below the floor")])], {"checks": []})
    got = parse(metrics.render(report, "1", 0.0))
    assert values(got["ddp_smoke_check_pass"], "host") == {("n0",): 0, ("n1",): 0}


def test_a_practice_run_marks_every_series_and_a_real_one_none():
    """Issue 35: an injected failure must not page anyone as a real one; an alert rule can
    route it (`ddp_smoke_pass{practice!="true"} == 0` pages for real failures only)."""
    ranks = [{"rank": r, "local_rank": 0, "host": f"n{r}"} for r in range(2)]
    for fault in ("1:crash@compute", None):
        report = Report("0", "t", "gloo", 2, ranks, [CheckResult("compute", FAIL, culprits=[
            Culprit(1, "n1", "terminated")])], {"checks": ["compute"], "fault": fault})
        got = parse(metrics.render(report, "1", 0.0))
        samples = [s for series in got.values() for s in series]
        assert {s.labels.get("practice") for s in samples} == ({"true"} if fault else {None})
        assert got["ddp_smoke_info"][0].labels.get("fault") == fault


@pytest.mark.timeout(240)
def test_real_run_writes_a_textfile_prometheus_reads(tmp_path):
    """Two real ranks with bandwidth, compute and training; every figure in the file is the
    report's."""
    config = tmp_path / "small.yaml"
    config.write_text(yaml.safe_dump(SMALL))
    textfile = tmp_path / "textfile" / "ddp_smoke.prom"
    textfile.parent.mkdir()
    run = smoke_local(2, "--checks", "environment,bandwidth,compute,training", "--config",
                      str(config),
                      "--prometheus", str(textfile), report_dir=tmp_path / "report")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = run.report
    got = parse(textfile.read_text())
    host = socket.gethostname()
    assert got["ddp_smoke_pass"][0].value == 1
    assert (got["ddp_smoke_world_size"][0].value, got["ddp_smoke_nodes"][0].value) == (2, 1)
    assert values(got["ddp_smoke_check_pass"], "check", "host") == {
        (c, host): 1 for c in ("environment", "bandwidth", "compute", "training")}
    rows = run.check("bandwidth")["figures"]["results"]
    assert values(got["ddp_smoke_busbw_gbps"], "collective", "size_bytes") == pytest.approx(
        {(r["collective"], str(r["size_bytes"])): r["busbw_gbps"] for r in rows})
    assert len(rows) >= 4  # 1 KiB .. 64 KiB by 4, all_reduce and all_gather
    ranks = run.check("compute")["figures"]["ranks"]
    # CPU ranks: no GPU label value (issue 25: "0" read as GPU 0), told apart by local rank
    assert values(got["ddp_smoke_tflops"], "host", "gpu", "local_rank", "dtype") == \
        pytest.approx({(host, "", str(r["rank"]), "fp32"): r["matmul"]["fp32"]["tflops"]
                       for r in ranks})
    trained = run.check("training")["figures"]["ranks"]
    assert values(got["ddp_smoke_training_tokens_per_second"], "host", "gpu",
                  "local_rank") == pytest.approx({(host, "", str(r["rank"])): r["tokens_per_s"]
                                                  for r in trained})
    assert "ddp_smoke_training_mfu" not in got  # CPU ranks: no dense peak, no MFU
    assert values(got["ddp_smoke_host_status"], "status") == {("good",): 1, ("suspect",): 0,
                                                                ("bad",): 0}
    assert got["ddp_smoke_run_duration_seconds"][0].value == report["timings"]["total_s"]
    # The textfile collector reads every *.prom there: nothing but the file itself.
    assert os.listdir(textfile.parent) == ["ddp_smoke.prom"]


@pytest.mark.timeout(120)
def test_unwritable_textfile_is_one_line_and_keeps_the_verdict(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    run = smoke_local(1, "--checks", "environment", "--prometheus", str(blocker / "x.prom"),
                      report_dir=tmp_path / "report")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"ddp-smoke: --prometheus {blocker / 'x.prom'}: not written:" in run.stderr
    assert run.report["verdict"] == "pass"
