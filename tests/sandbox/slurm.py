"""A real, throw-away Slurm cluster on this machine: munged + slurmctld + one slurmd per host.

Debian's slurm-wlm (22.05) and munge, installed with apt when missing. Every node is a host of
:class:`tests.sandbox.hosts.HostSandbox` (own network namespace, address and hostname);
slurmctld runs in the root network namespace on the bridge address under its own hostname
(``<prefix>-gw``), munged there on a private socket. All state, logs and the config live in
one private run directory; clients find the cluster through ``SLURM_CONF`` (see :meth:`env`).

From the repository root, as root::

    python -m tests.sandbox.slurm up [NODES]      # prints the SLURM_CONF line to export
    export SLURM_CONF=$PWD/.sandbox/slurm/slurm.conf
    sbatch --wait --gpus-per-node=0 --cpus-per-task=2 slurm/ddp_smoke.sbatch   # needs .venv
    python -m tests.sandbox.slurm status
    python -m tests.sandbox.slurm down

Teardown signals every daemon by PID (SIGTERM, then SIGKILL), then whatever still lives in the
node namespaces, removes the hosts and the run directory, and says loudly what it could not
remove.
"""
from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from tests.sandbox import tools
from tests.sandbox.hosts import (HostSandbox, SandboxError, is_alive, missing_requirements,
                                 stop_pids, teardown_by_name)

PREFIX, SUBNET = "dss", "10.231.2.0/24"
# slurmctld listens in this machine's own network namespace, on every address: each cluster's
# port is 6900 + its subnet's third byte (dss: 6902), unique as the subnets are
# (tests/test_parallel.py), so clusters in parallel test workers never meet, and a real
# slurmctld (6817) stays untouched.
CTLD_PORT_BASE = 6900
# Installed from slurm-wlm and munge (tests/sandbox/tools.py APT); the tests run these too.
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "scancel",
            "squeue")
READY_TIMEOUT_S = 30  # daemons answer within ~1 s; nodes register within a few
PROBE_TIMEOUT_S = 60  # the first batch job waits ~3 s for the scheduler

_CONF = """\
# Written by tests/sandbox/slurm.py for a throw-away cluster; see slurm-test-cluster.md.
ClusterName=ddpsmoke
SlurmctldHost={ctld}({ctld_addr})
SlurmctldPort={port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={run}/munge/munge.socket.2
StateSaveLocation={run}/ctld/state
SlurmctldPidFile={run}/ctld/slurmctld.pid
SlurmctldLogFile={run}/log/slurmctld.log
SlurmdSpoolDir={run}/nodes/%n/spool
SlurmdPidFile={run}/nodes/%n/slurmd.pid
SlurmdLogFile={run}/log/slurmd.%n.log
# No cgroups, systemd or accounting on a test machine.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
# Lets N nodes x {cpus} CPUs exist on a 2-core machine.
SlurmdParameters=config_overrides
# sbatch --wait polls every 2 s only while the job is younger than MinJobAge/2; with the
# default 300 a 15 s job is seen done only after 42 s.
MinJobAge=5
# A cancelled or timed-out job's processes get SIGKILL 5 s after SIGTERM, not 30.
KillWait=5
SchedulerParameters=batch_sched_delay=0,sched_interval=1
NodeName=DEFAULT CPUs={cpus} RealMemory=4096 State=UNKNOWN
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
{extra}"""


def _run(argv: Sequence[str], timeout: float,
         env: dict | None = None) -> subprocess.CompletedProcess:
    """Runs a command to completion, captured, bounded by timeout."""
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, env=env)


def missing_binaries() -> list[str]:
    """Returns the Slurm/munge programs not on PATH."""
    return tools.missing(*BINARIES)


def ensure_installed() -> None:
    """Installs slurm-wlm and munge with apt when a program is missing (services stay off).

    Raises:
        SandboxError: when apt cannot install them (the apt output's tail is in the message).
    """
    try:
        tools.ensure(*BINARIES)
    except tools.MissingProgram as exc:
        raise SandboxError(str(exc)) from exc


class SlurmSandbox:
    """munged + slurmctld + N slurmd on network-namespace hosts; a context manager.

    Args:
        nodes: number of compute nodes.
        run_dir: private directory for config, state and logs (created; removed at teardown
            unless keep_run_dir).
        prefix: HostSandbox prefix; nodes are called ``<prefix>-node<i>``.
        subnet: HostSandbox subnet.
        cpus: CPUs each node declares.
        keep_run_dir: leave the logs behind after teardown (for a person debugging).
        node_name_prefix: when set, node i's Slurm NodeName is ``<node_name_prefix><i>``, a name
            that resolves nowhere, while its NodeHostname stays its hostname and its NodeAddr
            its address: three different things, as on sites whose NodeNames are inventory
            labels. None: NodeName = hostname.
        extra_conf: slurm.conf lines appended as they are (HealthCheckProgram=…, Prolog=…).
        same_hostname: ``(i, j)``: node j's slurmd (and every job step on it) runs under
            node i's hostname, as two machines cloned from one image; its NodeName and
            NodeAddr stay its own.
    """

    def __init__(self, nodes: int = 2, run_dir: str | None = None, prefix: str = PREFIX,
                 subnet: str = SUBNET, cpus: int = 2, keep_run_dir: bool = False,
                 node_name_prefix: str | None = None, extra_conf: str = "",
                 same_hostname: tuple[int, int] | None = None):
        self.extra_conf = extra_conf
        self.run_dir = Path(run_dir or f"/tmp/ddp-smoke-slurm-{os.getpid()}").resolve()
        self.conf = self.run_dir / "slurm.conf"
        self.hosts = HostSandbox(prefix, subnet, nodes)
        self.port = CTLD_PORT_BASE + ipaddress.ip_network(subnet).network_address.packed[2]
        self.cpus, self.keep_run_dir = cpus, keep_run_dir
        self.node_name_prefix = node_name_prefix
        self.same_hostname = same_hostname
        self.pids: dict[str, int] = {}
        self._started = False

    @property
    def node_names(self) -> list[str]:
        """The compute nodes' Slurm NodeNames (their hostnames unless node_name_prefix)."""
        if self.node_name_prefix:
            return [f"{self.node_name_prefix}{i}" for i in range(1, len(self.hosts.hosts) + 1)]
        return [h.name for h in self.hosts.hosts]

    @property
    def hostnames(self) -> list[str]:
        """The compute nodes' hostnames (= NodeHostname unless same_hostname), in node order."""
        return [h.name for h in self._uts_hosts()]

    def _uts_hosts(self) -> list:
        hosts = list(self.hosts.hosts)
        if self.same_hostname:
            i, j = self.same_hostname
            hosts[j] = dataclasses.replace(hosts[j], name=hosts[i].name)
        return hosts

    def env(self, **extra: str) -> dict[str, str]:
        """This process's environment plus SLURM_CONF (clients need it: no DNS SRV here)."""
        return {**os.environ, "SLURM_CONF": str(self.conf), **extra}

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> "SlurmSandbox":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> "SlurmSandbox":
        """Installs if needed, starts everything, returns once a probe job has run.

        Raises:
            SandboxError: on a clash, a daemon that does not come up, or a failed probe; the
                message names the log to read. Whatever started is torn down first.
        """
        ensure_installed()
        if self.run_dir.exists():
            raise SandboxError(f"run directory {self.run_dir} exists: is a cluster running? "
                               "`python -m tests.sandbox.slurm down` removes it")
        self.hosts.up()
        self._started = True
        try:
            self._write_files()
            self._start_daemons()
            self._wait_ready()
            self._probe()
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Stops every daemon by PID, removes hosts and run directory; loud if anything stays.

        Raises:
            SandboxError: naming what is left behind.
        """
        if not self._started:
            return  # refused at start: the run directory and hosts there are not ours
        left = stop_pids(self.pids.values())  # all at once: each takes ~2 s to exit
        problems = [f"daemons {left} would not die"] if left else []
        try:
            self.hosts.down()
        except SandboxError as exc:
            problems.append(str(exc))
        if not self.keep_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        if problems:
            msg = f"Slurm sandbox could NOT clean up fully: {'; '.join(problems)}"
            print(f"!!! {msg}", file=sys.stderr)
            raise SandboxError(msg)

    # -- steps -------------------------------------------------------------------------------

    def _write_files(self) -> None:
        run = self.run_dir
        for sub in ("munge", "ctld/state", "log", *(f"nodes/{n}/spool" for n in self.node_names)):
            (run / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(run / "munge", 0o700)  # munged refuses a socket dir others can write
        key = run / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o600)
        nodes = "\n".join(f"NodeName={n} NodeHostname={h.name} NodeAddr={h.addr}"
                          for n, h in zip(self.node_names, self.hosts.hosts))
        gw = self.hosts.gateway
        self.conf.write_text(_CONF.format(ctld=gw.name, ctld_addr=gw.addr, port=self.port,
                                          run=run, cpus=self.cpus, nodes=nodes,
                                          extra=self.extra_conf))

    def _start(self, name: str, argv: list[str], host=None) -> None:
        """Starts a daemon in the foreground (so its PID is ours), output to log/<name>.out."""
        with open(self.run_dir / "log" / f"{name}.out", "wb") as out:
            kw = dict(stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
            if host is None:  # outside the hosts' namespaces: recorded with the sandbox's owner
                proc = subprocess.Popen(argv, start_new_session=True, **kw)
                self.hosts.own(proc.pid)
            else:
                proc = self.hosts.popen(host, argv, **kw)
        self.pids[name] = proc.pid

    def _start_daemons(self) -> None:
        run, conf = self.run_dir, str(self.conf)
        self._start("munged", ["munged", "-F", "--force", f"--key-file={run}/munge/munge.key",
                               f"--socket={run}/munge/munge.socket.2",
                               f"--pid-file={run}/munge/munged.pid",
                               f"--log-file={run}/log/munged.log",
                               f"--seed-file={run}/munge/munged.seed"])
        self._wait_for(lambda: (run / "munge" / "munge.socket.2").exists(), "munged",
                       "munged.log")
        # slurmctld insists that its hostname is SlurmctldHost's ("not a valid controller").
        self._start("slurmctld", ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                                  self.hosts.gateway.name, "slurmctld", "-D", "-f", conf])
        for name, host in zip(self.node_names, self._uts_hosts()):
            self._start(f"slurmd.{name}", ["slurmd", "-D", "-f", conf, "-N", name], host=host)

    def _wait_for(self, ready, what: str, log: str, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            dead = [n for n, pid in self.pids.items() if not is_alive(pid)]
            if dead or time.monotonic() > deadline:
                why = f"{dead} exited" if dead else f"not ready after {timeout_s} s"
                raise SandboxError(f"{what}: {why}; read {self.run_dir}/log/{log} and "
                                   f"{self.run_dir}/log/*.out")
            time.sleep(0.2)

    def _idle_nodes(self) -> bool:
        proc = _run(["sinfo", "-h", "-N", "-o", "%N %T"], 10, self.env())
        states = dict(line.split() for line in proc.stdout.splitlines() if line.strip())
        return proc.returncode == 0 and all(states.get(n) == "idle" for n in self.node_names)

    def _wait_ready(self) -> None:
        self._wait_for(self._idle_nodes, "nodes idle in sinfo", "slurmctld.log")

    def _probe(self) -> None:
        """One batch job across all nodes, absorbing the first job's scheduling delay."""
        out = self.run_dir / "log" / "probe.out"
        argv = ["sbatch", "--wait", f"--nodes={len(self.node_names)}", "--time=1",
                f"--output={out}", "--wrap", "srun hostname"]
        try:
            proc = _run(argv, PROBE_TIMEOUT_S, self.env())
        except subprocess.TimeoutExpired:
            raise SandboxError(f"probe job did not finish in {PROBE_TIMEOUT_S} s; read "
                               f"{self.run_dir}/log/slurmctld.log") from None
        seen = out.read_text().split() if out.exists() else []
        if proc.returncode != 0 or sorted(seen) != sorted(self.hostnames):
            raise SandboxError(f"probe job failed ({proc.returncode}: {proc.stderr.strip()}), "
                               f"ran on {seen}; read {self.run_dir}/log/")

    def state(self) -> dict:
        """What `down` in another process needs: run dir, prefix, daemon PIDs and binaries."""
        return {"run_dir": str(self.run_dir), "prefix": self.hosts.prefix, "conf": str(self.conf),
                "pids": self.pids, "nodes": self.node_names}


def missing_for_tests() -> str | None:
    """Why the Slurm tests cannot run here (None when they can; apt may still install)."""
    reason = missing_requirements()
    if reason:
        return reason
    if missing_binaries() and shutil.which("apt-get") is None:
        return f"Slurm is not installed ({missing_binaries()}) and there is no apt-get"
    return None


def slurm_fixture(nodes: int = 2, scope: str = "module", node_name_prefix: str | None = None,
                  extra_conf=""):
    """Returns a pytest fixture yielding a running SlurmSandbox, skipping without root.
    ``extra_conf``: slurm.conf lines, or a function of the fixture's tmp_path_factory that
    returns them (a HealthCheckProgram written for the module)."""
    import pytest

    @pytest.fixture(scope=scope)
    def _cluster(tmp_path_factory):
        reason = missing_for_tests()
        if reason:
            pytest.skip(reason)
        run_dir = tmp_path_factory.mktemp("slurm") / "run"
        extra = extra_conf(tmp_path_factory) if callable(extra_conf) else extra_conf
        with SlurmSandbox(nodes, str(run_dir), node_name_prefix=node_name_prefix,
                          extra_conf=extra) as cluster:
            yield cluster

    return _cluster


# -- CLI ---------------------------------------------------------------------------------------

CLI_RUN_DIR = ".sandbox/slurm"  # under the repository root; .gitignore'd


def _cli_up(args) -> int:
    cluster = SlurmSandbox(args.nodes, args.run_dir, keep_run_dir=True)
    cluster.up()
    cluster.hosts.keep()
    (cluster.run_dir / "state.json").write_text(json.dumps(cluster.state()))
    print(f"Slurm sandbox up: nodes {cluster.node_names}, logs in {cluster.run_dir}/log")
    print(f"export SLURM_CONF={cluster.conf}")
    print("then: sbatch --wait --gpus-per-node=0 --cpus-per-task=2 slurm/ddp_smoke.sbatch")
    return 0


def _same_program(pid: int, name: str) -> bool:
    """True when pid still runs the daemon we started (guards against a reused PID)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return name.split(".")[0].encode() in f.read()
    except FileNotFoundError:
        return False


def _cli_down(args) -> int:
    state_file = Path(args.run_dir) / "state.json"
    prefix = json.loads(state_file.read_text())["prefix"] if state_file.exists() else PREFIX
    # the owner record names slurmctld and munged (start times checked: a reused PID is
    # left alone); the slurmds go with their hosts' namespaces
    problems = teardown_by_name(prefix)
    shutil.rmtree(args.run_dir, ignore_errors=True)
    if problems:
        print(f"!!! Slurm sandbox NOT fully removed: {'; '.join(problems)}", file=sys.stderr)
        return 1
    print("Slurm sandbox: nothing left")
    return 0


def _cli_status(args) -> int:
    state_file = Path(args.run_dir) / "state.json"
    if not state_file.exists():
        print(f"no Slurm sandbox state in {args.run_dir}")
        return 1
    state = json.loads(state_file.read_text())
    for name, pid in state["pids"].items():
        print(f"{name:<22} pid {pid:<8} {'running' if _same_program(pid, name) else 'GONE'}")
    env = {**os.environ, "SLURM_CONF": state["conf"]}
    print(_run(["sinfo", "-N", "-l"], 10, env).stdout, end="")
    print(f"export SLURM_CONF={state['conf']}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m tests.sandbox.slurm`."""
    parser = argparse.ArgumentParser(prog="python -m tests.sandbox.slurm",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", default=CLI_RUN_DIR, help=f"default {CLI_RUN_DIR}")
    sub = parser.add_subparsers(dest="verb", required=True)
    up = sub.add_parser("up", help="install if needed, start, run a probe job")
    up.add_argument("nodes", type=int, nargs="?", default=2)
    sub.add_parser("down", help="stop everything by PID and remove it")
    sub.add_parser("status", help="daemons and sinfo")
    args = parser.parse_args(argv)
    reason = missing_requirements()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    try:
        return {"up": _cli_up, "down": _cli_down, "status": _cli_status}[args.verb](args)
    except SandboxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
