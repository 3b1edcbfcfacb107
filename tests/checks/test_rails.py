"""Rails without traffic: the NIC a rank sends on (NCCL's log), where it sits (made sysfs trees,
tests/data/topology), the rails check's judgement, the bandwidth check's per-rail blame, the
dead-rail rule, and how the outputs say rail. Pure: no process of the worker runs here; the
real runs are tests/worker/test_diagnosis_rails.py.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ddp_smoke import config
from ddp_smoke.config import profiles
from ddp_smoke.checks import _nccl_log as nccl_log, _pairs, _topology as topology, perf
from ddp_smoke.checks import bandwidth, rails
from ddp_smoke.checks.api import Evidence
from ddp_smoke.config.launchenv import LaunchEnv
from ddp_smoke.coordination import rails as binding, stragglers
from ddp_smoke.errors import ConfigError
from ddp_smoke.model import FAIL, Culprit, CheckResult, Report
from ddp_smoke.outputs import metrics, page
from ddp_smoke.outputs.hosts import host_lists, hosts_section, render
from ddp_smoke.outputs.report import as_dict
from tests import report_schema

DATA = Path(__file__).resolve().parent.parent / "data"
CFG = config.resolve({}, {})
CPU = profiles.load("cpu")


def make_tree(root: Path, name: str) -> Path:
    """A made sysfs tree (tests/data/topology/<name>.json) under root."""
    fixture = json.loads((DATA / "topology" / f"{name}.json").read_text())
    for rel, text in fixture["files"].items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text + "\n")
    for rel, target in sorted(fixture["links"].items(), key=lambda kv: kv[0].count("/")):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(root / target, (root / rel).parent), root / rel)
    return root


@pytest.fixture(scope="module")
def gpu_root(tmp_path_factory) -> str:
    return str(make_tree(tmp_path_factory.mktemp("gpu"), "gpu-8rail"))


@pytest.fixture(scope="module")
def cpu_root(tmp_path_factory) -> str:
    return str(make_tree(tmp_path_factory.mktemp("cpu"), "cpu-2numa"))


GPUS = json.loads((DATA / "topology" / "gpu-8rail.json").read_text())["gpus"]


# -- NCCL's log: the NIC a process sends on -------------------------------------------------

def _log(name: str) -> dict:
    return nccl_log.parse((DATA / "nccl" / name).read_text().splitlines())


def test_the_nic_a_gpu_sends_on_comes_from_its_channel_lines():
    aligned = nccl_log.sending_nic(_log("rails-gpu3-aligned.log"))
    assert aligned == {"device": "mlx5_3", "port": 1, "link_layer": "IB", "transport": "IB",
                       "index": 3, "channels": {"IB/3": 4}}
    crossed = nccl_log.sending_nic(_log("rails-gpu3-crossnic.log"))
    assert (crossed["device"], crossed["index"]) == ("mlx5_5", 5)
    assert crossed["channels"] == {"IB/5": 3, "IBext/3": 1}  # proxy and plugin forms counted
    assert nccl_log.sending_nic(_log("ib-gdr-enabled-old.log"))["index"] == 0  # "Ring" lines
    assert nccl_log.sending_nic(_log("ib-roce-nccl-2.19.log")) is None  # no channel line
    assert nccl_log.nics(_log("socket-no-libibverbs.log")["devices"]) == {
        "Socket": {0: {"device": "eth0", "address": "10.177.137.15"}}}


# -- sysfs: where things sit -----------------------------------------------------------------

def test_made_tree_places_gpus_nics_and_cores(gpu_root, cpu_root):
    gpu3, nic3, nic5 = (topology.gpu(gpu_root, GPUS[3]), topology.nic(gpu_root, "mlx5_3"),
                        topology.nic(gpu_root, "mlx5_5"))
    assert gpu3["numa_node"] == 0 and gpu3["path"][0] == "pci0000:00"
    assert (nic3["kind"], nic3["numa_node"], nic5["numa_node"]) == ("rdma", 0, 1)
    assert [topology.link(gpu3, topology.nic(gpu_root, f"mlx5_{i}")) for i in range(8)] == \
        ["PHB", "PHB", "PHB", "PIX", "SYS", "SYS", "SYS", "SYS"]
    assert topology.rdma_devices(gpu_root) == [f"mlx5_{i}" for i in range(8)]
    assert topology.numa_of_cpus(gpu_root, {3, 60}) == [0, 1]
    assert topology.nic(cpu_root, "eth1")["numa_node"] == 1
    assert topology.nic(cpu_root, "veth0") is None  # virtual: no PCI device
    assert topology.nic(cpu_root, "nope0") is None
    assert topology.cpulist("0-3,8,10-11") == {0, 1, 2, 3, 8, 10, 11}


# -- the rails check -------------------------------------------------------------------------

def _gpu_obs(root: str, local: int, sent: str, listed=None, wanted=None) -> dict:
    rail = {"index": local, "device": sent, "port": 1, "source": "NCCL log", "sent_on": sent,
            "dead": None}
    listed = listed if listed is not None else [f"mlx5_{i}" for i in range(8)]
    candidates = {d: d in listed for d in topology.rdma_devices(root)}
    return {"rail": rail, "wanted": wanted,
            **rails.locate(root, sent, GPUS[local], {local}, candidates)}


def _judge(obs: list[dict], per_node: int, cfg=CFG) -> CheckResult:
    ranks = [{"rank": r, "host": f"n{r // per_node}", "local_rank": r % per_node}
             for r in range(len(obs))]
    return rails.judge(Evidence("rails", obs, ranks, cfg))


def test_aligned_rails_pass_with_the_whole_chain(gpu_root):
    obs = [_gpu_obs(gpu_root, i % 8, f"mlx5_{i % 8}") for i in range(16)]
    result = _judge(obs, 8)
    assert result.status == "pass", result.culprits
    first = result.figures["ranks"][3]
    assert first["gpu"] == {"bus_id": GPUS[3], "numa_node": 0}
    assert first["nic"]["device"] == "mlx5_3" and first["link"] == "PIX"
    assert result.summary == "16 of 16 ranks placed (PIX); each sends on a NIC as near as any"


def test_a_gpu_on_another_numa_nodes_nic_is_named_with_the_fix(gpu_root):
    obs = [_gpu_obs(gpu_root, i % 8, f"mlx5_{i % 8}") for i in range(16)]
    obs[11] = _gpu_obs(gpu_root, 3, "mlx5_5")  # node 1's GPU 3 sends through NIC 5
    result = _judge(obs, 8)
    assert result.status == "fail"
    assert [(c.rank, c.host, c.rail) for c in result.culprits] == [
        (11, "n1", {"index": 3, "device": "mlx5_5", "port": 1})]
    reason = result.culprits[0].reason
    assert f"GPU {GPUS[3]} (NUMA 0, rank 11) sends on mlx5_5" in reason
    assert "SYS, on another NUMA node" in reason and "mlx5_3" in reason and "is PIX" in reason
    assert "NCCL_IB_HCA" in reason and "NCCL_CROSS_NIC=0" in reason and "NCCL_TOPO_FILE" in reason


def test_a_nearer_nic_nccl_does_not_list_points_at_its_port(tmp_path):
    root = str(make_tree(tmp_path, "gpu-8rail"))
    listed = [f"mlx5_{i}" for i in range(8) if i != 1]
    obs = [_gpu_obs(root, i % 8, f"mlx5_{i % 8}", listed) for i in range(16)]
    obs[1] = _gpu_obs(root, 1, "mlx5_0", listed)  # NCCL_IB_HCA leaves its own NIC out
    result = _judge(obs, 8)
    assert [c.rank for c in result.culprits] == [1]
    assert "PHB" in result.culprits[0].reason
    assert ("NCCL does not list mlx5_1: NCCL_IB_HCA leaves it out (port 1 4: ACTIVE): list it "
            "for this rail") in result.culprits[0].reason
    state = next(tmp_path.glob("sys/devices/**/infiniband/mlx5_1/ports/1/state"))
    state.write_text("1: DOWN\n")  # as the kernel spells a port that went down
    obs[1] = _gpu_obs(root, 1, "mlx5_0", listed)
    assert "NCCL does not list mlx5_1: its port is not active (port 1 1: DOWN): the health " \
        "check names it" in _judge(obs, 8).culprits[0].reason


def test_nccl_candidates_are_its_nics_and_the_sites_rails():
    devices = ["mlx5_0", "mlx5_1", "mlx5_8"]  # mlx5_8: a storage NIC nobody names a rail
    assert rails.nccl_candidates(devices, ["mlx5_0"], None) == {"mlx5_0": True}
    assert rails.nccl_candidates(devices, ["mlx5_0"], ["mlx5_0:1", "mlx5_1:1"]) == {
        "mlx5_0": True, "mlx5_1": False}


def test_the_sites_rails_setting_is_held_against_nccls_choice(gpu_root):
    obs = [_gpu_obs(gpu_root, i % 8, f"mlx5_{i % 8}", wanted=f"mlx5_{i % 8}") for i in range(16)]
    obs[2] = _gpu_obs(gpu_root, 2, "mlx5_2", wanted="mlx5_6")
    result = _judge(obs, 8)
    assert [c.rank for c in result.culprits] == [2]
    assert "the site's rails name mlx5_6 for local rank 2" in result.culprits[0].reason


def _cpu_obs(root: str, local: int, sent: str, cores: set[int]) -> dict:
    rail = {"index": local, "device": sent, "port": None, "source": "rails setting",
            "sent_on": sent, "dead": None}
    return {"rail": rail, "wanted": sent,
            **rails.locate(root, sent, None, cores, {"eth0": True, "eth1": True})}


def test_a_cpu_rank_whose_cores_are_far_from_its_nic_is_named(cpu_root):
    aligned = [_cpu_obs(cpu_root, 0, "eth0", set(range(16))),
               _cpu_obs(cpu_root, 1, "eth1", set(range(16, 32)))] * 2
    assert _judge(aligned, 2).status == "pass"
    crossed = aligned[:3] + [_cpu_obs(cpu_root, 1, "eth1", set(range(16)))]
    result = _judge(crossed, 2)
    assert [(c.rank, c.host) for c in result.culprits] == [(3, "n1")]
    assert result.culprits[0].reason == (
        "rank 3 runs on cores 0-15 (NUMA 0) but sends on eth1 (NUMA 1); eth0 is on NUMA 0: bind "
        "the rank to NUMA 1 (numactl --cpunodebind=1) or order the rails setting so that local "
        "rank 1 gets eth0")
    assert result.figures["ranks"][3]["link"] == "remote"


def test_virtual_interfaces_and_one_node_are_skipped_never_passed(cpu_root):
    virtual = [_cpu_obs(cpu_root, r % 2, "veth0", {0}) for r in range(4)]
    result = _judge(virtual, 2)
    assert result.status == "skip"
    assert result.summary == "not measured: veth0 has no PCI device in sysfs (a virtual interface)"
    assert _judge(virtual, 4).summary == "one node: no rank sends over a network"


# -- the bandwidth check, per rail -----------------------------------------------------------

GOOD, SLOW = 1.0, 0.02
SIZE = 2 << 20


def _bandwidth(nodes: int, speed, dead=(), devices=("eth0", "eth1"), cfg=CFG) -> CheckResult:
    """Observations of a run of ``nodes`` x 2 ranks whose rail pairs ran at ``speed(rail, a,
    b)`` GB/s; ``dead``: (node, rail) found dead before the process group."""
    per = len(devices)
    rows = _pairs.layout([r // per for r in range(nodes * per)], [r % per for r in range(nodes * per)],
                         [1 + r % per for r in range(nodes * per)],
                         [int((r // per, r % per) in dead) for r in range(nodes * per)])
    obs = []
    for r in range(nodes * per):
        node, rail = r // per, r % per
        measured = [{"pass": 1, "round": 0, "node": node, "peer_node": peer, "rail": rail,
                     "time_us": SIZE / (speed(rail, *sorted((node, peer))) * 1e9) * 1e6}
                    for peer in range(nodes) if peer != node and (node, rail) not in dead
                    and (peer, rail) not in dead]
        why = {"why": "cut off", "unreached": ["x", "y"], "tried": 2} \
            if (node, rail) in dead else None
        if why and nodes == 2:
            why = {"why": "unresolved", "unreached": ["x"], "tried": 1}
        obs.append({"rows": [], "nodes": nodes, "profile": CPU, "sweep_s": 0.1,
                    "pairs_s": 0.1,
                    "rail": {"index": rail, "device": devices[rail], "port": None,
                             "sent_on": "eth0" if why else devices[rail], "dead": why},
                    "pairs": {"size_bytes": SIZE, "device_type": "cpu", "measured": measured,
                              "leaders": [n * per for n in range(nodes)] if r == 0 else None,
                              "rails": rows if r == 0 else None}})
    ranks = [{"rank": r, "host": f"node{r // per + 1}", "local_rank": r % per}
             for r in range(nodes * per)]
    return bandwidth.judge(Evidence("bandwidth", obs, ranks, cfg))


def _named(result: CheckResult) -> list[tuple]:
    return [(c.rank, c.host, c.ranks, (c.rail or {}).get("index")) for c in result.culprits]


def test_one_nodes_slow_rail_names_that_rail_not_the_node_nor_its_other_rail():
    result = _bandwidth(4, lambda rail, a, b: SLOW if rail == 1 and 2 in (a, b) else GOOD)
    assert _named(result) == [(5, "node3", None, 1)]
    assert result.culprits[0].reason.startswith(
        "node node3 rail 1 (eth1) is slow with every partner on it (node1 0.02, node2 0.02, "
        "node4 0.02 GB/s; reference 1.00 GB/s); its other 1 rail(s) are fine")
    pairs = result.figures["pairs"]
    assert [r["index"] for r in pairs["rails"]] == [0, 1] and len(pairs["results"]) == 12
    assert pairs["rails"][1]["devices"] == ["eth1"] * 4


def test_a_node_slow_on_every_rail_is_the_node():
    result = _bandwidth(4, lambda rail, a, b: SLOW if 2 in (a, b) else GOOD)
    assert _named(result) == [(4, "node3", None, None)]
    assert "is slow with every partner on every rail" in result.culprits[0].reason


def test_a_rail_slow_on_every_node_is_the_rail():
    result = _bandwidth(3, lambda rail, a, b: SLOW if rail == 1 else GOOD)
    assert _named(result) == [(None, None, None, 1)]
    assert result.culprits[0].reason.startswith(
        "rail 1 (eth1) slow on all nodes: its leaf switch or the NCCL setting")
    assert result.culprits[0].rail["ranks"] == [1, 3, 5]


def test_a_slow_link_on_one_rail_names_both_ends_on_that_rail():
    result = _bandwidth(4, lambda rail, a, b: SLOW if rail == 1 and (a, b) == (0, 1) else GOOD)
    assert _named(result) == [(None, None, [1, 3], 1)]
    assert " on rail 1 (eth1): 0.02 GB/s" in result.culprits[0].reason


def test_dead_rails_are_named_dead_and_left_out_of_the_pairs():
    one = _bandwidth(3, lambda *_: GOOD, dead={(2, 1)})
    assert _named(one) == [(5, "node3", None, 1)]
    assert one.culprits[0].reason.startswith("node node3 rail 1 (eth1) carries no connection")
    assert not any(p["rail"] == 1 and 2 in (p["node_a"], p["node_b"])
                   for p in one.figures["pairs"]["results"])
    everywhere = _bandwidth(3, lambda *_: GOOD, dead={(n, 1) for n in range(3)})
    assert _named(everywhere) == [(None, None, None, 1)]
    assert "dead on all nodes" in everywhere.culprits[0].reason
    two = _bandwidth(2, lambda *_: GOOD, dead={(0, 1)} | {(1, 1)})
    assert _named(two) == [(None, None, [1, 3], 1)]  # rail-wide needs a third node to tell


def test_the_runs_reference_percentile_and_probe_settings_are_the_ones_applied():
    """Half the pairs slow (rail 1 everywhere): against the 90th-percentile pair rail 1 is
    slow; a run whose reference is the median pair finds nothing slow. A dead rail's reason
    quotes the probes as the run set them."""
    def slow_rail(rail, a, b):
        return SLOW if rail == 1 else GOOD
    assert _named(_bandwidth(4, slow_rail)) == [(None, None, None, 1)]
    median = config.resolve({"bandwidth": {"pair_reference_percentile": 50}}, {})
    assert _named(_bandwidth(4, slow_rail, cfg=median)) == []
    quick = config.resolve({"diagnosis": {"probe_s": 0.5, "probe_rounds": 3}}, {})
    dead = _bandwidth(3, lambda *_: GOOD, dead={(2, 1)}, cfg=quick)
    assert "(probe port, 3 tries of 0.5 s each, before the process group)" in \
        dead.culprits[0].reason, dead.culprits[0].reason


def test_the_ranks_of_a_rail_named_as_a_whole_are_not_named_again_as_stragglers():
    """Rail 1 slow everywhere: its ranks arrive last at every round's barrier; the rail
    explains it (seen in the two-rail sandbox: rank 5 named a straggler beside the rail)."""
    wide = Culprit(None, None, "rail 1 (eth1) slow on all nodes",
                   rail={"index": 1, "device": "eth1", "port": None, "ranks": [1, 3, 5]})
    result = CheckResult("bandwidth", FAIL, summary="rail 1", culprits=[wide])
    late = [[0.01 if r == 5 else 0.05] * 100 for r in range(6)]  # rank 5 always last
    stragglers.attach(result, late, lambda r, why: Culprit(r, f"h{r}", why))
    assert result.culprits == [wide]
    alone = CheckResult("bandwidth", FAIL, summary="x", culprits=[
        Culprit(None, None, "rail 1", rail={"index": 1, "device": "eth1", "port": None})])
    stragglers.attach(alone, late, lambda r, why: Culprit(r, f"h{r}", why))
    assert [c.rank for c in alone.culprits] == [None, 5]  # without its ranks: named


def test_one_network_keeps_the_node_pairs_of_old():
    assert _pairs.layout([0, 0, 1, 1], [0, 1, 0, 1], [7, 7, 7, 7], [0, 0, 0, 0]) is None
    assert _pairs.layout([0, 0, 1, 1], [0, 1, 0, 1], [7, 8, 7, 8], [0, 0, 0, 0]) == [
        {"index": 0, "ranks": [0, 2]}, {"index": 1, "ranks": [1, 3]}]


def test_one_network_is_the_one_rail_case_with_the_node_pairs_reasons():
    """No rails: the same judgement with the nodes' leaders as its one row; no rail in the
    figures, the culprits or their reasons."""
    one = ("eth0",)
    node = _bandwidth(4, lambda rail, a, b: SLOW if 2 in (a, b) else GOOD, devices=one)
    assert _named(node) == [(2, "node3", None, None)]
    assert node.culprits[0].reason == (
        "node node3 is slow with every partner (node1 0.02, node2 0.02, node4 0.02 GB/s; "
        "reference 1.00 GB/s)")
    pairs = node.figures["pairs"]
    assert "rails" not in pairs and "dead" not in pairs and len(pairs["results"]) == 6
    assert not any("rail" in r for r in pairs["results"])
    link = _bandwidth(4, lambda rail, a, b: SLOW if (a, b) == (0, 1) else GOOD, devices=one)
    assert _named(link) == [(None, None, [0, 1], None)]
    assert link.culprits[0].reason == (
        "link node1 (rank 0) <-> node2 (rank 1): 0.02 GB/s, 98 % below the reference 1.00 "
        "GB/s; both nodes are fast with other partners")


def test_a_given_reference_judges_a_rail_against_the_others():
    busbw = {(0, 1): SLOW, (0, 2): SLOW, (1, 2): SLOW}
    assert perf.attribute(busbw, 0.5)["slow"] == []  # against itself, nothing is slow
    assert len(perf.attribute(busbw, 0.5, reference=GOOD)["slow"]) == 3


# -- a dead rail, before the process group ---------------------------------------------------

def test_cut_off_names_the_rank_its_peers_fail_with():
    cut = {2: {"tried": [0, 1], "failed": [0, 1]}, 0: {"tried": [1, 2], "failed": [2]},
           1: {"tried": [0, 2], "failed": [2]}}
    assert binding.cut_off(cut) == {2: "cut off"}
    healthy = {r: {"tried": [x for x in range(3) if x != r], "failed": []} for r in range(3)}
    assert binding.cut_off(healthy) == {}
    two = {0: {"tried": [1], "failed": [1]}, 1: {"tried": [0], "failed": [0]}}
    assert binding.cut_off(two) == {0: "unresolved", 1: "unresolved"}
    one_way_link = {0: {"tried": [1, 2, 3], "failed": [1]}, 1: {"tried": [0, 2, 3], "failed": []},
                    2: {"tried": [0, 1, 3], "failed": []}, 3: {"tried": [0, 1, 2], "failed": []}}
    assert binding.cut_off(one_way_link) == {0: "unresolved", 1: "unresolved"}


def test_rails_setting_is_checked_before_any_rank_connects():
    env = LaunchEnv.from_environ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                                  "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                  "MASTER_PORT": "29500"})
    cfg = config.resolve({"rails": ["lo", "nope0"]}, {"backend": "gloo"})
    with pytest.raises(ConfigError, match=r"key 'rails' = \['lo', 'nope0'\]: local rank 1's "
                                          r"interface 'nope0' has no IPv4 address on "):
        binding.check(cfg, env)
    binding.check(config.resolve({"rails": ["nope0", "lo"]}, {"backend": "gloo"}), env)
    assert binding.interface(["eth0", "eth1"], 3) == "eth1"


@pytest.mark.parametrize("value, needle", [
    ([], "a list of 1 to 64 distinct network device names"),
    (["eth0", "eth0"], "distinct"),
    (["eth 0"], "'eth 0'"),
    (["a/b"], "'a/b'"),
    ("eth0", "expected a list"),
    ([1], "expected a list"),
])
def test_bad_rails_settings_are_one_line_errors(value, needle):
    with pytest.raises(ConfigError, match=needle):
        config.resolve({"rails": value}, {})


# -- the outputs say rail ------------------------------------------------------------------

def _rail_report() -> Report:
    ranks = [{"rank": r, "local_rank": r % 2, "host": f"node{r // 2 + 1}"} for r in range(6)]
    culprits = [Culprit(5, "node3", "node node3 rail 1 (eth1) is slow",
                        rail={"index": 1, "device": "eth1", "port": None}),
                Culprit(None, None, "rail 0 (eth0) slow on all nodes",
                        rail={"index": 0, "device": "eth0", "port": None})]
    pairs = {"results": [{"rail": 1, "node_a": 0, "node_b": 2, "host_a": "node1",
                          "host_b": "node3", "busbw_gbps": 0.02, "slow": True},
                         {"rail": 0, "node_a": 0, "node_b": 2, "host_a": "node1",
                          "host_b": "node3", "busbw_gbps": 1.0, "slow": False}],
             "rails": [{"index": 0, "ranks": [0, 2, 4], "devices": ["eth0"] * 3},
                       {"index": 1, "ranks": [1, 3, 5], "devices": ["eth1"] * 3}],
             "reference_busbw_gbps": 1.0, "size_bytes": SIZE}
    check = CheckResult("bandwidth", FAIL, culprits=culprits, figures={"pairs": pairs})
    return Report("0", "2026-12-01T10:00:00+00:00", "gloo", 6, ranks, [check], {"timeout": 9, "checks": ["bandwidth"]},
                  timings={"total_s": 1.0}, run_id="r1", written_by="rank 0")


def test_host_lists_page_and_metrics_say_the_rail():
    report = _rail_report()
    hosts = hosts_section(report)
    node3 = next(h for h in hosts if h["host"] == "node3")
    assert node3["status"] == "bad"
    assert node3["rails"] == [{"index": 1, "device": "eth1", "port": None, "status": "bad"}]
    assert all("rails" not in h for h in hosts if h["host"] != "node3")
    lists = host_lists(hosts)
    assert lists["bad_hosts.txt"] == "node3\n"  # one host a line: tools feed it to --exclude
    assert lists["bad_rails.txt"] == "node3 rail 1 eth1\n"
    printed = render(hosts, "r1", "/r", None)
    assert "bad_rails.txt" in printed[0]
    assert printed[1].startswith("#   bad     node3                · rail 1 (eth1) bad bandwidth")
    html = page.render(as_dict(report))
    assert "rank 5 (node3) · rail 1 (eth1)" in html
    assert "rail 0 (eth0), every node" in html
    assert "rail 1 (eth1): <span class=\"chip bad\">bad</span>" in html
    assert html.count("<figcaption>rail ") == 2  # a pair matrix per rail
    text = metrics.render(as_dict(report), "r1", 0.0)
    assert 'ddp_smoke_pair_busbw_gbps{host_a="node1",host_b="node3",rail="1"} 0.02' in text
    assert report_schema.problems({**as_dict(report), "hosts": hosts}) == []
