"""Real faults on one machine, as a cluster has them (../shared/reference/fault-recipes.md).

Every fault here is the kernel's own, put on real processes and real network paths: a cgroup
CPU quota or memory limit on a process, tc and iptables inside a network-namespace host (and
on its veth's bridge side), a tmpfs report folder filled up or remounted read-only. Each is a
context manager that undoes itself, so a failing test leaves nothing behind. Root only.

This kernel has the ``tbf`` and ``htb`` qdiscs and ``u32`` filters; ``netem`` and ``prio`` are
missing, so delay and loss are made with rates and drops, never with netem.
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

from tests.sandbox import tools
from tests.sandbox.hosts import Host

CMD_TIMEOUT_S = 10
SLOW_RATE = ["rate", "200mbit", "burst", "64kb", "latency", "500ms"]
LARGE_BYTES = 1200  # a packet longer than this is dropped by blackhole(): a frame's worth
MEMORY_HEADROOM_BYTES = 256 << 10  # the OOM cgroup's limit sits this far above the use


class FaultError(RuntimeError):
    """A fault could not be put in place (the message says what failed)."""


def sh(*argv: str) -> None:
    tools.ensure("tc", "iptables")  # a no-op once installed
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    if proc.returncode != 0:
        raise FaultError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")


def in_host(host: Host, *argv: str) -> None:
    sh("nsenter", f"--net=/run/netns/{host.netns}", *argv)


# -- cgroups ---------------------------------------------------------------------------------

def _v2() -> bool:
    return Path("/sys/fs/cgroup/cgroup.controllers").exists()


class _Group:
    """A cgroup of our own, under the one ``pid`` is in (v1: that controller's hierarchy), so
    the process stays inside whatever holds it (a Slurm job, a session's own group)."""

    def __init__(self, controller: str, pid: int, name: str):
        if os.geteuid() != 0:
            raise FaultError("a cgroup needs root")
        line = next((ln for ln in Path(f"/proc/{pid}/cgroup").read_text().splitlines()
                     if (_v2() and ln.startswith("0::")) or
                     controller in ln.split(":")[1].split(",")), None)
        if line is None:
            raise FaultError(f"no {controller} cgroup for pid {pid}")
        root = Path("/sys/fs/cgroup") if _v2() else Path("/sys/fs/cgroup") / controller
        self.path = root / line.split(":", 2)[2].lstrip("/") / name
        self.path.mkdir()

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))  # every thread of the process

    def release(self) -> None:
        """Move the processes still in this group back to the group above it."""
        with contextlib.suppress(OSError):  # the group is gone already
            for pid in (self.path / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):  # it exited meanwhile
                    (self.path.parent / "cgroup.procs").write_text(pid)

    def remove(self) -> None:
        for _ in range(100):  # its processes leave as they end (the launch ended)
            self.release()
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)


class CpuQuota:
    """Processes held to ``share`` of one core (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``),
    as a thermally throttled or power-capped device holds a rank back."""

    def __init__(self, share: float | None, name: str | None = None):
        self.share, self.name = share, name or f"ddp-smoke-quota-{os.getpid()}"
        self.group: _Group | None = None

    @staticmethod
    def missing() -> str | None:
        """Why no quota can be set here, or None."""
        v2 = Path("/sys/fs/cgroup/cgroup.controllers")
        if not ((v2.exists() and "cpu" in v2.read_text().split())
                or Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").exists()):
            return "no cgroup cpu controller to set a quota with"
        return "a cgroup CPU quota needs root" if os.geteuid() != 0 else None

    def __enter__(self) -> "CpuQuota":
        return self

    def add(self, pid: int) -> None:
        if self.group is None:
            self.group = _Group("cpu", pid, self.name)
            self.limit(self.share)
        self.group.add(pid)

    def limit(self, share: float | None) -> None:
        """Hold the group's processes to ``share`` of one core from now on (None: no quota
        yet, so that what they start costs no test time)."""
        self.share = share
        quota = None if share is None else int(share * 100000)
        if _v2():
            (self.group.path / "cpu.max").write_text(f"{quota or 'max'} 100000")
        else:
            (self.group.path / "cpu.cfs_quota_us").write_text(str(quota or -1))

    def release(self) -> None:
        """Lift the quota now: its processes (a slurmd that outlives the test) go back to
        the group above; the group itself goes on exit."""
        if self.group is not None:
            self.group.release()

    def __exit__(self, *exc) -> None:
        if self.group is not None:
            self.group.remove()


class MemoryLimit:
    """A memory cgroup for ``pid`` whose limit sits MEMORY_HEADROOM_BYTES above what is
    charged to it: the process's next fresh pages past that make the kernel's OOM killer kill
    it (no swap counted). Pages it touched before stay charged where they were, so the
    process must take fresh pages (a large tensor, with glibc's dynamic mmap threshold off)."""

    def __init__(self, pid: int, name: str | None = None):
        self.pid = pid
        self.group = _Group("memory", pid, name or f"ddp-smoke-oom-{os.getpid()}")

    def __enter__(self) -> "MemoryLimit":
        g = self.group.path
        self.group.add(self.pid)
        if _v2():
            use = int((g / "memory.current").read_text())
            (g / "memory.swap.max").write_text("0")
            (g / "memory.max").write_text(str(use + MEMORY_HEADROOM_BYTES))
        else:  # v1 (charges stay where they were made: this kernel refuses to move them)
            for _ in range(50):
                use = int((g / "memory.usage_in_bytes").read_text())
                try:
                    (g / "memory.limit_in_bytes").write_text(str(use + MEMORY_HEADROOM_BYTES))
                    break
                except OSError as e:  # EBUSY: charged past it between the read and the write
                    if e.errno != errno.EBUSY:  # (the rank allocates as it runs; a CI run
                        raise  # met it once)
            else:
                raise RuntimeError(f"{g}: the memory limit kept falling below the usage")
            with contextlib.suppress(OSError):  # only with swap accounting
                (g / "memory.memsw.limit_in_bytes").write_text(str(use + MEMORY_HEADROOM_BYTES))
        return self

    def __exit__(self, *exc) -> None:
        self.group.remove()


# -- network, between namespace hosts ---------------------------------------------------------

@contextlib.contextmanager
def slow_node(host: Host, rail: int = 0):
    """tbf on both ends of the node's veth: every link of the node, both directions (``rail``:
    on that rail's interface alone, 0: eth0)."""
    ifname, _, link = host.rail(rail)
    sh("tc", "qdisc", "add", "dev", link, "root", "tbf", *SLOW_RATE)
    try:
        in_host(host, "tc", "qdisc", "add", "dev", ifname, "root", "tbf", *SLOW_RATE)
        yield
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", link, "root"], capture_output=True)
        subprocess.run(["nsenter", f"--net=/run/netns/{host.netns}", "tc", "qdisc", "del",
                        "dev", ifname, "root"], capture_output=True)


def dead_interface(host: Host, rail: int = 0):
    """Everything in and out of the node's interface of ``rail`` dropped: a dead NIC or
    cable."""
    ifname = host.rail(rail)[0]
    return _rules([(host, ["INPUT", "-i", ifname, "-j", "DROP"]),
                   (host, ["OUTPUT", "-o", ifname, "-j", "DROP"])])


@contextlib.contextmanager
def slow_link(a: Host, b: Host):
    """htb at both ends; only traffic to the other end's address takes the slow class."""
    try:
        for here, there in ((a, b), (b, a)):
            dev = ["dev", here.ifname]
            in_host(here, "tc", "qdisc", "add", *dev, "root", "handle", "1:", "htb",
                    "default", "10")
            in_host(here, "tc", "class", "add", *dev, "parent", "1:", "classid", "1:10", "htb",
                    "rate", "20gbit")
            in_host(here, "tc", "class", "add", *dev, "parent", "1:", "classid", "1:30", "htb",
                    "rate", "200mbit")
            in_host(here, "tc", "filter", "add", *dev, "protocol", "ip", "parent", "1:0",
                    "prio", "1", "u32", "match", "ip", "dst", f"{there.addr}/32",
                    "flowid", "1:30")
        yield
    finally:
        for here in (a, b):
            subprocess.run(["nsenter", f"--net=/run/netns/{here.netns}", "tc", "qdisc", "del",
                            "dev", here.ifname, "root"], capture_output=True)


@contextlib.contextmanager
def _rules(rules: list[tuple[Host, list[str]]]):
    """iptables rules inserted inside hosts (``-I`` CHAIN …), deleted on exit."""
    done = []
    try:
        for host, rule in rules:
            in_host(host, "iptables", "-w", "5", "-I", *rule)
            done.append((host, rule))
        yield
    finally:
        for host, rule in reversed(done):
            subprocess.run(["nsenter", f"--net=/run/netns/{host.netns}", "iptables", "-w",
                            "5", "-D", *rule], capture_output=True)


def cut_link(a: Host, b: Host):
    """Nothing passes between a and b, either way; each still reaches every other node."""
    return _rules([(h, [chain, flag, o.addr, "-j", "DROP"]) for h, o in ((a, b), (b, a))
                   for chain, flag in (("INPUT", "-s"), ("OUTPUT", "-d"))])


def cut_node(host: Host, subnet: str):
    """The node loses its network: nothing in or out on the subnet (a pulled cable); it
    still reaches itself (its own address goes over loopback, never on the wire)."""
    return _rules([(host, ["INPUT", "!", "-i", "lo", "-s", subnet, "-j", "DROP"]),
                   (host, ["OUTPUT", "!", "-o", "lo", "-d", subnet, "-j", "DROP"])])


def lossy_link(a: Host, b: Host, probability: float = 0.03, both_ways: bool = True,
               rail: int = 0):
    """Between a and b a share of the packets vanishes at random (iptables' statistic match;
    netem is missing here): a bad cable or optic. TCP sends them again, nothing errors.
    ``both_ways=False``: only a's packets to b (a fault in one direction); ``rail``: on that
    rail's interfaces (0: eth0). Dropped where they arrive, as on a wire: a drop in the
    sender's own OUTPUT chain is a local error its TCP retries at once, unseen by its
    retransmission counters (measured: 1 segment sent again in 50 MB at 3 %)."""
    ends = ((b, a), (a, b)) if both_ways else ((b, a),)
    return _rules([(h, ["INPUT", "-i", h.rail(rail)[0], "-s", o.rail(rail)[1], "-m",
                        "statistic", "--mode", "random", "--probability", str(probability),
                        "-j", "DROP"]) for h, o in ends])


@contextlib.contextmanager
def flapping_link(a: Host, b: Host, down_s: float = 1.0, up_s: float = 1.0):
    """Between a and b nothing passes for ``down_s``, then everything for ``up_s``, over and
    over until the block ends (a flapping port), starting down; each end still reaches every
    other node. Dropped where they arrive, as on a wire (see :func:`lossy_link`: a drop in
    the sender's OUTPUT is a local error its TCP retries unseen; measured on a link kept busy
    with a byte every 0.2 s for 12 s: 2 retransmission timeouts there, 17 with INPUT)."""
    rules = [(h, ["INPUT", "-s", o.addr, "-j", "DROP"]) for h, o in ((a, b), (b, a))]
    stop, failed = threading.Event(), []

    def flap():
        while not stop.is_set():
            try:
                with _rules(rules):
                    stop.wait(down_s)
            except FaultError as e:  # said when the block ends
                failed.append(e)
                return
            stop.wait(up_s)

    thread = threading.Thread(target=flap, name="flapping-link", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(CMD_TIMEOUT_S * len(rules))
    if failed:
        raise failed[0]


def blackhole(a: Host, b: Host, over: int = LARGE_BYTES):
    """Between a and b every packet longer than ``over`` bytes vanishes, either way: TCP
    connects and small messages pass, a large transfer never completes (a cable corrupting
    long frames; jumbo frames behind a port without them)."""
    return _rules([(h, ["OUTPUT", "-d", o.addr, "-m", "length", "--length", f"{over + 1}:65535",
                        "-j", "DROP"]) for h, o in ((a, b), (b, a))])


@contextlib.contextmanager
def renamed_interface(host: Host, to: str = "ens7"):
    """The host's interface is called ``to``, not what the launcher names (a node of another
    hardware generation, whose predictable name differs): its address and routes stay, so
    every connection by address still works, and only a lookup by name fails. Renaming takes
    the link down for a moment (milliseconds; TCP rides it out)."""
    def rename(old: str, new: str) -> None:
        in_host(host, "ip", "link", "set", old, "down")
        in_host(host, "ip", "link", "set", old, "name", new)
        in_host(host, "ip", "link", "set", new, "up")
    rename(host.ifname, to)
    try:
        yield host
    finally:
        with contextlib.suppress(FaultError):
            rename(to, host.ifname)


# -- the report folder -----------------------------------------------------------------------

class SmallFolder:
    """A tmpfs of ``size`` bytes mounted at ``path``: filled to the last byte, or turned
    read-only, when told (a full or read-only shared filesystem)."""

    def __init__(self, path: Path, size: int = 64 << 20):
        self.path, self.size, self.mounts = Path(path), size, 0

    def __enter__(self) -> "SmallFolder":
        self.path.mkdir(parents=True, exist_ok=True)
        sh("mount", "-t", "tmpfs", "-o", f"size={self.size},mode=1777", "tmpfs", str(self.path))
        self.mounts = 1
        return self

    def fill(self) -> None:
        """Nothing left: the free space taken at once (fallocate), then the last bytes."""
        fd = os.open(self.path / ".filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            free = os.statvfs(self.path)
            with contextlib.suppress(OSError):
                os.posix_fallocate(fd, 0, free.f_bavail * free.f_frsize)
            for size in (1 << 20, 4096, 1):
                with contextlib.suppress(OSError):
                    while os.write(fd, b"\0" * size):
                        pass
        finally:
            os.close(fd)

    def read_only(self) -> None:
        """Read-only for every new open from now on (EROFS), as a share remounted read-only
        under a running job: a read-only bind of the folder over itself (the tmpfs itself
        cannot be remounted while a file is open for writing; those files keep writing)."""
        sh("mount", "--bind", str(self.path), str(self.path))
        self.mounts += 1
        sh("mount", "-o", "remount,bind,ro", str(self.path))

    def __exit__(self, *exc) -> None:
        for _ in range(self.mounts):
            for _ in range(50):  # a rank may still hold a file open as it leaves
                if subprocess.run(["umount", str(self.path)],
                                  capture_output=True).returncode == 0:
                    break
                time.sleep(0.2)
            else:
                subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


OTHER_TORCH = "2.12.0+cpu"  # what other_torch() says it is


@contextlib.contextmanager
def other_torch(folder: Path, version: str = OTHER_TORCH):
    """A torch install that says it is ``version``: ``folder/torch``, every entry of this
    machine's torch linked but its ``version.py`` (and its own bytecode cache); a node whose
    ``PYTHONPATH`` is ``folder`` runs it. Only one CPU wheel is on this disk (any other spec
    downloads the CUDA build), so the skew a node with another torch has is what every
    process there sees of it: ``torch.__version__``, not another binary's behaviour."""
    import importlib.util
    real = Path(importlib.util.find_spec("torch").origin).parent
    mine = folder / "torch"
    mine.mkdir(parents=True)
    try:
        for entry in real.iterdir():
            if entry.name not in ("version.py", "__pycache__"):
                (mine / entry.name).symlink_to(entry)
        (mine / "__pycache__").mkdir()  # not the real one: its version.pyc stays the real's
        text = (real / "version.py").read_text()
        mine.joinpath("version.py").write_text(
            "".join(f"__version__ = {version!r}\n" if line.startswith("__version__ =")
                    else line for line in text.splitlines(keepends=True)))
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # the links, not what they point at
