"""report.html of real runs in a real browser, and history over real runs with a real fault.

Single-node reports come from real torchrun runs (a pass and each software fault: crash, hang,
slow, corrupt, raise), multi-node ones from three network-namespace nodes (tests/sandbox),
two healthy runs and one with node 3 throttled by tbf (../shared/reference/fault-recipes.md).
Each run's own report.html (written by rank 0) is opened in Debian's headless chromium: no
console message (the page has no script, and its CSP turns any load into one), the verdict and
every culprit in the DOM, a screenshot that is not blank. ``ddp-smoke history`` over the
multi-node runs must flag node 3, and only node 3.
"""
from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import browser
from tests.launch import smoke_local
from tests.multinode import Nodes, torchrun_argv
from tests.sandbox.hosts import sandbox_fixture
from tests.worker.test_diagnosis_network import SMALL_SWEEP, _slow_node

PREFIX, SUBNET = "dsp", "10.231.26.0/24"
NODES = 3
QUICK = ["--backend", "gloo", "--level", "quick"]
SINGLE = {
    "pass": [],
    "crash": ["--checks", "environment,collectives,compute", "--fault", "1:crash@collectives"],
    "hang": ["--checks", "environment,ddp_step", "--fault", "1:hang@ddp_step", "--timeout", "8"],
    # fortyfold: on a loaded host the fast rank runs slow too; a fourfold rank passed once, a
    # tenfold one once too (25 GFLOPS against 10: the healthy rank at a fifth of its best)
    "slow": ["--checks", "environment,compute", "--fault", "1:slow=40@compute"],
    "corrupt": ["--checks", "environment,collectives", "--fault", "1:corrupt@collectives"],
    "raise": ["--checks", "environment,storage,bandwidth", "--fault", "0:raise@storage"],
}
# CPU pairs over veths on a loaded host differ by far more than GPU links: judge history as
# the pair test does on CPU (pair_margin_cpu), over the two runs before (three runs in all).
HISTORY = "history:\n  margin_cpu: 0.8\n  min_runs: 2\n"
MULTI = ["multi-pass-1", "multi-pass-2", "multi-throttled"]

box = sandbox_fixture(PREFIX, SUBNET, NODES)


@pytest.fixture(scope="module")
def chromium():
    try:
        return browser.chromium()
    except browser.MissingBrowser as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def single_runs(tmp_path_factory) -> Path:
    """One folder of runs (ROOT/<name>/), so that later runs' pages draw history too."""
    root = tmp_path_factory.mktemp("single")
    for name, args in SINGLE.items():
        run = smoke_local(2, *QUICK, *args, report_dir=root / name, timeout_s=120)
        assert run.report is not None, run.stderr[-3000:]
        assert (run.report["verdict"] == "pass") == (name == "pass"), run.stdout[-2000:]
    return root


@pytest.fixture(scope="module")
def multi_runs(box, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("multi")
    config = root / "cfg.yaml"
    config.write_text(SMALL_SWEEP + HISTORY)
    for i, name in enumerate(MULTI):
        # No compute: three CPU ranks on two cores would name a straggler in a healthy run.
        worker = [*QUICK, "--checks", "environment,bandwidth", "--timeout", "60",
                  "--config", str(config), "--report-dir", str(root / name)]
        nodes, port = Nodes(box, root / f"{name}.logs"), 29610 + i
        nodes.logs.mkdir()
        if name == "multi-throttled":
            with _slow_node(box.hosts[2]):
                _start(box, nodes, port, worker)
                nodes.wait(200)
        else:
            _start(box, nodes, port, worker)
            nodes.wait(200)
        assert (root / name / "report.json").exists(), nodes.tails()
    return root


def _start(box, nodes: Nodes, port: int, worker: list[str]) -> None:
    first = box.hosts[0]
    for host in box.hosts:
        nodes.start(host, torchrun_argv(host, NODES, 1, f"{first.name}:{port}",
                                        f"dsp-{port}-{os.getpid()}",
                                        "join_timeout=60,read_timeout=60", worker))


def _folder(name: str, single_runs: Path, multi_runs: Path) -> Path:
    return (multi_runs if name.startswith("multi") else single_runs) / name


def _text(dom_fragment: str) -> str:
    """Text of a serialised DOM fragment, entities as chromium writes them."""
    return html.unescape(re.sub(r"<[^>]+>", "", dom_fragment))


def test_the_console_detector_sees_a_misbehaving_page(chromium, tmp_path):
    """The no-console-error assertion below can fail: a blocked load and a script are seen."""
    bad = tmp_path / "bad.html"
    bad.write_text(page_with('<img src="http://127.0.0.1:9/x.png"><script>1</script>'))
    assert len(browser.load(chromium, bad).console) >= 2


def page_with(body: str) -> str:
    from ddp_smoke.outputs import page
    return page.render({"verdict": "fail"}).replace("<main>", "<main>" + body)


@pytest.mark.parametrize("name", [*SINGLE, *MULTI])
def test_the_page_of_a_real_run_in_chromium(chromium, single_runs, multi_runs, name):
    folder = _folder(name, single_runs, multi_runs)
    report = json.loads((folder / "report.json").read_text())
    page = folder / "report.html"
    assert page.exists(), "rank 0 writes report.html beside every report"
    got = browser.load(chromium, page)
    (folder / "screenshot.png").write_bytes(got.png)
    assert got.console == []
    verdict = re.search(r'<span id="verdict">(.*?)</span>', got.dom)[1]
    assert verdict == report["verdict"].upper()
    text = _text(got.dom)
    culprits = [k for c in report["checks"] for k in c["culprits"]]
    assert bool(culprits) == (report["verdict"] == "fail")
    for k in culprits:
        assert k["reason"] in text and (k["host"] or "") in text
    assert browser.pixel_variance(got.png) > 100, "a blank screenshot"


@pytest.mark.planted_report  # partial and odd reports, made from a real one on purpose
def test_invalid_and_partial_reports_in_chromium(chromium, single_runs, tmp_path):
    real = json.loads((single_runs / "crash" / "report.json").read_text())
    cases = {"partial": {k: real[k] for k in ("verdict", "run_id", "ranks")},
             "odd": {**real, "checks": [{"name": "bandwidth", "figures": "x"}, 3], "hosts": 5},
             "list": [real]}
    for name, data in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "report.json").write_text(json.dumps(data))
        done = subprocess.run([sys.executable, "-m", "ddp_smoke", "render",
                               str(tmp_path / name / "report.json")], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        got = browser.load(chromium, tmp_path / name / "report.html")
        assert got.console == [] and 'id="verdict"' in got.dom, name


def test_history_flags_exactly_the_throttled_node(multi_runs, box):
    slow = box.hosts[2].name
    done = subprocess.run([sys.executable, "-m", "ddp_smoke", "history", str(multi_runs),
                           "--min-runs", "2"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    (multi_runs / "history.txt").write_text(done.stdout)
    flagged = [line for line in done.stdout.splitlines() if line.startswith("degrading: ")]
    assert len(flagged) == 1 and flagged[0].startswith(f"degrading: host {slow}: best node-pair"), \
        done.stdout
    # The throttled run's own page, written by rank 0, marks that host in the hosts table.
    page = (multi_runs / "multi-throttled" / "report.html").read_text()
    hosts = page[page.index('id="hosts"'):page.index('id="checks"')]
    rows = re.findall(r"<tr>.*?</tr>", hosts)
    assert [re.search(r"<b>(.*?)</b>", r)[1] for r in rows if "degrading</span>" in r] == [slow]


def test_a_phone_sized_screenshot(chromium, multi_runs):
    got = browser.load(chromium, multi_runs / "multi-throttled" / "report.html", 390, 844)
    (multi_runs / "phone.png").write_bytes(got.png)
    assert got.console == [] and browser.pixel_variance(got.png) > 100
    shutil.copy(multi_runs / "phone.png", multi_runs / "multi-throttled" / "phone.png")
