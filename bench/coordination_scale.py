"""Benchmark: the harness's store coordination with N simulated ranks on one TCPStore.

Not a test: it prints numbers. Each simulated rank is a real ``coordination.protocol.Coordinator`` with
its own three store connections (main, watchdog, heartbeat, each a signed ``PrefixStore`` over a
TCPStore client, as the harness makes them) and its own main thread; its heartbeat
(``liveness.beat_once``) and watchdog (``liveness.Watchdog.step``) run at the kit's periods,
driven for all ranks of a worker by one thread each (12,288 threads on 2 cores would measure
the scheduler, not the protocol). No process group, no collective: only the store protocol.
The store is one libuv TCPStore hosted by this process; the ranks live in ``--procs`` worker
processes (one torch import each), in a network namespace of their own where root may.

Per world size N it measures, in one simulated run:

* heartbeat load: store operations per second of the heartbeats and watchdogs of all ranks,
  with every main thread idle (steady state);
* per check: store operations of the main threads (counted by a proxy around each
  connection: one call, one operation) and rank 0's wall time for arrive → post a trivial
  observation → gather, which is pure coordination;
* an abort: at one more check the last rank dies (its heartbeat stops) and the middle one
  stalls (alive, never posts); ranks far from 0, so that no search that stops early hides.
  Rank 0's main thread waits in ``gather`` while its watchdog notices the silent heartbeat
  and aborts ("detect"); then ``judge.judge_as_a_rank`` names the culprits ("judge"),
  while every other rank goes through the real ``_exit_aborted`` and waits for the report,
  as its watchdog does once it sees the abort (here the rank's main thread stands in for its
  watchdog; its own parked store wait costs the store nothing while it waits). Process exit
  (``ending.leave``) and the stack files (``forensics.dump``) are replaced in the workers, nothing
  else.

    .venv/bin/python bench/coordination_scale.py            # --quick: N = 64 … 4096, ~1 min
    .venv/bin/python bench/coordination_scale.py --full --json --sizes 64,256

Columns: store calls per check (all ranks), per rank, per rank less the waits that timed out
(each followed by a look at the abort list: none, unless a watchdog failed to act), rank
0's median seconds per check, heartbeat + watchdog calls per second, seconds from the
death to the abort, seconds and store calls of ``judge_as_a_rank`` (the culprits named), how many
live ranks' forensics the report lists and how long the writer waited for them after judging
(at most ``FORENSICS_WAIT_S``), the culprits.

Times are this machine's, under whatever else runs on it (the load average is printed): the
simulated ranks share its cores, where a cluster gives each rank its own.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))


class Counted:
    """A store connection that counts its calls (one call = one request to the store)."""

    def __init__(self, store):
        self._s, self.ops, self.timeouts = store, Counter(), 0

    def total(self) -> int:
        return sum(self.ops.values())

    def __getattr__(self, name):
        attr = getattr(self._s, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            self.ops[name] += 1
            try:
                return attr(*args, **kwargs)
            except RuntimeError as e:  # a blocking wait that timed out: one poll
                if name == "wait" and "timeout" in str(e):
                    self.timeouts += 1
                raise
        return call


# -- one worker process: ranks [lo, hi) ------------------------------------------------------

class _Left(BaseException):
    """A simulated rank leaves (replaces os._exit); BaseException: nothing in the kit catches it."""


def worker(args) -> None:
    from ddp_smoke import harness  # torch, once per process, not per rank
    from ddp_smoke.config.launchenv import LaunchEnv
    from ddp_smoke.coordination import ending, forensics, liveness, protocol

    # first, a low fd: the watchdogs select() on it, and select() takes fds below 1024 only
    pipe_r, _pipe_w = os.pipe()  # never written: the watchdogs' select just times out
    threading.stack_size(512 * 1024)
    _raise_nofile()

    def leave(message, code):
        raise _Left(code)
    ending.leave = leave
    forensics.dump = lambda report_dir, rank: {"where": "bench: simulated rank"}
    if args.unsigned:  # the baseline: the same protocol with records unsigned (no secret)
        from ddp_smoke.coordination import signing
        signing.run_secret = lambda env, environ=None: None
    hook = threading.excepthook
    threading.excepthook = lambda a: None if issubclass(a.exc_type, _Left) else hook(a)

    world = args.world
    names = [f"c{i}" for i in range(args.checks)] + ["abort_here"]
    cfg = {"checks": names, "timeout": args.timeout}

    def connect(env):
        def one(may_host):  # as the harness connects: a signed PrefixStore over a client
            signed = harness._store(env, args.timeout, may_host=False)
            signed.raw = Counted(signed.raw)  # counts the store's calls, not the wrapper's
            return signed
        return one

    ranks = range(args.lo, args.hi)
    coords = {}
    for r in ranks:
        env = LaunchEnv(rank=r, world_size=world, local_rank=r, local_world_size=world,
                                group_rank=0, master_addr="127.0.0.1", master_port=args.port,
                                agent_store=True, launcher="bench", run_id="bench")
        coords[r] = protocol.Coordinator(env, cfg, connect(env), lambda *a: "fail", "bench",
                                        time.monotonic())
        coords[r].report_dir = "/nonexistent"
    out = {r: {} for r in ranks}
    seen = {r: threading.Event() for r in ranks}  # set when the rank's watchdog saw the abort
    if 0 in coords:
        coords[0].claim_finish()  # the bench judges on rank 0 itself, below; no report file
    drivers = [threading.Thread(target=_drive_beats, args=(coords,), daemon=True),
               threading.Thread(target=_drive_watchdogs,
                                args=({r: liveness.Watchdog(c, pipe_r) for r, c in coords.items()},
                                      seen), daemon=True)]
    for t in drivers:
        t.start()
    mains = [threading.Thread(target=_rank_main, args=(coords[r], out[r], args, names, seen[r]),
                              daemon=True) for r in ranks]
    for t in mains:
        t.start()
    threading.Thread(target=_progress, args=(out, args.lo), daemon=True).start()
    for t in mains:
        t.join(args.timeout * 3)
    for c in coords.values():
        c.stop.set()
    alive = sum(t.is_alive() for t in mains)  # a stuck rank may still write its dict: copy
    json.dump({"ranks": {r: dict(v) for r, v in out.items()}, "alive": alive}, sys.stdout)
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown under threads still inside store calls


def _progress(out: dict, lo: int) -> None:
    """Every 10 s on stderr: how many of this worker's ranks passed each phase (shown when
    a simulation does not finish)."""
    t = time.monotonic()
    while True:
        time.sleep(10)
        passed = Counter(len(v.get("marks", ())) for v in out.values())
        print(f"worker {lo} at {time.monotonic() - t:.0f} s: ranks by phases passed "
              f"{dict(sorted(passed.items()))}", file=sys.stderr, flush=True)


def _drive_beats(coords: dict) -> None:
    """Every rank's heartbeat, one ``liveness.beat_once`` per rank per period, from one
    thread: a thread per rank and per role would measure this machine's scheduler."""
    from ddp_smoke.coordination import liveness, store as storekeys
    n = dict.fromkeys(coords, 0)
    period = storekeys.look_period(next(iter(coords.values())).env.world_size, 2)
    while True:
        t = time.monotonic()
        for r, c in coords.items():
            if not c.stop.is_set():
                n[r] += 1
                liveness.beat_once(c, c.beat_store, n[r])
        time.sleep(max(0.0, period - (time.monotonic() - t)))


def _drive_watchdogs(dogs: dict, seen: dict) -> None:
    """Every rank's watchdog, one ``Watchdog.step`` per rank per period, from one thread.
    A rank whose watchdog saw the abort is told (``seen``) and looked at no more."""
    from ddp_smoke.coordination import store as storekeys
    period = storekeys.look_period(next(iter(dogs.values())).coord.env.world_size, 2)
    while True:
        t = time.monotonic()
        for r, dog in dogs.items():
            if not dog.coord.stop.is_set() and not seen[r].is_set():
                if dog.step(dog.coord.wd_store, 0.0):
                    seen[r].set()
        time.sleep(max(0.0, period - (time.monotonic() - t)))


def _rank_main(c, out, args, names, seen) -> None:
    from ddp_smoke.coordination import ending, protocol, store as storekeys
    r, store = c.env.rank, c.store
    side = lambda: c.beat_store.total() + c.wd_store.total()  # noqa: E731
    out["marks"] = marks = [time.monotonic()]
    try:
        c.enter("init", args.timeout)
        store.set(f"rank/{r}", json.dumps({"rank": r, "host": f"sim{r // 8}"}))
        c.arrive(store, "connect", "every rank to connect")
        if r == 0:
            c.ranks = [json.loads(v) for v in
                       store.multi_get([f"rank/{i}" for i in range(c.env.world_size)])]
        marks.append(time.monotonic())
        c.enter("steady", None)
        t, n = time.monotonic(), side()
        time.sleep(args.steady_s)
        out["side_ops"], out["side_s"] = side() - n, time.monotonic() - t

        marks.append(time.monotonic())
        n, polls, per = store.total(), store.timeouts, []
        for name in names[:-1]:
            t = time.monotonic()
            c.enter(name, args.timeout)
            c.arrive(store, f"arrive/{c.key(name)}", f"every rank to arrive at {name}")
            c.enter(name, args.timeout)
            c.post_observation(store, name, {"ok": True, "data": {}, "duration_s": 0.0})
            if r == 0:
                c.gather(store, name)
            per.append(time.monotonic() - t)
        out["check_ops"], out["check_s"] = store.total() - n, per
        out["check_polls"] = store.timeouts - polls
        marks.append(time.monotonic())
        _abort_scenario(c, out, args, names[-1], seen)
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
        try:
            ending.exit_aborted(c, store)
        except _Left:
            pass
    finally:
        marks.append(time.monotonic())
        out["ops"] = {k: dict(s.ops) for k, s in
                      (("main", store), ("watchdog", c.wd_store), ("beat", c.beat_store))}


def _abort_scenario(c, out, args, name, seen) -> None:
    """The last rank dies after arriving, the middle one stalls; the others finish and wait
    for the next check."""
    from ddp_smoke.coordination import ending, judge, store as storekeys
    r, store = c.env.rank, c.store
    c.enter(name, args.timeout)
    c.arrive(store, f"arrive/{c.key(name)}", f"every rank to arrive at {name}")
    c.enter(name, args.timeout)
    dead, stalled = c.env.world_size - 1, c.env.world_size // 2
    if r == dead:
        out["died_at"] = time.monotonic()
        c.stop.set()  # heartbeat and watchdog stop: to the others this process is gone
        return
    if r != stalled:  # alive, beating, never posts
        c.post_observation(store, name, {"ok": True, "data": {}, "duration_s": 0.0})
    if r != 0:  # the rank's watchdog takes over once it sees the abort
        if seen.wait(args.timeout):
            ending.exit_aborted(c, c.wd_store)
        return
    gathered = threading.Event()
    threading.Thread(target=lambda: (c.gather(store, name), gathered.set()),
                     daemon=True).start()  # blocks in the store's wait, as rank 0's main does
    if not seen.wait(args.timeout) or gathered.is_set():
        out["error"] = f"rank {dead} died and rank 0's watchdog did not abort"
        return
    out["detected_at"] = time.monotonic()
    wd, n = c.wd_store, c.wd_store.total()  # the watchdog judges, on its own connection
    t = time.monotonic()
    c.leave_forensics(wd)  # as _exit_aborted does, before it judges
    c.identities(wd)
    live = judge.judge_as_a_rank(wd, c.stopped(), c.silence)
    out["judge_s"] = time.monotonic() - t
    out["judge_ops"] = wd.total() - n
    t = time.monotonic()  # then, as finalize does: the live ranks' forensics for the report
    listed = storekeys.posted(wd, "forensics", live, judge.FORENSICS_WAIT_S)
    out["forensics"] = [len(set(listed) & live), len(live), time.monotonic() - t]
    res = c.judged[-1][1]
    out["culprits"] = [x.rank for x in res.culprits]
    out["victims"] = len(res.figures["victims"])
    wd.set("final", "fail")


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
             unsigned: bool = False) -> dict:
    """One simulated run of ``world`` ranks (records signed, unless ``unsigned``); returns
    the measured figures."""
    import torch.distributed as dist

    _raise_nofile()
    need = 3 * world + 64
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < need:
        raise SystemExit(f"coordination_scale: {world} ranks need {need} file descriptors for "
                         f"the store's connections; the hard limit is "
                         f"{resource.getrlimit(resource.RLIMIT_NOFILE)[1]}")
    server = dist.TCPStore("127.0.0.1", 0, world, True, datetime.timedelta(seconds=timeout),
                           wait_for_workers=False, use_libuv=True)
    # Ranks per process, not the protocol, set the floor here: a process's ranks take turns
    # at one GIL, and each store call wakes a thread. At 4,096 ranks a check took 1.5 s
    # with 2 processes, 0.66–1.0 s with 4, 0.34–0.38 s with 8 and 0.30 s with 16.
    procs = max(1, min(procs, world // 4))
    secret = secrets.token_hex(32)  # the run's, as a launcher hands it to every rank
    # Rank 0, which gathers and judges, has a process of its own, as it has a node of its
    # own in a cluster: its timings are the store's, not those of a GIL shared with 1,000
    # simulated ranks.
    bounds = [0] + [1 + (world - 1) * i // procs for i in range(procs + 1)]
    t = time.monotonic()
    logs = [tempfile.TemporaryFile("w+") for _ in bounds[1:]]
    workers = [subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--worker", "--port", str(server.port),
         "--world", str(world), "--lo", str(lo), "--hi", str(hi), "--checks", str(checks),
         "--steady-s", str(steady_s), "--timeout", str(timeout)]
        + (["--unsigned"] if unsigned else []),
        stdout=subprocess.PIPE, stderr=log, text=True,
        env={**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR", "DDP_SMOKE_SECRET": secret})
        for (lo, hi), log in zip(zip(bounds, bounds[1:]), logs)]
    ranks, alive, end = {}, 0, time.monotonic() + timeout * 3
    try:
        for p in workers:
            text = p.communicate(timeout=max(1.0, end - time.monotonic()))[0]
            got = json.loads(text or "null") or {"ranks": {}, "alive": 0}
            ranks.update({int(r): v for r, v in got["ranks"].items()})
            alive += got["alive"]
    except (subprocess.TimeoutExpired, json.JSONDecodeError) as e:
        for p in workers:
            p.kill()
            p.wait()
        tails = []
        for i, log in enumerate(logs):
            log.seek(0)
            tails.append(f"worker {i} (exit {workers[i].returncode}): {log.read()[-600:]}")
        raise SystemExit(f"coordination_scale: the simulation of {world} ranks failed "
                         f"({type(e).__name__}); the workers' stderr ends:\n"
                         + "\n".join(tails)) from None
    wall = time.monotonic() - t
    del server
    zero = ranks.get(0, {})
    side = [v for v in ranks.values() if "side_ops" in v]
    out = {
        "N": world, "wall_s": round(wall, 1), "stuck_threads": alive,
        "ops_per_check": sum(v.get("check_ops", 0) for v in ranks.values()) / checks,
        # the part that does not depend on how long a check takes: every timed-out wait is
        # a poll, followed by one look at the abort list
        "fixed_ops_per_check": sum(v.get("check_ops", 0) - 2 * v.get("check_polls", 0)
                                   for v in ranks.values()) / checks,
        "coord_s_per_check": statistics.median(zero.get("check_s") or [float("nan")]),
        "heartbeat_ops_per_s": sum(v["side_ops"] / v["side_s"] for v in side),
        "ranks_reported": len(ranks),
        "detect_s": zero.get("detected_at", float("nan"))
        - ranks.get(world - 1, {}).get("died_at", float("nan")),
        "judge_s": zero.get("judge_s", float("nan")), "judge_ops": zero.get("judge_ops"),
        "culprits": zero.get("culprits"), "victims": zero.get("victims"),
        "forensics": zero.get("forensics") or [0, 0, float("nan")],
        "error": zero.get("error"),
        "ops_by_kind": {k: dict(sum((Counter(v.get("ops", {}).get(k, {})) for v in ranks.values()),
                                     Counter()))
                        for k in ("main", "watchdog", "beat")},
    }
    return out


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs) or float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="the default: 3 checks and 2 s of steady state per size (~2 min)")
    p.add_argument("--full", action="store_true", help="10 checks and 5 s per size")
    p.add_argument("--sizes", default="64,256,1024,4096")
    p.add_argument("--checks", type=int)
    p.add_argument("--procs", type=int, default=8,
                   help="worker processes hosting the ranks (8: 512 ranks each at 4,096)")
    p.add_argument("--steady-s", type=float)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--json", action="store_true", help="one JSON line per size, too")
    p.add_argument("--signing-cost", type=int, metavar="PAIRS",
                   help="per size, PAIRS runs unsigned and signed, alternating; print each "
                        "and the ratios of the medians (signed / unsigned)")
    p.add_argument("--unsigned", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
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
          f"on {os.cpu_count()} cores", flush=True)
    print(f"{'N':>6} {'ops/check':>10} {'ops/check/N':>11} {'fixed/N':>7} {'coord s/check':>13} "
          f"{'beat ops/s':>10} {'detect s':>8} {'judge s':>7} {'judge ops':>9} "
          f"{'forensics':>15}  culprits",
          flush=True)
    for n in [int(x) for x in args.sizes.split(",")]:
        runs = {False: [], True: []}
        for unsigned in [True, False] * (args.signing_cost or 0) or [False]:
            r = simulate(n, args.checks, args.procs, args.steady_s, args.timeout, unsigned)
            runs[unsigned].append(r)
            print(f"{n:>6} {r['ops_per_check']:>10.0f} {r['ops_per_check'] / n:>11.2f} "
                  f"{r['fixed_ops_per_check'] / n:>7.2f} "
                  f"{r['coord_s_per_check']:>13.3f} {r['heartbeat_ops_per_s']:>10.0f} "
                  f"{r['detect_s']:>8.2f} {r['judge_s']:>7.2f} {r['judge_ops'] or 0:>9} "
                  f"{'%d/%d %.1fs' % tuple(r['forensics']):>15}  "
                  f"{r['culprits']}{' ' + r['error'] if r['error'] else ''}"
                  f"{' (unsigned)' if unsigned else ''}", flush=True)
            if args.json:
                print(json.dumps(dict(r, unsigned=unsigned)), flush=True)
        if args.signing_cost:
            print(f"{n:>6} signed / unsigned, medians of {args.signing_cost} each: " + ", ".join(
                f"{k} {_median(runs[False], k) / _median(runs[True], k):.2f}"
                for k in ("ops_per_check", "coord_s_per_check", "heartbeat_ops_per_s",
                          "detect_s", "judge_s")), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "job"))
    main()
