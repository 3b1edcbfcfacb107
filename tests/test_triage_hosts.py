"""A throttled node among three real hosts ends up in bad_hosts.txt, the others in good_hosts.txt.

Three network-namespace hosts (prefix dse, 10.231.9.0/24), one torchrun each, one rank per
host, gloo over the hosts' eth0. The second host's link is throttled in both directions with
tc tbf (its root-side veth and its own eth0, as a slow NIC or a bad cable would): the
bandwidth check's node pairs find it slow with every partner, and the report's hosts section,
the host lists and the Prometheus textfile all say which host to drain.
Run under ``flock /tmp/ddpsmoke-hosts.lock`` with the other namespace tests.
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.sandbox.hosts import Host, sandbox_fixture
from tests.test_multihost import _Nodes, _torchrun

PREFIX, SUBNET = "dse", "10.231.9.0/24"
PORT = 29491
RATE = "200mbit"  # ~25 MB/s: far below the ~1 GB/s gloo gets over an unthrottled veth here
SMALL = {"bandwidth": {"max_bytes_cpu": 1 << 20, "iters": 3, "time_per_size_s": 0.05,
                       "pair_bytes_cpu": 4 << 20, "pair_iters": 3}}

box = sandbox_fixture(PREFIX, SUBNET, 3)


def _throttle(host: Host) -> None:
    """tbf on both ends of host's link (fault-recipes.md: 'a slow node, both directions')."""
    tbf = ["root", "tbf", "rate", RATE, "burst", "64kb", "latency", "500ms"]
    for argv in (["tc", "qdisc", "add", "dev", host.link, *tbf],
                 ["ip", "netns", "exec", host.netns, "tc", "qdisc", "add", "dev", "eth0", *tbf]):
        subprocess.run(argv, check=True, capture_output=True, timeout=10)


@pytest.mark.timeout(300)
def test_throttled_node_is_the_one_bad_host(box, tmp_path):
    hosts, slow = box.hosts, box.hosts[1]
    _throttle(slow)
    config, report_dir, textfile = tmp_path / "small.yaml", tmp_path / "report", \
        tmp_path / "ddp_smoke.prom"
    config.write_text(yaml.safe_dump(SMALL))
    worker = ["--backend", "gloo", "--checks", "environment,bandwidth", "--timeout", "120",
              "--config", str(config), "--report-dir", str(report_dir),
              "--prometheus", str(textfile)]
    nodes = _Nodes(box, tmp_path)
    for host in hosts:
        nodes.start(host, _torchrun(host, 3, 1, f"{hosts[0].name}:{PORT}",
                                    f"dse-triage-{os.getpid()}",
                                    "join_timeout=60,read_timeout=30", worker))
    codes = nodes.wait(timeout_s=240)
    report = json.loads((report_dir / "report.json").read_text())
    print("\nhosts section:\n" + json.dumps(report["hosts"], indent=2))
    print("bad_hosts.txt:\n" + (report_dir / "bad_hosts.txt").read_text())
    log = nodes.log(hosts[0].name)
    tail = log[log.find("verdict: "):log.find("ddp-smoke/result=fail --overwrite")]
    print(f"wall {nodes.elapsed():.1f} s; rank 0 printed:\n{tail}ddp-smoke/result=fail "
          "--overwrite")
    assert codes[hosts[0].name] != 0  # verdict fail
    verdicts = {h["host"]: h["verdict"] for h in report["hosts"]}
    assert verdicts == {hosts[0].name: "good", slow.name: "bad", hosts[2].name: "good"}, \
        json.dumps(report["checks"], indent=1)[-4000:]
    [entry] = [h for h in report["hosts"] if h["host"] == slow.name]
    assert [(r["check"], r["rank"]) for r in entry["reasons"]] == [("bandwidth", 1)]
    assert entry["reasons"][0]["reason"].startswith(f"node {slow.name} is slow with every "
                                                    "partner")
    assert (report_dir / "bad_hosts.txt").read_text() == f"{slow.name}\n"
    assert (report_dir / "good_hosts.txt").read_text() == f"{hosts[0].name}\n{hosts[2].name}\n"
    assert f"sbatch --exclude={slow.name} slurm/ddp_smoke.sbatch" in log
    assert f"kubectl label node {slow.name} ddp-smoke/result=fail --overwrite" in log

    got = {f.name: f.samples for f in text_string_to_metric_families(textfile.read_text())}
    bad = {s.labels["host"]: s.value for s in got["ddp_smoke_host_verdict"]
           if s.labels["verdict"] == "bad"}
    assert bad == {hosts[0].name: 0, slow.name: 1, hosts[2].name: 0}
    pairs = {(s.labels["host_a"], s.labels["host_b"]): s.value
             for s in got["ddp_smoke_pair_busbw_gbps"]}
    fast = pairs[(hosts[0].name, hosts[2].name)]
    assert all(v < fast / 4 for (a, b), v in pairs.items() if slow.name in (a, b)), pairs
    print(f"pair busbw GB/s: {pairs}")
