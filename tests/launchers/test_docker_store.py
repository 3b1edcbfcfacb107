"""Issue 24 in containers: two containers as two nodes (the image's entrypoint on both, with
DDP_SMOKE_STORE=auto), rank 0's worker or every worker SIGKILLed mid-check.

The node that hosts torchrun's rendezvous (node a: the --rdzv-endpoint names it) runs the store
host next to torchrun, on the endpoint's port + 1; node b derives the same address. Rank 0 is
held at ddp_step (``hang``) until rank 1 waits for it there, then killed from outside, by PID,
as the OOM killer would. Rendezvous order decides which node runs rank 0: either way, a survivor
must write the report naming rank 0 and its container's hostname; with both killed, the store
host must write it.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests import store_kill
from tests.sandbox.docker import (BuiltImage, PodNetwork, docker_engine,  # noqa: F401
                                  pod_network, wait_all, worker_image)

pytestmark = pytest.mark.timeout(900)  # the first Docker test of a session builds the image
TIMEOUT_S = 30  # the worker's stage deadline: the report must come within it + 10 s
RUN_ID = "dsd-store"


def _killed_pair(docker_engine, worker_image, pod_network, tmp_path, victims):
    uid = int(docker_engine.docker("image", "inspect", "-f", "{{.Config.User}}",
                                   worker_image.tag).stdout.strip())
    out = tmp_path / "reports"
    out.mkdir()
    os.chown(out, uid, uid)
    names = {"dsd-node-a": "10.231.3.11", "dsd-node-b": "10.231.3.12"}
    pods = [pod_network.add_pod(n, addr, etc_hosts=names) for n, addr in names.items()]
    nodes = []
    for pod in pods:
        args = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={pods[0].hostname}:29500", f"--rdzv-id={RUN_ID}",
                f"--local-addr={pod.addr}", "--", "--checks", "environment,ddp_step",
                "--fault", "0:hang@ddp_step", "--timeout", str(TIMEOUT_S),
                "--report-dir", "/reports"]
        nodes.append(pod_network.run(pod, worker_image.tag, args, volumes=[f"{out}:/reports"],
                                     env={"GLOO_SOCKET_IFNAME": "eth0",
                                          "DDP_SMOKE_STORE": "auto"}))
    end, store = time.monotonic() + 240, None
    while store is None:
        try:
            store = store_kill.store_at(names["dsd-node-a"], 29501, timeout_s=2)
        except RuntimeError:
            assert time.monotonic() < end, "\n".join(n.logs() for n in nodes)
            time.sleep(1)
    store_kill.wait_arrived(store, "ddp_step", [1], 240)
    pids = store_kill.workers(run_id=RUN_ID)
    assert sorted(pids) == [0, 1], pids
    killed = store_kill.kill(pids[r] for r in victims)
    written = store_kill.wait_file(out / "report.json", TIMEOUT_S + 10)
    statuses = wait_all(nodes, 120)
    logs = "\n".join(f"--- {n.name} (exit {s})\n{n.logs()}" for n, s in zip(nodes, statuses))
    assert written is not None, f"no report within {TIMEOUT_S + 10} s of the kill\n{logs}"
    return json.loads((out / "report.json").read_text()), logs, written - killed


def _culprits(report: dict) -> set:
    return {(c["rank"], c["host"]) for ch in report["checks"] for c in ch["culprits"]}


def _stopped(report: dict) -> dict:
    return next(c for c in report["checks"] if c["name"] == "ddp_step")


def _host_of(report: dict, rank: int) -> str:
    return next(r["host"] for r in report["ranks"] if r["rank"] == rank)


def test_rank0_killed_the_survivor_writes_the_report(docker_engine, worker_image,
                                                      pod_network, tmp_path):
    report, logs, took = _killed_pair(docker_engine, worker_image, pod_network, tmp_path, [0])
    print(f"\ndocker, rank 0 SIGKILLed: report {took:.1f} s after the kill; culprits "
          f"{sorted(_culprits(report))}")
    assert report["verdict"] == "fail"
    assert _host_of(report, 0) in ("dsd-node-a", "dsd-node-b")
    assert _culprits(report) == {(0, _host_of(report, 0))}, logs[-4000:]
    # The survivor writes, unless its node's torchrun agent stopped it first: node a's agent
    # hosts torchrun's rendezvous store and leaves with its killed worker, and node b's agent
    # then fails on that store (RendezvousConnectionError) and stops rank 1. The store host's
    # report of last resort names rank 0 all the same.
    assert report["written_by"] in ("rank 1 (took over from rank 0)", "store host"), \
        logs[-6000:]
    assert took < TIMEOUT_S + 10


def test_every_rank_killed_the_store_host_writes_the_report(docker_engine, worker_image,
                                                             pod_network, tmp_path):
    report, logs, took = _killed_pair(docker_engine, worker_image, pod_network, tmp_path,
                                      [0, 1])
    print(f"\ndocker, both ranks SIGKILLed: report {took:.1f} s after the kill; culprits "
          f"{sorted(_culprits(report))}")
    assert report["error"]["type"] == "AllRanksLost", logs[-4000:]
    assert report["written_by"] == "store host"
    assert (0, _host_of(report, 0)) in _culprits(report)
    assert took < TIMEOUT_S + 10
