"""How a dead rank ended, in words, from what its witnesses saw (coordination/fate.py)."""
import os
import signal
import subprocess
import sys

import pytest

from ddp_smoke.coordination import fate, keys


def test_last_words_of_a_real_crash_name_the_signal_and_the_frame(tmp_path):
    # a real process enables its last words and dies of SIGSEGV and of SIGABRT
    for sig, name in ((signal.SIGSEGV, "SIGSEGV"), (signal.SIGABRT, "SIGABRT")):
        code = (f"from ddp_smoke.coordination import fate; import os, signal\n"
                f"fate.last_words({str(tmp_path)!r}, 3)\n"
                f"def check(): os.kill(os.getpid(), {int(sig)})\ncheck()\n")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
        assert proc.returncode == -sig
        got = fate.said(str(tmp_path), 3)
        assert got["signal"] == name and "in check, <string>:3" in got["said"], got


def test_an_empty_file_goes_at_a_clean_exit_and_an_old_one_cannot_speak(tmp_path):
    old = tmp_path / fate.FOLDER / "rank1.txt"
    old.parent.mkdir()
    old.write_text("Fatal Python error: Segmentation fault\n")  # an earlier run's
    code = (f"from ddp_smoke.coordination import fate\n"
            f"fate.last_words({str(tmp_path)!r}, 1)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert not old.exists() and fate.said(str(tmp_path), 1) == {}


def test_the_words_say_what_was_seen_and_nothing_more():
    stage = "collectives"
    said = {"signal": "SIGSEGV", "said": "Fatal Python error: Segmentation fault, in f, x.py:1"}
    assert fate.describe({"exit": {"signal": "SIGKILL"}}, stage) == (
        "killed by SIGKILL during collectives (the launcher saw it)")
    assert fate.describe({"exit": {"code": 13}}, stage).startswith("exited with status 13")
    assert fate.describe(said, stage).startswith("killed by SIGSEGV during collectives: Fatal")
    oom = {"gone": True, "host": "h", "pid": 7, "oom": "Memory cgroup out of memory: Killed "
                                                      "process 7 (python)"}
    assert "OOM killer during collectives: cgroup memory limit" in fate.describe(oom, stage)
    assert "frozen" in fate.describe({"stopped": True, "host": "h", "pid": 7}, stage)
    assert fate.describe({"gone": True, "host": "h", "pid": 7}, stage) == (
        "died during collectives: its process 7 is gone from h")
    assert fate.describe({}, stage) is None


def test_a_neighbour_that_is_gone_or_stopped_is_seen_and_others_are_not(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        host = os.uname().nodename
        ranks = [{"rank": 0, "pid": os.getpid(), "host": host},
                 {"rank": 1, "pid": gone.pid, "host": host},
                 {"rank": 2, "pid": stopped.pid, "host": host},
                 {"rank": 3, "pid": gone.pid, "host": "another-host"}]
        for _ in range(50):  # the stop takes effect asynchronously
            seen = fate.look(ranks, 0, str(tmp_path))
            if seen.get(2, {}).get("stopped"):
                break
        assert sorted(seen) == [1, 2] and seen[1]["gone"] and seen[2]["stopped"], seen
    finally:
        stopped.kill()
        stopped.wait()


def test_a_dead_neighbours_empty_file_goes_and_its_words_stay(tmp_path):
    """A SIGKILL or an OOM kill leaves the file faulthandler held open empty: the live rank
    that finds the rank gone drops it (and the folder); a file with words is evidence."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    host = os.uname().nodename
    folder = tmp_path / fate.FOLDER
    folder.mkdir()
    (folder / "rank1.txt").write_text("")
    ranks = [{"rank": 0, "pid": os.getpid(), "host": host},
             {"rank": 1, "pid": gone.pid, "host": host}]
    assert fate.look(ranks, 0, str(tmp_path)) == {1: {"gone": True, "host": host,
                                                      "pid": gone.pid}}
    assert not folder.exists()
    folder.mkdir()
    (folder / "rank1.txt").write_text("Fatal Python error: Aborted\n")
    assert fate.look(ranks, 0, str(tmp_path))[1]["signal"] == "SIGABRT"
    assert sorted(p.name for p in folder.iterdir()) == ["rank1.txt"]


def test_an_oom_line_from_before_the_rank_started_names_no_one(monkeypatch):
    """PIDs wrap (32,768 here): the kernel log's OOM line for an earlier process with the same
    PID must not speak for this run's rank (a SIGSEGV was once said to be an OOM kill so).
    Real records, written into the real kernel log, on each side of the rank's start."""
    try:
        kmsg = os.open("/dev/kmsg", os.O_WRONLY)
    except OSError as e:
        pytest.skip(f"writing the kernel log needs root: {e.strerror}")
    monkeypatch.setattr(fate, "_log_mark", -1)
    stale, fresh = 4_000_000 + os.getpid() % 1000, 4_100_000 + os.getpid() % 1000  # > pid_max
    try:
        os.write(kmsg, f"Memory cgroup out of memory: Killed process {stale} (ddp-smoke r1) "
                       "total-vm:1kB\n".encode())
        assert stale in fate.oom_kills({stale})  # read back before the mark: it would speak
        fate.mark_kernel_log()
        os.write(kmsg, f"Out of memory: Killed process {fresh} (ddp-smoke r2) "
                       "total-vm:1kB\n".encode())
    finally:
        os.close(kmsg)
    got = fate.oom_kills({stale, fresh})
    assert list(got) == [fresh] and f"Killed process {fresh} (ddp-smoke r2)" in got[fresh], got


# /proc/<pid>/stat of a process killed by SIGKILL while the kernel freed its 3 GB, recorded
# here: still "R", its flags 0x40040c (PF_EXITING 0x4, PF_SIGNALED 0x400)
EXITING = ("12716 (python3) R 12675 12671 18684 0 -1 4195340 788747 0 0 0 22 180 0 0 20 0 1 0 "
           "4008572 0 0 18446744073709551615 0 0 0 0 0 0 0 16781312 2 0 0 0 17 1 0 0 0 0 0 0 "
           "0 0 0 0 0 0 9")


def test_a_process_that_has_begun_to_exit_is_not_running():
    assert fate.state_of(EXITING) == "X"
    running = EXITING.replace(" 4195340 ", " 4194560 ")  # the same flags less those two
    assert fate.state_of(running) == "R"
    assert fate.state_of(EXITING.replace(") R ", ") Z ")) == "X"
    assert fate.state_of("12716 (a) b) S 1 1 1 0 -1 4194560 0") == "S"  # a name with ")"
    assert fate.state_of("garbage") is None


def test_a_killed_rank_whose_files_are_closed_is_gone_to_its_node(tmp_path):
    """Its peers see their connections reset as its files close, before it is a zombie;
    from then on its node sees it gone, not running."""
    r, w = os.pipe()
    code = ("import time; b = bytearray(512 << 20); b[::4096] = b'x' * (len(b) // 4096); "
            "print('ready', flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                             pass_fds=(w,))
    os.close(w)
    try:
        assert child.stdout.readline() == b"ready\n"
        os.kill(child.pid, signal.SIGKILL)
        assert os.read(r, 1) == b""  # its files are closed (what a peer's reset shows)
        seen = fate.look([{"rank": 1, "pid": child.pid, "host": os.uname().nodename}], 0,
                         str(tmp_path))
        assert seen[1]["gone"], seen
    finally:
        os.close(r)
        child.kill()
        child.wait()



def _end(rank: int, code: int) -> None:
    """A forked worker (as make smoke-local's agent forks them): named after its rank, ended
    0.5 s later with status ``code`` (negative: that signal)."""
    import time
    fate.name_rank(rank)
    time.sleep(0.5)
    if code < 0:
        os.kill(os.getpid(), -code)
    os._exit(code)


class _Late(fate.Witness):
    """A Witness whose thread learns the workers but is always woken after the agent reaped."""

    def _tell(self, got) -> None:
        pass


def _witness_round(store, witness_class) -> dict:
    """Two forked workers end (status 13; SIGKILL) under an agent that reaps them every 0.1 s
    through ``multiprocessing`` (as torchrun's agent does, in make smoke-local's launcher);
    what was posted."""
    import json
    import multiprocessing
    import time

    from ddp_smoke import launch_local

    witness = witness_class(lambda: store)
    witness.start()
    ends = {5: 13, 6: -signal.SIGKILL}
    fork = multiprocessing.get_context("fork")
    try:
        with launch_local._reaps_told(witness):
            workers = [fork.Process(target=_end, args=end) for end in ends.items()]
            for w in workers:
                w.start()
            end = time.monotonic() + 30
            while any(w.is_alive() for w in workers) and time.monotonic() < end:
                time.sleep(0.1)  # the agent's monitor interval
        key = {rank: keys.of(keys.EXIT, rank) for rank in ends}
        said = {rank: json.loads(store.get(k)) for rank, k in key.items() if store.check([k])}
        for k in key.values():
            store.delete_key(k)
    finally:
        witness.stopped.set()
        witness.join(5)
    return said


@pytest.mark.parametrize("witness_class", [fate.Witness, _Late], ids=["witness", "late"])
def test_each_workers_end_is_told_exact_whoever_reaps_it_first(witness_class):
    """make smoke-local's launcher posts each worker's exit status or signal, for the report to
    name a SIGKILL as one. Its Witness thread is woken by the worker's pidfd; torchrun's agent
    reaps at its 0.1 s look, and a status reaped first is lost to the thread (two full suites,
    2026-12-02: one of six; CI 2026-12-06: a SIGKILL said "gone" after a 6 s wait). So the
    agent's reap tells the Witness too: every status exact, every round, whether the thread
    wins each race or loses every one (``_Late``)."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=10))
    rounds = [_witness_round(store, witness_class) for _ in range(3)]
    assert rounds == [{5: {"code": 13}, 6: {"signal": "SIGKILL"}}] * 3, rounds
