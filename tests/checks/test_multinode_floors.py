"""Multi-node bandwidth floors (profiles' multi_node section) and the "no data is not a pass" rule.

Pure judgements on observations shaped like a real 2 x 8 and 4 x 8 run: the profile files as
shipped, the bandwidth check's own judge.
"""
from __future__ import annotations

import pytest

from ddp_smoke import config
from ddp_smoke.config import profiles
from ddp_smoke.checks import bandwidth
from ddp_smoke.errors import ConfigError
from ddp_smoke.checks.api import Evidence

GIB16 = 16 << 30


def _evidence(profile: dict, nodes: int, per_node: int, busbw: float | None) -> Evidence:
    """n ranks whose all_reduce at 16 GiB took the time that gives this busbw."""
    n = nodes * per_node
    rows = []
    if busbw is not None:
        algbw = busbw / (2 * (n - 1) / n)
        rows.append({"collective": "all_reduce", "size_bytes": GIB16, "count": GIB16 // 4,
                     "type": "float32", "redop": "sum", "root": -1, "iterations": 5,
                     "time_us": GIB16 / algbw / 1e3, "nwrong": 0, "wrong_from": []})
    obs = [{"rows": rows, "pairs": {"skipped": "not measured here"}, "nodes": nodes,
            "profile": profile, "sweep_s": 1.0, "pairs_s": 0.0} for _ in range(n)]
    ranks = [{"rank": r, "host": f"gpu{r // per_node}"} for r in range(n)]
    return Evidence("bandwidth", obs, ranks, config.resolve({}, {}))


@pytest.mark.parametrize("name, nodes, busbw, status", [
    ("h100-8gpu", 2, 350.0, "pass"), ("h100-8gpu", 2, 300.0, "fail"),
    ("h200-8gpu", 4, 340.0, "pass"), ("b200-8gpu", 2, 320.0, "fail"),
    ("p5-h100-efa", 2, 480.0, "pass"), ("p5-h100-efa", 2, 400.0, "fail"),
    ("h100-8gpu", 1, 470.0, "pass"),  # one node: the single-node floor (460)
    ("h100-8gpu", 1, 400.0, "fail"),
])
def test_floors_apply_by_node_count(name, nodes, busbw, status):
    result = bandwidth.judge(_evidence(profiles.load(name), nodes, 8, busbw))
    assert result.status == status, result.culprits
    assert result.figures["floors"]["applied"]
    if status == "fail":
        assert "below the" in result.culprits[0].reason


def test_no_floor_for_the_shape_fails_when_the_profile_gates():
    """a100-8gpu has no multi-node floor; 2 x 4 ranks fits no h100 floor: no data, no pass."""
    for name, nodes, per_node in (("a100-8gpu", 2, 8), ("h100-8gpu", 2, 4)):
        result = bandwidth.judge(_evidence(profiles.load(name), nodes, per_node, 500.0))
        assert result.status == "fail", name
        assert "no floor to judge this run by" in result.culprits[0].reason
    cpu = bandwidth.judge(_evidence(profiles.load("cpu"), 2, 8, 1.0))
    assert cpu.status == "pass"  # no floors at all: figures only, as before


def test_a_floor_whose_size_was_not_measured_fails():
    result = bandwidth.judge(_evidence(profiles.load("h100-8gpu"), 2, 8, None))
    assert result.status == "fail" and "not measured" in result.culprits[0].reason


def test_sweep_reaches_the_multi_node_floor_size():
    h100 = profiles.load("h100-8gpu")
    assert profiles.floor_sizes(h100, ["all_reduce"], 16, 2) == [GIB16]
    assert profiles.floor_sizes(h100, ["all_reduce"], 12, 2) == []
    assert profiles.bandwidth_floors(h100, 32, 4)[1] is None


def test_shipped_multi_node_profiles_cite_and_expect_their_fabric():
    for name in ("h100-8gpu", "h200-8gpu", "b200-8gpu", "p5-h100-efa"):
        p = profiles.load(name)
        assert p["multi_node"]["floors"] and p["multi_node"]["fabric"], name
        assert p["expect_transport"] in ("ib", "libfabric"), name
        assert any("field reports" in s or "awsome" in s for s in p["sources"]), name


def test_shipped_profiles_cite_only_what_a_reader_can_open():
    """A source is a public address or says what it is; never a file this project does not
    ship (issue 25: profiles cited ../shared/reference/field-facts.md)."""
    for name in profiles.names():
        for source in profiles.load(name)["sources"]:
            assert source.startswith(("https://", "field reports: ", "none: ")), (name, source)
            assert ".md'" not in source and "../" not in source, (name, source)


@pytest.mark.parametrize("body, needle", [
    ("multi_node: {ranks_per_node: 8, min_nodes: 0, floors: []}", "min_nodes"),
    ("multi_node: {ranks_per_node: 8, min_nodes: 2, floor: []}", "unknown key 'floor'"),
    ("multi_node: {ranks_per_node: 8, min_nodes: 2, floors: [{collective: all_reduce}]}",
     "bandwidth floor"),
    ("expect_transport: [ib]", "expect_transport"),
])
def test_bad_multi_node_sections_are_config_errors(tmp_path, body, needle):
    path = tmp_path / "p.yaml"
    path.write_text(body + "\n")
    with pytest.raises(ConfigError, match=needle):
        profiles.load(str(path))
