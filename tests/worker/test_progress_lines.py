"""Issue 51: the run speaks while it runs. Read as a job log reads it, from a pipe, each line
stamped as it arrives: rank 0 says the join and each check as it is judged at once, and
during a hung rank's wait names that rank, not the others, at least every 10 s until the
abort; the summary still ends on the verdict, after every such line. On a terminal the
waiting lines are one status line rewritten in place."""
from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import threading
import time

import pytest

from tests.launch import BIN, REPO


def _stamped(argv: list[str], timeout_s: float) -> tuple[int, list, list]:
    """Run ``argv``; (status, [(t, line)] of stdout, of stderr), t in seconds from the start."""
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, bufsize=1)
    got: dict[str, list] = {"out": [], "err": []}

    def read(stream, into):
        for line in stream:
            into.append((time.monotonic() - t0, line.rstrip("\n")))
    readers = [threading.Thread(target=read, args=(proc.stdout, got["out"])),
               threading.Thread(target=read, args=(proc.stderr, got["err"]))]
    for r in readers:
        r.start()
    code = proc.wait(timeout=timeout_s)
    for r in readers:
        r.join(timeout=10)
    return code, got["out"], got["err"]


def _smoke_local(tmp_path, *worker: str) -> list[str]:
    return [sys.executable, "-m", "ddp_smoke.launch_local", "--", "--backend", "gloo",
            "--level", "quick", "--report-dir", str(tmp_path / "r"), *worker]


@pytest.mark.timeout(180)
def test_a_hung_rank_is_named_while_the_run_waits_and_each_check_as_it_is_judged(tmp_path):
    """Plain torchrun, as a job log sees it (also test_faults' hung rank 1 at ddp_step)."""
    code, out, err = _stamped([str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2",
                               "-m", "ddp_smoke", "--report-dir", str(tmp_path / "r"),
                               "--checks", "environment,sampler_epochs,ddp_step", "--fault",
                               "1:hang@ddp_step", "--timeout", "11"], 150)
    assert code != 0, "\n".join(x for _, x in err[-30:])
    said = [(t, x[len("ddp-smoke: "):]) for t, x in err if x.startswith("ddp-smoke: ")]
    joined = [t for t, x in said if " joined in " in x]
    checks = {x.split()[1]: t for t, x in said if x.startswith("[")}
    waits = [(t, x) for t, x in said if x.startswith("ddp_step: waited ")]
    assert len(joined) == 1 and " 2 ranks on 1 node joined in " in said[0][1], said
    assert "; checks: environment, sampler_epochs, ddp_step; report " in said[0][1], said
    assert list(checks) == ["environment", "sampler_epochs"], said  # the hung one: not judged
    assert [x.split()[2] for _, x in said if x.startswith("[")] == ["PASS", "PASS"], said
    verdict = next(t for t, x in out if x.startswith("verdict: FAIL"))
    assert out[-1][1].startswith("verdict: FAIL"), out[-3:]
    # said as they happen: the checks before the hang long before the verdict (an 11 s wait)
    assert joined[0] <= checks["environment"] <= checks["sampler_epochs"] < verdict - 8, said
    # the wait: the hung rank named, the other not, at least every 10 s until the abort
    assert len(waits) >= 2, said
    for _, x in waits:
        assert ": rank 1 (" in x and "rank 0" not in x and x.endswith("s to the deadline"), x
    # (then the stop: its line, and the seconds of judging who stopped it before the verdict)
    assert said[-1][1] == "ddp_step: the run stopped; finding who stopped it, then the report"
    stamps = [checks["sampler_epochs"], *(t for t, _ in waits), said[-1][0]]
    assert max(b - a for a, b in zip(stamps, stamps[1:])) <= 10.5, (stamps, said)
    assert all(t <= verdict for t, _ in said), (said, verdict)
    assert not [x for _, x in err + out if "\x1b" in x or "\r" in x]  # a log: plain lines
    # what test_faults asserts of every fault: the rank named, the report written
    text = (tmp_path / "r" / "report.json").read_text()
    assert '"verdict": "fail"' in text and "did not arrive at ddp_step" in text
    assert "culprit: rank 1" in "\n".join(x for _, x in out)


@pytest.mark.timeout(120)
def test_on_a_terminal_the_wait_is_one_status_line_in_place(tmp_path):
    """make smoke-local on a terminal: no waiting lines, a status line rewritten in place
    (the check, ranks arrived of the world, the time left), cleared before the summary."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(_smoke_local(tmp_path, "--checks", "environment,collectives",
                                         "--fault", "1:hang@collectives", "--timeout", "6"),
                            cwd=REPO, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
    os.close(slave)
    seen, end = b"", time.monotonic() + 100
    while time.monotonic() < end:
        if select.select([master], [], [], 1)[0]:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every writer has closed the terminal
                break
            if not chunk:
                break
            seen += chunk
        elif proc.poll() is not None:
            break
    os.close(master)
    assert proc.wait(timeout=30) == 1, seen[-3000:]
    text = seen.decode(errors="replace")
    status = [s for s in text.split("\r\x1b[K") if s.startswith("ddp-smoke: collectives: 1/2 in")]
    assert len(status) >= 3, text[-3000:]  # rewritten every look (~1 s) from the first second
    assert all("waiting for rank 1 (" in s and " s left" in s for s in status), status
    assert "waited" not in text, text[-3000:]  # no waiting lines
    lines = text.replace("\r\n", "\n").split("\n")
    assert not [ln for ln in lines if "\x1b" in ln and "stopped" not in ln and
                not ln.startswith("ddp-smoke: collectives: 1/2")], lines  # only the status
    assert lines[-2].startswith("verdict: FAIL") and "\x1b" not in lines[-2], lines[-4:]


@pytest.mark.timeout(60)
def test_progress_none_is_silent_until_the_report(tmp_path):
    code, out, err = _stamped(_smoke_local(tmp_path, "--checks", "environment", "--progress",
                                           "none"), 50)
    assert code == 0, "\n".join(x for _, x in err[-30:])
    assert not [x for _, x in err if x.startswith("ddp-smoke: ")], err
    assert out[-1][1].startswith("verdict: PASS"), out[-3:]


def test_the_ranks_awaited_cost_a_few_store_calls_at_any_world_size():
    """Rank 0 names whom it waits for by halving the key list with ``check``: a few calls
    for a few missing ranks among 16,384, and no more than it names when many are missing."""
    from ddp_smoke.coordination import telling

    class Store:
        def __init__(self, present):
            self.present, self.calls = present, 0

        def check(self, wanted):
            self.calls += 1
            return all(k in self.present for k in wanted)
    world = 16384
    wanted = [f"arrive/x/{r}" for r in range(world)]
    few = Store(set(wanted) - {wanted[5], wanted[9000]})
    assert telling._missing(few, list(range(world)), wanted, 9) == [5, 9000]
    assert few.calls <= 4 * 14, few.calls  # two paths down a tree 14 levels deep
    many = Store({w for r, w in enumerate(wanted) if r % 2})
    assert telling._missing(many, list(range(world)), wanted, 9) == list(range(0, 18, 2))
    assert many.calls <= 9 * 2 * 14, many.calls
