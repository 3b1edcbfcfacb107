"""How a rank whose heartbeat stopped really ended, from the only places that know.

A heartbeat that stops says nothing of why: killed, crashed, frozen, or its node cut off. Three
witnesses can say more, and :mod:`.blame` quotes whichever spoke:

* the rank itself, for the signals a process can note before it dies (SIGSEGV, SIGABRT,
  SIGBUS, SIGFPE, SIGILL): ``faulthandler`` writes its last words to
  ``REPORT_DIR/fatal/rank<R>.txt`` (:func:`last_words`), async-signal-safe, with the frame;
* its node: every live rank looks, on an abort, at the ranks of its own host (:func:`note`):
  a PID that is gone (dead, not cut off), a process stopped (SIGSTOP: state T), the kernel's
  OOM killer naming that PID in the kernel log (``/dev/kmsg``, root or CAP_SYSLOG), and the
  dead rank's last words; it posts ``fate/<rank>`` (the first word stands);
* the launcher that is the workers' parent (``make smoke-local``'s ``launch_local``):
  :class:`Witness` sees each worker's exit status the moment it dies, without reaping it
  (``waitid(WNOWAIT)``: torchrun's agent still does), and posts ``exit/<rank>``.

A killed process cannot speak, and with one rank per node nobody else is there to look: then
the heartbeat's silence is all there is, and the culprit text says so.
"""
from __future__ import annotations

import atexit
import datetime
import faulthandler
import json
import os
import re
import selectors
import signal
import socket
import threading
import time

from . import hosting, keys, proc, signing
from .store import reads

FOLDER = "fatal"
# A rank forked by its launcher (make smoke-local) shares the launcher's command line and, as
# /proc shows it, its environment: its process name says which rank it is (ps, top, the
# launcher's Witness). /proc/<pid>/comm holds 15 bytes: ranks up to 9999.
_PROCESS_NAME = "ddp-smoke r{}"
_NAMED = re.compile(r"ddp-smoke r(\d+)")
_OOM = re.compile(r"(Memory cgroup out of memory|Out of memory[^:]*): Killed process (\d+) ")
_FATAL = {"Segmentation fault": "SIGSEGV", "Aborted": "SIGABRT", "Bus error": "SIGBUS",
          "Floating-point exception": "SIGFPE", "Illegal instruction": "SIGILL"}
_file = None
_log_mark = -1  # the kernel log's last record when this rank started (its sequence number)


def last_words(report_dir: str, rank: int):
    """This rank's fatal signals leave their traceback in REPORT_DIR/fatal/rank<R>.txt
    (emptied now: a file left by an earlier run in the folder must not speak for this one).
    Called again once the run's folder is known (a rank may learn it from rank 0 at the
    join), it moves there. Returns what removes the file while it is still empty (a clean
    exit runs it too). Never raises."""
    global _file
    path = os.path.join(report_dir, FOLDER, f"rank{rank}.txt")
    if _file is not None and _file.name == path:
        return drop_current
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        new = open(path, "w")  # noqa: SIM115 — held open: faulthandler writes to its fd
        faulthandler.enable(file=new, all_threads=False)
    except OSError:
        return drop_current
    if _file is not None:
        _file.close()
        drop_if_empty(_file.name)
    else:
        atexit.register(drop_current)
    _file = new
    return drop_current


def drop_current() -> None:
    """This rank's last-words file, gone while it holds nothing (an empty one is no evidence,
    and must not be left in the folder). Also on the injected crash's way out
    (:class:`ddp_smoke.config.faults.Injector`), which skips atexit as a real death does."""
    if _file is not None:
        drop_if_empty(_file.name)


def drop_if_empty(path: str) -> None:
    try:
        if os.path.getsize(path) == 0:
            os.unlink(path)
            os.rmdir(os.path.dirname(path))
    except OSError:
        pass


def said(report_dir: str, rank: int) -> dict:
    """A dead rank's last words: ``{"signal", "said"}`` (first line and innermost frame)."""
    try:
        with open(os.path.join(report_dir, FOLDER, f"rank{rank}.txt"), errors="replace") as f:
            text = f.read(8192)
    except OSError:
        return {}
    for words, sig in _FATAL.items():
        if words in text:
            frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', text)
            # the innermost frame of the kit's checks, else the innermost of all
            kit = [f for f in frames if f"{os.sep}ddp_smoke{os.sep}" in f[0]
                   and f"{os.sep}coordination{os.sep}" not in f[0]]
            frame = (kit or frames or [None])[0]
            where = f", in {frame[2]}, {os.path.basename(frame[0])}:{frame[1]}" if frame else ""
            return {"signal": sig, "said": f"Fatal Python error: {words}{where}"}
    return {}


def name_rank(rank: int) -> None:
    """Name this (forked) rank's process after its rank. Never raises."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(_PROCESS_NAME.format(rank)[:15])
    except OSError:
        pass


def rank_named(pid: int) -> int | None:
    """The rank a process is named after (:func:`name_rank`), else None."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            m = _NAMED.fullmatch(f.read().strip())
    except OSError:
        return None
    return int(m.group(1)) if m else None


def _proc_state(pid: int) -> str | None:
    """The process's state letter (R, S, D, T, Z …; X once it has begun to exit), None
    when it is gone."""
    return proc.state(proc.stat(pid))


def state_of(stat: str) -> str | None:
    """The state letter of a ``/proc/<pid>/stat`` line (:func:`.proc.state`)."""
    return proc.state(proc.fields(stat))


def mark_kernel_log() -> None:
    """Note where the kernel log stands as this rank starts (a millisecond or two: the ring's
    records are read once). An OOM kill of a neighbour this run knows comes later; an older
    line may name an earlier process with the same PID (PIDs wrap: 32,768 on many nodes).
    Sequence numbers, not times: the log's clock drifts from the system's on long uptimes."""
    global _log_mark
    _log_mark = max((seq for seq, _ in _kernel_log()), default=-1)


def oom_kills(pids: set[int]) -> dict[int, str]:
    """The kernel log's OOM-killer line for each of ``pids`` it names after
    :func:`mark_kernel_log` (pid -> the line). No pids, no read: every live rank looks on an
    abort, and the log's records cost ~2.6 ms a read (1,023 simulated ranks: 2.7 s of CPU)."""
    if not pids:
        return {}
    found = {}
    for seq, text in _kernel_log():
        m = _OOM.search(text)
        if m and seq > _log_mark and int(m.group(2)) in pids:
            found[int(m.group(2))] = text[:200]
    return found


def _kernel_log():
    """The kernel log's records, oldest first: (sequence number, text). Nothing where it
    cannot be read (:func:`.proc.kernel_log`)."""
    try:
        for record in proc.kernel_log():
            head, _, text = record.partition(";")
            try:
                yield int(head.split(",")[1]), text.strip()
            except (IndexError, ValueError):
                continue
    except OSError:
        return


def look(ranks: list[dict], me: int, report_dir: str) -> dict[int, dict]:
    """What this node shows of the other ranks on this host that are no longer running:
    rank -> ``{"gone"|"stopped", "oom", "signal", "said", "host", "pid"}``."""
    host = socket.gethostname()
    out, gone = {}, {}
    for rec in ranks:
        r, pid = rec.get("rank"), rec.get("pid")
        if r == me or pid is None or rec.get("host") != host:
            continue
        state = _proc_state(pid)
        if state in ("T", "t"):
            out[r] = {"stopped": True, "host": host, "pid": pid}
        elif state in (None, "Z", "X"):
            gone[pid] = r
            out[r] = {"gone": True, "host": host, "pid": pid, **said(report_dir, r)}
            # a dead rank says no more: its empty file (a SIGKILL, an OOM kill) is no evidence
            drop_if_empty(os.path.join(report_dir, FOLDER, f"rank{r}.txt"))
    for pid, line in oom_kills(set(gone)).items():
        out[gone[pid]]["oom"] = line
    return out


def note(c, store) -> None:
    """On an abort, every live rank: post what its node shows of its neighbours (the first
    word on a rank stands). Never raises."""
    try:
        run, env = c.run, c.env
        if len(run.ranks) == env.world_size:  # read at the join: this node's among them
            ranks = list(run.ranks)
        else:  # before the join: this node's ranks only, a few reads, not the world's
            ranks = list(reads(store, keys.RANK, env.node_ranks).values())
        for r, seen in look(ranks, env.rank, run.report_dir).items():
            store.compare_set(keys.of(keys.FATE, r), "", json.dumps({**seen, "by": c.env.rank}))
    except Exception:  # noqa: BLE001 — evidence gathering never raises
        pass


def describe(fate: dict, stage: str) -> str | None:
    """A dead rank's end in words, from what was seen (None: nothing was)."""
    ended = fate.get("exit") or {}
    if ended.get("signal"):
        how = f"killed by {ended['signal']}"
        if fate.get("oom"):
            return _oom(fate, stage)
        if fate.get("said"):
            return f"{how} during {stage} (the launcher saw it): {fate['said']}"
        return f"{how} during {stage} (the launcher saw it)"
    if ended.get("code") is not None:
        return f"exited with status {ended['code']} during {stage} (the launcher saw it)"
    if fate.get("oom"):
        return _oom(fate, stage)
    if fate.get("said"):
        return f"killed by {fate['signal']} during {stage}: {fate['said']}"
    if fate.get("stopped"):
        return (f"stopped during {stage}: its process {fate.get('pid')} on {fate.get('host')} "
                "is frozen (state T: SIGSTOP, a debugger, a paused container)")
    if fate.get("gone"):
        return (f"died during {stage}: its process {fate.get('pid')} is gone from "
                f"{fate.get('host')}")
    return None


def _oom(fate: dict, stage: str) -> str:
    where = "cgroup memory limit" if "cgroup" in fate["oom"] else "host memory"
    return (f"killed by the kernel's OOM killer during {stage}: {where} "
            f"(kernel log on {fate.get('host')}: {fate['oom']})")


def children(pid: int | str = "self") -> list[int] | None:
    """The live children of process ``pid``, whichever of its threads started them (None
    when its threads cannot be listed: no /proc, or the process is gone)."""
    tasks = f"/proc/{pid}/task"
    try:
        threads = os.listdir(tasks)
    except OSError:
        return None
    out = []
    for t in threads:
        try:
            with open(f"{tasks}/{t}/children") as f:
                out += [int(p) for p in f.read().split()]
        except OSError:
            continue  # a thread that ended meanwhile
    return out


_LOOK_S = 0.02  # how often the Witness looks for new workers (and, without pidfds, deaths)


class Witness(threading.Thread):
    """In the launcher that is the workers' parent: each worker's end, seen the moment it
    dies (``waitid`` with WNOWAIT leaves it for torchrun's agent to reap), posted as
    ``exit/<rank>`` to the run's store (``store_of()`` makes the client, as it starts).

    Woken by each worker's pidfd (readable once the process has exited), not by a poll: the
    agent reaps every 0.1 s, and a status it reaps first is lost to this thread (an exit
    status missed once on a loaded machine: the campaign's exit.store_node.health.smoke_local
    named the rank "gone", without its status). Kernels without pidfds (< 5.3) poll. The
    pidfd narrows that race, not closes it: a thread woken late on a loaded machine still finds
    the status reaped (CI: sigkill.middle.collectives.smoke_local.1x3 said "gone" after a 6 s
    wait), so the agent that reaps it tells :meth:`reaped` too (``launch_local``)."""

    def __init__(self, store_of):
        super().__init__(name="ddp-smoke-witness", daemon=True)
        self.store_of, self.ranks, self.stopped = store_of, {}, threading.Event()
        self.ended: dict[int, dict] = {}  # rank -> its end, as posted (none for a clean exit)

    def _learn(self) -> list[int]:
        """pid -> rank of this process's live children (a zombie's environment is gone); the
        pids learned now."""
        new = []
        for pid in children() or []:
            if pid not in self.ranks:
                try:
                    with open(f"/proc/{pid}/environ", "rb") as f:
                        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0")
                                   if b"=" in kv)
                except OSError:
                    continue
                if b"RANK" in env:
                    self.ranks[pid] = int(env[b"RANK"])
                elif (named := rank_named(pid)) is not None:  # a forked rank
                    self.ranks[pid] = named
                else:
                    continue
                new.append(pid)
        return new

    def run(self) -> None:
        try:  # connected before a worker dies: its word then costs one call
            self.store_of()
        except Exception:  # noqa: BLE001 — the store may not be there yet; tried again on a death
            pass
        try:
            self._watch()
        except (AttributeError, OSError):  # no pidfd_open / P_PIDFD here
            self._poll()

    def _watch(self) -> None:
        exits = selectors.DefaultSelector()
        while not self.stopped.is_set():
            for pid in self._learn():
                try:
                    exits.register(os.pidfd_open(pid), selectors.EVENT_READ, pid)
                except ProcessLookupError:
                    continue  # gone before it was watched
            if not exits.select(_LOOK_S):
                continue
            # Every watched worker's status first, the posts after: the agent, once it finds
            # one failed, reaps the others at once (its look at whether they live reaps them),
            # and two ranks killed together lost the second's status to a post in between.
            seen = []
            for key in list(exits.get_map().values()):
                try:
                    got = os.waitid(os.P_PIDFD, key.fileobj,
                                    os.WEXITED | os.WNOWAIT | os.WNOHANG)
                except ChildProcessError:
                    got = None  # reaped already
                else:
                    if got is None:
                        continue  # alive
                    seen.append(got)
                exits.unregister(key.fileobj)
                os.close(key.fileobj)
            for got in seen:
                self._tell(got)

    def _poll(self) -> None:
        while not self.stopped.is_set():
            self._learn()
            try:
                got = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT | os.WNOHANG)
            except ChildProcessError:
                got = None
            if got is None:
                time.sleep(_LOOK_S)
                continue
            self._tell(got)
            while _waitable(got.si_pid):  # until the agent reaps it
                time.sleep(_LOOK_S)

    def _tell(self, got) -> None:
        rank = self.ranks.get(got.si_pid)
        if rank is not None:
            killed = got.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
            self.heard(rank, -got.si_status if killed else got.si_status)

    def reaped(self, pid: int, exitcode: int) -> None:
        """The agent reaped worker ``pid``, which ended so (``Popen.returncode``: -N for signal
        N): its status, lost to this thread if the agent reaped first (``launch_local``)."""
        if (rank := self.ranks.get(pid)) is not None:
            self.heard(rank, exitcode)

    def heard(self, rank: int, exitcode: int) -> None:
        """Post rank ``rank``'s end (``exitcode`` as ``Popen.returncode``); the first word
        stands."""
        if exitcode == 0:
            return
        ended = {"signal": signal.Signals(-exitcode).name} if exitcode < 0 else {"code": exitcode}
        self.ended.setdefault(rank, ended)
        try:
            self.store_of().compare_set(keys.of(keys.EXIT, rank), "", json.dumps(ended))
        except Exception:  # noqa: BLE001 — the store may be gone: nobody to tell
            pass


# Set in the launcher that started a Witness, so its workers (forked after) know that each
# death among them is posted at once: the report's writer waits a moment for that word
# (witnessed()).
WITNESSED_ENV = "DDP_SMOKE_WITNESSED"
# The Witness posts within ~20 ms, the agent's reap within its 0.1 s look; on a loaded node a
# word was seen after 1 s. (Two waits of 3 s and 6 s that ended with no word, in CI, were a
# status reaped by the agent before the Witness woke, which the agent now tells too.) Waited
# for only where the rank's process is gone and no word has come.
WITNESS_WAIT_S = 6.0


def witnessed(environ=os.environ) -> bool:
    """This rank's launcher watches its workers' ends (:func:`watch_workers`)."""
    return environ.get(WITNESSED_ENV) == "1"


def watch_workers(environ=os.environ) -> Witness | None:
    """In a launcher whose children are the workers and which has a store host
    (``DDP_SMOKE_STORE``, ``DDP_SMOKE_SECRET``): start the :class:`Witness`, and return it."""
    address, secret = environ.get("DDP_SMOKE_STORE"), environ.get("DDP_SMOKE_SECRET")
    if not address or not secret or ":" not in address:
        return None
    environ[WITNESSED_ENV] = "1"
    client = []

    def store_of():
        if not client:
            import torch.distributed as dist
            host, _, port = address.rpartition(":")
            raw = dist.TCPStore(host, int(port), 1, False, datetime.timedelta(seconds=5),
                                wait_for_workers=False)
            client.append(signing.SignedStore(dist.PrefixStore(hosting.PREFIX, raw),
                                              hosting.PREFIX, bytes.fromhex(secret), rank=-1))
        return client[0]

    # Connected here, before the agent starts the workers: where it forks them (make
    # smoke-local), a thread inside the connect's address lookup as it forks would leave the
    # C library's lock held in the child, whose own connect would then wait forever (the
    # suspected cause of a forked rank that never connected, in two CI-like runs of 8 ranks).
    try:
        store_of()
    except Exception:  # noqa: BLE001 — the thread tries again on the first death
        pass
    witness = Witness(store_of)
    witness.start()
    return witness


def _waitable(pid: int) -> bool:
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None
    except ChildProcessError:
        return False
