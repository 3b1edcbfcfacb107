"""``ddp-smoke node-check`` on this machine: the node tier's verdict, lines, report and memory.

Real runs: the worker on 2 CPU ranks under torchrun; a replayed faulty GPU node
(DDP_SMOKE_HEALTH_REPLAY) through the same path; a node held by a real cgroup CPU quota; a
missing interface and a full report filesystem (preflight's findings: no worker starts). Its
time is measured in bench/node_check.py, never asserted here. Slurm: test_node_check_slurm.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import report_schema
from tests.outputs.test_report_write_failure import _full_tmpfs
from tests.sandbox.faults import CpuQuota

REPO = Path(__file__).resolve().parents[2]
HEALTH = REPO / "tests" / "data" / "health"


def _node_check(*args: str, env: dict | None = None, timeout_s: float = 120,
                quota: CpuQuota | None = None) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "ddp_smoke", "node-check", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    if quota is not None:
        quota.add(proc.pid)  # before it starts any child: they inherit the group
    out, err = proc.communicate(timeout=timeout_s)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _report(run: subprocess.CompletedProcess) -> dict:
    verdict = next(ln for ln in run.stdout.splitlines() if " · report " in ln)
    path = verdict.rsplit(" report ", 1)[1]
    return report_schema.read(Path(path))


def _lines(run) -> list[str]:
    return run.stdout.strip().splitlines()


@pytest.mark.parametrize("args,said", [
    (["--timeout", "1"], "--timeout 1: expected seconds in [5, 3600]"),
    (["--every", "0"], "--every 0: expected seconds in [1, 604800]"),
    (["--", "--report-dir", "x"], "--report-dir after --: node-check sets it"),
    (["--", "--checks", "health"], "--checks after --: node-check sets it"),
    (["--", "--level", "fast"], "argument --level: invalid choice: 'fast'"),
    (["--act", "reboot"], "argument --act: invalid choice: 'reboot'"),
    (["--report-root", "a", "--report-dir", "b"], "not allowed with argument"),
])
def test_bad_input_is_one_line_and_exit_2(args, said, tmp_path):
    given = {"--report-root", "--report-dir"} & set(args)
    run = _node_check(*([] if given else ["--report-root", str(tmp_path)]), *args)
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stdout == "" and len(run.stderr.splitlines()) == 1, run.stderr
    assert run.stderr.startswith("ddp-smoke: error: ") and said in run.stderr
    assert not list(tmp_path.iterdir())  # nothing ran


def test_a_missing_interface_is_one_finding_a_report_and_after_three_runs_a_lemon(tmp_path):
    """Preflight's finding: no worker starts. Three failing runs make the node a lemon; the
    history of the root says so, with the runs."""
    env = {"GLOO_SOCKET_IFNAME": "eth9", "NODE_NAME": "nodeA"}
    for i in range(3):
        run = _node_check("--report-root", str(tmp_path), env=env)
        assert run.returncode == 1, run.stdout + run.stderr
        lines = _lines(run)
        assert lines[0].startswith("ddp-smoke node-check: nodeA FAIL preflight: interfaces: "
                                   "GLOO_SOCKET_IFNAME=eth9: no interface eth9 on this node")
        assert lines[1].startswith("ddp-smoke node-check: nodeA FAIL in ")
        assert " · 1 finding(s) · report " in lines[1]
        assert (len(lines) == 3) == (i == 2), lines  # the third run: the lemon line
    assert lines[2].startswith("ddp-smoke node-check: nodeA LEMON failed 3 of its last 3 runs "
                               "-> reboot"), lines
    report = _report(run)
    assert report["run_id"].startswith("node-check-nodeA-")
    assert report["written_by"] == "node-check launcher"
    assert [(c["name"], c["status"]) for c in report["checks"]] == [("preflight", "fail")]
    assert [(h["host"], h["status"]) for h in report["hosts"]] == [("nodeA", "bad")]
    history = subprocess.run([sys.executable, "-m", "ddp_smoke", "history", str(tmp_path)],
                             capture_output=True, text=True, timeout=60)
    lemon = [ln for ln in history.stdout.splitlines() if ln.startswith("lemon nodeA")]
    assert lemon and "-> reboot" in lemon[0] and report["run_id"] in lemon[0], history.stdout


def test_keep_prunes_this_nodes_oldest_runs_only(tmp_path):
    other = tmp_path / "node-check-nodeAB-20200101-000000-abcdef"  # another node's run
    other.mkdir()
    env = {"GLOO_SOCKET_IFNAME": "eth9", "NODE_NAME": "nodeA"}
    for _ in range(3):
        _node_check("--report-root", str(tmp_path), "--keep", "2", env=env)
        time.sleep(1.1)  # run ids are to the second
    mine = sorted(p.name for p in tmp_path.glob("node-check-nodeA-*"))
    assert len(mine) == 2 and other.exists(), sorted(p.name for p in tmp_path.iterdir())


def test_a_full_report_filesystem_is_a_finding_and_the_report_reaches_stderr(tmp_path):
    with _full_tmpfs(tmp_path / "full", 2048) as full:
        run = _node_check("--report-root", str(full), env={"NODE_NAME": "nodeF"})
    assert run.returncode == 1, run.stdout + run.stderr
    first = _lines(run)[0]
    assert first.startswith("ddp-smoke node-check: nodeF FAIL preflight: report_dir: report "
                            f"folder {full}/node-check-nodeF-"), first
    assert "No space left on device" in first
    said = [json.loads(ln) for ln in run.stderr.splitlines() if ln.startswith('{"verdict"')]
    assert len(said) == 1 and report_schema.validate(said[0])["verdict"] == "fail"


@pytest.mark.timeout(180)
def test_a_healthy_cpu_node_passes_with_a_report_like_any_other(tmp_path):
    run = _node_check("--report-root", str(tmp_path), env={"NODE_NAME": "nodeP"})
    assert run.returncode == 0, run.stdout + run.stderr
    (line,) = _lines(run)
    assert line.startswith("ddp-smoke node-check: nodeP PASS in ") and " · 0 finding(s) · " in line
    report = _report(run)
    assert report["written_by"] == "rank 0" and report["world_size"] == 2
    assert [c["name"] for c in report["checks"]] == ["environment", "collectives", "bandwidth",
                                                     "health"]
    assert report["config"]["level"] == "quick"
    folder = Path(report["config"]["report_dir"])
    assert (folder / "node-check.log").read_text().count("verdict: PASS") == 1
    assert json.loads((folder / "preflight" / "nodeP.json").read_text())["ok"]
    health = next(c for c in report["checks"] if c["name"] == "health")
    (node,) = health["figures"]["nodes"]
    assert node["boot_id"] and any(x.startswith("CPU quota") for x in node["checked"])
    # the line says what a CPU node's PASS did not read; a passing run leaves no empty file
    assert " · health skipped: " in line and "hardware not read: GPUs: " in line, line
    empty = [p for p in folder.rglob("*") if p.is_file() and p.stat().st_size == 0
             and not p.name.endswith("_hosts.txt") and p.name != "bad_rails.txt"]
    assert not empty and not (folder / "fatal").exists(), empty


@pytest.mark.timeout(180)
def test_a_replayed_faulty_gpu_node_fails_with_one_line_per_finding(tmp_path):
    run = _node_check("--report-root", str(tmp_path), env={
        "NODE_NAME": "nodeG", "DDP_SMOKE_HEALTH_REPLAY": str(HEALTH / "xid79_kernel_log.json")})
    assert run.returncode == 1, run.stdout + run.stderr
    lines = _lines(run)
    report = _report(run)
    culprits = [k for c in report["checks"] for k in c["culprits"]]
    assert report["world_size"] == 2 and culprits  # CPU ranks; the recording's GPUs
    assert lines[:-1] == [f"ddp-smoke node-check: nodeG FAIL health: {k['reason']}"
                          for k in culprits], lines
    assert any("XID 79" in ln for ln in lines), lines


def test_skip_if_busy_skips_a_node_running_another_jobs_processes_and_not_its_own(tmp_path):
    """The DaemonSet's --skip-if-busy: a node whose GPUs run another job's processes is left
    unchecked; node-check's own process on a GPU is no other job (the campaign's
    gpu_faults_per_gpu.middle.health.daemonset.4x1: the replayed reader shows itself on GPU 0,
    PID 1 in the pod, and node-check skipped its faulty node as busy)."""
    own = _node_check("--report-root", str(tmp_path), "--skip-if-busy", env={
        "NODE_NAME": "nodeG", "DDP_SMOKE_HEALTH_REPLAY": str(HEALTH / "h200_faults_per_gpu.json")})
    assert own.returncode == 1 and "skipped" not in own.stdout, own.stdout + own.stderr
    assert "row remap pending" in own.stdout, own.stdout
    busy = tmp_path / "busy.json"  # a healthy node, another job's process on its GPU 1
    busy.write_text(json.dumps({"base": str(HEALTH / "h200_8gpu_healthy.json"), "patch": {
        "nvml.gpus.1.processes": [{"pid": 4242, "used_mib": 30000}]}}))
    other = _node_check("--report-root", str(tmp_path), "--skip-if-busy", env={
        "NODE_NAME": "nodeG", "DDP_SMOKE_HEALTH_REPLAY": str(busy)})
    assert other.returncode == 0, other.stdout + other.stderr
    assert "skipped: 1 process(es) of another job on its GPUs (pid 4242)" in other.stdout


@pytest.mark.timeout(180)
def test_a_node_under_a_cpu_quota_fails_with_the_quota_as_evidence(tmp_path):
    """A real throttle: node-check and everything it starts held to a tenth of a core. The
    worker finishes or not within the bound; either way the finding is the quota."""
    with CpuQuota(0.1, name=f"ddp-smoke-nodecheck-{os.getpid()}") as quota:
        run = _node_check("--report-root", str(tmp_path), "--timeout", "20",
                          env={"NODE_NAME": "nodeQ"}, quota=quota)
    assert run.returncode == 1, run.stdout + run.stderr
    findings = [ln for ln in _lines(run) if " FAIL " in ln and " FAIL in " not in ln]
    print("\n" + "\n".join(findings))
    assert findings and all("CPU quota" in ln for ln in findings), findings
    assert any("0.1 CPU" in ln for ln in findings), findings


def test_the_quota_evidence_of_a_worker_past_its_time_uses_the_runs_config(tmp_path):
    """Issue 50: node-check's own CPU-quota finding (a worker that ran past its bound wrote
    nothing) read the package defaults, so a ``--config`` after ``--`` was ignored there. The
    cgroup readings of 60 % of the periods throttled: the default rule (50 %) fails them, a
    site's 90 % does not."""
    from ddp_smoke import node_check

    def reading(periods, throttled):
        return {"version": "v2", "levels": [{"path": "/job", "quota_cpus": 0.5,
                                             "periods": periods, "throttled": throttled,
                                             "throttled_s": throttled * 0.05}]}
    before, after = reading(1000, 100), reading(1100, 160)
    _, _, cfg = node_check.parse(["--"])
    assert "CPU quota" in node_check._throttle(before, after, cfg["health"])
    site = tmp_path / "site.yaml"
    site.write_text("health:\n  cpu_throttled_fraction: 0.9\n")
    _, _, cfg = node_check.parse(["--", "--config", str(site)])
    assert node_check._throttle(before, after, cfg["health"]) == ""
