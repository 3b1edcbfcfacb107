"""Bad input, completely: one row per mistake, each through the real command line.

Every row runs ``python -m ddp_smoke`` (with the plain env contract, as submitit exports it)
or ``ddp-smoke-submit``, and asserts: exit status 2, exactly one line on stderr that names the
key (flag, variable, file) and what is allowed, no traceback, and nothing connected: the
launcher's MASTER_ADDR:MASTER_PORT is a socket this test listens on, and it must never see a
connection; a submission's folder is never created.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

# (id, argv after the command, env overrides, config YAML, profile YAML, words in the line)
WORKER = [
    # -- flags --------------------------------------------------------------------------
    ("flag-timeout-inf", ["--timeout", "inf"], {}, None, None, ["'timeout'", "inf", "finite"]),
    ("flag-timeout-nan", ["--timeout", "nan"], {}, None, None, ["'timeout'", "finite"]),
    ("flag-timeout-1e15", ["--timeout", "1e15"], {}, None, None, ["'timeout'", "86400"]),
    ("flag-timeout-negative", ["--timeout", "-1"], {}, None, None, ["'timeout'", "> 0"]),
    ("flag-timeout-zero", ["--timeout", "0"], {}, None, None, ["'timeout'", "> 0"]),
    ("flag-timeout-text", ["--timeout", "soon"], {}, None, None, ["--timeout", "float"]),
    ("flag-expect-nodes-0", ["--expect-nodes", "0"], {}, None, None, ["'expect_nodes'", ">= 1"]),
    ("flag-expect-world-negative", ["--expect-world-size", "-3"], {}, None, None,
     ["'expect_world_size'", ">= 1"]),
    ("flag-checks-unknown", ["--checks", "bogus"], {}, None, None,
     ["'checks'", "bogus", "environment"]),
    ("flag-checks-repeated", ["--checks", "environment,environment"], {}, None, None,
     ["'checks'", "repeated"]),
    ("flag-backend", ["--backend", "mpi"], {}, None, None, ["--backend", "gloo"]),
    ("flag-progress", ["--progress", "loud"], {}, None, None, ["--progress", "plain"]),
    ("flag-unknown", ["--colour", "red"], {}, None, None, ["unrecognized", "--colour"]),
    ("flag-typo-hint", ["--chekcs", "environment"], {}, None, None,
     ["unrecognized", "--chekcs", "did you mean --checks?"]),
    ("checks-typo-hint", ["--checks", "enviroment"], {}, None, None,
     ["'checks'", "enviroment", "did you mean 'environment'?"]),
    ("act-on-injected-fault", ["--fault", "0:crash@compute", "--act", "slurm-drain"], {}, None,
     None, ["'act'", "'fault'", "never acts on an injected fault"]),
    ("gpu-profile-on-gloo", ["--backend", "gloo", "--profile", "h100-8gpu"], {}, None, None,
     ["h100-8gpu", "does not fit this run", "H100", "--profile cpu"]),
    ("fault-slow-1.2.3", ["--fault", "0:slow=1.2.3@compute"], {}, None, None,
     ["'fault'", "1.2.3", "RANK:KIND@CHECK"]),
    ("fault-duplicate", ["--fault", "0:crash@environment,0:hang@environment"], {}, None, None,
     ["'fault'", "rank 0", "one per (rank, check)"]),
    ("fault-slow-below-1", ["--fault", "0:slow=0.5@compute"], {}, None, None,
     ["'fault'", "1..1000"]),
    ("fault-slow-huge", ["--fault", "0:slow=5000@compute"], {}, None, None,
     ["'fault'", "1..1000"]),
    ("fault-check-not-selected", ["--checks", "environment", "--fault", "1:crash@compute"],
     {}, None, None, ["'fault'", "compute", "environment"]),
    ("profile-unknown", ["--profile", "h900-8gpu"], {}, None, None,
     ["'profile'", "h900-8gpu", "h100-8gpu"]),
    ("profile-typo-hint", ["--profile", "h900"], {}, None, None,
     ["'profile'", "did you mean 'h200-8gpu' or 'h100-8gpu'?"]),
    ("rails-missing-interface", ["--backend", "gloo", "--rails", "nope0"], {}, None, None,
     ["'rails'", "'nope0'", "no IPv4 address", "interfaces with one: "]),
    ("rails-repeated", ["--rails", "eth0,eth0"], {}, None, None, ["'rails'", "distinct"]),
    # -- the --config file: every kind of value ----------------------------------------
    ("yaml-timeout-inf", [], {}, "timeout: .inf\n", None, ["'timeout'", "finite"]),
    ("yaml-timeout-nan", [], {}, "timeout: .nan\n", None, ["'timeout'", "finite"]),
    ("yaml-timeout-1e15", [], {}, "timeout: 1.0e+15\n", None, ["'timeout'", "86400"]),
    ("yaml-timeout-string", [], {}, "timeout: '90'\n", None, ["'timeout'", "float", "str"]),
    ("yaml-unknown-key", [], {}, "timeuot: 5\n", None, ["'timeuot'", "valid keys", "timeout"]),
    ("yaml-bool-for-int", [], {}, "expect_nodes: true\n", None, ["'expect_nodes'", "int"]),
    ("yaml-nul-in-path", [], {}, 'storage_dir: "a\\0b"\n', None, ["'storage_dir'", "NUL"]),
    ("yaml-dtypes-gpu-bf17", [], {}, "compute: {dtypes_gpu: [bf17]}\n", None,
     ["'compute.dtypes_gpu'", "bf17", "bf16, fp16, tf32, fp32"]),
    ("yaml-max-bytes-below-min", [], {}, "bandwidth: {max_bytes_cpu: 512}\n", None,
     ["'bandwidth.max_bytes_cpu'", "512", "'bandwidth.min_bytes'"]),
    ("yaml-compute-blocks-0", [], {}, "compute: {blocks: 0}\n", None,
     ["'compute.blocks'", ">= 1"]),
    ("yaml-pair-iters-0", [], {}, "bandwidth: {pair_iters: 0}\n", None,
     ["'bandwidth.pair_iters'", ">= 1"]),
    ("yaml-time-per-size-nan", [], {}, "bandwidth: {time_per_size_s: .nan}\n", None,
     ["'bandwidth.time_per_size_s'", "finite"]),
    ("yaml-straggler-margin-nan", [], {}, "compute: {straggler_margin: .nan}\n", None,
     ["'compute.straggler_margin'", "finite"]),
    ("yaml-pair-margin-nan", [], {}, "bandwidth: {pair_margin: .nan}\n", None,
     ["'bandwidth.pair_margin'", "finite"]),
    ("yaml-margin-above-1", [], {}, "compute: {straggler_margin_cpu: 1.5}\n", None,
     ["'compute.straggler_margin_cpu'", "<= 1"]),
    ("yaml-iters-below-min-iters", [], {}, "bandwidth: {iters: 1, min_iters: 5}\n", None,
     ["'bandwidth.iters'", "'bandwidth.min_iters'"]),
    ("yaml-sizes-zero", [], {}, "collectives: {sizes_bytes: [0]}\n", None,
     ["'collectives.sizes_bytes'", "1..1073741824"]),
    ("yaml-sizes-too-big", [], {}, "collectives: {sizes_bytes: [2147483648]}\n", None,
     ["'collectives.sizes_bytes'", "1..1073741824"]),
    ("yaml-model-width-huge", [], {}, "storage: {model_width: 100000}\n", None,
     ["'storage.model_width'", "16384"]),
    ("yaml-samples-huge", [], {}, "sampler_epochs: {samples: 100000000}\n", None,
     ["'sampler_epochs.samples'", "1048576"]),
    ("yaml-seed-negative", [], {}, "sampler_epochs: {seed: -1}\n", None,
     ["'sampler_epochs.seed'", ">= 0"]),
    ("yaml-step-factor-1", [], {}, "bandwidth: {step_factor: 1}\n", None,
     ["'bandwidth.step_factor'", ">= 2"]),
    ("yaml-collectives-empty", [], {}, "bandwidth: {collectives: []}\n", None,
     ["'bandwidth.collectives'", "all_reduce", "at least one"]),
    ("yaml-dtypes-repeated", [], {}, "collectives: {dtypes: [float32, float32]}\n", None,
     ["'collectives.dtypes'", "distinct"]),
    ("yaml-block-s-inf", [], {}, "compute: {block_s: .inf}\n", None,
     ["'compute.block_s'", "finite"]),
    ("yaml-max-bytes-gpu-1tib", [], {}, "bandwidth: {max_bytes_gpu: 1099511627776}\n", None,
     ["'bandwidth.max_bytes_gpu'", "68719476736"]),
    ("yaml-section-not-mapping", [], {}, "compute: 5\n", None, ["'compute'", "mapping"]),
    ("yaml-bandwidth-dtype", [], {}, "bandwidth: {dtype: int8}\n", None,
     ["'bandwidth.dtype'", "float32, bfloat16, float16"]),
    # -- profile files ----------------------------------------------------------------
    ("profile-floors-not-a-list", [], {}, None,
     "bandwidth: {world_size: 8, nodes: 1, floors: 5}\n", ["floors", "list of"]),
    ("profile-floors-mapping", [], {}, None,
     "bandwidth: {world_size: 8, nodes: 1, floors: {collective: all_reduce}}\n",
     ["floors", "list of"]),
    ("profile-min-tflops-not-mapping", [], {}, None, "compute: {min_tflops: [1, 2]}\n",
     ["compute.min_tflops", "dtype"]),
    ("profile-floor-nan", [], {}, None,
     "bandwidth: {world_size: 8, nodes: 1, floors: [{collective: all_reduce, "
     "size_bytes: 1024, min_busbw_gbps: .nan}]}\n", ["min_busbw_gbps", "finite"]),
    ("profile-tflops-nan", [], {}, None, "compute: {min_tflops: {bf16: .nan}}\n",
     ["compute.min_tflops", "finite"]),
    ("profile-tflops-unknown-dtype", [], {}, None, "compute: {min_tflops: {bf17: 100}}\n",
     ["compute.min_tflops", "bf17", "bf16"]),
    ("profile-floor-size-0", [], {}, None,
     "bandwidth: {world_size: 8, nodes: 1, floors: [{collective: all_reduce, "
     "size_bytes: 0, min_busbw_gbps: 1.0}]}\n", ["size_bytes", ">= 1"]),
    ("profile-floor-collective", [], {}, None,
     "bandwidth: {world_size: 8, nodes: 1, floors: [{collective: all_sum, "
     "size_bytes: 1024, min_busbw_gbps: 1.0}]}\n", ["all_sum", "all_reduce"]),
    ("profile-not-mapping", [], {}, None, "- a\n", ["profile", "mapping"]),
    ("profile-section-unknown-key", [], {}, None, "compute: {min_tflop: {bf16: 1}}\n",
     ["compute", "min_tflop", "min_tflops"]),
    # -- the launcher's environment ---------------------------------------------------
    ("env-local-world-size-x", [], {"LOCAL_WORLD_SIZE": "x"}, None, None,
     ["LOCAL_WORLD_SIZE='x'", "integer"]),
    ("env-master-port-70000", [], {"MASTER_PORT": "70000"}, None, None,
     ["MASTER_PORT='70000'", "1..65535"]),
    ("env-master-port-0", [], {"MASTER_PORT": "0"}, None, None, ["MASTER_PORT='0'", "1..65535"]),
    ("env-group-rank-negative", [], {"GROUP_RANK": "-1"}, None, None,
     ["GROUP_RANK='-1'", "0..1"]),
    ("env-local-rank-outside", [], {"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"}, None, None,
     ["LOCAL_RANK='3'", "0..1"]),
    ("env-rank-outside-world", [], {"RANK": "2"}, None, None, ["RANK='2'", "0..1"]),
    ("env-world-size-0", [], {"WORLD_SIZE": "0", "RANK": "0"}, None, None,
     ["WORLD_SIZE='0'", "integer"]),
    ("env-run-id-traversal", [], {"DDP_SMOKE_RUN_ID": "../x"}, None, None,
     ["DDP_SMOKE_RUN_ID='../x'", "[A-Za-z0-9._-]"]),
    ("env-run-id-dotdot", [], {"DDP_SMOKE_RUN_ID": ".."}, None, None,
     ["DDP_SMOKE_RUN_ID='..'", "[A-Za-z0-9._-]"]),
    ("env-restart-count", [], {"TORCHELASTIC_RESTART_COUNT": "abc"}, None, None,
     ["TORCHELASTIC_RESTART_COUNT='abc'", "integer"]),
    ("env-slurm-restart-count", [], {"SLURM_JOB_ID": "5", "SLURM_RESTART_COUNT": "x"}, None,
     None, ["SLURM_RESTART_COUNT='x'", "integer"]),
    ("env-master-addr-empty", [], {"MASTER_ADDR": ""}, None, None,
     ["MASTER_ADDR=''", "host name"]),
    ("env-rank-missing", [], {"RANK": None}, None, None, ["RANK", "not set", "torchrun"]),
]

SUBMIT = [
    ("submit-wait-timeout-nan", ["--wait-timeout", "nan"], ["--wait-timeout", "finite"]),
    ("submit-wait-timeout-inf", ["--wait-timeout", "inf"], ["--wait-timeout", "finite"]),
    ("submit-wait-timeout-negative", ["--wait-timeout", "-1"], ["--wait-timeout", "> 0"]),
    ("submit-gpus-per-node-negative", ["--gpus-per-node", "-1"], ["gpus_per_node", ">= 0"]),
    ("submit-nodes-0", ["--nodes", "0"], ["nodes=0", ">= 1"]),
    ("submit-cluster", ["--cluster", "k8s"], ["--cluster", "slurm"]),
    ("submit-worker-option", ["--", "--timeout", "inf"], ["'timeout'", "finite"]),
    ("submit-procs-text", ["--procs-per-node", "two"], ["--procs-per-node", "int"]),
]


# The commands a first word picks (issue 49): a mistyped command, or a worker option given
# to node-check before its ``--``, is said with what was meant.
COMMANDS = [
    ("command-typo-hint", ["histroy", "reports/"],
     ["unknown command 'histroy'", "did you mean 'history'?", "node-check"]),
    ("command-unknown", ["bogus"], ["unknown command 'bogus'", "--options only"]),
    ("node-check-worker-option-before-dashes", ["node-check", "--levle", "quick"],
     ["--levle", "did you mean the worker's --level? it goes after --",
      "ddp-smoke node-check [options] -- --level"]),
    ("node-check-own-option-typo", ["node-check", "--evry", "5"],
     ["--evry", "did you mean --every?"]),
]


@pytest.fixture
def listener():
    """The address every row's launcher env points at; a row must never connect to it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        s.setblocking(False)
        yield s
        try:
            conn, _ = s.accept()
        except BlockingIOError:
            return
        conn.close()
        pytest.fail("the worker connected to MASTER_ADDR:MASTER_PORT despite bad input")


def _assert_one_line_exit_2(p: subprocess.CompletedProcess, prog: str, words: list[str]):
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2, f"exit {p.returncode}\n{p.stderr}"
    assert len(lines) == 1, p.stderr
    assert "Traceback" not in p.stderr
    assert lines[0].startswith(f"{prog}: error: "), lines[0]
    for w in words:
        assert w in lines[0], f"{w!r} not in {lines[0]!r}"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("argv, env, config, profile, words",
                         [pytest.param(*row[1:], id=row[0]) for row in WORKER])
def test_worker_bad_input(tmp_path, listener, argv, env, config, profile, words):
    contract = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(listener.getsockname()[1])}
    full = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    full.update(contract)
    for k, v in env.items():
        full.pop(k) if v is None else full.__setitem__(k, v)
    extra = []
    if config is not None:
        (tmp_path / "c.yaml").write_text(config)
        extra += ["--config", str(tmp_path / "c.yaml")]
    if profile is not None:
        (tmp_path / "p.yaml").write_text(profile)
        extra += ["--profile", str(tmp_path / "p.yaml")]
    p = subprocess.run([sys.executable, "-m", "ddp_smoke", "--report-dir",
                        str(tmp_path / "r"), *extra, *argv], capture_output=True, text=True,
                       cwd=REPO, env=full, timeout=30, stdin=subprocess.DEVNULL)
    _assert_one_line_exit_2(p, "ddp-smoke", words)
    assert not (tmp_path / "r").exists()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("argv, words", [pytest.param(*row[1:], id=row[0]) for row in SUBMIT])
def test_submit_bad_input(tmp_path, argv, words):
    folder = tmp_path / "f"
    p = subprocess.run([str(BIN / "ddp-smoke-submit"), "--folder", str(folder), *argv],
                       capture_output=True, text=True, cwd=REPO, timeout=30,
                       stdin=subprocess.DEVNULL)
    _assert_one_line_exit_2(p, "ddp-smoke-submit", words)
    assert not folder.exists()  # nothing submitted


@pytest.mark.timeout(90)
@pytest.mark.parametrize("argv, words", [pytest.param(*row[1:], id=row[0]) for row in COMMANDS])
def test_command_bad_input(tmp_path, argv, words):
    p = subprocess.run([sys.executable, "-m", "ddp_smoke", *argv], capture_output=True,
                       text=True, cwd=tmp_path, timeout=30, stdin=subprocess.DEVNULL)
    _assert_one_line_exit_2(p, "ddp-smoke", words)
    assert not any(tmp_path.iterdir())  # nothing written, no report folder


def test_the_table_has_a_row_per_mistake():
    assert len(WORKER) + len(SUBMIT) + len(COMMANDS) >= 40


def test_fault_rank_outside_the_world_exits_2_on_every_rank(tmp_path, listener):
    """Checked once the world size is known, still before any rank connects."""
    p = subprocess.run([sys.executable, "-m", "ddp_smoke", "--fault", "5:crash@environment",
                        "--report-dir", str(tmp_path / "r")], capture_output=True, text=True,
                       cwd=REPO, timeout=120, stdin=subprocess.DEVNULL,
                       env={**os.environ, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                            "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": str(listener.getsockname()[1])})
    _assert_one_line_exit_2(p, "ddp-smoke", ["'fault'", "WORLD_SIZE=2"])


def test_every_key_of_defaults_has_one_range_rule_and_every_dtype_name_is_torchs():
    import torch

    from ddp_smoke import config
    from ddp_smoke.config import rules

    assert set(rules.flat(config.defaults())) == set(rules.RULES)
    rules.check(config.defaults())  # the defaults are inside their own ranges
    torch_names = [*rules.COLLECTIVE_DTYPES, *rules.BANDWIDTH_DTYPES,
                   *(name for name, _ in rules.GPU_MATMUL_DTYPES.values())]
    assert all(isinstance(getattr(torch, n), torch.dtype) for n in torch_names)
