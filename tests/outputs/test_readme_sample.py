"""README's "What `make smoke-local` prints" is a real run's output, and stays one.

The test runs what ``make smoke-local`` runs (``python -m ddp_smoke.launch_local``: 2 gloo
ranks, level quick) and compares its output with README's block, line by line, with what
differs between runs and machines masked: numbers, the host name, the run id, the CPU's
name, the filesystem. A check added or renamed, a line added or dropped, "7/7" against
"7/8": the test fails (issue 25: the sample had 7 checks while the suite had 8).

``DDP_SMOKE_UPDATE_README=1`` writes the run's output into README first (host shown as
``vm``, the folder it ran in as ``~/ddp-smoke``): how the sample is made.
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent
README = REPO / "README.md"
HEAD = "## What `make smoke-local` prints\n\n```\n"


def _block(text: str) -> tuple[int, int]:
    start = text.index(HEAD) + len(HEAD)
    return start, text.index("```\n", start)


def _mask(lines: list[str]) -> list[str]:
    out, in_compute = [], False
    for line in lines:
        if line.startswith("# warning: "):  # ranks outnumber cores on this machine only
            continue
        # README shows make smoke-local's venv (no matplotlib); the test venv has it
        line = re.sub(r" once matplotlib is installed: [^)]*\)$", ")", line)
        line = re.sub(r"local-\d{8}-\d{6}-[0-9a-f]+", "RUN", line)
        line = re.sub(r"ddp-smoke-[0-9a-f]+…?", "ddp-smoke-X", line)
        line = re.sub(r"\((ext4|xfs|tmpfs|overlay|btrfs|nfs4?|zfs|[a-z0-9]+)\)$", "(FS)", line)
        if line.startswith("# check"):
            in_compute = False
        if in_compute and not line.startswith("#"):
            line = " ".join(line.split()[:4])  # rank host threads GFLOPS; then the CPU's name
        if line.startswith("# compute:"):
            in_compute = True
        line = re.sub(r"\d+(\.\d+)?", "0", line)
        out.append(" ".join(line.split()))
    return out


@pytest.mark.timeout(180)
def test_readme_sample_is_what_make_smoke_local_prints(tmp_path):
    p = subprocess.run([sys.executable, "-m", "ddp_smoke.launch_local", "--nproc-per-node=2",
                        "--", "--backend", "gloo", "--level", "quick"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=150,
                       stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    host = socket.gethostname()
    # the host as `vm`, the test's folder as a user's checkout: what README shows
    ran = [re.sub(rf"\b{re.escape(host)}\b", "vm", line).replace(str(tmp_path), "~/ddp-smoke")
           .rstrip() for line in p.stdout.splitlines()]
    text = README.read_text()
    start, end = _block(text)
    if os.environ.get("DDP_SMOKE_UPDATE_README") == "1":
        kept = [line for line in ran if not line.startswith("# warning: ")]
        text = text[:start] + "\n".join(kept) + "\n" + text[end:]
        README.write_text(text)
        start, end = _block(text)
    sample = text[start:end].splitlines()
    assert _mask(sample) == _mask(ran), "\n".join(
        ["README's sample drifted from a real run; regenerate it with "
         "DDP_SMOKE_UPDATE_README=1. The run printed:", *ran])
