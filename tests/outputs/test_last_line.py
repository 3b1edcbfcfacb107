"""The one-line verdict the Kubernetes manifests write as the pod's termination message."""
import json
import subprocess
import sys

import pytest

from ddp_smoke.outputs import last_line

FAILED = {"verdict": "fail", "run_id": "job-1", "world_size": 16, "nodes": 2,
          "checks": [{"name": "environment", "status": "pass", "culprits": []},
                     {"name": "transport", "status": "fail", "culprits": [
                         {"rank": 8, "host": "gpu-b", "reason": "ranks [8, 9] used Socket"}]}]}


def test_line_names_verdict_run_shape_and_culprits():
    assert last_line.line(FAILED) == ("ddp-smoke FAIL · run job-1 · 16 ranks on 2 nodes · failed: "
                                    "transport (rank 8 gpu-b: ranks [8, 9] used Socket)")
    assert last_line.line({"verdict": "pass", "world_size": 2, "nodes": 1, "checks": []}) == (
        "ddp-smoke PASS · run ? · 2 ranks on 1 nodes")


def test_line_is_bounded_and_single():
    long = dict(FAILED, checks=[{"name": "bandwidth", "status": "fail", "culprits": [
        {"rank": r, "host": "h", "reason": "slow\nlink " * 20} for r in range(50)]}])
    text = last_line.line(long)
    assert len(text) == last_line.MAX_CHARS and "\n" not in text and text.endswith("…")


@pytest.mark.planted_report  # FAILED holds only the fields the line reads
def test_cli_reads_a_report_and_refuses_a_missing_one(tmp_path):
    path = tmp_path / "report.json"
    path.write_text(json.dumps(FAILED))
    ok = subprocess.run([sys.executable, "-m", "ddp_smoke", "last-line", str(path)],
                        capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0 and ok.stdout.startswith("ddp-smoke FAIL · run job-1")
    bad = subprocess.run([sys.executable, "-m", "ddp_smoke", "last-line", str(tmp_path / "x")],
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr
