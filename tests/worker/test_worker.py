"""The worker end to end under real torchrun (gloo, CPU): contract, tutorial parity, exits."""
import subprocess
import sys

import pytest

from tests.launch import REPO, single, torchrun

TUTORIAL = ["rank=0 local_rank=0 world_size=2 samples=[0, 2] loss=6.6602 weight=1.1972",
            "rank=1 local_rank=1 world_size=2 samples=[1, 3] loss=17.2775 weight=1.1972",
            "ddp_step_complete=True"]
BASIC = ("--checks", "environment,ddp_step")


@pytest.mark.timeout(180)
def test_two_ranks_print_the_tutorial_and_write_the_contract(tmp_path):
    run = torchrun(2, *BASIC, report_dir=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    start = lines.index(TUTORIAL[0])
    assert lines[start:start + 3] == TUTORIAL
    assert lines[-1].startswith("verdict: PASS")
    report = run.report
    assert (report["verdict"], report["world_size"], report["nodes"], report["backend"]) == \
        ("pass", 2, 1, "gloo")
    assert [(r["rank"], r["local_rank"]) for r in report["ranks"]] == [(0, 0), (1, 1)]
    assert all(r["host"] and r["pid"] for r in report["ranks"])
    for c in report["checks"]:
        assert set(c) >= {"name", "status", "culprits", "figures"} and c["status"] == "pass"
    assert {"rendezvous_s", "checks_s", "total_s"} <= set(report["timings"])
    assert (tmp_path / "junit.xml").exists()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("nproc", [1, 4])
def test_other_world_sizes_pass_with_the_right_shards(tmp_path, nproc):
    run = torchrun(nproc, *BASIC, report_dir=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    step = run.check("ddp_step")
    assert step["figures"]["expected_shards"] == {1: [[0, 1, 2, 3]],
                                                  4: [[0], [1], [2], [3]]}[nproc]
    assert run.report["world_size"] == nproc


@pytest.mark.timeout(120)
def test_plain_env_contract_without_torchrun(tmp_path):
    """What submitit's TorchDistributedEnvironment exports: rank 0 hosts the store itself."""
    run = single(*BASIC, report_dir=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.report["verdict"] == "pass"


@pytest.mark.timeout(120)
def test_broken_promise_fails_with_exit_1_and_a_report(tmp_path):
    run = single("--checks", "environment", "--expect-nodes", "3", report_dir=tmp_path)
    assert run.returncode == 1
    env = run.check("environment")
    assert env["status"] == "fail"
    assert "promised 3 nodes" in env["culprits"][0]["reason"]


def _one_line_exit_2(run):
    assert run.returncode == 2, (run.stdout, run.stderr)
    assert "Traceback" not in run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("ddp-smoke: error:")]
    assert len(errors) == 1, run.stderr
    return errors[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, words", [
    (["--checks", "environment,nope"], "unknown check 'nope'"),
    (["--timeout", "0"], "'timeout'"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--fault", "5:crash@environment", "--checks", "environment"], "rank out of range"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, words):
    assert words in _one_line_exit_2(single(*args, report_dir=tmp_path))


@pytest.mark.timeout(60)
def test_bad_yaml_and_unwritable_report_dir_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("checks: [environment\n")
    assert "not valid YAML" in _one_line_exit_2(single("--config", str(bad),
                                                       report_dir=tmp_path / "r"))
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert "not writable" in _one_line_exit_2(single(report_dir=blocker / "sub"))


@pytest.mark.timeout(60)
def test_without_a_launcher_says_how_to_launch(tmp_path):
    p = subprocess.run([sys.executable, "-m", "ddp_smoke"], capture_output=True, text=True,
                       cwd=REPO, env={"PATH": "/usr/bin:/bin"}, timeout=60)
    assert p.returncode == 2 and "torchrun --standalone" in p.stderr


@pytest.mark.timeout(60)
def test_help_is_the_manual_and_names_every_check():
    from ddp_smoke.checks import REGISTRY
    p = subprocess.run([sys.executable, "-m", "ddp_smoke", "--help"], capture_output=True,
                       text=True, cwd=REPO, timeout=60)
    assert p.returncode == 0
    for name in REGISTRY:
        assert f"  {name} " in p.stdout
    for words in ("--report-dir", "--config", "--checks", "--timeout", "Exit status"):
        assert words in p.stdout
    from ddp_smoke.config.faults import KINDS  # issue 35: sdc was missing from --help
    fault_help = " ".join(p.stdout[p.stdout.index("\n  --fault "):].split()[:40])
    assert all(kind in fault_help for kind in KINDS), fault_help


@pytest.mark.timeout(60)
@pytest.mark.parametrize("text, words", [
    ("collectives: {dtypes: [float8]}\n", "'collectives.dtypes' = 'float8'"),
    ("sampler_epochs: {epochs: 1}\n", "'sampler_epochs.epochs' = 1"),
    ("bandwidth: {collectives: [all_sum]}\n", "'bandwidth.collectives'"),
    ("storage: {file_bytes: 0}\n", "'storage.file_bytes' = 0"),
    ("profile: h900-8gpu\n", "h900-8gpu"),
])
def test_bad_check_options_exit_2_before_any_rank_waits(tmp_path, text, words):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    assert words in _one_line_exit_2(single("--config", str(cfg), report_dir=tmp_path / "r"))
