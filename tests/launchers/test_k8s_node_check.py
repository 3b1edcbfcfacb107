"""The node-check DaemonSet (k8s/node-check/): its pods label their nodes, in the pod emulation.

No API server runs on these machines (shared/reference/kubernetes.md). ``tests/k8s_operator.py``
computes the DaemonSet's pods as its controller and the kubelet would (one per node its
nodeSelector selects, bound to it, ``NODE_NAME`` from ``spec.nodeName``); each runs as a
container of the image from ``docker/`` on the real Docker engine, with what the kubelet gives
a pod beside that: the service account's token, CA and namespace at
``/var/run/secrets/kubernetes.io/serviceaccount`` and ``KUBERNETES_SERVICE_HOST``/``_PORT``.
The API server's side is a stand-in (tests/k8s_api.py) that does what the real one does with the
pods' one request, and checks what it checks. Nodes: one healthy CPU node, one whose
hardware is a replayed faulty GPU node (DDP_SMOKE_HEALTH_REPLAY, the kit's recorded XID 79).
The interval is the manifest's EDIT point, shortened here.
"""
from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest

from tests import k8s_operator as ko, kubelet
from tests.k8s_api import NAMESPACE, SA_DIR, ApiServer, allowed, certificate, service_account
from tests.sandbox import hosts
from tests.sandbox.docker import PodNetwork, docker_engine, worker_image  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
FOLDER = REPO / "k8s" / "node-check"
PREFIX, SUBNET = "dsn", "10.231.41.0/24"
EVERY_S = 8
NODES = {"gpu-a": {"nvidia.com/gpu.present": "true"}, "gpu-b": {"nvidia.com/gpu.present": "true"},
         "cpu-c": {}}


# -- static: where it lives, what it may do ----------------------------------------------------

def test_kubectl_apply_f_k8s_never_applies_the_daemonset():
    top = [d["kind"] for d in ko.load_manifests(REPO / "k8s")]
    assert "DaemonSet" not in top and "ClusterRole" not in top, top
    mine = {d["kind"] for d in ko.load_manifests(FOLDER)}
    assert mine == {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding",
                    "DaemonSet"}


def test_it_may_get_and_patch_nodes_and_nothing_else():
    docs = ko.load_manifests(FOLDER)
    (role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"],
                              "verbs": ["get", "patch"]}]
    assert allowed(docs, NAMESPACE, "ddp-smoke-node-check", "patch", "nodes")
    assert not allowed(docs, NAMESPACE, "default", "patch", "nodes")
    assert not allowed(docs, NAMESPACE, "ddp-smoke-node-check", "delete", "nodes")


def test_one_pod_per_selected_node_each_told_its_node():
    pods = ko.compute_pods(ko.load_manifests(FOLDER), namespace=NAMESPACE, nodes=NODES)
    assert sorted(p.node for p in pods) == ["gpu-a", "gpu-b"]  # the nodeSelector's
    for pod in pods:
        assert pod.env["NODE_NAME"] == pod.node and pod.service_account == "ddp-smoke-node-check"
        assert pod.argv[:4] == ["python3", "-m", "ddp_smoke", "node-check"]
        assert {"--act", "k8s-label", "--skip-if-busy"} <= set(pod.argv)
    assert len({p.name for p in pods}) == 2


# -- the run ------------------------------------------------------------------------------------

@pytest.mark.timeout(600)
def test_the_daemonset_labels_a_healthy_node_pass_and_a_faulty_one_fail_on_its_interval(
        docker_engine, worker_image, tmp_path):  # noqa: F811 — the fixtures
    reason = hosts.missing_requirements()
    if reason:
        pytest.skip(reason)
    docs = ko.customize(ko.load_manifests(FOLDER), image=worker_image.tag)
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    args = ds["spec"]["template"]["spec"]["containers"][0]["args"]
    args[args.index("--every") + 1] = str(EVERY_S)  # the EDIT point: seconds between checks
    pods = ko.compute_pods(docs, namespace=NAMESPACE, nodes=NODES)
    with PodNetwork(docker_engine, worker_image.tag, prefix=PREFIX, subnet=SUBNET) as net:
        gateway = str(net.net[1])
        cert, key = certificate(tmp_path, gateway)
        sa = service_account(tmp_path / "serviceaccount", cert)
        api = ApiServer(gateway, cert, key, docs, NODES)
        containers = {}
        try:
            for pod in pods:
                spec = ds["spec"]["template"]["spec"]
                user, security = kubelet.security_options(spec, pod)
                binds, shm_size, _ = kubelet.volumes(pod, spec, tmp_path / pod.name)
                binds.append(f"{sa}:{SA_DIR}:ro")
                env = {**pod.env, "KUBERNETES_SERVICE_HOST": gateway,
                       "KUBERNETES_SERVICE_PORT": str(api.port)}
                if pod.node == "gpu-b":  # this node's hardware: a recorded XID 79
                    binds.append(f"{REPO / 'tests' / 'data' / 'health'}:/replay:ro")
                    env["DDP_SMOKE_HEALTH_REPLAY"] = "/replay/xid79_kernel_log.json"
                net_pod = net.add_pod(pod.hostname)
                containers[pod.node] = net.run(net_pod, pod.image, command=pod.argv, env=env,
                                               volumes=binds, user=user, shm_size=shm_size,
                                               extra=security)
            t0 = time.monotonic()
            first = _wait_labels(api, lambda n: all(
                "ddp-smoke/health" in n[x]["metadata"]["labels"] for x in ("gpu-a", "gpu-b")),
                240, containers)
            took = time.monotonic() - t0
            a, b = (first[x]["metadata"] for x in ("gpu-a", "gpu-b"))
            print(f"\nboth nodes labelled {took:.0f} s after their pods started: "
                  f"gpu-a {a['labels']} gpu-b {b['labels']}\n{b['annotations']}")
            assert a["labels"]["ddp-smoke/health"] == "pass", containers["gpu-a"].logs()[-3000:]
            assert b["labels"]["ddp-smoke/health"] == "fail", containers["gpu-b"].logs()[-3000:]
            assert "ddp-smoke/health-finding" not in a["annotations"]
            assert "XID 79" in b["annotations"]["ddp-smoke/health-finding"]
            assert b["annotations"]["ddp-smoke/health-run"].startswith("node-check-gpu-b-")
            assert a["labels"]["nvidia.com/gpu.present"] == "true"  # others' labels stay
            stamp = a["annotations"]["ddp-smoke/health-checked-at"]
            again = _wait_labels(api, lambda n: n["gpu-a"]["metadata"]["annotations"][
                "ddp-smoke/health-checked-at"] != stamp, 4 * EVERY_S + 60, containers)
            assert again["gpu-a"]["metadata"]["labels"]["ddp-smoke/health"] == "pass"
            assert "cpu-c" not in {p.node for p in pods}
            assert {ct for _, ct, _ in api.requests} == {"application/merge-patch+json"}
            for node, container in containers.items():  # a pod deleted: SIGTERM, then it ends
                net.engine.docker("kill", "--signal", "TERM", container.name)
                assert container.wait(20) == 143, container.logs()[-2000:]
        finally:
            api.close()


def _wait_labels(api: ApiServer, done, timeout_s: float, containers) -> dict:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        nodes = copy.deepcopy(api.nodes)
        if done(nodes):
            return nodes
        time.sleep(1)
    logs = "\n".join(f"--- {n}\n{c.logs()[-3000:]}" for n, c in containers.items())
    pytest.fail(f"labels not there within {timeout_s:.0f} s: {api.nodes}\n{logs}")
