"""A private Docker engine for the tests: install, start, base image, offline build, "pods".

No registry is reachable here, so the engine makes its own stand-in for the PyTorch base
(debootstrap bookworm, python3 and pip, the CPU torch wheel of this machine installed system-wide
as in pytorch/pytorch) and builds ``docker/Dockerfile`` against it offline, from a wheelhouse.
Everything persists under ``<repo>/.cache/docker/`` (git-ignored) so that a warm run rebuilds in
seconds::

    data/ exec/                  dockerd's --data-root and --exec-root (images, build cache)
    docker.sock dockerd.pid dockerd.log daemon.json
    rootfs-bookworm-<hash>.tar   the debootstrap'd rootfs, re-imported if data/ is wiped
    wheels-base/                 torch==2.13.0 (+cpu) and its dependencies, for the base
    wheelhouse/                  numpy, pyyaml, submitit, nvidia-ml-py, setuptools: the build's only source
    debs/                        the image's RDMA packages (+ what the base lacks of their
                                 dependencies), from this machine's apt: the build's apt source
    build.log                    the last `docker build` output

The daemon ALWAYS runs with ``--iptables=false --ip6tables=false --bridge=none
--ip-forward=false``: its defaults set iptables FORWARD to DROP, which (bridge netfilter is on)
would cut every other bridge on the machine. Several processes may share it: each user holds a
shared lock, and the last one out stops it, by PID (never one started with ``up``).

A "pod" is a holder container (``--network none``, its own hostname and /etc/hosts lines) whose
network namespace is attached as ``<prefix>-pod<i>`` and plugged into a HostSandbox bridge (see
hosts.py); containers then join it with ``--network container:<holder>``, as a Kubernetes pod's
containers join its pause container.

Tests import the fixtures (``from tests.sandbox.docker import docker_engine, worker_image,
pod_network``). By hand, from the repository root, as root::

    python -m tests.sandbox.docker up      # install, start; prints DOCKER_HOST for `docker`
    python -m tests.sandbox.docker build   # base image, wheelhouse, docker/Dockerfile
    python -m tests.sandbox.docker down    # stop the daemon; caches stay
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import glob
import hashlib
import ipaddress
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Mapping, Sequence

from tests.sandbox import hosts, tools

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "docker"
WHEELHOUSE = CACHE / "wheelhouse"  # the image build's only package source (in the context)
DEBS = CACHE / "debs"  # .deb files for the Dockerfile's RDMA packages (in the context)
# The Dockerfile's final stage installs exactly these (its RUN line says so too).
RDMA_PACKAGES = ("libibverbs1", "ibverbs-providers", "librdmacm1", "ibverbs-utils")
BASE_WHEELS = CACHE / "wheels-base"  # torch for the base; kept out of the build context
TOOLS = ("dockerd", "docker", "debootstrap", "ip")  # from apt: tests/sandbox/tools.py APT
# python3-pip but no python3-venv: like the real pytorch/pytorch base (pip, no ensurepip).
BASE_PACKAGES = ("python3", "python3-pip", "passwd")
DEBIAN_MIRROR = "http://deb.debian.org/debian"
TORCH_SPEC = "torch==2.13.0"  # exactly: any other spec makes pip fetch a multi-GB CUDA build
TORCH_WHEEL_GLOB = "torch-2.13.0+cpu-cp311-cp311-*.whl"  # bookworm's python3 is 3.11
# The worker's dependencies (torch aside: the base has it) and setuptools to build the worker.
WHEEL_SPECS = ("numpy", "pyyaml", "submitit", "nvidia-ml-py>=13.580.65,<14", "setuptools")
IMAGE_TAG = "local/ddp-smoke:test"
# none, not host: proves the image builds with no network at all (pip --no-index).
BUILD_NETWORK = "none"
POD_PREFIX, POD_SUBNET = "dsd", "10.231.3.0/24"

APT_TIMEOUT_S = 900  # 300 s of it may be waiting for a colleague's dpkg lock
DEBOOTSTRAP_TIMEOUT_S = 600  # 31–36 s measured; a slow mirror must still end
PIP_TIMEOUT_S = 600
BUILD_TIMEOUT_S = 900  # ≈ 1 min from scratch, seconds after a source edit
START_TIMEOUT_S = 60  # `docker info` answers in < 1 s once up
STOP_GRACE_S = 30  # dockerd gives running containers 15 s on SIGTERM
LOCK_TIMEOUT_S = 120
DOCKER_TIMEOUT_S = 120


class DockerError(RuntimeError):
    """A step failed; the message says which, with the tail of its output."""


class MissingPart(DockerError):
    """Something this machine lacks (root, packages, the CPU torch wheel): tests skip on it."""


def _run(argv: Sequence[str], timeout_s: float, check: bool = True,
         **kwargs) -> subprocess.CompletedProcess:
    """Runs argv captured, bounded by timeout_s; raises DockerError with the output's tail."""
    argv = [str(a) for a in argv]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, **kwargs)
    except subprocess.TimeoutExpired as exc:
        raise DockerError(f"`{' '.join(argv[:6])} …` did not finish in {timeout_s} s") from exc
    if check and proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip()[-3000:]
        raise DockerError(f"`{' '.join(argv[:8])} …` failed ({proc.returncode}):\n{tail}")
    return proc


def _acquire(path: str | Path, timeout_s: float = LOCK_TIMEOUT_S):
    """Returns path opened and exclusively flock'ed, waiting at most timeout_s for it."""
    f = open(path, "a")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return f
        except BlockingIOError:
            if time.monotonic() > deadline:
                f.close()
                raise DockerError(f"{path} stayed locked for {timeout_s} s: another run holds it")
            time.sleep(0.2)


@contextlib.contextmanager
def _flock(path: Path, timeout_s: float = LOCK_TIMEOUT_S):
    """Holds an exclusive flock on path for the with-block."""
    with _acquire(path, timeout_s):
        yield


def missing_requirements() -> str | None:
    """Returns why the engine cannot run here (before installing anything), or None."""
    if os.geteuid() != 0:
        return "a private dockerd needs root (apt-get, dockerd, ip netns)"
    if shutil.which("apt-get") is None and shutil.which("dockerd") is None:
        return "no dockerd and no apt-get to install docker.io"
    return None


def ensure_packages() -> None:
    """Installs the Debian packages of whichever of TOOLS are missing (tools.ensure).

    Raises:
        MissingPart: when apt-get cannot install them (no network, not Debian).
    """
    if not tools.missing(*TOOLS):
        return
    try:
        tools.ensure(*TOOLS)
    except tools.MissingProgram as exc:
        raise MissingPart(str(exc)) from exc
    _refuse_system_dockerd()


def _refuse_system_dockerd() -> None:
    """Fails loudly if installing docker.io started the system daemon (iptables on)."""
    with contextlib.suppress(OSError, ValueError):
        pid = int(Path("/var/run/docker.pid").read_text())
        if Path(f"/proc/{pid}").exists():
            raise DockerError(
                f"the system dockerd (PID {pid}) is running with its iptables defaults, which cut "
                "other bridges; stop it (`service docker stop`) - this kit never starts it")


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    return ""


def _pid_from(pidfile: Path, must_contain: str) -> int | None:
    """Returns the PID in pidfile when that process is alive and its command line has the text."""
    with contextlib.suppress(OSError, ValueError):
        pid = int(pidfile.read_text().strip())
        if must_contain in _cmdline(pid) and hosts.is_alive(pid):
            return pid
    return None


class Engine:
    """A dockerd with private state under root, shared by every process that starts it.

    Args:
        root: folder for data-root, exec-root, socket, pidfile and log.
    """

    def __init__(self, root: Path = CACHE):
        self.root = Path(root)
        self.data, self.exec_root = self.root / "data", self.root / "exec"
        self.sock, self.pidfile = self.root / "docker.sock", self.root / "dockerd.pid"
        self.log = self.root / "dockerd.log"
        self.host = f"unix://{self.sock}"
        self._users = None  # open file holding a shared lock while this object uses the daemon
        self._proc: subprocess.Popen | None = None

    @property
    def client(self) -> str:
        """docker.io's own CLI: it matches the daemon, where a newer CLI would want buildx."""
        return "/usr/bin/docker" if os.path.exists("/usr/bin/docker") else "docker"

    def docker(self, *args: str, timeout_s: float = DOCKER_TIMEOUT_S, check: bool = True,
               **kwargs) -> subprocess.CompletedProcess:
        """Runs `docker -H <our socket> ARGS`, captured; raises DockerError when check fails."""
        return _run([self.client, "-H", self.host, *args], timeout_s, check, **kwargs)

    def pid(self) -> int | None:
        """PID of our dockerd, or None when it is not running."""
        return _pid_from(self.pidfile, str(self.data))

    def start(self, timeout_s: float = START_TIMEOUT_S) -> "Engine":
        """Installs what is missing, starts the daemon unless it runs, waits until it answers."""
        reason = missing_requirements()
        if reason:
            raise MissingPart(reason)
        ensure_packages()
        self.root.mkdir(parents=True, exist_ok=True)
        with _flock(self.root / "start.lock"):
            if self.pid() is None:
                self._spawn()
            self._users = open(self.root / "users.lock", "a")
            fcntl.flock(self._users, fcntl.LOCK_SH)
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self) -> None:
        self.pidfile.unlink(missing_ok=True)  # stale: dockerd refuses a pidfile naming a live PID
        config = self.root / "daemon.json"  # ours, so no /etc/docker/daemon.json applies
        config.write_text("{}\n")
        argv = ["dockerd", "--config-file", config, "--data-root", self.data,
                "--exec-root", self.exec_root, "--pidfile", self.pidfile, "-H", self.host,
                "--iptables=false", "--ip6tables=false", "--bridge=none",
                "--ip-forward=false", "--ip-masq=false", "--storage-driver=overlay2"]
        with open(self.log, "ab") as log:
            self._proc = subprocess.Popen([str(a) for a in argv], stdin=subprocess.DEVNULL,
                                          stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise DockerError(f"dockerd exited ({self._proc.returncode}):\n{self._log_tail()}")
            if self.docker("version", timeout_s=10, check=False).returncode == 0:
                return
            time.sleep(0.2)
        raise DockerError(f"dockerd did not answer in {timeout_s} s:\n{self._log_tail()}")

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-3000:]
        return "(no log)"

    def stop(self, force: bool = False) -> bool:
        """Releases this user; the last one stops the daemon, by PID.

        Args:
            force: stop even a daemon started with `up` (which tests otherwise leave running).

        Returns:
            True when the daemon was stopped here.
        """
        with _flock(self.root / "start.lock", timeout_s=LOCK_TIMEOUT_S + STOP_GRACE_S):
            if self._users is not None:
                self._users.close()
                self._users = None
            with open(self.root / "users.lock", "a") as probe:
                try:
                    fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return False  # someone else still uses it; they stop it
                if (self.root / "manual").exists() and not force:
                    return False
                return self._kill()

    def _kill(self) -> bool:
        pid = self.pid()
        if pid is None:
            return False
        left = hosts.stop_pids([pid], grace_s=STOP_GRACE_S)
        # dockerd stops the containerd it started; one still alive (dockerd was killed) is next.
        containerd = _pid_from(self.exec_root / "containerd" / "containerd.pid", str(self.root))
        if containerd is not None:
            left += hosts.stop_pids([containerd], grace_s=5)
        if left:
            raise DockerError(f"dockerd/containerd {left} would not die; see {self.log}")
        return True

    def image_exists(self, ref: str) -> bool:
        """True when the image is in this engine."""
        return self.docker("image", "inspect", ref, check=False).returncode == 0


# -- the base image and the wheelhouse -----------------------------------------------------------

def _packages_key() -> str:
    return hashlib.sha256(" ".join(BASE_PACKAGES).encode()).hexdigest()[:8]


def base_tag() -> str:
    """The local PyTorch-like base's tag; it changes with BASE_PACKAGES and TORCH_SPEC."""
    key = hashlib.sha256(f"{_packages_key()} {TORCH_SPEC}".encode()).hexdigest()[:8]
    return f"local/ddp-smoke-base:bookworm-torch-{key}"


def ensure_base_image(engine: Engine) -> str:
    """Makes the local stand-in for pytorch/pytorch (once); returns its tag.

    debootstrap (cached as a tarball) → `docker import` → torch pip-installed system-wide with
    --break-system-packages, as the real base has it, then `docker commit`: the wheel itself
    never lands in a layer.
    """
    tag = base_tag()
    if engine.image_exists(tag):
        return tag
    bare = f"local/ddp-smoke-base:bookworm-{_packages_key()}"
    if not engine.image_exists(bare):
        tarball = CACHE / f"rootfs-bookworm-{_packages_key()}.tar"
        if not tarball.exists():
            _debootstrap(tarball)
        engine.docker("import", "--change", 'CMD ["/bin/bash"]', str(tarball), bare,
                      timeout_s=300)
    wheels, name = ensure_wheelhouse(BASE_WHEELS, (TORCH_SPEC,)), "ddp-smoke-base-install"
    engine.docker("rm", "-f", name, check=False)
    try:
        engine.docker("run", "--name", name, "--network", "none",
                      "--volume", f"{wheels}:/wheelhouse:ro", bare,
                      "python3", "-m", "pip", "install", "--no-cache-dir", "--no-index",
                      "--find-links", "/wheelhouse", "--break-system-packages", TORCH_SPEC,
                      timeout_s=PIP_TIMEOUT_S)
        engine.docker("commit", "--change", 'CMD ["/bin/bash"]', name, tag, timeout_s=300)
    finally:
        engine.docker("rm", "-f", name, check=False)
    return tag


def _debootstrap(tarball: Path) -> None:
    root = tarball.with_suffix(".d")
    _remove_tree(root)
    _run(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
          "bookworm", root, DEBIAN_MIRROR], DEBOOTSTRAP_TIMEOUT_S)
    tmp = tarball.with_suffix(".tmp")
    # Package lists and downloaded .debs only weigh on the image: leave them out.
    _run(["tar", "--numeric-owner", "--exclude=./var/lib/apt/lists/*",
          "--exclude=./var/cache/apt/*", "-C", root, "-cf", tmp, "."], 300)
    os.replace(tmp, tarball)
    _remove_tree(root)


def _remove_tree(root: Path) -> None:
    """Removes a rootfs, unmounting first whatever a failed debootstrap left mounted in it."""
    prefix = os.path.realpath(root) + "/"
    with open("/proc/self/mounts") as f:
        mounts = [line.split()[1] for line in f]
    for mnt in sorted((m for m in mounts if m.startswith(prefix)), key=len, reverse=True):
        _run(["umount", "-l", mnt], 30, check=False)
    shutil.rmtree(root, ignore_errors=True)


def _local_torch_wheel() -> Path:
    """Finds the CPU torch wheel in pip's find-links folders (PIP_FIND_LINKS, /opt/wheels)."""
    dirs = os.environ.get("PIP_FIND_LINKS", "").split() + ["/opt/wheels"]
    for d in dirs:
        found = sorted(glob.glob(os.path.join(d.removeprefix("file://"), TORCH_WHEEL_GLOB)))
        if found:
            return Path(found[-1])
    raise MissingPart(f"no CPU torch wheel {TORCH_WHEEL_GLOB} in {dirs} (PyPI's torch==2.13.0 "
                      "is a multi-GB CUDA build); put it in one of them or in PIP_FIND_LINKS")


def ensure_wheelhouse(path: Path = WHEELHOUSE, specs: Sequence[str] = WHEEL_SPECS) -> Path:
    """Fills path with cp311 wheels of specs and their dependencies, once; returns it."""
    stamp = path / ".specs"
    if stamp.exists() and stamp.read_text() == "\n".join(specs):
        return path
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if TORCH_SPEC in specs:
        wheel = _local_torch_wheel()
        try:
            os.link(wheel, tmp / wheel.name)  # 190 MB: a hard link when on the same filesystem
        except OSError:
            shutil.copy2(wheel, tmp / wheel.name)
    # --find-links tmp: pip takes the CPU wheel (2.13.0+cpu sorts above PyPI's 2.13.0).
    _run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--dest", tmp,
          "--find-links", tmp, "--only-binary=:all:", "--python-version", "3.11", *specs],
         PIP_TIMEOUT_S)
    (tmp / ".specs").write_text("\n".join(specs))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path


@dataclasses.dataclass(frozen=True)
class BuiltImage:
    """The worker image as built here: tag, build seconds, size."""

    tag: str
    build_s: float
    size_bytes: int


def build_image(engine: Engine, tag: str = IMAGE_TAG) -> BuiltImage:
    """Builds docker/Dockerfile offline against the local base, from the wheelhouse.

    One process at a time (a lock under CACHE): two cold runs must not debootstrap into the
    same folder.
    """
    with _flock(CACHE / "build.lock", timeout_s=BUILD_TIMEOUT_S + DEBOOTSTRAP_TIMEOUT_S):
        return _build_image(engine, tag)


def ensure_debs(engine: Engine, base: str, path: Path = DEBS,
                packages: Sequence[str] = RDMA_PACKAGES) -> Path:
    """Fills path with the .debs of packages and of their dependencies the base lacks, once.

    The base here is Debian bookworm like this machine, so this machine's apt (its package
    lists and mirror) provides them: `apt-cache depends` for the closure, the base's
    `dpkg-query` for what it has, `apt-get download` for the rest.
    """
    stamp = path / ".packages"
    key = f"{base}\n" + "\n".join(packages)
    if stamp.exists() and stamp.read_text() == key:
        return path
    have = set(engine.docker("run", "--rm", "--network", "none", base, "dpkg-query", "-W",
                             "-f", "${Package}\n").stdout.split())
    need = _missing_closure(packages, have)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    os.chmod(tmp, 0o777)  # apt-get download drops to the _apt user to write here
    _run(["apt-get", "download", *sorted(need)], APT_TIMEOUT_S, cwd=tmp)
    stamp_tmp = tmp / ".packages"
    stamp_tmp.write_text(key)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path


def _missing_closure(packages: Sequence[str], have: set[str]) -> set[str]:
    """packages and their Depends/PreDepends not in have, recursively; of alternatives
    (``a | b``) the first, as apt itself prefers it, unless another one is already there."""
    need, todo = set(), [p for p in packages if p not in have]
    while todo:
        pkg = todo.pop()
        if pkg in need:
            continue
        need.add(pkg)
        out = _run(["apt-cache", "depends", "--no-recommends", "--no-suggests", "--no-conflicts",
                    "--no-breaks", "--no-replaces", "--no-enhances", pkg], 60).stdout
        group: list[str] = []
        for line in out.splitlines()[1:]:
            match = re.match(r"^\s*(\|?)(?:Pre)?Depends: (\S+)", line)
            if not match:
                continue
            group.append(match.group(2))
            if match.group(1):  # "|": an alternative follows
                continue
            if not any(name in have or name in need for name in group):
                first = group[0]
                if not first.startswith("<"):  # virtual: provided by an installed package
                    todo.append(first)
            group = []
    return need


def _build_image(engine: Engine, tag: str) -> BuiltImage:
    base, wheelhouse = ensure_base_image(engine), ensure_wheelhouse()
    debs = ensure_debs(engine, base)
    start = time.monotonic()
    proc = engine.docker("build", "--network", BUILD_NETWORK, "-f", "docker/Dockerfile",
                         "--build-arg", f"BASE_IMAGE={base}",
                         "--build-arg", f"WHEELHOUSE={wheelhouse.relative_to(REPO)}",
                         "--build-arg", f"RDMA_DEBS={debs.relative_to(REPO)}",
                         "-t", tag, ".", cwd=REPO, timeout_s=BUILD_TIMEOUT_S, check=False)
    (CACHE / "build.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise DockerError(f"docker build failed; {CACHE / 'build.log'}:\n"
                          f"{(proc.stdout + proc.stderr)[-3000:]}")
    size = int(engine.docker("image", "inspect", "-f", "{{.Size}}", tag).stdout)
    return BuiltImage(tag, time.monotonic() - start, size)


# -- pods -------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Pod:
    """A holder container whose network namespace is on the bridge.

    Attributes:
        name: holder container name, also its netns name (`<prefix>-pod<i>`).
        hostname: what socket.gethostname() says inside.
        addr: IPv4 address of eth0 inside.
    """

    name: str
    hostname: str
    addr: str


@dataclasses.dataclass(frozen=True)
class Container:
    """A detached container started by PodNetwork.run."""

    engine: Engine
    name: str

    def wait(self, timeout_s: float) -> int:
        """Returns the exit status; raises DockerError (with logs) if still running at timeout."""
        try:
            proc = self.engine.docker("wait", self.name, timeout_s=timeout_s)
        except DockerError as exc:
            raise DockerError(f"{exc}\n--- logs of {self.name}:\n{self.logs()[-3000:]}") from exc
        return int(proc.stdout.strip())

    def logs(self) -> str:
        """stdout and stderr so far, interleaved as docker stored them."""
        proc = self.engine.docker("logs", self.name, check=False)
        return proc.stdout + proc.stderr


def wait_all(containers: Sequence[Container], timeout_s: float) -> list[int | None]:
    """Waits until every container has exited, or one has failed, or timeout_s has passed.

    Returns:
        Exit statuses in order; None for a container still running. One failure ends the wait:
        after it the others may hang for minutes (torchrun's exit barrier waits 300 s).
    """
    engine, names = containers[0].engine, [c.name for c in containers]
    deadline = time.monotonic() + timeout_s
    while True:
        out = engine.docker("inspect", "-f", "{{.State.Running}} {{.State.ExitCode}}", *names)
        states = [line.split() for line in out.stdout.splitlines()]
        codes = [None if running == "true" else int(code) for running, code in states]
        if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
            return codes
        if time.monotonic() > deadline:
            return codes
        time.sleep(0.5)


class PodNetwork:
    """Pods on a private bridge (HostSandbox with no hosts of its own); always cleans up.

    Args:
        engine: a started Engine.
        holder_image: image with `sleep` for the holder containers (the worker image will do).
        prefix: names of netns, links and containers start with it.
        subnet: private /24; the bridge is .1, pods get .11, .12, … unless given an address.
    """

    def __init__(self, engine: Engine, holder_image: str, prefix: str = POD_PREFIX,
                 subnet: str = POD_SUBNET):
        self.engine, self.holder_image, self.prefix = engine, holder_image, prefix
        self.net = ipaddress.ip_network(subnet)
        self.pods: list[Pod] = []
        self._containers: list[str] = []
        self._box: hosts.HostSandbox | None = None
        self._lock = None

    def __enter__(self) -> "PodNetwork":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> "PodNetwork":
        """Takes the prefix's lock, removes what a dead run left, creates the bridge."""
        self._lock = _acquire(f"/run/ddp-smoke-pods-{self.prefix}.lock")
        self._remove_leftovers()  # we hold the lock: whatever carries our prefix is a dead run's
        self._box = hosts.HostSandbox(self.prefix, str(self.net), 0).up()
        return self

    def _remove_leftovers(self) -> None:
        ps = self.engine.docker("ps", "-aq", "--filter", f"label=ddp-smoke.pods={self.prefix}")
        if ps.stdout.split():
            self.engine.docker("rm", "-f", *ps.stdout.split())
        for ns in hosts.netns_names():
            if re.fullmatch(rf"{self.prefix}-pod\d+", ns):
                _run(["ip", "netns", "del", ns], 10)
        problems = hosts.teardown_by_name(self.prefix)
        if problems:
            raise DockerError(f"pods {self.prefix}: could not remove leftovers: {problems}")

    def add_pod(self, hostname: str, addr: str | None = None,
                etc_hosts: Mapping[str, str] | None = None) -> Pod:
        """Starts a holder and plugs its namespace into the bridge.

        Args:
            hostname: the pod's hostname.
            addr: its address (default: .11 for the first pod, .12 …).
            etc_hosts: name → address lines for its /etc/hosts (give every pod's name, as
                Kubernetes DNS would resolve them).

        Returns:
            The Pod; run containers in it with run().
        """
        index = len(self.pods) + 1
        name, addr = f"{self.prefix}-pod{index}", addr or str(self.net[10 + index])
        add_hosts = [f"--add-host={n}:{a}" for n, a in (etc_hosts or {}).items()]
        self._containers.append(name)
        self.engine.docker("run", "-d", "--name", name, f"--label=ddp-smoke.pods={self.prefix}",
                           "--network", "none", "--hostname", hostname, *add_hosts,
                           "--entrypoint", "sleep", self.holder_image, "infinity")
        pid = self.engine.docker("inspect", "-f", "{{.State.Pid}}", name).stdout.strip()
        _run(["ip", "netns", "attach", name, pid], 10)
        self._box.plug(name, addr)
        pod = Pod(name, hostname, addr)
        self.pods.append(pod)
        return pod

    def run(self, pod: Pod, image: str, args: Sequence[str] = (), *,
            command: Sequence[str] | None = None, env: Mapping[str, str] | None = None,
            volumes: Sequence[str] = (), user: str | None = None, shm_size: str = "256m",
            extra: Sequence[str] = ()) -> Container:
        """Starts image in pod's network namespace (hostname and /etc/hosts included), detached.

        Args:
            pod: from add_pod.
            image: the image to run.
            args: like Kubernetes `args` (replace CMD; after the entrypoint).
            command: like Kubernetes `command` (replaces the ENTRYPOINT); None keeps it.
            env: environment variables.
            volumes: `HOST:CONTAINER[:ro]` mounts.
            user: `UID[:GID]` (runAsUser); None keeps the image's USER.
            shm_size: /dev/shm size (Kubernetes: an emptyDir of medium Memory).
            extra: further `docker run` options (e.g. --cap-drop=ALL).

        Returns:
            The Container; wait() on it, then logs().
        """
        name = f"{pod.name}-c{sum(c.startswith(pod.name + '-c') for c in self._containers) + 1}"
        opts = ["--name", name, f"--label=ddp-smoke.pods={self.prefix}",
                f"--network=container:{pod.name}", f"--shm-size={shm_size}"]
        opts += [f"--env={k}={v}" for k, v in (env or {}).items()]
        opts += [f"--volume={v}" for v in volumes] + ([f"--user={user}"] if user else [])
        argv = list(args)
        if command is not None:
            opts += ["--entrypoint", command[0]]
            argv = [*command[1:], *argv]
        self._containers.append(name)
        self.engine.docker("run", "-d", *opts, *extra, image, *argv)
        return Container(self.engine, name)

    def down(self) -> None:
        """Removes containers, pod namespaces and the bridge; raises DockerError on leftovers."""
        problems = []
        if self._containers:
            rm = self.engine.docker("rm", "-f", *reversed(self._containers), check=False)
            problems += [ln for ln in rm.stderr.splitlines() if "No such container" not in ln]
        for pod in self.pods:
            proc = _run(["ip", "netns", "del", pod.name], 10, check=False)
            if proc.returncode != 0 and "No such file" not in proc.stderr:
                problems.append(proc.stderr.strip())
        self._containers, self.pods = [], []
        try:
            if self._box is not None:
                self._box.down()
        except hosts.SandboxError as exc:
            problems.append(str(exc))
        finally:
            self._box = None
            if self._lock is not None:
                self._lock.close()
                self._lock = None
        if problems:
            raise DockerError(f"pods {self.prefix} left behind: {problems}")


# -- pytest fixtures ----------------------------------------------------------------------------

_BUILT: dict[tuple[str, str], BuiltImage] = {}  # one build per process, however many modules


def _pytest():
    import pytest  # only the tests need pytest; the CLI must not

    return pytest


def _engine_fixture():
    pytest = _pytest()

    @pytest.fixture(scope="session")
    def docker_engine() -> Iterator[Engine]:
        """A started private Engine (skips when this machine lacks root or docker.io)."""
        engine = Engine()
        try:
            engine.start()
        except MissingPart as exc:
            pytest.skip(f"no Docker engine: {exc}")
        yield engine
        engine.stop()

    return docker_engine


def _image_fixture():
    pytest = _pytest()

    @pytest.fixture(scope="session")
    def worker_image(docker_engine: Engine) -> BuiltImage:
        """docker/Dockerfile built offline on the local base (skips without the CPU wheel)."""
        key = (str(docker_engine.root), IMAGE_TAG)
        if key not in _BUILT:
            try:
                _BUILT[key] = build_image(docker_engine)
            except MissingPart as exc:
                pytest.skip(f"cannot build the image: {exc}")
        return _BUILT[key]

    return worker_image


def _pods_fixture():
    pytest = _pytest()

    @pytest.fixture
    def pod_network(docker_engine: Engine, worker_image: BuiltImage) -> Iterator[PodNetwork]:
        """A PodNetwork (prefix dsd, 10.231.3.0/24) torn down after the test."""
        reason = hosts.missing_requirements()
        if reason:
            pytest.skip(reason)
        with PodNetwork(docker_engine, worker_image.tag) as net:
            yield net

    return pod_network


try:
    docker_engine, worker_image, pod_network = (
        _engine_fixture(), _image_fixture(), _pods_fixture())
except ImportError:  # the CLI on a machine without pytest
    pass


# -- CLI ----------------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m tests.sandbox.docker up|down|build`."""
    parser = argparse.ArgumentParser(prog="python -m tests.sandbox.docker",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("verb", choices=["up", "down", "build"])
    parser.add_argument("--tag", default=IMAGE_TAG, help=f"image tag for build ({IMAGE_TAG})")
    args = parser.parse_args(argv)
    engine = Engine()
    try:
        if args.verb == "down":
            (engine.root / "manual").unlink(missing_ok=True)
            stopped = engine.stop(force=True)
            print("dockerd stopped" if stopped else "dockerd not stopped: not running or in use")
            return 0
        engine.start()
        if args.verb == "up":
            (engine.root / "manual").touch()  # tests then leave it running
            print(f"export DOCKER_HOST={engine.host}   # PID {engine.pid()}")
            return 0
        built = build_image(engine, args.tag)
        print(f"{built.tag}: built in {built.build_s:.1f} s, {built.size_bytes / 1e6:.0f} MB")
        return 0
    except DockerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, MissingPart) else 1
    finally:
        if args.verb == "build":
            engine.stop()


if __name__ == "__main__":
    sys.exit(main())
