"""Optional picture: busbw against message size, one line per collective, beside the report.

Rank 0 calls :func:`write_busbw_png` after writing ``report.json``. It needs matplotlib in the
worker's Python (:data:`INSTALL`, the ``plot`` extra's one package); without it nothing is
written, and the summary says why. Not at the quick level (``ddp_smoke.config.levels``). A plot
that fails for another reason costs one line on stderr, never the verdict.
"""
from __future__ import annotations

import importlib.util
import io
import os
import sys

from .files import write_atomic

FILENAME = "busbw.png"
# The kit is not on PyPI (pip install 'ddp-smoke[plot]' finds nothing): the command that works
# as written, from the checkout, for the venv `make` made; elsewhere that Python's own pip.
INSTALL = ".venv/bin/python -m pip install matplotlib"


def not_drawn(report) -> str | None:
    """Why there is no busbw.png although the bandwidth check ran (None: it is drawn)."""
    config = (report.get("config") if isinstance(report, dict) else report.config) or {}
    # found, not imported: importing it would cost a quick run a large part of its time
    have = importlib.util.find_spec("matplotlib") is not None
    if config.get("level") == "quick":
        # quick: four sizes make a poor picture, and importing matplotlib and drawing would
        # be a large part of a quick run (bench/phases.py shows where the time goes); the
        # hint names all that the standard level needs, so that it leads somewhere
        return ("not drawn at the quick level (--level standard draws it"
                + ("" if have else f" once matplotlib is installed: {INSTALL}") + ")")
    if not have:
        return f"not drawn: matplotlib is not installed (in the checkout: {INSTALL})"
    return None


def write_busbw_png(report, report_dir: str) -> str | None:
    """Write ``report_dir/busbw.png`` from the bandwidth check's figures; return its path.

    Args:
        report: the :class:`ddp_smoke.model.Report`, or its JSON form (a dict).
        report_dir: the directory that holds ``report.json``.

    Returns:
        The PNG's path, or None when there is nothing to plot or matplotlib is absent.
    """
    rows = bandwidth_rows(report)
    if not rows or not_drawn(report):
        return None
    from matplotlib.figure import Figure  # no pyplot: no global state, no display needed
    try:
        return _draw(Figure, rows, report, os.path.join(report_dir, FILENAME))
    except Exception as e:  # noqa: BLE001 — a picture must never cost the report
        print(f"ddp-smoke: {FILENAME} not written ({type(e).__name__}: {e})", file=sys.stderr)
        return None


def bandwidth_rows(report) -> list[dict]:
    checks = report["checks"] if isinstance(report, dict) else report.checks
    for check in checks:
        name = check["name"] if isinstance(check, dict) else check.name
        figures = check["figures"] if isinstance(check, dict) else check.figures
        if name == "bandwidth":
            return figures.get("results", [])
    return []


def _draw(Figure, rows: list[dict], report, path: str) -> str:
    fig = Figure(figsize=(8, 5), dpi=110)
    ax = fig.subplots()
    for collective in dict.fromkeys(r["collective"] for r in rows):
        mine = [r for r in rows if r["collective"] == collective]
        ax.plot([r["size_bytes"] for r in mine], [r["busbw_gbps"] for r in mine],
                marker="o", label=collective)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size S (bytes, nccl-tests' definition)")
    ax.set_ylabel("busbw (GB/s, GB = 1e9 B)")
    world = report["world_size"] if isinstance(report, dict) else report.world_size
    backend = report["backend"] if isinstance(report, dict) else report.backend
    ax.set_title(f"ddp-smoke bandwidth: {world} rank(s), {backend}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    write_atomic(path, png.getvalue())  # like the report: a reader never sees half a PNG
    return path
