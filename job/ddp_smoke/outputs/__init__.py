"""Everything a run leaves beside its report, written by one :func:`publish` in one order,
whoever writes: rank 0, the survivor that took over, the store host (the report of last resort),
a launcher whose workers never ran (:mod:`.launch_report`), submit.

``ARTIFACTS`` lists every file a run writes in its report folder; :func:`prepare` removes them
all before the run starts, so nothing an earlier run left (a ``bad_hosts.txt`` an operator
drains from) can be read as this run's when this run dies before writing its own.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import NamedTuple

from ..errors import ConfigError, ReportWriteError
from ..model import FAIL, Report
from . import files, hosts, metrics, page, plot, summary
from .report import to_json_line, write_report

ARTIFACTS = ("report.json", "junit.xml", plot.FILENAME, page.FILENAME, *hosts.LISTS.values(),
             hosts.RAIL_LIST)


def prepare(report_dir: str, room: bool = True) -> list[str]:
    """Before a run: the folder must be writable, and every artifact of an earlier run goes;
    with ``room`` (the report's writer, at its start), room for the report is kept there
    (:func:`.files.hold_room`, freed by :func:`publish`). Returns the paths removed.

    Raises:
        ConfigError: the folder cannot be written, or a stale file cannot be removed
            (another user's, in a sticky folder; a read-only one): the run must not start.
    """
    check_writable(report_dir)
    gone = []
    for name in ARTIFACTS:
        path = os.path.join(report_dir, name)
        try:
            os.unlink(path)  # a symlink is removed, never followed
        except FileNotFoundError:
            continue
        except OSError as e:
            raise ConfigError(f"--report-dir {report_dir}: cannot remove {name} left by another "
                              f"run ({e.strerror}); remove it or choose another folder") from None
        gone.append(path)
    if room:  # for the report, should the folder fill during the run
        files.hold_room(report_dir)
    return gone


def check_writable(report_dir: str, room: bool = True) -> None:
    """The folder can be made and written (a probe file, removed again); else ConfigError.
    ``room``: the probe holds a byte, so a full filesystem fails too; False (a rank that does
    not write the report) only creates it: ranks probing at once would race for the last
    free block of a nearly full one, and which of them failed would be chance."""
    if os.path.exists(report_dir) and not os.path.isdir(report_dir):
        raise ConfigError(f"--report-dir {report_dir}: is a file, not a folder; choose a folder "
                          "(it is made when missing)")
    probe = os.path.join(report_dir, f".write-test-{os.getpid()}")
    try:
        os.makedirs(report_dir, exist_ok=True)
        with open(probe, "w") as f:
            f.write("x" if room else "")  # a full filesystem still creates an empty file
    except OSError as e:
        raise ConfigError(f"--report-dir {report_dir}: not writable ({e.strerror})") from None
    finally:  # the probe goes even when writing it failed (ENOSPC at close)
        with contextlib.suppress(OSError):
            os.unlink(probe)


class Published(NamedTuple):
    verdict: str  # what the ranks still waiting are told: ``fail`` when the report was lost
    path: str     # report.json's path, or "(not written: why)"


# what a rank says on stderr when the folder takes no report (full, read-only), before it
REPORT_FOLLOWS = "the report follows as one JSON line"


class Said(NamedTuple):
    report: dict  # the report a rank put on stderr
    why: str      # why the folder took none: "cannot write PATH: No space left on device …"


def unwritten(line: str) -> str | None:
    """Why the folder took no report, from the line where a rank says so (it ends in
    :data:`REPORT_FOLLOWS`); None for any other line."""
    if not line.endswith(REPORT_FOLLOWS):
        return None
    return line[:-len(REPORT_FOLLOWS)].rstrip("; ").split("error: ", 1)[-1]


def report_in_stderr(text: str) -> Said | None:
    """The report a rank wrote to stderr as one JSON line (after :data:`REPORT_FOLLOWS`), and
    why, from the text of its stderr; None when there is none."""
    lines = text.splitlines()
    for said, line in zip(lines, lines[1:]):
        if (why := unwritten(said)) is not None and line.startswith("{"):
            with contextlib.suppress(ValueError):
                report = json.loads(line)
                if isinstance(report, dict):
                    return Said(report, why)
    return None


def publish(report: Report, report_dir: str, run_id: str,
            print_summary: bool = True) -> Published:
    """Write every output of a finished run, in this order: report.json and junit.xml, the
    plot, the page (report.html), the host lists (and ``--act``), the Prometheus file; then
    the human summary, which ends on the verdict line (hosts, next steps and where the optional
    files went come just before it). ``print_summary`` False (a launcher that prints its own
    last line): only those lines before it. A report that cannot be written goes to stderr as
    one JSON line. Never raises."""
    lost, png = False, None
    for first in (True, False):
        try:
            path = write_report(report, report_dir)
            png = plot.write_busbw_png(report, report_dir)  # only with matplotlib installed
            page.write(report, report_dir)  # report.html, with history when ROOT has runs
            break
        except (ReportWriteError, OSError) as e:  # full, over quota, read-only, stale NFS
            if first and files.free_room(report_dir):  # the folder filled during the run
                print(f"ddp-smoke: warning: {e}; written in the room kept for the report "
                      "instead: the folder is full", file=sys.stderr)
                continue
            path, lost = f"(not written: {e})", True
            print(f"ddp-smoke: error: {e}; {REPORT_FOLLOWS}", file=sys.stderr)
            print(to_json_line(report), file=sys.stderr)
            break
    files.free_room(report_dir)  # the run's outputs are out: no room is held past them
    said = hosts.finish(report, report_dir, run_id)
    prom = metrics.write(report, run_id)  # --prometheus FILE, when set
    # where the optional files went, or why they are absent: a missing file asks a question
    if plot.bandwidth_rows(report) and not lost:
        said.append(f"# {plot.FILENAME}: {png or plot.not_drawn(report) or 'not written'}")
    if prom:
        said.append(f"# prometheus textfile: {prom}")
    if print_summary:
        summary.print_report(report, path, said)
    elif said:
        print("\n".join(said), flush=True)
    return Published(FAIL if lost else report.verdict, path)
