"""Each launcher, started as its users start it, on the campaign's shared real parts.

A :class:`Launch` is one run of one cell: plain ``torchrun`` (``--standalone`` on one machine,
c10d across namespace hosts), ``make smoke-local``, ``sbatch slurm/ddp_smoke.sbatch`` on the
sandbox Slurm cluster, the image on pods (``docker run`` per node, the entrypoint as in
Kubernetes), ``ddp-smoke-submit`` (submitit: local, or Slurm across nodes), and the PyTorchJob of
``k8s/`` (its pods as the Training Operator and the kubelet make them, tests/k8s_operator.py and
tests/kubelet.py, on the same pod network: ``docker/pod.sh`` under the manifest's own
securityContext, ConfigMap, Secret and a shared report volume), and ``node-check`` as the
Slurm cluster's HealthCheckProgram and as the DaemonSet of ``k8s/node-check`` (its outcome the
nodes it drained or labelled fail, with their reasons). The campaign
finds the run's processes as root sees them (their environment carries the cell's marker),
reads its coordination store through the address a worker was given, and waits for the
launcher to end by itself.

:class:`Parts` holds what cells share: a HostSandbox of four nodes, a four-node Slurm cluster
(one more with two nodes of one hostname, for that fault), the Docker engine, the image and a
pod network; each made on first use and torn down once at the end.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from ddp_smoke.coordination import fate
from tests.launch import REPO, record_value
from tests.multinode import node_env, torchrun_argv
from tests.sandbox.hosts import HostSandbox, host_command, missing_requirements

BIN = Path(sys.executable).parent
TEMPLATE = REPO / "slurm" / "ddp_smoke.sbatch"
HOSTS_PREFIX, HOSTS_SUBNET = "dcp", "10.231.9.0/24"
HOSTS_RAIL = "10.231.19.0/24"  # rail 1 (eth1) of the plain-torchrun hosts
SLURM_PREFIX, SLURM_SUBNET = "dcs", "10.231.10.0/24"
DUP_PREFIX, DUP_SUBNET = "dcu", "10.231.12.0/24"
PODS_PREFIX, PODS_SUBNET = "dcd", "10.231.11.0/24"
NODES = 4  # the largest shape's
STORE_LINE = re.compile(r"serving the coordination store at (\S+):(\d+)")  # a store host's


def _processes():
    """(pid, argv bytes, environment) of every process root can read."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes()
                env = dict(kv.split(b"=", 1) for kv in
                           (entry / "environ").read_bytes().split(b"\0") if b"=" in kv)
            except OSError:
                continue
            yield int(entry.name), cmd, env


def _rank_of(pid: int, cmd: bytes, env: dict) -> int | None:
    """The rank a worker process is, by how its launcher started it; None for another."""
    head = cmd.split(b"\0")[:4]  # the program and its module, not the options
    if [b"-m", b"submitit.core._submit"] == head[-2:] or \
            b"submitit.core._submit" in head:  # one submitit task per rank
        rank = env.get(b"SUBMITIT_LOCAL_GLOBALID") or env.get(b"SLURM_PROCID")
    elif b"ddp_smoke" in head and b"-m" in head and b"TORCHELASTIC_RUN_ID" in env:
        rank = env.get(b"RANK")  # torchrun's worker (not a pod's preflight, whose
        # environment holds the operator's RANK too)
    elif b"ddp_smoke.launch_local" in head:  # make smoke-local's ranks: forked, named
        rank = fate.rank_named(pid)
    else:
        return None
    return None if rank is None else int(rank)


class Parts:
    """The real parts cells share, made on first use (see the module docstring)."""

    def __init__(self, work: Path):
        self.work = work
        self._stack = contextlib.ExitStack()
        self._made: dict[str, object] = {}
        self._dup = None  # the Slurm cluster with two nodes of one hostname, while it is up

    def _make(self, key: str, factory):
        if key not in self._made:
            self._made[key] = self._stack.enter_context(factory())
        return self._made[key]

    def hosts(self) -> HostSandbox:
        return self._make("hosts", lambda: HostSandbox(HOSTS_PREFIX, HOSTS_SUBNET, NODES,
                                                       rail_subnets=(HOSTS_RAIL,)))

    def slurm(self, dup: tuple[int, int] | None = None):
        """The four-node cluster; with ``dup``, one whose node dup[1] has node dup[0]'s
        hostname (one such cluster at a time: they share a prefix)."""
        from tests.sandbox.slurm import SlurmSandbox
        if dup is None:
            return self._make("slurm", lambda: SlurmSandbox(
                NODES, str(self.work / "slurm"), prefix=SLURM_PREFIX, subnet=SLURM_SUBNET))
        if self._dup is not None and self._dup.same_hostname != dup:
            self._dup.down()
            self._dup = None
        if self._dup is None:
            self._dup = SlurmSandbox(NODES, str(self.work / f"slurm-dup{dup[0]}{dup[1]}"),
                                     prefix=DUP_PREFIX, subnet=DUP_SUBNET,
                                     same_hostname=dup).up()
        return self._dup

    def docker(self):
        from tests.sandbox import docker
        engine = self._make("engine", lambda: _started(docker.Engine()))
        image = self._made.get("image") or self._made.setdefault("image",
                                                                 docker.build_image(engine))
        return engine, image

    def close(self) -> None:
        try:
            if self._dup is not None:
                self._dup.down()
        finally:
            self._stack.close()


@contextlib.contextmanager
def _started(engine):
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


@dataclasses.dataclass
class Launch:
    """One cell's run: the launcher's process (or containers), where its report goes."""

    cell: object
    marker: str
    report_dir: Path
    proc: subprocess.Popen | None = None
    hosts: list = dataclasses.field(default_factory=list)  # node index -> Host (network faults)
    names: list = dataclasses.field(default_factory=list)  # node index -> its hostname, where
    # that is not its Host's name (a pod's)
    dns: dict = dataclasses.field(default_factory=dict)  # a pod's DNS name -> its address
    out_path: Path | None = None
    containers: list = dataclasses.field(default_factory=list)
    env: dict | None = None
    job: str | None = None
    logs: Path | None = None  # one log per node (torchrun across nodes)
    logged: bool = False  # the report is read from the pods' logs alone (a TrainJob's)
    t0: float = dataclasses.field(default_factory=time.monotonic)
    _store = None

    # -- what the campaign reads while the run goes on -------------------------------------
    def workers(self) -> dict[int, int]:
        """rank -> pid of this run's worker processes."""
        found = {}
        mark = self.marker.encode()
        for pid, cmd, env in _processes():
            rank = _rank_of(pid, cmd, env) if env.get(b"DDP_SMOKE_CAMPAIGN") == mark else None
            if rank is not None:
                found[rank] = pid
        return found

    def store_pid(self) -> int | None:
        """The process that holds the coordination store: the store host, else the torchrun
        agent (of node 1) that hosts it."""
        mark = self.marker.encode()
        agents = []
        for pid, cmd, env in _processes():
            if env.get(b"DDP_SMOKE_CAMPAIGN") != mark:
                continue
            head = cmd.split(b"\0")[:4]
            if b"ddp_smoke.store_host" in head and b"--plan" not in cmd:
                return pid
            if b"ddp_smoke.launch_local" in head and b"--check" not in cmd \
                    and fate.rank_named(pid) is None:
                return pid  # make smoke-local's launcher holds the store itself
            if b"torch.distributed.run" in head or any(a.endswith(b"/torchrun") or
                                                        a == b"torchrun" for a in head[:2]):
                agents.append((pid, cmd))
        if not agents:
            return None
        head = self.hosts[0].addr.encode() if self.hosts else b""
        for pid, cmd in agents:  # node 1's agent: its --local-addr is node 1's
            if not head or b"--local-addr=" + head in cmd:
                return pid
        return agents[0][0]

    def store(self):
        """A client of the run's coordination store (the harness's prefix), once a worker
        says where it is; None before."""
        if self._store is not None:
            return self._store
        addr = self._store_address()
        if addr is None:
            return None
        import torch.distributed as dist
        try:
            raw = dist.TCPStore(addr[0], addr[1], 1, False, datetime.timedelta(seconds=5),
                                wait_for_workers=False)
        except (RuntimeError, OSError):
            return None
        self._store = dist.PrefixStore("ddp_smoke/0", raw)
        return self._store

    def _store_address(self) -> tuple[str, int] | None:
        """Where a worker said the store is, as this (the host's) network sees it: a pod's
        loopback is the pod's own address (--standalone in a single-node image)."""
        addr = self._said_address()
        if addr and self.containers and addr[0] in ("127.0.0.1", "localhost", "::1"):
            return self.hosts[0].addr, addr[1]
        if addr and addr[0] in self.dns:  # cluster DNS, which this host does not ask
            return self.dns[addr[0]], addr[1]
        return addr

    def _said_address(self) -> tuple[str, int] | None:
        text = self.output()
        m = STORE_LINE.search(text)
        if m:
            return m.group(1), int(m.group(2))
        for f in (self.report_dir / "store").glob("*"):  # submit: task 0 leaves it there
            try:
                got = f.read_text().strip()
            except OSError:  # a temporary file, renamed into place meanwhile
                continue
            if ":" in got:
                host, _, port = got.rpartition(":")
                return host, int(port)
        for pid in self.workers().values():
            try:
                env = dict(kv.split(b"=", 1) for kv in
                           Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in kv)
            except OSError:
                continue
            if b"DDP_SMOKE_STORE" in env and env[b"DDP_SMOKE_STORE"] != b"auto":
                host, _, port = env[b"DDP_SMOKE_STORE"].decode().rpartition(":")
                return host, int(port)
            if b"MASTER_PORT" in env:
                return env[b"MASTER_ADDR"].decode(), int(env[b"MASTER_PORT"])
        return None

    def has(self, key: str) -> bool:
        store = self.store()
        try:
            return bool(store is not None and store.check([key]))
        except (RuntimeError, OSError):
            self._store = None
            return False

    def get(self, key: str) -> bytes | None:
        store = self.store()
        try:
            return record_value(store.get(key)) if store is not None and store.check([key]) \
                else None
        except (RuntimeError, OSError):
            return None

    # -- the end ---------------------------------------------------------------------------
    def running(self) -> bool:
        if self.containers:
            return any(c.running() for c in self.containers)
        return self.proc is not None and self.proc.poll() is None

    def status(self) -> int | None:
        if self.containers:
            return self.containers[0].status()
        return None if self.proc is None else self.proc.returncode

    def output(self) -> str:
        parts = []
        if self.out_path is not None and self.out_path.exists():
            parts.append(self.out_path.read_text(errors="replace"))
        for c in self.containers:
            parts.append(c.logs())
        for log in sorted(self.logs.glob("*.log")) if self.logs else []:
            parts.append(log.read_text(errors="replace"))
        return "\n".join(parts)

    def stop(self) -> None:
        """End what is left (the cell's bound passed): the launcher, then its workers."""
        if self.env is not None and self.job:  # a batch job: Slurm's to end (no pid here)
            subprocess.run(["scancel", self.job], env=self.env, capture_output=True, timeout=10)
        elif self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        for c in self.containers:
            c.kill()
        for pid in self.workers().values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# -- starting each launcher -------------------------------------------------------------------

def _popen(argv, out: Path, env: dict, cwd=REPO, **kw) -> subprocess.Popen:
    with open(out, "wb") as f:
        return subprocess.Popen(argv, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, **kw)


def start(cell, parts: Parts, work: Path, reports: Path, worker: list[str], marker: str,
          dup: tuple[int, int] | None, before=lambda hosts: None,
          node_env=lambda node: {}) -> Launch:
    """Start ``cell``'s launcher with the worker's options ``worker`` (no --report-dir): its
    own files (logs, submitit's) in ``work``, the run's report folder under ``reports``.
    ``before(hosts)``: called with the nodes' Hosts once they exist, before anything starts
    on them (a fault that must be there before the launcher looks). ``node_env(i)``: more
    environment for node i's ranks alone (a site's per-node setting; a wrapper of the
    interpreter where the launcher gives every node the same environment)."""
    launch = {"torchrun": _torchrun, "smoke_local": _smoke_local, "slurm": _slurm,
              "image": _image, "submit": _submit, "pytorchjob": _k8s_job("", True),
              "indexed_job": _k8s_job("indexed-job", False),
              "trainjob": _k8s_job("trainer-v2", False), "node_check": _node_check,
              "daemonset": _daemonset}[cell.launcher]
    return launch(cell, parts, work, reports, worker, marker, dup, before, node_env)


WRAPPER = """#!/bin/sh
# The cell's per-node environment: each node's own, by Slurm's name for it.
{cases}exec {python} "$@"
"""


def _python(work: Path, names: list[str], node_env) -> str:
    """This interpreter, or a wrapper of it that sets ``node_env(i)`` on node ``names[i]``."""
    cases = "".join(f'if [ "$SLURMD_NODENAME" = "{name}" ]; then export '
                    + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + "; fi\n"
                    for name, env in ((n, node_env(i)) for i, n in enumerate(names)) if env)
    if not cases:
        return sys.executable
    path = work / "python-per-node"
    path.write_text(WRAPPER.format(cases=cases, python=sys.executable))
    path.chmod(0o755)
    return str(path)


def _env(marker: str, cell=None) -> dict:
    return {**node_env(), **_worker_env(marker, cell)}


def _worker_env(marker: str, cell) -> dict:
    """The cell's marker; for an OOM cell, glibc's malloc without its dynamic mmap threshold:
    every large tensor is fresh pages, charged to the cgroup it is in now (glibc otherwise
    serves them from pages faulted in before the fault's cgroup existed)."""
    oom = cell is not None and cell.kind == "oom"
    return {"DDP_SMOKE_CAMPAIGN": marker, **({"MALLOC_MMAP_THRESHOLD_": "131072"} if oom else {})}


def _torchrun(cell, parts, work, reports, worker, marker, dup, before, node_env) -> Launch:
    rd = reports / "report"
    launch = Launch(cell, marker, rd, out_path=work / "launcher.log")
    if cell.nodes == 1:
        argv = [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={cell.per_node}",
                "-m", "ddp_smoke", "--report-dir", str(rd), *worker]
        launch.proc = _popen(argv, launch.out_path, {**_env(marker, cell), **node_env(0)})
        return launch
    box = parts.hosts()
    hosts = box.hosts[:cell.nodes]
    launch.hosts, launch.logs = hosts, work / "logs"
    launch.logs.mkdir()
    endpoint = f"{hosts[0].addr}:{29700 + os.getpid() % 200}"
    before(hosts)
    procs = []
    for i, host in enumerate(hosts):
        shown = dataclasses.replace(host, name=hosts[dup[0]].name) if dup and i == dup[1] \
            else host
        argv = torchrun_argv(host, cell.nodes, cell.per_node, endpoint, marker,
                             "join_timeout=60,read_timeout=30", ["--report-dir", str(rd),
                                                                 *worker])
        with open(work / "logs" / f"node{i + 1}.log", "wb") as f:
            procs.append(subprocess.Popen(host_command(shown, argv),
                                          env={**_env(marker, cell), **node_env(i)},
                                          stdout=f, stderr=subprocess.STDOUT,
                                          start_new_session=True, cwd=REPO))
    launch.proc = _Group(procs, lambda: launch.workers().values())
    return launch


class _Group:
    """Several node launchers as one: like srun --kill-on-bad-exit, once one fails the
    others get SIGTERM, then SIGKILL KILL_WAIT_S later, their workers too (srun kills a
    step's whole cgroup; torchrun starts each worker in a session of its own, which a signal
    to the node's process group misses: a stopped one would outlive its killed agent). The
    status is the first failed node's."""

    KILL_WAIT_S = 30  # Slurm's default KillWait, and torchrun's own grace for its workers

    def __init__(self, procs, workers):
        self.procs, self.pid, self.failed_at, self.first = procs, procs[0].pid, None, None
        self.workers = workers  # () -> the run's worker PIDs still alive

    def poll(self):
        codes = [p.poll() for p in self.procs]
        if self.failed_at is None and any(c not in (None, 0) for c in codes):
            self.failed_at = time.monotonic()
            self.first = next(c for c in codes if c not in (None, 0))
            self._signal(signal.SIGTERM)
        elif self.failed_at and time.monotonic() - self.failed_at > self.KILL_WAIT_S:
            self._signal(signal.SIGKILL)
            for pid in self.workers():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        # like srun: the status of the first node that failed (the others were stopped)
        return None if any(c is None for c in codes) else (self.first or codes[0])

    def _signal(self, sig):
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, sig)

    @property
    def returncode(self):
        return self.poll()

    def wait(self, timeout=None):
        end = time.monotonic() + (timeout or 1e9)
        while self.poll() is None and time.monotonic() < end:
            time.sleep(0.1)


def _smoke_local(cell, parts, work, reports, worker, marker, dup, before, node_env) -> Launch:
    rd = reports / "report"
    launch = Launch(cell, marker, rd, out_path=work / "launcher.log")
    args = " ".join(worker)
    launch.proc = _popen(["make", "-s", "smoke-local", f"NPROC={cell.per_node}",
                          f"REPORT_DIR={rd}", f"ARGS={args}"], launch.out_path,
                         {**_env(marker, cell), **node_env(0)})
    return launch


def _slurm(cell, parts, work, reports, worker, marker, dup, before, node_env) -> Launch:
    cluster = parts.slurm(dup)
    before(cluster.hosts.hosts[:cell.nodes])
    python = _python(work, [h.name for h in cluster.hosts.hosts[:cell.nodes]], node_env)
    env = cluster.env(**_env(marker, cell), WORKER_PYTHON=python,
                      NPROC_PER_NODE=str(cell.per_node), REPORT_ROOT=str(reports / "reports"))
    proc = subprocess.run(["sbatch", "--parsable", "--gpus-per-node=0", "--cpus-per-task=2",
                           f"--nodes={cell.nodes}", f"--output={work}/job.out", str(TEMPLATE),
                           *worker], cwd=work, env=env, capture_output=True, text=True,
                          timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"sbatch: {proc.stderr.strip()}")
    job = proc.stdout.strip().split(";")[0]
    launch = Launch(cell, marker, reports / "reports" / job, out_path=work / "job.out", env=env,
                    job=job, hosts=cluster.hosts.hosts[:cell.nodes])
    launch.proc = _SlurmJob(job, env)
    return launch


class _SlurmJob:
    """A batch job as a process: poll() is its exit status once squeue no longer lists it."""

    def __init__(self, job: str, env: dict):
        self.job, self.env, self.pid, self.returncode = job, env, -1, None

    def poll(self):
        if self.returncode is None:
            q = subprocess.run(["squeue", "-h", "-j", self.job], env=self.env,
                               capture_output=True, text=True, timeout=10)
            if not q.stdout.strip():
                s = subprocess.run(["scontrol", "show", "job", self.job], env=self.env,
                                   capture_output=True, text=True, timeout=10).stdout
                m = re.search(r"ExitCode=(\d+):(\d+)", s)
                self.returncode = int(m.group(1)) if m else 1
        return self.returncode

    def wait(self, timeout=None):
        end = time.monotonic() + (timeout or 1e9)
        while self.poll() is None and time.monotonic() < end:
            time.sleep(0.5)


def _pods_folder(folder: Path, uid: int = 1000) -> Path:
    """``folder``, made and given to the pods' user (the image's; the manifests' runAsUser)."""
    folder.mkdir(exist_ok=True)
    with contextlib.suppress(OSError):  # a folder the cell made read-only is already 1777
        os.chown(folder, uid, uid)
    return folder


def _node_roots(cell, reports: Path, work: Path) -> list[Path]:
    """The node tier's report root of each node of the cell, made: the fault's node's is the
    cell's report folder (the one a folder fault hits), the others their own."""
    roots = [reports / "reports" if i == cell.node else work / f"node{i}-reports"
             for i in range(cell.nodes)]
    for root in roots:
        root.mkdir(exist_ok=True)
    return roots


def _image(cell, parts, work, reports, worker, marker, dup, before, node_env) -> Launch:
    from tests.sandbox.docker import PodNetwork
    engine, image = parts.docker()
    uid = int(engine.docker("image", "inspect", "-f", "{{.Config.User}}", image.tag).stdout)
    out = _pods_folder(reports / "reports", uid)
    net = PodNetwork(engine, image.tag, PODS_PREFIX, PODS_SUBNET).up()
    names = [f"dcd-node-{chr(97 + i)}" for i in range(cell.nodes)]
    if dup:
        names[dup[1]] = names[dup[0]]
    addrs = [f"10.231.11.{11 + i}" for i in range(cell.nodes)]
    pods = [net.add_pod(n, a, etc_hosts=dict(zip(names, addrs))) for n, a in zip(names, addrs)]
    launch = Launch(cell, marker, out, hosts=[net._box.plugged[i] for i in range(cell.nodes)],
                    names=names)
    before(launch.hosts)
    worker, volumes = _in_pod(worker, [f"{out}:/reports"])
    for i, pod in enumerate(pods):
        own, mounts = _pod_files(node_env(i))
        if cell.nodes == 1:  # the entrypoint's store host comes with --standalone
            args = ["--standalone", f"--nproc-per-node={cell.per_node}"]
        else:
            args = [f"--nnodes={cell.nodes}", f"--nproc-per-node={cell.per_node}",
                    "--rdzv-backend=c10d",
                    f"--rdzv-endpoint={addrs[0]}:29500", f"--rdzv-id={marker}",
                    f"--local-addr={pod.addr}"]
        launch.containers.append(_Container(net.run(
            pod, image.tag, [*args, "--", "--report-dir", "/reports", *worker],
            volumes=volumes + mounts, env={"GLOO_SOCKET_IFNAME": "eth0",
                                           "DDP_SMOKE_STORE": "auto", "OMP_NUM_THREADS": "1",
                                           **_worker_env(marker, cell), **own})))
    launch.net = net
    return launch


def _pod_files(env: dict) -> tuple[dict, list[str]]:
    """A pod's per-node environment: a file it names (a recording, and the recordings it
    builds on) has its folder mounted read-only, the variable naming it there."""
    files = {k: Path(v) for k, v in env.items() if Path(v).is_file()}
    own = {**env, **{k: f"/campaign/files/{p.name}" for k, p in files.items()}}
    return own, sorted({f"{p.parent}:/campaign/files:ro" for p in files.values()})


K8S_CLAIM = "campaign-reports"  # the PVC every pod mounts at /reports: one shared folder
TRAINJOB_REPORTS = "/tmp/ddp-smoke-reports"  # the TrainJob's report folders, in the pod


def _k8s_job(folder: str, first_last: bool):
    """A launcher for the job of ``k8s/<folder>`` as its controller and the kubelet run its
    pods (tests/k8s_operator.py, tests/kubelet.py): the README's edits (image, nodes, no GPU,
    ranks a pod), the ConfigMap's config.yaml replaced by the campaign's, the cell's worker
    options after the manifest's, the README's Secret, and a shared volume (a PVC) at
    /reports. The TrainJob has no volume and no ConfigMap: its worker options in its command
    name the campaign's configuration, mounted read-only, and its report is read from the pod
    log as its users read it (its pods' report folders, each in the pod's own /tmp, are one
    host folder here only for the ranks' records in lost/). ``first_last``: the pods start in
    order (the PyTorchJob's Workers wait for the Master's name), else the store's host last
    (an Indexed Job's pods, a TrainJob's too, come in no order)."""
    def launch(cell, parts, work, reports, worker, marker, dup, before, node_env) -> Launch:
        from tests import k8s_operator as ko, kubelet
        from tests.sandbox.docker import PodNetwork
        engine, image = parts.docker()
        out = _pods_folder(reports / "reports")
        at = worker.index("--config")
        config, options = worker[at + 1], worker[:at] + worker[at + 2:]
        docs = ko.customize(ko.load_manifests(REPO / "k8s" / folder), image=image.tag,
                            nodes=cell.nodes, gpus_per_node=0, nproc_per_node=cell.per_node,
                            reports_claim=K8S_CLAIM)
        # `kubectl create secret generic ddp-smoke-secret --from-literal=secret=…` (README)
        docs.append({"apiVersion": "v1", "kind": "Secret",
                     "metadata": {"name": "ddp-smoke-secret"},
                     "stringData": {"secret": os.urandom(32).hex()}})
        job = next(d for d in docs if d["kind"] in ("PyTorchJob", "Job", "TrainJob"))
        trainjob = job["kind"] == "TrainJob"
        if trainjob:
            options += ["--config", "/campaign/config.yaml"]
            job["spec"]["trainer"]["args"][-1] += " " + shlex.join(options)
        else:
            templates = ([r["template"] for r in job["spec"]["pytorchReplicaSpecs"].values()]
                         if job["kind"] == "PyTorchJob" else [job["spec"]["template"]])
            for (container,) in (t["spec"]["containers"] for t in templates):
                container["args"][-1] += " " + shlex.join(options)
            next(d for d in docs if d["kind"] == "ConfigMap")["data"]["config.yaml"] = \
                Path(config).read_text()
        if ko.on_pod_failure(next(d for d in ko.expanded(docs)
                                  if d["kind"] in ("PyTorchJob", "Job"))) != "continue":
            raise NotImplementedError(f"{folder}: a failed pod's controller deletes the others")
        ips = {n: f"10.231.11.{11 + i}" for i, n in enumerate(ko.pod_names(docs))}
        pods = ko.compute_pods(docs, pod_ips=ips)
        net = PodNetwork(engine, image.tag, PODS_PREFIX, PODS_SUBNET).up()
        run = Launch(cell, marker, out / pods[0].env["DDP_SMOKE_RUN_ID"],
                     names=[p.hostname for p in pods], dns=ko.etc_hosts(pods[0], pods, ips),
                     logged=trainjob)
        run.net = net

        def more(pod):  # the cell's marker; the node's own environment and files
            env, mounts = _pod_files(node_env(pods.index(pod)))
            if trainjob:
                mounts += [f"{config}:/campaign/config.yaml:ro", f"{out}:{TRAINJOB_REPORTS}"]
            # (the rendezvous host's preflight waits this long for every pod's hello, 600 s
            # by default for image pulls: the campaign's pods start at once)
            return {**_worker_env(marker, cell), "OMP_NUM_THREADS": "1",
                    "DDP_SMOKE_PREFLIGHT_TIMEOUT": "30", **env}, mounts

        def plugged():  # the pods' namespaces, once they exist: node index -> Host
            run.hosts = [net._box.plugged[i] for i in range(len(pods))]
            before(run.hosts)
        _, containers = kubelet.start_pods(
            net, docs, pods, ips, pods if first_last else pods[::-1], work / "pods",
            claims={K8S_CLAIM: out}, more=more, before=plugged)
        run.containers = [_Container(containers[p.name]) for p in pods]  # node 0's first
        return run
    return launch


def _in_pod(worker: list[str], volumes: list[str]) -> tuple[list[str], list[str]]:
    """The worker's options as a pod sees them: its --config file mounted (read-only) where
    the options then name it, as a ConfigMap would be."""
    worker = list(worker)
    if "--config" in worker:
        at = worker.index("--config") + 1
        volumes = [*volumes, f"{worker[at]}:/campaign/config.yaml:ro"]
        worker[at] = "/campaign/config.yaml"
    return worker, volumes


class _Container:
    def __init__(self, c):
        self.c = c

    def _state(self):
        got = self.c.engine.docker("inspect", "-f", "{{.State.Running}} {{.State.ExitCode}}",
                                   self.c.name, check=False).stdout.split()
        return got or ["false", "1"]

    def running(self) -> bool:
        return self._state()[0] == "true"

    def status(self) -> int | None:
        running, code = self._state()
        return None if running == "true" else int(code)

    def logs(self) -> str:
        return self.c.logs()

    def kill(self) -> None:
        self.c.engine.docker("kill", self.c.name, check=False)


def _submit(cell, parts, work, reports, worker, marker, dup, before, node_env) -> Launch:
    folder = work / "submitit"
    folder.mkdir()
    (reports / "report").mkdir(exist_ok=True)
    (folder / "report").symlink_to(reports / "report")  # submit's report folder: DIR/report
    argv = [str(BIN / "ddp-smoke-submit"), "--folder", str(folder), "--wait-timeout", "240",
            "--procs-per-node", str(cell.per_node)]
    env = {**_env(marker, cell), **node_env(0)} if cell.nodes == 1 else _env(marker, cell)
    hosts = []
    if cell.nodes > 1:
        cluster = parts.slurm(dup)
        env = cluster.env(**env)
        hosts = cluster.hosts.hosts[:cell.nodes]
        before(hosts)
        argv += ["--cluster", "slurm", "--nodes", str(cell.nodes), "--allow-local-folder",
                 "--python", _python(work, [h.name for h in hosts], node_env)]
    launch = Launch(cell, marker, folder / "report", out_path=work / "launcher.log",
                    hosts=hosts)
    launch.proc = _popen([*argv, "--", *worker], launch.out_path, env)
    return launch


# -- node-check as Slurm's HealthCheckProgram -------------------------------------------------

# slurmctld asks every node for its health check this often (a reconfigure triggers none: the
# first ask comes within one interval); node-check.conf lets each node run one check a cell
HEALTH_INTERVAL_S = 5
NODE_CHECK_TIMEOUT_S = 50  # node-check's own bound (slurmd kills its program at 60 s)
NODE_CHECK_CONF = """\
# The campaign's cell {marker}: each node of the cell runs one node-check (slurmctld asks
# again every {interval} s: a node that ran one exits at once), the nodes outside it none.
case "$SLURMD_NODENAME" in
{cases}  *) exit 0 ;;
esac
mkdir {ran}/"$SLURMD_NODENAME" 2>/dev/null || exit 0
PYTHON={python}
TIMEOUT={timeout}
export SLURM_CONF={conf} GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 DDP_SMOKE_CAMPAIGN={marker}
"""


def _alone(worker: list[str]) -> list[str]:
    """The worker's options for a node-check: its world is its one node (no speakers)."""
    if "--node-speaker" not in worker:
        return worker
    at = worker.index("--node-speaker")
    return worker[:at] + worker[at + 2:]


def health_check(cluster, script: Path | None) -> None:
    """slurm.conf's health lines set to run ``script`` on every node (None: taken out), and
    the cluster reconfigured, as docs/continuous.md deploys node-check."""
    lines = [ln for ln in cluster.conf.read_text().splitlines()
             if not ln.startswith("HealthCheck")]
    if script is not None:
        lines += [f"HealthCheckProgram={script}", f"HealthCheckInterval={HEALTH_INTERVAL_S}",
                  "HealthCheckNodeState=ANY"]
    cluster.conf.write_text("\n".join(lines) + "\n")
    subprocess.run(["scontrol", "reconfigure"], env=cluster.env(), check=True,
                   capture_output=True, timeout=30)


def _node_check(cell, parts, work, reports, worker, marker, dup, before, node_env) -> Launch:
    """``slurm/node-check.sh`` as the HealthCheckProgram of the campaign's Slurm cluster: node
    i of the cell runs ``node-check --act slurm-drain --cpu-ranks M`` with its own
    environment (``node_env(i)``) and its own report root on its local disk (the fault's node:
    the cell's report folder), the cell's worker options after ``--``."""
    cluster = parts.slurm()
    hosts, names = cluster.hosts.hosts[:cell.nodes], cluster.node_names[:cell.nodes]
    before(hosts)
    folder = work / "health-check"
    (folder / "ran").mkdir(parents=True)
    script = folder / "node-check.sh"
    shutil.copy(REPO / "slurm" / "node-check.sh", script)
    roots = _node_roots(cell, reports, work)
    worker = _alone(worker)
    cases = ""
    for i, name in enumerate(names):
        args = shlex.join(["--cpu-ranks", str(cell.per_node), "--", *worker])
        env = "".join(f" {k}={shlex.quote(v)}" for k, v in node_env(i).items())
        cases += (f"  {name}) REPORT_ROOT={shlex.quote(str(roots[i]))}; ARGS=({args})"
                  + (f"; export{env}" if env else "") + " ;;\n")
    (folder / "node-check.conf").write_text(NODE_CHECK_CONF.format(
        marker=marker, interval=HEALTH_INTERVAL_S, cases=cases, ran=folder / "ran",
        python=sys.executable, timeout=NODE_CHECK_TIMEOUT_S, conf=cluster.conf))
    launch = NodeCheckLaunch(cell, marker, roots[cell.node], hosts=hosts, names=names,
                             env=cluster.env(), cluster=cluster, roots=roots,
                             ran=folder / "ran")
    health_check(cluster, script)
    return launch


@dataclasses.dataclass
class NodeCheckLaunch(Launch):
    """One node-check a node of the cell, started by slurmd: running until every node's has
    started and ended; its ranks numbered as the cell numbers them (node i's local rank j is
    rank i * M + j); each node's drain as the cluster shows it, the moment it was first seen.
    No store to watch: every fault of its cells is in place before the node-check starts."""

    cluster: object = None
    roots: list = dataclasses.field(default_factory=list)
    ran: Path | None = None
    drained_at: dict = dataclasses.field(default_factory=dict)  # node index -> monotonic
    states: dict = dataclasses.field(default_factory=dict)  # NodeName -> {"state", "reason"}
    _polled: float = 0.0

    def _ours(self):
        """(node index, pid, argv, environment) of this cell's processes on its nodes."""
        mark = self.marker.encode()
        for pid, cmd, env in _processes():
            name = env.get(b"SLURMD_NODENAME", b"").decode()
            if env.get(b"DDP_SMOKE_CAMPAIGN") == mark and name in self.names:
                yield self.names.index(name), pid, cmd, env

    def workers(self) -> dict[int, int]:
        found = {}
        for node, pid, cmd, env in self._ours():
            rank = _rank_of(pid, cmd, env)
            if rank is not None:
                found[node * self.cell.per_node + rank] = pid
        return found

    def poll_drains(self) -> dict:
        """The cluster's nodes as scontrol shows them (once a second at most); each drain
        the kit made, the moment it was first seen."""
        if time.monotonic() - self._polled >= 1.0:
            from ddp_smoke.outputs import act
            self._polled = time.monotonic()
            got = subprocess.run(["scontrol", "show", "node"], env=self.env,
                                 capture_output=True, text=True, timeout=10)
            if got.returncode == 0:
                self.states = act.parse_nodes(got.stdout)
            for i, name in enumerate(self.names):
                if "DRAIN" in self.states.get(name, {}).get("state", ""):
                    self.drained_at.setdefault(i, self._polled)
        return self.states

    def findings(self) -> tuple[dict[int, str], list[float], str]:
        """Read now: node index -> the kit's drain reason; the moments those drains were
        first seen; a note on drains by another."""
        self._polled = 0.0  # now, not a second ago
        states = self.poll_drains()
        drained = {i: states.get(n, {}).get("reason", "") for i, n in enumerate(self.names)
                   if "DRAIN" in states.get(n, {}).get("state", "")}
        kit = {i: why for i, why in drained.items() if why.startswith("ddp-smoke node-check:")}
        others = {self.names[i]: why for i, why in drained.items() if i not in kit}
        return (kit, [self.drained_at[i] for i in kit],
                f"drained by another: {others}" if others else "")

    def running(self) -> bool:
        self.poll_drains()
        started = all((self.ran / name).exists() for name in self.names)
        return not started or any(b"node-check" in cmd for _, _, cmd, _ in self._ours())

    def status(self) -> int | None:
        """The worst node-check's exit status, as its report's verdict says (slurmd keeps
        its program's status to itself), or where it could write none (a full folder) its
        node's drain: 1 a finding, 0 a pass, None no node's word."""
        reports = self.reports()
        said = [reports[i].get("verdict") == "pass" if i in reports else
                False if i in self.drained_at else None for i in range(len(self.names))]
        return None if all(s is None for s in said) else int(False in said)

    def reports(self) -> dict[int, dict]:
        """node index -> its node-check's report."""
        import json
        out = {}
        for i, root in enumerate(self.roots):
            for path in sorted(root.glob("node-check-*/report.json")):
                with contextlib.suppress(OSError, ValueError):
                    out[i] = json.loads(path.read_text())
        return out

    def output(self) -> str:
        parts = []
        for root in self.roots:
            for log in sorted(root.glob("node-check-*/node-check.log")):
                parts.append(log.read_text(errors="replace")[-3000:])
        return "\n".join(parts)

    def stop(self) -> None:
        """The health lines out, this cell's processes ended, every drained node resumed:
        the cluster as later cells (of every launcher) expect it."""
        health_check(self.cluster, None)
        for _, pid, _, _ in list(self._ours()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for name, state in self.poll_drains().items():
            if "DRAIN" in state["state"] or "DOWN" in state["state"]:
                subprocess.run(["scontrol", "update", f"NodeName={name}", "State=RESUME"],
                               env=self.env, capture_output=True, timeout=10)


# -- node-check as the DaemonSet of k8s/node-check ---------------------------------------------

DAEMONSET_CLAIM = "campaign-node-reports"  # its emptyDir at /reports, each node's own folder


def _daemonset(cell, parts, work, reports, worker, marker, dup, before, node_env) -> Launch:
    """The DaemonSet's pods (tests/k8s_operator.py, tests/kubelet.py), one a node of the cell,
    on the pod network with the stand-in API server (tests/k8s_api.py) at its gateway: node i
    runs ``node-check --act k8s-label --cpu-ranks M`` once (``--every``, the manifest's EDIT
    point, set past the cell), its own environment and files (``node_env(i)``), its /reports
    its own folder (the fault's node: the cell's)."""
    from tests import k8s_api, k8s_operator as ko, kubelet
    from tests.sandbox.docker import PodNetwork
    engine, image = parts.docker()
    names = [f"dcn-node-{chr(97 + i)}" for i in range(cell.nodes)]
    docs = ko.customize(ko.load_manifests(REPO / "k8s" / "node-check"), image=image.tag)
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    spec = ds["spec"]["template"]["spec"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "reports"]
    volume.pop("emptyDir")
    volume["persistentVolumeClaim"] = {"claimName": DAEMONSET_CLAIM}
    args = spec["containers"][0]["args"]
    args[args.index("--every") + 1] = "3600"
    worker, config = _in_pod(_alone(worker), [])
    args += ["--cpu-ranks", str(cell.per_node), "--", *worker]
    nodes = {n: {"nvidia.com/gpu.present": "true"} for n in names}
    pods = sorted(ko.compute_pods(docs, namespace=k8s_api.NAMESPACE, nodes=nodes),
                  key=lambda p: names.index(p.node))
    net = PodNetwork(engine, image.tag, PODS_PREFIX, PODS_SUBNET).up()
    gateway = str(net.net[1])
    cert, key = k8s_api.certificate(work, gateway)
    account = k8s_api.service_account(work / "serviceaccount", cert)
    launch = DaemonSetLaunch(cell, marker, reports / "reports", names=names,
                             api=k8s_api.ApiServer(gateway, cert, key, docs, nodes))
    launch.net = net
    runs = []
    for i, (pod, root) in enumerate(zip(pods, _node_roots(cell, reports, work))):
        _pods_folder(root)
        user, security = kubelet.security_options(spec, pod)
        binds, shm_size, _ = kubelet.volumes(pod, spec, work / "pods" / pod.name,
                                             {DAEMONSET_CLAIM: root})
        env, files = _pod_files(node_env(i))
        runs.append((net.add_pod(pod.hostname), pod.image, dict(
            command=pod.argv, volumes=binds + config + files + [f"{account}:{k8s_api.SA_DIR}:ro"],
            env={**pod.env, "KUBERNETES_SERVICE_HOST": gateway, "OMP_NUM_THREADS": "1",
                 "KUBERNETES_SERVICE_PORT": str(launch.api.port), **_worker_env(marker, cell),
                 **env}, user=user, shm_size=shm_size, extra=security)))
    launch.hosts = [net._box.plugged[i] for i in range(len(pods))]
    before(launch.hosts)
    launch.containers = [_Container(net.run(pod, image_tag, **opts))
                         for pod, image_tag, opts in runs]
    return launch


@dataclasses.dataclass
class DaemonSetLaunch(Launch):
    """The DaemonSet's pods until each has labelled its node once; the labels and annotations
    as the API server holds them."""

    api: object = None
    labelled_at: dict = dataclasses.field(default_factory=dict)  # node index -> monotonic

    def labels(self) -> dict[int, dict]:
        """node index -> its Node's metadata, once node-check has labelled it."""
        out = {i: self.api.nodes[n]["metadata"] for i, n in enumerate(self.names)
               if "ddp-smoke/health" in self.api.nodes[n]["metadata"].get("labels", {})}
        for i in out:
            self.labelled_at.setdefault(i, time.monotonic())
        return out

    def findings(self) -> tuple[dict[int, str], list[float], str]:
        """Node index -> its finding, for the nodes labelled fail; the moments each node's
        label was first seen; no note."""
        labels = self.labels()
        failed = {i: m.get("annotations", {}).get("ddp-smoke/health-finding", "")
                  for i, m in labels.items() if m["labels"]["ddp-smoke/health"] == "fail"}
        return failed, [self.labelled_at[i] for i in labels], ""

    def running(self) -> bool:
        return len(self.labels()) < len(self.names) and any(
            c.running() for c in self.containers)

    def status(self) -> int | None:
        """1 a node labelled fail, 0 every node pass, None no node labelled."""
        said = [m["labels"]["ddp-smoke/health"] for m in self.labels().values()]
        return None if not said else int("fail" in said)

    def output(self) -> str:
        return "\n".join(c.logs()[-3000:] for c in self.containers)

    def stop(self) -> None:
        for c in self.containers:
            c.kill()
        self.api.close()


def missing() -> str | None:
    """Why the campaign cannot run here (root, namespaces), or None."""
    return missing_requirements(("tc", "iptables"))


def cleanup_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
