"""What the kit does to one node on its own: Slurm drain and resume, a Kubernetes node's label.

Slurm, through ``scontrol`` (the node's state and reason; drain; resume), each call bounded by
``SCONTROL_S``: a slurmctld that does not answer must not hold a health check past its time;
a run's bad hosts drained side by side under one deadline (:func:`slurm_drain_all`).

Kubernetes, through the API server from inside a pod (the pod's service account: its token
and CA under ``SERVICE_ACCOUNT``, the server at ``KUBERNETES_SERVICE_HOST``/``_PORT``, both
set by the kubelet): one JSON merge patch (RFC 7386) of the Node's labels and annotations,
which needs ``get`` and ``patch`` on ``nodes`` (k8s/node-check/'s ClusterRole). Standard
library only: the image needs no kubectl.
"""
from __future__ import annotations

import json
import os
import ssl
import subprocess
import time
import urllib.error
import urllib.request

SCONTROL_S = 5.0
API_S = 5.0
SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


class ActError(RuntimeError):
    """A call the kit made to act failed; the message says which and why."""


def _scontrol(*args: str, environ=None) -> str:
    try:
        proc = subprocess.run(["scontrol", *args], capture_output=True, text=True,
                              timeout=SCONTROL_S, env=environ, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise ActError(f"scontrol {args[0]} gave no answer within {SCONTROL_S:g} s") from None
    except OSError as e:
        raise ActError(f"scontrol: {e.strerror or e} (no Slurm client on this node?)") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        raise ActError(f"scontrol {' '.join(args[:2])}: {last[-1] if last else proc.returncode}")
    return proc.stdout


def parse_nodes(text: str) -> dict[str, dict]:
    """``scontrol show node`` as ``{name: {"state", "reason"}}``. Its multi-line form: a
    reason has a line of its own there (it may hold spaces and ``KEY=value`` words, and Slurm
    appends ``[user@time]`` to it)."""
    out: dict[str, dict] = {}
    name = None
    for line in text.splitlines():
        words = line.strip()
        if words.startswith("NodeName="):
            name = words.split()[0].split("=", 1)[1]
            out[name] = {"state": "", "reason": ""}
        elif name and words.startswith("Reason="):
            out[name]["reason"] = words[len("Reason="):].strip()
        elif name and words.startswith("State="):
            out[name]["state"] = words.split()[0].split("=", 1)[1]
    return out


def slurm_nodes(environ=None) -> dict[str, dict]:
    """Every node of the cluster with its state and reason."""
    return parse_nodes(_scontrol("show", "node", environ=environ))


def drain_argv(node: str, reason: str) -> list[str]:
    """The scontrol command that drains ``node`` with ``reason``."""
    return ["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"]


def slurm_drain(node: str, reason: str, environ=None) -> None:
    _scontrol(*drain_argv(node, reason)[1:], environ=environ)


def slurm_drain_all(reasons: dict[str, str], budget_s: float,
                    environ=None) -> dict[str, str | None]:
    """Drain each node with its reason, the calls side by side under one deadline (the
    other ranks wait for rank 0's verdict meanwhile): node -> None when drained, else why
    not (scontrol's last line, or the deadline)."""
    procs = {}
    for node, reason in reasons.items():
        try:
            procs[node] = subprocess.Popen(drain_argv(node, reason), stdin=subprocess.DEVNULL,
                                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                           text=True, env=environ)
        except OSError as e:  # no scontrol on this node
            procs[node] = e
    deadline = time.monotonic() + budget_s
    return {node: _finish(proc, deadline, budget_s) for node, proc in procs.items()}


def _finish(proc, deadline: float, budget_s: float) -> str | None:
    if isinstance(proc, OSError):
        return f"{type(proc).__name__}: {proc}"
    try:
        output, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return f"scontrol gave no answer within {budget_s:g} s"
    if proc.returncode == 0:
        return None
    return (output.strip().splitlines() or [f"scontrol exit {proc.returncode}"])[-1]


def slurm_resume(node: str, environ=None) -> None:
    _scontrol("update", f"NodeName={node}", "State=RESUME", environ=environ)


# -- Kubernetes ------------------------------------------------------------------------------

def label_node(node: str, labels: dict[str, str], annotations: dict[str, str],
               environ=os.environ, account: str = SERVICE_ACCOUNT) -> None:
    """Merge ``labels`` and ``annotations`` into the Node ``node`` (others stay as they are).

    Raises:
        ActError: not in a pod (no service account or server), or the server refused.
    """
    host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT")
    try:
        with open(os.path.join(account, "token")) as f:
            token = f.read().strip()
    except OSError as e:
        raise ActError(f"no service account token ({account}/token: {e.strerror}): not in a "
                       "pod, or automountServiceAccountToken is off") from None
    if not host or not port:
        raise ActError("KUBERNETES_SERVICE_HOST/_PORT unset: not in a pod")
    context = ssl.create_default_context(cafile=os.path.join(account, "ca.crt"))
    body = json.dumps({"metadata": {"labels": labels, "annotations": annotations}}).encode()
    url = f"https://{'[' + host + ']' if ':' in host else host}:{port}/api/v1/nodes/{node}"
    request = urllib.request.Request(url, data=body, method="PATCH", headers={
        "Authorization": f"Bearer {token}", "Content-Type": "application/merge-patch+json",
        "Accept": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=API_S, context=context) as answer:
            answer.read()
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:300]
        raise ActError(f"PATCH node {node}: HTTP {e.code}: {_message(detail)}") from None
    except (urllib.error.URLError, OSError) as e:
        raise ActError(f"PATCH node {node}: {getattr(e, 'reason', e)}") from None


def _message(body: str) -> str:
    """The API server's Status message, else the body as it came."""
    try:
        return str(json.loads(body).get("message") or body)
    except (ValueError, AttributeError):
        return body
