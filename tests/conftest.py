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
    if REQUIRE_REAL and report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under DDP_SMOKE_REQUIRE_REAL=1 (CI), which forbids skips: {reason}"
