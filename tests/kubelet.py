"""A computed pod (tests/k8s_operator.py) as the kubelet would run it: ``docker run`` options.

Shared by the Kubernetes tests (tests/launchers/test_k8s_run.py, test_k8s_node_check.py) and
the fault campaign's Kubernetes launchers (tests/campaign/launchers.py), so that each runs the
manifests' pods with the same emulation:

* securityContext: ``--user runAsUser:runAsGroup``, ``--group-add fsGroup``, capabilities
  dropped/added as written, ``no-new-privileges`` for ``allowPrivilegeEscalation: false``,
  Docker's default seccomp profile for ``RuntimeDefault``; ``runAsNonRoot`` checked as the
  kubelet does. Any other key is refused (NotImplementedError), never ignored;
* ConfigMap volumes: the files written to a host folder, mounted read-only (0644 files);
* emptyDir volumes: a host folder per pod, mode 2777 group fsGroup (the kubelet's emptyDir with
  an ``fsGroup``); the memory emptyDir at /dev/shm: ``--shm-size`` of its ``sizeLimit``;
* a PersistentVolumeClaim: the host folder the caller binds it to (one for every pod: a shared
  volume);
* the termination message: a host file (mode 0666) mounted at /dev/termination-log.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Mapping

from tests import k8s_operator as ko
from tests.sandbox.docker import Container, PodNetwork

# securityContext keys turned into `docker run` options (or checked); any other key is refused.
SECURITY_KEYS = {"runAsUser", "runAsGroup", "runAsNonRoot", "fsGroup", "fsGroupChangePolicy",
                 "seccompProfile", "allowPrivilegeEscalation", "privileged", "capabilities"}


def pod_spec(docs: list[dict[str, Any]], pod: ko.Pod) -> dict[str, Any]:
    """The pod template's spec that ``pod`` was made from (for the pod-level securityContext)."""
    job = next(d for d in ko.expanded(docs) if d["kind"] in ("PyTorchJob", "Job", "DaemonSet"))
    if job["kind"] == "PyTorchJob":
        return job["spec"]["pytorchReplicaSpecs"][pod.replica]["template"]["spec"]
    return job["spec"]["template"]["spec"]


def security_options(spec: dict[str, Any], pod: ko.Pod) -> tuple[str, list[str]]:
    """``--user`` value and further ``docker run`` options for the pod's securityContexts.

    Pod-level fields apply unless the container sets them (the kubelet's merge); the kubelet
    refuses to start a container whose runAsNonRoot contradicts its user.
    """
    (container,) = spec["containers"]
    pod_sc, ctr_sc = spec.get("securityContext", {}), container.get("securityContext", {})
    merged = {**pod_sc, **ctr_sc}
    unknown = set(merged) - SECURITY_KEYS
    if unknown:
        raise NotImplementedError(f"securityContext fields not emulated: {sorted(unknown)}")
    if pod.run_as_user is None or pod.run_as_group is None:
        raise ValueError("runAsUser/runAsGroup unset: the pod would run as the image's user")
    if merged.get("runAsNonRoot") and pod.run_as_user == 0:
        raise ValueError("runAsNonRoot with runAsUser 0: the kubelet refuses it")
    extra = []
    if "fsGroup" in pod_sc:  # the kubelet adds fsGroup to the container's supplementary groups
        extra.append(f"--group-add={pod_sc['fsGroup']}")
    caps = merged.get("capabilities", {})
    extra += [f"--cap-drop={c}" for c in caps.get("drop", [])]
    extra += [f"--cap-add={c}" for c in caps.get("add", [])]
    if merged.get("allowPrivilegeEscalation") is False:
        extra.append("--security-opt=no-new-privileges")
    if merged.get("privileged"):
        raise NotImplementedError("privileged pods are not run here")
    seccomp = merged.get("seccompProfile", {}).get("type", "RuntimeDefault")
    if seccomp != "RuntimeDefault":
        raise NotImplementedError(f"seccompProfile {seccomp} is not emulated")
    # RuntimeDefault = the runtime's default profile: Docker applies its own unless told not to.
    return f"{pod.run_as_user}:{pod.run_as_group}", extra


def volumes(pod: ko.Pod, spec: dict[str, Any], root: Path,
            claims: Mapping[str, Path] | None = None) -> tuple[list[str], str, dict]:
    """Host folders for the pod's mounts (under ``root``; a PVC at its folder in ``claims``):
    ``-v`` values, /dev/shm size, mount path → host folder."""
    root.mkdir(parents=True)
    fs_group = spec.get("securityContext", {}).get("fsGroup")
    binds, shm_size, host_of = [], None, {}
    for i, mount in enumerate(pod.mounts):
        if mount.kind == "memory":
            if mount.path != "/dev/shm" or not mount.size_limit_bytes:
                raise NotImplementedError(f"memory emptyDir at {mount.path} without a sizeLimit "
                                          "at /dev/shm: not emulated (unbounded)")
            shm_size = str(mount.size_limit_bytes)  # bytes; Docker's unit-less default
            continue
        folder = root / f"vol{i}"
        if mount.kind == "configMap":
            # The kubelet writes each key as a file, mode 0644 (defaultMode), in a folder every
            # user can read, and mounts configMap volumes read-only whatever the pod says.
            folder.mkdir()
            for name, text in mount.files.items():
                (folder / name).write_text(text)
                (folder / name).chmod(0o644)
            folder.chmod(0o755)
            binds.append(f"{folder}:{mount.path}:ro")
        elif mount.kind == "emptyDir":
            # The kubelet creates an emptyDir 0777; with fsGroup it then gives it that group
            # and the setgid bit, so files made in it keep the group.
            folder.mkdir()
            if fs_group is not None:
                os.chown(folder, 0, fs_group)
            folder.chmod(0o777 if fs_group is None else 0o2777)
            binds.append(f"{folder}:{mount.path}{':ro' if mount.read_only else ''}")
        elif mount.kind == "persistentVolumeClaim" and mount.claim in (claims or {}):
            folder = Path(claims[mount.claim])
            binds.append(f"{folder}:{mount.path}{':ro' if mount.read_only else ''}")
        else:
            raise NotImplementedError(f"volume kind {mount.kind} at {mount.path}: not emulated")
        host_of[mount.path] = folder
    if not shm_size:
        raise ValueError("no memory emptyDir at /dev/shm: the runtime's 64 MiB default applies")
    return binds, shm_size, host_of


def host_path(host_of: dict[str, Path], path: str) -> Path:
    """The host path of a path inside the container, through its bind mounts."""
    for inside, folder in sorted(host_of.items(), key=lambda kv: -len(kv[0])):
        if path == inside or path.startswith(inside.rstrip("/") + "/"):
            return folder / os.path.relpath(path, inside)
    raise AssertionError(f"{path} is on no volume: it dies with the container")


def start_pods(net: PodNetwork, docs: list[dict[str, Any]], pods: list[ko.Pod],
               ips: dict[str, str], start_order: list[ko.Pod], root: Path,
               claims: Mapping[str, Path] | None = None,
               more=lambda pod: ({}, []),
               before=lambda: None) -> tuple[dict[str, Any], dict[str, Container]]:
    """Starts every pod (in ``start_order``); returns {name: {pod, net_pod, host_of, message,
    opts}} with ``"_start"`` (monotonic) and the containers by pod name. ``more(pod)``: env
    and ``-v`` values the caller adds to a pod (a file a node reads, a campaign's marker);
    ``before()``: called once every pod's network namespace exists, before any container
    starts (a fault that must be there first)."""
    runs: dict[str, Any] = {}
    for pod in pods:
        spec = pod_spec(docs, pod)
        user, security = security_options(spec, pod)
        binds, shm_size, host_of = volumes(pod, spec, root / pod.name, claims)
        message = root / pod.name / "termination-log"  # the kubelet's terminationMessagePath
        message.touch(mode=0o666)
        message.chmod(0o666)
        binds.append(f"{message}:/dev/termination-log")
        env, added = more(pod)
        net_pod = net.add_pod(pod.hostname, ips[pod.name],
                              etc_hosts=ko.etc_hosts(pod, pods, ips))
        runs[pod.name] = dict(pod=pod, net_pod=net_pod, host_of=host_of, message=message,
                              opts=dict(command=pod.argv, env={**pod.env, **env},
                                        volumes=binds + list(added), user=user,
                                        shm_size=shm_size, extra=security))
    before()
    containers: dict[str, Container] = {}
    runs["_start"] = time.monotonic()
    for pod in start_order:
        run = runs[pod.name]
        containers[pod.name] = net.run(run["net_pod"], pod.image, **run["opts"])
    return runs, containers


def wait_all_ended(containers: list[Container], timeout_s: float) -> list[int | None]:
    """Exit statuses once every container has exited (None for one still running at timeout)."""
    deadline = time.monotonic() + timeout_s
    statuses: list[int | None] = []
    for container in containers:
        try:
            statuses.append(container.wait(max(1.0, deadline - time.monotonic())))
        except Exception:  # noqa: BLE001 — still running at the deadline
            statuses.append(None)
    return statuses
