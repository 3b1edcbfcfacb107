"""Shared test plumbing.

Tests that need a real part this machine lacks (root, network namespaces, Slurm, Docker) skip
with a reason on a user's laptop. CI sets ``DDP_SMOKE_REQUIRE_REAL=1``, which turns every skip
into a failure: a skipped real-part test is not a passing one.
"""
import os

import pytest

REQUIRE_REAL = os.environ.get("DDP_SMOKE_REQUIRE_REAL") == "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    # An xfail is a quarantined test that ran (named in its marker), not a skipped one.
    if REQUIRE_REAL and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under DDP_SMOKE_REQUIRE_REAL=1 (CI), which forbids skips: {reason}"


def pytest_report_header(config):
    from tests.campaign import matrix  # pure: the seed, so that a sample can be rerun
    return f"fault campaign sample: seed {matrix.commit_seed()} (python -m tests.campaign " \
           f"--sample {matrix.commit_seed()} --list)"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "planted_report: the test writes a report.json the kit did not (a stale or "
        "fake one), so the reports under its tmp_path are not checked against the schema")


@pytest.fixture(autouse=True)
def _reports_match_the_schema(request):
    """Every report.json a test leaves under its tmp_path matches report.schema.json, whether
    or not the test read it (tests/report_schema.py)."""
    yield
    tmp = request.node.funcargs.get("tmp_path")
    if tmp is None or request.node.get_closest_marker("planted_report"):
        return
    from tests import report_schema  # jsonschema: only for tests that made a folder

    for path in sorted(tmp.rglob("report.json")):
        if path.is_file():
            report_schema.read(path)
