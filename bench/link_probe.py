"""What issue 45's link signals cost: the pair round trips and the TCP counter reads.

Not a test: it prints numbers. As root, in one invocation, on three network-namespace nodes
(tests/sandbox/hosts.py), one gloo rank each, ``--checks bandwidth`` at the quick sweep, runs
alternate (ABBA, so drift on a shared machine hits both alike) between

* **probe**: the defaults: ``links.latency_iters`` (100) one-element round trips per pair;
* **no probe**: ``links.latency_iters: 0``: the pairs' bandwidth exchanges alone;
* **no beacon**: ``links.beacon_s: 0``: no byte kept on every link all run long.

Per kind it prints the medians of the check's ``pairs_s`` and ``duration_s`` and the
difference probe − no probe (the issue's bound: 1 s or less per check on three CPU nodes).
Then the cost of one :func:`ddp_smoke.coordination.retransmits.snapshot` (read at every
check's start and end) in a process holding 64 open TCP connections, as a gloo rank of a
large job holds one per peer it met.

    sudo .venv/bin/python bench/link_probe.py [ROUNDS]
"""
from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' sandbox

from bench.abba import alternate, medians, ready  # noqa: E402
from ddp_smoke.coordination import retransmits  # noqa: E402
from tests.sandbox.hosts import HostSandbox  # noqa: E402

PREFIX, SUBNET, NODES = "dsy", "10.231.43.0/24", 3
SWEEP = "bandwidth:\n  max_bytes_cpu: 1048576\n  pair_bytes_cpu: 2097152\n  pair_rounds: 3\n"
KINDS = {"probe": SWEEP, "no probe": SWEEP + "links:\n  latency_iters: 0\n",
         "no beacon": SWEEP + "links:\n  beacon_s: 0\n"}


def snapshot_cost(connections: int = 64, reads: int = 200) -> float:
    """Seconds per snapshot() with ``connections`` loopback TCP connections open."""
    server = socket.create_server(("127.0.0.1", 0), backlog=connections)
    ends = []
    for _ in range(connections):
        ends.append(socket.create_connection(server.getsockname()))
        ends.append(server.accept()[0])
    try:
        retransmits.snapshot()
        t0 = time.perf_counter()
        for _ in range(reads):
            found = retransmits.snapshot()
        took = (time.perf_counter() - t0) / reads
        assert len(found) >= 2 * connections, len(found)
        return took
    finally:
        for s in ends + [server]:
            s.close()


def main(rounds: int) -> int:
    if not ready(f"{NODES} nodes x 1 gloo rank, bandwidth at the quick sweep", rounds):
        return 2
    with HostSandbox(PREFIX, SUBNET, NODES) as box:
        med = medians(alternate(box, KINDS, rounds, 1))
    print(f"# {'kind':<9} {'pairs_s':>8} {'check_s':>8}   (medians)")
    for kind in KINDS:
        print(f"  {kind:<9} {med[kind]['pairs_s']:>8.3f} {med[kind]['check_s']:>8.3f}")
    print(f"# latency probe costs {med['probe']['check_s'] - med['no probe']['check_s']:+.3f} s "
          f"per check (pairs {med['probe']['pairs_s'] - med['no probe']['pairs_s']:+.3f} s; "
          f"bound 1 s); load average now {os.getloadavg()[0]:.2f}")
    print(f"# beacon (a byte every links.beacon_s on each node's links) costs "
          f"{med['probe']['check_s'] - med['no beacon']['check_s']:+.3f} s per check")
    print(f"# retransmits.snapshot() with 128 TCP sockets open: "
          f"{1e3 * snapshot_cost():.2f} ms per read (two reads per check)")
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 5))
