"""Several "hosts" on one machine: one network namespace per host on a private bridge.

Each host gets its own network namespace ``<prefix>-node<i>`` with ``eth0`` (a veth whose other
end ``<prefix>-v<i>`` sits on the bridge ``<prefix>-br``), the address ``.10+i`` of the given /24
(the bridge holds ``.1``, named ``<prefix>-gw``), its own hostname ``<prefix>-node<i>`` (a UTS
namespace per started process), and its names in ``/etc/hosts`` between marker lines named after
the prefix, so several sandboxes coexist. There is no default route in a host: nothing leaves the
private subnet. The filesystem is shared, so a venv or a report directory is at the same path on
every host.

Rails (``rail_subnets``): each further /24 is another network, a rail of a rail-optimized
fabric. Every host then has one more interface per rail (``eth1`` on the first, with the
address ``.10+i`` of that subnet, its bridge-side veth ``<prefix>-r<k>v<i>``), each rail its
own bridge ``<prefix>-br<k>`` (a leaf switch), and a spine joins them: a namespace
``<prefix>-spine`` with a leg on every bridge at ``.254``, forwarding between them. Each host
routes by source address, as a host with one NIC per rail does: traffic from a rail's address
leaves through that rail, and reaches another rail's addresses through the spine. One rail
(the default) is the sandbox as it always was: no second bridge, no spine, no rules.

Used by the tests as a context manager (or through :func:`sandbox_fixture`)::

    with HostSandbox("dsh", "10.231.1.0/24", 2) as box:
        proc = box.popen(box.hosts[0], ["torchrun", ...], env=env)

and by a person, from the repository root, as root::

    python -m tests.sandbox.hosts up 2            # prefix dsh, subnet 10.231.1.0/24
    python -m tests.sandbox.hosts up 3 --rail-subnet 10.231.2.0/24   # two rails
    python -m tests.sandbox.hosts exec dsh-node1 -- hostname -I
    python -m tests.sandbox.hosts status
    python -m tests.sandbox.hosts down

Start refuses when a name, the subnet, or the hosts block is already there, unless all of it is
a sandbox of the same prefix whose maker is gone: each sandbox that is up has an owner record
(``/run/ddp-smoke-sandbox-<prefix>.owner.json``: the making process's PID and start time, and
the PIDs it started outside the hosts' namespaces), so what a killed run left (a CI job stopped
mid-suite, a test worker killed) is removed by the next start of that prefix instead of
refusing every later run. Teardown removes what this sandbox made even after a failure
(processes by PID, namespaces, links, bridge, hosts lines, the iptables rule) and raises
:class:`SandboxError` listing whatever it could not remove.
"""
from __future__ import annotations

import argparse
import dataclasses
import fcntl
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Callable, Iterable, Sequence

from tests.sandbox import tools

DEFAULT_PREFIX = "dsh"
DEFAULT_SUBNET = "10.231.1.0/24"
FIRST_HOST_OFFSET = 10  # host i (1-based) gets .10+i: .11, .12, …
IP_TIMEOUT_S = 10  # an `ip` call is instant; a stuck one must not hang a test
STOP_GRACE_S = 3.0  # daemons need ~2 s to exit on SIGTERM before SIGKILL
_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{1,7}$")  # keeps `<prefix>-node99` under 15 chars
SPINE_OFFSET = 254  # the spine's leg on every rail: .254
RAIL_TABLE = 100    # host routing table of rail k: 100 + k (source-address rules)
# What a sandbox runs itself; iptables for the bridge's ACCEPT rule (see _Firewall).
_ROOT_TOOLS = ("ip", "nsenter", "unshare", "hostname", "iptables")


class SandboxError(RuntimeError):
    """A sandbox could not start (clash, missing tool) or could not clean up fully."""


@dataclasses.dataclass(frozen=True)
class Host:
    """One host of the sandbox.

    Attributes:
        name: hostname inside the host, also its /etc/hosts name.
        netns: network namespace name (under /run/netns).
        addr: IPv4 address on the bridge.
        link: the bridge-side veth in the root namespace.
        ifname: the interface inside the namespace.
    """

    name: str
    netns: str
    addr: str
    link: str
    ifname: str = "eth0"
    rails: tuple = ()  # the further rails' interfaces: (ifname, addr, link) each, rail 1 first

    def rail(self, k: int) -> tuple[str, str, str]:
        """(interface, address, bridge-side veth) of rail ``k`` (0: eth0)."""
        return (self.ifname, self.addr, self.link) if k == 0 else tuple(self.rails[k - 1])


def _sh(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    """Runs a short system command, captured, bounded by IP_TIMEOUT_S."""
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and proc.returncode != 0:
        raise SandboxError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _ip_json(*args: str) -> list:
    """Returns `ip -j ARGS` parsed (an empty list when ip prints nothing)."""
    out = _sh(["ip", "-j", *args]).stdout.strip()
    return json.loads(out) if out else []


def _undo_ip(argv: Sequence[str]) -> None:
    """Runs an `ip … del`; a device that is already gone (its netns died) counts as done."""
    proc = _sh(argv, check=False)
    if proc.returncode != 0 and "Cannot find device" not in proc.stderr:
        raise SandboxError(f"`{' '.join(argv)}`: {proc.stderr.strip()}")


def host_command(host: Host, argv: Sequence[str]) -> list[str]:
    """Returns argv wrapped to run in host's network namespace under host's hostname.

    nsenter rather than `ip netns exec`: the latter remounts /sys and hides /sys/fs/cgroup,
    which slurmd needs. Each process gets its own UTS namespace holding host.name.
    """
    return ["nsenter", f"--net=/run/netns/{host.netns}", "unshare", "--uts", "sh", "-c",
            'hostname "$0" && exec "$@"', host.name, *argv]


def missing_requirements(needs: Sequence[str] = ()) -> str | None:
    """Installs what sandboxes (and the caller's tests: needs) run when missing (apt); returns
    why sandboxes cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "network-namespace hosts need root (ip netns, veth, bridge, unshare --uts)"
    try:
        tools.ensure(*_ROOT_TOOLS, *needs)
    except tools.MissingProgram as exc:
        return str(exc)
    return None


def netns_names() -> set[str]:
    """Returns the names of the existing named network namespaces."""
    out = _sh(["ip", "netns", "list"]).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def netns_pids(netns: str) -> list[int]:
    """Returns the PIDs of processes living in a named network namespace."""
    proc = _sh(["ip", "netns", "pids", netns], check=False)
    return [int(tok) for tok in proc.stdout.split() if tok.isdigit()]


def stop_pids(pids: Iterable[int], grace_s: float = STOP_GRACE_S) -> list[int]:
    """Sends SIGTERM to each PID, SIGKILL to survivors after grace_s; returns those still alive."""
    pids = [p for p in set(pids) if p > 1 and p != os.getpid()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if is_alive(p)]
            time.sleep(0.05)
    return [p for p in pids if is_alive(p)]


def is_alive(pid: int) -> bool:
    """True while pid exists and is not a zombie (reaps our own children on the way)."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass  # not our child: fall through to /proc
    return started_at(pid) is not None


def started_at(pid: int) -> int | None:
    """The process's start time (clock ticks after boot, /proc/PID/stat field 22): with the PID,
    one process, never a later one given the same number. None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return int(fields[19]) if fields[0] != "Z" else None


class _Owner:
    """Who made the sandbox of a prefix that is up: a JSON record in /run (gone at reboot, as
    namespaces and links are). ``pid``/``start``: the making process (None: kept up on purpose
    by a person's `up`, until their `down`); ``pids``: [pid, start] of the processes it started
    outside the hosts' namespaces (those inside are found through the namespaces)."""

    def __init__(self, prefix: str):
        self.path = f"/run/ddp-smoke-sandbox-{prefix}.owner.json"

    def read(self) -> dict | None:
        try:
            with open(self.path) as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {"pid": -1, "start": None, "pids": []}  # unreadable: its maker is unknown

    def running(self, record: dict | None) -> str | None:
        """Who holds the prefix by its ``record`` (:meth:`read`), in words; None when no one
        does (no record, its maker gone, or this very process: a sandbox of its own whose
        teardown failed)."""
        if record is None or record.get("pid") == os.getpid():
            return None
        if record.get("pid") is None:
            return "a sandbox kept up by `python -m tests.sandbox.hosts up` (or slurm's)"
        start = started_at(record["pid"])
        if start is not None and start == record["start"]:
            return f"running process {record['pid']}"
        return None

    def claim(self) -> None:
        """Writes this process's record; refuses when another has just written one."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            raise SandboxError(f"{self.path} appeared while this sandbox started: another "
                               "process is starting the same prefix") from None
        with os.fdopen(fd, "w") as f:
            json.dump({"pid": os.getpid(), "start": started_at(os.getpid()), "pids": []}, f)

    def _write(self, record: dict) -> None:
        with open(self.path, "w") as f:
            json.dump(record, f)

    def update(self, **fields) -> None:
        self._write({**(self.read() or {}), **fields})

    def add(self, pid: int) -> None:
        """Records one more process started outside the namespaces."""
        record = self.read() or {}
        self._write({**record, "pids": [*record.get("pids", []), [pid, started_at(pid)]]})

    def drop(self) -> None:
        """Removes the record if it is this process's."""
        if (self.read() or {}).get("pid") == os.getpid():
            os.unlink(self.path)

    def stop_started(self) -> list[str]:
        """Stops the recorded processes that are still the same processes; removes the record."""
        record = self.read() or {}
        pids = [pid for pid, start in record.get("pids", []) if started_at(pid) == start]
        left = stop_pids(pids)
        if os.path.exists(self.path):
            os.unlink(self.path)
        return [f"processes {left} would not die"] if left else []


class _HostsFile:
    """The marker-delimited block of one sandbox in /etc/hosts, edited in place under flock.

    In place, not by rename: /etc/hosts is often a bind mount in containers. The lock is shared
    with every other sandbox using this module.
    """

    def __init__(self, path: str, prefix: str):
        self.path = path
        self.begin = f"# >>> ddp-smoke sandbox {prefix} >>>"
        self.end = f"# <<< ddp-smoke sandbox {prefix} <<<"

    def _edit(self, change: Callable[[list[str]], list[str]]) -> None:
        with open(self.path, "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            lines = change(self._without_block(f.read().splitlines()))
            f.seek(0)
            f.write("".join(line + "\n" for line in lines))
            f.truncate()

    def _without_block(self, lines: list[str]) -> list[str]:
        if self.begin not in lines:
            return lines
        start = lines.index(self.begin)
        stop = lines.index(self.end, start) if self.end in lines[start:] else len(lines) - 1
        return lines[:start] + lines[stop + 1:]

    def has_block(self) -> bool:
        """True when this prefix's block is present."""
        with open(self.path) as f:
            return self.begin in f.read().splitlines()

    def names_present(self, names: Iterable[str]) -> list[str]:
        """Returns which of names already appear in the file outside comments and this block."""
        with open(self.path) as f:
            lines = self._without_block(f.read().splitlines())
        tokens = {t for line in lines for t in line.split("#", 1)[0].split()}
        return [n for n in names if n in tokens]

    def write(self, entries: dict[str, str]) -> None:
        """Replaces the block with one `addr name` line per entry."""
        block = [self.begin] + [f"{addr} {name}" for name, addr in entries.items()] + [self.end]
        self._edit(lambda lines: lines + block)

    def remove(self) -> None:
        """Removes the block (no-op when absent)."""
        self._edit(lambda lines: lines)


class _Firewall:
    """One tagged iptables ACCEPT rule for the bridge, when a FORWARD DROP policy would cut it.

    Bridge netfilter is on in the kernels we run on, so bridged traffic crosses FORWARD; a
    dockerd started with its iptables defaults sets that policy to DROP.
    """

    def __init__(self, bridge: str, tag: str):
        self.rule = ["FORWARD", "-i", bridge, "-o", bridge, "-m", "comment", "--comment", tag,
                     "-j", "ACCEPT"]
        self.tag = tag

    @staticmethod
    def available() -> bool:
        """True when iptables is installed."""
        return shutil.which("iptables") is not None

    def forward_drops(self) -> bool:
        """True when the FORWARD chain's policy is DROP."""
        out = _sh(["iptables", "-w", "5", "-S", "FORWARD"]).stdout
        return "-P FORWARD DROP" in out.splitlines()

    def present(self) -> bool:
        """True when a rule carrying our tag exists."""
        if not self.available():
            return False
        return self.tag in _sh(["iptables", "-w", "5", "-S", "FORWARD"]).stdout

    def insert(self) -> None:
        """Inserts the rule at the top of FORWARD."""
        _sh(["iptables", "-w", "5", "-I", *self.rule[:1], "1", *self.rule[1:]])

    def delete(self) -> None:
        """Deletes every copy of the rule."""
        while _sh(["iptables", "-w", "5", "-D", *self.rule], check=False).returncode == 0:
            pass


class HostSandbox:
    """N hosts on a private bridge; a context manager that always cleans up.

    Args:
        prefix: 2–8 lowercase letters/digits; every name this sandbox makes starts with it.
        subnet: a private IPv4 /24; the bridge takes .1, host i takes .10+i.
        count: number of hosts to create (0 for a bare bridge to `plug` namespaces into).
        hosts_file: the hosts file to write names into.
        rail_subnets: one private /24 per further rail (none: one network, as always).
    """

    def __init__(self, prefix: str = DEFAULT_PREFIX, subnet: str = DEFAULT_SUBNET,
                 count: int = 2, hosts_file: str = "/etc/hosts",
                 rail_subnets: Sequence[str] = ()):
        if not _PREFIX_RE.match(prefix):
            raise SandboxError(f"prefix {prefix!r} must match {_PREFIX_RE.pattern}")
        self.nets = [ipaddress.ip_network(n) for n in (subnet, *rail_subnets)]
        self.net = self.nets[0]
        for net in self.nets:
            if net.prefixlen != 24 or not net.is_private:
                raise SandboxError(f"subnet {net} must be a private /24")
        if len(set(self.nets)) != len(self.nets) or len(self.nets) > 8:
            raise SandboxError(f"rail subnets {[str(n) for n in self.nets]}: at most 8, distinct")
        if not 0 <= count <= 200:
            raise SandboxError(f"count {count} must be between 0 and 200")
        self.prefix, self.bridge = prefix, f"{prefix}-br"
        self.bridges = [self.bridge] + [f"{prefix}-br{k}" for k in range(1, len(self.nets))]
        self.spine = f"{prefix}-spine" if len(self.nets) > 1 else None
        self.gateway = Host(f"{prefix}-gw", "", str(self.net[1]), self.bridge, self.bridge)
        self.hosts = [Host(f"{prefix}-node{i}", f"{prefix}-node{i}",
                           str(self.net[FIRST_HOST_OFFSET + i]), f"{prefix}-v{i}",
                           rails=tuple((f"eth{k}", str(net[FIRST_HOST_OFFSET + i]),
                                        f"{prefix}-r{k}v{i}")
                                       for k, net in enumerate(self.nets[1:], 1)))
                      for i in range(1, count + 1)]
        self.plugged: list[Host] = []
        self._hosts_file = _HostsFile(hosts_file, prefix)
        self._firewalls = [_Firewall(br, f"ddp-smoke-{prefix}" + (f"-{k}" if k else ""))
                           for k, br in enumerate(self.bridges)]
        self._undo: list[tuple[str, Callable[[], None]]] = []
        self._procs: list[subprocess.Popen] = []
        self._made_netns: list[str] = []
        self._owner = _Owner(prefix)
        self._claimed = False

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> "HostSandbox":
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> "HostSandbox":
        """Creates bridge, hosts, names and firewall rule; undoes all of it if a step fails.

        Raises:
            SandboxError: on a clash with something that exists, or when a step fails.
        """
        record = self._owner.read()
        holder = self._owner.running(record)
        if holder:
            raise SandboxError(f"sandbox {self.prefix} ({self.net}) refuses to start: it is up, "
                               f"made by {holder}")
        clashes = self.clashes()
        if (clashes or record) and not self._foreign(clashes):
            problems = teardown_by_name(self.prefix, self._hosts_file.path)
            print(f"sandbox {self.prefix}: removed the leftovers of a sandbox whose maker is "
                  f"gone (or failed to remove them): {'; '.join(clashes) or 'its owner record'}",
                  file=sys.stderr)
            clashes = problems + self.clashes()
        if clashes:
            raise SandboxError(
                f"sandbox {self.prefix} ({self.net}) refuses to start, already there: "
                f"{'; '.join(clashes)}. If a previous run of yours left them, run "
                f"`python -m tests.sandbox.hosts down --prefix {self.prefix}`.")
        self._owner.claim()
        self._claimed = True
        try:
            for k in range(len(self.nets)):
                self._make_bridge(k)
            if self.spine:
                self._make_spine()
            for host in self.hosts:
                self._make_host(host)
            self._write_names()
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Stops processes, then removes everything this sandbox made, newest first.

        Raises:
            SandboxError: naming what is left behind, after trying every step.
        """
        if not self._claimed:
            return  # never started (e.g. refused on a clash): what exists is not ours
        problems = self._stop_processes(self._made_netns)
        while self._undo:
            what, undo = self._undo.pop()
            try:
                undo()
            except Exception as exc:  # keep going: one stuck step must not strand the rest
                problems.append(f"{what}: {exc}")
        problems += self.leftovers()
        if not problems:  # else the record stays: the next start of the prefix removes the rest
            self._owner.drop()
            self._claimed = False
        if problems:
            msg = f"sandbox {self.prefix} could NOT clean up fully: {'; '.join(problems)}"
            print(f"!!! {msg}", file=sys.stderr)
            raise SandboxError(msg)

    def _do(self, what: str, argv: Sequence[str], undo: Sequence[str]) -> None:
        """Runs argv, then remembers how to undo it (only once it has succeeded)."""
        _sh(argv)
        self._undo.append((what, lambda: _undo_ip(undo)))

    def _make_bridge(self, k: int = 0) -> None:
        """Rail k's bridge; rail 0's holds the gateway address (the root namespace's leg)."""
        br, firewall = self.bridges[k], self._firewalls[k]
        self._do(f"bridge {br}", ["ip", "link", "add", br, "type", "bridge"],
                 ["ip", "link", "del", br])
        if k == 0:
            _sh(["ip", "addr", "add", f"{self.gateway.addr}/24", "dev", br])
        _sh(["ip", "link", "set", br, "up"])
        if _Firewall.available() and firewall.forward_drops():
            firewall.insert()
            self._undo.append((f"iptables rule {firewall.tag}", firewall.delete))

    def _make_spine(self) -> None:
        """A namespace routing between the rails' bridges: one leg (.254) on each."""
        self._do(f"netns {self.spine}", ["ip", "netns", "add", self.spine],
                 ["ip", "netns", "del", self.spine])
        self._made_netns.append(self.spine)
        for k, (net, br) in enumerate(zip(self.nets, self.bridges)):
            leg = f"{self.prefix}-s{k}"
            self._do(f"link {leg}", ["ip", "link", "add", leg, "type", "veth", "peer", "name",
                                     f"leg{k}", "netns", self.spine], ["ip", "link", "del", leg])
            _sh(["ip", "link", "set", leg, "master", br, "up"])
            _sh(["ip", "-n", self.spine, "addr", "add", f"{net[SPINE_OFFSET]}/24", "dev",
                 f"leg{k}"])
            _sh(["ip", "-n", self.spine, "link", "set", f"leg{k}", "up"])
        # forwarding in the spine's namespace only (/proc/sys/net is per network namespace)
        _sh(["ip", "netns", "exec", self.spine, "sh", "-c",
             "echo 1 > /proc/sys/net/ipv4/ip_forward"])

    def _make_host(self, host: Host) -> None:
        self._do(f"netns {host.netns}", ["ip", "netns", "add", host.netns],
                 ["ip", "netns", "del", host.netns])
        self._made_netns.append(host.netns)
        self._attach(host)
        for k in range(1, len(self.nets)):
            ifname, addr, link = host.rail(k)
            self._attach(dataclasses.replace(host, addr=addr, link=link, ifname=ifname), k)
        if self.spine:
            self._route_by_source(host)

    def _route_by_source(self, host: Host) -> None:
        """Traffic from rail k's address leaves through rail k; other rails via the spine."""
        ns = ["ip", "-n", host.netns]
        for k, net in enumerate(self.nets):
            ifname, addr, _ = host.rail(k)
            table = str(RAIL_TABLE + k)
            _sh([*ns, "route", "add", str(net), "dev", ifname, "src", addr, "table", table])
            _sh([*ns, "route", "add", "default", "via", str(net[SPINE_OFFSET]), "dev", ifname,
                 "table", table])
            _sh([*ns, "rule", "add", "from", addr, "table", table])

    def _attach(self, host: Host, rail: int = 0) -> None:
        """Veth from rail's bridge into host.netns, addressed, up (loopback too)."""
        self._do(f"link {host.link}", ["ip", "link", "add", host.link, "type", "veth", "peer",
                                       "name", host.ifname, "netns", host.netns],
                 ["ip", "link", "del", host.link])
        _sh(["ip", "link", "set", host.link, "master", self.bridges[rail], "up"])
        ns = ["ip", "-n", host.netns]
        _sh([*ns, "addr", "add", f"{host.addr}/24", "dev", host.ifname])
        _sh([*ns, "link", "set", host.ifname, "up"])
        _sh([*ns, "link", "set", "lo", "up"])

    def _write_names(self) -> None:
        entries = {h.name: h.addr for h in [self.gateway, *self.hosts, *self.plugged] if h.name}
        self._hosts_file.write(entries)
        if not any(what == "hosts lines" for what, _ in self._undo):
            self._undo.append(("hosts lines", self._hosts_file.remove))

    # -- checks ------------------------------------------------------------------------------

    def _my_links(self) -> list[str]:
        names = [link["ifname"] for link in _ip_json("link", "show")]
        return [n for n in names if n.startswith(f"{self.prefix}-")]

    def _my_netns(self) -> list[str]:
        return sorted(n for n in netns_names()
                      if re.fullmatch(rf"{self.prefix}-(node\d+|spine)", n))

    def clashes(self) -> list[str]:
        """Returns what already exists that this sandbox would create or collide with."""
        found = [f"link {n}" for n in self._my_links()]
        found += [f"netns {n}" for n in self._my_netns()]
        for iface in _ip_json("-4", "addr", "show"):
            for a in iface.get("addr_info", []):
                if any(ipaddress.ip_address(a["local"]) in net for net in self.nets):
                    found.append(f"address {a['local']} on {iface['ifname']}")
        for route in _ip_json("-4", "route", "show", "table", "all"):
            dst = route.get("dst", "default")
            if dst != "default" and "/" in dst and any(ipaddress.ip_network(dst).overlaps(net)
                                                       for net in self.nets):
                found.append(f"route {dst} via {route.get('dev', '?')}")
        if self._hosts_file.has_block():
            found.append(f"hosts block for {self.prefix} in {self._hosts_file.path}")
        names = [h.name for h in [self.gateway, *self.hosts]]
        found += [f"name {n} in {self._hosts_file.path}"
                  for n in self._hosts_file.names_present(names)]
        found += [f"iptables rule tagged {fw.tag}" for fw in self._firewalls if fw.present()]
        return found

    def _foreign(self, clashes: Iterable[str]) -> list[str]:
        """The clashes a sandbox of this prefix cannot have made: its links, namespaces, hosts
        block and rules are its own by name; an address or route is its own on its own link;
        a name outside its block is someone else's."""
        own = (f"link {self.prefix}-", f"netns {self.prefix}-", "hosts block for ",
               "iptables rule ")
        return [c for c in clashes if not c.startswith(own)
                and not (c.startswith(("address ", "route "))
                         and c.rsplit(" ", 1)[1].startswith(f"{self.prefix}-"))]

    def own(self, pid: int) -> None:
        """Records a process this sandbox's user started outside its hosts' namespaces (Slurm's
        controller): stopped with the sandbox's leftovers should its maker be killed first."""
        self._owner.add(pid)

    def keep(self) -> None:
        """Marks the sandbox kept up on purpose (a person's `up`) until `down`: never stale."""
        self._owner.update(pid=None, start=None)

    def leftovers(self) -> list[str]:
        """Returns what of this sandbox's making still exists (empty once down)."""
        left = [f"link {n}" for n in self._my_links()] + [f"netns {n}" for n in self._my_netns()]
        if self._hosts_file.has_block():
            left.append(f"hosts block in {self._hosts_file.path}")
        left += [f"iptables rule {fw.tag}" for fw in self._firewalls if fw.present()]
        return left

    # -- processes ---------------------------------------------------------------------------

    def host(self, name: str) -> Host:
        """Returns the host (or plugged namespace) called name."""
        for h in [*self.hosts, *self.plugged]:
            if name in (h.name, h.netns):
                return h
        raise SandboxError(f"no host {name!r} in sandbox {self.prefix}: "
                           f"{[h.name for h in self.hosts + self.plugged]}")

    def popen(self, host: Host | str, argv: Sequence[str], **popen_kwargs) -> subprocess.Popen:
        """Starts argv inside host; the process is stopped (by PID) at teardown.

        Args:
            host: a Host or its name.
            argv: the command.
            **popen_kwargs: passed to subprocess.Popen (env, stdout, cwd …); env is the whole
                environment, as for Popen.

        Returns:
            The Popen, leader of its own session so its children can be stopped with it.
        """
        host = self.host(host) if isinstance(host, str) else host
        proc = subprocess.Popen(host_command(host, argv), start_new_session=True, **popen_kwargs)
        self._procs.append(proc)
        return proc

    def _stop_processes(self, namespaces: Iterable[str]) -> list[str]:
        """Stops what popen started, then anything still living in the given namespaces."""
        pids = [p.pid for p in self._procs if p.poll() is None]
        pids += [pid for ns in namespaces for pid in netns_pids(ns)]
        left = stop_pids(pids)
        for proc in self._procs:
            if proc.poll() is None:
                proc.wait(timeout=1)
        self._procs.clear()
        return [f"processes {left} would not die"] if left else []

    # -- plugging existing namespaces --------------------------------------------------------

    def plug(self, netns: str, addr: str, name: str | None = None,
             ifname: str = "eth0") -> Host:
        """Connects an existing named netns (e.g. `ip netns attach pod1 <pid>`) to the bridge.

        The veth pair is removed at teardown; the namespace itself stays its owner's.

        Args:
            netns: name under /run/netns.
            addr: address inside the subnet for ifname.
            name: hostname to add to the hosts block (None: add none).
            ifname: interface name inside netns.

        Returns:
            The plugged Host.
        """
        ip = ipaddress.ip_address(addr)
        used = {h.addr for h in [self.gateway, *self.hosts, *self.plugged]}
        if ip not in self.net or addr in used or ip in (self.net.network_address,
                                                        self.net.broadcast_address):
            raise SandboxError(f"address {addr} is not a free host address of {self.net}")
        if netns not in netns_names():
            raise SandboxError(f"no netns {netns!r}; attach one first: ip netns attach NAME PID")
        host = Host(name or "", netns, addr, f"{self.prefix}-p{len(self.plugged) + 1}", ifname)
        self._attach(host)
        self.plugged.append(host)
        if name:
            self._write_names()
        return host

    def status(self) -> dict:
        """Returns a JSON-able view: hosts, plugged namespaces, leftovers."""
        return {"prefix": self.prefix, "subnet": str(self.net), "bridge": self.bridge,
                "rail_subnets": [str(n) for n in self.nets[1:]],
                "hosts": [dataclasses.asdict(h) for h in self.hosts + self.plugged],
                "existing": self.leftovers()}


def teardown_by_name(prefix: str, hosts_file: str = "/etc/hosts") -> list[str]:
    """Removes whatever a sandbox with this prefix left (for a person, or after a crash).

    Stops the processes its owner record names (if still the same processes) and those in the
    `<prefix>-node<i>` namespaces by PID, deletes those namespaces, every link named
    `<prefix>-*`, the hosts block, the tagged iptables rule and the owner record.

    Returns:
        What could not be removed (empty on success).
    """
    box = HostSandbox(prefix, DEFAULT_SUBNET, 0, hosts_file)
    problems = box._owner.stop_started() + box._stop_processes(box._my_netns())
    steps = [(f"netns {n}", ["ip", "netns", "del", n]) for n in box._my_netns()]
    # Veths first, the bridge last: deleting a veth end removes its peer too.
    links = sorted(box._my_links(), key=lambda n: n == box.bridge)
    steps += [(f"link {n}", ["ip", "link", "del", n]) for n in links]
    for what, argv in steps:
        proc = _sh(argv, check=False)
        if proc.returncode != 0 and "Cannot find" not in proc.stderr:
            problems.append(f"{what}: {proc.stderr.strip()}")
    box._hosts_file.remove()
    for firewall in _all_firewalls(prefix):
        if firewall.present():
            firewall.delete()
    return problems + box.leftovers() + [f"iptables rule {fw.tag}"
                                         for fw in _all_firewalls(prefix) if fw.present()]


def _all_firewalls(prefix: str) -> list[_Firewall]:
    """The ACCEPT rules a sandbox with this prefix may have made, one per possible rail."""
    return [_Firewall(f"{prefix}-br" + (str(k) if k else ""),
                      f"ddp-smoke-{prefix}" + (f"-{k}" if k else "")) for k in range(8)]


def sandbox_fixture(prefix: str, subnet: str, count: int, scope: str = "module",
                    needs: Sequence[str] = (), rail_subnets: Sequence[str] = ()):
    """Returns a pytest fixture yielding a started HostSandbox, skipping without root.

    Use at module level: ``hosts = sandbox_fixture("dsh", "10.231.1.0/24", 3)``; needs names
    the programs the module's tests run themselves (``("tc",)``), installed before the start;
    rail_subnets gives every host a further interface per subnet (see the module docstring).
    """
    import pytest  # only the tests need pytest; the CLI must not

    @pytest.fixture(scope=scope)
    def _sandbox():
        reason = missing_requirements(needs)
        if reason:
            pytest.skip(reason)
        with HostSandbox(prefix, subnet, count, rail_subnets=rail_subnets) as box:
            yield box

    return _sandbox


# -- CLI ---------------------------------------------------------------------------------------

def _state_path(prefix: str) -> str:
    return f"/run/ddp-smoke-sandbox-{prefix}.json"


def _cli_up(args) -> int:
    box = HostSandbox(args.prefix, args.subnet, args.count,
                      rail_subnets=args.rail_subnet or ()).up()
    box.keep()
    with open(_state_path(args.prefix), "w") as f:
        json.dump(box.status(), f)
    for h in box.hosts:
        print(f"{h.name}\t{h.addr}\tnetns {h.netns}")
    print("run in a host:  python -m tests.sandbox.hosts exec HOST -- CMD …")
    print(f"tear down:      python -m tests.sandbox.hosts down --prefix {args.prefix}")
    return 0


def _cli_exec(args) -> int:
    with open(_state_path(args.prefix)) as f:
        hosts = [Host(**h) for h in json.load(f)["hosts"]]
    host = next((h for h in hosts if args.host in (h.name, h.netns)), None)
    if host is None:
        print(f"no host {args.host!r}; hosts: {[h.name for h in hosts]}", file=sys.stderr)
        return 2
    argv = host_command(host, args.cmd or ["bash"])
    os.execvp(argv[0], argv)


def _cli_down(args) -> int:
    problems = teardown_by_name(args.prefix)
    if os.path.exists(_state_path(args.prefix)):
        os.unlink(_state_path(args.prefix))
    if problems:
        print(f"!!! sandbox {args.prefix} NOT fully removed: {'; '.join(problems)}",
              file=sys.stderr)
        return 1
    print(f"sandbox {args.prefix}: nothing left")
    return 0


def _cli_status(args) -> int:
    box = HostSandbox(args.prefix, args.subnet, 0)
    left = box.leftovers()
    print("\n".join(left) if left else f"sandbox {args.prefix}: not running")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m tests.sandbox.hosts`."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--prefix", default=DEFAULT_PREFIX, help="name prefix (default dsh)")
    common.add_argument("--subnet", default=DEFAULT_SUBNET, help=f"/24 (default {DEFAULT_SUBNET})")
    parser = argparse.ArgumentParser(prog="python -m tests.sandbox.hosts",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    up = sub.add_parser("up", parents=[common], help="create N hosts (default 2)")
    up.add_argument("count", type=int, nargs="?", default=2)
    up.add_argument("--rail-subnet", action="append", metavar="SUBNET",
                    help="a further rail: every host gets one more interface on this /24")
    ex = sub.add_parser("exec", parents=[common], help="run a command in a host: exec HOST -- CMD")
    ex.add_argument("host")
    ex.add_argument("cmd", nargs=argparse.REMAINDER)
    sub.add_parser("down", parents=[common], help="remove everything the sandbox made")
    sub.add_parser("status", parents=[common], help="list what exists")
    args = parser.parse_args(argv)
    if getattr(args, "cmd", None) and args.cmd[0] == "--":
        args.cmd = args.cmd[1:]
    reason = missing_requirements()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    try:
        return {"up": _cli_up, "exec": _cli_exec, "down": _cli_down,
                "status": _cli_status}[args.verb](args)
    except SandboxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
