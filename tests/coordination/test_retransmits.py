"""Links bad only some of the time (issue 45), the pure parts on hand-made evidence, and the
tcp_info reader on a real connection: coordination/retransmits.py, checks/_pairs.unstable,
checks/bandwidth's collapse, model.nodes_or_links. The real faults (random loss, a flapping
port, loss one way) in namespace nodes: tests/worker/test_diagnosis_network.py."""
from __future__ import annotations

import os
import socket
import threading

from ddp_smoke import config
from ddp_smoke.checks import _pairs
from ddp_smoke.coordination import blame, retransmits
from ddp_smoke.model import CheckResult, Culprit, nodes_or_links

RULES = config.defaults()["links"]
HOSTS = ["n0", "n1", "n2", "n3"]
RANKS = [{"rank": r, "host": h, "local_rank": 0,
          "addresses": {"lo": "127.0.0.1", "eth0": f"10.0.0.{r + 1}"}} for r, h in enumerate(HOSTS)]


def _posted(counts: dict[tuple[int, int], tuple[int, int, int]]) -> list[dict]:
    """Each rank's :func:`retransmits.since` rows: ``counts[(r, peer)] = (retrans, rto,
    segs)`` as rank r's sockets to peer's address saw them."""
    out: list[dict] = [{} for _ in RANKS]
    for (r, peer), row in counts.items():
        out[r][f"10.0.0.{peer + 1}"] = list(row)
    return out


def _healthy(extra: dict | None = None) -> list[dict]:
    """Every pair of the four nodes sent 40,000 segments each way, a few sent again (what a
    healthy loaded run shows: a few dozen, no timeout); ``extra`` replaces some."""
    counts = {(r, p): (3, 0, 40000) for r in range(4) for p in range(4) if r != p}
    counts.update(extra or {})
    return _posted(counts)


def test_healthy_links_name_nothing_and_loopback_and_own_addresses_are_not_links():
    posted = _healthy()
    posted[0]["127.0.0.1"] = [500, 9, 1000]  # the store on this node, over loopback
    posted[1]["10.0.0.2"] = [500, 9, 1000]   # a rank of its own node by its address
    found = retransmits.links(posted, RANKS)
    assert sorted(found) == [(a, b, "eth0") for i, a in enumerate(HOSTS) for b in HOSTS[i + 1:]]
    assert retransmits.culprits(found, RULES, RANKS) == []


def test_a_link_that_times_out_is_named_with_both_ends_and_who_sent_again():
    found = retransmits.links(_healthy({(1, 2): (14, 13, 40000)}), RANKS)
    [c] = retransmits.culprits(found, RULES, RANKS)
    assert (c.rank, c.ranks, c.hosts) == (None, [1, 2], ["n1", "n2"])
    assert "loses packets" in c.reason and "13 retransmission timeout(s)" in c.reason
    assert "n1 14 of 40000 (0.04 %), n2 3 of 40000 (0.01 %)" in c.reason


def test_a_link_losing_a_share_of_its_segments_in_one_direction_is_named():
    # 3 % random loss one way measured 114 of 8,571 segments (1.3 %) on that direction, none
    # the other way: half the link's share, undiluted per direction
    found = retransmits.links(_healthy({(3, 0): (114, 0, 8571), (0, 3): (0, 0, 8571)}), RANKS)
    assert [(c.ranks, c.hosts) for c in retransmits.culprits(found, RULES, RANKS)] == \
        [([0, 3], ["n0", "n3"])]


def test_a_node_losing_on_every_link_is_the_node():
    bad = {(2, p): (30, 4, 40000) for p in (0, 1, 3)}
    found = retransmits.links(_healthy(bad), RANKS)
    assert [(c.rank, c.host, c.ranks) for c in retransmits.culprits(found, RULES, RANKS)] == \
        [(2, "n2", None)]


def test_a_fabric_that_retransmits_everywhere_names_no_single_link():
    counts = {(r, p): (40, 3, 40000) for r in range(4) for p in range(4) if r != p}
    found = retransmits.links(_posted(counts), RANKS)
    assert retransmits.culprits(found, RULES, RANKS) == []


def test_below_every_threshold_nothing_is_named():
    # a healthy busy run's worst seen: 67 of 7,741 segments sent again (0.87 %), one timeout
    found = retransmits.links(_healthy({(1, 2): (67, 1, 7741)}), RANKS)
    assert retransmits.culprits(found, RULES, RANKS) == []


def test_on_a_rail_run_the_link_is_named_on_its_rail():
    ranks = [{"rank": r, "host": f"n{r // 2}", "local_rank": r % 2,
              "addresses": {"eth0": f"10.0.0.{r // 2 + 1}", "eth1": f"10.0.1.{r // 2 + 1}"}}
             for r in range(6)]
    posted: list[dict] = [{} for _ in ranks]
    for r in range(6):
        for node in range(3):
            if node != r // 2:
                posted[r][f"10.0.{r % 2}.{node + 1}"] = [1, 0, 20000]
    posted[3]["10.0.1.3"] = [20, 6, 20000]  # n1 -> n2 on rail 1 (eth1) only
    found = retransmits.links(posted, ranks)
    [c] = retransmits.culprits(found, RULES, ranks, rails=["eth0", "eth1"])
    assert (c.ranks, c.hosts, c.rail) == ([3, 5], ["n1", "n2"],
                                          {"index": 1, "device": "eth1", "port": None})
    assert "on rail 1 (eth1)" in c.reason


def test_attach_names_the_link_and_the_stragglers_rule_spares_its_ends():
    result = CheckResult("collectives", "pass", summary="28/28 cases exact")
    retransmits.attach(result, _healthy({(0, 1): (20, 5, 40000)}), RANKS,
                       {"links": RULES, "rails": None})
    assert result.status == "fail" and result.summary.startswith("lossy: link n0 (rank 0)")
    assert [h["hosts"] for h in result.figures["links"]][0] == ["n0", "n1"]


def test_an_aborted_run_stuck_in_a_collective_is_blamed_on_the_link_that_timed_out():
    lossy = retransmits.culprits(retransmits.links(_healthy({(1, 2): (14, 13, 40000)}), RANKS),
                                 RULES, RANKS)
    stuck = {r: {"seq": 722, "op": "all_gather", "inside": True, "for_s": 2.4, "stage":
                 "bandwidth"} for r in (1, 2)}
    stuck[0] = {**stuck[1], "seq": 723, "op": "barrier"}
    s = blame.Snapshot(stage="bandwidth", world_size=4, timeout_s=60, hosts=HOSTS,
                       connected={0, 1, 2, 3}, arrived={0, 1, 2, 3}, progress=stuck,
                       aborts={0: {"kind": "timeout", "at": 1.0}}, lossy=lossy)
    got = blame.assign(s)
    assert [(c.ranks, c.hosts) for c in got.culprits] == [([1, 2], ["n1", "n2"])]
    assert {v["rank"] for v in got.victims} == {0, 3}


def test_nodes_or_links():
    pairs = [(0, 1), (0, 2), (1, 2), (2, 3), (0, 3)]
    assert nodes_or_links([(0, 2), (1, 2), (2, 3)], pairs) == ([2], [])
    assert nodes_or_links([(1, 2)], pairs) == ([], [(1, 2)])
    # one pair alone says nothing of which end: the link
    assert nodes_or_links([(0, 1)], [(0, 1)]) == ([], [(0, 1)])


# -- the pairs' round trips and exchanges (checks/_pairs.py) --------------------------------

def _record(rtt_p99_us: float, fastest_us: float = 5000, slowest_us: float = 9000,
            rtt_max_us: float | None = None) -> dict:
    return {"time_us": fastest_us, "time_us_max": slowest_us,
            "rtt_us": [100, rtt_p99_us, rtt_max_us or rtt_p99_us * 1.1]}


def test_one_round_trip_that_waited_for_a_lost_message_names_the_pair():
    # 3 % loss one way: often a single trip of 100 is lost, the p99 stays with the healthy
    records = {(0, 1): _record(2100, rtt_max_us=9600), (0, 2): _record(4000),
               (1, 2): _record(3500, rtt_max_us=208000)}
    found = _pairs.unstable(records, RULES, "cpu")
    assert (found["links"], found["waited"], found["tail"]) == ([(1, 2)], [(1, 2)], [])
    records[(1, 2)] = _record(3500, rtt_max_us=11000)  # a busy healthy pair's worst seen
    assert _pairs.unstable(records, RULES, "cpu")["links"] == []


def test_a_pair_whose_round_trip_tail_stands_out_is_unstable_and_a_loaded_one_is_not():
    # p99s seen here: healthy pairs under two busy loops 0.14-10.5 ms; 3 % loss 207-209 ms
    records = {(0, 1): _record(10500), (0, 2): _record(4000), (1, 2): _record(208000),
               (0, 3): _record(300), (1, 3): _record(2600), (2, 3): _record(7900)}
    got = _pairs.unstable(records, RULES, "cpu")
    assert (got["tail"], got["links"], got["nodes"]) == ([(1, 2)], [(1, 2)], [])
    healthy = {p: r for p, r in records.items() if p != (1, 2)}
    assert _pairs.unstable(healthy, RULES, "cpu")["links"] == []


def test_a_pair_with_one_exchange_stalled_is_intermittent():
    records = {(0, 1): _record(3000), (0, 2): _record(3000, 6500, 259700),
               (1, 2): _record(3000, 5000, 31900)}  # 6.4x: a busy moment, not a stall
    got = _pairs.unstable(records, RULES, "cpu")
    assert (got["stalls"], got["links"]) == ([(0, 2)], [(0, 2)])


def test_a_moment_the_ends_spent_waiting_for_a_core_is_not_the_links():
    """CI, 2026-12-06: on a suite-loaded machine a healthy rail's pair was named beside the
    slow rail. A pair's worst moment that its two ends' waits for a core cover is the cores'
    (``busy``, named by no one); a lost message's 200 ms timer with a few ms of waiting, or a
    stalled exchange the waits do not cover, stays the link's."""
    def waited(record, rtt_ms=0.0, exchange_ms=0.0):
        return {**record, "rtt_cpu_wait_us": rtt_ms * 1e3,
                "exchange_cpu_wait_us": exchange_ms * 1e3}

    records = {(0, 1): _record(3000), (0, 2): _record(4000),
               (1, 2): waited(_record(3500, rtt_max_us=208000), rtt_ms=230)}
    got = _pairs.unstable(records, RULES, "cpu")
    assert (got["links"], got["waited"], got["busy"]) == ([], [], [(1, 2)])
    records[(1, 2)] = waited(_record(3500, rtt_max_us=208000), rtt_ms=3)
    assert _pairs.unstable(records, RULES, "cpu")["links"] == [(1, 2)]
    stalled = {(0, 1): _record(3000), (0, 2): waited(_record(3000, 6500, 259700), exchange_ms=300),
               (1, 2): _record(3000)}
    assert _pairs.unstable(stalled, RULES, "cpu")["busy"] == [(0, 2)]
    stalled[(0, 2)] = waited(stalled[(0, 2)], exchange_ms=40)
    assert _pairs.unstable(stalled, RULES, "cpu")["links"] == [(0, 2)]


def test_a_process_kept_off_its_core_counts_its_wait_and_an_idle_one_does_not():
    """The count behind ``busy`` (``proc.cpu_wait_s``: the threads' run_delay) on real
    processes: two busy loops pinned to one core each wait about half the time; one sleeping
    process waits for nothing."""
    import subprocess
    import sys
    import time

    from ddp_smoke.coordination import proc
    core = sorted(os.sched_getaffinity(0))[0]
    loop = "import os, time\nos.sched_setaffinity(0, {%d})\nend = time.time() + 3\n" \
           "while time.time() < end: pass\n" % core
    busy = [subprocess.Popen([sys.executable, "-c", loop]) for _ in range(2)]
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])
    try:
        time.sleep(0.5)
        before = [proc.cpu_wait_s(p.pid) for p in busy + [idle]]
        time.sleep(1.5)
        after = [proc.cpu_wait_s(p.pid) for p in busy + [idle]]
    finally:
        for p in busy + [idle]:
            p.kill()
            p.wait()
    grew = [b - a for a, b in zip(before, after)]
    assert all(g >= 0.3 for g in grew[:2]), grew  # ~0.75 s each of the 1.5 s
    assert grew[2] < 0.05, grew
    assert proc.cpu_wait_s(idle.pid) is None  # gone


def test_on_a_gpu_fabric_the_floor_is_the_fabrics():
    records = {(0, 1): _record(30), (0, 2): _record(25), (1, 2): _record(2500)}
    assert _pairs.unstable(records, RULES, "cuda")["links"] == [(1, 2)]
    assert _pairs.unstable(records, RULES, "cpu")["links"] == []


# -- the reader, on a real connection --------------------------------------------------------

def test_the_reader_sees_this_process_connections_and_counts_from_a_take():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port), timeout=5)
    peer, _ = server.accept()
    try:
        counter = retransmits.Counter()
        counter.take()
        got_bytes = []

        def receive():
            while sum(got_bytes) < 8000:
                got_bytes.append(len(peer.recv(1 << 16)) or 8000)

        t = threading.Thread(target=receive)
        t.start()
        for _ in range(8):
            client.sendall(b"x" * 1000)
        t.join(5)
        got = counter.take()
        # data segments sent (Nagle may merge the eight sends)
        assert got is not None and got["127.0.0.1"][2] >= 1, got
        assert got["127.0.0.1"][0] == 0  # nothing sent again on loopback
        assert counter.so_far() is None  # nothing since the take
        found = retransmits.snapshot()
        assert any(local[1] == port or remote[1] == port for local, remote in found)
        client.fileno()  # the reader borrowed the descriptors; they are still ours
        client.sendall(b"still open")
    finally:
        for s in (client, peer, server):
            s.close()


def test_two_nodes_one_link_are_found_by_the_thresholds_alone():
    ranks = RANKS[:2]
    lossy = retransmits.links(_posted({(0, 1): (14, 13, 40000), (1, 0): (0, 0, 40000)}), ranks)
    assert [c.ranks for c in retransmits.culprits(lossy, RULES, ranks)] == [[0, 1]]
    fine = retransmits.links(_posted({(0, 1): (3, 0, 40000), (1, 0): (0, 0, 40000)}), ranks)
    assert retransmits.culprits(fine, RULES, ranks) == []
    assert _pairs.unstable({(0, 1): _record(208000)}, RULES, "cpu")["links"] == [(0, 1)]
    assert _pairs.unstable({(0, 1): _record(10500)}, RULES, "cpu")["links"] == []


def test_a_link_the_check_named_already_stays_one_culprit_with_both_pieces_of_evidence():
    cfg = {"links": RULES, "rails": None}
    result = CheckResult("bandwidth", "fail", "slow", [Culprit(
        None, None, "link n2 <-> n1 is unstable: p99 round trip 208 ms", ranks=[2, 1],
        hosts=["n2", "n1"])])
    retransmits.attach(result, _healthy({(1, 2): (14, 13, 40000)}), RANKS, cfg)
    [c] = result.culprits
    assert c.reason.startswith("link n2 <-> n1 is unstable") and "13 retransmission" in c.reason
    assert result.status == "fail" and result.figures["links"]
    other = CheckResult("collectives", "pass", "ok")
    retransmits.attach(other, _healthy({(1, 2): (14, 13, 40000)}), RANKS, cfg)
    assert [k.ranks for k in other.culprits] == [[1, 2]] and other.status == "fail"
