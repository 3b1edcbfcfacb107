"""Kubernetes manifests (issue 8): parse, schema, the issue's requirements, the operator's pods.

Layer 1, parse: ``kubectl label --local -f DIR x=y -o name`` decodes every manifest exactly as
``kubectl apply -f DIR`` will, offline, for ``k8s/`` and each variant folder.

Layer 2, schema, unknown fields rejected everywhere:

* core kinds (ConfigMap, Service, Job) against Kubernetes' own strict schemas
  (``kubernetes-validate``) at :data:`K8S_VERSIONS`;
* the PyTorchJob against the real CRD of Training Operator v1.9.4 (``tests/data``), converted as
  the API server's strict field validation reads it, plus the operator's webhook rules; its pod
  templates also against core PodSpec at :data:`K8S_VERSIONS`;
* the TrainJob and its TrainingRuntime against the real CRDs of Kubeflow Trainer v2.3.0
  (``tests/data``), converted the same way (their CEL rules are not evaluated);
* the operator's init-container template (``k8s/operator``) against core Container;
* any other kind is a failure, never a silent pass.

Then the issue's requirements (c10d, /dev/shm, GPUs, Istio, securityContext, deadlines, restart
policy, labels) on each variant, the typical mistakes that must fail, the embedded shell
scripts run against a fake torchrun, and unit tests of ``tests/k8s_operator.py``, which layer 3
uses to run each replica as a container.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests import k8s_check as kc, k8s_operator as ko
from tests.k8s_check import validate

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
FOLDERS = {"pytorchjob": K8S, "indexed-job": K8S / "indexed-job", "trainer-v2": K8S / "trainer-v2",
           "operator": K8S / "operator", "node-check": K8S / "node-check"}
DATA = REPO / "tests" / "data"
CRD = DATA / "kubeflow.org_pytorchjobs.yaml"
CRD_SHA256 = "8b8a8a719cc94173169290251e817f7ac2bb425c20b6c2fa813397bcf4e932ed"
# Kubeflow Trainer v2.3.0 CRDs: file -> (bytes, sha256); see tests/data/PROVENANCE.md.
TRAINER_CRDS = {
    "trainer.kubeflow.org_trainjobs.yaml": (
        554665, "a742cafc5b5582640c7e0b7467c024fc237256fbca5ba0a9f0531dfb66d64416"),
    "trainer.kubeflow.org_trainingruntimes.yaml": (
        926556, "69b8dbdf60a18e28cddcc2b8dfc4ce72a943e14b531b9389d593118faee4919f"),
}
K8S_VERSIONS = kc.K8S_VERSIONS
# From the worker's contract (.notes/CONTRACT.md): config keys and registered checks.
CONFIG_KEYS = {"report_dir", "checks", "timeout", "backend", "expect_nodes", "expect_world_size",
               "storage_dir", "fault", "expect_transport"}
CHECKS = {"environment", "ddp_step", "sampler_epochs", "collectives", "storage", "bandwidth",
          "transport", "rails", "compute", "training", "health"}
# Names the operator appends after the user's env: a user value would be silently overridden.
OPERATOR_ENV = re.compile(r"^(PET_.*|MASTER_ADDR|MASTER_PORT|WORLD_SIZE|RANK|PYTHONUNBUFFERED)$")
GPU = "nvidia.com/gpu"


# -- tools ----------------------------------------------------------------------------------------

def _kubectl() -> str:
    try:
        return kc.kubectl()
    except kc.ToolMissing as e:
        pytest.skip(str(e))


def _kv():
    return pytest.importorskip("kubernetes_validate", reason="kubernetes-validate missing: "
                               "install the test extra (`pip install -e '.[test]'`)")


# -- layer 1: kubectl decodes each folder ---------------------------------------------------------

def _kubectl_names(folder: Path) -> subprocess.CompletedProcess:
    _kubectl()
    return kc.kubectl_names(folder)


@pytest.mark.parametrize("variant", FOLDERS)
def test_kubectl_decodes_folder_as_apply_would(variant):
    proc = _kubectl_names(FOLDERS[variant])
    assert proc.returncode == 0, proc.stderr
    expected = []
    for doc in ko.load_manifests(FOLDERS[variant]):
        group = doc["apiVersion"].rpartition("/")[0]
        expected.append(f"{doc['kind'].lower()}{'.' + group if group else ''}/"
                        f"{doc['metadata']['name']}")
    assert proc.stdout.split() == expected  # kubectl and these tests read the same documents


def test_kubectl_refuses_a_non_manifest(tmp_path):
    shutil.copy(K8S / "00-ddp-smoke-config.yaml", tmp_path)
    (tmp_path / "kustomization.yaml").write_text("resources: [00-ddp-smoke-config.yaml]\n")
    assert _kubectl_names(tmp_path).returncode != 0  # layer 1 has teeth


def test_k8s_holds_only_manifests_and_the_known_variants():
    files = sorted(p.relative_to(K8S) for p in K8S.rglob("*") if p.is_file())
    assert files and all(p.suffix == ".yaml" for p in files), files
    assert {p.parent for p in files} == {Path("."), Path("indexed-job"), Path("trainer-v2"),
                                         Path("operator"), Path("node-check")}


@pytest.mark.parametrize("variant", FOLDERS)
def test_headers_name_version_and_command(variant):
    # tomllib would need Python 3.11; the project supports 3.10.
    version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(),
                        re.M).group(1)
    folder = FOLDERS[variant].relative_to(REPO)
    for path in sorted(FOLDERS[variant].glob("*.yaml")):
        head = path.read_text().splitlines()[:2]
        assert head[0].startswith(f"# ddp-smoke {version} — "), (path, head)
        assert f"kubectl apply -f {folder}" in head[1], (path, head)


def _k8s_check(*folders) -> subprocess.CompletedProcess:
    """What `make k8s-check [K8S_DIRS=…]` runs (issue 35: a user checks the manifests offline)."""
    _kv(), _kubectl()
    recipe = re.search(r"^k8s-check:.*\n\t@(.+)$", (REPO / "Makefile").read_text(), re.M)[1]
    assert recipe == "$(PY) -m tests.k8s_check $(K8S_DIRS)"
    return subprocess.run([sys.executable, "-m", "tests.k8s_check", *map(str, folders)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def test_k8s_check_passes_the_shipped_manifests_and_names_a_typo(tmp_path):
    listed = subprocess.run(["make", "-s", "help"], cwd=REPO, capture_output=True, text=True,
                            timeout=30).stdout
    assert re.search(r"^k8s-check +check the manifests in k8s/", listed, re.M), listed
    done = _k8s_check()
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1].startswith(
        "k8s-check: OK: k8s, k8s/indexed-job, k8s/trainer-v2, k8s/operator, k8s/node-check "
        "checked offline")
    for path in K8S.glob("*.yaml"):
        (tmp_path / path.name).write_text(path.read_text().replace(
            "activeDeadlineSeconds: 1800\n    # No retries",
            "activeDeadlineSecond: 1800\n    # No retries"))
    done = _k8s_check(tmp_path)
    assert done.returncode == 1 and "k8s-check: FAIL" in done.stdout, done.stdout
    assert f"{tmp_path}/10-ddp-smoke-pytorchjob.yaml: PyTorchJob/ddp-smoke: spec.runPolicy: " \
        "Additional properties are not allowed ('activeDeadlineSecond' was unexpected)" \
        in done.stdout, done.stdout
    daemonset = tmp_path / "node-check" / "10-ddp-smoke-node-check-daemonset.yaml"
    daemonset.parent.mkdir()
    daemonset.write_text((K8S / "node-check" / daemonset.name).read_text().replace(
        "serviceAccountName:", "serviceAccountNme:"))
    done = _k8s_check(daemonset.parent)
    assert done.returncode == 1 and f"{daemonset}: DaemonSet/ddp-smoke-node-check: [1.31] " \
        "spec.template.spec: Additional properties are not allowed ('serviceAccountNme' was " \
        "unexpected)" in done.stdout, done.stdout
    (tmp_path / "kustomization.yaml").write_text("resources: []\n")
    done = _k8s_check(tmp_path)
    assert done.returncode == 1 and "kubectl cannot read it" in done.stdout, done.stdout


# -- layer 2: schemas -----------------------------------------------------------------------------

def test_crd_copy_is_the_pinned_upstream_file():
    data = CRD.read_bytes()
    assert (len(data), hashlib.sha256(data).hexdigest()) == (644522, CRD_SHA256), \
        "tests/data/kubeflow.org_pytorchjobs.yaml changed: see tests/data/PROVENANCE.md"
    for name, pinned in TRAINER_CRDS.items():
        data = (DATA / name).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == pinned, \
            f"tests/data/{name} changed: see tests/data/PROVENANCE.md"


@pytest.mark.parametrize("variant", FOLDERS)
def test_every_document_validates(variant):
    docs = ko.load_manifests(FOLDERS[variant])
    assert docs
    assert {d["metadata"]["name"]: validate(d) for d in docs} == {
        d["metadata"]["name"]: [] for d in docs}


@pytest.mark.parametrize("doc", [
    {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}},
    {"apiVersion": "kubeflow.org/v1", "kind": "TFJob", "metadata": {"name": "t"}, "spec": {}},
    {"apiVersion": "v1", "kind": "Widget", "metadata": {"name": "w"}},
], ids=["custom", "other-kubeflow-kind", "unknown-core-kind"])
def test_unknown_kinds_fail(doc):
    _kv()
    assert validate(doc)


def _edited(path: Path, old: str, new: str) -> tuple[list[dict], dict]:
    """The folder of ``path`` as kubectl reads it, with ``old`` replaced by ``new`` in that file.

    Returns:
        All documents of the folder, and the edited file's last document.
    """
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} must occur once in {path.name}"
    edited = [d for d in yaml.safe_load_all(text.replace(old, new)) if d]
    docs = []
    for other in sorted(path.parent.glob("*.yaml")):
        docs += edited if other == path else ko.load_manifests_file(other)
    return docs, edited[-1]


JOB = K8S / "10-ddp-smoke-pytorchjob.yaml"
IJ = K8S / "indexed-job" / "20-ddp-smoke-job.yaml"
TJ = K8S / "trainer-v2" / "10-ddp-smoke-trainjob.yaml"
TR = K8S / "trainer-v2" / "00-ddp-smoke-runtime.yaml"
OP = K8S / "operator" / "pytorch-init-container.yaml"
MISTAKES = {
    "unquoted-nprocPerNode": (JOB, 'nprocPerNode: &gpus-per-node "8"',
                              "nprocPerNode: &gpus-per-node 8", "nprocPerNode"),
    "missing-Master-replicas": (JOB, "      # Must be written, and must be 1: the webhook rejects "
                                "a Master without `replicas`.\n      replicas: 1\n", "",
                                "Master].replicas"),
    "two-Masters": (JOB, "      replicas: 1\n      # Never", "      replicas: 2\n      # Never",
                    "Master].replicas"),
    "typo-in-runPolicy": (JOB, "    activeDeadlineSeconds: 1800\n    # No retries",
                          "    activeDeadlineSecond: 1800\n    # No retries",
                          "activeDeadlineSecond"),
    "typo-in-pod-template": (JOB, "enableServiceLinks: false", "enableServiceLink: false",
                             "enableServiceLink"),
    "typo-in-container": (JOB, "terminationMessagePolicy:", "terminationMessagePolicies:",
                          "terminationMessagePolicies"),
    "container-not-named-pytorch": (JOB, "- name: pytorch\n", "- name: main\n",
                                    "named 'pytorch'"),
    "lowercase-replica-type": (JOB, "    Worker:\n", "    worker:\n", "unsupported"),
    "indexed-job-typo": (IJ, "completionMode: Indexed", "completionmode: Indexed",
                         "completionmode"),
    "trainjob-typo": (TJ, "numProcPerNode: &gpus-per-node 8", "numProcsPerNode: &gpus-per-node 8",
                      "numProcsPerNode"),
    "trainjob-string-nproc": (TJ, "numProcPerNode: &gpus-per-node 8",
                              'numProcPerNode: &gpus-per-node "8"', "numProcPerNode"),
    "trainjob-unknown-trainer-field": (TJ, "    numNodes: 2 ", "    numNode: 2 ", "numNode"),
    "runtime-typo": (TR, "backoffLimitPerIndex: 0", "backoffLimitsPerIndex: 0",
                     "backoffLimitsPerIndex"),
    "runtime-typo-in-pod": (TR, "restartPolicy: Never", "restartpolicy: Never", "restartpolicy"),
    "runtime-jobset-typo": (TR, "        maxRestarts: 0", "        maxRestart: 0", "maxRestart"),
}


@pytest.mark.parametrize("name", MISTAKES)
def test_typical_mistakes_are_rejected(name):
    path, old, new, needle = MISTAKES[name]
    _kv()
    errors = validate(_edited(path, old, new)[1])
    assert any(needle in e for e in errors), errors


# -- the issue's requirements, and the traps the schema cannot see --------------------------------

def requirement_errors(docs: list[dict]) -> list[str]:
    """What the issue asks of every variant, beyond what the API server checks."""
    errors = []
    for doc in docs:
        name, kind = doc["metadata"]["name"], doc["kind"]
        labels = doc["metadata"].get("labels", {})
        if labels.get("app.kubernetes.io/name") != "ddp-smoke":
            errors.append(f"{kind} {name}: label app.kubernetes.io/name=ddp-smoke missing")
        if kind == "PyTorchJob":
            errors += _pytorchjob_requirements(doc)
        elif kind == "Job":
            errors += _job_requirements(doc, docs)
        elif kind == "TrainJob":
            errors += _trainjob_requirements(doc, docs)
        elif kind == "TrainingRuntime":
            errors += _runtime_requirements(doc)
        elif kind == "ConfigMap" and "initContainer.yaml" in doc["data"]:
            errors += _init_template_requirements(doc)
        elif kind == "ConfigMap":
            errors += _config_requirements(doc, docs)
    return errors


def _pytorchjob_requirements(job: dict) -> list[str]:
    spec, name = job["spec"], job["metadata"]["name"]
    run = spec.get("runPolicy", {})
    errors = [] if str(spec.get("nprocPerNode")).isdigit() else [
        f"nprocPerNode {spec.get('nprocPerNode')!r}: a count of processes (auto on CPU starts "
        "one per visible CPU)"]
    if (spec.get("elasticPolicy") or {}).get("standalone"):
        errors.append("elasticPolicy.standalone: true makes torchrun die parsing PET_STANDALONE=''")
    if not run.get("activeDeadlineSeconds") or run.get("backoffLimit") != 0:
        errors.append("runPolicy: activeDeadlineSeconds and backoffLimit: 0 are required")
    for rtype, rspec in spec["pytorchReplicaSpecs"].items():
        if rspec.get("restartPolicy") != "Never":
            errors.append(f"{rtype}.restartPolicy {rspec.get('restartPolicy')!r}: must be Never")
        pod_deadline = rspec["template"]["spec"].get("activeDeadlineSeconds")
        if run.get("cleanPodPolicy") not in ("All", "Running") and not pod_deadline:
            errors.append(f"{rtype} pod: activeDeadlineSeconds, or a hung pod outlives the job")
        errors += _pod_requirements(rspec["template"], name, "training.kubeflow.org/job-name",
                                    spec.get("nprocPerNode"))
    return errors


def _job_requirements(job: dict, docs: list[dict]) -> list[str]:
    spec, name = job["spec"], job["metadata"]["name"]
    env = {e["name"]: e.get("value") for e in spec["template"]["spec"]["containers"][0]["env"]}
    errors = _pod_requirements(spec["template"], name, "batch.kubernetes.io/job-name",
                               env.get("NPROC_PER_NODE"))
    if not (spec.get("completionMode") == "Indexed"
            and spec.get("completions") == spec.get("parallelism") == int(env["NNODES"])):
        errors.append("Indexed, with completions = parallelism = NNODES (all pods at once)")
    if not spec.get("activeDeadlineSeconds"):
        errors.append("activeDeadlineSeconds is required")
    if spec.get("backoffLimitPerIndex") != 0 or "backoffLimit" in spec:
        errors.append("backoffLimitPerIndex: 0 and no backoffLimit: backoffLimit 0 fails the Job "
                      "at the first failed pod and deletes the others, rank 0's report with them")
    if spec["template"]["spec"].get("restartPolicy") != "Never":
        errors.append("template restartPolicy must be Never")
    sub = spec["template"]["spec"].get("subdomain")
    svc = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == sub]
    if not svc or not svc[0]["spec"].get("publishNotReadyAddresses") \
            or svc[0]["spec"].get("clusterIP") != "None":
        errors.append(f"subdomain {sub!r}: needs a headless Service of that name with "
                      "publishNotReadyAddresses: true")
    if env.get("RDZV_ENDPOINT", "").split(":")[0] != f"{name}-0.{sub}":
        errors.append(f"RDZV_ENDPOINT {env.get('RDZV_ENDPOINT')!r}: must name {name}-0.{sub}")
    return errors


def _trainjob_requirements(job: dict, docs: list[dict]) -> list[str]:
    trainer, name = job["spec"]["trainer"], job["metadata"]["name"]
    script = trainer["args"][0]
    errors = (_pod_call_errors(trainer["command"], trainer["args"])
              + _node_name_errors(trainer.get("env", [])) + _secret_errors(trainer.get("env", [])))
    env = {e["name"]: e for e in trainer.get("env", [])}
    run_id = env.get("DDP_SMOKE_RUN_ID", {}).get("value", "")
    if not (run_id.startswith(name) and "$(JOB_UID)" in run_id
            and "controller-uid" in str(env.get("JOB_UID"))):
        errors.append(f"DDP_SMOKE_RUN_ID {run_id!r}: the TrainJob's name and its Job's uid")
    if trainer["resourcesPerNode"]["limits"].get(GPU) != trainer["numProcPerNode"]:
        errors.append("numProcPerNode must equal the nvidia.com/gpu limit")
    if not job["spec"].get("activeDeadlineSeconds"):
        errors.append("activeDeadlineSeconds is required")
    if "storage" in script.replace("--storage", ""):
        errors.append("storage check without a shared directory")
    ref = job["spec"]["runtimeRef"]
    runtimes = [d for d in docs if d["kind"] == ref.get("kind")
                and d["metadata"]["name"] == ref["name"]]
    if ref.get("kind") != "TrainingRuntime" or not runtimes:
        errors.append(f"runtimeRef {ref}: must name this folder's TrainingRuntime (the stock "
                      "torch-distributed retries failures and has no /dev/shm)")
    return errors


def _runtime_requirements(runtime: dict) -> list[str]:
    """The TrainingRuntime: nothing retried, /dev/shm in memory, the restricted PSS."""
    jobset = runtime["spec"]["template"]["spec"]
    errors = [] if (jobset.get("failurePolicy") or {}).get("maxRestarts") == 0 else [
        "JobSet failurePolicy.maxRestarts: 0"]
    (rjob,) = jobset["replicatedJobs"]
    job = rjob["template"]["spec"]
    if rjob["name"] != "node" or rjob["template"].get("metadata", {}).get("labels", {}).get(
            "trainer.kubeflow.org/trainjob-ancestor-step") != "trainer":
        errors.append("replicated job `node` labelled trainjob-ancestor-step: trainer")
    if not (job.get("completionMode") == "Indexed" and job.get("backoffLimitPerIndex") == 0
            and "backoffLimit" not in job):
        errors.append("Job: Indexed, backoffLimitPerIndex: 0, no backoffLimit")
    pod, meta = job["template"]["spec"], job["template"].get("metadata", {})
    if pod.get("restartPolicy") != "Never":
        errors.append("pod restartPolicy must be Never (JobSet's default is OnFailure)")
    (container,) = pod["containers"]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    shm = [m for m in container.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
    if not shm or (volumes[shm[0]["name"]].get("emptyDir") or {}).get("medium") != "Memory":
        errors.append("/dev/shm must be an emptyDir of medium Memory")
    if not (meta.get("labels", {}).get("sidecar.istio.io/inject")
            == meta.get("annotations", {}).get("sidecar.istio.io/inject") == "false"):
        errors.append("sidecar.istio.io/inject: \"false\" as label and annotation")
    return errors + _security_errors(pod.get("securityContext", {}),
                                     container.get("securityContext", {}))


def render_init_template(text: str, image: str = "alpine:3.10", master: str = "j-master-0",
                         tries: int = 900) -> list[dict]:
    """The operator's init-container template filled in as the operator does (Go template
    fields .InitContainerImage, .MasterAddr, .MaxTries), parsed as its YAML list."""
    for field, value in (("InitContainerImage", image), ("MasterAddr", master),
                         ("MaxTries", tries)):
        text = text.replace("{{." + field + "}}", str(value))
    assert "{{" not in text, f"template uses fields the operator does not fill: {text}"
    return yaml.safe_load(text)


def _init_template_requirements(cm: dict) -> list[str]:
    containers = render_init_template(cm["data"]["initContainer.yaml"])
    errors = []
    for version in K8S_VERSIONS:
        container = kc.validator(kc.core_schema("io.k8s.api.core.v1.Container"), version)
        errors += [f"[{version} init container] {e}" for c in containers
                   for e in kc.errors_of(container, c)]
    for c in containers:
        errors += _security_errors({}, c.get("securityContext", {}))
        if "seq 900" not in " ".join(c.get("command", [])):
            errors.append("the init container must use the operator's MaxTries")
    return errors


def _node_name_errors(env: list[dict]) -> list[str]:
    """The worker names a pod's node (what an operator drains) from NODE_NAME; a pod's
    hostname is the pod's name."""
    source = next((e.get("valueFrom") for e in env if e["name"] == "NODE_NAME"), None)
    return [] if source == {"fieldRef": {"fieldPath": "spec.nodeName"}} else [
        "env NODE_NAME from fieldRef spec.nodeName: the report must name the node to drain"]


def _pod_requirements(template: dict, job: str, job_label: str, nproc) -> list[str]:
    pod, meta = template["spec"], template.get("metadata", {})
    (container,) = pod["containers"]
    errors = _pod_call_errors(container["command"], container["args"]) + [
        f"env {e['name']}: the operator appends its own value after env:, which wins"
        for e in container.get("env", []) if OPERATOR_ENV.match(e["name"])]
    if not (meta.get("labels", {}).get("sidecar.istio.io/inject")
            == meta.get("annotations", {}).get("sidecar.istio.io/inject") == "false"):
        errors.append("sidecar.istio.io/inject: \"false\" as label and annotation")
    if meta.get("labels", {}).get("app.kubernetes.io/instance") != job:
        errors.append(f"pod label app.kubernetes.io/instance must be {job}")
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    shm = [m for m in container.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
    if not shm or (volumes[shm[0]["name"]].get("emptyDir") or {}).get("medium") != "Memory" \
            or not volumes[shm[0]["name"]]["emptyDir"].get("sizeLimit"):
        errors.append("/dev/shm must be a bounded emptyDir of medium Memory")
    res = container.get("resources", {})
    # a quantity: 8 or "8" (the manifests alias the GPU count to the quoted process count)
    if not (str(nproc).isdigit() and str(res.get("limits", {}).get(GPU)) == str(int(nproc))
            and all(res.get("requests", {}).get(k) for k in ("cpu", "memory", GPU))):
        errors.append("requests cpu, memory, nvidia.com/gpu; gpu limit = processes per pod")
    errors += _security_errors(pod.get("securityContext", {}), container.get("securityContext", {}))
    errors += _node_name_errors(container.get("env", [])) + _secret_errors(container.get("env", []))
    terms = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    if terms[0]["labelSelector"]["matchLabels"] != {job_label: job} \
            or terms[0]["topologyKey"] != "kubernetes.io/hostname":
        errors.append(f"anti-affinity must select {job_label}={job} per kubernetes.io/hostname")
    reports = volumes.get("reports", {})
    if "emptyDir" not in reports and "persistentVolumeClaim" not in reports:
        errors.append("a `reports` volume (emptyDir, or a PVC) must hold the report")
    return errors


def _security_errors(pod_sc: dict, sc: dict) -> list[str]:
    eff = {**pod_sc, **sc}
    ok = (eff.get("runAsNonRoot") is True and isinstance(eff.get("runAsUser"), int)
          and eff["runAsUser"] > 0 and sc.get("allowPrivilegeEscalation") is False
          and not sc.get("privileged") and "ALL" in sc.get("capabilities", {}).get("drop", [])
          and eff.get("seccompProfile", {}).get("type") == "RuntimeDefault")
    return [] if ok else ["securityContext: non-root (numeric user), no privilege escalation, "
                          "capabilities drop ALL, seccomp RuntimeDefault"]


POD_SCRIPT = REPO / "docker" / "pod.sh"
IN_IMAGE = "/opt/ddp-smoke/pod.sh"  # where docker/Dockerfile puts it
POD_OPTIONS = ("--nnodes=", "--nproc-per-node=", "--rdzv-endpoint=", "--node-rank=",
               "--report-dir=")


def _pod_call_errors(command: list[str], args: list[str]) -> list[str]:
    """Issue 31: every variant runs the image's one pod script with its own five values."""
    call = " ".join([*command, *args])
    errors = [] if command == ["sh", "-c"] and len(args) == 1 and args[0].startswith(
        f"exec bash {IN_IMAGE} ") else [f"command: sh -c 'exec bash {IN_IMAGE} …' (the image's "
                                        "pod script, docker/pod.sh)"]
    return errors + [f"the pod script needs {o}…" for o in POD_OPTIONS if o not in call]


def _pod_script_errors(script: str) -> list[str]:
    """What docker/pod.sh must do in every pod: c10d torchrun under the store host, preflight
    first, signals passed on, the verdict as the termination message."""
    flags = ("--rdzv-backend=c10d", "--rdzv-endpoint=", '--rdzv-id="$DDP_SMOKE_RUN_ID"',
             "--max-restarts=0", "read_timeout=600", "join_timeout=600",
             "--local-addr=", "-m ddp_smoke", "--expect-nodes=", "--expect-world-size=",
             "--report-dir=")
    errors = [f"torchrun needs {f}" for f in flags if f not in script]
    if not re.search(r"^\s*trap '[^']*kill -TERM[^']*' TERM", script, re.M):
        errors.append("bash is PID 1 and ignores SIGTERM: trap it and pass it on to torchrun")
    if "python3 -m ddp_smoke last-line" not in script or '"$msg_file"' not in script:
        errors.append("write the one-line verdict to the termination message file")
    # ("${store[@]}": the store host and its options on the pod that hosts it, nothing on the
    # others)
    launches = [ln for ln in script.splitlines()
                if ln.strip().removeprefix('"${store[@]}" ').startswith("torchrun")]
    if len(launches) != 1 or "--standalone" in script:
        errors.append("exactly one torchrun per pod, never --standalone")
    # Issue 24: the kit's store outlives rank 0 (and its node's torchrun agent) only in a
    # process of its own, which runs torchrun as its child on the rendezvous host's pod.
    if not (re.search(r"store=\(python3 -m ddp_smoke\.store_host --host \S+ --port .+\n\s*"
                      r"--report-dir \S+ --\)$", script, re.M)
            and "export DDP_SMOKE_STORE" in script
            and any(ln.strip().startswith('"${store[@]}" torchrun') for ln in launches)):
        errors.append("start the store host (python3 -m ddp_smoke.store_host … -- torchrun) on "
                      "the rendezvous host's pod and export DDP_SMOKE_STORE in every pod")
    # Issue 28: preflight before torchrun, the rendezvous host listening for every pod's hello.
    preflight = script.find("python3 -m ddp_smoke preflight --rdzv ")
    if not (0 <= preflight < script.find("torchrun \\")
            and all(f in script for f in ("--serve", "--nodes ", '> "$msg_file"'))):
        errors.append("run preflight (python3 -m ddp_smoke preflight --rdzv … --nodes …, the "
                      "rendezvous host with --serve) before torchrun, its line as the "
                      "termination message when it fails")
    return errors


def test_the_pod_script_does_what_every_pod_needs():
    assert _pod_script_errors(POD_SCRIPT.read_text()) == []
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    assert f"COPY docker/pod.sh {IN_IMAGE}" in dockerfile
    assert "!docker/pod.sh" in (REPO / ".dockerignore").read_text().splitlines()


def _secret_errors(env: list[dict]) -> list[str]:
    """Issue 27: every pod of a run gets the same signing secret, from a Secret (which other
    users cannot read), optional so that a job without one still runs (unsigned, said so)."""
    source = next((e.get("valueFrom") for e in env if e["name"] == "DDP_SMOKE_SECRET"), None)
    ref = (source or {}).get("secretKeyRef", {})
    return [] if ref.get("name") and ref.get("key") and ref.get("optional") is True else [
        "env DDP_SMOKE_SECRET from secretKeyRef (optional: true): the run's signing secret"]


def _config_requirements(cm: dict, docs: list[dict]) -> list[str]:
    config = yaml.safe_load(cm["data"]["config.yaml"])
    errors = [f"config key {k!r} is not in the worker's contract"
              for k in set(config) - CONFIG_KEYS]
    errors += [f"check {c!r} is not registered" for c in set(config["checks"]) - CHECKS]
    shared = any("persistentVolumeClaim" in v for d in docs for v in _volumes(d))
    if ("storage" in config["checks"]) != shared:
        errors.append("`storage` belongs in the checks exactly when /reports is a shared PVC")
    return errors


def _volumes(doc: dict) -> list[dict]:
    if doc["kind"] == "PyTorchJob":
        return [v for r in doc["spec"]["pytorchReplicaSpecs"].values()
                for v in r["template"]["spec"].get("volumes", [])]
    return doc["spec"]["template"]["spec"].get("volumes", []) if doc["kind"] == "Job" else []


@pytest.mark.parametrize("variant", FOLDERS)
def test_requirements_of_the_issue(variant):
    assert requirement_errors(ko.load_manifests(FOLDERS[variant])) == []


TRAPS = {
    "standalone": (JOB, "  runPolicy:\n", "  elasticPolicy: {standalone: true}\n  runPolicy:\n",
                   "standalone"),
    "nproc-auto": (JOB, 'nprocPerNode: &gpus-per-node "8"',
                   'nprocPerNode: &gpus-per-node "auto"', "nprocPerNode"),
    "operator-env-in-env": (JOB, "- name: TORCH_NCCL_ASYNC_ERROR_HANDLING\n",
                            "- name: MASTER_ADDR\n", "MASTER_ADDR"),
    "no-read-timeout": (POD_SCRIPT, "join_timeout=600,read_timeout=600", "join_timeout=600",
                        "read_timeout"),
    "no-signal-forwarding": (POD_SCRIPT, "trap 'kill -TERM \"$pid\" 2> /dev/null' TERM INT",
                             ":", "SIGTERM"),
    "ij-backoff-limit-0": (IJ, "backoffLimitPerIndex: 0", "backoffLimit: 0",
                           "backoffLimitPerIndex"),
    "trainjob-stock-runtime": (TJ, "kind: TrainingRuntime\n    name: ddp-smoke-torch",
                               "kind: ClusterTrainingRuntime\n    name: torch-distributed",
                               "runtimeRef"),
    "runtime-on-failure": (TR, "restartPolicy: Never", "restartPolicy: OnFailure",
                           "restartPolicy"),
    "runtime-no-shm": (TR, "                      volumeMounts:\n                        - name: "
                       "dshm\n                          mountPath: /dev/shm\n", "", "/dev/shm"),
    "runtime-backoff": (TR, "backoffLimitPerIndex: 0", "backoffLimit: 6", "backoffLimitPerIndex"),
    "init-container-privileged": (OP, "        allowPrivilegeEscalation: false\n", "",
                                  "securityContext"),
    "restart-on-failure": (JOB, "first node)\n      restartPolicy: Never",
                           "first node)\n      restartPolicy: OnFailure", "restartPolicy"),
    "no-deadline": (JOB, "    activeDeadlineSeconds: 1800\n    # No", "    # No",
                    "activeDeadlineSeconds"),
    "no-pod-deadline": (JOB, "          activeDeadlineSeconds: 1800\n", "",
                        "activeDeadlineSeconds"),
    # the GPU limit is an alias of nprocPerNode: a mismatch takes an edit of the limit itself
    "gpu-mismatch": (JOB, "memory: *memory\n                  nvidia.com/gpu: *gpus-per-node",
                     "memory: *memory\n                  nvidia.com/gpu: 4", "gpu"),
    "privileged": (JOB, "privileged: false", "privileged: true", "securityContext"),
    "standalone-torchrun": (POD_SCRIPT, "--rdzv-backend=c10d \\", "--standalone \\",
                            "torchrun"),
    "ij-parallelism": (IJ, "parallelism: *nodes", "parallelism: 1", "parallelism"),
    "no-node-name": (TJ, "fieldPath: spec.nodeName", "fieldPath: metadata.name", "NODE_NAME"),
    "no-store-host": (POD_SCRIPT, '"${store[@]}" torchrun', "torchrun", "store host"),
    "no-preflight": (POD_SCRIPT, 'python3 -m ddp_smoke preflight --rdzv', "true --rdzv",
                     "preflight"),
    "own-script": (IJ, "exec bash /opt/ddp-smoke/pod.sh", "exec bash /opt/my-pod.sh",
                   "docker/pod.sh"),
    "no-node-rank": (JOB, '--node-rank="${PET_NODE_RANK}"\n', "", "--node-rank"),
    "secret-required": (JOB, "                      optional: true\n", "", "DDP_SMOKE_SECRET"),
    "ij-not-published": (K8S / "indexed-job" / "10-ddp-smoke-service.yaml",
                         "publishNotReadyAddresses: true", "publishNotReadyAddresses: false",
                         "publishNotReadyAddresses"),
}


@pytest.mark.parametrize("name", TRAPS)
def test_traps_of_the_reference_are_caught(name):
    path, old, new, needle = TRAPS[name]
    if path == POD_SCRIPT:
        text = path.read_text()
        assert text.count(old) == 1, f"{old!r} must occur once in {path.name}"
        errors = _pod_script_errors(text.replace(old, new))
    else:
        docs, doc = _edited(path, old, new)
        errors = requirement_errors(docs) + (validate(doc) if name == "standalone" else [])
    assert any(needle in e for e in errors), errors


def test_customized_manifests_still_validate():
    """The README's edits (image, nodes, GPUs, report PVC) keep every variant valid."""
    _kv()
    for variant, folder in FOLDERS.items():
        docs = ko.customize(ko.load_manifests(folder), image="example.org/x:1", nodes=4,
                            gpus_per_node=4, reports_claim="reports")
        assert {d["metadata"]["name"]: validate(d) for d in docs} == {
            d["metadata"]["name"]: [] for d in docs}, variant
        assert requirement_errors(docs) == [], variant


# -- the pod script, run as each variant's pods call it ----------------------------------------

def _calls() -> dict[str, str]:
    """Each variant's one-line call of the pod script (the sh -c argument)."""
    out = {}
    for variant, folder in FOLDERS.items():
        for doc in ko.load_manifests(folder):
            if doc["kind"] == "TrainJob":
                out[variant] = doc["spec"]["trainer"]["args"][0]
            elif doc["kind"] in ("PyTorchJob", "Job"):
                out[variant] = ko.compute_pods([doc] + ko.load_manifests(folder), pod_ips={
                    n: "10.0.0.1" for n in ko.pod_names([doc])})[0].argv[2]
    return out


def here(argv: list[str], tmp_path: Path, pod: ko.Pod | None = None) -> list[str]:
    """A pod's argv run on this machine: the image's pod script is the checkout's, and the
    ConfigMap the kubelet mounts at /etc/ddp-smoke is a folder of its files under tmp_path."""
    etc = tmp_path / "etc-ddp-smoke"
    for mount in pod.mounts if pod else []:
        if mount.kind == "configMap" and mount.path == "/etc/ddp-smoke":
            etc.mkdir(exist_ok=True)
            for name, text in mount.files.items():
                (etc / name).write_text(text)
    return [a.replace(IN_IMAGE, str(POD_SCRIPT)).replace("/etc/ddp-smoke/", f"{etc}/")
            for a in argv]


@pytest.mark.parametrize("variant", ["pytorchjob", "indexed-job", "trainer-v2"])
def test_calls_are_posix_sh(variant, tmp_path):
    call = _calls()[variant]
    assert "$(" not in call.replace("$((", ""), "kubelet would expand $(...) before sh runs"
    assert subprocess.run(["sh", "-n", "-c", call], capture_output=True).returncode == 0
    shellcheck = shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if shellcheck:
        (tmp_path / "s.sh").write_text(call)
        proc = subprocess.run([shellcheck, "-s", "sh", str(tmp_path / "s.sh")],
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout


def test_the_pod_script_is_shellcheck_clean():
    shellcheck = shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if not shellcheck:
        pytest.skip("shellcheck missing: pip install -e '.[test]'")
    proc = subprocess.run([shellcheck, str(POD_SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


FAKE_TORCHRUN = """#!/usr/bin/env python3
import json, os, sys
out = os.environ["FAKE_OUT"]
json.dump(sys.argv[1:], open(out, "w"))
json.dump(os.environ.get("DDP_SMOKE_STORE"), open(out + ".store", "w"))
report = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--report-dir=")][0]
os.makedirs(report, exist_ok=True)
json.dump({"verdict": "fail", "culprits": [{"rank": 3}]}, open(report + "/report.json", "w"),
          indent=2)
sys.exit(int(os.environ["FAKE_RC"]))
"""


def _run_pod(pod: ko.Pod, tmp_path: Path, rc: int = 1):
    """Run a pod's argv with its env, torchrun replaced by a recorder, /reports under tmp."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "torchrun").write_text(FAKE_TORCHRUN)
    (bin_dir / "torchrun").chmod(0o755)
    # The venv's python3 first: the script runs `python3 -m ddp_smoke last-line`.
    env = {**pod.env, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "FAKE_RC": str(rc), "FAKE_OUT": str(tmp_path / f"{pod.name}.json"),
           "DDP_SMOKE_PREFLIGHT": "0",  # about torchrun's argv; preflight has its own test
           "TERMINATION_LOG": str(tmp_path / f"{pod.name}.termination-log")}
    if "REPORT_DIR" in env:
        env["REPORT_DIR"] = str(tmp_path / env["REPORT_DIR"].lstrip("/"))
    proc = subprocess.run(here(pod.argv, tmp_path, pod), env=env, capture_output=True,
                          text=True, timeout=60)
    return proc, json.loads((tmp_path / f"{pod.name}.json").read_text())


@pytest.mark.planted_report  # FAKE_TORCHRUN's, not the kit's
def test_pytorchjob_pods_run_c10d_torchrun_and_log_the_report(tmp_path):
    docs = ko.load_manifests(K8S)
    pods = ko.compute_pods(docs, pod_ips={"ddp-smoke-master-0": "10.9.0.2",
                                          "ddp-smoke-worker-0": "10.9.0.3"})
    proc, argv = _run_pod(pods[1], tmp_path, rc=1)
    assert argv == ["--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=c10d",
                    "--rdzv-endpoint=ddp-smoke-master-0:29400", "--rdzv-id=ddp-smoke",
                    "--rdzv-conf=join_timeout=600,read_timeout=600,is_host=0",
                    "--max-restarts=0",
                    "--local-addr=10.9.0.3", "-m", "ddp_smoke",
                    f"--config={tmp_path}/etc-ddp-smoke/config.yaml",
                    f"--report-dir={tmp_path}/reports/ddp-smoke", "--expect-nodes=2",
                    "--expect-world-size=16"]
    assert proc.returncode == 1, proc.stderr  # torchrun's status, after the report was logged
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("ddp-smoke-report.json: ")]
    assert json.loads(line.split(": ", 1)[1])["verdict"] == "fail"
    message = (tmp_path / f"{pods[1].name}.termination-log").read_text()
    assert message.startswith("ddp-smoke FAIL · run ? · ") and "\n" not in message.strip()
    assert proc.stdout.splitlines()[-1] == message.strip()  # the log ends on the verdict


@pytest.mark.planted_report  # the fake torchrun's, written while it runs on
def test_a_trainjob_pod_logs_the_report_once_as_soon_as_it_is_written(tmp_path):
    """A TrainJob's users read the report in the log alone, and torchrun's agents may wait
    minutes after it is written (a node cut off: their rendezvous and exit-barrier timeouts):
    the pod logs it within a second or two of its writing, while torchrun still runs, and
    once only."""
    docs = ko.customize(ko.load_manifests(K8S / "trainer-v2"), nodes=1, gpus_per_node=0,
                        nproc_per_node=1)
    pod = ko.compute_pods(docs, pod_ips={n: "127.0.0.1" for n in ko.pod_names(docs)})[0]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    written, ended = tmp_path / "written", tmp_path / "ended"  # the fake torchrun's times
    (bin_dir / "torchrun").write_text(
        "#!/bin/sh\nfor a; do case $a in --report-dir=*) d=${a#*=};; esac; done\n"
        f"date +%s.%N > {written}\n"
        "mkdir -p \"$d\" && echo '{\"verdict\": \"fail\"}' > \"$d/report.json\"\nsleep 8\n"
        f"touch {ended}\nexit 1\n")
    (bin_dir / "torchrun").chmod(0o755)
    run_id = f"ddp-smoke-v2-{tmp_path.name}"
    env = {**pod.env, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "DDP_SMOKE_PREFLIGHT": "0", "DDP_SMOKE_RUN_ID": run_id,
           "TERMINATION_LOG": str(tmp_path / "msg")}
    proc = subprocess.Popen(here(pod.argv, tmp_path, pod), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        first = next(ln for ln in proc.stdout if ln.startswith("ddp-smoke-report.json: "))
        # (from the report's writing, not the pod's start: a loaded rehearsal's pod took
        # seconds to reach torchrun, and the log came 8.3 s after its start)
        logged_s, running = time.time() - float(written.read_text()), not ended.exists()
        rest = proc.stdout.read()
    finally:
        proc.kill() if proc.poll() is None else None
        proc.wait(30)
        shutil.rmtree(f"/tmp/ddp-smoke-reports/{run_id}", ignore_errors=True)
    assert running and logged_s < 6, logged_s  # torchrun runs 8 s on
    assert json.loads(first.split(": ", 1)[1]) == {"verdict": "fail"}
    assert "ddp-smoke-report.json" not in rest and proc.returncode == 1, rest


@pytest.mark.planted_report  # a stale one, which the script must remove
def test_a_stale_report_is_never_logged_as_this_runs(tmp_path):
    """A report.json left on a shared volume by an earlier job of the same name is removed
    before torchrun starts: a run whose rank 0 died early logs no report, not the old one."""
    docs = ko.load_manifests(K8S)
    pod = ko.compute_pods(docs, pod_ips={"ddp-smoke-master-0": "10.9.0.2",
                                         "ddp-smoke-worker-0": "10.9.0.3"})[0]
    stale = tmp_path / "reports" / "ddp-smoke" / "report.json"
    stale.parent.mkdir(parents=True)
    stale.write_text(json.dumps({"verdict": "pass"}))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text("#!/bin/sh\nexit 1\n")  # rank 0 dies before writing
    (bin_dir / "torchrun").chmod(0o755)
    # (the venv's python3: the Master runs the store host, which finds no rank and no report)
    env = {**pod.env, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "DDP_SMOKE_PREFLIGHT": "0",
           "REPORT_DIR": str(stale.parent), "TERMINATION_LOG": str(tmp_path / "msg")}
    proc = subprocess.run(here(pod.argv, tmp_path, pod), env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1 and "ddp-smoke-report.json" not in proc.stdout, proc.stdout
    assert not stale.exists()
    assert "no report in this pod" in (tmp_path / "msg").read_text()


def _rendezvous_host(variant: str, port: int, tmp_path: Path) -> tuple[list[str], dict]:
    """argv and env of the pod that hosts the rendezvous, at 127.0.0.1:``port`` (cluster DNS,
    offline), its report folder under ``tmp_path`` (the TrainJob's is fixed, in the pod's
    /tmp, under its run id)."""
    docs = ko.load_manifests(FOLDERS[variant])
    if variant == "trainer-v2":
        host = ko.compute_pods(docs, pod_ips={n: "127.0.0.1" for n in ko.pod_names(docs)},
                               job_uid=tmp_path.name)[0]
        env = {**host.env, "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port)}
        return here(host.argv, tmp_path, host), env
    host = ko.compute_pods(docs, pod_ips={n: "127.0.0.1" for n in ko.pod_names(docs)})[0]
    env = {**host.env, "REPORT_DIR": str(tmp_path / "reports"),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "RDZV_ENDPOINT": f"127.0.0.1:{port}"}
    return here(host.argv, tmp_path, host), env


@pytest.mark.parametrize("variant", ["pytorchjob", "indexed-job", "trainer-v2"])
def test_rendezvous_host_names_the_node_ranks_that_never_joined(variant, tmp_path):
    """The other pod never starts (Pending, no image): the rendezvous host's preflight (the
    Master, index 0, node 0) waits its timeout for the hello, then stops before torchrun with
    a termination message that names node rank 1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    host_argv, env = _rendezvous_host(variant, port, tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text("#!/bin/sh\necho torchrun ran; exit 1\n")
    (bin_dir / "torchrun").chmod(0o755)
    env.update({"PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
                "DDP_SMOKE_PREFLIGHT_TIMEOUT": "4", "TERMINATION_LOG": str(tmp_path / "msg")})
    fixed = Path(f"/tmp/ddp-smoke-reports/ddp-smoke-v2-{tmp_path.name}")  # the TrainJob's
    folder = fixed if variant == "trainer-v2" else Path(env["REPORT_DIR"])
    try:
        proc = subprocess.run(host_argv, env=env, capture_output=True, text=True, timeout=60)
        # the pod's own preflight error file: on a volume every pod shares, one file for all
        # was truncated by each pod's preflight and tailed into another pod's message
        said = (folder / "launch" / f"{socket.gethostname()}.preflight.err").read_text()
    finally:
        shutil.rmtree(fixed, ignore_errors=True)
    assert proc.returncode == 1 and "torchrun ran" not in proc.stdout, proc.stdout + proc.stderr
    assert not (folder / "preflight.err").exists()
    message = (tmp_path / "msg").read_text().strip()
    assert said.rstrip().splitlines()[-1] == message, (said, message)
    assert message.startswith("ddp-smoke preflight: ") and " FAIL · " in message, message
    assert "joined: node rank(s) 1 never joined within 4 s: 1 of 2 said hello" in message, message
    assert "\n" not in message


@pytest.mark.planted_report  # FAKE_TORCHRUN's, not the kit's
def test_indexed_job_pods_say_who_hosts_the_store(tmp_path):
    docs = ko.load_manifests(K8S / "indexed-job")
    names = ko.pod_names(docs)
    pods = ko.compute_pods(docs, pod_ips={n: f"10.9.0.{i + 2}" for i, n in enumerate(names)})
    for pod in pods:
        proc, argv = _run_pod(pod, tmp_path, rc=0)
        assert proc.returncode == 0, proc.stderr
        assert (f"--rdzv-conf=join_timeout=600,read_timeout=600,is_host={int(pod.index == 0)}"
                in argv)
        assert "--rdzv-endpoint=ddp-smoke-indexed-0.ddp-smoke-indexed:29400" in argv
        # The run id: the Job's name and uid, the same in every pod of the Job.
        run_id = f"ddp-smoke-indexed-{pods[0].labels['batch.kubernetes.io/controller-uid']}"
        assert "--expect-world-size=16" in argv and f"--rdzv-id={run_id}" in argv
        assert f"--report-dir={tmp_path}/reports/{run_id}" in argv
        # Every pod is told where the kit's store is; index 0 serves it (torchrun its child).
        store = "ddp-smoke-indexed-0.ddp-smoke-indexed:29401"
        assert json.loads((tmp_path / f"{pod.name}.json.store").read_text()) == store
        served = f"serving the coordination store at {store} " in proc.stderr
        assert served == (pod.index == 0), proc.stderr


@pytest.mark.parametrize("variant", ["pytorchjob", "indexed-job"])
def test_a_misspelt_configmap_is_one_line_and_exit_2_before_anything_starts(variant, tmp_path):
    """A check misspelt in the ConfigMap is said once by the pod, before preflight and torchrun
    (found by the fault campaign's first PyTorchJob cells: a report folder that cannot be
    written ended as every rank's error under torchrun's traceback, the pod's status 1)."""
    docs = ko.load_manifests(FOLDERS[variant])
    (config,) = [d for d in docs if d["kind"] == "ConfigMap"]
    config["data"]["config.yaml"] = config["data"]["config.yaml"].replace(
        "checks: [environment,", "checks: [enviroment,")
    pod = ko.compute_pods(docs, pod_ips={n: "10.9.0.2" for n in ko.pod_names(docs)})[0]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("torchrun", "nvidia-smi"):  # neither may run
        (bin_dir / tool).write_text(f"#!/bin/sh\necho {tool} ran\n")
        (bin_dir / tool).chmod(0o755)
    env = {**pod.env, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "TERMINATION_LOG": str(tmp_path / "msg"), "REPORT_DIR": str(tmp_path / "r")}
    proc = subprocess.run(here(pod.argv, tmp_path, pod), env=env, capture_output=True,
                          text=True, timeout=60)
    (line,) = [ln for ln in proc.stderr.splitlines() if "error" in ln]
    assert proc.returncode == 2 and "enviroment" in line, proc.stdout + proc.stderr
    assert line.startswith("ddp-smoke: error: ") and " ran" not in proc.stdout, proc.stdout
    assert (tmp_path / "msg").read_text().strip() == line


def test_indexed_job_pod_beyond_nnodes_is_one_line_and_exit_2(tmp_path):
    """completions raised without NNODES: the extra pod says so once, starts nothing."""
    docs = ko.load_manifests(K8S / "indexed-job")
    docs[[d.get("kind") for d in docs].index("Job")]["spec"]["completions"] = 3
    names = ko.pod_names(docs)
    pod = ko.compute_pods(docs, pod_ips={n: f"10.9.0.{i + 2}" for i, n in enumerate(names)})[2]
    env = {**pod.env, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "TERMINATION_LOG": str(tmp_path / "msg"), "REPORT_DIR": str(tmp_path / "r")}
    proc = subprocess.run(here(pod.argv, tmp_path, pod), env=env, capture_output=True,
                          text=True, timeout=60)
    line = ("ddp-smoke: error: pod of node rank 2 but --nnodes=2: the job starts more pods "
            "than its node count (Indexed Job: set completions and NNODES to the same number)")
    assert proc.returncode == 2 and proc.stderr.strip() == line, proc.stderr
    assert (tmp_path / "msg").read_text().strip() == line


# -- tests/k8s_operator.py ------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("$(A)-$(B)", "1-$(B)"), ("$$(A)", "$(A)"), ("$$$(A)", "$1"), ("a$", "a$"),
    ("$(A", "$(A"), ("$x$(A)", "$x1"), ("$((A * 2))", "$((A * 2))"), ("$()", "$()"),
])
def test_expand_follows_the_kubelet(text, expected):
    assert ko.expand(text, {"A": "1"}) == expected


def test_quantity_bytes():
    assert [ko.quantity_bytes(q) for q in ("16Gi", "500M", "1k", 7)] == [16 << 30, 5 * 10 ** 8,
                                                                        1000, 7]
    with pytest.raises(ValueError):
        ko.quantity_bytes("16GB")


def _two_pod_job(**spec_extra) -> dict:
    container = {"name": "pytorch", "image": "img", "command": ["run", "$(MASTER_ADDR)"],
                 "env": [{"name": "A", "value": "x"}, {"name": "B", "value": "$(A)-$(WORLD_SIZE)"},
                         {"name": "RANK", "value": "mine"}, {"name": "A", "value": "y"}]}
    rspec = {"replicas": 1, "template": {"spec": {"containers": [container]}}}
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "j"},
            "spec": {"pytorchReplicaSpecs": {"Master": copy.deepcopy(rspec),
                                             "Worker": {**copy.deepcopy(rspec), "replicas": 2}},
                     **spec_extra}}


def test_operator_env_is_appended_and_wins():
    master, w0, w1 = ko.compute_pods([_two_pod_job(nprocPerNode="4")])
    assert [p.name for p in (master, w0, w1)] == ["j-master-0", "j-worker-0", "j-worker-1"]
    assert w1.env == {"A": "y", "B": "x-$(WORLD_SIZE)", "RANK": "2", "PYTHONUNBUFFERED": "1",
                      "MASTER_PORT": "23456", "MASTER_ADDR": "j-master-0",
                      "PET_MASTER_PORT": "23456", "PET_MASTER_ADDR": "j-master-0",
                      "WORLD_SIZE": "12", "PET_NODE_RANK": "2", "PET_NPROC_PER_NODE": "4",
                      "PET_NNODES": "3"}
    assert master.env["RANK"] == "0" and master.argv == ["run", "j-master-0"]
    assert master.init_containers == [] and w0.init_containers[0]["image"] == "alpine:3.10"
    assert "nslookup j-master-0" in w0.init_containers[0]["argv"][2]
    assert w0.labels["training.kubeflow.org/replica-type"] == "worker"
    assert master.labels["training.kubeflow.org/job-role"] == "master"
    assert master.dns_requires_ready and "j-worker-1.default.svc.cluster.local" in w1.dns_names
    assert master.restart_policy == "OnFailure"  # the operator's default: what k8s/ avoids


def test_secret_key_ref_as_the_kubelet_resolves_it():
    """The Secret's value (base64 in data, plain in stringData, which wins); a missing Secret
    or key leaves an optional entry unset and stops a required one's container."""
    docs = ko.load_manifests(K8S)
    ips = {n: "10.9.0.2" for n in ko.pod_names(docs)}
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "ddp-smoke-secret"},
              "data": {"secret": "YWJj", "other": "eHl6"}}
    pods = ko.compute_pods(docs + [secret], pod_ips=ips)
    assert {p.env["DDP_SMOKE_SECRET"] for p in pods} == {"abc"}
    pods = ko.compute_pods(docs + [{**secret, "stringData": {"secret": "def"}}], pod_ips=ips)
    assert {p.env["DDP_SMOKE_SECRET"] for p in pods} == {"def"}
    for absent in ([], [{**secret, "data": {"other": "eHl6"}}]):
        assert not any("DDP_SMOKE_SECRET" in p.env for p in ko.compute_pods(docs + absent,
                                                                             pod_ips=ips))
        required = ko.customize(docs)
        for rspec in required[1]["spec"]["pytorchReplicaSpecs"].values():
            for entry in rspec["template"]["spec"]["containers"][0]["env"]:
                entry.get("valueFrom", {}).get("secretKeyRef", {}).pop("optional", None)
        with pytest.raises(ValueError, match="CreateContainerConfigError"):
            ko.compute_pods(required + absent, pod_ips=ips)


def test_operator_defaults_and_elastic_env():
    (auto,) = ko.compute_pods([_two_pod_job()])[:1]
    assert auto.env["PET_NPROC_PER_NODE"] == "auto" and auto.env["WORLD_SIZE"] == "3"
    job = _two_pod_job()
    del job["spec"]["pytorchReplicaSpecs"]["Master"]
    job["spec"]["elasticPolicy"] = {"maxReplicas": 4, "rdzvId": "r", "standalone": True}
    w0 = ko.compute_pods([job])[0]
    assert "MASTER_ADDR" not in w0.env and w0.init_containers == []
    assert (w0.env["PET_RDZV_ENDPOINT"], w0.env["PET_NNODES"], w0.env["PET_STANDALONE"]) == (
        "j-worker-0:23456", "2:4", "")


@pytest.mark.parametrize("mutate, needle", [
    (lambda s: s["pytorchReplicaSpecs"]["Master"].pop("replicas"), "must be 1"),
    (lambda s: s["pytorchReplicaSpecs"]["Worker"].update(replicas=0), "at least 1"),
    (lambda s: s["pytorchReplicaSpecs"].update(Chief=s["pytorchReplicaSpecs"]["Worker"]),
     "unsupported"),
    (lambda s: s["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0].update(
        name="main"), "named 'pytorch'"),
    (lambda s: s.update(elasticPolicy={"nProcPerNode": 2}, nprocPerNode="2"), "must not"),
])
def test_webhook_rules(mutate, needle):
    job = _two_pod_job()
    mutate(job["spec"])
    assert any(needle in e for e in ko.pytorchjob_webhook_errors(job))
    with pytest.raises(ValueError, match="webhook"):
        ko.compute_pods([job])


def test_k8s_pods_and_dns(tmp_path):
    docs = ko.load_manifests(K8S)
    with pytest.raises(ValueError, match="pod_ips"):
        ko.compute_pods(docs)
    ips = {"ddp-smoke-master-0": "10.9.0.2", "ddp-smoke-worker-0": "10.9.0.3"}
    master, worker = ko.compute_pods(docs, pod_ips=ips)
    assert (master.hostname, master.env["REPORT_DIR"], master.env["POD_IP"]) == (
        "ddp-smoke-master-0", "/reports/ddp-smoke", "10.9.0.2")
    assert master.image == worker.image and master.run_as_user == 1000
    assert master.restart_policy == worker.restart_policy == "Never"
    mounts = {m.path: m for m in worker.mounts}
    assert mounts["/dev/shm"].kind == "memory" and mounts["/dev/shm"].size_limit_bytes == 16 << 30
    assert "checks:" in mounts["/etc/ddp-smoke"].files["config.yaml"]
    hosts = ko.etc_hosts(worker, [master, worker], ips)
    assert hosts["ddp-smoke-master-0"] == "10.9.0.2" and hosts["ddp-smoke-worker-0"] == "10.9.0.3"
    json.dumps(master.as_dict())  # plain data


def test_indexed_job_pods_and_dns():
    docs = ko.load_manifests(K8S / "indexed-job")
    ips = {"ddp-smoke-indexed-0": "10.9.0.2", "ddp-smoke-indexed-1": "10.9.0.3"}
    p0, p1 = ko.compute_pods(docs, pod_ips=ips)
    assert (p1.hostname, p1.env["JOB_COMPLETION_INDEX"], p1.labels[ko.INDEX_ANNOTATION]) == (
        "ddp-smoke-indexed-1", "1", "1")
    assert p0.fqdn == "ddp-smoke-indexed-0.ddp-smoke-indexed.default.svc.cluster.local"
    assert not p0.dns_requires_ready  # publishNotReadyAddresses
    assert ko.dns_table([p0, p1])["ddp-smoke-indexed-0.ddp-smoke-indexed"] == p0.name
    other = [d for d in docs if d["kind"] != "Service"]  # no Service: no names at all
    assert ko.compute_pods(other, pod_ips=ips)[0].dns_names == []


def test_failure_policy_of_the_controllers():
    ij = ko.load_manifests(K8S / "indexed-job")[-1]
    assert ko.on_pod_failure(ij) == "continue"  # what the manifest ships
    del ij["spec"]["backoffLimitPerIndex"]
    assert ko.on_pod_failure({**ij, "spec": {**ij["spec"], "backoffLimit": 0}}) == "delete"
    assert ko.on_pod_failure(ij) == "retry"  # Kubernetes' default backoffLimit 6
    (job,) = [d for d in ko.load_manifests(K8S) if d["kind"] == "PyTorchJob"]
    assert ko.on_pod_failure(job) == "continue"
    job["spec"]["runPolicy"]["cleanPodPolicy"] = "Running"
    assert ko.on_pod_failure(job) == "delete"


def test_trainjob_pods_are_trainers_and_a_runtime_not_shipped_is_refused(tmp_path):
    """The TrainJob's pods as Trainer v2.3 (its torch plugin) and JobSet make them from this
    folder's TrainingRuntime: an Indexed Job per replicated job, the TrainJob's image, command
    and env in the runtime's ``node`` container, then the PET_* variables; every pod finds
    node 0 by the name Trainer gives, before it is Ready (JobSet's headless Service); the pod
    script then runs torchrun with c10d there, the node rank its completion index."""
    docs = ko.customize(ko.load_manifests(K8S / "trainer-v2"), image="img:1", nodes=2,
                        gpus_per_node=0, nproc_per_node=2)
    names = ko.pod_names(docs)
    assert names == ["ddp-smoke-v2-node-0-0", "ddp-smoke-v2-node-0-1"]
    pods = ko.compute_pods(docs, pod_ips={n: f"10.9.0.{i + 2}" for i, n in enumerate(names)})
    master = "ddp-smoke-v2-node-0-0.ddp-smoke-v2"
    for i, pod in enumerate(pods):
        assert (pod.hostname, pod.image, pod.container) == (names[i], "img:1", "node")
        assert {k: pod.env[k] for k in pod.env if k.startswith("PET_")} == {
            "PET_NNODES": "2", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": str(i),
            "PET_MASTER_ADDR": master, "PET_MASTER_PORT": "29500"}
        assert pod.dns_names[0] == f"{names[i]}.ddp-smoke-v2" and not pod.dns_requires_ready
        uid = pod.labels["batch.kubernetes.io/controller-uid"]  # the Job's: one a run
        assert pod.env["DDP_SMOKE_RUN_ID"] == f"ddp-smoke-v2-{uid}"
        assert pod.restart_policy == "Never" and pod.run_as_user == 1000
    proc, argv = _run_pod(pods[1], tmp_path, rc=0)
    assert proc.returncode == 0, proc.stderr
    assert argv[:4] == ["--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d",
                        f"--rdzv-endpoint={master}:29500"], argv
    runtime = next(d for d in docs if d["kind"] == "TrainingRuntime")
    with pytest.raises(NotImplementedError, match="not among the manifests"):
        ko.compute_pods([d for d in docs if d is not runtime])


def test_customize_edits_what_the_readme_says():
    docs = ko.customize(ko.load_manifests(K8S), image="img:1", nodes=3, gpus_per_node=0,
                        nproc_per_node=2, reports_claim="shared")
    names = ko.pod_names(docs)
    pods = ko.compute_pods(docs, pod_ips={n: "10.9.0.9" for n in names})
    assert names == ["ddp-smoke-master-0", "ddp-smoke-worker-0", "ddp-smoke-worker-1"]
    assert {p.image for p in pods} == {"img:1"} and pods[0].env["WORLD_SIZE"] == "6"
    mounts = {m.path: m for m in pods[0].mounts}
    assert mounts["/reports"].claim == "shared"
    assert "storage" in yaml.safe_load(mounts["/etc/ddp-smoke"].files["config.yaml"])["checks"]
    job = next(d for d in docs if d["kind"] == "PyTorchJob")
    limits = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0][
        "resources"]["limits"]
    assert GPU not in limits
    assert ko.load_manifests(K8S)[1]["spec"]["nprocPerNode"] == "8"  # input untouched


def test_a_pod_whose_ranks_lost_the_store_says_who_went_silent(tmp_path):
    """The store's pod died with rank 0: a Worker pod's ranks left lost/<rank>.json (each
    pod's own emptyDir), and its termination message names the silent ranks from them."""
    docs = ko.load_manifests(K8S)
    pod = ko.compute_pods(docs, pod_ips={"ddp-smoke-master-0": "10.9.0.2",
                                         "ddp-smoke-worker-0": "10.9.0.3"})[1]
    reports = tmp_path / "reports"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = {"ddp_smoke_rank": 1, "run_id": pod.env["DDP_SMOKE_RUN_ID"], "stage": "ddp_step",
              "store": "ddp-smoke-master-0:29401", "world_size": 2,
              "hosts": ["ddp-smoke-master-0", "ddp-smoke-worker-0"]}
    (bin_dir / "torchrun").write_text(  # rank 1 lost the store, left its word, exited 1
        f"#!/bin/sh\nmkdir -p \"$REPORT_DIR/lost\"\necho '{json.dumps(record)}' > "
        "\"$REPORT_DIR/lost/1.json\"\nexit 1\n")
    (bin_dir / "torchrun").chmod(0o755)
    env = {**pod.env, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "DDP_SMOKE_PREFLIGHT": "0", "REPORT_DIR": str(reports),
           "TERMINATION_LOG": str(tmp_path / "msg")}
    proc = subprocess.run(here(pod.argv, tmp_path, pod), env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    message = (tmp_path / "msg").read_text()
    assert message.startswith(f"ddp-smoke FAIL · run {record['run_id']} · 2 ranks"), message
    assert "silent: rank 0 ddp-smoke-master-0" in message, message
