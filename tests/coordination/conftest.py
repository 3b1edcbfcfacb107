"""The coordination tests' simulated world: ranks as threads of this process, each a real
Coordinator with its one signed connection to a real TCPStore, as the harness makes it."""
import datetime
import time

import pytest
import torch.distributed as dist

from ddp_smoke.config.launchenv import LaunchEnv
from ddp_smoke.coordination import signing
from ddp_smoke.coordination.protocol import Coordinator
from ddp_smoke.coordination.store import Connection
from tests.launch import free_port


@pytest.fixture
def world():
    """``make(n, timeout)`` → n Coordinators on one fresh store (rank 0's hosts it)."""
    port, made, connections = free_port(), [], []

    def make(n: int, timeout: float = 5.0, checks=("alpha",), per_node: int | None = None,
             node_speaker: str = "auto"):
        cfg = {"checks": list(checks), "timeout": timeout, "node_speaker": node_speaker}
        master = dist.TCPStore("127.0.0.1", port, n, True, datetime.timedelta(seconds=10),
                               wait_for_workers=False)
        made.append(master)

        def connect(may_host):
            raw = dist.TCPStore("127.0.0.1", port, n, False, datetime.timedelta(seconds=10),
                                wait_for_workers=False)
            connections.append(raw)
            # as the harness connects: one connection, every record signed with the run's secret
            return signing.SignedStore(Connection(dist.PrefixStore("ddp_smoke/0", raw), 0.25),
                                       "ddp_smoke/0", b"t" * 32, 0)

        coords = []
        for r in range(n):
            k = per_node or n  # ranks a node, numbered as torchrun numbers them
            env = LaunchEnv(rank=r, world_size=n, local_rank=r % k, local_world_size=k,
                            group_rank=r // k, master_addr="127.0.0.1", master_port=port,
                            agent_store=True, launcher="test", run_id="t")
            c = Coordinator(env, cfg, connect, lambda *a: "fail", "now", time.monotonic())
            c.met([{"rank": i, "host": f"h{i}"} for i in range(n)])
            coords.append(c)
        return coords
    make.connections = connections
    return make
