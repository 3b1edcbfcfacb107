"""The fleet memory's rules (outputs/fleet.py) on recorded histories: the circuit breaker, lemons
and their escalation, the kit's drain records as ``ddp-smoke history`` lists them.

The histories are folders of runs made from two reports node-check recorded on this machine
(tests/data/fleet/: a pass, and a fail whose worker never ran), each copy given its run id,
start time, host and boot id, and its host's status where a run failed.
"""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_smoke.outputs import fleet, history
from ddp_smoke.outputs.runs import Index

DATA = Path(__file__).resolve().parents[1] / "data" / "fleet"
FULL = "write failed: [Errno 28] No space left on device: '/shared/ckpt/ddp-smoke-7/rank{r}.bin'"
pytestmark = pytest.mark.planted_report  # the histories are copies of recorded reports


def _reasons(check: str, text: str) -> list[dict]:
    return [{"check": check, "reason": text}]


# -- the circuit breaker --------------------------------------------------------------------

def test_a_full_disk_naming_every_node_trips_the_breaker_and_names_the_storage():
    failing = {f"gpu{r}": _reasons("storage", FULL.format(r=r)) for r in range(3)}
    tripped = fleet.breaker(failing, 3, 0.5, {"storage": "/shared/ckpt (nfs)"})
    assert tripped is not None and tripped["kind"] == "storage"
    assert tripped["failing"] == ["gpu0", "gpu1", "gpu2"]
    assert tripped["line"].startswith("circuit breaker: 3 of 3 nodes failed (more than 50%): "
                                      "drained none; the cause is likely shared (storage): "
                                      "every one failed storage: ")
    assert "No space left on device" in tripped["line"]
    assert tripped["line"].endswith("all of them used /shared/ckpt (nfs)")


@pytest.mark.parametrize("failing,nodes,share", [
    (1, 2, 0.5),    # one bad node of two: a node's own fault, drained
    (1, 1, 0.5),    # a one-node run (node-check): nothing to compare with
    (2, 4, 0.5),    # exactly the share: not more than it
    (3, 4, 0.75),
])
def test_the_breaker_lets_a_share_up_to_the_limit_through(failing, nodes, share):
    bad = {f"n{i}": _reasons("compute", "slow") for i in range(failing)}
    assert fleet.breaker(bad, nodes, share) is None


def test_the_breaker_names_the_fabric_when_every_node_lost_its_interface():
    bad = {n: _reasons("preflight", f"interfaces: NCCL_SOCKET_IFNAME=ib0: matches no interface "
                                    f"with an address (interfaces here: lo 127.0.0.1, eth0 "
                                    f"10.0.0.{i})") for i, n in enumerate(("gpu1", "gpu2", "gpu3"))}
    tripped = fleet.breaker(bad, 4, 0.5)
    assert tripped["kind"] == "fabric"
    assert "NCCL_SOCKET_IFNAME=ib0: matches no interface with an address" in tripped["common"]


def test_a_cpu_quota_on_every_node_is_their_set_up_and_a_gpu_finding_their_hardware():
    """The health check's CPU quota finding is a limit a setting put on the nodes (one
    configuration pushed to all); its other findings are the hardware's or the driver's."""
    quota = {n: _reasons("health", f"CPU quota: this node's processes were held back in {pc}% "
                                   "of the periods they could run; evidence: cgroup "
                                   f"/sys/fs/cgroup/cpu/slurmd allows 0.25 CPU; {p} of {p} "
                                   "periods throttled")
             for n, pc, p in (("gpu1", 100, 36), ("gpu2", 98, 37))}
    tripped = fleet.breaker(quota, 2, 0.5)
    assert tripped["kind"] == "the nodes' set-up"
    # whole words, "…" where they differ: not the "%" of 100% and 98%, nor the "3" of 36
    # and 37; and the words after a difference are said too
    assert tripped["common"] == ("every one failed health: \"CPU quota: this node's processes "
                                 "were held back in … of the periods they could run; evidence: "
                                 "cgroup /sys/fs/cgroup/cpu/slurmd allows 0.25 CPU; … of … "
                                 "periods throttled\"")
    # CI: "158 of 159" and "157 of 158" were quoted "… 158 … periods": a number one text had
    # elsewhere; a number is matched in its place and said only where the texts agree
    counts = {n: _reasons("health", f"CPU quota: … allows 0.15 CPU; {a} of {b} periods "
                                    f"throttled, {held} s held back during the run")
              for n, a, b, held in (("n1", 158, 159, 22.2), ("n2", 157, 158, 22.0))}
    assert "allows 0.15 CPU; … of … periods throttled, … s held back" in \
        fleet.breaker(counts, 2, 0.5)["common"]
    gpus = {n: _reasons("health", f"GPU 0 (bus 0000:1b:00.0, serial {i}): XID 79: fell off the "
                                  "bus") for i, n in enumerate(("gpu1", "gpu2"))}
    assert fleet.breaker(gpus, 2, 0.5)["kind"] == "hardware or driver"


def test_different_checks_on_each_node_are_said_as_unclear():
    bad = {"a": _reasons("compute", "slow"), "b": _reasons("storage", "corrupt"),
           "c": _reasons("health", "XID 79")}
    tripped = fleet.breaker(bad, 3, 0.5)
    assert tripped["kind"] == "unclear" and "no check failed on all of them" in tripped["common"]


# -- what node-check does to its Slurm node -------------------------------------------------

def _nodes(**given) -> dict:
    """Slurm's view of a 10-node cluster: idle but for the nodes given as (state, reason)."""
    nodes = {f"n{i}": {"state": "IDLE", "reason": ""} for i in range(10)}
    return {**nodes, **{n: {"state": s, "reason": r} for n, (s, r) in given.items()}}


def test_the_kit_reads_back_only_its_own_drain_reasons():
    mine = fleet.drain_reason({"reasons": _reasons("health", "GPU 3: XID 79")}, fleet.NODE_CHECK)
    assert mine == "ddp-smoke node-check: health: GPU 3: XID 79"
    assert fleet.read_reason(mine) == {"by": "node-check", "check": "health",
                                       "reason": "GPU 3: XID 79"}
    assert fleet.read_reason("ddp-smoke local-1: preflight: eth1 down")["by"] == "local-1"
    for theirs in ("", "bad DIMM, ticket 4711", "ddp-smoke said so", "Kill task failed"):
        assert fleet.read_reason(theirs) is None, theirs


@pytest.mark.parametrize("state, reason, failed, action, says", [
    ("IDLE", "", False, None, ""),
    ("IDLE+DRAIN", "ddp-smoke node-check: health: XID 79", False, "resume", "resumed"),
    ("DRAINED", "bad DIMM", False, None, "left drained: drained by someone else"),
    ("IDLE", "", True, "drain", "drained: Reason=ddp-smoke node-check: health: XID 48"),
    ("DRAINING", "ddp-smoke node-check: health: XID 48", True, None, "stays drained"),
    ("IDLE+DRAIN", "ddp-smoke node-check: preflight: eth1 down", True, "drain", "drained"),
    ("IDLE+DRAIN", "bad DIMM", True, None, "left drained as it is"),
    ("IDLE+DRAIN", "ddp-smoke local-7: health: XID 48", True, None, "left drained as it is"),
], ids=["pass", "pass-own-drain", "pass-their-drain", "fail", "fail-same-drain",
        "fail-other-own-drain", "fail-their-drain", "fail-a-jobs-drain"])
def test_node_checks_slurm_decision(state, reason, failed, action, says):
    why = "ddp-smoke node-check: health: XID 48"
    got, line, _ = fleet.slurm_decision("n0", _nodes(n0=(state, reason)), failed, why,
                                        _reasons("health", "XID 48"), 0.2)
    assert got == action and line.startswith(says), line


def test_node_check_holds_when_the_kit_drained_too_many_nodes_already():
    why = "ddp-smoke node-check: health: CPU quota: 97 % of periods throttled"
    kit = ("IDLE+DRAIN", why)
    theirs = ("IDLE+DRAIN", "bad DIMM")  # not the kit's: not counted
    got, line, recorded = fleet.slurm_decision(
        "n0", _nodes(n1=kit, n2=kit, n3=theirs), True, why,
        _reasons("health", "CPU quota: 97 % of periods throttled"), 0.2)
    assert got == "hold" and line == f"not drained: {recorded}" and "3 of 10" in recorded
    assert fleet.slurm_decision("n0", _nodes(n1=kit, n3=theirs), True, why, [], 0.2)[0] == \
        "drain"


# -- lemons ---------------------------------------------------------------------------------

def _runs(statuses: str, boots: str = "") -> list[dict]:
    """'gbbgb' -> runs (g good, b bad); boots: one letter per run (its boot id)."""
    return [{"t": i, "run_id": f"r{i}", "status": "bad" if s == "b" else "good",
             "reason": "preflight: interfaces: eth0 gone" if s == "b" else "",
             "boot_id": boots[i] if boots else None} for i, s in enumerate(statuses)]


def test_a_node_failing_k_of_its_last_n_runs_is_a_lemon_to_reboot_then_to_rma():
    assert fleet.lemons({"n": _runs("gbbgg")}, 3, 5) == []
    (lemon,) = fleet.lemons({"n": _runs("gbgbb", "aaaaa")}, 3, 5)
    assert (lemon["failed"], lemon["of"], lemon["action"]) == (3, 5, fleet.REBOOT)
    assert [r["run_id"] for r in lemon["evidence"]] == ["r1", "r3", "r4"]
    (lemon,) = fleet.lemons({"n": _runs("gbgbbb", "aaaabb")}, 3, 5)  # failed after a reboot
    assert lemon["action"] == fleet.RMA and "after a reboot" in lemon["why"]
    assert fleet.lemons({"n": _runs("bbbggggg", "aaabbbbb")}, 3, 5) == []  # outside the window
    line = fleet.lemon_line(lemon)
    assert line.startswith("lemon n: failed 4 of its last 5 runs -> drain and RMA") and "r5" in line


def _history(root: Path, node: str, plan: str, boots: str, first: int = 0) -> list[str]:
    """A folder per run of ``node``, oldest first: 'g' the recorded pass, 'b' a failure (the
    recorded pass with its host bad: a health finding), 'f' the recorded preflight failure."""
    passed = json.loads((DATA / "node-check-pass.json").read_text())
    failed = json.loads((DATA / "node-check-fail.json").read_text())
    ids = []
    for i, kind in enumerate(plan, start=first):
        report = copy.deepcopy(failed if kind == "f" else passed)
        rid = f"node-check-{node}-20261201-10{i:02d}00-00000{i}"
        report["run_id"], report["started_at"] = rid, f"2026-12-01T10:{i:02d}:00+00:00"
        for h in report["hosts"]:
            h["host"] = node
            if kind == "b":
                h["status"] = "bad"
                h["reasons"] = _reasons("health", "CPU quota: held back in 94% of periods")
        for c in report["checks"]:
            for n in c["figures"].get("nodes", []) if c["name"] == "health" else []:
                n["host"], n["boot_id"] = node, f"boot-{boots[i - first]}"
        (root / rid).mkdir(parents=True)
        (root / rid / "report.json").write_text(json.dumps(report))
        ids.append(rid)
    return ids


def test_history_names_the_lemons_with_their_runs_on_a_recorded_history(tmp_path):
    _history(tmp_path, "gpu07", "gbgbb", "aaaaa")
    _history(tmp_path, "gpu08", "gbggg", "aaaaa")
    index = Index(str(tmp_path), history.defaults())
    index.refresh()
    (lemon,) = fleet.lemons(index.host_runs(), 3, 5)
    assert (lemon["node"], lemon["action"]) == ("gpu07", fleet.REBOOT)
    ids = _history(tmp_path, "gpu07", "b", "b", first=5)  # one more failure, after a reboot
    index.refresh()
    (lemon,) = fleet.lemons(index.host_runs(), 3, 5)
    assert lemon["action"] == fleet.RMA and lemon["evidence"][-1]["run_id"] == ids[0]
    index.close()


def test_preflight_failures_without_a_boot_id_are_a_lemon_to_reboot(tmp_path):
    _history(tmp_path, "gpu09", "fff", "aaa")
    index = Index(str(tmp_path), history.defaults())
    index.refresh()
    (lemon,) = fleet.lemons(index.host_runs(), 3, 5)
    assert lemon["action"] == fleet.REBOOT and "no boot id" in lemon["why"]
    assert lemon["evidence"][0]["reason"].startswith("preflight: interfaces: GLOO_SOCKET_IFNAME")
    index.close()


# -- drain records --------------------------------------------------------------------------

def test_history_lists_the_nodes_the_kit_drained_and_why_from_records_made_later(tmp_path):
    """actions.json is written after report.json: the index sees it on its next refresh even
    though the report did not change."""
    ids = _history(tmp_path, "gpu07", "bg", "aa")
    index = Index(str(tmp_path), history.defaults())
    index.refresh()
    assert index.actions() == []
    why = "ddp-smoke node-check: health: CPU quota: held back in 94% of periods"
    fleet.record(str(tmp_path / ids[0]), ids[0], [fleet.entry("gpu07", fleet.DRAIN, why, True)])
    index.refresh()
    assert [(a["node"], a["action"], a["run_id"]) for a in index.actions()] == \
        [("gpu07", "drain", ids[0])]
    index.close()
    out = subprocess.run([sys.executable, "-m", "ddp_smoke", "history", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"drained by ddp-smoke: gpu07 ({why})" in out.stdout
    assert f"drain  gpu07            run {ids[0]}: {why}" in out.stdout
    fleet.record(str(tmp_path / ids[1]), ids[1], [fleet.entry("gpu07", fleet.RESUME, why, True)])
    out = subprocess.run([sys.executable, "-m", "ddp_smoke", "history", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert "drained by ddp-smoke: none" in out.stdout and "resume gpu07" in out.stdout


def test_records_append_and_refuse_an_unknown_action(tmp_path):
    fleet.record(str(tmp_path), "r1", [fleet.entry("a", fleet.HOLD, "breaker", True)])
    fleet.record(str(tmp_path), "r1", [fleet.entry("b", fleet.HOLD, "breaker", True)])
    body = fleet.read(str(tmp_path / fleet.ACTIONS_FILE))
    assert body["format"] == fleet.FORMAT and [a["node"] for a in body["actions"]] == ["a", "b"]
    assert fleet.record(str(tmp_path), "r1", []) is None
    with pytest.raises(ValueError):
        fleet.entry("a", "reboot", "", True)
    assert fleet.tier({"run_id": "node-check-a-20261201-100000-abcdef"}) == "node"
    assert fleet.tier({"run_id": "4711"}) == "acceptance"
