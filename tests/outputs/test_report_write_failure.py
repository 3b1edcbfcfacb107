"""The report's own failure on a real full filesystem: nothing lost, nobody left waiting."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import time

import pytest

from ddp_smoke import outputs
from ddp_smoke.errors import ConfigError
from tests import report_schema
from tests.launch import torchrun
from tests.sandbox.faults import SmallFolder


@contextlib.contextmanager
def _full_tmpfs(path, free_bytes: int):
    """A 256 KiB tmpfs at ``path`` filled up to ``free_bytes`` (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(path)], check=True)
    try:
        with open(path / "filler", "wb") as f:
            f.write(b"\0" * (256 * 1024 - free_bytes))
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


@pytest.mark.timeout(180)
def test_full_report_dir_keeps_the_report_on_stderr_and_releases_every_rank(tmp_path):
    # two pages free: the writer's probe byte and the ranks' fatal/ folder (their last words,
    # coordination/fate.py; a tmpfs directory takes a page), never report.json
    with _full_tmpfs(tmp_path / "full", 8192) as full:
        run = torchrun(2, "--checks", "environment,ddp_step", "--timeout", "60",
                       report_dir=full / "report")
        left = sorted(os.listdir(full / "report"))
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if "ddp-smoke: error: cannot write" in line]
    assert len(errors) == 1, run.stderr[-3000:]
    assert "report.json: No space left on device (ENOSPC)" in errors[0]
    lines = [report_schema.validate(json.loads(line), "the report on stderr")
             for line in run.stderr.splitlines() if line.startswith('{"verdict"')]
    assert len(lines) == 1 and lines[0]["verdict"] == "pass"  # the checks passed; nothing lost
    # torchrun prints its own traceback for a failed worker; none may come from the kit
    assert not [line for line in run.stderr.splitlines()
                if line.lstrip().startswith("File ") and "ddp_smoke" in line], run.stderr[-3000:]
    assert run.wall_s < 60, run.wall_s  # rank 1 had the verdict at once, not after its timeout
    assert "report.json" not in left and "junit.xml" not in left  # never one without the other


@pytest.mark.timeout(180)
def test_ranks_whose_output_files_are_on_a_full_filesystem_still_pass(tmp_path):
    """torchrun --tee with its log folder on a full filesystem (the Slurm template puts it in
    the report folder): every print of a rank failed with ENOSPC, each rank died on its next
    line, its error file stayed empty and torchrun's agent died parsing it (exit 1, found by
    the campaign's disk_full.rank0.environment.slurm.1x3). Lines are lost, not the run."""
    with _full_tmpfs(tmp_path / "full", 0) as full:
        run = torchrun(2, "--checks", "environment", report_dir=tmp_path / "report",
                       launcher=("--tee=3", f"--log-dir={full / 'logs'}"))
    assert "Failed to parse reply file" not in run.stderr, run.stderr[-3000:]
    assert run.returncode == 0 and run.report["verdict"] == "pass", run.stderr[-3000:]


@pytest.mark.timeout(30)
def test_a_full_folder_is_bad_input_for_the_writer_only_and_leaves_no_probe(tmp_path):
    """The writer's probe holds a byte (a full disk fails it, and its empty file goes too);
    the other ranks' probe only creates one: on a nearly full disk they would race for the
    last block with the writer, and chance would pick who fails."""
    with _full_tmpfs(tmp_path / "full", 0) as full:
        with pytest.raises(ConfigError, match=r"not writable \(No space left on device\)"):
            outputs.check_writable(str(full / "r"))
        assert os.listdir(full / "r") == []
        outputs.check_writable(str(full / "r"), room=False)
        assert os.listdir(full / "r") == []


@pytest.mark.timeout(180)
def test_a_folder_that_fills_during_the_run_takes_the_report_in_the_room_kept_for_it(tmp_path):
    """The campaign's disk_full.rank0.environment.slurm.1x3: the folder filled mid-run, and the
    report put on stderr instead was cut where the ranks' own output files share that folder
    (the Slurm template's torchrun --log-dir): the run left no report anywhere. Rank 0 keeps
    room for the report at its start; the report takes it, and says the folder is full."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    with SmallFolder(tmp_path / "small", size=16 << 20) as folder:
        report_dir = folder.path / "report"

        def fill_once_room_is_kept():
            end = time.monotonic() + 60
            while not (report_dir / ".ddp-smoke-room").exists() and time.monotonic() < end:
                time.sleep(0.02)
            folder.fill()
        filler = threading.Thread(target=fill_once_room_is_kept, daemon=True)
        filler.start()
        run = torchrun(2, "--checks", "environment,ddp_step", "--duration", "3", "--timeout",
                       "60", report_dir=report_dir)
        filler.join(timeout=5)
        report, left = run.report, sorted(os.listdir(report_dir))
        assert os.statvfs(folder.path).f_bavail * os.statvfs(folder.path).f_frsize < (4 << 20)
    assert run.returncode == 0 and report["verdict"] == "pass", run.stderr[-3000:]
    assert "; written in the room kept for the report instead: the folder is full" in \
        run.stderr, run.stderr[-3000:]
    assert "report.json" in left and ".ddp-smoke-room" not in left, left
