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

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' sandbox

from bench.abba import alternate, medians, ready  # noqa: E402
from tests.sandbox.hosts import HostSandbox  # noqa: E402

PREFIX, SUBNET, RAIL1 = "dsb", "10.231.39.0/24", "10.231.40.0/24"
NODES, PER_NODE = 3, 2
SWEEP = "bandwidth:\n  max_bytes_cpu: 262144\n  pair_bytes_cpu: 8388608\n  pair_rounds: 3\n"
KINDS = {"rails": "rails: [eth0, eth1]\n" + SWEEP, "one network": SWEEP}


def main(rounds: int) -> int:
    if not ready(f"{NODES} nodes x {PER_NODE} gloo ranks, two rails", rounds):
        return 2
    with HostSandbox(PREFIX, SUBNET, NODES, rail_subnets=(RAIL1,)) as box:
        got = alternate(box, KINDS, rounds, PER_NODE)
    med = medians(got)
    shape = {k: (len(v[0]["figures"]["pairs"]["results"]),
                 len(v[0]["figures"]["pairs"].get("rails") or [None])) for k, v in got.items()}
    print(f"# {'kind':<12} {'rails':>5} {'pairs':>5} {'pairs_s':>8} {'check_s':>8}   (medians)")
    for kind in got:
        print(f"  {kind:<12} {shape[kind][1]:>5} {shape[kind][0]:>5} "
              f"{med[kind]['pairs_s']:>8.3f} {med[kind]['check_s']:>8.3f}")
    print(f"# ratio rails / one network: pairs_s {med['rails']['pairs_s'] / med['one network']['pairs_s']:.2f}, "
          f"check_s {med['rails']['check_s'] / med['one network']['check_s']:.2f} "
          f"(pairs measured: {shape['rails'][0] / shape['one network'][0]:.1f}x); "
          f"load average now {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 5))
