"""The pure rules of issue 23: who kept the others waiting (coordination/stragglers.py) and
which node or link cannot be crossed (coordination/reach.py), on hand-made evidence; and the
probe's connects on loopback."""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from ddp_smoke import config
from ddp_smoke.coordination import blame
from ddp_smoke.coordination import reach, retransmits, stragglers
from ddp_smoke.errors import ConfigError
from ddp_smoke.model import CheckResult, Culprit

HOSTS = [f"n{i}" for i in range(6)]


def _spent(n: int, k: int, late: int | None, seed: int = 0, late_share: float = 1.0):
    """k collectives on n ranks: each rank inside 1-3 ms at random; with ``late``, that rank
    arrives 20 ms after the others in ``late_share`` of them (so it spends the least inside)."""
    rng = random.Random(seed)
    rows = [[] for _ in range(n)]
    for _ in range(k):
        base = [rng.uniform(0.001, 0.003) for _ in range(n)]
        if late is not None and rng.random() < late_share:
            base = [b + (0.02 if r != late else 0.0) for r, b in enumerate(base)]
        for r in range(n):
            rows[r].append(base[r])
    return rows


def test_a_rank_the_others_wait_for_is_named_with_the_share_and_the_time():
    figure, slow = stragglers.waits_and_stragglers(_spent(4, 340, late=2, late_share=0.92))
    assert [r for r, _ in slow] == [2]
    assert slow[0][1].startswith("ranks 0, 1, 3 waited for rank 2 ")
    assert " s in all, 100 % of the waits of 3" in slow[0][1] and "arrived last in 3" in slow[0][1]
    assert figure["most_last"][0]["rank"] == 2 and figure["collectives"] == 340


def test_healthy_runs_name_nobody_at_any_size():
    for n in (2, 3, 4, 16):
        for seed in range(20):
            found = stragglers.waits_and_stragglers(_spent(n, 300, late=None, seed=seed))
            assert found[1] == [], (n, seed)


RECORDED = json.loads((Path(__file__).resolve().parent.parent / "data" / "waits" /
                       "recorded.json").read_text())


def _old_rule(spent: list) -> list[int]:
    """The rule before: last in half of >= 10 counted collectives, its waits >= 0.25 s, a
    tenth of the others' time inside and half of all waits (kept here to show the change)."""
    figure, _ = stragglers.waits_and_stragglers(spent)
    inside = sum(statistics.median(t[q] for q in range(len(t)) if q != min(
        range(len(t)), key=t.__getitem__)) for t in zip(*spent) if None not in t)
    return [m["rank"] for m in figure["most_last"]
            if figure["counted"] >= 10 and m["last"] >= 0.5 * figure["counted"]
            and m["wait_s"] >= max(0.25, 0.1 * inside, figure["wait_s"] / 2)]


def test_recorded_runs_the_quota_named_by_time_healthy_ranks_never():
    """Real durations (tests/data/waits/PROVENANCE.md): the collectives check of 4 torchrun
    ranks on a 2-core machine with one or two busy processes beside them."""
    named = {k: [r for r, _ in stragglers.waits_and_stragglers(v["spent"])[1]]
             for k, v in RECORDED.items()}
    assert named == {"quota_a": [2], "quota_b": [2], "quota_c": [2], "quota_barely_bit": [],
                     "quota_two_thirds": [2], "quota_alone": [2],
                     "healthy_crowded_core": [], "healthy_crowded_core_2": [],
                     "healthy_rank0_last_half": [], "healthy_two_thirds": [],
                     "healthy_bandwidth": []}
    # in every quota run the rank the others waited for longest is the throttled one
    assert all(stragglers.waits_and_stragglers(v["spent"])[0]["most_last"][0]["rank"] == 2
               for k, v in RECORDED.items() if k.startswith("quota"))
    figure, [(rank, reason)] = stragglers.waits_and_stragglers(RECORDED["quota_b"]["spent"])
    assert reason.startswith("ranks 0, 1, 3 waited for rank 2 1.3 s in all, 97 % of the waits "
                             "of 17 collectives (it arrived last in 10;")
    assert figure["most_last"][0] == {"rank": 2, "last": 10, "wait_s": 1.3005,
                                     "share": 0.966, "longest_s": 0.3885}
    # a healthy rank the scheduler starved on a crowded core: 82 % of the waits, last in 8 of
    # 14, 0.25 s: the old rule (last in half) named it; its waits are not half a second
    crowded = stragglers.waits_and_stragglers(
        RECORDED["healthy_crowded_core"]["spent"])[0]["most_last"][0]
    assert (crowded["rank"], crowded["last"], crowded["share"]) == (3, 8, 0.823)
    assert _old_rule(RECORDED["healthy_crowded_core"]["spent"]) == [3]
    # the quota rank whose quota barely bit: 65 % of the waits, 0.34 s; left to compute
    barely = stragglers.waits_and_stragglers(
        RECORDED["quota_barely_bit"]["spent"])[0]["most_last"][0]
    assert (barely["rank"], barely["share"]) == (2, 0.646)


def test_a_burst_straggler_is_named_by_the_time_it_cost_not_how_often_it_was_last():
    """A throttle in bursts: rank 1 arrives 85 ms late in 12 of 60 collectives (a quota's
    throttled stretch), otherwise on time; the last arriver of the others is chance."""
    rng, spent = random.Random(3), [[] for _ in range(4)]
    for k in range(60):
        base = [rng.uniform(0.002, 0.008) for _ in range(4)]  # each rank's few ms of chance
        throttled = k % 20 < 4  # three throttled stretches of 4 collectives
        for r in range(4):
            spent[r].append(base[r] + (0.085 if throttled and r != 1 else 0.0))
    figure, slow = stragglers.waits_and_stragglers(spent)
    top = figure["most_last"][0]
    assert top["rank"] == 1 and top["last"] < 0.5 * figure["counted"] and top["share"] > 0.5
    assert [r for r, _ in slow] == [1] and _old_rule(spent) == []


def test_one_long_hiccup_is_not_a_straggler():
    """Rank 0 stopped for 3 s inside one collective of 30 (a GC pause, SIGSTOP), last in its
    fair share of the others by chance: all the waiting is its, but without its longest wait
    it kept nobody waiting."""
    rng, spent = random.Random(5), [[] for _ in range(4)]
    for k in range(30):
        base = [rng.uniform(0.002, 0.008) for _ in range(4)]
        if k == 12:
            base = [b + (3.0 if r else 0.0) for r, b in enumerate(base)]
        for r in range(4):
            spent[r].append(base[r])
    figure, slow = stragglers.waits_and_stragglers(spent)
    top = figure["most_last"][0]
    assert top["rank"] == 0 and top["share"] > 0.9 and top["last"] * 4 >= figure["counted"]
    assert slow == [] and _old_rule(spent) == []


def test_few_collectives_or_small_waits_name_nobody():
    assert stragglers.waits_and_stragglers(_spent(4, 9, late=1))[1] == []  # under waits_min_counted
    tiny = [[0.0101 if r == 1 else 0.0102] * 100 for r in range(4)]  # 0.1 ms waits
    assert stragglers.waits_and_stragglers(tiny)[1] == []


def test_broadcasts_and_missing_ranks_are_left_out():
    rows = _spent(4, 60, late=3)
    for r in range(4):
        rows[r][5] = None  # a broadcast: its root leaves early
    figure, slow = stragglers.waits_and_stragglers(rows)
    assert [r for r, _ in slow] == [3] and figure["collectives"] == 60
    assert stragglers.waits_and_stragglers([None, None])[0]["collectives"] == 0


def test_the_runs_own_diagnosis_settings_apply_to_its_waits(tmp_path):
    """The rule's thresholds are the run's config (``diagnosis``): on each check (attach, with
    the run) and on an abort (blame, with the settings the run posted), validated like any."""
    spent = _spent(4, 100, late=2)
    path = tmp_path / "c.yaml"
    path.write_text("diagnosis:\n  waits_min_total_s: 600\n")
    lenient = config.resolve(config.load_file(str(path)), {})["diagnosis"]
    assert [r for r, _ in stragglers.waits_and_stragglers(spent)[1]] == [2]
    assert stragglers.waits_and_stragglers(spent, lenient)[1] == []
    run = types.SimpleNamespace(env=types.SimpleNamespace(run_id="7"), ranks=[{}] * 4,
                                cfg={"diagnosis": lenient})
    result = CheckResult("collectives", "pass", summary="28/28 cases exact")
    stragglers.attach(result, spent, lambda r, why: Culprit(r, f"h{r}", why), run)
    assert result.status == "pass" and result.figures["waits"]["most_last"][0]["rank"] == 2
    snap = dict(stage="collectives", world_size=4, timeout_s=1.0, hosts=["h"] * 4,
                connected=set(range(4)), arrived=set(range(4)), dead=set(),
                aborts={0: {"kind": "timeout"}}, waits=dict(enumerate(spent)))
    assert list(blame._waited_for(blame.Snapshot(**snap))) == [2]
    assert blame._waited_for(blame.Snapshot(**snap, rules=lenient)) == {}
    path.write_text("diagnosis:\n  waits_share: 0\n")
    with pytest.raises(ConfigError, match="key 'diagnosis.waits_share' = 0"):
        config.resolve(config.load_file(str(path)), {})


def test_docs_quote_every_diagnosis_threshold_as_the_defaults_set_it():
    text = " ".join((Path(__file__).resolve().parents[2] / "docs" / "diagnosis.md")
                    .read_text().split())
    for key, value in config.defaults()["diagnosis"].items():
        assert f"`{key}` {value:g}" in text, key


def test_attach_fails_a_passing_check_and_leaves_a_skip_alone():
    result = CheckResult("collectives", "pass", summary="28/28 cases exact")
    stragglers.attach(result, _spent(4, 100, late=0), lambda r, why: Culprit(r, f"h{r}", why))
    assert result.status == "fail" and [c.rank for c in result.culprits] == [0]
    assert result.summary.startswith("straggler: ranks 1, 2, 3 waited for rank 0 ")
    assert "waits" in result.figures and stragglers.line(result.figures["waits"])
    skipped = CheckResult("transport", "skip", summary="gloo")
    stragglers.attach(skipped, _spent(4, 100, late=0), lambda r, why: None)
    assert skipped.status == "skip" and not skipped.culprits


def test_attach_leaves_out_a_rank_the_check_already_names():
    """A slow link's ends arrive last in the sweep: the link explains it, no straggler too."""
    link = Culprit(None, None, "link 0-1 slow", ranks=[0, 1], hosts=["a", "b"])
    result = CheckResult("bandwidth", "fail", summary="slow link", culprits=[link])
    stragglers.attach(result, _spent(4, 100, late=0), lambda r, why: Culprit(r, f"h{r}", why))
    assert result.culprits == [link] and result.summary == "slow link"
    assert result.figures["waits"]["most_last"][0]["rank"] == 0  # the figure stays
    slow = Culprit(2, "h2", "slow with every partner")
    result = CheckResult("bandwidth", "fail", summary="slow node", culprits=[slow])
    stragglers.attach(result, _spent(4, 100, late=2), lambda r, why: Culprit(r, f"h{r}", why))
    assert result.culprits == [slow]
    # a rank after the link in the ring, not one of its ends: the link's delay, not the rank's
    result = CheckResult("collectives", "fail", summary="lossy link", culprits=[link])
    stragglers.attach(result, _spent(4, 100, late=2), lambda r, why: Culprit(r, f"h{r}", why))
    assert result.culprits == [link] and result.figures["waits"]["link_named"] == [2]
    # a rank named alone (not a link) spares no other rank
    result = CheckResult("compute", "fail", summary="slow", culprits=[slow])
    stragglers.attach(result, _spent(4, 100, late=0), lambda r, why: Culprit(r, f"h{r}", why))
    assert [k.rank for k in result.culprits] == [2, 0]


def test_a_node_check_on_cpu_ranks_keeps_the_waits_as_a_figure_only():
    """The node tier: CPU ranks share the node's cores (the scheduler picks who is last); GPU
    ranks are the node's GPUs, and an acceptance run on CPU names its straggler as before."""
    def run(run_id: str, device: str):
        env = types.SimpleNamespace(run_id=run_id)
        return types.SimpleNamespace(env=env, ranks=[{"device": device}] * 4, cfg={})

    node = "node-check-n1-20261201-100000-abcdef"
    for got, expected in [(run(node, "cpu"), []), (run(node, "cuda:0"), [0]),
                          (run("4711", "cpu"), [0])]:
        result = CheckResult("collectives", "pass", summary="28/28 cases exact")
        stragglers.attach(result, _spent(4, 100, late=0),
                          lambda r, why: Culprit(r, f"h{r}", why), got)
        assert [c.rank for c in result.culprits] == expected, got
        assert result.status == ("fail" if expected else "pass"), got
        assert result.figures["waits"]["most_last"][0]["rank"] == 0  # the figure stays


def test_a_cpu_rank_sharing_cores_is_named_only_when_a_cpu_quota_held_it():
    """CPU ranks that share their node's cores: the scheduler picks who arrives last, unless a
    CPU quota held the rank back (then named, with the seconds held); a rank on cores of its
    own, or one that said nothing of its CPU (a GPU rank), is named by its waits alone."""
    held = {"shared": True, "held_s": 2.1}
    for pace, expected in [({"shared": True, "held_s": 0.0}, []), (held, [0]),
                           ({"shared": True, "held_s": None}, []),
                           ({"shared": True,
                             "held_s": stragglers.RULES["waits_min_total_s"] - 0.01}, []),
                           ({"shared": False, "held_s": 0.0}, [0]), (None, [0])]:
        result = CheckResult("collectives", "pass", summary="28/28 cases exact")
        stragglers.attach(result, _spent(4, 100, late=0),
                          lambda r, why: Culprit(r, f"h{r}", why), None, [pace, None, None, None])
        assert [c.rank for c in result.culprits] == expected, pace
        assert result.figures["waits"]["most_last"][0]["rank"] == 0  # the figure stays
        spared = result.figures["waits"].get("scheduler_chose")
        assert spared == (None if expected or pace is None or not pace["shared"] else [0])
        if spared:
            assert stragglers.line(result.figures["waits"]).endswith(
                "(not named: CPU ranks that share their node's cores, no CPU quota held "
                "rank 0)")
        if pace is held:
            assert result.culprits[0].reason.endswith("; a CPU quota held it back 2.1 s in "
                                                      "the check"), result.culprits[0].reason


def test_keep_per_rank_is_bounded_at_any_world_size():
    assert stragglers.keep_per_rank(4) == 2048
    assert stragglers.keep_per_rank(4096) * 4096 <= stragglers.BUDGET
    assert stragglers.keep_per_rank(1 << 20) == 64


def _probes(n: int, bad: set) -> dict:
    """Every leader tried every other; ``bad`` holds the (a, b) pairs a could not reach."""
    return {a: {"tried": [b for b in range(n) if b != a],
                "failed": sorted(b for b in range(n) if (a, b) in bad)} for a in range(n)}


def test_a_link_is_named_with_both_ends_and_nothing_else():
    got = reach.culprits(_probes(4, {(1, 2), (2, 1)}), HOSTS)
    assert [(c.rank, c.ranks, c.hosts) for c in got] == [(None, [1, 2], ["n1", "n2"])]
    assert "neither could connect to the other" in got[0].reason
    assert "each reaches other nodes" in got[0].reason
    one_way = reach.culprits(_probes(4, {(3, 0)}), HOSTS)
    assert [c.ranks for c in one_way] == [[0, 3]]
    assert "rank 3 could not connect to rank 0" in one_way[0].reason


def test_a_node_nobody_reaches_is_named_not_its_peers():
    cut = {(a, 3) for a in range(3)} | {(3, b) for b in range(3)}
    got = reach.culprits(_probes(4, cut), HOSTS)
    assert [(c.rank, c.host) for c in got] == [(3, "n3")] and "is cut off" in got[0].reason
    # two nodes cut: both named, the healthy ones (each failing two of its three) are not
    two = {(a, b) for a in range(5) for b in range(5) if a != b and {a, b} & {3, 4}}
    assert [c.rank for c in reach.culprits(_probes(5, two), HOSTS)] == [3, 4]
    # nobody answered one node's probes, and it said nothing itself (its leader is stuck)
    silent = {a: p for a, p in _probes(4, {(a, 2) for a in range(4)}).items() if a != 2}
    assert [c.rank for c in reach.culprits(silent, HOSTS)] == [2]


def test_healthy_probes_name_nobody_and_blame_falls_through():
    assert reach.culprits(_probes(6, set()), HOSTS) == []
    s = blame.Snapshot(stage="collectives", world_size=4, timeout_s=10.0, hosts=HOSTS[:4],
                       connected={0, 1, 2, 3}, arrived={0, 1, 2, 3},
                       aborts={0: {"kind": "timeout", "at": 1.0}},
                       progress={r: {"seq": 5, "inside": True, "op": "all_reduce"}
                                 for r in range(4)},
                       reach=_probes(4, {(1, 2), (2, 1)}))
    blamed = blame.assign(s)
    assert [c.ranks for c in blamed.culprits] == [[1, 2]]
    assert sorted(v["rank"] for v in blamed.victims) == [0, 3]


def test_targets_are_all_nodes_when_few_and_bounded_when_many():
    assert reach.targets(2, [0, 1, 2, 3]) == [0, 1, 3]
    many = list(range(0, 8 * 4096, 8))
    got = reach.targets(80, many)
    assert 80 not in got and len(got) <= 2 * reach.RING + reach.SAMPLE
    assert {72, 64, 88, 96} <= set(got)  # ring neighbours
    tried_by = sum(1 for me in many[:400] if 0 in reach.targets(me, many))
    assert tried_by >= reach.RING  # node 0 is still tried by several


def test_connect_all_on_loopback_reached_refused_and_listening():
    probe = reach.Probe("127.0.0.1")
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, not listening: refused, which counts as reached
        port = closed.getsockname()[1]
        assert reach.connect_all({1: ("127.0.0.1", probe.port), 2: ("127.0.0.1", port)},
                                 1.0) == set()


def test_a_link_that_connects_and_drops_large_payloads_is_named_with_the_mtu_hint():
    probes = _probes(4, set())
    probes[1]["large"], probes[2]["large"] = [2], [1]
    got = reach.culprits(probes, HOSTS)
    assert [(c.rank, c.ranks, c.hosts) for c in got] == [(None, [1, 2], ["n1", "n2"])]
    assert "passes small packets and drops large ones" in got[0].reason
    assert "MTU" in got[0].reason and "each reaches other nodes" in got[0].reason
    # a node whose every link drops large payloads is the node, not its links
    probes = _probes(4, set())
    for a in range(4):
        probes[a]["large"] = [3] if a != 3 else [0, 1, 2]
    got = reach.culprits(probes, HOSTS)
    assert [(c.rank, c.ranks) for c in got] == [(3, None)] and "drops large" in got[0].reason


def test_carry_all_leaves_out_a_probe_that_counts_nothing_a_stopped_one_included():
    """A probe that does not count even one byte is no link dropping large packets: a listener
    that never reads, a real probe whose process is stopped (SIGSTOP: the campaign's
    sigstop.rank0.collectives.torchrun.4x1 named the stopped rank's node as dropping large
    packets, its kernel having accepted the connection), one that refuses."""
    probe = reach.Probe("127.0.0.1")
    stopped = subprocess.Popen(
        [sys.executable, "-c", "import time; from ddp_smoke.coordination import reach; "
         "print(reach.Probe('127.0.0.1').port, flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        port = int(stopped.stdout.readline())
        os.kill(stopped.pid, signal.SIGSTOP)
        with socket.socket() as deaf, socket.socket() as closed:
            deaf.bind(("127.0.0.1", 0))
            deaf.listen(8)  # accepts into its backlog, never reads nor answers
            closed.bind(("127.0.0.1", 0))  # refused: nothing listens
            got = reach.carry_all({1: ("127.0.0.1", probe.port),
                                   2: ("127.0.0.1", deaf.getsockname()[1]),
                                   3: ("127.0.0.1", closed.getsockname()[1]),
                                   4: ("127.0.0.1", port)}, 1.0)
    finally:
        stopped.kill()  # this test's own child, by handle
        stopped.wait(10)
    assert got == set()


def test_carry_all_names_a_probe_that_counts_a_byte_and_not_the_payload():
    """What a link dropping large frames looks like from the prober (the real one, jumbo
    frames behind a port without them: tests/campaign/test_four_faults.py): the byte is
    counted, the payload never is."""
    with socket.socket() as small_only:
        small_only.bind(("127.0.0.1", 0))
        small_only.listen(8)

        def serve():
            for _ in range(2):
                conn, _ = small_only.accept()
                with conn:
                    got = len(conn.recv(1 << 17))
                    if got < 1024:  # as if frames past a small MTU never arrived
                        conn.recv(1)  # the end of what is sent
                        conn.sendall(got.to_bytes(8, "big"))
                    else:
                        time.sleep(2)
        threading.Thread(target=serve, daemon=True).start()
        assert reach.carry_all({5: small_only.getsockname()}, 1.0) == {5}


def test_silent_ranks_on_a_node_the_probes_name_are_the_network_not_deaths():
    # node 3 (rank 3) cut off: its heartbeat stopped too, and every other node's probe failed
    cut = {(a, 3) for a in range(3)}
    probes = {a: p for a, p in _probes(4, cut).items() if a != 3}
    s = blame.Snapshot(stage="compute", world_size=4, timeout_s=10.0, hosts=HOSTS[:4],
                       connected={0, 1, 2, 3}, arrived={0, 1, 2, 3}, dead={3},
                       aborts={0: {"kind": "lost", "at": 1.0, "silent": [3]}}, reach=probes)
    got = blame.assign(s).culprits
    assert [(c.rank, c.host) for c in got] == [(3, "n3")] and "cut off" in got[0].reason
    # the probes reached it (refused: the host answers): the rank died
    s.reach = _probes(4, set())
    assert [c.rank for c in blame.assign(s).culprits] == [3]
    assert "no heartbeat" in blame.assign(s).culprits[0].reason


def test_the_runs_probe_settings_are_quoted_waited_for_and_validated(tmp_path):
    """A run that set its probes (``diagnosis.probe_s``, ``probe_rounds``): the reasons quote
    them, the writer waits (rounds + 2) x probe_s + 1.5 s; a value outside its range is
    refused in one line."""
    rules = config.resolve({"diagnosis": {"probe_s": 0.5, "probe_rounds": 3}}, {})["diagnosis"]
    s = blame.Snapshot(stage="health", world_size=4, timeout_s=10.0, hosts=HOSTS[:4],
                       connected={0, 1, 2, 3}, arrived={0, 1, 2, 3}, dead={1, 2, 3},
                       aborts={0: {"kind": "lost", "at": 1.0, "silent": [1, 2, 3]}},
                       reach={0: {"tried": [1, 2, 3], "failed": [1, 2, 3]}}, rules=rules)
    assert "(probe port, 3 tries of 0.5 s each)" in blame.assign(s).culprits[0].reason
    assert reach.wait_s(rules) == 4.0 and reach.wait_s() == 7.5
    path = tmp_path / "probe.yaml"
    path.write_text("diagnosis:\n  probe_rounds: 0\n")
    with pytest.raises(ConfigError, match="key 'diagnosis.probe_rounds' = 0"):
        config.resolve(config.load_file(str(path)), {})


def test_the_store_s_own_node_cut_off_explains_every_other_rank_s_silence():
    # rank 0's node (where the store is) cut off: from there every other rank is silent, and
    # only its own probes are posted, each failing: that node is named, not the silent ranks
    probes = {0: {"tried": [1, 2, 3], "failed": [1, 2, 3]}}
    s = blame.Snapshot(stage="health", world_size=4, timeout_s=10.0, hosts=HOSTS[:4],
                       connected={0, 1, 2, 3}, arrived={0, 1, 2, 3}, dead={1, 2, 3},
                       aborts={0: {"kind": "lost", "at": 1.0, "silent": [1, 2, 3]}},
                       reach=probes)
    got = blame.assign(s).culprits
    assert [(c.rank, c.host) for c in got] == [(0, "n0")] and "cut off" in got[0].reason


def test_the_probe_reads_a_beacon_for_as_long_as_it_sends():
    """A beacon's byte every 0.3 s, the probe's read timeout 0.2 s: the probe keeps reading
    (a beacon is silent for as long as an outage lasts), answers nothing, and every byte is a
    data segment of a connection :mod:`retransmits` counts; a refused address is let go."""
    probe, stop = reach.Probe("127.0.0.1", probe_s=0.1), threading.Event()
    with socket.create_server(("127.0.0.1", 0)) as closed:
        refused = closed.getsockname()
    beat = threading.Thread(target=reach._beat, args=([(probe.addr, probe.port), refused], 0.3,
                                                       stop), daemon=True)
    beat.start()
    try:
        time.sleep(1.45)
        mine = {c: v for c, v in retransmits.snapshot().items() if c[1][1] == probe.port}
        assert len(mine) == 1 and list(mine.values())[0][2] >= 4, mine
        assert beat.is_alive()
    finally:
        stop.set()
        beat.join(2)
        probe.sock.close()
    assert not beat.is_alive()


def test_nodes_of_one_kernel_share_its_cores_nodes_of_their_own_do_not():
    """Four launcher nodes of one rank each (namespaces as hosts) on one 2-core kernel: each
    says its node's cores are its own, but the kernel's threads outnumber its cores, so the
    rank the others waited for is the scheduler's choice; on four kernels it is named."""
    def pace(kernel: str) -> dict:
        return {"shared": False, "held_s": 0.0, "kernel": kernel, "threads": 1, "cores": 2}

    for kernels, expected in [(["k"] * 4, []), (["k0", "k1", "k2", "k3"], [0]),
                              (["k0", "k1", "k1", "k2"], [0]), ([None] * 4, [0])]:
        got = [pace(k) for k in kernels]
        assert [p["shared"] for p in stragglers.shared_kernels(got)] == \
            [kernels.count(k) >= 2 and k is not None for k in kernels]
        result = CheckResult("collectives", "pass", summary="28/28 cases exact")
        stragglers.attach(result, _spent(4, 100, late=0),
                          lambda r, why: Culprit(r, f"h{r}", why), None, got)
        assert [c.rank for c in result.culprits] == expected, kernels
