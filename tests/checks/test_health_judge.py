"""The health check's judge on rank 0 (pure): culprits carry rank, host and GPU; SDC; the
profile's health keys; the binding pin; docs/health.md covers every threshold and key."""
from __future__ import annotations

import copy
import re
from importlib import metadata
from pathlib import Path

import pytest

from ddp_smoke import config
from ddp_smoke.checks import health
from ddp_smoke.checks.api import Evidence
from ddp_smoke.checks.health import sdc
from ddp_smoke.checks.health.readers import nvml, replay
from ddp_smoke.config import profiles
from ddp_smoke.errors import ConfigError

from tests.checks.health_replay import DATA, read, recording

REPO = Path(__file__).parents[2]


def _obs(node=None, uuid=None, pid=1, digest="aa", cuda=False):
    return {"sdc": {"model": "cpu (1 thread(s)), torch x", "n": 8, "digests": [digest] * 2},
            "gpu_uuid": uuid, "cuda": cuda, "pid": pid, "node": node, "node_read_s": 0.01}


def _evidence(obs, hosts, profile="cpu", **health_cfg):
    cfg = copy.deepcopy(config.defaults())
    cfg["profile"] = profile
    cfg["health"].update(health_cfg)
    return Evidence("health", obs, [{"rank": r, "host": h} for r, h in enumerate(hosts)], cfg)


def test_judge_names_the_rank_that_uses_the_gpu_and_the_host(tmp_path):
    path = recording(tmp_path, "h200_8gpu_healthy", {"nvml.gpus.1.remapped_rows": [0, 4, 1, 0]})
    uuid = replay.rank_gpu_uuid(path, 1)
    obs = [_obs(read(path), None, 10), _obs(None, uuid, 11), _obs(None, None, 12)]
    result = health.judge(_evidence(obs, ["n1", "n1", "n2"]))
    assert result.status == "fail"
    assert [(c.rank, c.host) for c in result.culprits] == [(1, "n1")]
    assert result.culprits[0].reason.startswith(
        "GPU 1 (bus 00000000:43:00.0, serial 1641824000242): row remap pending; evidence: ")
    assert result.culprits[0].reason.endswith(
        "action: reset the GPU (the remap happens at the next reset)")


def test_ranks_on_cuda_make_a_gpu_run_even_without_a_gpu_profile(tmp_path):
    node = read(recording(tmp_path, "h200_nvml_missing"))
    cpu = health.judge(_evidence([_obs(node), _obs()], ["n1", "n1"]))
    assert cpu.status == "pass" and cpu.culprits == []  # its HCAs read; its GPUs not measured
    assert any(m.startswith("GPUs: libnvidia-ml.so.1") for m in cpu.figures["nodes"][0][
        "not_measured"])
    gpu = health.judge(_evidence([_obs(node, cuda=True), _obs(cuda=True)], ["n1", "n1"]))
    assert gpu.status == "fail" and [(c.rank, c.host) for c in gpu.culprits] == [(None, "n1")]
    assert "GPUs not read" in gpu.culprits[0].reason


def test_judge_on_cpu_skips_and_says_what_was_not_read():
    node = {"gpu": {"unavailable": {"code": "NVML_ERROR_LIBRARY_NOT_FOUND", "cause": "no lib",
                                    "fix": "install it"}},
            "hca": {"absent": "no /sys/class/infiniband on this node"}, "pci": {}, "kmsg": {}}
    result = health.judge(_evidence([_obs(node), _obs()], ["n1", "n1"]))
    assert result.status == "skip" and result.culprits == []
    assert "hardware not read: GPUs: no NVIDIA driver on this node " \
        "(NVML_ERROR_LIBRARY_NOT_FOUND)" in result.summary
    assert "HCAs: no /sys/class/infiniband on this node" in result.summary


def test_one_node_runs_do_not_ask_for_the_profiles_hcas(tmp_path):
    node = read(recording(tmp_path, "h200_8gpu_healthy", {"files": {
        "sys/class/infiniband/mlx5_0/ports/1/state": "1: DOWN"}}))
    one = health.judge(_evidence([_obs(node)], ["n1"], "b200-8gpu"))
    assert not any("HCA" in c.reason for c in one.culprits)
    two = health.judge(_evidence([_obs(node), _obs(node)], ["n1", "n2"], "b200-8gpu"))
    assert sorted(c.host for c in two.culprits if "GPU-traffic HCA port(s)" in c.reason) == \
        ["n1", "n2"]


def test_health_culprits_reach_the_hosts_drain_lists_and_prometheus(tmp_path):
    from ddp_smoke.model import Report
    from ddp_smoke.outputs import metrics
    from ddp_smoke.outputs.hosts import host_lists, hosts_section
    node = read(recording(tmp_path, "h200_config_faults"))
    result = health.judge(_evidence([_obs(), _obs(node, pid=2)], ["n1", "n2"],
                                    require_persistence_mode=True))
    assert {c.host for c in result.culprits} == {"n2"}
    ranks = [{"rank": r, "local_rank": 0, "host": h} for r, h in enumerate(["n1", "n2"])]
    report = Report("0", "t", "gloo", 2, ranks, [result], {"timeout": 9, "checks": ["health"]})
    hosts = {h["host"]: h["status"] for h in hosts_section(report)}
    assert hosts == {"n1": "good", "n2": "bad"}
    assert host_lists(hosts_section(report))["bad_hosts.txt"].split() == ["n2"]
    text = metrics.render(report, "run", 0.0)
    assert 'ddp_smoke_check_pass{check="health",host="n2"} 0.0' in text


def test_sdc_majority_names_the_odd_rank_a_tie_names_both_sides():
    obs = [_obs(digest="aa"), _obs(digest="bb"), _obs(digest="aa")]
    assert [f.ranks for f in sdc.rank_findings(obs)] == [(1,)]
    assert [f.ranks for f in sdc.rank_findings(obs[:2])] == [(0,), (1,)]
    flaky = _obs()
    flaky["sdc"]["digests"] = ["aa", "ab"]
    assert [f.ranks for f in sdc.rank_findings([_obs(), flaky, _obs()])] == [(1,)]
    other = _obs(digest="cc")
    other["sdc"]["model"] = "another cpu"  # another device model is not compared
    assert sdc.rank_findings([_obs(), _obs(), other]) == []
    tie = health.judge(_evidence(obs[:2], ["h", "h"]))
    # issue 35: two ranks of one machine are no link, and "more ranks" is no advice there
    assert [(c.rank, c.ranks) for c in tie.culprits] == [(0, None), (1, None)]
    assert all("no majority" in c.reason and "more ranks" not in c.reason for c in tie.culprits)
    assert health.judge(_evidence(obs, ["h"] * 3)).figures["sdc_culprits"] == [1]


def test_profile_health_keys_are_validated(tmp_path):
    bad = tmp_path / "p.yaml"
    for text, message in (("health: {pcie_gen: 0}", r"health.pcie_gen = 0"),
                          ("health: {pcie_speed: 5}", r"unknown key health.'pcie_speed'"),
                          ("health: {hca_names: mlx5_0}", r"health.hca_names = 'mlx5_0'"),
                          ("health: {hca_names: []}", r"health.hca_names = \[\]")):
        bad.write_text(text + "\n")
        with pytest.raises(ConfigError, match=message):
            profiles.load(str(bad))
    assert profiles.load("p5-h100-efa")["health"]["hca_names"] == ["rdmap*"]


def test_the_binding_is_pinned_to_the_tested_range_everywhere():
    spec = nvml.TESTED_BINDING
    for path in ("pyproject.toml", "Makefile", "docker/Dockerfile", "tests/sandbox/docker.py"):
        text = (REPO / path).read_text()
        assert spec in text, path
        installs = [ln for ln in text.splitlines() if "nvidia-ml-py" in ln and
                    re.search(r"install|download|SPECS|^\s*\"", ln)]
        assert all(spec in ln for ln in installs) and (installs or path == "Makefile"), path
    assert "install $$args numpy pyyaml submitit '$(NVML_SPEC)'" in (REPO / "Makefile").read_text()
    installed = tuple(int(x) for x in metadata.version("nvidia-ml-py").split(".")[:3])
    assert (13, 580, 65) <= installed < (14,)


def test_the_replay_binding_lacks_only_what_the_recording_says(tmp_path):
    rec = replay.load(str(DATA / "h200_binding_11.json"))
    nv = replay.binding(rec)
    assert not hasattr(nv, "nvmlDeviceGetCurrentClocksEventReasons")
    assert hasattr(nv, "nvmlDeviceGetCurrentClocksThrottleReasons")
    assert nv.NVMLError is __import__("pynvml").NVMLError  # the binding's own error classes
    with pytest.raises(nv.NVMLError_FunctionNotFound):
        nv.nvmlDeviceGetPowerUsage(None)  # a call the recording does not serve


def test_docs_health_lists_every_threshold_profile_key_family_and_its_test():
    doc = (REPO / "docs" / "health.md").read_text()
    missing = [k for k in config.defaults()["health"] if k != "sdc_seed" and f"`{k}`" not in doc]
    missing += [k for k in profiles._SECTIONS["health"] if f"`{k}`" not in doc]
    missing += [f.__name__.rsplit(".", 1)[1] for f in health.FAMILIES
                if f"`{f.__name__.rsplit('.', 1)[1]}`" not in doc]
    tests = set(re.findall(r"`(test_[a-z0-9_]+)`", doc))
    defined = set()
    for path in (REPO / "tests" / "checks").glob("test_health*.py"):
        defined |= set(re.findall(r"^def (test_[a-z0-9_]+)", path.read_text(), re.M))
    assert missing == [] and tests and tests <= defined, (missing, tests - defined)
    readme = (REPO / "README.md").read_text()
    assert "(docs/health.md)" in readme and "### Hardware health" not in readme


def _cpu(periods: int, throttled: int, quota: float | None = 0.25) -> dict:
    def level(p, t):
        return {"version": "v1", "levels": [
            {"path": "/sys/fs/cgroup/cpu/slurmd", "quota_cpus": quota, "periods": p,
             "throttled": t, "throttled_s": t * 0.075},
            {"path": "/sys/fs/cgroup/cpu", "quota_cpus": None, "periods": 0, "throttled": 0,
             "throttled_s": 0.0}]}
    return {"cpu": {"boot_id": "b", "start": level(100, 10), "end": level(100 + periods,
                                                                          10 + throttled)}}


def test_a_cpu_quota_that_held_the_node_back_fails_it():
    from ddp_smoke.checks.health import cpu
    from ddp_smoke.checks.health.finding import FAIL, NOT_MEASURED, Limits
    lim = Limits(config.defaults()["health"])
    (held, seen) = cpu.judge(_cpu(200, 150), lim)  # 75 % of the run's periods
    assert held.level == FAIL and "held back in 75% of the periods" in held.what
    assert "/sys/fs/cgroup/cpu/slurmd allows 0.25 CPU; 150 of 200 periods" in held.evidence
    assert seen.what == "CPU quota (v1): /sys/fs/cgroup/cpu/slurmd 0.25 CPU"
    assert [f.level for f in cpu.judge(_cpu(200, 99), lim)] == ["checked"]  # under 50 %
    assert [f.level for f in cpu.judge(_cpu(9, 9), lim)] == ["checked"]  # too few periods
    assert [f.level for f in cpu.judge(_cpu(200, 200, None), lim)] == ["checked"]  # no quota
    assert [f.level for f in cpu.judge({"cpu": {"end": None}}, lim)] == [NOT_MEASURED]
    assert cpu.judge({}, lim) == []  # a recorded node from before the reader
