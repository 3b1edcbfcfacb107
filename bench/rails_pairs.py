"""The bandwidth check's pairs with rails against without, on the two-rail sandbox, as a ratio.

Not a test: it prints numbers. As root, in one invocation: three network-namespace nodes with
two interfaces each on two bridges joined by a spine (tests/sandbox/hosts.py, rail_subnets),
two gloo ranks per node, ``--checks bandwidth`` at the quick sweep. Runs alternate (ABBA, so
drift on a shared machine hits both alike) between

* **rails**: ``rails: [eth0, eth1]``: each local rank on its own interface, node pairs measured
  inside both rails, the rails' rounds at once (6 pairs over 3 rounds);
* **one network**: no setting, every rank on eth0: node pairs between the node leaders, as
  without rails (3 pairs over the same 3 rounds).

Per kind it prints the median of the check's ``pairs_s`` (the pair passes alone, slowest rank)
and of its ``duration_s`` (sweep included), then the ratios rails / one network: about 1 when
the rails' rounds run at once, about 2 (the rails' pair count over one network's) when they
would run one rail after the other. Load is printed: on two shared cores the six ranks compete
for CPU, which is the part of the ratio above 1.

    sudo .venv/bin/python bench/rails_pairs.py [ROUNDS]      (/work/bin/realtest on the
                                                               project's shared machine)
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' sandbox

from tests.multinode import Nodes, torchrun_argv  # noqa: E402
from tests.sandbox.hosts import HostSandbox, missing_requirements  # noqa: E402

PREFIX, SUBNET, RAIL1 = "dsb", "10.231.39.0/24", "10.231.40.0/24"
NODES, PER_NODE = 3, 2
SWEEP = "bandwidth:\n  max_bytes_cpu: 262144\n  pair_bytes_cpu: 8388608\n  pair_rounds: 3\n"
KINDS = {"rails": "rails: [eth0, eth1]\n" + SWEEP, "one network": SWEEP}


def once(box: HostSandbox, folder: Path, config: str, port: int) -> dict:
    (folder / "cfg.yaml").write_text(config)
    worker = ["--backend", "gloo", "--checks", "bandwidth", "--level", "quick", "--timeout",
              "60", "--config", str(folder / "cfg.yaml"), "--report-dir", str(folder / "r")]
    nodes = Nodes(box, folder)
    for host in box.hosts:
        nodes.start(host, torchrun_argv(host, NODES, PER_NODE, f"{box.hosts[0].name}:{port}",
                                        f"dsb-{port}", "join_timeout=60,read_timeout=60",
                                        worker))
    nodes.wait(180)
    report = json.loads((folder / "r" / "report.json").read_text())
    check = next(c for c in report["checks"] if c["name"] == "bandwidth")
    assert report["verdict"] == "pass", check["culprits"]
    pairs = check["figures"]["pairs"]
    return {"pairs_s": check["figures"]["pairs_s"], "check_s": check["duration_s"],
            "pairs": len(pairs["results"]), "rails": len(pairs.get("rails") or [None])}


def main(rounds: int) -> int:
    reason = missing_requirements()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    print(f"# {NODES} nodes x {PER_NODE} gloo ranks, two rails; load average "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; {rounds} rounds, ABBA")
    got: dict[str, list[dict]] = {k: [] for k in KINDS}
    port = 29800
    with HostSandbox(PREFIX, SUBNET, NODES, rail_subnets=(RAIL1,)) as box, \
            tempfile.TemporaryDirectory() as tmp:
        for i in range(rounds):
            order = list(KINDS) if i % 2 == 0 else list(KINDS)[::-1]
            for kind in order:
                port += 1
                folder = Path(tmp) / f"{i}-{kind.replace(' ', '-')}"
                folder.mkdir()
                got[kind].append(once(box, folder, KINDS[kind], port))
    med = {k: {f: statistics.median(r[f] for r in v) for f in ("pairs_s", "check_s")}
           for k, v in got.items()}
    print(f"# {'kind':<12} {'rails':>5} {'pairs':>5} {'pairs_s':>8} {'check_s':>8}   (medians)")
    for kind, runs in got.items():
        print(f"  {kind:<12} {runs[0]['rails']:>5} {runs[0]['pairs']:>5} "
              f"{med[kind]['pairs_s']:>8.3f} {med[kind]['check_s']:>8.3f}")
    print(f"# ratio rails / one network: pairs_s {med['rails']['pairs_s'] / med['one network']['pairs_s']:.2f}, "
          f"check_s {med['rails']['check_s'] / med['one network']['check_s']:.2f} "
          f"(pairs measured: {got['rails'][0]['pairs'] / got['one network'][0]['pairs']:.1f}x); "
          f"load average now {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 5))
