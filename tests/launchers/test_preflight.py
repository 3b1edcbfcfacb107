"""Preflight on this machine and the launcher's verdict from real files (issue 28).

The real-cluster cases are in test_preflight_slurm.py; here the pieces: NCCL's interface
syntax, the one error line taken from a traceback or srun's output, the records turned into a
report, and the command itself on loopback (a rendezvous host and a second node).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import sys
from pathlib import Path

import pytest

from ddp_smoke import interfaces
from ddp_smoke.coordination import lost
from ddp_smoke.outputs import REPORT_FOLLOWS
from ddp_smoke.outputs import launch_report as lr

PY = sys.executable


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("spec, expected", [
    ("eth", ["eth0", "eth1"]),             # a prefix
    ("=eth0", ["eth0"]),                   # exactly
    ("^lo,docker", ["eth0", "eth1", "ib0"]),  # anything but
    ("^=eth0", ["lo", "docker0", "eth1", "ib0"]),
    ("ib,eth1", ["eth1", "ib0"]),
    ("bond", []),
])
def test_nccl_socket_ifname_syntax(spec, expected):
    assert interfaces.nccl_matches(spec, ["lo", "docker0", "eth0", "eth1", "ib0"]) == expected


def test_interfaces_must_exist_and_carry_an_address():
    have = {"lo": ["127.0.0.1"], "eth0": ["10.0.0.5"], "ib0": []}
    ok, text = interfaces.check_interfaces({"GLOO_SOCKET_IFNAME": "eth0",
                                           "NCCL_SOCKET_IFNAME": "^lo"}, have)
    assert ok and "eth0 10.0.0.5" in text
    ok, text = interfaces.check_interfaces({"GLOO_SOCKET_IFNAME": "eth9"}, have)
    assert not ok and text.startswith("GLOO_SOCKET_IFNAME=eth9: no interface eth9"), text
    ok, text = interfaces.check_interfaces({"GLOO_SOCKET_IFNAME": "ib0"}, have)
    assert not ok and "ib0 has no address" in text
    ok, text = interfaces.check_interfaces({"NCCL_SOCKET_IFNAME": "=ib0"}, have)
    assert not ok and "matches no interface with an address" in text


TRACEBACK = """Traceback (most recent call last):
  File "<frozen runpy>", line 189, in _run_module_as_main
  File "/x/ddp_smoke/__init__.py", line 1, in <module>
    import missing_dep
ModuleNotFoundError: No module named 'missing_dep'
"""
TORCH_STACK = """[W1130 node3] TCPStore warning
Traceback (most recent call last):
  File "/x/torch/distributed/run.py", line 9, in main
torch.distributed.DistNetworkError: The client socket has timed out after 20000ms while trying to connect to (10.0.0.1, 29502).
Exception raised from throwTimeoutError at /pytorch/torch/csrc/distributed/c10d/socket.cpp:1021 (most recent call first):
frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x98 (0x7f in libc10.so)
"""


def test_error_line_is_the_exception_never_a_frame():
    assert lr.error_line(TRACEBACK.splitlines()) == \
        "ModuleNotFoundError: No module named 'missing_dep'"
    assert lr.error_line(TORCH_STACK.splitlines()).startswith(
        "torch.distributed.DistNetworkError: The client socket has timed out")
    assert lr.error_line(["noise", "ddp-smoke: error: --checks x: unknown"]) == \
        "ddp-smoke: error: --checks x: unknown"
    assert lr.error_line(["/opt/venv/bin/python: No such file or directory"]) == \
        "/opt/venv/bin/python: No such file or directory"
    assert lr.error_line([]) == ""


SRUN = """srun: error: Task launch for StepId=2.0 failed on node bnode3: Communication connection failure
srun: error: bnode2: task 1: Exited with exit code 1
srun: error: bnode1: task 0: Terminated
srun: error: bnode3: task 2: Exited with exit code 1
srun: error: bnode4: task 3: Exited with exit code 143
srun: error: bnode5: task 4: Exited with exit code 137
"""


def test_srun_launch_errors_by_node_signals_are_victims():
    assert lr.launch_errors(SRUN) == {
        "bnode3": "task launch failed: Communication connection failure",
        "bnode2": "srun: Exited with exit code 1"}


def _record(tmp: Path, node: str, ok: bool = True, run_id: str = "7", **extra) -> None:
    checks = [{"name": "python", "ok": True, "detail": "python"}]
    if not ok:
        checks.append({"name": "interfaces", "ok": False, "detail": "GLOO_SOCKET_IFNAME=ib7: "
                                                                   "no interface ib7"})
    (tmp / "preflight").mkdir(parents=True, exist_ok=True)
    (tmp / "preflight" / f"{node}.json").write_text(json.dumps(
        {"node": node, "run_id": run_id, "ok": ok, "duration_s": 1.0, "checks": checks,
         **extra}))


def _launcher(tmp: Path, stage: str, nodes: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "ddp_smoke", "launch-report", "--stage", stage,
                           "--report-dir", str(tmp), "--nodes", nodes, "--run-id", "7", *extra],
                          capture_output=True, text=True, timeout=60)


def test_preflight_verdict_names_exactly_the_failed_node(tmp_path):
    _record(tmp_path, "a", joined={"0": "a", "1": "b"})
    _record(tmp_path, "b")
    _record(tmp_path, "c", ok=False)
    _record(tmp_path, "d", ok=False, run_id="6")  # another run's record: not evidence
    proc = _launcher(tmp_path, "preflight", "a b c d", "--exit", "1")
    assert proc.returncode == 1, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("ddp-smoke: verdict fail · preflight: c: interfaces: "), last
    report = json.loads((tmp_path / "report.json").read_text())
    culprits = {k["host"]: k["reason"] for k in report["checks"][0]["culprits"]}
    assert set(culprits) == {"c"}  # d has no record of this run and no error: a victim
    assert report["checks"][0]["figures"]["victims"][0].startswith("d: ")
    assert (report["verdict"], report["run_id"], report["checks"][0]["name"]) == \
        ("fail", "7", "preflight")
    assert (tmp_path / "bad_hosts.txt").read_text() == "c\n"
    assert (tmp_path / "junit.xml").exists()


def test_preflight_verdict_reads_a_node_stderr_and_srun(tmp_path):
    _record(tmp_path, "a")
    (tmp_path / "launch").mkdir()
    (tmp_path / "launch" / "b.preflight.err").write_text(TRACEBACK)
    (tmp_path / "launch" / "srun.preflight.err").write_text(SRUN.replace("bnode3", "c"))
    proc = _launcher(tmp_path, "preflight", "a b c", "--launch-log",
                     str(tmp_path / "launch" / "srun.preflight.err"))
    assert proc.returncode == 1, proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert {k["host"]: k["reason"] for k in report["checks"][0]["culprits"]} == {
        "b": "ModuleNotFoundError: No module named 'missing_dep'",
        "c": "task launch failed: Communication connection failure"}


def test_preflight_verdict_passes_quietly(tmp_path):
    _record(tmp_path, "a")
    _record(tmp_path, "b")
    proc = _launcher(tmp_path, "preflight", "a b")
    assert proc.returncode == 0 and "preflight ok on 2 node(s)" in proc.stdout
    assert not (tmp_path / "report.json").exists()


def test_run_verdict_quotes_the_workers_report(tmp_path):
    report = {"verdict": "fail", "run_id": "7", "checks": [
        {"name": "ddp_step", "status": "fail", "culprits": [
            {"rank": 1, "host": "b", "reason": "crashed"}]}]}
    (tmp_path / "report.json").write_text(json.dumps(report))
    proc = _launcher(tmp_path, "run", "a b", "--exit", "1")
    assert proc.returncode == 1
    assert proc.stdout.startswith("ddp-smoke: verdict fail · ddp_step: rank 1 b: crashed · "
                                  "srun exit 1 · report "), proc.stdout
    report["run_id"] = "6"  # another run's report is not this run's verdict
    (tmp_path / "report.json").write_text(json.dumps(report))
    proc = _launcher(tmp_path, "run", "a b", "--exit", "1")
    assert proc.returncode == 1 and "launch: a: no worker started" in proc.stdout


def test_run_verdict_names_nodes_without_workers(tmp_path):
    worker = tmp_path / "torchrun" / "a" / "7_x" / "attempt_0" / "0"
    worker.mkdir(parents=True)
    (tmp_path / "launch").mkdir()
    (tmp_path / "launch" / "b.run.err").write_text(TORCH_STACK)
    proc = _launcher(tmp_path, "run", "a b", "--exit", "1")
    assert proc.returncode == 1, proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    [culprit] = report["checks"][0]["culprits"]
    assert culprit["host"] == "b"
    assert culprit["reason"].startswith("no worker started: torch.distributed.DistNetworkError")


def test_run_verdict_bad_input_exits_2(tmp_path):
    (tmp_path / "launch").mkdir()
    (tmp_path / "launch" / "a.run.err").write_text("ddp-smoke: error: --checks nope: unknown\n")
    proc = _launcher(tmp_path, "run", "a", "--exit", "1")
    assert proc.returncode == 2
    assert "verdict none (no report) · bad input: ddp-smoke: error: --checks nope" in proc.stdout


def test_run_verdict_from_a_report_the_folder_could_not_take_exits_1(tmp_path):
    """The folder turned read-only mid-run (the campaign's read_only.rank0.ddp_step.slurm.4x1,
    called "bad input" before): rank 0 put its report on stderr; the last line says that
    verdict, where the report is, and why; a pass nobody kept is exit 1."""
    (tmp_path / "launch").mkdir()
    why = f"cannot write {tmp_path}/report.json: Read-only file system (EROFS)"
    for verdict, rid in (("pass", "7"), ("fail", "7"), ("pass", "6")):
        report = {"verdict": verdict, "run_id": rid, "checks": [
            {"name": "storage", "status": verdict, "culprits": [
                {"rank": None, "host": None, "reason": "unwritable folder"}
            ] if verdict == "fail" else []}]}
        (tmp_path / "launch" / "b.run.err").write_text(
            f"ddp-smoke: error: {why}; {REPORT_FOLLOWS}\n{json.dumps(report)}\n")
        proc = _launcher(tmp_path, "run", "a b", "--exit", "1")
        if rid == "6":  # another run's words are not this run's verdict
            assert "report kept only" not in proc.stdout, proc.stdout
            continue
        assert proc.returncode == 1, proc.stdout + proc.stderr
        said, line, last = proc.stdout.splitlines()  # the report once more, whole, then
        assert said == f"ddp-smoke: error: {why}; {REPORT_FOLLOWS}" and \
            json.loads(line) == report, proc.stdout
        assert last.startswith(f"ddp-smoke: verdict {verdict} · report kept only in the "
                               f"job's output ({why})"), proc.stdout
        assert ("storage: unwritable folder" in last) == (verdict == "fail")
        assert not (tmp_path / "report.json").exists()
    # the node's copy cut by another rank's lines (torchrun's tee reads a long line in pieces):
    # rank 0's own stderr file (torchrun --log-dir) holds it whole
    report = {**report, "verdict": "fail", "run_id": "7"}
    (tmp_path / "launch" / "b.run.err").write_text(
        f"ddp-smoke: error: {why}; {REPORT_FOLLOWS}\n{json.dumps(report)[:40]}\n"
        f"[b:1]: a line of rank 1\n{json.dumps(report)[40:]}\n")
    own = tmp_path / "torchrun" / "b" / "7_x" / "attempt_0" / "0"
    own.mkdir(parents=True)
    (own / "stderr.log").write_text(f"ddp-smoke: error: {why}; {REPORT_FOLLOWS}\n"
                                    f"{json.dumps(report)}\n")
    proc = _launcher(tmp_path, "run", "a b", "--exit", "1")
    assert json.loads(proc.stdout.splitlines()[1]) == report, proc.stdout
    assert proc.stdout.splitlines()[-1].startswith("ddp-smoke: verdict fail · report kept "
                                                   "only in the job's output"), proc.stdout
    shutil.rmtree(tmp_path / "torchrun")
    # a full folder kept the error line and not the long JSON line after it (the campaign's
    # disk_full.rank0.storage.image.4x1): not "bad input" either
    (tmp_path / "launch" / "b.run.err").write_text(f"ddp-smoke: error: {why}; {REPORT_FOLLOWS}\n")
    proc = _launcher(tmp_path, "run", "a b", "--exit", "1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.startswith(f"ddp-smoke: verdict unknown (report not kept) · {why}; "
                                  f"{REPORT_FOLLOWS} in the job's output · "), proc.stdout


def _preflight(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([PY, "-m", "ddp_smoke", "preflight", *args], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, **(env or {})})


def test_preflight_command_on_loopback_host_and_node(tmp_path):
    """A rendezvous host (listening on the port) and a second node; both pass, both write
    records, the host lists who said hello."""
    endpoint = f"127.0.0.1:{_free_port()}"
    common = ["--report-dir", str(tmp_path), "--rdzv", endpoint, "--timeout", "20",
              "--run-id", "r1"]
    host = _preflight(*common, "--serve", "--nodes", "2", "--node", "h0",
                      env={"SLURM_NODEID": "0"})
    node = _preflight(*common, "--node", "h1", "--skip-torch", env={"SLURM_NODEID": "1"})
    for proc in (host, node):
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, out + err
        assert out.startswith("ddp-smoke preflight: h") and " ok in " in out
    record = json.loads((tmp_path / "preflight" / "h0.json").read_text())
    assert record["joined"] == {"0": "h0", "1": "h1"} and record["ok"]
    assert {c["name"] for c in record["checks"]} == {"python", "report_dir", "interfaces",
                                                     "rendezvous", "torch", "joined", "mtu"}
    assert next(c for c in record["checks"] if c["name"] == "mtu")["ok"]  # both on lo
    # The port is free again at once for torchrun's store.
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("", int(endpoint.rsplit(":", 1)[1])))


def test_preflight_host_names_the_node_ranks_that_never_joined(tmp_path):
    endpoint = f"127.0.0.1:{_free_port()}"
    host = _preflight("--rdzv", endpoint, "--serve", "--nodes", "3", "--timeout", "3",
                      "--skip-torch", env={"PET_NODE_RANK": "0"})
    out, err = host.communicate(timeout=30)
    assert host.returncode == 1
    assert "joined: node rank(s) 1, 2 never joined within 3 s: 1 of 3 said hello" in err, err


def test_a_host_told_how_long_to_wait_for_hellos_misses_no_node_after_it(tmp_path):
    """The image's rendezvous host (--hello-wait): its nodes, started by hand, may start later
    or run torchrun without preflight; it listens that long and misses nobody (a node of the
    image's two, calling torchrun itself, kept it waiting 600 s)."""
    endpoint = f"127.0.0.1:{_free_port()}"
    t0 = time.monotonic()
    host = _preflight("--rdzv", endpoint, "--serve", "--nodes", "3", "--timeout", "60",
                      "--hello-wait", "2", "--skip-torch", "--node", "h0")
    out, err = host.communicate(timeout=30)
    assert host.returncode == 0 and time.monotonic() - t0 < 15, out + err
    assert "1 node(s) said hello" in out, out


def test_a_node_whose_own_checks_failed_says_so_in_its_hello_and_the_host_names_it(tmp_path):
    """A pod's interface missing (the campaign's missing_interface.middle.join.pytorchjob):
    before, its hello passed as any other, the host started torchrun and the job waited in
    the rendezvous for a pod that had left; the host names it now, at once."""
    endpoint = f"127.0.0.1:{_free_port()}"
    common = ["--rdzv", endpoint, "--timeout", "60", "--skip-torch", "--report-dir",
              str(tmp_path)]
    host = _preflight(*common, "--serve", "--nodes", "2", "--node", "h0",
                      env={"PET_NODE_RANK": "0"})
    node = _preflight(*common, "--node", "h1",
                      env={"PET_NODE_RANK": "1", "GLOO_SOCKET_IFNAME": "ens7"})
    t0 = time.monotonic()
    (out, err), (nout, nerr) = host.communicate(timeout=90), node.communicate(timeout=90)
    assert node.returncode == 1 and "no interface ens7" in nerr, nout + nerr
    assert host.returncode == 1 and time.monotonic() - t0 < 30, out + err
    record = json.loads((tmp_path / "preflight" / "h0.json").read_text())
    (failed,) = [c for c in record["checks"] if not c["ok"]]  # the others' word: "joined"
    assert failed["name"] == "joined" and failed["detail"].startswith(
        "node rank 1 h1: interfaces: GLOO_SOCKET_IFNAME=ens7: no interface ens7"), failed
    assert record["joined"] == {"0": "h0", "1": "h1"}


def test_preflight_unreachable_rendezvous_and_bad_input(tmp_path):
    proc = _preflight("--rdzv", f"127.0.0.1:{_free_port()}", "--timeout", "2", "--skip-torch")
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert "rendezvous: cannot reach rendezvous 127.0.0.1:" in err and "refused" in err, err
    proc = _preflight("--rdzv", "nohostport")
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and err.strip().count("\n") == 0, err
    assert err.startswith("ddp-smoke: error: --rdzv 'nohostport'")


def test_preflight_expected_gpus_on_a_cpu_machine(tmp_path):
    proc = _preflight("--gpus", "2", "--timeout", "30")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "torch: " in err and "CUDA sees 0 GPU(s), expected 2" in err, err


def test_worker_command_is_unchanged():
    proc = subprocess.run([PY, "-m", "ddp_smoke", "--checks", "nope"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "ddp-smoke: error:" in proc.stderr


ENTRYPOINT = Path(__file__).resolve().parents[2] / "docker" / "entrypoint.sh"


def _entrypoint(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """The image's entrypoint on this machine, the venv's python first on PATH."""
    env = {**os.environ, "PATH": f"{Path(PY).parent}:{os.environ['PATH']}",
           "DDP_SMOKE_REPORT_ROOT": str(tmp_path), "DDP_SMOKE_RUN_ID": "ep1",
           "NODE_NAME": "box1", **env}
    return subprocess.run(["bash", str(ENTRYPOINT), *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_entrypoint_preflight_failure_is_a_report_naming_this_node(tmp_path):
    proc = _entrypoint(tmp_path, "--", "--checks", "environment", GLOO_SOCKET_IFNAME="ib7")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("ddp-smoke: verdict fail · preflight: box1: interfaces: "
                           "GLOO_SOCKET_IFNAME=ib7: no interface ib7"), last
    report = json.loads((tmp_path / "ep1" / "report.json").read_text())
    assert report["run_id"] == "ep1" and report["written_by"] == "docker launcher"
    assert "+ torchrun" not in proc.stderr  # stopped before torchrun


def test_entrypoint_preflight_report_goes_where_the_worker_was_told_to_write(tmp_path):
    """A worker given its own --report-dir: the launcher's report of a failed preflight goes
    there, where the run's report is looked for (it went to the report root's run folder, and
    the campaign's missing_interface cell under the image found no report at all)."""
    mine = tmp_path / "mine"
    proc = _entrypoint(tmp_path, "--", "--report-dir", str(mine), "--checks", "environment",
                       GLOO_SOCKET_IFNAME="ib7")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads((mine / "report.json").read_text())
    assert report["written_by"] == "docker launcher" and report["verdict"] == "fail"
    assert not (tmp_path / "ep1").exists()


def test_entrypoint_checks_the_worker_options_once_before_anything_starts(tmp_path):
    """Issue 25: bad input is one line and exit 2 before preflight and torchrun (which would
    exit 1); the worker's --help is printed once, by no rank."""
    proc = _entrypoint(tmp_path, "--", "--checks", "enviroment")
    assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr
    assert proc.stderr.count("\n") == 1 and "did you mean 'environment'?" in proc.stderr
    assert list(tmp_path.iterdir()) == []
    proc = _entrypoint(tmp_path, "--", "--help")
    assert proc.returncode == 0 and proc.stdout.count("usage: python -m ddp_smoke") == 1
    assert "+ torchrun" not in proc.stderr and "preflight" not in proc.stderr, proc.stderr


def test_entrypoint_torchrun_that_never_starts_a_worker_is_named(tmp_path):
    """torchrun cannot reach the rendezvous (nothing listens on the port; no preflight to
    say so first): no worker, no report from one; the entrypoint writes it, with torchrun's
    own error line."""
    proc = _entrypoint(tmp_path, "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                       f"--rdzv-endpoint=127.0.0.1:{_free_port()}", "--rdzv-id=ep1",
                       "--rdzv-conf=join_timeout=3,read_timeout=3,is_host=0",
                       "--local-addr=127.0.0.1", "--", "--checks", "environment",
                       DDP_SMOKE_PREFLIGHT="0")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("ddp-smoke: verdict fail · launch: box1: no worker started: "), last
    report = json.loads((tmp_path / "ep1" / "report.json").read_text())
    [culprit] = report["checks"][0]["culprits"]
    assert culprit["host"] == "box1" and "Error" in culprit["reason"], culprit
    assert "\n" not in culprit["reason"] and "frame #" not in culprit["reason"]


def test_entrypoint_of_several_nodes_says_hello_to_the_rendezvous_host_first(tmp_path):
    """Several nodes: the image's preflight says hello to the rendezvous host (is_host=0 here,
    nothing listens): it names the unreachable rendezvous before torchrun starts (before, the
    image ran no hello: a node behind a black hole to the host left no report at all)."""
    port = _free_port()
    proc = _entrypoint(tmp_path, "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                       f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=ep1",
                       "--rdzv-conf=join_timeout=3,is_host=0", "--local-addr=127.0.0.1", "--",
                       "--checks", "environment", DDP_SMOKE_PREFLIGHT_TIMEOUT="6")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    # (a torch import slower than its 4 s under load is named before it, rightly: seen once)
    assert last.startswith("ddp-smoke: verdict fail · preflight: box1: "), last
    assert f"rendezvous: cannot reach rendezvous 127.0.0.1:{port} over TCP" in last, last
    assert "+ torchrun" not in proc.stderr  # stopped before torchrun


def test_a_host_names_the_nodes_it_heard_fail_that_its_launcher_does_not_know(tmp_path):
    """The image's rendezvous host knows only itself (each pod its own folder): the nodes it
    heard fail (their hellos, its path probe) are named by its word, not as its own fault."""
    _record(tmp_path, "a", ok=True)
    record = json.loads((tmp_path / "preflight" / "a.json").read_text())
    why = "path: its hello arrived, a 64 KiB message after it did not within 5 s"
    record.update(ok=False, joined={"a": "a", "b": "b"}, reason=f"joined: node rank b b: {why}")
    record["checks"].append({"name": "joined", "ok": False, "detail": f"node rank b b: {why}",
                             "nodes": {"b": why}})
    (tmp_path / "preflight" / "a.json").write_text(json.dumps(record))
    proc = _launcher(tmp_path, "preflight", "a", "--exit", "1", "--launcher", "docker")
    assert proc.returncode == 1, proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    [culprit] = report["checks"][0]["culprits"]
    assert culprit["host"] == "b" and culprit["reason"] == f"rendezvous host: {why}", culprit


def test_nodes_refused_by_a_late_host_blame_the_host(tmp_path):
    """Nothing listened on the rendezvous port (the first node started late): the nodes that
    were refused are victims, the host that never came up is the culprit."""
    _record(tmp_path, "b", ok=False)
    record = json.loads((tmp_path / "preflight" / "b.json").read_text())
    record["checks"][-1] = {"name": "rendezvous", "ok": False, "detail": "cannot reach "
                            "rendezvous 10.0.0.1:29500 over TCP within 29 s: connection refused"}
    (tmp_path / "preflight" / "b.json").write_text(json.dumps(record))
    proc = _launcher(tmp_path, "preflight", "a b", "--exit", "1")
    assert proc.returncode == 1, proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    [culprit] = report["checks"][0]["culprits"]
    assert culprit["host"] == "a" and culprit["reason"].startswith("rendezvous host: never "
                                                                   "listened"), culprit
    assert [v.split(":")[0] for v in report["checks"][0]["figures"]["victims"]] == ["b"]


def test_a_node_that_only_waited_is_a_victim_not_a_culprit(tmp_path):
    """srun could not launch on c; a and b printed only torch's C++ warnings while waiting
    for it in the rendezvous: c alone is named."""
    (tmp_path / "launch").mkdir()
    note = ("[W1130 23:28:27.714588602 socket.cpp:207] [c10d] The hostname of the client "
            "socket cannot be retrieved. err=-3\n")
    for node in ("a", "b"):
        (tmp_path / "launch" / f"{node}.run.err").write_text(note)
    (tmp_path / "launch" / "srun.run.err").write_text(SRUN.replace("bnode3", "c"))
    proc = _launcher(tmp_path, "run", "a b c", "--exit", "233", "--launch-log",
                     str(tmp_path / "launch" / "srun.run.err"))
    assert proc.returncode == 1, proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert {k["host"]: k["reason"] for k in report["checks"][0]["culprits"]} == {
        "c": "no worker started: task launch failed: Communication connection failure"}


def test_nodes_that_could_not_reach_a_silent_head_store_blame_the_head(tmp_path):
    """PREFLIGHT=0 and the first node started late: the others' torchrun timed out connecting
    to its store, the head itself printed nothing (killed while still starting)."""
    (tmp_path / "launch").mkdir()
    (tmp_path / "launch" / "b.run.err").write_text(TORCH_STACK)
    (tmp_path / "launch" / "srun.run.err").write_text(
        "srun: error: b: task 1: Exited with exit code 1\nsrun: error: a: task 0: Terminated\n")
    proc = _launcher(tmp_path, "run", "a b", "--exit", "143", "--launch-log",
                     str(tmp_path / "launch" / "srun.run.err"))
    assert proc.returncode == 1, proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    [culprit] = report["checks"][0]["culprits"]
    assert culprit["host"] == "a" and culprit["reason"].startswith(
        "rendezvous host: its c10d store never answered: 1 node(s) could not connect"), culprit
    assert report["checks"][0]["figures"]["victims"][0].startswith("b: ")


def test_a_head_that_came_up_after_the_others_gave_up_is_still_the_culprit(tmp_path):
    """The head started late: the others timed out connecting to its store, then its own
    torchrun timed out waiting for them (RendezvousTimeoutError): the head, not both."""
    (tmp_path / "launch").mkdir()
    (tmp_path / "launch" / "b.run.err").write_text(TORCH_STACK)
    (tmp_path / "launch" / "c.run.err").write_text(TORCH_STACK)
    (tmp_path / "launch" / "a.run.err").write_text(
        "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
        "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError\n")
    proc = _launcher(tmp_path, "run", "a b c", "--exit", "1")
    assert proc.returncode == 1, proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    [culprit] = report["checks"][0]["culprits"]
    assert culprit["host"] == "a" and culprit["reason"] == (
        "rendezvous host: its c10d store never answered: 2 node(s) could not connect to it; it "
        "started late or not at all (its own torchrun then timed out waiting for them)"), culprit
    assert [v.split(":")[0] for v in report["checks"][0]["figures"]["victims"]] == ["b", "c"]


def test_a_head_timing_out_while_one_node_failed_otherwise_names_that_node(tmp_path):
    """The head's rendezvous timed out because node c died of its own error: c alone is named,
    the head is a victim."""
    (tmp_path / "launch").mkdir()
    (tmp_path / "launch" / "c.run.err").write_text("ModuleNotFoundError: No module named 'x'\n")
    (tmp_path / "launch" / "a.run.err").write_text(
        "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError\n")
    proc = _launcher(tmp_path, "run", "a b c", "--exit", "1")
    assert proc.returncode == 1, proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert [(k["host"], k["reason"]) for k in report["checks"][0]["culprits"]] == [
        ("c", "no worker started: ModuleNotFoundError: No module named 'x'")]
    assert [v.split(":")[0] for v in report["checks"][0]["figures"]["victims"]] == ["b", "a"]


def test_ranks_that_lost_the_store_make_the_launchers_report_naming_the_silent_node(tmp_path):
    """The workers ran, the store's node died with rank 0, nobody could write: the launcher's
    report names the node whose ranks left no word in lost/, the others are victims."""
    hosts = ["a", "a", "b", "c"]
    for r in (2, 3):
        assert lost.write(str(tmp_path), r, {"ddp_smoke_rank": r, "run_id": "7",
                                             "stage": "ddp_step", "store": "a:29501",
                                             "world_size": 4, "hosts": hosts})
    lost.write(str(tmp_path), 1, {"ddp_smoke_rank": 1, "run_id": "6"})  # an older run's
    proc = _launcher(tmp_path, "run", "a b c", "--exit", "1")
    assert proc.returncode == 1, proc.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    [check] = report["checks"]
    assert check["summary"].startswith("the workers ran, but the coordination store went silent")
    assert [(k["host"], k["rank"], k["reason"]) for k in check["culprits"]] == [
        ("a", None, "ranks 0, 1 went silent with the coordination store at a:29501 during "
                      "ddp_step; no report and no word from them")]
    assert [v.split(":")[0] for v in check["figures"]["victims"]] == ["rank 2 b", "rank 3 c"]
    assert proc.stdout.splitlines()[-1].startswith("ddp-smoke: verdict fail · launch: a: ranks 0, 1 went "
                                  "silent"), proc.stdout


def test_interface_mtu_is_the_kernels_for_the_address():
    """Read through a socket (SIOCGIFMTU), not /sys/class/net: a process that entered a network
    namespace (the jumbo test's hosts) still sees the /sys of the namespace that mounted it."""
    assert interfaces.interface_mtu("127.0.0.1") == int(Path("/sys/class/net/lo/mtu").read_text())
    assert interfaces.interface_mtu("192.0.2.254") is None  # no interface here holds it


def test_mtu_comparison_names_the_odd_nodes_and_the_launcher_report_blames_them():
    ok, detail, odd = interfaces.compare_mtus({"n1": 1500, "n2": 9000, "n3": 9000, "n4": 1500,
                                              "n5": 1500})
    assert (ok, odd) == (False, ["n2", "n3"]) and "drops large ones" in detail
    assert interfaces.compare_mtus({"a": 1500, "b": 9000})[2] == ["a", "b"]  # a tie: both
    assert interfaces.compare_mtus({"a": 1500, "b": 1500})[0]
    host = {"node": "n1", "ok": False, "joined": {"0": "n1", "1": "n2", "2": "n3"},
            "checks": [{"name": "joined", "ok": True, "detail": "3 node(s) said hello"},
                       {"name": "mtu", "ok": False, "detail": detail, "nodes": ["n2", "n3"]}]}
    fine = {"ok": True, "checks": [{"name": "python", "ok": True, "detail": "x"}]}
    culprits, _ = lr.preflight_culprits(
        ["n1", "n2", "n3"], {"n1": host, "n2": {"node": "n2", **fine},
                             "n3": {"node": "n3", **fine}}, {}, "/nonexistent")
    assert [c.host for c in culprits] == ["n2", "n3"]
    assert all("MTU" in c.reason for c in culprits)
