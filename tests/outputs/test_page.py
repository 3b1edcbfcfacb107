"""report.html and history without processes: escaping, partial reports, the index, trends.

The real runs and the real browser are in test_page_browser.py; these build report dicts by
hand to reach the corners (hostile strings, missing keys, an index gone stale or corrupt).
"""
from __future__ import annotations

import copy
import html
import json
import os
import sqlite3
import re
import subprocess
import sys
import time

import pytest

from ddp_smoke.errors import ConfigError
from ddp_smoke.outputs import history, page, runs

# The reports here are made by hand (partial on purpose), not by the kit.
pytestmark = pytest.mark.planted_report

HOSTILE = '<script>alert(1)</script>"><img src=x onerror=alert(2)>'


def _report(host_b: str = "node2", started: str = "2026-11-30T10:00:00+00:00",
            pair: float = 1.0, tflops: float = 0.1, verdict: str = "pass") -> dict:
    """A two-node report of the shape the worker writes (bandwidth pairs, compute)."""
    ranks = [{"rank": 0, "local_rank": 0, "host": "node1", "device": "cpu"},
             {"rank": 1, "local_rank": 0, "host": host_b, "device": "cpu"},
             {"rank": 2, "local_rank": 0, "host": "node3", "device": "cpu"}]
    pairs = [{"node_a": 0, "node_b": 1, "host_a": "node1", "host_b": host_b, "busbw_gbps": 1.0,
              "slow": False},
             {"node_a": 0, "node_b": 2, "host_a": "node1", "host_b": "node3", "busbw_gbps": pair,
              "slow": pair < 0.5},
             {"node_a": 1, "node_b": 2, "host_a": host_b, "host_b": "node3", "busbw_gbps": pair,
              "slow": pair < 0.5}]
    culprits = [] if verdict == "pass" else [
        {"rank": 2, "host": "node3", "reason": "node node3 is slow with every partner",
         "ranks": None, "hosts": None, "where": None}]
    return {
        "verdict": verdict, "run_id": f"run-{started}", "world_size": 3, "nodes": 3,
        "backend": "gloo", "version": "0.1.0", "started_at": started,
        "config": {"history": {"margin": 0.1, "margin_cpu": 0.5, "window": 5, "min_runs": 2}},
        "ranks": ranks, "timings": {"total_s": 3.0},
        "checks": [
            {"name": "bandwidth", "status": verdict, "summary": "", "duration_s": 1.0,
             "culprits": culprits,
             "figures": {"results": [{"collective": "all_reduce", "size_bytes": 1024,
                                      "busbw_gbps": 0.1}],
                         "pairs": {"size_bytes": 2097152, "reference_busbw_gbps": 1.0,
                                   "results": pairs}}},
            {"name": "compute", "status": "pass", "summary": "", "duration_s": 0.5,
             "culprits": [], "figures": {"matrix_size": 512, "median_tflops": {"fp32": tflops},
                                         "ranks": [{"rank": r["rank"], "host": r["host"],
                                                    "matmul": {"fp32": {
                                                        "tflops": tflops * 1.1,
                                                        "tflops_median": tflops}}}
                                                   for r in ranks]}}]}


def test_every_report_string_is_escaped():
    report = _report(host_b=HOSTILE, verdict="fail")
    report["checks"][0]["culprits"].append({"rank": 1, "host": HOSTILE, "reason": HOSTILE})
    report["error"] = {"type": HOSTILE, "message": HOSTILE, "rank": 1}
    report["run_id"] = HOSTILE
    text = page.render(report)
    assert "<script" not in text and "<img" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;&quot;&gt;&lt;img" in text


def test_the_page_is_self_contained_and_reads_on_a_phone_and_on_paper():
    text = page.render(_report())
    assert "default-src 'none'" in text            # the browser itself refuses any load
    assert 'name="viewport"' in text and "@media print" in text
    assert re.findall(r"https?://[^\"' ]+", text) == ["http://www.w3.org/2000/svg"] * \
        text.count('xmlns="http://www.w3.org/2000/svg"')
    assert "<script" not in text and not re.search(r"\son[a-z]+=", text)


@pytest.mark.parametrize("broken", [
    [], "text", None, {}, {"verdict": "fail"},
    {"verdict": "fail", "checks": "not a list", "ranks": [1, "x", None], "hosts": 7},
    {"verdict": "fail", "checks": [{"name": "bandwidth", "status": "fail",
                                    "figures": {"results": [{"size_bytes": "x"}],
                                                "pairs": {"results": [{"node_a": "?"}]}},
                                    "culprits": [{"rank": None}, "junk"]}]},
    {"verdict": "pass", "checks": [{"name": "compute", "status": "pass",
                                    "figures": {"ranks": [{"matmul": {"fp32": {"tflops": None}}}]}}],
     "timings": {"total_s": float("nan")}},
])
def test_invalid_and_partial_reports_render_with_what_they_have(broken):
    text = page.render(copy.deepcopy(broken))
    assert 'id="verdict"' in text and text.rstrip().endswith("</html>")
    if not isinstance(broken, dict):
        assert "not a JSON object" in text


def test_times_read_as_the_terminal_prints_them():
    """Issue 35: a 25 us check read `2.5e-05` on the page; the terminal prints 0.000."""
    report = _report()
    report["checks"][0]["duration_s"] = 2.5e-05
    report["timings"] = {"load_checks_s": 1.2e-05, "total_s": 3.25, "iterations": 1}
    text = page.render(report)
    assert "e-05" not in text and '<td class="num">0.000</td>' in text
    assert "load_checks_s 0.000, total_s 3.250, iterations 1" in text


def test_compute_reads_as_the_terminal_sustained_and_in_gflops_on_cpu():
    text = page.render(_report(tflops=0.1))
    assert "fp32 matmul, sustained (median block; GFLOPS, n = 512)" in text
    assert "median 100" in text  # 0.1 TFLOPS median block = 100 GFLOPS


def test_training_step_times_are_charted_per_rank_and_absent_when_it_was_skipped():
    report = _with_training(_report(host_b=HOSTILE), 1250.0)
    check = report["checks"][-1]
    check["figures"]["ranks"][2].update(step_s=[0.1, 0.3, 0.12], step_s_p90=0.3)
    check["culprits"] = [{"rank": 2, "host": "node3", "reason": "the step waits for it"}]
    text = page.render(report)
    section = text[text.index('<section id="training">'):text.index('id="timeline"')]
    assert "FSDP 3, 1.97 M parameters, batch 2x64 tokens a rank" in section
    assert section.count("<svg") == 1 and "job 3750 tokens/s" in section
    assert [re.search(r"<title>(rank \d .*?):", t)[1] for t in
            re.findall(r"<title>rank \d [^<]*compute only", section)] == \
        ["rank 0 node1", f"rank 1 {html.escape(HOSTILE)}", "rank 2 node3 (named)"]
    assert "rank 2 node3 (named): step 2 300 ms" in section  # each step a dot with its time
    assert "step median 102.4 ms, p90 300 ms" in section and "<script" not in section
    check.update(status="skip", figures={"waits": {"collectives": 0}})  # the quick level
    assert 'id="training"' not in page.render(report)
    check.update(status="fail", figures={"ranks": ["x", {"step_s_median": "?"},
                                                   {"rank": 0, "step_s_median": 0.1,
                                                    "step_s_p90": None, "step_s": [None]}]})
    text = page.render(report)
    assert 'id="training"' not in text and "not drawn" not in text


def test_a_practice_run_says_so_on_the_page_and_lists_nothing_to_drain():
    """Issue 35: report.html of a --fault run read as a real failure, drain commands and all."""
    report = _report(pair=0.05, verdict="fail")
    report["ranks"][2]["slurm_node"] = "node3"
    report["injected"] = "2:slow=4@bandwidth"
    text = page.render(report)
    banner = re.search(r'<p id="practice" class="practice">(.*?)</p>', text)[1]
    assert banner.startswith("PRACTICE, injected on purpose (--fault 2:slow=4@bandwidth), "
                             "not this cluster&#x27;s fault: the failures below"), banner
    assert text.index('id="verdict"') < text.index('id="practice"') < text.index('id="culprits"')
    assert "<title>ddp-smoke FAIL (PRACTICE)" in text
    assert 'id="next"' not in text and "scontrol" not in text


def test_the_plot_hint_runs_as_written():
    """Issue 35: `pip install 'ddp-smoke[plot]'` fails: the kit is not on PyPI. The hint's
    command, run as written from the checkout, installs (here: finds) matplotlib."""
    from ddp_smoke.outputs import plot
    report = {"config": {"level": "standard"}}
    saved = sys.modules.get("matplotlib")
    sys.modules["matplotlib"] = None  # as if not installed: import raises ImportError
    try:
        said = plot.not_drawn(report)
        quick = plot.not_drawn({"config": {"level": "quick"}})
    finally:
        sys.modules.pop("matplotlib")
        if saved is not None:
            sys.modules["matplotlib"] = saved
    assert said == f"not drawn: matplotlib is not installed (in the checkout: {plot.INSTALL})"
    # issue 49: the quick level's hint names what the standard level needs, in a venv
    # without matplotlib (make smoke-local's) as well
    assert quick == ("not drawn at the quick level (--level standard draws it once "
                     f"matplotlib is installed: {plot.INSTALL})")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    argv = plot.INSTALL.split()
    if not os.path.exists(os.path.join(repo, argv[0])):
        pytest.skip("no .venv in this checkout (make venv makes it)")
    done = subprocess.run(argv, cwd=repo, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "matplotlib" in done.stdout, done.stdout + done.stderr


def test_a_failing_run_leads_with_the_verdict_culprits_and_next_commands():
    report = _report(pair=0.05, verdict="fail")
    report["ranks"][2]["slurm_node"] = "node3"  # next steps are the launcher's own commands
    text = page.render(report)
    assert text.index('id="verdict"') < text.index('id="culprits"') < text.index('id="next"') \
        < text.index('id="hosts"')
    assert "node node3 is slow with every partner" in text
    assert "scontrol update NodeName=node3 State=DRAIN" in text


# -- history --------------------------------------------------------------------------------

def _write(root, name: str, report: dict) -> str:
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text(json.dumps(report))
    return str(folder / "report.json")


def test_trend_against_its_own_median():
    assert history.trend([10, 10, 10, 4], 0.5, 5, 3)["degrading"] is True
    assert history.trend([10, 10, 10, 6], 0.5, 5, 3)["degrading"] is False  # within the margin
    assert history.trend([10, 10, 4], 0.5, 5, 3)["degrading"] is False      # too few runs
    assert history.trend([1, 1, 10, 10, 10, 4], 0.5, 3, 3)["median"] == 10  # the last window


def test_history_flags_exactly_the_host_whose_figure_fell(tmp_path):
    for i in range(3):
        _write(tmp_path, f"run{i}", _report(started=f"2026-11-30T1{i}:00:00+00:00"))
    last = _write(tmp_path, "run3", _report(started="2026-11-30T13:00:00+00:00", pair=0.05))
    text = history.run(str(tmp_path), min_runs=2)
    flagged = [line for line in text.splitlines() if line.startswith("degrading:")]
    assert len(flagged) == 1 and flagged[0].startswith("degrading: host node3: best node-pair"), text
    hist = history.for_report(json.loads(open(last).read()), last)
    assert [h["entity"] for h in hist["hosts"] if h["degrading"]] == ["node3"]
    text = page.render(json.loads(open(last).read()), hist)
    rows = re.findall(r"<tr>.*?</tr>", text[text.index('id="hosts"'):text.index('id="checks"')])
    assert [re.search(r"<b>(.*?)</b>", r)[1] for r in rows if 'degrading</span>' in r] == ["node3"]


def _with_training(report: dict, tokens_per_s: float, mfu: float | None = None,
                   seq_len: int = 64) -> dict:
    """The report with the training check's figures (checks/training.py), every rank at the
    same rate: ``mfu`` None on CPU."""
    ranks = [{"rank": r["rank"], "host": r["host"], "step_s_median": 128 / tokens_per_s,
              "step_s_p90": 128 / tokens_per_s, "step_s": [128 / tokens_per_s] * 3,
              "compute_s_median": 0.02, "exposed_comm_s": 128 / tokens_per_s - 0.02,
              "tokens_per_s": tokens_per_s, "mfu": mfu, "pace": 1.0,
              "peak_memory_bytes": 1 << 28, "loss_diff": 0.0, "grad_diff": 0.0,
              "param_diff": 0.0} for r in report["ranks"]]
    model = {"vocab": 512, "dim": 192, "layers": 4, "heads": 4, "ffn": 512, "seq_len": seq_len,
             "micro_batch": 2, "params": 1967808, "params_non_embedding": 1869504}
    report["checks"].append({"name": "training", "status": "pass", "summary": "",
                             "duration_s": 1.0, "culprits": [], "figures": {
                                 "layout": "fsdp", "mesh": [3], "model": model,
                                 "tokens_per_step": 128, "tokens_per_s": 3 * tokens_per_s,
                                 "mfu_median": mfu, "ranks": ranks}})
    return report


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu slot", "gpu"])
def test_history_flags_the_slot_whose_training_tokens_per_s_fell(tmp_path, gpu):
    """Training's tokens/s per rank (and MFU on a GPU), keyed by layout, mesh, model size and
    batch, degrade by the trend rule as compute's sustained rate does."""
    def run(i: int, tps: float = 1250.0, slow: float | None = None, seq_len: int = 64):
        report = _with_training(_report(started=f"2026-11-30T1{i}:00:00+00:00"), tps,
                                0.4 if gpu else None, seq_len)
        if gpu:
            for r in report["ranks"]:
                r.update(device="cuda:0", identity={"gpu_serial": f"S{r['rank']}"})
        if slow:
            row = report["checks"][-1]["figures"]["ranks"][2]
            row.update(tokens_per_s=slow, mfu=0.4 * slow / tps if gpu else None)
        return _write(tmp_path, f"run{i}", report)
    for i in range(3):
        run(i)
    last = run(3, slow=400.0)
    what = "training fsdp 3 ranks, 1.968M params, batch 2x64"
    text = history.run(str(tmp_path), min_runs=2)
    flagged = [line for line in text.splitlines() if line.startswith("degrading:")]
    slot = "device serial:S2: " if gpu else "device node3:0: "
    assert flagged == [f"degrading: {slot}{what} 400 tokens/s, 68% below its median 1250 of "
                       f"the 3 runs before (margin {10 if gpu else 50}%; run "
                       "run-2026-11-30T13:00:00+00:00)"] + (
        [f"degrading: {slot}{what} MFU 12.8 %, 68% below its median 40 of the 3 runs before "
         "(margin 10%; run run-2026-11-30T13:00:00+00:00)"] if gpu else []), text
    assert "# training: the rank's tokens/s over its median step" in text
    hist = history.for_report(json.loads(open(last).read()), last)
    assert [g["label"] for g in hist["gpus"] if g["degrading"]] == [
        "GPU serial S2 (now node3 gpu 0)" if gpu else "node3 cpu slot 0"]
    page_text = page.render(json.loads(open(last).read()), hist)
    past = page_text[page_text.index('id="history"'):page_text.index('id="identity"')]
    assert f'<span class="muted">{what}</span> 400 -68% <span class="chip bad">degrading' \
        in past
    # another batch is another series: its first run, slower, judges nothing
    run(4, tps=300.0, seq_len=128)
    lines = history.run(str(tmp_path), min_runs=2).splitlines()
    assert any(line.startswith(f"  {what[:-2]}128 (tokens/s)") for line in lines), lines
    assert not any("2x128" in line for line in lines if line.startswith("degrading:"))
    figures = {f["figure"] for f in runs.figures(json.loads(open(last).read()))
               if f["figure"].startswith("training")}
    assert figures == {what, f"{what} MFU"} if gpu else {what}


def test_a_re_rendered_old_report_shows_the_history_it_had(tmp_path):
    first = _write(tmp_path, "a", _report(started="2026-11-30T10:00:00+00:00"))
    _write(tmp_path, "b", _report(started="2026-11-30T11:00:00+00:00", pair=0.05))
    hist = history.for_report(json.loads(open(first).read()), first)
    assert all(len(f["values"]) == 1 for h in hist["hosts"] for f in h["figures"])
    assert not (tmp_path / runs.INDEX_NAME).exists()  # only `ddp-smoke history` makes one


def test_the_index_follows_the_reports(tmp_path):
    path = _write(tmp_path, "a", _report())
    index = runs.Index(str(tmp_path), history.defaults())
    assert index.refresh()["read"] == 1 and index.path.endswith(runs.INDEX_NAME)
    index.close()
    again = runs.Index(str(tmp_path), history.defaults())
    assert again.refresh()["read"] == 0  # nothing changed: one stat, no read
    again.close()
    later = _report(pair=0.25)
    with open(path, "w") as f:  # the same path rewritten: read again
        json.dump(later, f)
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    index = runs.Index(str(tmp_path), history.defaults())
    assert index.refresh()["read"] == 1
    assert [p[3] for p in index.series("host", "node3")["best node-pair busbw 2 MiB"]["points"]] \
        == [0.25]
    index.close()
    os.unlink(path)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "report.json").write_text("{truncated")
    index = runs.Index(str(tmp_path), history.defaults())
    stats = index.refresh()
    assert (stats["removed"], stats["unreadable"], stats["reports"]) == (1, 1, 0)
    index.close()


def test_a_corrupt_or_foreign_index_is_rebuilt_from_the_reports(tmp_path):
    _write(tmp_path, "a", _report())
    (tmp_path / runs.INDEX_NAME).write_bytes(b"this is not sqlite" * 100)
    index = runs.Index(str(tmp_path), history.defaults())
    assert index.refresh()["reports"] == 1 and index.path != ":memory:"
    index.close()
    # an index of the schema before (hosts.verdict, not hosts.status): rebuilt, not misread
    old = sqlite3.connect(tmp_path / runs.INDEX_NAME)
    old.executescript("DROP TABLE hosts; CREATE TABLE hosts (path TEXT, host TEXT, verdict TEXT);"
                      "UPDATE meta SET value = '4' WHERE key = 'schema'")
    old.close()
    index = runs.Index(str(tmp_path), history.defaults())
    assert index.refresh()["read"] == 1 and index.host_statuses("node3") == []
    assert index.db.execute("SELECT count(status) FROM hosts").fetchone() == (0,)
    index.close()


def test_a_lone_report_dir_leaves_its_parent_alone(tmp_path):
    path = _write(tmp_path, "only", _report())
    assert history.for_report(_report(), path) is None
    assert not (tmp_path / runs.INDEX_NAME).exists()


def test_a_gpu_is_followed_by_its_serial_across_hosts():
    report = _report()
    report["ranks"][0].update(device="cuda:0", identity={"gpu_serial": "1650123"})
    rows = [f for f in runs.figures(report) if f["kind"] == "gpu"]
    assert rows[0]["entity"] == "serial:1650123" and "node1" in rows[0]["label"]


# -- the commands ---------------------------------------------------------------------------

def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ddp_smoke", *args], capture_output=True,
                          text=True, timeout=60)


def test_render_and_history_commands(tmp_path):
    path = _write(tmp_path, "a", _report())
    done = _cli("render", path, "-o", str(tmp_path / "out.html"))
    assert done.returncode == 0 and (tmp_path / "out.html").exists(), done.stderr
    done = _cli("history", str(tmp_path))
    assert done.returncode == 0 and "host node1" in done.stdout, done.stderr
    help_text = _cli("--help").stdout
    assert "ddp-smoke render" in help_text and "ddp-smoke history" in help_text


# a path under a regular file: it cannot exist, whatever another run left at /nonexistent
MISSING = os.path.join(__file__, "missing")


@pytest.mark.parametrize("args", [["render"], ["render", os.path.join(MISSING, "report.json")],
                                  ["render", __file__], ["history", MISSING],
                                  ["history", ".", "--margin", "1.5"],
                                  ["history", ".", "--window", "0"], ["history"]])
def test_bad_input_is_one_line_and_exit_2(args):
    done = _cli(*args)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith("ddp-smoke: error: ")


def test_render_file_names_the_file():
    with pytest.raises(ConfigError, match="not JSON"):
        page.render_file(__file__)


def test_publish_writes_the_page_beside_the_report_and_prepare_clears_it(tmp_path, capsys):
    from ddp_smoke import outputs
    from ddp_smoke.model import FAIL, CheckResult, Culprit, Report

    report = Report(version="0.1.0", started_at="2026-11-30T10:00:00+00:00", backend="gloo",
                    world_size=2, ranks=[{"rank": r, "local_rank": r, "host": "vm"}
                                         for r in range(2)],
                    checks=[CheckResult("ddp_step", FAIL, culprits=[Culprit(1, "vm", HOSTILE)])],
                    config={"checks": ["ddp_step"], "timeout": 10}, run_id="r1",
                    written_by="rank 0")
    assert outputs.publish(report, str(tmp_path), "r1").verdict == FAIL
    text = (tmp_path / "report.html").read_text()
    assert '<span id="verdict">FAIL</span>' in text and "&lt;script&gt;" in text
    assert str(tmp_path / "report.html") in outputs.prepare(str(tmp_path))
