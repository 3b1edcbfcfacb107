"""The transport check: NCCL's own log lines say which network it used; a wrong one fails.

The parser runs on real NCCL INFO excerpts from public issues (tests/data/nccl/, with their
sources); the judgement on observations as ranks of a multi-node run would send them; the worker
end to end on gloo (the check must skip: these machines have no GPU, so no NCCL).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_smoke.checks import _nccl_log as nccl_log
from ddp_smoke.coordination import runtime
from ddp_smoke.checks import transport
from ddp_smoke.checks.api import Evidence
from tests.launch import smoke_local

DATA = Path(__file__).resolve().parents[1] / "data" / "nccl"


def _parse(name: str) -> dict:
    return nccl_log.parse((DATA / name).read_text().splitlines())


@pytest.mark.parametrize("name, network, gdr, fallback", [
    ("ib-roce-nccl-2.19.log", "IB", None, None),
    ("ib-roce-gdr-disabled.log", "IB", False, None),
    ("ib-gdr-enabled-old.log", None, True, None),
    ("socket-no-libibverbs.log", "Socket", None, "Failed to open libibverbs.so[.1]"),
    ("plugin-aws-libfabric.log", "AWS Libfabric", None, None),
    ("plugin-libfabric-efa.log", "Libfabric", None, None),
])
def test_parser_on_real_nccl_logs(name, network, gdr, fallback):
    facts = _parse(name)
    assert (facts["network"], facts["gdr"], facts["fallback"]) == (network, gdr, fallback)


def test_parser_details():
    assert _parse("ib-roce-nccl-2.19.log")["devices"] == {
        "IB": "[0]mlx5_10:1/RoCE [1]mlx5_11:1/RoCE [RO]; OOB enp220s0np0:11.1.128.136<0>"}
    assert _parse("socket-no-libibverbs.log")["devices"] == {"Socket": "[0]eth0:10.177.137.15<0>"}
    assert _parse("plugin-aws-libfabric.log")["plugin"] == "NET/OFI Using aws-ofi-nccl 1.3.0aws"
    assert nccl_log.parse([]) == {"network": None, "devices": {}, "gdr": None,
                                  "fallback": None, "plugin": None, "net_channels": {}}


@pytest.mark.parametrize("network, expected, ok", [
    ("IB", "ib", True), ("IB", "IB", True), ("Socket", "ib", False), ("IB", "socket", False),
    ("AWS Libfabric", "libfabric", True), ("Libfabric", "libfabric", True),
    ("Socket", "libfabric", False), (None, "ib", False), ("IBext", "ib", False),
])
def test_expected_network_matching(network, expected, ok):
    assert nccl_log.matches(network, expected) is ok


def test_own_log_files_by_pid(tmp_path):
    (tmp_path / "node-a.4242.log").write_text((DATA / "socket-no-libibverbs.log").read_text())
    (tmp_path / "node-a.4243.log").write_text((DATA / "ib-roce-nccl-2.19.log").read_text())
    facts, files = nccl_log.read_own_log(str(tmp_path / "%h.%p.log"), pid=4242)
    assert facts["network"] == "Socket" and files == [str(tmp_path / "node-a.4242.log")]


def test_worker_sets_nccl_logging_only_where_the_user_did_not(tmp_path):
    env = {"NCCL_DEBUG": "WARN"}
    runtime.nccl_log_env("nccl", str(tmp_path), env)
    assert env == {"NCCL_DEBUG": "WARN", "NCCL_DEBUG_SUBSYS": "INIT,NET",
                   "NCCL_DEBUG_FILE": f"{tmp_path}/nccl/%h.%p.log"}
    assert (tmp_path / "nccl").is_dir()
    env = {}
    runtime.nccl_log_env("gloo", str(tmp_path / "g"), env)
    assert env == {} and not (tmp_path / "g").exists()


def _obs(network, files=("x.log",), debug="INFO", fallback=None) -> dict:
    return {**nccl_log.parse([]), "network": network, "fallback": fallback,
            "log_files": list(files), "nccl_debug": debug, "nccl_debug_subsys": "INIT,NET"}


def _evidence(obs: list[dict], hosts: list[str], **config) -> Evidence:
    ranks = [{"rank": r, "host": h} for r, h in enumerate(hosts)]
    return Evidence("transport", obs, ranks, {"profile": None, "expect_transport": None,
                                              **config})


HOSTS = ["gpu-a", "gpu-a", "gpu-b", "gpu-b"]


def test_multi_node_on_the_expected_network_passes():
    result = transport.judge(_evidence([_obs("IB")] * 4, HOSTS, expect_transport="ib"))
    assert (result.status, result.culprits) == ("pass", [])
    assert [r["network"] for r in result.figures["ranks"]] == ["IB"] * 4


def test_a_node_fallen_back_to_sockets_is_named():
    obs = [_obs("IB"), _obs("IB"),
           _obs("Socket", fallback="Failed to open libibverbs.so[.1]"), _obs("Socket")]
    result = transport.judge(_evidence(obs, HOSTS, expect_transport="ib"))
    assert result.status == "fail"
    assert [(c.rank, c.host) for c in result.culprits] == [(2, "gpu-b")]
    assert "ranks [2, 3] used Socket (expected ib); Failed to open libibverbs" in \
        result.culprits[0].reason


def test_without_expectation_the_odd_node_out_fails():
    obs = [_obs("IB")] * 4 + [_obs("Socket")] * 2
    result = transport.judge(_evidence(obs, HOSTS + ["gpu-c", "gpu-c"]))
    assert [(c.rank, c.host) for c in result.culprits] == [(4, "gpu-c")]


def test_no_evidence_is_not_a_pass():
    """NCCL_DEBUG=WARN set by the user: no INFO line, no network: the expectation fails."""
    obs = [_obs(None, debug="WARN")] * 4
    result = transport.judge(_evidence(obs, HOSTS, expect_transport="ib"))
    assert result.status == "fail" and len(result.culprits) == 2
    assert "NCCL_DEBUG=WARN hides the INFO lines" in result.culprits[0].reason
    assert transport.judge(_evidence(obs, HOSTS)).status == "fail"  # no network anywhere


def test_the_profile_supplies_the_expectation(tmp_path):
    profile = tmp_path / "fabric.yaml"
    profile.write_text("description: x\nexpect_transport: libfabric\n")
    obs = [_obs("AWS Libfabric")] * 2 + [_obs("Socket")] * 2
    result = transport.judge(_evidence(obs, HOSTS, profile=str(profile)))
    assert [(c.rank, c.host) for c in result.culprits] == [(2, "gpu-b")]
    assert result.figures["expected"] == "libfabric"


def test_one_node_is_reported_not_judged():
    result = transport.judge(_evidence([_obs("Socket")] * 2, ["gpu-a"] * 2,
                                       expect_transport="ib"))
    assert result.status == "pass" and "not judged" in result.summary


def test_bad_expectation_is_one_line_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ddp_smoke", "--expect-transport", " "],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "RANK": "0"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "ddp-smoke: error: key 'expect_transport' = '': expected ib, socket or a net plugin's "
        "name (e.g. libfabric)"]


@pytest.mark.timeout(120)
def test_gloo_run_skips_with_its_reason(tmp_path):
    run = smoke_local(2, "--checks", "environment,transport", "--expect-transport", "ib",
                      report_dir=tmp_path / "r")
    assert run.returncode == 0, run.stderr[-3000:]
    check = run.check("transport")
    assert (check["status"], check["summary"]) == ("skip", "backend gloo: NCCL is not used")
    assert not (tmp_path / "r" / "nccl").exists()  # no NCCL log set up on gloo
