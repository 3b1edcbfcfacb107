"""The pods Kubernetes would run for the manifests in ``k8s/``, computed without a cluster.

The Kubernetes tests' layer 3 runs each replica as a container of the image from ``docker/``.
This module says exactly what each container gets, as plain data: name, hostname, image, the
argv that runs (command + args after the kubelet's ``$(VAR)`` expansion), the final env, the
mounts, and which DNS names must resolve to which pod. It is pure: no subprocess, no network;
only :func:`load_manifests` reads files.

What it emulates, and from where:

* **Kubeflow Training Operator v1.9.4, PyTorchJob** (``shared/reference/kubernetes.md``, read
  from ``pkg/controller.v1/pytorch`` and ``pkg/webhooks/pytorch``): the validating webhook's
  rules (:func:`pytorchjob_webhook_errors`), the default ``pytorchjob-port`` (23456), one pod per
  replica named ``<job>-<master|worker>-<i>`` (hostname = pod name), its labels, the env
  appended *after* the user's ``env:`` to every container (later duplicates win), the Worker
  init container ``init-pytorch``, and one headless Service per pod (no
  ``publishNotReadyAddresses``: its name resolves only once that pod is Ready).
* **Job controller, Indexed completion mode**: hostname ``<job>-<i>``, the completion-index
  annotation and labels, ``JOB_COMPLETION_INDEX`` (appended unless the container sets it), and
  ``<hostname>.<subdomain>`` names from a headless Service that selects the pod.
* **DaemonSet controller** (apps/v1): one pod per node whose labels match the template's
  ``nodeSelector``, named ``<daemonset>-<5 random characters>`` (generateName), bound to its
  node (``spec.nodeName``); hostname = pod name; the ``controller-revision-hash`` and
  ``pod-template-generation`` labels. Taints and tolerations are not emulated (every node
  given is schedulable).
* **Kubeflow Trainer v2.3, TrainJob** (the torch plugin's EnforceMLPolicy, read from
  ``pkg/runtime/framework/plugins/torch``, and JobSet's naming): the TrainJob's runtime (a
  TrainingRuntime or ClusterTrainingRuntime among the documents) becomes a JobSet named after
  the TrainJob, each replicated job one Indexed Job ``<trainjob>-<replicated job>-0`` (the
  trainer's: completions = parallelism = ``numNodes``), its pods' subdomain the JobSet's name
  and a headless Service of that name that publishes pods before they are Ready; the trainer
  container (``node``) gets the TrainJob's image, command, args and resources, its ``env``
  upserted (a name the runtime has is replaced in place, a new one appended), then
  ``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK`` (the completion index),
  ``PET_MASTER_ADDR=<trainjob>-node-0-0.<trainjob>``, ``PET_MASTER_PORT=29500`` and that
  container port (:func:`expanded`).
* **kubelet**: env resolution in order (``$(VAR)`` in a value sees only earlier entries; a
  later duplicate replaces an earlier one), downward-API ``fieldRef`` values, ``secretKeyRef``
  values from the Secrets among the documents (as ``kubectl create secret`` makes them: ``data``
  base64, ``stringData`` plain and winning; a missing Secret or key leaves an ``optional`` entry
  unset and stops any other pod from starting, the kubelet's CreateContainerConfigError), then
  ``$(VAR)``
  expansion of command and args against the final env (``$$`` → ``$``; an undefined reference
  stays as written), hostname truncation to 63 characters, the pod's own FQDN in /etc/hosts.

Not emulated, and refused loudly rather than guessed: a TrainJob whose runtime is not among
the documents, Trainer's other ML policies (MPI, torchtune), sidecar containers, ``envFrom``,
secret volumes, resource field refs, volumes other than emptyDir/configMap/PVC. Not added to
``env``: the ``KUBERNETES_*`` service variables and ``HOSTNAME``, which every real container
also has (the runtime sets ``HOSTNAME`` to :attr:`Pod.hostname`).
"""
from __future__ import annotations

import base64
import copy
import dataclasses
import re
import uuid
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

OPERATOR_PORT_NAME = "pytorchjob-port"
OPERATOR_DEFAULT_PORT = 23456
OPERATOR_CONTAINER = "pytorch"
INIT_IMAGE = "alpine:3.10"
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY = re.compile(r"^([0-9.]+)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m)?$")
_FACTORS = {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
            **{s: 1024 ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))}}


@dataclasses.dataclass(frozen=True)
class Mount:
    """One volume mount of the pod's container.

    Attributes:
        path: mount path inside the container.
        kind: ``emptyDir``, ``memory`` (emptyDir with medium Memory, i.e. a tmpfs),
            ``configMap`` or ``persistentVolumeClaim``.
        read_only: whether the mount is read-only.
        size_limit_bytes: emptyDir ``sizeLimit`` in bytes, or None.
        files: for a configMap, file name → content.
        claim: for a PVC, the claim name.
    """

    path: str
    kind: str
    read_only: bool = False
    size_limit_bytes: int | None = None
    files: dict[str, str] = dataclasses.field(default_factory=dict)
    claim: str | None = None


@dataclasses.dataclass(frozen=True)
class Pod:
    """One pod as the controllers and the kubelet would run it.

    Attributes:
        name: pod name (an Indexed Job's real pods carry a random suffix after ``<job>-<i>-``).
        hostname: what ``socket.gethostname()`` returns inside it.
        fqdn: the first name the pod's own /etc/hosts gives its IP (``socket.getfqdn()``).
        namespace: the namespace the names were computed for.
        replica: ``Master``, ``Worker`` (PyTorchJob), ``Indexed`` (Job) or ``DaemonSet``.
        index: replica index, or completion index.
        labels: the pod's labels, the controller's included.
        annotations: the pod's annotations, the controller's included.
        container: the container's name.
        image: the container's image.
        argv: command + args after ``$(VAR)`` expansion: what the container executes.
        env: the container's final environment.
        dns_names: names any pod of the namespace resolves to this pod's IP.
        dns_requires_ready: True when those names answer only once this pod is Ready.
        init_containers: ``{name, image, argv}`` of each init container, in order.
        mounts: the container's volume mounts.
        run_as_user: effective ``runAsUser``, or None (the image's user).
        run_as_group: effective ``runAsGroup``, or None.
        ports: container port name → number.
        restart_policy: the pod's restartPolicy.
    """

    name: str
    hostname: str
    fqdn: str
    namespace: str
    replica: str
    index: int
    labels: dict[str, str]
    annotations: dict[str, str]
    container: str
    image: str
    argv: list[str]
    env: dict[str, str]
    dns_names: list[str]
    dns_requires_ready: bool
    init_containers: list[dict[str, Any]]
    mounts: list[Mount]
    run_as_user: int | None
    run_as_group: int | None
    ports: dict[str, int]
    restart_policy: str
    node: str | None = None  # spec.nodeName when a controller binds the pod (DaemonSet)
    service_account: str | None = None  # spec.serviceAccountName, when its token is mounted

    def as_dict(self) -> dict[str, Any]:
        """The pod as JSON-able plain data."""
        return dataclasses.asdict(self)


def load_manifests(folder: str | Path) -> list[dict[str, Any]]:
    """Read the manifests of one folder as ``kubectl apply -f FOLDER`` does.

    Args:
        folder: a folder such as ``k8s`` or ``k8s/indexed-job``.

    Returns:
        Every non-empty YAML document of the folder's ``*.yaml``, ``*.yml`` and ``*.json``
        files (not subfolders), in kubectl's order: file names sorted, documents in file order.
    """
    return [doc for path in sorted(Path(folder).iterdir())
            if path.is_file() and path.suffix in (".yaml", ".yml", ".json")
            for doc in load_manifests_file(path)]


def load_manifests_file(path: str | Path) -> list[dict[str, Any]]:
    """The non-empty YAML documents of one manifest file, in order."""
    return [d for d in yaml.safe_load_all(Path(path).read_text()) if d is not None]


def expand(text: str, env: Mapping[str, str]) -> str:
    """Expand ``$(VAR)`` references exactly as the kubelet does.

    Args:
        text: an env value, a command or an args element.
        env: the variables visible at that point.

    Returns:
        ``text`` with ``$(NAME)`` replaced by ``env[NAME]`` where defined (left as written
        otherwise), ``$$`` reduced to ``$``, and any other ``$`` kept.
    """
    out, i = [], 0
    while i < len(text):
        if text[i] != "$" or i + 1 == len(text):
            out.append(text[i])
            i += 1
        elif text[i + 1] == "$":
            out.append("$")
            i += 2
        elif text[i + 1] == "(" and ")" in text[i + 2:]:
            close = text.index(")", i + 2)
            name = text[i + 2:close]
            out.append(env[name] if name in env else text[i:close + 1])
            i = close + 1
        else:
            out.append(text[i:i + 2])
            i += 2
    return "".join(out)


def quantity_bytes(value: str | int) -> int:
    """Convert a Kubernetes quantity such as ``16Gi`` or ``500M`` to a number (bytes)."""
    match = _QUANTITY.match(str(value))
    if not match:
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    return int(float(match.group(1)) * _FACTORS[match.group(2)])


def pytorchjob_webhook_errors(job: Mapping[str, Any]) -> list[str]:
    """The Training Operator's validating webhook (v1.8+), as a list of rejections.

    Args:
        job: a PyTorchJob document.

    Returns:
        One message per rule broken; empty when the webhook would admit the job.
    """
    errors = []
    name = job.get("metadata", {}).get("name", "")
    if not _DNS1035.match(name) or len(name) > 63:
        errors.append(f"metadata.name {name!r}: must be a DNS-1035 label")
    spec = job.get("spec", {})
    replicas = spec.get("pytorchReplicaSpecs") or {}
    if not replicas:
        errors.append("spec.pytorchReplicaSpecs: must be required")
    elastic = spec.get("elasticPolicy")
    if elastic is not None and "Worker" not in replicas:
        errors.append("spec.pytorchReplicaSpecs[Worker]: must be configured if elastic policy "
                      "is used")
    if elastic is not None and "nProcPerNode" in elastic and "nprocPerNode" in spec:
        errors.append("spec.elasticPolicy.nProcPerNode: must not be used with spec.nprocPerNode")
    for rtype, rspec in replicas.items():
        path = f"spec.pytorchReplicaSpecs[{rtype}]"
        if rtype not in ("Master", "Worker"):
            errors.append(f"{path}: unsupported replica type (Master, Worker)")
        containers = ((rspec or {}).get("template", {}).get("spec", {}).get("containers")) or []
        if not containers:
            errors.append(f"{path}.template.spec.containers: must be specified")
        if not any(c.get("name") == OPERATOR_CONTAINER for c in containers):
            errors.append(f"{path}: must have a container named {OPERATOR_CONTAINER!r}")
        errors += [f"{path} container {c.get('name')!r}: image must be set"
                   for c in containers if not c.get("image")]
        count = (rspec or {}).get("replicas")
        if rtype == "Master" and count != 1:
            errors.append(f"{path}.replicas: must be 1 (and written), got {count!r}")
        elif rtype != "Master" and count is not None and (
                not isinstance(count, int) or count < 1):
            errors.append(f"{path}.replicas: must be at least 1, got {count!r}")
    managed_by = spec.get("runPolicy", {}).get("managedBy")
    if managed_by not in (None, "", "kubeflow.org/training-operator", "kueue.x-k8s.io/multikueue"):
        errors.append(f"spec.runPolicy.managedBy {managed_by!r}: not a supported manager")
    return errors


def pod_names(docs: Iterable[Mapping[str, Any]]) -> list[str]:
    """The names of the pods :func:`compute_pods` returns, in the same order (to assign IPs)."""
    docs, names = list(docs), []
    for doc in docs:
        if doc.get("kind") == "PyTorchJob":
            job = doc["metadata"]["name"]
            names += [f"{job}-{rtype.lower()}-{i}" for rtype, count in _replica_counts(doc)
                      for i in range(count)]
        elif doc.get("kind") == "Job":
            names += [f"{doc['metadata']['name']}-{i}" for i in range(_completions(doc))]
        elif doc.get("kind") == "TrainJob":
            names += pod_names(_trainjob_children(doc, docs))
    return names


TRAINER_ANCESTOR = "trainer.kubeflow.org/trainjob-ancestor-step"
TRAINER_CONTAINER = "node"  # the runtime's container Trainer fills from the TrainJob
TRAINER_PORT = 29500
JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"


def expanded(docs: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The documents with each TrainJob replaced by what Trainer and JobSet make of it: one
    Indexed Job per replicated job of its runtime, and the JobSet's headless Service."""
    docs = [copy.deepcopy(dict(d)) for d in docs]
    out = []
    for doc in docs:
        out += _trainjob_children(doc, docs) if doc.get("kind") == "TrainJob" else [doc]
    return out


def _trainjob_children(trainjob: Mapping[str, Any], docs: list) -> list[dict[str, Any]]:
    name, trainer = trainjob["metadata"]["name"], trainjob["spec"].get("trainer") or {}
    ref = trainjob["spec"]["runtimeRef"]
    runtime = next((d for d in docs if d.get("kind") == ref.get("kind", "ClusterTrainingRuntime")
                    and d["metadata"]["name"] == ref["name"]), None)
    if runtime is None:
        raise NotImplementedError(f"TrainJob {name!r}: its {ref.get('kind')} {ref['name']!r} is "
                                  "not among the manifests (the cluster's are not emulated)")
    policy = runtime["spec"].get("mlPolicy") or {}
    if set(policy) - {"numNodes", "torch"}:
        raise NotImplementedError(f"TrainJob {name!r}: ML policy {sorted(policy)}: only torch")
    nodes = trainer.get("numNodes", policy.get("numNodes", 1))
    nproc = trainer.get("numProcPerNode", (policy.get("torch") or {}).get("numProcPerNode",
                                                                           "auto"))
    if not isinstance(nproc, int):
        raise NotImplementedError(f"TrainJob {name!r}: numProcPerNode {nproc!r} (Trainer "
                                  "derives it from the resources): give a number")
    children = []
    for rjob in runtime["spec"]["template"]["spec"]["replicatedJobs"]:
        if rjob.get("replicas", 1) != 1:
            raise NotImplementedError(f"replicated job {rjob['name']!r}: one Job each only")
        job = copy.deepcopy(rjob["template"])
        job.update(apiVersion="batch/v1", kind="Job")
        job["metadata"] = {**job.get("metadata", {}), "name": f"{name}-{rjob['name']}-0"}
        template = job["spec"]["template"]
        template.setdefault("metadata", {}).setdefault("labels", {}).update({
            JOBSET_NAME: name, "jobset.sigs.k8s.io/replicatedjob-name": rjob["name"],
            "jobset.sigs.k8s.io/job-index": "0"})
        template["spec"]["subdomain"] = name  # JobSet's network: DNS hostnames on, its name
        if (job["metadata"].get("labels") or {}).get(TRAINER_ANCESTOR) == "trainer":
            job["spec"]["completions"] = job["spec"]["parallelism"] = nodes
            for container in template["spec"]["containers"]:
                if container["name"] == TRAINER_CONTAINER:
                    _trainer_container(container, trainer, name, nodes, nproc)
        children.append(job)
    children.append({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name},
                     "spec": {"clusterIP": "None", "selector": {JOBSET_NAME: name},
                              "publishNotReadyAddresses": True}})
    return children


def _trainer_container(container: dict[str, Any], trainer: Mapping[str, Any], name: str,
                       nodes: int, nproc: int) -> None:
    for key in ("image", "command", "args"):
        _set_if(container, key, copy.deepcopy(trainer.get(key)))
    if trainer.get("resourcesPerNode"):
        container["resources"] = copy.deepcopy(trainer["resourcesPerNode"])
    env = container.setdefault("env", [])
    index = {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}}
    for entry in [*copy.deepcopy(trainer.get("env", [])),
                  {"name": "PET_NNODES", "value": str(nodes)},
                  {"name": "PET_NPROC_PER_NODE", "value": str(nproc)},
                  {"name": "PET_NODE_RANK", "valueFrom": index},
                  {"name": "PET_MASTER_ADDR", "value": f"{name}-{TRAINER_CONTAINER}-0-0.{name}"},
                  {"name": "PET_MASTER_PORT", "value": str(TRAINER_PORT)}]:
        at = next((i for i, e in enumerate(env) if e["name"] == entry["name"]), None)
        if at is None:
            env.append(entry)
        else:
            env[at] = entry  # Trainer's upsert: in place
    ports = container.setdefault("ports", [])
    if not any(p["containerPort"] == TRAINER_PORT for p in ports):
        ports.append({"containerPort": TRAINER_PORT})


def compute_pods(docs: Iterable[Mapping[str, Any]], pod_ips: Mapping[str, str] | None = None,
                 namespace: str = "default", cluster_domain: str = "cluster.local",
                 job_uid: str | None = None,
                 nodes: Mapping[str, Mapping[str, str]] | None = None) -> list[Pod]:
    """Every pod the manifests would create, as the controllers and the kubelet would run it.

    Args:
        docs: the documents of one manifest folder (see :func:`load_manifests`); ConfigMaps,
            Services and Secrets among them are used for mounts, DNS and env.
        pod_ips: pod name (see :func:`pod_names`) → the IP it will have; needed when the env
            reads ``status.podIP``.
        namespace: the namespace the job is applied to.
        cluster_domain: the cluster's DNS domain.
        job_uid: the uid the API server gives the Job object (labels of its pods); None: a new
            random one, as every creation gets.
        nodes: the cluster's nodes, name -> labels (a DaemonSet has a pod on each that its
            nodeSelector selects).

    Returns:
        The pods, PyTorchJob Master then Workers by index, Indexed Job pods (a TrainJob's
        among them) by index.

    Raises:
        ValueError: a PyTorchJob the webhook would reject, or a value the pods need and the
            arguments do not give (a pod IP, a missing ConfigMap).
        NotImplementedError: a kind or feature this emulation does not cover.
    """
    docs = expanded(docs)
    ctx = _Context(docs, dict(pod_ips or {}), namespace, cluster_domain,
                   job_uid or str(uuid.uuid4()))
    pods: list[Pod] = []
    for doc in docs:
        kind = doc.get("kind")
        if kind == "PyTorchJob":
            pods += _pytorchjob_pods(doc, ctx)
        elif kind == "Job":
            pods += _indexed_job_pods(doc, ctx)
        elif kind == "DaemonSet":
            pods += _daemonset_pods(doc, ctx, dict(nodes or {}))
        elif kind not in ("ConfigMap", "Service", "Secret", "Namespace", "ServiceAccount",
                          "ClusterRole", "ClusterRoleBinding", "TrainingRuntime",
                          "ClusterTrainingRuntime"):
            raise NotImplementedError(
                f"{kind} {doc.get('metadata', {}).get('name')!r}: its pods are not emulated")
    return pods


def on_pod_failure(job: Mapping[str, Any]) -> str:
    """What the controller does to the job's other pods once one of them has failed.

    Returns:
        ``"continue"``: they run to their end and keep their logs (Indexed Job with
        ``backoffLimitPerIndex``: the index fails, the Job fails once all have ended; PyTorchJob
        with ``cleanPodPolicy: None``); ``"delete"``: the running pods are deleted, their logs
        with them (Job with ``backoffLimit: 0`` and no per-index limit: the Job fails at once
        and the Job controller removes its active pods; PyTorchJob with cleanPodPolicy All or
        Running); ``"retry"``: the failed pod is replaced (a backoff limit above 0).
    """
    spec = job["spec"]
    if job["kind"] == "PyTorchJob":
        run = spec.get("runPolicy", {})
        if run.get("backoffLimit", 0) > 0:
            return "retry"
        return "continue" if run.get("cleanPodPolicy", "None") == "None" else "delete"
    if spec.get("backoffLimitPerIndex") is not None:
        return "retry" if spec["backoffLimitPerIndex"] > 0 else "continue"
    return "delete" if spec.get("backoffLimit", 6) == 0 else "retry"


def dns_table(pods: Iterable[Pod]) -> dict[str, str]:
    """DNS name → name of the pod it must resolve to, for every pod (names are unique)."""
    table: dict[str, str] = {}
    for pod in pods:
        for name in pod.dns_names:
            if table.setdefault(name, pod.name) != pod.name:
                raise ValueError(f"DNS name {name} resolves to both {table[name]} and {pod.name}")
    return table


def etc_hosts(pod: Pod, pods: Iterable[Pod], pod_ips: Mapping[str, str]) -> dict[str, str]:
    """Name → IP for one pod's resolver: cluster DNS for every pod, plus its own /etc/hosts.

    Args:
        pod: the pod whose view this is.
        pods: every pod of the job.
        pod_ips: pod name → IP.

    Returns:
        Each DNS name of :func:`dns_table` with its pod's IP, and this pod's FQDN and hostname
        with its own IP (the kubelet writes those two into the pod's /etc/hosts). Fit for
        ``docker run --add-host``. A real cluster answers names whose pod has
        ``dns_requires_ready`` only once that pod is Ready; a static table cannot show that.
    """
    table = {name: pod_ips[owner] for name, owner in dns_table(pods).items()}
    table.update({pod.fqdn: pod_ips[pod.name], pod.hostname: pod_ips[pod.name]})
    return table


def customize(docs: Iterable[Mapping[str, Any]], *, image: str | None = None,
              nodes: int | None = None, gpus_per_node: int | None = None,
              nproc_per_node: int | None = None,
              reports_claim: str | None = None) -> list[dict[str, Any]]:
    """Apply the README's edits (image, node count, GPUs, report PVC) to parsed manifests.

    Args:
        docs: the documents of one manifest folder.
        image: the image of every worker container.
        nodes: the number of pods (PyTorchJob: 1 Master + ``nodes - 1`` Workers).
        gpus_per_node: ``nvidia.com/gpu`` per pod; 0 removes the GPU request (CPU clusters).
            Also sets the processes per pod unless ``nproc_per_node`` is given.
        nproc_per_node: processes per pod.
        reports_claim: mount this PersistentVolumeClaim at /reports instead of the emptyDir,
            and add the ``storage`` check to the config.

    Returns:
        Edited deep copies; the input is left untouched.
    """
    docs = [copy.deepcopy(dict(d)) for d in docs]
    nproc = nproc_per_node if nproc_per_node is not None else gpus_per_node
    for doc in docs:
        kind = doc.get("kind")
        if kind == "ConfigMap" and reports_claim and "config.yaml" in doc.get("data", {}):
            config = yaml.safe_load(doc["data"]["config.yaml"])
            config["checks"] = [c for c in config["checks"] if c != "storage"] + ["storage"]
            doc["data"]["config.yaml"] = yaml.safe_dump(config, sort_keys=False)
        elif kind == "TrainJob":
            trainer = doc["spec"]["trainer"]
            _set_if(trainer, "image", image)
            _set_if(trainer, "numNodes", nodes)
            _set_if(trainer, "numProcPerNode", nproc)
            _set_gpus(trainer["resourcesPerNode"], gpus_per_node)
        elif kind in ("PyTorchJob", "Job"):
            _customize_job(doc, image, nodes, gpus_per_node, nproc, reports_claim)
        elif kind == "DaemonSet":  # one pod per node: only the image is the user's edit
            for container in doc["spec"]["template"]["spec"]["containers"]:
                _set_if(container, "image", image)
    return docs


# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Context:
    docs: list[dict[str, Any]]
    pod_ips: dict[str, str]
    namespace: str
    domain: str
    job_uid: str


def _replica_counts(job: Mapping[str, Any]) -> list[tuple[str, int]]:
    # The operator defaults an omitted Worker count to 1 (the webhook requires Master's).
    specs = job["spec"]["pytorchReplicaSpecs"]
    return [(rtype, specs[rtype].get("replicas", 1)) for rtype in ("Master", "Worker")
            if rtype in specs]


def _completions(job: Mapping[str, Any]) -> int:
    spec = job["spec"]
    if spec.get("completionMode") != "Indexed":
        raise NotImplementedError(f"Job {job['metadata']['name']!r}: only completionMode Indexed")
    return spec.get("completions", 1)


def _pytorchjob_pods(job: dict[str, Any], ctx: _Context) -> list[Pod]:
    errors = pytorchjob_webhook_errors(job)
    if errors:
        raise ValueError("the webhook would reject this PyTorchJob: " + "; ".join(errors))
    name, spec = job["metadata"]["name"], job["spec"]
    specs = spec["pytorchReplicaSpecs"]
    for rspec in specs.values():  # the operator's defaulting, before any pod exists
        _default_port(rspec["template"]["spec"])
    pods = []
    for rtype, count in _replica_counts(job):
        for index in range(count):
            pod_name = f"{name}-{rtype.lower()}-{index}"
            template = copy.deepcopy(specs[rtype]["template"])
            labels = {**template.get("metadata", {}).get("labels", {}),
                      "training.kubeflow.org/operator-name": "pytorchjob-controller",
                      "training.kubeflow.org/job-name": name,
                      "training.kubeflow.org/replica-type": rtype.lower(),
                      "training.kubeflow.org/replica-index": str(index)}
            if rtype == "Master":
                labels["training.kubeflow.org/job-role"] = "master"
            operator_env = _operator_env(job, rtype, index)
            pod_spec = template["spec"]
            for container in pod_spec["containers"]:
                container["env"] = container.get("env", []) + operator_env
            if rtype == "Worker" and "Master" in specs and spec.get("elasticPolicy") is None:
                pod_spec["initContainers"] = pod_spec.get("initContainers", []) + [_init(name)]
            meta = {"name": pod_name, "labels": labels,
                    "annotations": template.get("metadata", {}).get("annotations", {})}
            svc = [pod_name, f"{pod_name}.{ctx.namespace}", f"{pod_name}.{ctx.namespace}.svc",
                   f"{pod_name}.{ctx.namespace}.svc.{ctx.domain}"]
            # The replica's policy replaces the template's; ExitCode is the operator's own and
            # runs the pod as Never.
            restart = specs[rtype].get("restartPolicy", "OnFailure")
            pod_spec["restartPolicy"] = "Never" if restart == "ExitCode" else restart
            pods.append(_pod(meta, pod_spec, rtype, index, svc, True, ctx))
    return pods


def _daemonset_pods(ds: dict[str, Any], ctx: _Context,
                    nodes: dict[str, Mapping[str, str]]) -> list[Pod]:
    """One pod per selected node, as the DaemonSet controller and the scheduler make them."""
    template = ds["spec"]["template"]
    selector = ds["spec"]["selector"].get("matchLabels", {})
    labels = template.get("metadata", {}).get("labels", {})
    if any(labels.get(k) != v for k, v in selector.items()):
        raise ValueError(f"DaemonSet {ds['metadata']['name']!r}: spec.selector does not match "
                         "the template's labels (the API server refuses it)")
    wanted = template["spec"].get("nodeSelector", {})
    pods = []
    for index, (node, node_labels) in enumerate(sorted(nodes.items())):
        if any(node_labels.get(k) != v for k, v in wanted.items()):
            continue
        pod_spec = copy.deepcopy(template["spec"])
        pod_spec["nodeName"] = node
        suffix = uuid.uuid4().hex[:5]
        meta = {"name": f"{ds['metadata']['name']}-{suffix}",
                "labels": {**labels, "controller-revision-hash": ctx.job_uid[:10],
                           "pod-template-generation": "1"},
                "annotations": template.get("metadata", {}).get("annotations", {})}
        pod = _pod(meta, pod_spec, "DaemonSet", index, [], True, ctx)
        account = pod_spec.get("serviceAccountName", "default") if pod_spec.get(
            "automountServiceAccountToken", True) else None
        pods.append(dataclasses.replace(pod, node=node, service_account=account))
    return pods


def _default_port(pod_spec: dict[str, Any]) -> None:
    for container in pod_spec["containers"]:
        ports = container.setdefault("ports", [])
        if container["name"] == OPERATOR_CONTAINER and not any(
                p.get("name") == OPERATOR_PORT_NAME for p in ports):
            ports.append({"name": OPERATOR_PORT_NAME, "containerPort": OPERATOR_DEFAULT_PORT})


def _operator_env(job: Mapping[str, Any], rtype: str, index: int) -> list[dict[str, str]]:
    """The env block the operator appends to every container, in its order."""
    name, spec = job["metadata"]["name"], job["spec"]
    specs, elastic = spec["pytorchReplicaSpecs"], spec.get("elasticPolicy")
    nproc = spec.get("nprocPerNode", "auto")
    if not isinstance(nproc, str):
        raise ValueError(f"spec.nprocPerNode {nproc!r}: the CRD types it as a string; quote it")
    env = [("PYTHONUNBUFFERED", "1")]
    if "Master" in specs:
        port = str(_port_of(specs["Master"]))
        addr = f"{name}-master-0"
        total = sum(count for _, count in _replica_counts(job))
        per_node = int(nproc) if nproc.isdigit() else 1
        rank = str(index + 1 if rtype == "Worker" else index)
        env += [("MASTER_PORT", port), ("MASTER_ADDR", addr), ("PET_MASTER_PORT", port),
                ("PET_MASTER_ADDR", addr), ("WORLD_SIZE", str(total * per_node)),
                ("RANK", rank), ("PET_NODE_RANK", rank)]
    if elastic is None:
        env += [("PET_NPROC_PER_NODE", nproc), ("PET_NNODES", str(sum(
            count for _, count in _replica_counts(job))))]
    else:
        env += _elastic_env(job, elastic, nproc)
    return [{"name": k, "value": v} for k, v in env]


def _elastic_env(job: Mapping[str, Any], elastic: Mapping[str, Any], nproc: str) -> list:
    name = job["metadata"]["name"]
    workers = dict(_replica_counts(job)).get("Worker", 1)
    host = elastic.get("rdzvHost") or f"{name}-worker-0"
    port = elastic.get("rdzvPort") or _port_of(job["spec"]["pytorchReplicaSpecs"]["Worker"])
    env = [("PET_RDZV_ENDPOINT", f"{host}:{port}"),
           ("PET_RDZV_BACKEND", elastic.get("rdzvBackend") or "c10d"),
           ("PET_NNODES", f"{elastic.get('minReplicas', workers)}:"
                          f"{elastic.get('maxReplicas', workers)}"),
           ("PET_NPROC_PER_NODE", str(elastic.get("nProcPerNode", nproc)))]
    if "maxRestarts" in elastic:
        env.append(("PET_MAX_RESTARTS", str(elastic["maxRestarts"])))
    if "rdzvId" in elastic:
        env.append(("PET_RDZV_ID", elastic["rdzvId"]))
    if elastic.get("rdzvConf"):
        env.append(("PET_RDZV_CONF", ",".join(f"{c['key']}={c['value']}"
                                              for c in elastic["rdzvConf"])))
    if elastic.get("standalone"):
        env.append(("PET_STANDALONE", ""))  # torchrun then dies parsing '' as an int
    return env


def _port_of(rspec: Mapping[str, Any]) -> int:
    for container in rspec["template"]["spec"]["containers"]:
        for port in container.get("ports", []) if container["name"] == OPERATOR_CONTAINER else []:
            if port.get("name") == OPERATOR_PORT_NAME:
                return port["containerPort"]
    return OPERATOR_DEFAULT_PORT


def _init(job_name: str) -> dict[str, Any]:
    master = f"{job_name}-master-0"
    script = (f"err=1;for i in $(seq 100); do if nslookup {master}; then err=0 && break; fi;"
              f"echo waiting for master; sleep 2; done; exit $err")
    return {"name": "init-pytorch", "image": INIT_IMAGE, "command": ["sh", "-c", script]}


def _indexed_job_pods(job: dict[str, Any], ctx: _Context) -> list[Pod]:
    name = job["metadata"]["name"]
    pods = []
    for index in range(_completions(job)):
        template = copy.deepcopy(job["spec"]["template"])
        meta = template.get("metadata", {})
        # The Job controller's labels: name and uid of the Job (new and shared per Job object).
        labels = {**meta.get("labels", {}), "batch.kubernetes.io/job-name": name,
                  "job-name": name, "batch.kubernetes.io/controller-uid": ctx.job_uid,
                  "controller-uid": ctx.job_uid, INDEX_ANNOTATION: str(index)}
        annotations = {**meta.get("annotations", {}), INDEX_ANNOTATION: str(index)}
        pod_spec = template["spec"]
        pod_spec["hostname"] = f"{name}-{index}"  # the Job controller overrides any template value
        for container in pod_spec.get("initContainers", []) + pod_spec["containers"]:
            env = container.setdefault("env", [])
            if not any(e["name"] == "JOB_COMPLETION_INDEX" for e in env):
                env.append({"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {
                    "fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}}})
        pod_meta = {"name": f"{name}-{index}", "labels": labels, "annotations": annotations}
        names, needs_ready = _subdomain_names(pod_spec, labels, ctx)
        pods.append(_pod(pod_meta, pod_spec, "Indexed", index, names, needs_ready, ctx))
    return pods


def _subdomain_names(pod_spec: Mapping[str, Any], labels: Mapping[str, str],
                     ctx: _Context) -> tuple[list[str], bool]:
    """Names a headless Service gives the pod: only if it is named like the pod's subdomain
    and selects the pod."""
    sub = pod_spec.get("subdomain")
    for svc in ctx.docs:
        spec = svc.get("spec", {})
        if (svc.get("kind") == "Service" and svc["metadata"]["name"] == sub
                and spec.get("clusterIP") == "None" and spec.get("selector")
                and all(labels.get(k) == v for k, v in spec["selector"].items())):
            base = f"{_hostname(pod_spec, '')}.{sub}"
            return ([base, f"{base}.{ctx.namespace}", f"{base}.{ctx.namespace}.svc",
                     f"{base}.{ctx.namespace}.svc.{ctx.domain}"],
                    not spec.get("publishNotReadyAddresses", False))
    return [], True


def _hostname(pod_spec: Mapping[str, Any], pod_name: str) -> str:
    # kubelet: spec.hostname, else the pod name cut to 63 characters without a trailing - or .
    return pod_spec.get("hostname") or pod_name[:63].rstrip("-.")


def _pod(meta: dict[str, Any], pod_spec: dict[str, Any], replica: str, index: int,
         dns_names: list[str], needs_ready: bool, ctx: _Context) -> Pod:
    containers = pod_spec["containers"]
    if len(containers) != 1:
        raise NotImplementedError(f"pod {meta['name']}: {len(containers)} containers; "
                                  "only single-container pods are emulated")
    container = containers[0]
    hostname = _hostname(pod_spec, meta["name"])
    sub = pod_spec.get("subdomain")
    fqdn = f"{hostname}.{sub}.{ctx.namespace}.svc.{ctx.domain}" if sub else hostname
    pod_ctx = {"meta": meta, "spec": pod_spec, "ip": ctx.pod_ips.get(meta["name"])}
    env = _resolve_env(container, pod_ctx, ctx)
    argv = [expand(a, env) for a in container.get("command", []) + container.get("args", [])]
    if not container.get("command"):
        raise NotImplementedError(f"pod {meta['name']}: no command; the image's entrypoint "
                                  "is not known here")
    security = {**pod_spec.get("securityContext", {}), **container.get("securityContext", {})}
    inits = [{"name": c["name"], "image": c["image"],
              "argv": [expand(a, _resolve_env(c, pod_ctx, ctx))
                       for a in c.get("command", []) + c.get("args", [])]}
             for c in pod_spec.get("initContainers", [])]
    return Pod(
        name=meta["name"], hostname=hostname, fqdn=fqdn, namespace=ctx.namespace,
        replica=replica, index=index, labels=meta["labels"], annotations=meta["annotations"],
        container=container["name"], image=container["image"], argv=argv, env=env,
        dns_names=dns_names, dns_requires_ready=needs_ready, init_containers=inits,
        mounts=_mounts(container, pod_spec, ctx), run_as_user=security.get("runAsUser"),
        run_as_group=security.get("runAsGroup"),
        ports={p.get("name", str(p["containerPort"])): p["containerPort"]
               for p in container.get("ports", [])},
        restart_policy=pod_spec.get("restartPolicy", "Always"))


def _resolve_env(container: Mapping[str, Any], pod: Mapping[str, Any],
                 ctx: _Context) -> dict[str, str]:
    if container.get("envFrom"):
        raise NotImplementedError(f"container {container['name']}: envFrom is not emulated")
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        if "valueFrom" in entry:
            value = _value_from(entry["name"], entry["valueFrom"], pod, ctx)
            if value is None:  # an optional Secret (or key) that does not exist: not set
                continue
        else:
            value = expand(entry.get("value", ""), env)  # sees earlier entries only
        env[entry["name"]] = value
    return env


def _value_from(name: str, source: Mapping[str, Any], pod: Mapping[str, Any],
                ctx: _Context) -> str | None:
    meta = pod["meta"]
    if "fieldRef" in source:
        path = source["fieldRef"]["fieldPath"]
        # spec.nodeName is the scheduler's choice: here every pod has a node of its own (the
        # manifests' anti-affinity asks for that), named after the pod.
        simple = {"metadata.name": meta["name"], "metadata.namespace": ctx.namespace,
                  "status.podIP": pod["ip"], "spec.serviceAccountName":
                      pod["spec"].get("serviceAccountName", "default"),
                  "spec.nodeName": pod["spec"].get("nodeName") or f"{meta['name']}-node"}
        keyed = re.match(r"^metadata\.(labels|annotations)\['([^']+)'\]$", path)
        if path in simple and simple[path] is not None:
            return simple[path]
        if path == "status.podIP":
            raise ValueError(f"env {name} reads status.podIP: pass pod_ips={{{meta['name']!r}:"
                             " <its IP>, ...}} (pod_names() lists the pods)")
        if keyed:
            # kubelet gives "" for a label or annotation the pod does not have.
            return meta[keyed.group(1)].get(keyed.group(2), "")
        raise NotImplementedError(f"env {name}: fieldRef {path} is not emulated")
    if "configMapKeyRef" in source:
        ref = source["configMapKeyRef"]
        return _config_map(ref["name"], ctx)[ref["key"]]
    if "secretKeyRef" in source:
        ref = source["secretKeyRef"]
        value = _secret(ref["name"], ctx).get(ref["key"])
        if value is None and not ref.get("optional", False):
            raise ValueError(f"env {name}: secret {ref['name']!r} has no key {ref['key']!r} "
                             "(or does not exist): the kubelet would not start the container "
                             "(CreateContainerConfigError)")
        return value
    raise NotImplementedError(f"env {name}: {sorted(source)} is not emulated")


def _config_map(name: str, ctx: _Context) -> dict[str, str]:
    for doc in ctx.docs:
        if doc.get("kind") == "ConfigMap" and doc["metadata"]["name"] == name:
            return doc.get("data", {})
    raise ValueError(f"ConfigMap {name!r} is not among the manifests: the pod would not start")


def _secret(name: str, ctx: _Context) -> dict[str, str]:
    """A Secret's keys and decoded values as the kubelet hands them to env; {} when absent."""
    for doc in ctx.docs:
        if doc.get("kind") == "Secret" and doc["metadata"]["name"] == name:
            data = {k: base64.b64decode(v).decode() for k, v in (doc.get("data") or {}).items()}
            return {**data, **(doc.get("stringData") or {})}  # the API server's merge
    return {}


def _mounts(container: Mapping[str, Any], pod_spec: Mapping[str, Any],
            ctx: _Context) -> list[Mount]:
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    mounts = []
    for vm in container.get("volumeMounts", []):
        volume, ro = volumes[vm["name"]], vm.get("readOnly", False)
        if "emptyDir" in volume:
            empty = volume["emptyDir"] or {}
            size = empty.get("sizeLimit")
            mounts.append(Mount(vm["mountPath"], "memory" if empty.get("medium") == "Memory"
                                else "emptyDir", ro, quantity_bytes(size) if size else None))
        elif "configMap" in volume:
            data = _config_map(volume["configMap"]["name"], ctx)
            items = volume["configMap"].get("items")
            files = ({i["path"]: data[i["key"]] for i in items} if items else dict(data))
            mounts.append(Mount(vm["mountPath"], "configMap", ro, files=files))
        elif "persistentVolumeClaim" in volume:
            mounts.append(Mount(vm["mountPath"], "persistentVolumeClaim", ro,
                                claim=volume["persistentVolumeClaim"]["claimName"]))
        else:
            raise NotImplementedError(f"volume {vm['name']}: only emptyDir, configMap and "
                                      "persistentVolumeClaim are emulated")
    return mounts


def _set_if(obj: dict[str, Any], key: str, value: Any) -> None:
    if value is not None:
        obj[key] = value


def _set_gpus(resources: dict[str, Any], gpus: int | None) -> None:
    for part in ("requests", "limits"):
        section = resources.setdefault(part, {})
        if gpus == 0:
            section.pop("nvidia.com/gpu", None)
        elif gpus is not None:
            section["nvidia.com/gpu"] = gpus


def _customize_job(doc: dict[str, Any], image: str | None, nodes: int | None,
                   gpus: int | None, nproc: int | None, claim: str | None) -> None:
    spec = doc["spec"]
    if doc["kind"] == "PyTorchJob":
        templates = [r["template"] for r in spec["pytorchReplicaSpecs"].values()]
        _set_if(spec, "nprocPerNode", None if nproc is None else str(nproc))
        if nodes is not None and nodes > 1:
            spec["pytorchReplicaSpecs"]["Worker"]["replicas"] = nodes - 1
        elif nodes == 1:
            spec["pytorchReplicaSpecs"].pop("Worker", None)
    else:
        templates = [spec["template"]]
        _set_if(spec, "completions", nodes)
        _set_if(spec, "parallelism", nodes)
    for pod_spec in (t["spec"] for t in templates):
        for container in pod_spec["containers"]:
            _set_if(container, "image", image)
            _set_gpus(container.setdefault("resources", {}), gpus)
            for entry in container.get("env", []):
                if entry["name"] == "NNODES" and nodes is not None:
                    entry["value"] = str(nodes)
                if entry["name"] == "NPROC_PER_NODE" and nproc is not None:
                    entry["value"] = str(nproc)
        for volume in pod_spec.get("volumes", []):
            if claim and volume["name"] == "reports":
                volume.pop("emptyDir", None)
                volume["persistentVolumeClaim"] = {"claimName": claim}
