"""Benchmark: the harness's store coordination with N simulated ranks on one TCPStore.

Not a test: it prints numbers. The ranks sit ``--per-node`` (8) a simulated node. A real
rank is a ``coordination.protocol.Coordinator`` with its one store connection (a
``store.Connection`` under the signing, over a TCPStore client, as the harness makes it) and
its own main thread; its liveness look (``liveness.Liveness.tick``: heartbeat and watchdog)
runs at the kit's period, driven for every 64 real ranks of a worker by one thread (a thread
each would measure the scheduler, not the protocol). As in the worker, a rank whose main
thread holds its connection in a wait does its own look between the wait's slices, and the
driver passes it by. With node speakers (``--node-speaker``; auto beyond 2,500 ranks) a
node's first rank is real and speaks for the node; its other ranks are slots in the node's
shared memory, written for them as they would write them (their beats by the driver, their
arrivals and observations by the speaker's main thread just before its own): 2,048 real
ranks and 14,336 slot writers at 16,384, where 16,384 threads and connections on 2 cores
measured this machine. Without, every rank is real. No process group, no collective: only the
store protocol. The store is one libuv TCPStore hosted by this process (its file descriptors
are counted); the ranks live in ``--procs`` worker processes (one torch import each, whole
nodes each), in a network namespace of their own where root may.

Per world size N it measures, in one simulated run:

* heartbeat load: store operations per second of the liveness looks of all ranks, with every
  main thread idle (steady state);
* per check: store operations made by the main threads (counted by a proxy around each
  connection's c10d store, by calling thread: one call, one operation), rank 0's wall time
  for arrive → post a trivial observation → gather, which is pure coordination, and the part
  of it rank 0 spends in its own calls (the store's answers, the signing, the records: what
  does not wait for another rank);
* an abort (:class:`Cast`): at one more check, after arriving, the last rank dies (a node mate:
  its slot stops), so does the first rank of the node a quarter in (its node's speaker: the
  next rank takes over), and a rank of the middle node stalls (alive, never posts); ranks far
  from 0, so that no search that stops early hides. Rank 0's main thread waits in
  ``gather``; between the wait's slices it looks at the heartbeats, finds the silent ones and
  aborts ("detect"); then ``stopped_run.add_stopped_result_as_a_rank`` names the culprits (the
  "judge" columns), while every other real rank goes through the real ``exit_aborted`` and
  waits for the report, as its liveness thread does once it sees the abort (here the rank's
  main thread stands in for it). Process exit (``ending.leave``) and the stack files
  (``forensics.dump``) are replaced in the workers; the simulated mates' forensics, and the
  word on a dead mate its node would read in /proc, are posted by their node's real rank.

    .venv/bin/python bench/coordination_scale.py            # --quick: N = 1,024 … 16,384
    .venv/bin/python bench/coordination_scale.py --full --json --sizes 64,256

Columns: how many nodes speak through one rank, store calls per check (all ranks), per node
less the wait slices that timed out (a wait longer than a look period costs one call per
period), rank 0's median seconds per check and its own calls' share of them, the liveness
looks' calls per second, seconds from the death to the abort, seconds and store calls of
``add_stopped_result_as_a_rank`` (the culprits named), how many live ranks' forensics the
report lists and how long the writer waited for them after that (at most
``FORENSICS_WAIT_S``), the store host's file descriptors per node, the longest round of a
driver thread's liveness looks against the heartbeat silence (a round past it starves the
simulated heartbeats: this machine, not the protocol), and the culprits, with the staged ones.
``--signing-cost PAIRS`` runs each size unsigned and signed, alternating, and prints the
ratios of their medians; ``make bench`` runs one pair at the largest size.

Times are this machine's, under whatever else runs on it (the load average is printed): the
simulated nodes share its cores, where a cluster gives each rank its own.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import secrets
import statistics
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))


_ROLE = threading.local()  # "liveness" while a main thread takes its look between slices


class Counted:
    """A c10d store that counts the calls made to it (one call = one request to the store),
    by role: the liveness look's, wherever it runs, else the calling thread's (its name up to
    the first "-": main, liveness)."""

    def __init__(self, store):
        self._s, self.ops, self.timeouts = store, Counter(), Counter()
        self.busy = Counter()  # seconds in calls that wait for no other rank, by role

    def total(self, role: str) -> int:
        return sum(n for (r, _), n in self.ops.items() if r == role)

    def __getattr__(self, name):
        attr = getattr(self._s, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            role = getattr(_ROLE, "name", None) or threading.current_thread().name.split("-")[0]
            if name != "set_timeout":  # the client's own setting, not a request
                self.ops[role, name] += 1
            t = time.monotonic()
            try:
                return attr(*args, **kwargs)
            except RuntimeError as e:  # a wait slice that timed out: one call per slice
                if name in ("wait", "get") and "timeout" in str(e):
                    self.timeouts[role] += 1
                raise
            finally:
                if name not in ("wait", "get"):  # (a get may block on another's flag)
                    self.busy[role] += time.monotonic() - t
        return call


# -- one worker process: ranks [lo, hi) ------------------------------------------------------

class _Left(BaseException):
    """A simulated rank leaves (replaces os._exit); BaseException: nothing in the kit catches it."""


def worker(args) -> None:
    from ddp_smoke import harness  # torch, once per process, not per rank
    from ddp_smoke.config.launchenv import LaunchEnv
    from ddp_smoke.coordination import ending, forensics, node, protocol, records
    from ddp_smoke.coordination.store import look_period

    threading.stack_size(512 * 1024)
    _raise_nofile()

    def leave(message, code):
        raise _Left(code)
    ending.leave = leave
    forensics.dump = lambda report_dir, rank: records.Forensics(where="bench: simulated rank")
    if args.unsigned:  # the baseline: the same protocol with records unsigned (no secret)
        from ddp_smoke.coordination import signing
        signing.run_secret = lambda env, environ=None: None
    hook = threading.excepthook

    def said(a):  # a rank that died of an error says so, once per kind (a worker's stderr)
        if not issubclass(a.exc_type, _Left) and a.exc_type not in said.seen:
            said.seen.add(a.exc_type)
            hook(a)
    said.seen = set()
    threading.excepthook = said

    world, k = args.world, args.per_node
    names = [f"c{i}" for i in range(args.checks)] + ["abort_here"]
    cfg = {"checks": names, "timeout": args.timeout, "node_speaker": args.node_speaker}

    def connect(env):
        def one(may_host):  # as the harness connects: one signed, shared connection
            signed = harness._store(env, args.timeout, may_host=False)
            signed.raw.raw = Counted(signed.raw.raw)  # the c10d calls, not the wrappers'
            return signed
        return one

    def env_of(r):  # k ranks a node, numbered as torchrun numbers them (host sim<node>)
        return LaunchEnv(rank=r, world_size=world, local_rank=r % k,
                         local_world_size=min(k, world - r // k * k), group_rank=r // k,
                         master_addr="127.0.0.1", master_port=args.port,
                         agent_store=True, launcher="bench", run_id="bench")

    cast = Cast(world, k, args.node_speaker)
    ranks = range(args.lo, args.hi)
    coords, mates = {}, {}
    for r in ranks:
        if cast.real(r):
            coords[r] = protocol.Coordinator(env_of(r), cfg, connect(env_of(r)),
                                             lambda *a: "fail", "bench", time.monotonic())
            coords[r].locate(env_of(r), args.report_dir)  # where a rank that lost the store
        else:  # a node mate: its slots only, written for it (no connection, no thread)
            mates[r] = node.NodeBeats(env_of(r), look_period(world))
    out = {r: {} for r in coords}
    seen = {r: threading.Event() for r in coords}  # set when the rank saw the abort
    if 0 in coords:
        coords[0].claim_finish()  # the bench judges on rank 0 itself, below; no report file
    go = threading.Event()  # every rank starts together, as torchrun starts a node's ranks
    mains = [threading.Thread(target=_rank_main,
                              args=(coords[r], out[r], args, names, seen[r], go, cast,
                                    [mates[m] for m in cast.offered_by(r) if m in mates]),
                              daemon=True, name=f"main-{r}") for r in coords]
    t0 = time.monotonic()
    for t in mains:
        t.start()
    rounds = [0.0]  # the longest round of the liveness looks (a rank's beat gap at least)
    ids = list(coords)
    for i in range(0, len(ids), DRIVEN):
        driven = {r: coords[r] for r in ids[i:i + DRIVEN]}
        threading.Thread(target=_drive_liveness,
                         args=(driven, seen, rounds, [mates[m] for r in driven for m in
                                                      cast.offered_by(r) if m in mates],
                               cast, coords),
                         daemon=True, name="liveness-driver").start()
    go.set()
    print(f"worker {args.lo}: {len(mains)} ranks started in {time.monotonic() - t0:.1f} s "
          f"({len(mates)} node mates beside them)", file=sys.stderr, flush=True)
    threading.Thread(target=_progress, args=(out, args.lo, rounds), daemon=True).start()
    for t in mains:
        t.join(args.timeout * 3)
    for c in coords.values():
        c.liveness.stop.set()
    alive = sum(t.is_alive() for t in mains)  # a stuck rank may still write its dict: copy
    json.dump({"ranks": {r: dict(v) for r, v in out.items()}, "alive": alive,
               "round_max": rounds[0]}, sys.stdout)
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown under threads still inside store calls


class Cast:
    """Who is who in a simulated run of ``world`` ranks, ``k`` a node.

    The staged abort, at the last check: the last rank dies (a node mate: its slot stops),
    the first rank of the node a quarter in dies too (its node's speaker: the next rank of
    the node takes over), and a rank in the middle node stalls (alive, beating, it never
    posts its observation). With node speakers (``--node-speaker on``, or auto beyond 2,500
    ranks) a node is its speaker, a real rank, and its other ranks are slots the speaker's
    main thread writes for them, as they would write them themselves (no connection, no
    thread: what this machine cannot host 16,384 of); the node whose speaker dies also runs
    the next rank for real, which takes over. Without, every rank is real, as before.
    """

    def __init__(self, world: int, k: int, setting: str):
        from ddp_smoke.coordination import node
        self.world, self.k, self.died = world, k, threading.Event()
        self.speakers = k > 1 and (setting == "on" or setting == "auto"
                                   and world > node.AUTO_FROM)
        nodes = max(1, world // k)
        self.dead = world - 1
        self.dead_speaker = max(1, nodes // 4 * k)  # (node 0's first relayer is rank 1)
        self.successor = self.dead_speaker + 1 if self.speakers else None
        self.stalled = nodes // 2 * k + k // 2 if k > 1 else world // 2
        self.expected = sorted({self.dead, self.dead_speaker})

    def _first(self, r: int) -> int:
        return max(1, r // self.k * self.k)

    def real(self, r: int) -> bool:
        return (r == 0 or not self.speakers or r == self._first(r) or r == self.successor)

    def witness(self, dead: int) -> int | None:
        """The live real rank that says how ``dead`` ended: the lowest of its node."""
        first = dead // self.k * self.k
        return next((r for r in range(first, min(first + self.k, self.world))
                     if r not in (self.dead, self.dead_speaker) and self.real(r)), None)

    def offered_by(self, r: int) -> list[int]:
        """The node mates whose slots rank ``r``'s main thread writes (the node's first rank,
        or the successor on the staged node): none without node speakers."""
        if not self.speakers or r == 0 or not self.real(r):
            return []
        first = self._first(r)
        if first == self.dead_speaker and r != self.successor:
            return []
        node_ranks = range(first, min(r // self.k * self.k + self.k, self.world))
        return [m for m in node_ranks if not self.real(m)]


def _clean(folder: str, port: int) -> None:
    """What the simulated ranks leave: lost/ records, and their node beats' slots (a
    simulated rank leaves without the clean exit that removes its slot)."""
    from ddp_smoke.coordination.node import run_folder
    shutil.rmtree(folder, ignore_errors=True)
    shutil.rmtree(run_folder(f"127.0.0.1:{port}", "bench"), ignore_errors=True)


def _progress(out: dict, lo: int, rounds: list) -> None:
    """Every 10 s on stderr: how many of this worker's ranks passed each phase, and the
    longest round of its liveness looks (shown when a simulation does not finish)."""
    t = time.monotonic()
    while True:
        time.sleep(10)
        passed = Counter(len(v.get("marks", ())) for v in out.values())
        print(f"worker {lo} at {time.monotonic() - t:.0f} s: ranks by phases passed "
              f"{dict(sorted(passed.items()))}, look round max {rounds[0]:.2f} s",
              file=sys.stderr, flush=True)


DRIVEN = 64  # ranks whose liveness looks one thread drives


def _drive_liveness(coords: dict, seen: dict, rounds: list, mates: list, cast: "Cast",
                    everyone: dict) -> None:
    """The liveness looks (``Liveness.tick``: heartbeat and watchdog) of ``coords``' ranks,
    once per period, from one thread: a thread per rank would measure this machine's
    scheduler, and one per process would wait out each look's round trip to the store one
    after another. A
    rank whose connection is taken (its main thread waits on it) is passed by: it looks
    between its wait's slices, as in the worker. A rank that saw the abort is told
    (``seen``) and looked at no more. ``mates``: node mates whose heartbeat slots this
    thread writes, at the stage of their node's real rank (not the dead one's, once it
    died). ``rounds[0]``: the longest round so far."""
    from ddp_smoke.coordination import records
    period = next(iter(coords.values())).liveness.period
    n = 0
    while True:
        t = time.monotonic()
        n += 1
        for m in mates:
            if m.env.rank == cast.dead and cast.died.is_set():
                continue
            speaker = everyone.get(max(1, m.env.rank // cast.k * cast.k))
            m.post(records.Beat(n=n, t=time.time(), stage=speaker.stage if speaker else "?",
                                progress={}).to_json())
        for r, c in coords.items():
            if c.liveness.stop.is_set() or seen[r].is_set():
                continue
            if c.liveness.tick(c.store):
                seen[r].set()
        took = time.monotonic() - t
        rounds[0] = max(rounds[0], took)
        time.sleep(max(0.0, period - took))


def _rank_main(c, out, args, names, seen, go, cast, mates) -> None:
    from ddp_smoke.coordination import ending, protocol, store as storekeys
    r, store = c.env.rank, c.store
    counted = store.raw.raw
    look = c.liveness.tick

    def tick(s, full=True):  # between this thread's wait slices: counted as the liveness's
        _ROLE.name = "liveness"
        try:
            return look(s, full)
        finally:
            _ROLE.name = None
    c.liveness.tick = tick
    if r == 0:  # the longest gap between two of rank 0's heartbeats (the others follow it)
        beat, beats = c.liveness.beat, []

        def timed_beat(s):
            beats.append(time.monotonic())
            out["beat_gap_max"] = max(b - a for a, b in zip(beats, beats[1:])) if beats[1:] \
                else 0.0
            return beat(s)
        c.liveness.beat = timed_beat
    go.wait()
    out["marks"] = marks = [time.monotonic()]
    try:
        c.enter("init", args.timeout)
        # the node mates' join, posted for them in one call (each would post its own)
        joining = [r] + [m.env.rank for m in mates]
        store.multi_set([f"rank/{i}" for i in joining],
                        [json.dumps({"rank": i, "host": f"sim{i // cast.k}"}) for i in joining])
        if mates:
            store.multi_set([f"connect/{m.env.rank}" for m in mates], ["1"] * len(mates))
        c.arrive(store, "connect", "every rank to connect")
        c.meet(store)  # as the harness's join: rank 0 every record, the others a few
        marks.append(time.monotonic())
        c.enter("steady", None)
        t, n = time.monotonic(), counted.total("liveness")
        time.sleep(args.steady_s)
        out["side_ops"], out["side_s"] = counted.total("liveness") - n, time.monotonic() - t

        marks.append(time.monotonic())
        out["init_polls"] = counted.timeouts["main"]
        n, polls, per = counted.total("main"), counted.timeouts["main"], []
        busy = counted.busy["main"]
        for name in names[:-1]:
            t = time.monotonic()
            _arrive(c, store, args, name, mates)
            _post(c, store, args, name, mates)
            if r == 0:
                c.gather(store, name)
            per.append(time.monotonic() - t)
        out["check_ops"], out["check_s"] = counted.total("main") - n, per
        out["check_polls"] = counted.timeouts["main"] - polls
        out["own_s"] = (counted.busy["main"] - busy) / len(per)
        marks.append(time.monotonic())
        _abort_scenario(c, out, args, names[-1], seen, cast, mates)
    except _Left:
        pass
    except protocol.Stop:
        if r == 0:  # an abort before the staged one: say whose, and let everyone leave
            got = storekeys.posted(store, "abort")
            out["error"] = "aborted before the staged fault: " + "; ".join(
                f"rank {i}: {a.get('kind')} {a.get('silent', '')}"[:200]
                for i, a in list(got.items())[:3])
            store.set("final", "fail")
            return
        try:  # (a node's speaker that waited for a dead or stalled mate's observation)
            _mates_leave(store, mates, cast, r)
            ending.exit_aborted(c, store)
        except _Left:
            pass
    finally:
        marks.append(time.monotonic())
        out["ops"] = {f"{role}.{op}": k for (role, op), k in counted.ops.items()}


def _arrive(c, store, args, name, mates) -> None:
    """A check's arrival as the worker makes it, for ``c`` and the node mates it writes for:
    each mate leaves its arrival in its slot, as it would itself, then ``c`` arrives."""
    c.enter(name, args.timeout)
    prefix = f"arrive/{c.key(name)}"
    for m in mates:
        m.offer(prefix, "1")
    c.arrive(store, prefix, f"every rank to arrive at {name}")


def _post(c, store, args, name, mates, leaving=()) -> None:
    """A check's observation, the same way; ``leaving``: mates that post none."""
    from ddp_smoke.coordination import keys, records
    c.enter(name, args.timeout)
    obs = records.Observation(data={}, duration_s=0.0, waits=[])
    for m in mates:
        if m.env.rank not in leaving:
            m.offer(keys.of(keys.OBS, c.key(name)), records.text(obs))
    c.post_observation(store, name, obs)


def _abort_scenario(c, out, args, name, seen, cast, mates) -> None:
    """The staged abort (:class:`Cast`): two ranks die after arriving, one stalls; the others
    finish and wait for the report."""
    from ddp_smoke.coordination import ending, protocol, stopped_run, store as storekeys
    r, store = c.env.rank, c.store
    _arrive(c, store, args, name, mates)
    gone = {m.env.rank for m in mates} & {cast.dead, cast.stalled}
    if cast.dead in gone:
        cast.died.set()  # the driver writes its slot no more
        out["died_at"] = time.monotonic()
    if r in (cast.dead, cast.dead_speaker):
        out["died_at"] = time.monotonic()
        c.liveness.stop.set()  # no more heartbeats or looks: to the others this rank is gone
        return
    if r != cast.stalled:  # alive, beating, never posts
        _post(c, store, args, name, mates, leaving=gone)
    if r != 0:  # the rank's liveness thread takes over once it sees the abort
        if seen.wait(args.timeout):
            _mates_leave(store, mates, cast, r)
            ending.exit_aborted(c, store)
        return
    try:  # rank 0's main thread waits, looking between the slices of its wait
        c.gather(store, name)
        out["error"] = f"rank {cast.dead} died and rank 0 gathered every observation"
        return
    except protocol.Stop:
        out["detected_at"] = time.monotonic()
    counted, n = store.raw.raw, store.raw.raw.total("main")
    t = time.monotonic()
    c.leave_forensics(store)  # as exit_aborted does, before it blames
    stopped = c.run.with_identities(store).stopped()  # as finalize does
    live = stopped_run.add_stopped_result_as_a_rank(store, stopped, c.silence, r)
    result = stopped.judged[-1][1]
    out["judge_s"] = time.monotonic() - t
    out["judge_ops"] = counted.total("main") - n
    t = time.monotonic()  # then, as finalize does: the live ranks' forensics for the report
    listed = storekeys.posted(store, "forensics", live, stopped_run.FORENSICS_WAIT_S)
    out["forensics"] = [len(set(listed) & live), len(live), time.monotonic() - t]
    out["culprits"] = [x.rank for x in result.culprits]
    out["victims"] = len(result.figures["victims"])
    store.set("final", "fail")


def _mates_leave(store, mates: list, cast: Cast, me: int) -> None:
    """What a node's live ranks post once they see the abort, for the simulated ones: their
    forensics (one set and one append each; here their speaker posts them, two calls in
    all), and the word on a dead node mate (``fate.note``: its process gone from the node,
    which a real node mate reads in /proc, and which ends the writer's wait for it; here the
    node's lowest live real rank says it, once)."""
    from ddp_smoke.coordination import records
    for d in (cast.dead, cast.dead_speaker):
        if cast.witness(d) == me:
            store.compare_set(f"fate/{d}", "", json.dumps(
                {"gone": True, "pid": 0, "host": f"sim{d // cast.k}", "by": me}))
    ranks = [m.env.rank for m in mates if m.env.rank != cast.dead]
    if ranks:
        found = json.dumps(records.wire(records.Forensics(where="bench: simulated node mate")))
        store.multi_set([f"forensics/{m}" for m in ranks], [found] * len(ranks))
        store.append("forensics/listed", "".join(f"{m}," for m in ranks))


def _private_loopback() -> str:
    """Move this process (and the workers it starts) into a network namespace of its own with
    only loopback up. Why: every store connection makes c10d look up the peer's name; this
    machine's resolver answers ::ffff:127.0.0.1 by DNS and drops about one query in 25, a 5 s
    stall per connection that has nothing to do with the protocol. With no route to any name
    server the lookup fails at once. Needs root; without it the bench runs, slower to start."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x40000000) != 0:  # CLONE_NEWNET
        return f"shared network namespace (unshare: {os.strerror(ctypes.get_errno())})"
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    return "private network namespace, loopback only"


def _raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# -- the driver ------------------------------------------------------------------------------

def simulate(world: int, checks: int, procs: int, steady_s: float, timeout: float,
             unsigned: bool = False, node_speaker: str = "auto", per_node: int = 8) -> dict:
    """One simulated run of ``world`` ranks (records signed, unless ``unsigned``); returns
    the measured figures."""
    import torch.distributed as dist
    from ddp_smoke.coordination.store import dead_after

    _raise_nofile()
    base_fds = _fds()
    need = world + base_fds + 64  # one connection per rank: the store host's share
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < need:
        raise SystemExit(f"coordination_scale: {world} ranks need {need} file descriptors for "
                         f"the store's connections; the hard limit is "
                         f"{resource.getrlimit(resource.RLIMIT_NOFILE)[1]}")
    server = dist.TCPStore("127.0.0.1", 0, world, True, datetime.timedelta(seconds=timeout),
                           wait_for_workers=False, use_libuv=True)
    fds = [0]  # the most this process (the store host) held at once, less what it held before
    sampling = threading.Event()
    threading.Thread(target=_sample_fds, args=(fds, base_fds, sampling), daemon=True).start()
    # Ranks per process, not the protocol, set the floor here: a process's ranks take turns
    # at one GIL, and each store call wakes a thread. At 4,096 ranks (three connections per
    # rank then) a check took 1.5 s with 2 processes, 0.66–1.0 s with 4, 0.34–0.38 s with 8
    # and 0.30 s with 16.
    nodes = max(1, world // per_node)
    procs = max(1, min(procs or max(8, world // 1024), world // 4, nodes))
    secret = secrets.token_hex(32)  # the run's, as a launcher hands it to every rank
    # Rank 0, which gathers and judges, has a process of its own, as it has a node of its
    # own in a cluster: its timings are the store's, not those of a GIL shared with 1,000
    # simulated ranks.
    # (whole nodes a process: a node's speaker writes its mates' slots)
    bounds = [0] + [max(1, nodes * i // procs * per_node) for i in range(procs)] + [world]
    t = time.monotonic()
    logs = [tempfile.TemporaryFile("w+") for _ in bounds[1:]]
    folder = tempfile.mkdtemp(prefix="ddp-smoke-bench-")  # the ranks' lost/ records, if any
    workers = [subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--worker", "--port", str(server.port),
         "--world", str(world), "--lo", str(lo), "--hi", str(hi), "--checks", str(checks),
         "--steady-s", str(steady_s), "--timeout", str(timeout), "--report-dir", folder,
         "--node-speaker", node_speaker, "--per-node", str(per_node)]
        + (["--unsigned"] if unsigned else []),
        stdout=subprocess.PIPE, stderr=log, text=True,
        env={**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR", "DDP_SMOKE_SECRET": secret},
        # The simulated ranks yield to the store (this process) and to rank 0, whose core
        # is theirs alone on a cluster: here thousands of ranks share two with them.
        preexec_fn=None if lo == 0 else lambda: os.nice(10))
        for (lo, hi), log in zip(zip(bounds, bounds[1:]), logs)]
    ranks, alive, round_max, end = {}, 0, 0.0, time.monotonic() + timeout * 3
    try:
        for p in workers:
            text = p.communicate(timeout=max(1.0, end - time.monotonic()))[0]
            got = json.loads(text or "null") or {"ranks": {}, "alive": 0}
            ranks.update({int(r): v for r, v in got["ranks"].items()})
            alive += got["alive"]
            round_max = max(round_max, got.get("round_max", 0.0))
    except (subprocess.TimeoutExpired, json.JSONDecodeError) as e:
        for p in workers:
            p.kill()
            p.wait()
        _clean(folder, server.port)
        tails = []
        for i, log in enumerate(logs):
            log.seek(0)
            text = log.read()
            tails.append(f"worker {i} (exit {workers[i].returncode}): {text[:700]}"
                         + (f" … {text[-300:]}" if len(text) > 1000 else text[700:]))
        print(f"coordination_scale: the simulation of {world} ranks failed "
              f"({type(e).__name__}); the workers' stderr ends:\n" + "\n".join(tails),
              file=sys.stderr, flush=True)
        sampling.set()
        why = "workers killed" if isinstance(e, subprocess.TimeoutExpired) else "no figures"
        raise Unfinished(f"did not finish in {time.monotonic() - t:.0f} s ({why}; their "
                         "stderr above)") from None
    wall = time.monotonic() - t
    _clean(folder, server.port)
    sampling.set()
    del server
    zero = ranks.get(0, {})
    side = [v for v in ranks.values() if "side_ops" in v]
    out = {
        "N": world, "nodes": nodes, "per_node": per_node, "wall_s": round(wall, 1),
        "stuck_threads": alive, "expected_culprits": Cast(world, per_node, node_speaker).expected,
        "node_speakers": Cast(world, per_node, node_speaker).speakers,
        "ops_per_check": sum(v.get("check_ops", 0) for v in ranks.values()) / checks,
        # the part that does not depend on how long a check takes: every wait slice that
        # timed out is one more call (the look taken after it counts as the liveness look's)
        "fixed_ops_per_check": sum(v.get("check_ops", 0) - v.get("check_polls", 0)
                                   for v in ranks.values()) / checks,
        "store_fds_per_rank": fds[0] / world,
        "coord_s_per_check": statistics.median(zero.get("check_s") or [float("nan")]),
        # rank 0's own calls (the store's answers, the signing, the records), not its waits
        "rank0_calls_s_per_check": zero.get("own_s", float("nan")),
        "heartbeat_ops_per_s": sum(v["side_ops"] / v["side_s"] for v in side),
        "ranks_reported": len(ranks),
        "detect_s": zero.get("detected_at", float("nan"))
        - min((v["died_at"] for v in ranks.values() if "died_at" in v), default=float("nan")),
        "judge_s": zero.get("judge_s", float("nan")), "judge_ops": zero.get("judge_ops"),
        "culprits": zero.get("culprits"), "victims": zero.get("victims"),
        "forensics": zero.get("forensics") or [0, 0, float("nan")],
        "error": zero.get("error"),
        "rank0_beat_gap_max_s": zero.get("beat_gap_max"),
        # the longest round of a driver's liveness looks: past the heartbeat silence, this
        # machine cannot simulate the size (its ranks read as dead for the bench's own load)
        "look_round_max_s": round(round_max, 3), "silence_s": dead_after(world),
        "init_slices_timed_out": sum(v.get("init_polls", 0) for v in ranks.values()),
        "phases_s": [round(b - a, 2) for a, b in zip(zero.get("marks", []),
                                                     zero.get("marks", [])[1:])],
        "ops_by_kind": dict(sum((Counter(v.get("ops", {})) for v in ranks.values()), Counter())),
    }
    return out


class Unfinished(Exception):
    """A simulated run that did not end by itself within its bound (its figures: none)."""


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _sample_fds(most: list, base: int, done: threading.Event) -> None:
    """The store host's open files (this process serves the store), every second."""
    while not done.wait(1.0):
        most[0] = max(most[0], _fds() - base)


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs) or float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="the default: 3 checks and 2 s of steady state per size")
    p.add_argument("--full", action="store_true", help="10 checks and 5 s per size")
    p.add_argument("--sizes", default="1024,4096,16384")
    p.add_argument("--checks", type=int)
    p.add_argument("--procs", type=int,
                   help="worker processes hosting the ranks (default: 8, or one per 1,024 "
                        "ranks beyond: 16 at 16,384)")
    p.add_argument("--steady-s", type=float)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--json", action="store_true", help="one JSON line per size, too")
    p.add_argument("--node-speaker", choices=("auto", "on", "off"), default="auto",
                   help="the worker's --node-speaker (default auto, as the worker's)")
    p.add_argument("--signing-cost", type=int, metavar="PAIRS",
                   help="per size, PAIRS runs unsigned and signed, alternating; print each "
                        "and the ratios of the medians (signed / unsigned)")
    p.add_argument("--signing-at", metavar="SIZES",
                   help="the sizes --signing-cost applies to (default: every size)")
    p.add_argument("--unsigned", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--report-dir", help=argparse.SUPPRESS)
    p.add_argument("--per-node", type=int, default=8,
                   help="simulated ranks a node (default 8, as a node of 8 GPUs)")
    for k in ("port", "world", "lo", "hi"):
        p.add_argument(f"--{k}", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    args.checks = args.checks or (10 if args.full else 3)
    args.steady_s = args.steady_s or (5.0 if args.full else 2.0)
    where = _private_loopback()  # before torch starts any thread
    print(f"coordination at scale (simulated ranks, one libuv TCPStore, {where}); load: "
          f"{os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f} "
          f"on {os.cpu_count()} cores; {args.per_node} ranks a simulated node; node speakers "
          f"{args.node_speaker} (--node-speaker; auto: beyond 2,500 ranks)", flush=True)
    print(f"{'N':>6} {'speakers':>8} {'ops/check':>9} {'fixed/node':>10} "
          f"{'coord s/check':>13} {'rank 0 s':>8} {'beat ops/s':>10} {'detect s':>8} {'judge s':>7} "
          f"{'judge ops':>9} {'forensics':>15} {'fds/node':>8} {'look round s':>12}  "
          f"culprits (staged)", flush=True)
    sizes = [int(x) for x in args.sizes.split(",")]
    signing_at = [int(x) for x in args.signing_at.split(",")] if args.signing_at else sizes
    for n in sizes:
        runs = {False: [], True: []}
        pairs = args.signing_cost if n in signing_at else 0
        for unsigned in [True, False] * (pairs or 0) or [False]:
            try:
                r = simulate(n, args.checks, args.procs, args.steady_s, args.timeout, unsigned,
                             args.node_speaker, args.per_node)
            except Unfinished as e:  # the row says so; the other sizes and benches still run
                print(f"{n:>6}  {e}{' (unsigned)' if unsigned else ''}", flush=True)
                continue
            runs[unsigned].append(r)
            nodes = r["nodes"]
            print(f"{n:>6} {nodes if r['node_speakers'] else 0:>8} "
                  f"{r['ops_per_check']:>9.0f} {r['fixed_ops_per_check'] / nodes:>10.2f} "
                  f"{r['coord_s_per_check']:>13.3f} {r['rank0_calls_s_per_check']:>8.3f} "
                  f"{r['heartbeat_ops_per_s']:>10.0f} "
                  f"{r['detect_s']:>8.2f} {r['judge_s']:>7.2f} {r['judge_ops'] or 0:>9} "
                  f"{'%d/%d %.1fs' % tuple(r['forensics']):>15} "
                  f"{r['store_fds_per_rank'] * n / nodes:>8.2f} "
                  f"{'%.2f/%.2f' % (r['look_round_max_s'], r['silence_s']):>12}  "
                  f"{r['culprits']} ({r['expected_culprits']})"
                  f"{' ' + r['error'] if r['error'] else ''}"
                  f"{' (unsigned)' if unsigned else ''}", flush=True)
            if args.json:
                print(json.dumps(dict(r, unsigned=unsigned)), flush=True)
        if pairs and runs[False] and runs[True]:
            print(f"{n:>6} signed / unsigned, medians of {pairs} each: " + ", ".join(
                f"{k} {_median(runs[False], k) / _median(runs[True], k):.2f}"
                for k in ("ops_per_check", "coord_s_per_check", "heartbeat_ops_per_s",
                          "detect_s", "judge_s")), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "job"))
    main()
