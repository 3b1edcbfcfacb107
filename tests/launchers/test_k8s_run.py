"""Kubernetes layer 3 (issue 8): the manifests' pods, run for real, rendezvous and pass.

For ``k8s/`` (the PyTorchJob) and ``k8s/indexed-job/`` (the operator-free Indexed Job): the
manifests are loaded as ``kubectl apply -f`` reads them, edited as the README tells a user to
(image, 2 nodes, no GPU, 1 process per pod), and ``tests/k8s_operator.py`` computes each pod as
the Training Operator v1.9.4 / the Job controller and the kubelet would build it: argv after
``$(VAR)`` expansion, the final env (the operator's appended variables, ``JOB_COMPLETION_INDEX``,
downward-API values such as the pod IP), hostname, mounts, user. Each pod then runs on the real
Docker engine of ``tests/sandbox/docker.py`` as a container of the image built from ``docker/``,
in its own network namespace on a private bridge, with exactly that and nothing else:

* argv, env, hostname: the computed ones (``command`` replaces the image's ENTRYPOINT);
* names: every name cluster DNS would answer (the per-pod headless Services of the operator;
  ``<job>-<i>.<svc>`` of the Indexed Job's Service) and the pod's own FQDN, as /etc/hosts lines;
* ConfigMap volumes: the ConfigMap's files written to a host folder, mounted read-only (0644 files,
  as the kubelet writes them);
* emptyDir volumes: a host folder per pod, mode 2777 group fsGroup (the kubelet's emptyDir with
  an ``fsGroup``); the memory emptyDir at /dev/shm: ``--shm-size`` of its ``sizeLimit``;
* the termination message: a host file (mode 0666) mounted at /dev/termination-log, as the
  kubelet mounts one at terminationMessagePath;
* pod deletion and activeDeadlineSeconds: SIGTERM to the container's PID 1, as the kubelet sends;
* a failed pod: what its controller does to the others (``k8s_operator.on_pod_failure``): let
  them run (their logs stay) or delete them (their logs go);
* securityContext: ``--user runAsUser:runAsGroup``, ``--group-add fsGroup``, capabilities
  dropped/added as written, ``no-new-privileges`` for ``allowPrivilegeEscalation: false``,
  Docker's default seccomp profile for ``RuntimeDefault``; ``runAsNonRoot`` checked as the
  kubelet does. Anything else in a securityContext fails the test instead of being ignored.

Not run: the operator's init container (``alpine:3.10``, ``nslookup <job>-master-0``), which no
offline machine can pull; its one effect, the Worker starting after the Master exists, is kept by
starting the Master first. The Indexed Job's pods are started highest index first: the Job
controller promises no order, and the pod that hosts the c10d store starting last is the worst
case. Resource requests/limits are not applied (16 CPUs do not exist here); cluster DNS is a
static table, so names that a real cluster answers only once a pod is Ready answer at once here.

The pods must rendezvous (c10d, over real TCP between the namespaces) and the pod that ran rank 0
must hold ``report.json`` in its /reports and print it as the ``ddp-smoke-report.json: `` log
line that the manifests' headers tell users to grep: verdict pass, 2 ranks on 2 nodes, hosts =
the pods' hostnames. The checks are the ConfigMaps' own list, unedited. Every pod ran preflight
first (the rendezvous host's heard both hellos), and the rendezvous host's pod ran the kit's
store host (issue 24). The PyTorchJob runs with the Secret the README says to create (``kubectl
create secret generic ddp-smoke-secret --from-literal=secret=…``): its report is signed; the
Indexed Job runs without one (the reference is optional): it still passes, unsigned, and says so.

Rank 0's worker SIGKILLed mid-check (issue 24): the PyTorchJob's pods, rank 0 held at ddp_step
(``hang``) until rank 1 waits for it there, then killed from outside by PID as the OOM killer
does. A survivor or the Master's store host must write the report naming exactly rank 0, within
the stage deadline + 10 s of the kill, and a pod must log it.
"""
from __future__ import annotations

import base64
import ipaddress
import json
import os
import shlex
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import k8s_operator as ko, kubelet, report_schema, store_kill
from tests.launch import paced
from tests.sandbox import hosts
from tests.sandbox.docker import (REPO, BuiltImage, Container, PodNetwork,  # noqa: F401
                                  docker_engine, wait_all, worker_image)

# The first test of a session pays for a cold image build (≈ 3–4 min, see test_docker.py); a warm
# run takes well under a minute per job. Every wait below has its own, shorter bound.
pytestmark = pytest.mark.timeout(900)

PREFIX, SUBNET = "dsk", "10.231.4.0/24"  # this file's own pods, bridge and addresses
NODES, NPROC = 2, 1
RUN_TIMEOUT_S = 240  # a 2-pod run of the ConfigMap's checks takes < 1 min; a hang must end
REPORT_LINE = "ddp-smoke-report.json: "
# The Secret of the README's one-liner; its value here is this file's own.
SECRET_NAME, SECRET_KEY, SECRET = "ddp-smoke-secret", "secret", os.urandom(32).hex()
STORE_PORT = 29401  # the rendezvous port + 1: the manifests' store host
KILL_TIMEOUT_S = 30  # the killed run's stage deadline: its report must come within it + 10 s


@pytest.fixture
def k8s_net(docker_engine, worker_image: BuiltImage):
    """A PodNetwork with this file's prefix and subnet, removed after the test."""
    reason = hosts.missing_requirements()
    if reason:
        pytest.skip(reason)
    with PodNetwork(docker_engine, worker_image.tag, prefix=PREFIX, subnet=SUBNET) as net:
        yield net


# -- one job, run -----------------------------------------------------------------------------------

def _customized(folder: Path, image: str) -> list[dict[str, Any]]:
    """The folder's manifests with the README's edits for this machine (CPU, 2 nodes, 1 rank)."""
    docs = ko.customize(ko.load_manifests(folder), image=image, nodes=NODES, gpus_per_node=0,
                        nproc_per_node=NPROC)
    job = next(d for d in docs if d["kind"] in ("PyTorchJob", "Job"))
    templates = ([r["template"] for r in job["spec"]["pytorchReplicaSpecs"].values()]
                 if job["kind"] == "PyTorchJob" else [job["spec"]["template"]])
    for container in (c for t in templates for c in t["spec"]["containers"]):
        resources = container.get("resources", {})  # the README's CPU edit: no GPU request left
        assert not any("nvidia.com/gpu" in resources.get(k, {}) for k in ("requests", "limits"))
    return docs


def _config_checks(docs: list[dict[str, Any]]) -> list[str]:
    (config,) = [d for d in docs if d["kind"] == "ConfigMap"]
    return yaml.safe_load(config["data"]["config.yaml"])["checks"]


def _run_job(net: PodNetwork, docs: list[dict[str, Any]], pods: list[ko.Pod],
             ips: dict[str, str], start_order: list[ko.Pod], tmp_path: Path) -> dict[str, Any]:
    """Runs every pod, waits, and returns {name: {status, logs, host_of, pod, message}} per pod.

    Once a pod has failed, the others are treated as their controller treats them: left to
    finish (bounded), or deleted, their logs lost with them.
    """
    runs, containers = kubelet.start_pods(net, docs, pods, ips, start_order, tmp_path)
    statuses = wait_all([containers[p.name] for p in pods], RUN_TIMEOUT_S)
    job = next(d for d in docs if d["kind"] in ("PyTorchJob", "Job"))
    if any(s not in (None, 0) for s in statuses) and None in statuses:
        if ko.on_pod_failure(job) == "continue":
            statuses = kubelet.wait_all_ended([containers[p.name] for p in pods], RUN_TIMEOUT_S)
        else:
            for pod, status in zip(pods, statuses):
                if status is None:  # deleted: no exit status, no log, no message
                    net.engine.docker("rm", "-f", containers[pod.name].name, check=False)
    elapsed = time.monotonic() - runs.pop("_start")
    for pod, status in zip(pods, statuses):
        logs = containers[pod.name].logs() if status is not None else ""
        # the pod's stdout alone (`logs` is stdout, then stderr): where its last line is
        stdout = net.engine.docker("logs", containers[pod.name].name, check=False).stdout \
            if status is not None else ""
        runs[pod.name].update(status=status, logs=logs, stdout=stdout,
                              message=runs[pod.name]["message"].read_text())
    runs["_elapsed_s"] = elapsed
    return runs


def _describe(runs: dict[str, Any]) -> str:
    """Every pod's `docker run` essentials, exit status and log, for an assertion message."""
    parts = [f"elapsed {runs['_elapsed_s']:.1f} s"]
    for name, run in runs.items():
        if name.startswith("_"):
            continue
        parts.append(f"--- pod {name} (hostname {run['pod'].hostname}, exit {run['status']}) "
                     f"argv: {shlex.join(run['pod'].argv)[:200]}…\n{run['logs'][-6000:]}")
    return "\n".join(parts)


def _secret_doc() -> dict[str, Any]:
    """What ``kubectl create secret generic ddp-smoke-secret --from-literal=secret=…`` makes."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": SECRET_NAME},
            "data": {SECRET_KEY: base64.b64encode(SECRET.encode()).decode()}}


def _assert_ran_before_torchrun(runs: dict[str, Any], pods: list[ko.Pod], host: ko.Pod,
                                store: str) -> None:
    """Every pod's preflight passed, the rendezvous host's heard every pod; that pod (only)
    served the kit's store, at ``store``, which every pod was given."""
    info = _describe(runs)
    for pod in pods:
        logs = runs[pod.name]["logs"]
        assert f"ddp-smoke preflight: {pod.hostname} ok in " in logs, info
        record = json.loads(kubelet.host_path(
            runs[pod.name]["host_of"],
            f"{pod.env['REPORT_DIR']}/preflight/{pod.hostname}.json").read_text())
        assert record["ok"] and record["run_id"] == pod.env["DDP_SMOKE_RUN_ID"], record
        if pod is host:
            assert sorted(record["joined"].values()) == sorted(p.hostname for p in pods), record
        served = f"serving the coordination store at {store} " in logs
        assert served == (pod is host), info


def _assert_passing_report(runs: dict[str, Any], pods: list[ko.Pod],
                           checks: list[str], signed: bool) -> dict[str, Any]:
    """The pod that ran rank 0 kept report.json in /reports and logged it; it says pass,
    signed or not as the pods were given a secret or not. A check failed on pace alone is
    taken for a pass, and printed: two pods and another test's ranks share two cores here,
    and who arrives last is then the scheduler's (:func:`tests.launch.paced`)."""
    info = _describe(runs)
    holders = []
    for pod in pods:
        path = kubelet.host_path(runs[pod.name]["host_of"],
                                 f"{pod.env['REPORT_DIR']}/report.json")
        lines = [ln for ln in runs[pod.name]["logs"].splitlines() if ln.startswith(REPORT_LINE)]
        if path.exists():
            holders.append(pod)
            assert path.stat().st_uid == pod.run_as_user, "report not written as runAsUser"
            report = report_schema.read(path)
            assert len(lines) == 1, info
            assert json.loads(lines[0][len(REPORT_LINE):]) == report, info  # the log = the file
        else:
            assert lines == [], info  # a pod without the report prints no report line
    assert len(holders) == 1, f"report.json in {[p.name for p in holders]}\n{info}"
    # rank 0's pod said each check as it was judged, while the run went (issue 51)
    said = [ln.split()[2] for ln in runs[holders[0].name]["logs"].splitlines()
            if ln.startswith("ddp-smoke: [")]
    assert said == checks, info
    slow = paced(report)
    verdict = "fail" if slow else "pass"
    assert [runs[p.name]["status"] for p in pods] == [1 if slow else 0] * len(pods), info
    for pod in pods:  # the one-line verdict as termination message; the others say where it is
        message = runs[pod.name]["message"]
        assert message.startswith(f"ddp-smoke {verdict.upper()} · run ") if pod in holders else (
            "no report in this pod" in message), (pod.name, message)
        # the pod's log ends on that line (issue 35), after the report's JSON line
        assert runs[pod.name]["stdout"].rstrip().splitlines()[-1] == message.strip(), info
    assert (report["verdict"], report["world_size"], report["nodes"], report["backend"]) == (
        verdict, NODES * NPROC, NODES, "gloo"), info
    assert sorted(r["host"] for r in report["ranks"]) == sorted(p.hostname for p in pods), info
    assert sorted(r["rank"] for r in report["ranks"]) == list(range(NODES * NPROC))
    assert {r["local_rank"] for r in report["ranks"]} == {0}
    # transport and health skip on these CPU pods, with their reasons (no NCCL, no NVML/HCAs).
    assert [(c["name"], c["status"]) for c in report["checks"]] == [
        (name, "skip" if name in ("transport", "health") else "fail" if name in slow else "pass")
        for name in checks], info
    assert report["security"]["signed"] is signed, report["security"]
    assert report["security"].get("findings", []) == [], report["security"]
    # never logged, never reported
    assert not any(SECRET in runs[p.name]["logs"] for p in pods) and SECRET not in json.dumps(report)
    return report


def _ips(docs: list[dict[str, Any]]) -> dict[str, str]:
    """Pod name → address in this file's subnet (.11, .12, …), in the controllers' order."""
    net = ipaddress.ip_network(SUBNET)
    return {name: str(net[11 + i]) for i, name in enumerate(ko.pod_names(docs))}


# -- the tests --------------------------------------------------------------------------------------

def test_pytorchjob_pods_rendezvous_and_pass(k8s_net: PodNetwork, worker_image: BuiltImage,
                                             tmp_path):
    docs = _customized(REPO / "k8s", worker_image.tag) + [_secret_doc()]
    ips = _ips(docs)
    pods = ko.compute_pods(docs, pod_ips=ips)
    master, worker = pods
    # The kubelet hands every pod the Secret's value (secretKeyRef): one secret for the run.
    assert {p.env["DDP_SMOKE_SECRET"] for p in pods} == {SECRET}
    # What the operator gives the pods, from the manifest alone (nothing set by this test).
    assert (master.hostname, worker.hostname) == ("ddp-smoke-master-0", "ddp-smoke-worker-0")
    for pod in pods:
        assert (pod.env["MASTER_ADDR"], pod.env["MASTER_PORT"], pod.env["PET_NNODES"],
                pod.env["PET_NPROC_PER_NODE"], pod.env["WORLD_SIZE"]) == (
            "ddp-smoke-master-0", "29400", "2", "1", "2"), pod.env
        assert pod.env["POD_IP"] == ips[pod.name] and pod.image == worker_image.tag
    assert (master.env["RANK"], worker.env["RANK"]) == ("0", "1")
    # The one part not run: the Worker's init container waits for the Master's name.
    assert master.init_containers == []
    (init,) = worker.init_containers
    assert init["image"] == ko.INIT_IMAGE and "nslookup ddp-smoke-master-0" in init["argv"][-1]

    runs = _run_job(k8s_net, docs, pods, ips, start_order=[master, worker], tmp_path=tmp_path)
    _assert_passing_report(runs, pods, _config_checks(docs), signed=True)
    _assert_ran_before_torchrun(runs, pods, master, f"ddp-smoke-master-0:{STORE_PORT}")


def test_indexed_job_pods_rendezvous_and_pass(k8s_net: PodNetwork, worker_image: BuiltImage,
                                              tmp_path):
    docs = _customized(REPO / "k8s" / "indexed-job", worker_image.tag)
    ips = _ips(docs)
    pods = ko.compute_pods(docs, pod_ips=ips)
    assert [(p.hostname, p.env["JOB_COMPLETION_INDEX"]) for p in pods] == [
        ("ddp-smoke-indexed-0", "0"), ("ddp-smoke-indexed-1", "1")]
    for pod in pods:
        assert pod.env["RDZV_ENDPOINT"] == "ddp-smoke-indexed-0.ddp-smoke-indexed:29400"
        assert (pod.env["NNODES"], pod.env["NPROC_PER_NODE"], pod.env["POD_IP"]) == (
            "2", "1", ips[pod.name])
        # Index 0's Service name resolves in every pod, before anything is Ready.
        assert ko.etc_hosts(pod, pods, ips)["ddp-smoke-indexed-0.ddp-smoke-indexed"] == ips[
            pods[0].name]
    assert not pods[0].dns_requires_ready  # publishNotReadyAddresses: true
    assert pods[0].fqdn == "ddp-smoke-indexed-0.ddp-smoke-indexed.default.svc.cluster.local"

    # No Secret here: the reference is optional, the run goes on unsigned and says so.
    assert not any("DDP_SMOKE_SECRET" in p.env for p in pods)

    # No order among an Indexed Job's pods: the store's host (index 0) starts last here.
    runs = _run_job(k8s_net, docs, pods, ips, start_order=pods[::-1], tmp_path=tmp_path)
    _assert_passing_report(runs, pods, _config_checks(docs), signed=False)
    _assert_ran_before_torchrun(runs, pods, pods[0],
                                f"ddp-smoke-indexed-0.ddp-smoke-indexed:{STORE_PORT}")


def _with_config(docs: list[dict[str, Any]], **extra: Any) -> list[dict[str, Any]]:
    """The docs with keys added to the worker's ConfigMap (as a user would edit it)."""
    (config,) = [d for d in docs if d["kind"] == "ConfigMap"]
    values = {**yaml.safe_load(config["data"]["config.yaml"]), **extra}
    config["data"]["config.yaml"] = yaml.safe_dump(values)
    return docs


def test_indexed_job_pod_failure_keeps_rank_0s_report(k8s_net: PodNetwork,
                                                      worker_image: BuiltImage, tmp_path):
    """Rank 1 dies: its pod fails first. backoffLimitPerIndex lets the pod that ran rank 0 run
    on, write the failing report naming rank 1 and log it (backoffLimit: 0 would have deleted
    that pod with its log)."""
    docs = _with_config(_customized(REPO / "k8s" / "indexed-job", worker_image.tag),
                        checks=["environment", "ddp_step"], fault="1:crash@ddp_step")
    ips = _ips(docs)
    pods = ko.compute_pods(docs, pod_ips=ips)
    runs = _run_job(k8s_net, docs, pods, ips, start_order=pods, tmp_path=tmp_path)
    info = _describe(runs)
    assert sorted(runs[p.name]["status"] for p in pods) == [1, 1], info
    lines = [ln for p in pods for ln in runs[p.name]["logs"].splitlines()
             if ln.startswith(REPORT_LINE)]
    assert len(lines) == 1, info
    report = report_schema.validate(json.loads(lines[0][len(REPORT_LINE):]), "logged report")
    assert report["verdict"] == "fail", info
    named = {c["rank"] for check in report["checks"] for c in check["culprits"]}
    if report.get("error"):
        named.add(report["error"].get("rank"))
    assert 1 in named, info
    messages = [runs[p.name]["message"] for p in pods]
    # The report's holder: its verdict in one line, naming the culprit, for `kubectl describe`;
    # a practice run's (the fault was injected) says so first (issue 35). The same line ends
    # that pod's log.
    holder = [p for p in pods if runs[p.name]["message"].startswith(
        "ddp-smoke FAIL (PRACTICE: --fault 1:crash@ddp_step) · run ")]
    assert len(holder) == 1 and "rank 1 ddp-smoke-indexed-" in runs[holder[0].name]["message"], \
        messages
    assert runs[holder[0].name]["stdout"].rstrip().splitlines()[-1] == \
        runs[holder[0].name]["message"].strip(), info


def test_pod_deletion_reaches_the_workers(k8s_net: PodNetwork, worker_image: BuiltImage,
                                          tmp_path):
    """The kubelet stops a deleted pod (or one past activeDeadlineSeconds) with SIGTERM to the
    container's PID 1, the manifest's sh. Passed on to torchrun, it stops the workers within
    seconds; ignored, the pods would run on until the worker's own 90 s timeout."""
    docs = _with_config(_customized(REPO / "k8s", worker_image.tag),
                        checks=["environment", "ddp_step"], fault="0:hang@ddp_step")
    ips = _ips(docs)
    pods = ko.compute_pods(docs, pod_ips=ips)
    runs, containers = kubelet.start_pods(k8s_net, docs, pods, ips, pods, tmp_path)
    deadline = time.monotonic() + 120

    def workers_up(container: Container) -> bool:  # torchrun starts them as `python -u -m …`
        probe = ("import glob; print(any(b'-u\\0-m\\0ddp_smoke' in open(p, 'rb').read() "
                 "for p in glob.glob('/proc/[0-9]*/cmdline')))")
        out = k8s_net.engine.docker("exec", container.name, "python3", "-c", probe,
                                    check=False).stdout
        return out.strip() == "True"

    while not all(workers_up(c) for c in containers.values()):
        assert time.monotonic() < deadline, "\n".join(c.logs() for c in containers.values())
        time.sleep(0.5)
    time.sleep(5)  # past the rendezvous: rank 0 now hangs before ddp_step
    sent = time.monotonic()
    for container in containers.values():
        k8s_net.engine.docker("kill", "--signal=TERM", container.name)
    statuses = kubelet.wait_all_ended(list(containers.values()), 30)
    stopped_s = time.monotonic() - sent
    logs = "\n".join(f"--- {n}\n{c.logs()[-3000:]}" for n, c in containers.items())
    assert None not in statuses, f"still running 30 s after SIGTERM\n{logs}"
    assert 137 not in statuses, logs  # ended by the signal passed on, not by a SIGKILL
    assert logs.count("death signal, shutting down workers") == len(pods), logs
    print(f"\nSIGTERM -> every pod ended in {stopped_s:.1f} s; statuses {statuses}")


def test_pytorchjob_rank0_killed_the_report_names_it(k8s_net: PodNetwork,
                                                     worker_image: BuiltImage, tmp_path):
    """Issue 24: rank 0's worker SIGKILLed mid-check. The kit's store lives in the Master's
    store host, not in a torchrun agent that leaves with its worker: a survivor, or the store
    host when the survivor's agent stopped it first, writes the report naming rank 0."""
    docs = _with_config(_customized(REPO / "k8s", worker_image.tag) + [_secret_doc()],
                        checks=["environment", "ddp_step"], fault="0:hang@ddp_step",
                        timeout=KILL_TIMEOUT_S)
    ips = _ips(docs)
    pods = ko.compute_pods(docs, pod_ips=ips)
    runs, containers = kubelet.start_pods(k8s_net, docs, pods, ips, pods, tmp_path)
    end, master = time.monotonic() + 240, containers[pods[0].name]
    while "serving the coordination store at " not in master.logs():  # the Master's store host
        assert time.monotonic() < end, "\n".join(c.logs() for c in containers.values())
        time.sleep(0.5)
    store = store_kill.store_at(ips[pods[0].name], STORE_PORT, timeout_s=10)
    store_kill.wait_arrived(store, "ddp_step", [1], 240)
    pids = store_kill.workers(run_id=pods[0].env["DDP_SMOKE_RUN_ID"])
    assert sorted(pids) == [0, 1], pids
    killed = store_kill.kill([pids[0]])
    paths = {p.name: kubelet.host_path(runs[p.name]["host_of"],
                                       f"{p.env['REPORT_DIR']}/report.json")
             for p in pods}
    written, holder = None, None
    while written is None and time.monotonic() < killed + KILL_TIMEOUT_S + 10:
        holder = next((n for n, path in paths.items() if path.exists() and path.stat().st_size),
                      None)
        written = time.monotonic() if holder else None
        time.sleep(0.1)
    statuses = kubelet.wait_all_ended(list(containers.values()), 120)
    logs = "\n".join(f"--- {n} (exit {s})\n{c.logs()[-5000:]}"
                     for (n, c), s in zip(containers.items(), statuses))
    assert written is not None, f"no report within {KILL_TIMEOUT_S + 10} s of the kill\n{logs}"
    report = report_schema.read(paths[holder])
    host_of = {r["rank"]: r["host"] for r in report["ranks"]}
    culprits = {(c["rank"], c["host"]) for ch in report["checks"] for c in ch["culprits"]}
    writer = report["written_by"]
    print(f"\nk8s pods, rank 0 SIGKILLed: report {written - killed:.1f} s after the kill, "
          f"written by {writer} in pod {holder}; culprits {sorted(culprits)}")
    assert report["verdict"] == "fail", logs
    # (the store host's report of last resort has no security section: it read signed records)
    assert report.get("security", {}).get("signed", writer == "store host") is True, logs
    assert culprits == {(0, host_of[0])} and host_of[0] in {p.hostname for p in pods}, logs
    # The writer: rank 1, unless its torchrun agent stopped it first (the Master's agent hosts
    # torchrun's rendezvous store and leaves with its killed worker): then the store host.
    assert writer in ("rank 1 (took over from rank 0)", "store host"), logs
    assert None not in statuses, logs
    lines = [ln for c in containers.values() for ln in c.logs().splitlines()
             if ln.startswith(REPORT_LINE)]
    assert [json.loads(ln[len(REPORT_LINE):]) for ln in lines] == [report], logs  # logged once
