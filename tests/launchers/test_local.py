"""`make smoke-local` as a new user meets it (issue 25): which torch the venv gets, bad input
before any rank starts, a failing run that ends on the kit's own last line, one folder per run.

The launcher is ``python -m ddp_smoke.launch_local`` (what the Makefile runs), started as a
real process; the runs are real torchrun launches with 2 gloo ranks.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.launch import torchrun

REPO = Path(__file__).resolve().parent.parent.parent
CHOICE = REPO / "job" / "torch_choice.sh"


# -- item 1: the first download -------------------------------------------------------------

def _choice(**env) -> str:
    """The decision, dry run, with this machine's pip configuration hidden (PIP_CONFIG_FILE
    /dev/null and no PIP_* variables) unless the case sets its own."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    clean.update({"PIP_CONFIG_FILE": os.devnull, "PIP": f"{sys.executable} -m pip", **env})
    p = subprocess.run(["sh", str(CHOICE), "--dry-run"], capture_output=True, text=True,
                       env=clean, timeout=60, check=True)
    return p.stdout.strip()


@pytest.mark.parametrize("env, expected", [
    ({"DDP_SMOKE_GPU": "0"},
     "torch: torch==2.13.0, the CPU-only build from https://download.pytorch.org/whl/cpu "
     "(no NVIDIA GPU here)"),
    ({"DDP_SMOKE_GPU": "1"}, "torch: torch==2.13.0, the CUDA build from PyPI (an NVIDIA GPU is "
                             "present)"),
    ({"DDP_SMOKE_GPU": "0", "PIP_FIND_LINKS": "/opt/wheels"},
     "torch: torch==2.13.0 from pip's own configuration (:env:.find-links='/opt/wheels')"),
    ({"DDP_SMOKE_GPU": "1", "PIP_NO_INDEX": "1"},
     "torch: torch==2.13.0 from pip's own configuration (:env:.no-index='1')"),
    ({"DDP_SMOKE_GPU": "0", "PIP_FIND_LINKS": "/w", "PIP_EXTRA": "--index-url https://x/cu126",
      "TORCH_SPEC": "torch==2.12.0"},
     "torch: torch==2.12.0 with PIP_EXTRA as given (--index-url https://x/cu126)"),
], ids=["no-gpu", "gpu", "local-wheels", "no-index", "overrides-win"])
def test_torch_choice(env, expected):
    assert _choice(**env) == expected


def test_the_makefile_installs_what_the_choice_prints():
    """`make` itself, dry: the venv recipe takes torch's pip arguments from the script; and on
    a machine without a GPU or pip configuration those arguments are the CPU index."""
    p = subprocess.run(["make", "-n", "/tmp/ddp-smoke-choice/.runtime",
                        "VENV=/tmp/ddp-smoke-choice"], cwd=REPO, capture_output=True, text=True,
                       timeout=60, check=True)
    assert "sh job/torch_choice.sh) && " in p.stdout and "install $args numpy" in p.stdout
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    args = subprocess.run(["sh", str(CHOICE)], capture_output=True, text=True, timeout=60,
                          env={**clean, "PIP_CONFIG_FILE": os.devnull, "DDP_SMOKE_GPU": "0",
                               "PIP": f"{sys.executable} -m pip"}, check=True)
    assert args.stdout.split() == ["--index-url", "https://download.pytorch.org/whl/cpu",
                                   "--extra-index-url", "https://pypi.org/simple",
                                   "torch==2.13.0"]
    assert args.stderr.startswith("ddp-smoke: torch: torch==2.13.0, the CPU-only build")


# -- items 2 and 4: bad input, once, before any rank ------------------------------------------

def _local(*worker_args: str, cwd: Path, nproc: int = 2, timeout: float = 120,
           merged: bool = False):
    """make smoke-local's launcher; ``merged``: stderr into stdout, the terminal's one stream."""
    return subprocess.run([sys.executable, "-m", "ddp_smoke.launch_local",
                           f"--nproc-per-node={nproc}", "--", "--backend", "gloo",
                           "--level", "quick", *worker_args],
                          cwd=cwd, stdout=subprocess.PIPE, text=True, timeout=timeout,
                          stderr=subprocess.STDOUT if merged else subprocess.PIPE,
                          stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("argv, line", [
    (["--checks", "enviroment,ddp_step"],
     "ddp-smoke: error: key 'checks' = 'enviroment,ddp_step': unknown check 'enviroment' (did "
     "you mean 'environment'?)"),
    (["--chekcs", "environment"],
     "ddp-smoke: error: unrecognized arguments: --chekcs environment; did you mean --checks?"),
    (["--fault", "1:crash@collectives", "--act", "slurm-drain"],
     "ddp-smoke: error: keys 'act' and 'fault': --act slurm-drain never acts on an injected "
     "fault"),
    (["--fault", "2:crash@collectives"],
     "ddp-smoke: error: key 'fault' = '2:crash@collectives': rank out of range for WORLD_SIZE=2"),
    (["--profile", "h100-8gpu"],
     "ddp-smoke: error: --profile h100-8gpu does not fit this run: it is for H100 GPUs and "
     "--backend gloo runs the checks on CPUs"),
    (["--report-dir", "r.txt"],  # issue 35: "File exists" before
     "ddp-smoke: error: --report-dir r.txt: is a file, not a folder; choose a folder"),
    (["--config", "c.yaml"],  # issue 35: no "did you mean" for a key in a file before
     "ddp-smoke: error: unknown key 'timout' (c.yaml); did you mean 'timeout'? valid keys: "),
], ids=["check-typo", "flag-typo", "fault-with-act", "fault-rank", "gpu-profile-on-cpu",
        "report-dir-is-a-file", "config-key-typo"])
def test_bad_input_is_one_line_and_exit_2_before_any_rank_starts(tmp_path, argv, line):
    (tmp_path / "r.txt").write_text("a file\n")
    (tmp_path / "c.yaml").write_text("timout: 30\n")
    p = _local(*argv, cwd=tmp_path, timeout=30)
    assert p.returncode == 2, p.stderr
    assert p.stdout == "" and p.stderr.count("\n") == 1 and p.stderr.startswith(line), p.stderr
    assert not (tmp_path / "reports").exists()  # no rank started, nothing made


def test_under_make_a_mistake_is_the_kits_line_and_makes_own(tmp_path):
    """Issue 35 item 4: before, 5 lines (a bare store address, the store host's "serving …"
    and "no rank ever posted the run's shape" around the kit's line) and 3-4 s, the store
    host importing torch before the options were checked. Now the kit's line, then make's;
    and the launcher never imports torch for bad input."""
    p = subprocess.run(["make", "-s", "smoke-local", f"REPORT_DIR={tmp_path / 'r'}",
                        "ARGS=--chekcs environment"], cwd=REPO, capture_output=True, text=True,
                       timeout=60, stdin=subprocess.DEVNULL)
    assert p.returncode == 2 and p.stdout == "", (p.stdout, p.stderr)
    assert p.stderr.splitlines()[0] == ("ddp-smoke: error: unrecognized arguments: --chekcs "
                                        "environment; did you mean --checks?"), p.stderr
    assert len(p.stderr.splitlines()) == 2 and "Error 2" in p.stderr.splitlines()[1], p.stderr
    probe = subprocess.run(
        [sys.executable, "-c", "import sys; from ddp_smoke import launch_local; "
         "rc = launch_local.main(['--', '--chekcs', 'environment']); "
         "print(rc, 'torch' in sys.modules)"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert probe.stdout == "2 False\n", probe.stdout + probe.stderr


@pytest.mark.timeout(120)
def test_under_make_a_failed_check_ends_on_the_verdict_then_makes_line_with_the_kits_status(
        tmp_path):
    """Issue 49: what README and the Makefile say make does with a failed check: the kit's
    verdict is its last line, make adds `make: *** [...] Error 1` (1: the kit's status) and
    exits 2, its own code for a failed recipe."""
    p = subprocess.run(["make", "-s", "smoke-local", f"REPORT_DIR={tmp_path / 'r'}",
                        "ARGS=--checks environment,ddp_step --fault 1:crash@ddp_step"],
                       cwd=REPO, capture_output=True, text=True, timeout=110,
                       stdin=subprocess.DEVNULL)
    assert p.returncode == 2, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    assert p.stdout.rstrip().splitlines()[-1].startswith("verdict: FAIL (PRACTICE: "), p.stdout
    last = p.stderr.rstrip().splitlines()[-1]  # make[1]: under another make (make test)
    assert re.fullmatch(r"make(\[\d+\])?: \*\*\* \[Makefile:\d+: smoke-local\] Error 1", last), \
        p.stderr[-2000:]
    assert json.loads((tmp_path / "r" / "report.json").read_text())["verdict"] == "fail"


def test_more_ranks_than_the_cores_can_hold_is_bad_input_unless_asked_for(tmp_path):
    """Issue 35: NPROC=64 on 2 cores only warned, then asked ~25 GB and minutes of imports.
    Beyond 4 ranks per core: one line, exit 2, nothing started; --oversubscribe (make's
    OVERSUBSCRIBE=1) runs it anyway. Up to 4 per core it runs, with a warning."""
    from ddp_smoke import launch_local
    cores = len(os.sched_getaffinity(0))
    p = _local("--checks", "environment", cwd=tmp_path, nproc=4 * cores + 1, timeout=30)
    assert p.returncode == 2 and p.stdout == "", p.stderr
    assert p.stderr == (f"ddp-smoke: error: --nproc-per-node {4 * cores + 1} on {cores} CPU "
                        "core(s): more than 4 ranks per core (each a Python process with torch, "
                        f"~0.4 GB): choose at most {4 * cores}, or add --oversubscribe (make "
                        "smoke-local OVERSUBSCRIBE=1) to run it\n")
    assert not (tmp_path / "reports").exists()
    for argv in (["--nproc-per-node=64", "--oversubscribe"], [f"--nproc-per-node={4 * cores}"]):
        assert launch_local._split([*argv, "--", "--checks", "environment"])[0] == \
            int(argv[0].split("=")[1])
    make = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    assert "--nproc-per-node=$(NPROC) $(if $(OVERSUBSCRIBE),--oversubscribe) --" in make


@pytest.mark.parametrize("launcher, worker, status, says", [
    (["--nnodes", "2", "--nproc-per-node=1"], ["--fault", "2:crash@collectives"], 2,
     "rank out of range for WORLD_SIZE=2"),
    # a count torchrun resolves on each node (gpu, MIN:MAX): what depends on it is the ranks'
    (["--nnodes=1:4", "--nproc-per-node", "gpu"], ["--fault", "9:crash@collectives"], 0, ""),
    ([], ["--chekcs", "environment"], 2, "did you mean --checks?"),
    ([], ["--checks", "environment"], 0, ""),
], ids=["world-size", "counts-unknown", "flag-typo", "good"])
def test_check_only_starts_nothing(tmp_path, launcher, worker, status, says):
    """``--check``: what the image's entrypoint runs once before its torchrun (issue 25)."""
    p = subprocess.run([sys.executable, "-m", "ddp_smoke.launch_local", "--check", *launcher,
                        "--", "--backend", "gloo", *worker], cwd=tmp_path, capture_output=True,
                       text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert (p.returncode, p.stdout) == (status, ""), p.stderr
    assert p.stderr.count("\n") == (1 if says else 0) and says in p.stderr, p.stderr
    # a good run's folder was tested (made, written, the claim tried); nothing else was made
    made = [f.name for f in (tmp_path / "reports").glob("*/*")] if status == 0 else []
    assert made == ([".ddp-smoke.lock"] if status == 0 and not launcher else []), made


def test_a_report_folder_that_cannot_be_written_is_bad_input(tmp_path):
    """Issue 25 item 4 (before: 78 lines in 14.5 s, a FAIL table blaming the launcher)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a read-only tmpfs needs root")
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(ro)], check=True)
    try:
        p = _local("--report-dir", str(ro / "rep"), cwd=tmp_path, timeout=30)
    finally:
        subprocess.run(["umount", str(ro)], check=True)
    assert p.returncode == 2
    assert p.stderr == (f"ddp-smoke: error: --report-dir {ro / 'rep'}: not writable "
                        "(Read-only file system)\n") and p.stdout == ""


@pytest.mark.timeout(120)
def test_bad_input_a_rank_finds_under_plain_torchrun_leads_with_no_kit_traceback(tmp_path):
    """Issue 35: a mistake only the ranks can see (the world size) under a hand-written
    torchrun. Before: the kit's ConfigError left the @record-wrapped run and torchrun printed
    its traceback once per rank in its failure box (65 lines). Now the kit's line comes before
    anything of the failure, and no frame of the kit's code appears."""
    run = torchrun(2, "--backend", "gloo", "--fault", "5:crash@compute",
                   report_dir=tmp_path / "r", env={"OMP_NUM_THREADS": "1"})
    assert run.returncode == 1, run.stderr  # torchrun's agent: 1 whatever the workers said
    lines = run.stderr.splitlines()
    said = [i for i, ln in enumerate(lines) if "ddp-smoke: error:" in ln]
    assert [lines[i] for i in said] == ["ddp-smoke: error: key 'fault' = '5:crash@compute': "
                                        "rank out of range for WORLD_SIZE=2"], run.stderr
    assert said[0] == 0, run.stderr  # first: torchrun's "failed" line and box come after it
    assert "ddp_smoke/" not in run.stderr and "ConfigError" not in run.stderr, run.stderr
    assert "exitcode  : 2" in run.stderr  # the workers' own status, in torchrun's box


@pytest.mark.timeout(120)
def test_bad_input_under_plain_torchrun_is_said_once(tmp_path):
    """Without the local launcher (sbatch, the image: torchrun itself) every rank finds the
    mistake; only local rank 0 says it, on a line of its own."""
    run = torchrun(2, "--chekcs", "environment", report_dir=tmp_path / "r")
    said = [line for line in run.stderr.splitlines() if "ddp-smoke: error:" in line]
    assert said == ["ddp-smoke: error: unrecognized arguments: --chekcs environment; did you "
                    "mean --checks?"], run.stderr


# -- items 3, 5, 6, 7: a failing run; two at once --------------------------------------------

@pytest.mark.timeout(180)
def test_a_failing_run_ends_on_the_kits_line_and_leads_with_the_culprit(tmp_path):
    """Rank 1 crashes in collectives (an injected fault). Before: torchrun's ChildFailedError
    block after the verdict, the report's error naming rank 0's "Connection reset by peer",
    drain and cordon lines for a laptop, nothing saying the fault was injected."""
    p = _local("--checks", "environment,collectives", "--fault", "1:crash@collectives",
               "--report-dir", str(tmp_path / "r"), cwd=tmp_path, merged=True)
    out = p.stdout
    assert p.returncode == 1, out[-3000:]
    assert "Traceback" not in out and "ChildFailedError" not in out, out[-3000:]
    # issue 35: the verdict is the last line of the terminal (stdout and stderr alike)
    lines = out.rstrip().splitlines()
    assert lines[-1].startswith("verdict: FAIL (PRACTICE: --fault 1:crash@collectives) — "), \
        out[-2000:]
    assert lines[-2].startswith("# next steps: none; the failures were injected"), out[-2000:]
    assert "# injected on purpose (--fault 1:crash@collectives)" in out
    assert "store host" not in out, out[-2000:]  # no store-host chatter (issue 35 item 4)
    assert "scontrol" not in out and "kubectl" not in out
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["injected"] == "1:crash@collectives"
    assert (report["error"]["rank"], report["error"]["stage"]) == (1, "collectives"), report
    junit = ET.parse(tmp_path / "r" / "junit.xml").getroot()
    [run] = [t for t in junit.iter("testcase") if t.get("name") == "run"]
    assert run.find("failure").get("message").startswith(
        "PRACTICE, injected on purpose (--fault 1:crash@collectives), not this cluster's fault: "
        "rank 1 host "), ET.tostring(run)
    assert [p.get("value") for p in junit.iter("property") if p.get("name") == "injected"] \
        == ["1:crash@collectives"]


@pytest.mark.timeout(180)
def test_two_runs_started_together_each_own_a_folder(tmp_path):
    """Before: both in reports/local-<second>, both printing PASS and that path, one report
    lost. Now each run's id (local-<time>-<random>) names its folder."""
    argv = [sys.executable, "-m", "ddp_smoke.launch_local", "--", "--backend", "gloo",
            "--checks", "environment"]
    procs = [subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, text=True,
                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
             for _ in range(2)]
    outs = [proc.communicate(timeout=150)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outs
    folders = sorted((tmp_path / "reports").iterdir())
    assert len(folders) == 2, outs
    for folder in folders:
        report = json.loads((folder / "report.json").read_text())
        assert report["verdict"] == "pass" and report["run_id"] == folder.name
        assert folder.name.startswith("local-")
        assert not (folder / "fatal").exists()  # no empty last-words files after a pass
    assert sum(f"report reports/{f.name}/report.json" in o for f in folders for o in outs) == 2


def test_a_folder_a_live_run_holds_is_refused(tmp_path):
    """The worker's claim on its folder: a second run naming the same --report-dir is bad
    input while the first lives (the kernel drops the claim when the holder exits)."""
    from ddp_smoke.config import prelaunch
    from ddp_smoke.errors import ConfigError

    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from ddp_smoke.config import prelaunch; "
        f"prelaunch.hold({str(tmp_path)!r}, 'first-run'); print('held', flush=True); "
        "sys.stdin.read()")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(ConfigError, match=r"in use by run first-run \(pid "):
            prelaunch.hold(str(tmp_path), "second-run", keep=False)
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    prelaunch.hold(str(tmp_path), "second-run", keep=False)  # released with its process


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (the launcher's forked ranks)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return sorted(kids)


@pytest.mark.timeout(180)
def test_every_rank_killed_the_launcher_writes_the_report(tmp_path):
    """The launcher holds the coordination store itself (issue 34: no store-host process
    before the first rank): it outlives every rank, and when all of them are killed at once
    mid-run it writes the report of last resort from what the store holds, at once."""
    proc = subprocess.Popen([sys.executable, "-m", "ddp_smoke.launch_local", "--", "--backend",
                             "gloo", "--checks", "environment,collectives", "--fault",
                             "1:hang@collectives", "--timeout", "60", "--report-dir",
                             str(tmp_path / "r")],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, stdin=subprocess.DEVNULL)
    lock = tmp_path / "r" / ".ddp-smoke.lock"
    deadline = time.monotonic() + 60
    while not (lock.exists() and "(pid " in lock.read_text()) or len(_children(proc.pid)) < 2:
        assert time.monotonic() < deadline and proc.poll() is None, "the ranks never started"
        time.sleep(0.1)
    time.sleep(1.5)  # in collectives now: rank 1 hangs there, rank 0 waits for it
    for pid in _children(proc.pid):
        os.kill(pid, 9)
    killed = time.monotonic()
    out, err = proc.communicate(timeout=60)
    took = time.monotonic() - killed
    assert proc.returncode == 1, err[-3000:]
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["error"]["type"] == "AllRanksLost", report["error"]
    [stopped] = [c for c in report["checks"] if c["status"] == "fail"]
    assert stopped["name"] == "collectives" and report["written_by"] == "store host"
    assert sorted(c["rank"] for c in stopped["culprits"]) == [0, 1], stopped["culprits"]
    assert "no rank wrote the report" in err and "Traceback" not in err, err[-3000:]
    # both: torchrun's agent reports the first it found failed (either, under load), the
    # Witness saw the other's end too
    assert err.rstrip().splitlines()[-1] == ("ddp-smoke: no verdict: rank 0 killed by SIGKILL, "
                                             "rank 1 killed by SIGKILL"), err[-2000:]
    assert took < 30, took  # not a heartbeat timeout's worth: the launcher knows


def test_submit_help_is_options_with_defaults():
    """Issue 25: `ddp-smoke-submit --help` was the module's rationale, no defaults, and its
    usage lacked `-- WORKER_ARGS`."""
    p = subprocess.run([str(Path(sys.executable).parent / "ddp-smoke-submit"), "--help"],
                       capture_output=True, text=True, timeout=60, check=True)
    assert p.stdout.startswith("usage: ddp-smoke-submit [options] [-- WORKER_ARGS …]\n")
    options = [line.split()[0] for line in p.stdout.splitlines() if line.startswith("  --")]
    assert "--cluster" in options and "--wait-timeout" in options
    for option in ("--cluster", "--nodes", "--procs-per-node", "--gpus-per-node", "--time-min",
                   "--folder", "--wait-timeout", "--container-python", "--cpus-per-proc"):
        said = p.stdout[p.stdout.index(f"  {option}"):].split("\n  --")[0]
        assert "(default" in said, said
    assert "TorchDistributedEnvironment" not in p.stdout  # the rationale stays in the module


@pytest.mark.timeout(120)
def test_ctrl_c_ends_in_one_line_and_the_signals_status(tmp_path):
    """SIGINT to the launcher mid-run (as Ctrl-C sends it to the launcher alone when the
    ranks are elsewhere): torchrun stops the ranks; no traceback, exit 128 + 2."""
    proc = subprocess.Popen([sys.executable, "-m", "ddp_smoke.launch_local", "--", "--backend",
                             "gloo", "--checks", "environment,collectives", "--fault",
                             "1:hang@collectives", "--timeout", "60"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, stdin=subprocess.DEVNULL)
    # Rank 0 has claimed the folder (its lock names its pid): the ranks run, the agent waits.
    deadline = time.monotonic() + 60
    while not any("(pid " in lock.read_text()
                  for lock in tmp_path.glob("reports/*/.ddp-smoke.lock")):
        assert time.monotonic() < deadline and proc.poll() is None, "the ranks never started"
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(2)
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "ChildFailedError" not in err, err[-3000:]
    assert err.rstrip().splitlines()[-1] == ("ddp-smoke: stopped by SIGINT; the ranks were "
                                             "stopped too"), err[-3000:]
