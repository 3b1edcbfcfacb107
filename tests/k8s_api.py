"""A stand-in for the Kubernetes API server's side of the node-check DaemonSet's pods
(k8s/node-check/): no API server runs on these machines (shared/reference/kubernetes.md).

It does what the real one does with the pods' one request, and checks what it checks: HTTPS
with the account's CA, the bearer token, RBAC from the manifests' own ClusterRole and
ClusterRoleBinding, a JSON merge patch (RFC 7386) of the Node, label keys and values as the API
server validates them, the patched Node against Kubernetes' own schema (kubernetes-validate,
strict). Shared by tests/launchers/test_k8s_node_check.py and the campaign's daemonset launcher.
"""
from __future__ import annotations

import copy
import http.server
import json
import re
import ssl
import subprocess
import threading
from pathlib import Path

from tests.sandbox import tools

NAMESPACE = "ddp-smoke"  # k8s/node-check's
ACCOUNT = "ddp-smoke-node-check"
TOKEN = "emulated-service-account-token"
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
_NAME = r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
_PREFIX = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"


def service_account(folder: Path, cert: Path, namespace: str = NAMESPACE) -> Path:
    """What the kubelet mounts at SA_DIR: the token, the cluster's CA, the namespace."""
    folder.mkdir()
    (folder / "ca.crt").write_bytes(cert.read_bytes())
    (folder / "token").write_text(TOKEN)
    (folder / "namespace").write_text(namespace)
    for f in folder.iterdir():
        f.chmod(0o644)
    return folder


def allowed(docs: list[dict], namespace: str, account: str, verb: str, resource: str) -> bool:
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

    def __init__(self, addr: str, cert: Path, key: Path, docs: list[dict],
                 nodes: dict[str, dict], namespace: str = NAMESPACE):
        self.docs, self.namespace, self.nodes, self.requests = docs, namespace, {}, []
        for name, labels in nodes.items():
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
        if not allowed(self.docs, self.namespace, ACCOUNT, "patch", "nodes"):
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


def certificate(folder: Path, addr: str) -> tuple[Path, Path]:
    """A self-signed certificate for the API server's address (the cluster's CA is its own)."""
    cert, key = folder / "ca.crt", folder / "server.key"
    tools.ensure("openssl")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=kubernetes", "-addext", f"subjectAltName=IP:{addr}",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True,
                   timeout=60)
    return cert, key
