"""The environment check's judgement on recorded identities (pure: no process group)."""
from ddp_smoke.checks import environment
from ddp_smoke.checks.api import Evidence
from ddp_smoke.config import defaults


def _evidence(ranks: list[dict], **cfg) -> Evidence:
    obs = [{"versions": {"torch": "2.13.0", "cuda": None, "nccl": None, "cudnn": None,
                         "driver": None, "python": "3.11"}, "env": {}, "world_size_env": len(ranks),
            "local_world_size": 1} for _ in ranks]
    return Evidence("environment", obs, ranks, {**defaults(), **cfg})


def _rank(r: int, host: str, addr: str, node: str) -> dict:
    return {"rank": r, "local_rank": 0, "host": host, "route_address": addr,
            "addresses": {"lo": "127.0.0.1", "eth0": addr}, "slurm_node": node}


def test_two_machines_with_one_hostname_are_named_as_such_with_address_and_node():
    ranks = [_rank(0, "n1", "10.0.0.1", "gpu1"), _rank(1, "n2", "10.0.0.2", "gpu2"),
             _rank(2, "n2", "10.0.0.3", "gpu3"), _rank(3, "n4", "10.0.0.4", "gpu4")]
    got = environment.judge(_evidence(ranks, expect_nodes=4))
    assert got.status == "fail"
    assert [(c.rank, c.host) for c in got.culprits] == [(1, "n2"), (2, "n2")]
    first = got.culprits[0].reason
    assert "same hostname 'n2'" in first and "10.0.0.2 (Slurm node gpu2)" in first
    assert "10.0.0.3 (Slurm node gpu3)" in first and "Duplicate GPU detected" in first
    # the consequences are not named again: slots and the node count are per machine
    assert not any("shares slot" in c.reason or "promised" in c.reason for c in got.culprits)


def test_ranks_of_one_machine_share_its_hostname_without_a_finding():
    ranks = [{**_rank(r, "n1", "10.0.0.1", "gpu1"), "local_rank": r} for r in range(3)]
    assert environment.judge(_evidence(ranks, expect_nodes=1)).status == "pass"


def test_an_interface_that_came_between_two_ranks_looks_is_not_a_second_machine():
    """Recorded from a rehearsal of the suite: rank 0 read its addresses while another test's
    bridge (10.231.1.1) was up on the machine, rank 1 after it went; they share 192.0.2.2."""
    ranks = [{**_rank(0, "vm", "192.0.2.2", None), "local_rank": 0},
             {**_rank(1, "vm", "192.0.2.2", None), "local_rank": 1}]
    ranks[0]["addresses"]["dsn-br"] = "10.231.1.1"
    got = environment.judge(_evidence(ranks, expect_nodes=1))
    assert got.status == "pass", [c.reason for c in got.culprits]


def _with_torch(versions: list[str]):
    ranks = [{**_rank(r, f"n{r // 2}", f"10.0.0.{r // 2 + 1}", None), "local_rank": r % 2}
             for r in range(len(versions))]
    ev = _evidence(ranks, expect_nodes=len(versions) // 2)
    for o, v in zip(ev.observations, versions):
        o["versions"] = {**o["versions"], "torch": v}
    return environment.judge(ev)


def test_a_node_with_another_torch_among_more_is_named_by_its_ranks():
    got = _with_torch(["2.13.0", "2.13.0", "2.12.0", "2.12.0", "2.13.0", "2.13.0"])
    assert [(c.rank, c.host) for c in got.culprits] == [(2, "n1"), (3, "n1")]
    assert got.culprits[0].reason == "torch 2.12.0 here, 2.13.0 on 4 of 6 ranks"


def test_two_nodes_with_two_torches_name_the_job_not_an_arbitrary_side():
    """No majority: whichever version came first was taken for the common one, naming the
    other node's ranks (the campaign's torch_skew.middle.join.slurm.2x2 would have been right
    or wrong by which node held rank 0)."""
    for versions in (["2.13.0"] * 2 + ["2.12.0"] * 2, ["2.12.0"] * 2 + ["2.13.0"] * 2):
        got = _with_torch(versions)
        [culprit] = got.culprits
        assert culprit.rank is None and culprit.host is None, culprit
        assert culprit.reason.startswith("torch differs with no majority: "), culprit.reason
        assert "2.13.0 on ranks" in culprit.reason and "2.12.0 on ranks" in culprit.reason
