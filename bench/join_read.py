"""Benchmark: the identity records a rank reads at the join, against every rank's.

Not a test: it prints numbers. Per world size N, N identity records the size of a real
rank's (host, pid, device, addresses) are posted, signed, to one libuv TCPStore in this
process; then ``Coordinator.meet`` runs as rank 0 (which reads every record: it judges and
writes the report) and as rank 13 (8 ranks a node: its own node's and rank 0's node's), each
on its own signed connection, as the harness connects. Printed: records read, one rank's
wall time, and the bytes every rank's read would move through the store were each rank to
read like it (before 2026-12-02 every rank read like rank 0).

    .venv/bin/python bench/join_read.py                # N = 1,024, 4,096, 16,384
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import secrets
import sys
import time

RECORD = {"rank": 0, "local_rank": 0, "host": "gpu-node-0001", "group_rank": 0, "pid": 123456,
          "device": "cuda:0", "route_address": "10.0.0.1",
          "hostname_addresses": ["10.0.0.1"], "addresses": ["10.0.0.1", "192.168.0.1"],
          "identity": {"machine_id": "0" * 32, "boot_id": "0" * 36,
                       "gpu_uuid": "GPU-00000000-0000-0000-0000-000000000000"}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1024,4096,16384")
    args = p.parse_args()
    os.environ.setdefault("DDP_SMOKE_SECRET", secrets.token_hex(32))
    import torch.distributed as dist
    from ddp_smoke import harness
    from ddp_smoke.config.launchenv import LaunchEnv
    from ddp_smoke.coordination import keys, protocol

    server = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=60),
                           wait_for_workers=False, use_libuv=True)
    print(f"{'N':>6} {'rank':>4} {'records':>7} {'read s':>7} {'all ranks GB':>12}", flush=True)
    for n in (int(x) for x in args.sizes.split(",")):
        def env(rank: int) -> LaunchEnv:
            return LaunchEnv(rank=rank, world_size=n, local_rank=rank % 8,
                             local_world_size=8, group_rank=rank // 8, master_addr="127.0.0.1",
                             master_port=server.port, agent_store=True, launcher="bench",
                             run_id=f"join-{n}")

        def coordinator(rank: int) -> protocol.Coordinator:
            e = env(rank)
            return protocol.Coordinator(e, {"checks": [], "timeout": 60},
                                        lambda may_host: harness._store(e, 60, may_host=False),
                                        lambda *a: "fail", "bench", time.monotonic())
        writer = coordinator(0)
        for lo in range(0, n, 1024):
            ranks = range(lo, min(n, lo + 1024))
            writer.store.multi_set([keys.of(keys.RANK, r) for r in ranks],
                                   [json.dumps({**RECORD, "rank": r}) for r in ranks])
        for c in (writer, coordinator(13)):
            t = time.monotonic()
            c.meet(c.store)
            took = time.monotonic() - t
            read = [r for r in c.run.ranks if r]
            size = sum(len(json.dumps(r)) for r in read)
            print(f"{n:>6} {c.env.rank:>4} {len(read):>7} {took:>7.3f} {size * n / 1e9:>12.2f}",
                  flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "job"))
    main()
