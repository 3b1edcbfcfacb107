"""A sandbox whose maker was killed (a CI job stopped mid-suite, a test worker SIGKILLed) leaves
its namespaces, links, hosts block and processes behind. The next start of that prefix removes
them instead of refusing every later run; a sandbox whose maker still runs, or a clash the
prefix cannot have made, is never touched. Real namespaces and processes, as root."""
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT
from tests.sandbox.hosts import HostSandbox, SandboxError, missing_requirements, started_at

PREFIX, SUBNET = "dso", "10.231.50.0/24"
# The maker: a sandbox of two hosts, a process in a host and one outside (as Slurm's controller
# is), then it prints their PIDs and waits for its standard input to close.
_MAKER = textwrap.dedent(f"""
    import subprocess, sys
    from tests.sandbox.hosts import HostSandbox
    with HostSandbox({PREFIX!r}, {SUBNET!r}, 2) as box:
        inside = box.popen(box.hosts[0], ["sleep", "600"])
        outside = subprocess.Popen(["sleep", "600"], start_new_session=True)
        box.own(outside.pid)
        print(inside.pid, outside.pid, flush=True)
        sys.stdin.read()
""")


@pytest.fixture
def maker():
    reason = missing_requirements()
    if reason:
        pytest.skip(reason)
    proc = subprocess.Popen([sys.executable, "-c", _MAKER], cwd=ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    line = proc.stdout.readline()
    assert line, f"the maker did not start its sandbox (exit {proc.wait(timeout=30)})"
    yield proc, [int(pid) for pid in line.split()]
    if proc.poll() is None:
        proc.stdin.close()  # its `with` takes its sandbox down
        proc.wait(timeout=60)


@pytest.mark.parametrize("record", ["kept", "lost"])
def test_a_killed_makers_sandbox_is_removed_by_the_next_start(maker, record, capfd):
    proc, (inside, outside) = maker
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    if record == "lost":  # as a run of a version before owner records left it
        os.unlink(f"/run/ddp-smoke-sandbox-{PREFIX}.owner.json")
    box = HostSandbox(PREFIX, SUBNET, 2)
    with box:
        assert started_at(inside) is None  # found in its host's namespace
        if record == "kept":
            assert started_at(outside) is None  # found in the record
        else:  # nothing says whose it is: left alone, stopped here by the PID the test knows
            assert started_at(outside) is not None
            os.kill(outside, signal.SIGKILL)
        out = box.popen(box.hosts[1], ["hostname"], stdout=subprocess.PIPE, text=True)
        assert out.communicate(timeout=10)[0].strip() == f"{PREFIX}-node2"
    assert box.leftovers() == []
    assert not os.path.exists(f"/run/ddp-smoke-sandbox-{PREFIX}.owner.json")
    err = capfd.readouterr().err
    assert f"sandbox {PREFIX}: removed the leftovers" in err and f"netns {PREFIX}-node1" in err


def test_a_sandbox_whose_maker_runs_is_never_taken(maker):
    proc, pids = maker
    with pytest.raises(SandboxError, match=rf"it is up, made by running process {proc.pid}$"):
        HostSandbox(PREFIX, SUBNET, 2).up()
    assert all(started_at(pid) is not None for pid in pids)
    assert f"netns {PREFIX}-node1" in HostSandbox(PREFIX, SUBNET, 2).leftovers()


def test_a_clash_the_prefix_cannot_have_made_is_refused_and_left():
    reason = missing_requirements()
    if reason:
        pytest.skip(reason)
    subprocess.run(["ip", "link", "add", "xdso0", "type", "veth", "peer", "name", "xdso1"],
                   check=True)
    try:
        subprocess.run(["ip", "addr", "add", "10.231.50.200/24", "dev", "xdso0"], check=True)
        with pytest.raises(SandboxError, match=r"already there: address 10\.231\.50\.200 on xdso0"):
            HostSandbox(PREFIX, SUBNET, 2).up()
        shown = subprocess.run(["ip", "-4", "addr", "show", "xdso0"], capture_output=True,
                               text=True, check=True).stdout
        assert "10.231.50.200/24" in shown
        assert not os.path.exists(f"/run/ddp-smoke-sandbox-{PREFIX}.owner.json")
    finally:
        subprocess.run(["ip", "link", "del", "xdso0"], check=False)
