"""Signed store records (issue 27), on a real TCPStore in this process: what a record written
from outside the run reads as, the run's secret, and what the report and --act make of it.
The runs with a forger beside them are in tests/worker/test_forgery.py."""
from __future__ import annotations

import datetime
import json
import os
import stat

import pytest
import torch.distributed as dist

from ddp_smoke.config.launchenv import LaunchEnv
from ddp_smoke.coordination import signing, store as storekeys
from ddp_smoke.errors import ConfigError
from ddp_smoke.model import PASS, CheckResult, Culprit, Report
from ddp_smoke.outputs import hosts as triage, summary
from ddp_smoke.outputs.report import to_json

SCOPE = "ddp_smoke/0"


@pytest.fixture(autouse=True)
def _fresh():
    signing._reset_for_tests()
    yield
    signing._reset_for_tests()


@pytest.fixture
def server():
    return dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=2),
                         wait_for_workers=False)


def _env(rank=0, world=3, local_world=3, port=29500) -> LaunchEnv:
    return LaunchEnv(rank=rank, world_size=world, local_rank=rank % local_world,
                     local_world_size=local_world, group_rank=0, master_addr="127.0.0.1",
                     master_port=port, agent_store=True, launcher="t", run_id="r")


def _signed(server, secret=b"k" * 32, rank=0):
    return signing.SignedStore(dist.PrefixStore(SCOPE, server), SCOPE, secret, rank)


def _outsider(server):
    """What anyone who reaches the port can do: write any key, unsigned."""
    return dist.PrefixStore(SCOPE, server)


def test_a_record_reads_back_only_when_this_run_signed_it(server):
    run, other = _signed(server), _signed(server, secret=b"o" * 32)
    run.set("rank/0", '{"rank": 0}')
    assert run.get("rank/0") == b'{"rank": 0}'
    raw = server.get(f"{SCOPE}/rank/0")
    assert raw.startswith(b'{"rank": 0}.') and len(raw) == len(b'{"rank": 0}') + 41
    assert run.open("rank/0", raw) == (b'{"rank": 0}', None)
    # the same value under another key, altered, unsigned, or with another secret: refused
    assert run.open("rank/1", raw)[1] == "forged"
    assert run.open("rank/0", raw.replace(b"0}", b"1}", 1))[1] == "forged"
    assert run.open("rank/0", b'{"rank": 0}')[1] == "unsigned"
    assert other.open("rank/0", raw)[1] == "other"
    # an unsigned (multi-node, no secret) rank knows a signed record is not one of its run's
    assert signing.SignedStore(_outsider(server), SCOPE, None, 1).open("rank/0", raw)[1] == \
        "signed"


def test_the_scope_is_signed_too_a_record_of_an_earlier_restart_is_refused(server):
    first = signing.SignedStore(dist.PrefixStore("ddp_smoke/0", server), "ddp_smoke/0",
                                b"k" * 32, 0)
    second = signing.SignedStore(dist.PrefixStore("ddp_smoke/1", server), "ddp_smoke/1",
                                 b"k" * 32, 0)
    first.set("abort/2", '{"rank": 2, "kind": "terminated"}')
    replayed = server.get("ddp_smoke/0/abort/2")
    assert second.open("abort/2", replayed)[1] == "forged"


def test_forged_records_are_no_evidence_and_each_is_a_finding(server):
    run, out = _signed(server), _outsider(server)
    run.set("beat/0", json.dumps({"n": 1}))
    out.set("beat/1", json.dumps({"n": 99, "rank": 1}))
    out.set("abort/2", json.dumps({"rank": 2, "kind": "terminated", "signal": "SIGTERM"}))
    out.append("abort/listed", "2,")
    run.set("obs/compute/0/0", "{}")
    out.set("obs/compute/0/1", "{}")
    assert storekeys.read_beats(run, range(3)) == {0: {"n": 1}}
    assert storekeys.try_get(run, "abort/2") is None
    assert storekeys.posted(run, "abort") == {}
    assert storekeys.ranks_with(run, "obs/compute/0", range(3)) == {0}
    found = {(f["key"], f["rank"]) for f in signing.findings(run)}
    assert found == {("beat/1", 1), ("abort/2", 2), ("abort/listed", 2),
                     ("obs/compute/0/1", 1)}
    # the other ranks' findings reach the writer through the signed list security/listed
    signing._reset_for_tests()
    assert {(f["key"], f["rank"]) for f in signing.findings(run)} == found


def test_a_list_keeps_its_genuine_items_whatever_is_appended_between_them(server):
    run, out = _signed(server), _outsider(server)
    run.append("abort/listed", "0,")
    out.append("abort/listed", "2,")          # unsigned, no line break: runs into the next
    run.append("abort/listed", "1,")
    out.append("abort/listed", "\n3,.00000000" + "0" * 32 + "\n")  # looks signed, is not
    assert storekeys.listed(run, "abort") == [0, 1]


def test_set_when_absent_replaces_a_forged_record_and_keeps_a_genuine_one(server):
    run, out = _signed(server), _outsider(server)
    out.set("abort/2", json.dumps({"rank": 2, "kind": "terminated"}))  # before rank 2 aborts
    text = json.dumps({"rank": 2, "kind": "error"})
    assert run.compare_set("abort/2", "", text) == text.encode()  # rank 2's own reason stands
    assert run.get("abort/2") == text.encode()
    assert run.compare_set("abort/2", "", "later") == text.encode()  # the first reason stands
    run.compare_set("writer", "", "0")
    assert run.compare_set("writer", "", "1") == b"0"


def test_reading_a_forged_record_waits_for_the_genuine_one_and_is_bounded(server):
    run, out = _signed(server), _outsider(server)
    out.set("final", "pass")
    with pytest.raises(dist.DistStoreError, match="written outside the run"):
        run.get("final")  # the store's timeout: 2 s
    run.set("final", "fail")
    assert run.get("final") == b"fail"


def test_peers_of_another_secret_or_build_are_a_config_error_not_a_wait(server):
    me, other = _signed(server), _signed(server, secret=b"o" * 32, rank=1)
    me.set("connect/0", "gloo")
    other.set("connect/1", "gloo")
    with pytest.raises(ConfigError, match="rank 1's records are signed with another secret"):
        signing.peers(me, ["connect/0", "connect/1"])
    _outsider(server).set("connect/1", "gloo")  # a build that does not sign
    with pytest.raises(ConfigError, match="rank 1's records are not signed"):
        signing.peers(me, ["connect/0", "connect/1"])
    unsigned = signing.SignedStore(_outsider(server), SCOPE, None, 1)
    with pytest.raises(ConfigError, match="rank 0's records are signed, and this rank has no "
                                          "secret"):
        signing.peers(unsigned, ["connect/0"])
    other.set("connect/1", "gloo")
    me.set("connect/1", "nccl")
    assert signing.peers(me, ["connect/0", "connect/1"]) == [b"gloo", b"nccl"]


def test_the_secret_comes_from_the_launcher_checked_and_taken_out_of_the_environment():
    secret = "ab" * 32
    environ = {signing.ENV: secret}
    assert signing.run_secret(_env(world=8, local_world=4), environ) == bytes.fromhex(secret)
    assert signing.ENV not in environ  # nothing started later inherits it
    with pytest.raises(ConfigError, match="expected 64 hex digits") as e:
        signing.run_secret(_env(), {signing.ENV: "not-a-secret"})
    assert "not-a-secret" not in str(e.value)
    # several nodes and none from the launcher: unsigned (the report says so)
    assert signing.run_secret(_env(world=8, local_world=4), {}) is None


def test_one_node_makes_its_own_secret_shared_through_a_file_of_the_users_alone(tmp_path,
                                                                                monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)
    environ = {"TORCHELASTIC_RUN_ID": "abc"}
    first = signing.run_secret(_env(rank=0), dict(environ))
    path = signing._local_file
    signing._reset_for_tests()
    assert signing.run_secret(_env(rank=2), dict(environ)) == first  # another local rank
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    signing.forget_local_secret()
    assert not os.path.exists(path)
    # another run (another store port) draws its own
    assert signing.run_secret(_env(port=29501), dict(environ)) != first
    # a file someone else could have planted or read is refused, with its path
    os.chmod(signing._local_file, 0o644)
    signing._reset_for_tests()
    with pytest.raises(ConfigError, match="not this user's alone"):
        signing.run_secret(_env(port=29501), dict(environ))


def test_the_secret_never_reaches_the_report():
    secret = "cd" * 32
    signing.run_secret(_env(), {signing.ENV: secret})
    report = Report(version="t", started_at="now", backend="gloo", world_size=1,
                    ranks=[{"rank": 0, "host": "h", "note": f"x {secret} y"}],
                    checks=[CheckResult("environment", PASS,
                                        figures={"env": {"A": secret.upper()}})],
                    config={"timeout": 1.0}, run_id="r",
                    security={"signed": True, "findings": [{"value": secret}]})
    text = to_json(report)
    assert secret not in text.lower() and "<redacted>" in text


def _failing_report(security: dict) -> Report:
    culprit = Culprit(1, "node-b", "terminated by SIGTERM during compute")
    return Report(version="t", started_at="now", backend="gloo", world_size=2,
                  ranks=[{"rank": 0, "host": "node-a", "slurm_node": "node-a"},
                         {"rank": 1, "host": "node-b", "slurm_node": "node-b"}],
                  checks=[CheckResult("compute", "fail", culprits=[culprit])],
                  config={"timeout": 1.0, "checks": ["compute"], "act": "slurm-drain"},
                  run_id="r", security=security, written_by="rank 0")


@pytest.mark.parametrize("security, said", [
    ({"signed": True, "findings": [{"key": "abort/1", "rank": 1, "why": "x", "seen_by": 0}]},
     "nothing drained: the store held 1 record(s) not written by this run"),
    ({"signed": False, "findings": []}, "nothing drained: this run's records were not signed"),
])
def test_act_drains_nothing_in_a_run_that_saw_a_forgery_or_was_not_signed(
        security, said, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setattr(triage, "drain", lambda *a, **k: pytest.fail("drain was called"))
    report = _failing_report(security)
    triage.finish(report, str(tmp_path), "r")
    out = capsys.readouterr().out
    assert said in out
    assert "SECURITY" in summary.render(report, "report.json")
    assert (tmp_path / "bad_hosts.txt").read_text() == "node-b\n"  # the lists still say it
