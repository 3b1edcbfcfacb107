"""The node-check DaemonSet (k8s/node-check/): its pods label their nodes, in the pod emulation.

No API server runs on these machines (shared/reference/kubernetes.md). ``tests/k8s_operator.py``
computes the DaemonSet's pods as its controller and the kubelet would (one per node its
nodeSelector selects, bound to it, ``NODE_NAME`` from ``spec.nodeName``); each runs as a
container of the image from ``docker/`` on the real Docker engine, with what the kubelet gives
a pod beside that: the service account's token, CA and namespace at
``/var/run/secrets/kubernetes.io/serviceaccount`` and ``KUBERNETES_SERVICE_HOST``/``_PORT``.
The API server's side is a stand-in that does what the real one does with the pods' one
request, and checks what it checks: HTTPS with the account's CA, the bearer token, RBAC from
the manifests' own ClusterRole and ClusterRoleBinding, a JSON merge patch (RFC 7386) of the
Node, label keys and values as the API server validates them, the patched Node against
Kubernetes' own schema (kubernetes-validate, strict). Nodes: one healthy CPU node, one whose
hardware is a replayed faulty GPU node (DDP_SMOKE_HEALTH_REPLAY, the kit's recorded XID 79).
The interval is the manifest's EDIT point, shortened here.
"""
from __future__ import annotations

import copy
import http.server
import json
import re
import ssl
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests import k8s_operator as ko, kubelet
from tests.sandbox import hosts, tools
from tests.sandbox.docker import PodNetwork, docker_engine, worker_image  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
FOLDER = REPO / "k8s" / "node-check"
NAMESPACE = "ddp-smoke"
PREFIX, SUBNET = "dsn", "10.231.41.0/24"
EVERY_S = 8
TOKEN = "emulated-service-account-token"
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
NODES = {"gpu-a": {"nvidia.com/gpu.present": "true"}, "gpu-b": {"nvidia.com/gpu.present": "true"},
         "cpu-c": {}}
_NAME = r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
_PREFIX = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"


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
    assert _allowed(docs, NAMESPACE, "ddp-smoke-node-check", "patch", "nodes")
    assert not _allowed(docs, NAMESPACE, "default", "patch", "nodes")
    assert not _allowed(docs, NAMESPACE, "ddp-smoke-node-check", "delete", "nodes")


def test_one_pod_per_selected_node_each_told_its_node():
    pods = ko.compute_pods(ko.load_manifests(FOLDER), namespace=NAMESPACE, nodes=NODES)
    assert sorted(p.node for p in pods) == ["gpu-a", "gpu-b"]  # the nodeSelector's
    for pod in pods:
        assert pod.env["NODE_NAME"] == pod.node and pod.service_account == "ddp-smoke-node-check"
        assert pod.argv[:4] == ["python3", "-m", "ddp_smoke", "node-check"]
        assert {"--act", "k8s-label", "--skip-if-busy"} <= set(pod.argv)
    assert len({p.name for p in pods}) == 2


# -- the stand-in API server --------------------------------------------------------------------

def _allowed(docs: list[dict], namespace: str, account: str, verb: str, resource: str) -> bool:
    """RBAC as the API server evaluates it for a service account: a ClusterRoleBinding naming
    the account binds a ClusterRole whose rule grants the verb on the resource (core group)."""
    roles = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ClusterRole"}
    for b in (d for d in docs if d["kind"] == "ClusterRoleBinding"):
        if not any(s.get("kind") == "ServiceAccount" and s.get("name") == account and
                   s.get("namespace") == namespace for s in b.get("subjects", [])):
            continue
        for rule in roles.get(b["roleRef"]["name"], {}).get("rules", []):
            if "" in rule.get("apiGroups", []) and resource in rule.get("resources", []) and \
                    verb in rule.get("verbs", []):
                return True
    return False


def merge_patch(target, patch):
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def label_errors(labels: dict) -> list[str]:
    """The API server's label validation (apimachinery validation.IsQualifiedName, IsValidLabelValue)."""
    errors = []
    for key, value in labels.items():
        prefix, _, name = key.rpartition("/")
        if (prefix and (len(prefix) > 253 or not re.fullmatch(_PREFIX, prefix))) or \
                len(name) > 63 or not re.fullmatch(_NAME, name):
            errors.append(f"label key {key!r}")
        if len(value) > 63 or (value and not re.fullmatch(_NAME, value)):
            errors.append(f"label value {value!r}")
    return errors


class ApiServer:
    """Nodes in memory; PATCH /api/v1/nodes/NAME as described in the module docstring."""

    def __init__(self, addr: str, cert: Path, key: Path, docs: list[dict]):
        self.docs, self.nodes, self.requests = docs, {}, []
        for name, labels in NODES.items():
            self.nodes[name] = {"apiVersion": "v1", "kind": "Node",
                                "metadata": {"name": name, "labels": dict(labels)}}
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_PATCH(self):  # noqa: N802 — http.server's name
                owner.patch(self)

            def log_message(self, *args):
                pass

        self.http = http.server.ThreadingHTTPServer((addr, 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self.http.socket = context.wrap_socket(self.http.socket, server_side=True)
        self.port = self.http.server_address[1]
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def patch(self, req) -> None:
        body = req.rfile.read(int(req.headers.get("Content-Length", 0)))
        self.requests.append((req.path, req.headers.get("Content-Type"), body))
        name = req.path.removeprefix("/api/v1/nodes/")
        if req.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._answer(req, 401, "Unauthorized")
        if not _allowed(self.docs, NAMESPACE, "ddp-smoke-node-check", "patch", "nodes"):
            return self._answer(req, 403, f'nodes "{name}" is forbidden')
        if req.headers.get("Content-Type") != "application/merge-patch+json":
            return self._answer(req, 415, "Unsupported Media Type")
        if name not in self.nodes:
            return self._answer(req, 404, f'nodes "{name}" not found')
        node = merge_patch(self.nodes[name], json.loads(body))
        errors = label_errors(node["metadata"].get("labels", {}))
        import kubernetes_validate
        try:
            kubernetes_validate.validate(node, "1.31", strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(e.message)
        if errors:
            return self._answer(req, 422, "; ".join(errors))
        self.nodes[name] = node
        self._answer(req, 200, node)

    @staticmethod
    def _answer(req, code: int, body) -> None:
        data = json.dumps(body if isinstance(body, dict) else {
            "kind": "Status", "status": "Failure", "message": body, "code": code}).encode()
        req.send_response(code)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        req.wfile.write(data)

    def close(self) -> None:
        self.http.shutdown()


def _certificate(folder: Path, addr: str) -> tuple[Path, Path]:
    """A self-signed certificate for the API server's address (the cluster's CA is its own)."""
    cert, key = folder / "ca.crt", folder / "server.key"
    tools.ensure("openssl")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=kubernetes", "-addext", f"subjectAltName=IP:{addr}",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True,
                   timeout=60)
    return cert, key


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
        sa = tmp_path / "serviceaccount"
        sa.mkdir()
        cert, key = _certificate(tmp_path, gateway)
        (sa / "ca.crt").write_bytes(cert.read_bytes())
        (sa / "token").write_text(TOKEN)
        (sa / "namespace").write_text(NAMESPACE)
        for f in sa.iterdir():
            f.chmod(0o644)
        api = ApiServer(gateway, cert, key, docs)
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
