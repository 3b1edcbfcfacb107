"""The health check: its rules on readings recorded from public outputs (tests/data/health,
PROVENANCE.md), the sysfs HCA reader on made trees, and silent data corruption for real on
CPU ranks under torchrun."""
from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest

from ddp_smoke import config
from ddp_smoke.config import profiles
from ddp_smoke.checks import _gpu, _hca, health
from ddp_smoke.checks._health_rules import judge_hcas, judge_node, _Out
from ddp_smoke.checks.api import Evidence
from ddp_smoke.errors import ConfigError

from tests.launch import torchrun

DATA = Path(__file__).parents[1] / "data" / "health"
LIM = config.defaults()["health"]
H200 = profiles.load("h200-8gpu")["health"]


def fixture(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


def judged(node: dict, lim: dict | None = None, want: dict | None = None) -> dict:
    return judge_node(node, {**LIM, **(lim or {})}, want or {})


def whats(out: dict) -> list[str]:
    return [f["what"] for f in out["findings"]]


def end_gpu(node: dict, i: int = 0) -> dict:
    """The i-th GPU of the end snapshot (the fixtures share one snapshot for start and end:
    copy before changing an end reading)."""
    node["gpu"]["end"] = copy.deepcopy(node["gpu"]["end"])
    return node["gpu"]["end"]["gpus"][i]


# -- recorded readings ---------------------------------------------------------------------

def test_every_fixture_names_its_public_source():
    table = (DATA / "PROVENANCE.md").read_text()
    for path in DATA.glob("*.json"):
        body = json.loads(path.read_text())
        assert body["source"] and body["excerpt"] and body["transcribed"], path.name
        assert path.name in table and all(url in table for url in body["source"]), path.name


def test_recorded_h100_node_fails_only_on_persistence_mode():
    node = fixture("h100_persistence_off")["node"]
    out = judged(node)
    assert whats(out) == [
        "GPU 0 (bus 00000000:18:00.0, serial unreadable): persistence mode is off",
        "GPU 1 (bus 00000000:2A:00.0, serial unreadable): persistence mode is off"]
    assert all("nvidia-smi -pm 1" in f["action"] for f in out["findings"])
    assert judged(node, {"require_persistence_mode": False})["findings"] == []
    # the profile's count: 2 GPUs where an HGX node has 8
    assert "2 GPU(s) on the node, the profile expects 8" in whats(
        judged(node, {"require_persistence_mode": False}, H200))


def test_recorded_pending_row_remap_asks_for_a_gpu_reset():
    out = judged(fixture("remap_pending")["node"])
    assert [(f["gpu"], f["what"].split(": ", 1)[1], f["action"]) for f in out["findings"]] == [
        (0, "row remap pending", "reset the GPU (the remap happens at the next reset)")]


def test_recorded_mig_gpu_is_named_and_its_unsupported_rows_listed():
    out = judged(fixture("a100_mig_enabled")["node"])
    assert [f["what"].split(": ", 1)[1] for f in out["findings"]] == ["MIG is on"]
    assert out["findings"][0]["uuid"] == "GPU-072b19bd-4ccf-63cf-6435-cf462aff833d"
    assert any("remapped rows: Not Supported" in m for m in out["not_measured"])


def test_recorded_not_supported_readings_are_listed_never_passed():
    out = judged(fixture("l20_not_supported")["node"])
    assert out["findings"] == []
    unsupported = [m for m in out["not_measured"] if m.endswith("Not Supported")]
    assert len(unsupported) == 5
    assert any("never busy" in m for m in out["not_measured"])


def test_recorded_inactive_nvlinks_are_named():
    out = judged(fixture("v100_nvlink_inactive")["node"])
    assert whats(out) == ["GPU 3 (bus ?, serial unreadable): NVLink link(s) 3, 5 down"]


def test_nvlink_all_down_on_a_gpu_without_nvlink_is_not_a_fault_unless_expected():
    node = fixture("h100_persistence_off")["node"]
    for i in (0, 1):
        end_gpu(node, i)["nvlink_up"] = {str(k): False for k in range(18)}
    lim = {"require_persistence_mode": False}
    assert judged(node, lim)["findings"] == []  # a PCIe card's links read "down" (NVSentinel#1481)
    assert len(judged(node, lim, {"nvlink_links": 18})["findings"]) == 2
    end_gpu(node, 0)["nvlink_up"] = {str(k): True for k in range(12)}
    assert "12 NVLink links, the profile expects 18" in " ".join(
        whats(judged(node, lim, {"nvlink_links": 18})))


def test_recorded_pcie_link_at_x8_under_full_load_is_named():
    out = judged(fixture("pcie_x8_under_load")["node"])
    assert [f["what"].split(": ", 1)[1] for f in out["findings"]] == [
        "PCIe link at Gen2 x8 under load, expected Gen2 x16"]
    assert "reseat" in out["findings"][0]["action"]


def test_recorded_idle_gpu_link_is_not_judged():
    out = judged(fixture("idle_gen1")["node"], want={"pcie_gen": 3})
    assert out["findings"] == []
    assert any("never busy in 12 sample(s)" in m for m in out["not_measured"])


def test_recorded_xid_79_in_the_kernel_log():
    body = fixture("xid79_kernel_log")
    parsed = _gpu.parse_kmsg(body["kmsg_record"], uptime_s=1843.308145)
    assert parsed[0]["bus"] == "0000:44:00" and parsed[0]["xid"] == 79
    assert parsed[0]["age_s"] == pytest.approx(120.0, abs=0.01)
    out = judged(body["node"])
    assert [(f["gpu"], f["what"].split(": ", 1)[1]) for f in out["findings"]] == [
        (0, "XID 79 120 s ago (kernel log)")]
    assert out["findings"][0]["action"].startswith("reboot the node")
    assert judged(body["node"], {"xid_window_s": 60.0})["findings"] == []  # too old to count


def test_unreadable_kernel_log_and_missing_event_set_are_said():
    node = fixture("remap_pending")["node"]
    node["gpu"].update(kernel_xids=None, kernel_xids_why="kernel log /dev/kmsg not readable "
                       "here (Permission denied)", xid_events="XID events: Not Supported")
    out = judged(node)
    assert "past XIDs: kernel log /dev/kmsg not readable here (Permission denied)" in \
        out["not_measured"]
    assert "XID events: Not Supported" in out["not_measured"]
    assert _gpu.kernel_xids("/nonexistent/kmsg")[0] is None


def test_xids_during_the_run_critical_fail_application_ones_are_ignored():
    node = fixture("h100_persistence_off")["node"]
    uuid = node["gpu"]["end"]["gpus"][1]["uuid"]
    node["gpu"]["xids"] = [{"xid": 13, "uuid": uuid}, {"xid": 94, "uuid": uuid},
                           {"xid": 48, "uuid": uuid}]
    out = judged(node, {"require_persistence_mode": False})
    assert [(f["gpu"], f["what"].split(": ", 1)[1]) for f in out["findings"]] == [
        (1, "XID 48 during the run")]
    assert [w for w in out["warnings"] if "XID" in w] == [
        "GPU 1 (bus 00000000:2A:00.0, serial unreadable): XID 94 during the run"]


# -- every rule on a recorded node, one reading changed ------------------------------------

BASE = "h100_persistence_off"
OFF = {"require_persistence_mode": False}


@pytest.mark.parametrize("change, expected, action", [
    ({"remapped_rows": {"correctable": 0, "uncorrectable": 2, "pending": 0, "failure": 1}},
     "row remapping failed", "drain and RMA"),
    ({"remapped_rows": {"correctable": 0, "uncorrectable": 512, "pending": 0, "failure": 0}},
     "512 rows remapped for uncorrectable errors", "drain and RMA"),
    ({"ecc_uncorrected_volatile": 1}, "1 volatile uncorrected ECC error(s)", "reset the GPU"),
    ({"ecc_enabled": False}, "ECC is off", "enable ECC"),
    ({"recovery_action": 2}, "the driver asks for recovery action 2", "reboot the node"),
    ({"remapped_rows": None, "retired_pages": {"pending": False, "sbe": 40, "dbe": 23}},
     "63 retired pages", "drain and RMA"),
    ({"remapped_rows": None, "retired_pages": {"pending": True, "sbe": 1, "dbe": 0}},
     "page retirement pending", "reset the GPU"),
    ({"fabric": {"state": 2, "status": 0, "health_mask": 0}},
     "NVSwitch fabric not ready or degraded", "nvidia-fabricmanager"),
    ({"fabric": {"state": 3, "status": 0, "health_mask": 1}},
     "NVSwitch fabric not ready or degraded", "nvidia-fabricmanager"),
    ({"mig_enabled": True}, "MIG is on", "disable MIG"),
    ({"lost": True}, "lost (NVML_ERROR_GPU_IS_LOST)", "reboot the node"),
])
def test_each_memory_and_configuration_rule(change, expected, action):
    node = fixture(BASE)["node"]
    end_gpu(node, 1).update(change)
    out = judged(node, OFF)
    assert [(f["gpu"], f["what"].split(": ", 1)[1]) for f in out["findings"]] == [(1, expected)]
    assert action in out["findings"][0]["action"]


def test_row_remap_limits_hold_at_their_edges():
    node = fixture(BASE)["node"]
    end_gpu(node, 0)["remapped_rows"] = {"correctable": 9, "uncorrectable": 511, "pending": 0,
                                         "failure": 0}
    assert judged(node, OFF)["findings"] == []
    end_gpu(node, 0)["remapped_rows"]["pending"] = 1
    assert whats(judged(node, OFF))[0].endswith("row remap pending")


def _counters(node, i: int, **end):
    end_gpu(node, i).update(end)


def test_pcie_replays_judged_at_dcgms_per_lane_rate():
    # Gen5 x16: ceil(1e-12 x 32e9 x 60 x 16) = 31 replays per minute (DCGM health)
    node = fixture(BASE)["node"]
    _counters(node, 0, pcie_replay=31)
    assert judged(node, OFF)["findings"] == []
    _counters(node, 0, pcie_replay=32)
    assert [f["what"].split(": ", 1)[1] for f in judged(node, OFF)["findings"]] == [
        "32 PCIe replays in 30 s"]


def test_nvlink_error_increases():
    node = fixture(BASE)["node"]
    _counters(node, 0, nvlink_replay=1)
    _counters(node, 1, nvlink_crc_flit=3000)  # 100/s over the fixture's 30 s
    out = judged(node, OFF)
    assert [f["what"].split(": ", 1)[1] for f in out["findings"]] == [
        "1 NVLink replay error(s) during the run", "NVLink CRC errors at 100/s"]
    _counters(node, 1, nvlink_crc_flit=30)
    _counters(node, 0, nvlink_replay=0)
    out = judged(node, OFF)
    assert out["findings"] == [] and "NVLink CRC errors at 1.00/s" in out["warnings"][0]


def test_no_start_reading_means_counters_not_measured():
    node = fixture(BASE)["node"]
    node["gpu"]["start"] = {"gpus": []}
    _counters(node, 0, pcie_replay=10**6)
    out = judged(node, OFF)
    assert out["findings"] == []
    assert any("counter increases: no reading at the run's start" in m
               for m in out["not_measured"])


@pytest.mark.parametrize("bit, share, failed", [
    ("hw_slowdown", 30, True), ("hw_thermal", 30, True), ("hw_power_brake", 30, True),
    ("hw_slowdown", 29, False)])
def test_hw_slowdown_for_most_of_the_load(bit, share, failed):
    node = fixture(BASE)["node"]
    node["gpu"]["samples"][1][bit] = share  # of 50 busy samples: 60 % is gpud's limit
    assert bool(judged(node, OFF)["findings"]) == failed


def test_sw_thermal_only_warns_and_idle_samples_do_not_count():
    s = _gpu._empty_summary()
    _gpu.add_sample(s, _gpu.IDLE, 0, 1, 16)
    _gpu.add_sample(s, 0, 0, 1, 16)  # no kernel ran in the period
    _gpu.add_sample(s, _gpu.SW_THERMAL | _gpu.HW_SLOWDOWN, 97, 5, 16)
    _gpu.add_sample(s, 0, 100, 4, 16)
    assert (s["n"], s["busy"], s["hw_slowdown"], s["sw_thermal"]) == (4, 2, 1, 1)
    assert (s["pcie_gen_busy_max"], s["pcie_width_busy_max"]) == (5, 16)
    node = fixture(BASE)["node"]
    node["gpu"]["samples"][0]["sw_thermal"] = 50
    out = judged(node, OFF)
    assert out["findings"] == [] and "SW thermal slowdown in 50 of 50" in out["warnings"][0]


def test_pcie_below_the_profile_under_load():
    node = fixture(BASE)["node"]
    node["gpu"]["samples"][0].update(pcie_gen_busy_max=4)
    assert whats(judged(node, OFF)) == [
        "GPU 0 (bus 00000000:18:00.0, serial unreadable): PCIe link at Gen4 x16 under load, "
        "expected Gen5 x16"]


def test_vbios_odd_one_out_and_gpu_count_against_the_ranks():
    node = fixture(BASE)["node"]
    node["gpu"]["end"] = copy.deepcopy(node["gpu"]["end"])
    for g, v in zip(node["gpu"]["end"]["gpus"], ("96.00.89.00.01", "96.00.74.00.0D")):
        g["vbios"] = v
    node["gpu"]["end"]["gpus"].append({**node["gpu"]["end"]["gpus"][0], "index": 2,
                                       "bus_id": "00000000:3A:00.0"})
    node["gpu"]["end"]["count"] = 3
    node["cuda_ranks"] = 4
    out = judged(node, OFF)
    assert whats(out) == [
        "3 GPU(s) visible to NVML for 4 GPU ranks",
        "GPU 1 (bus 00000000:2A:00.0, serial unreadable): VBIOS 96.00.74.00.0D differs from "
        "the node's 96.00.89.00.01"]


def test_stray_processes_only_when_nvml_sees_this_runs_pids():
    node = fixture(BASE)["node"]
    end_gpu(node, 0)["processes"] = [{"pid": 100, "used_mib": 900}, {"pid": 4242, "used_mib": 70000}]
    node["run_pids"] = [100, 101]
    assert whats(judged(node, OFF)) == [
        "GPU 0 (bus 00000000:18:00.0, serial unreadable): 1 process(es) of another job hold "
        "GPU memory"]
    node["run_pids"] = [7, 8]  # another PID namespace: none of ours visible
    out = judged(node, OFF)
    assert out["findings"] == [] and any("PID namespace" in m for m in out["not_measured"])


# -- HCAs through sysfs, on made trees -----------------------------------------------------

def make_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / _hca.IB_CLASS / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return root


def counters(root: Path, port: str, **values):
    make_tree(root, {f"{port}/counters/{c}": str(values.get(c, 0)) for c in _hca.COUNTERS})


@pytest.fixture
def hca_root(tmp_path) -> Path:
    root = make_tree(tmp_path, fixture("hca_ports")["files"])
    for port in ("mlx5_0/ports/1", "mlx5_1/ports/1", "mlx4_0/ports/1", "mlx4_0/ports/2"):
        counters(root, port)
    return root


def test_sysfs_reader_on_a_made_tree(hca_root):
    ports = _hca.read_ports(str(hca_root))
    assert sorted(ports) == ["mlx4_0/1", "mlx4_0/2", "mlx5_0/1", "mlx5_1/1"]
    assert ports["mlx5_0/1"]["rate_gbps"] == 100.0 and ports["mlx4_0/2"]["rate_gbps"] == 56.0
    assert ports["mlx4_0/1"]["state"] == "1: DOWN"
    assert ports["mlx5_1/1"]["counters"]["link_downed"] == 0
    assert _hca.read_ports(str(hca_root / "nothing")) is None
    assert _hca.rate_gbps("400 Gb/sec (4X NDR)") == 400.0 and _hca.rate_gbps("garbage") is None


def test_hca_ports_without_expectations_warn_with_them_fail(hca_root):
    ports = _hca.read_ports(str(hca_root))
    hca = {"start": ports, "end": ports, "window_s": 30.0}
    out = _Out()
    judge_hcas(hca, LIM, {}, out)
    assert out.findings == [] and out.warnings == [
        "HCA port mlx4_0/1: state '1: DOWN', phys_state '3: Disabled', rate '10 Gb/sec (4X)'"]
    out = _Out()
    judge_hcas(hca, LIM, {"hca_ports": 4, "hca_rate_gbps": 100}, out)
    assert [f["port"] for f in out.findings] == ["mlx4_0/1", "mlx4_0/2", None]
    assert out.findings[-1]["what"] == "2 HCA port(s) up at full rate, the profile expects 4"


def test_hca_counter_increases(hca_root):
    start = _hca.read_ports(str(hca_root))
    counters(hca_root, "mlx5_0/ports/1", link_downed=1, symbol_error=300)
    counters(hca_root, "mlx5_1/ports/1", symbol_error=301, link_error_recovery=3)
    counters(hca_root, "mlx4_0/ports/1", link_downed=9)  # a down port's counters: not judged
    out = _Out()
    judge_hcas({"start": start, "end": _hca.read_ports(str(hca_root)), "window_s": 30.0},
               LIM, {}, out)
    assert [(f["port"], f["what"].split(": ", 1)[1]) for f in out.findings] == [
        ("mlx5_0/1", "link_downed increased by 1 during the run"),
        ("mlx5_1/1", "symbol_error at 10.0/s"),
        ("mlx5_1/1", "link_error_recovery at 0.1/s")]


def test_a_node_without_hcas_says_so_and_fails_only_when_the_profile_wants_them():
    node = fixture(BASE)["node"]
    assert "HCAs: no /sys/class/infiniband on this node" in judged(node, OFF)["not_measured"]
    assert whats(judged(node, OFF, {"hca_ports": 8})) == [
        "no HCA found (no /sys/class/infiniband on this node)"]


def test_no_nvidia_driver_is_said_and_hcas_still_judged(hca_root):
    ports = _hca.read_ports(str(hca_root))
    node = {"gpu": {"unavailable": "NVMLError_LibraryNotFound: NVML Shared Library Not Found"},
            "hca": {"start": ports, "end": ports, "window_s": 5.0}}
    out = judged(node)
    assert out["not_measured"] == ["GPUs: NVMLError_LibraryNotFound: NVML Shared Library Not "
                                   "Found"]
    assert out["checked"] == ["4 HCA port(s) in sysfs (3 active)"]


# -- the check's judge: culprits carry rank, host and GPU ----------------------------------

def _obs(node=None, uuid=None, pid=1, digest="aa"):
    return {"sdc": {"model": "cpu (1 thread(s)), torch x", "n": 8, "digests": [digest] * 2},
            "gpu_uuid": uuid, "pid": pid, "node": node, "node_read_s": 0.01}


def _evidence(obs, hosts, profile="cpu", **health_cfg):
    cfg = copy.deepcopy(config.defaults())
    cfg["profile"] = profile
    cfg["health"].update(health_cfg)
    ranks = [{"rank": r, "host": h} for r, h in enumerate(hosts)]
    return Evidence("health", obs, ranks, cfg)


def test_judge_names_the_rank_that_uses_the_gpu_and_the_host():
    node = fixture("remap_pending")["node"]
    node["gpu"]["end"]["gpus"][0]["uuid"] = "GPU-aaaa"
    obs = [_obs(node, None, 10), _obs(None, "GPU-aaaa", 11), _obs(None, None, 12)]
    result = health.judge(_evidence(obs, ["n1", "n1", "n2"]))
    assert result.status == "fail"
    assert [(c.rank, c.host) for c in result.culprits] == [(1, "n1")]
    assert "row remap pending" in result.culprits[0].reason
    assert "action: reset the GPU" in result.culprits[0].reason


def test_judge_on_cpu_skips_and_says_what_was_not_read():
    node = {"gpu": {"unavailable": "NVMLError_LibraryNotFound: NVML Shared Library Not Found"},
            "hca": {"absent": "no /sys/class/infiniband on this node"}}
    result = health.judge(_evidence([_obs(node), _obs()], ["n1", "n1"]))
    assert result.status == "skip" and result.culprits == []
    assert "hardware not read: GPUs: NVMLError_LibraryNotFound" in result.summary
    assert "HCAs: no /sys/class/infiniband" in result.summary


def test_one_node_runs_do_not_ask_for_the_profiles_hcas():
    node = fixture(BASE)["node"]
    one = health.judge(_evidence([_obs(node)], ["n1"], "h200-8gpu",
                                 require_persistence_mode=False))
    assert not any("HCA" in c.reason for c in one.culprits)
    two = health.judge(_evidence([_obs(node), _obs(node)], ["n1", "n2"], "h200-8gpu",
                                 require_persistence_mode=False))
    assert [c.host for c in two.culprits if "no HCA found" in c.reason] == ["n1", "n2"]


def test_sdc_majority_names_the_odd_rank_a_tie_names_both_sides():
    obs = [_obs(digest="aa"), _obs(digest="bb"), _obs(digest="aa")]
    assert [c.rank for c in health.sdc_culprits(_evidence(obs, ["h"] * 3))] == [1]
    tie = health.sdc_culprits(_evidence(obs[:2], ["h"] * 2))
    # issue 35: two ranks of one machine are no link, and "more ranks" is no advice there
    assert [(c.rank, c.ranks) for c in tie] == [(0, None), (1, None)]
    assert all("no majority" in c.reason and "more ranks" not in c.reason for c in tie)
    flaky = _obs()
    flaky["sdc"]["digests"] = ["aa", "ab"]
    assert [c.rank for c in health.sdc_culprits(_evidence([_obs(), flaky, _obs()],
                                                          ["h"] * 3))] == [1]
    other = _obs(digest="cc")
    other["sdc"]["model"] = "another cpu"  # another device model is not compared
    assert health.sdc_culprits(_evidence([_obs(), _obs(), other], ["h"] * 3)) == []


def test_profile_health_keys_are_validated(tmp_path):
    bad = tmp_path / "p.yaml"
    bad.write_text("health: {pcie_gen: 0}\n")
    with pytest.raises(ConfigError, match=r"health.pcie_gen = 0"):
        profiles.load(str(bad))
    bad.write_text("health: {pcie_speed: 5}\n")
    with pytest.raises(ConfigError, match=r"unknown key health.'pcie_speed'"):
        profiles.load(str(bad))


def test_sdc_fault_parses_and_health_is_in_the_default_selection():
    from ddp_smoke.config.faults import parse_faults
    assert parse_faults("1:sdc@health", ["health"])[0].kind == "sdc"
    assert config.defaults()["checks"][-1] == "health"


# -- for real: silent data corruption on CPU ranks -----------------------------------------

def test_sdc_fault_names_exactly_the_perturbed_rank_every_time(tmp_path):
    run = torchrun(3, "--backend", "gloo", "--checks", "health", "--repeat", "3",
                   "--fault", "1:sdc@health", report_dir=tmp_path, timeout_s=120)
    assert run.returncode == 1, run.stderr[-2000:]
    check = run.check("health")
    assert check["status"] == "fail"
    assert [c["rank"] for c in check["culprits"]] == [1]
    assert "in every iteration" in check["culprits"][0]["reason"]
    assert [[c["rank"] for c in it["culprits"]] for it in check["figures"]["iterations"]] == \
        [[1], [1], [1]]
    assert "silent data corruption" in check["culprits"][0]["reason"]
    bad = [h for h in run.report["hosts"] if h["status"] == "bad"]
    assert len(bad) == 1 and (tmp_path / "bad_hosts.txt").read_text().split() == [bad[0]["host"]]


def test_clean_cpu_run_skips_health_with_its_reasons_and_costs_little(tmp_path):
    run = torchrun(2, "--backend", "gloo", "--checks", "environment,health",
                   report_dir=tmp_path, timeout_s=120)
    assert run.returncode == 0, run.stderr[-2000:]
    check = run.check("health")
    assert check["status"] in ("skip", "pass")  # pass where this machine has GPUs or HCAs
    assert check["culprits"] == []
    assert check["duration_s"] < 1.0
    if check["status"] == "skip":
        assert "hardware not read" in check["summary"]


def test_health_culprits_reach_the_hosts_drain_lists_and_prometheus(hca_root):
    from ddp_smoke.model import Report
    from ddp_smoke.outputs import metrics
    from ddp_smoke.outputs.hosts import host_lists, hosts_section
    start = _hca.read_ports(str(hca_root))
    counters(hca_root, "mlx5_0/ports/1", link_downed=2)
    node = {"gpu": {"unavailable": "NVMLError_LibraryNotFound"},
            "hca": {"start": start, "end": _hca.read_ports(str(hca_root)), "window_s": 9.0}}
    result = health.judge(_evidence([_obs(), _obs(node)], ["n1", "n2"]))
    assert [(c.rank, c.host) for c in result.culprits] == [(None, "n2")]  # a port: the node
    ranks = [{"rank": r, "local_rank": 0, "host": h} for r, h in enumerate(["n1", "n2"])]
    report = Report("0", "t", "gloo", 2, ranks, [result], {"timeout": 9, "checks": ["health"]})
    hosts = {h["host"]: h["status"] for h in hosts_section(report)}
    assert hosts == {"n1": "good", "n2": "bad"}
    assert host_lists(hosts_section(report))["bad_hosts.txt"].split() == ["n2"]
    text = metrics.render(report, "run", 0.0)
    assert 'ddp_smoke_check_pass{check="health",host="n2"} 0.0' in text
    assert 'ddp_smoke_check_pass{check="health",host="n1"} 1.0' in text


def test_readme_documents_every_health_threshold_and_profile_key():
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    section = readme.split("### Hardware health", 1)[1].split("\n## ", 1)[0]
    missing = [k for k in LIM if k != "sdc_seed" and f"`{k}`" not in section]
    missing += [k for k in H200 if f"`{k}`" not in section]
    assert missing == []


# -- the NVML reader, replaying a recorded GPU through the real binding's types -------------
# No GPU on the machines these tests run on: the binding's functions are replaced by ones that
# answer from the recorded H100 readings (and raise pynvml's own NVMLError classes), so the
# reader's calls, constants and error handling run as they will against libnvidia-ml.

def _replay(recorded: dict, unsupported=(), lost_after: int | None = None):
    import types

    import pynvml as nv
    fake = types.SimpleNamespace(**{k: getattr(nv, k) for k in dir(nv) if not k.startswith("__")})
    gpus, calls = recorded["gpus"], {"n": 0}

    def call(name, fn):
        def wrapped(*args):
            calls["n"] += 1
            if name in unsupported:
                raise nv.NVMLError(nv.NVML_ERROR_NOT_SUPPORTED)
            if lost_after is not None and calls["n"] > lost_after:
                raise nv.NVMLError(nv.NVML_ERROR_GPU_IS_LOST)
            return fn(*args)
        setattr(fake, name, wrapped)

    g = lambda h: gpus[h]  # noqa: E731 — the handle is the index
    call("nvmlSystemGetDriverVersion", lambda: recorded["driver"])
    call("nvmlDeviceGetCount", lambda: len(gpus))
    call("nvmlDeviceGetHandleByIndex", lambda i: i)
    call("nvmlDeviceGetName", lambda h: g(h)["name"])
    call("nvmlDeviceGetUUID", lambda h: g(h)["uuid"])
    call("nvmlDeviceGetSerial", lambda h: "1654922006536")
    call("nvmlDeviceGetPciInfo", lambda h: types.SimpleNamespace(busId=g(h)["bus_id"].encode()))
    call("nvmlDeviceGetVbiosVersion", lambda h: "96.00.89.00.01")
    call("nvmlDeviceGetEccMode", lambda h: (1, 1))
    call("nvmlDeviceGetTotalEccErrors", lambda h, kind, counter: 0)
    call("nvmlDeviceGetRemappedRows", lambda h: (0, 4, 1, 0))
    call("nvmlDeviceGetPersistenceMode", lambda h: 0)
    call("nvmlDeviceGetMigMode", lambda h: (0, 0))
    call("nvmlDeviceGetGpuFabricInfoV", lambda h, ref: None)
    call("nvmlDeviceGetComputeRunningProcesses",
         lambda h: [types.SimpleNamespace(pid=4242, usedGpuMemory=512 << 20)])
    call("nvmlDeviceGetMaxPcieLinkGeneration", lambda h: 5)
    call("nvmlDeviceGetMaxPcieLinkWidth", lambda h: 16)

    def fields(h, ids):
        out = (nv.c_nvmlFieldValue_t * len(ids))()
        for v, fid in zip(out, ids):
            v.fieldId, v.nvmlReturn = fid, nv.NVML_SUCCESS
            v.valueType, v.value.ullVal = nv.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, 7
        out[-1].nvmlReturn = nv.NVML_ERROR_NOT_SUPPORTED  # recovery action: an older driver
        return out
    call("nvmlDeviceGetFieldValues", fields)

    def link(h, i):
        if i >= 18:
            raise nv.NVMLError(nv.NVML_ERROR_INVALID_ARGUMENT)
        return nv.NVML_FEATURE_ENABLED
    call("nvmlDeviceGetNvLinkState", link)
    call("nvmlEventSetCreate", lambda: object())
    call("nvmlDeviceRegisterEvents", lambda h, kinds, events: None)

    def wait(events, ms):
        time.sleep(ms / 1000)
        raise nv.NVMLError(nv.NVML_ERROR_TIMEOUT)
    call("nvmlEventSetWait_v2", wait)
    call("nvmlDeviceGetCurrentClocksEventReasons", lambda h: nv.nvmlClocksEventReasonHwSlowdown)
    call("nvmlDeviceGetUtilizationRates", lambda h: types.SimpleNamespace(gpu=98))
    call("nvmlDeviceGetCurrPcieLinkGeneration", lambda h: 5)
    call("nvmlDeviceGetCurrPcieLinkWidth", lambda h: 8)
    return fake



def test_nvml_reader_and_sampler_on_a_replayed_node():
    recorded = fixture(BASE)["node"]["gpu"]["end"]
    nv = _replay(recorded)
    snap = _gpu.snapshot(nv)
    g = snap["gpus"][1]
    assert (g["uuid"], g["bus_id"], g["serial"]) == (recorded["gpus"][1]["uuid"],
                                                    "00000000:2A:00.0", "1654922006536")
    assert g["remapped_rows"] == {"correctable": 0, "uncorrectable": 4, "pending": 1,
                                  "failure": 0}
    assert (g["persistence"], g["mig_enabled"], g["ecc_enabled"]) == (False, False, True)
    assert g["processes"] == [{"pid": 4242, "used_mib": 512}]
    assert len(g["nvlink_up"]) == 18 and g["pcie_replay"] == 7 and g["recovery_action"] is None
    assert g["not_measured"] == {"recovery_action": "Not Supported"}
    sampler = _gpu.Sampler(nv, 0.05)
    sampler.start()
    time.sleep(0.3)
    sampler.stop_event.set()
    sampler.join(2)
    taken = sampler.take()
    s = taken["samples"][0]
    assert s["busy"] == s["n"] >= 2 and s["hw_slowdown"] == s["n"]
    assert (s["pcie_gen_busy_max"], s["pcie_width_busy_max"]) == (5, 8)
    node = {"gpu": {"start": snap, "end": _gpu.snapshot(nv), "window_s": 1.0, **taken,
                    "kernel_xids": [], "kernel_xids_why": ""}, "hca": {"absent": "none"},
            "cuda_ranks": 2, "run_pids": [4242]}
    out = judged(node, want={"pcie_width": 16})
    assert sorted({f["what"].split(": ", 1)[1] for f in out["findings"]}) == [
        "HW slowdown (clocks cut by half or more) in 100% of busy samples",
        "PCIe link at Gen5 x8 under load, expected Gen5 x16",
        "persistence mode is off", "row remap pending"]


def test_nvml_reader_says_what_is_unsupported_and_names_a_lost_gpu():
    recorded = fixture(BASE)["node"]["gpu"]["end"]
    snap = _gpu.snapshot(_replay(recorded, unsupported={"nvmlDeviceGetRemappedRows",
                                                        "nvmlDeviceGetGpuFabricInfoV"}))
    g = snap["gpus"][0]
    assert g["remapped_rows"] is None and g["fabric"] is None
    assert g["not_measured"]["remapped rows"] == "Not Supported"
    lost = _gpu.snapshot(_replay(recorded, lost_after=30))
    assert lost["gpus"][0].get("lost") is None and lost["gpus"][1]["lost"] is True
    out = judged({"gpu": {"start": lost, "end": lost, "window_s": 1.0, "samples": None},
                  "hca": {"absent": "none"}})
    assert any(f["what"].endswith("lost (NVML_ERROR_GPU_IS_LOST)") and f["gpu"] == 1
               for f in out["findings"])


def test_kernel_log_read_in_part_is_said(tmp_path):
    log = tmp_path / "kmsg"
    log.write_text("6,1,5000000,-;NVRM: Xid (PCI:0000:44:00): 79, GPU has fallen off the bus\n")
    found, why = _gpu.kernel_xids(str(log), limit_s=-1)  # a regular file never ends: cut
    assert found == [] and "not read to its end" in why
    node = fixture("remap_pending")["node"]
    node["gpu"]["kernel_xids_why"] = why
    assert any("not read to its end" in m for m in judged(node)["not_measured"])


def test_kernel_log_records_are_parsed_from_the_device_format(tmp_path):
    log = tmp_path / "kmsg"  # /dev/kmsg gives one record per read; a file gives all at once
    log.write_text("4,9,1000000,-;NVRM: Xid (PCI:0000:44:00): 79, GPU has fallen off the bus\n")
    found, why = _gpu.kernel_xids(str(log))
    assert why == "" and [(x["bus"], x["xid"]) for x in found] == [("0000:44:00", 79)]


def test_stray_process_on_a_gpu_no_rank_uses_is_still_named():
    node = fixture(BASE)["node"]
    end_gpu(node, 0)["processes"] = [{"pid": 100, "used_mib": 900}]
    end_gpu(node, 1)["processes"] = [{"pid": 4242, "used_mib": 70000}]
    node["run_pids"] = [100]
    assert [f["gpu"] for f in judged(node, OFF)["findings"]] == [1]
