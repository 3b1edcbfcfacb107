"""The harness: runs the selected checks on every rank, bounds every wait, gathers to rank 0.

Coordination goes through the launcher's TCPStore, never through the backend under test, so it
works the same for gloo and NCCL and still works when a collective is stuck:

* each rank posts its identity, then for every check: arrives (a store counter, polled with a
  deadline, the idea of gloo's ``monitored_barrier``), runs the check, posts its observation
  as JSON; rank 0 waits for all observations with a deadline and judges;
* a watchdog thread per rank, on its own store connection, beats a counter, watches the
  deadline, the shared abort flag and SIGTERM (through a wakeup fd, because the main thread may
  sit inside a C++ collective where Python signal handlers cannot run);
* any rank that errs, times out or is terminated posts an abort with its reason; rank 0 then
  judges from evidence (who raised, whose heartbeat stopped, who never arrived, who never
  finished), writes the report with what was measured, and every rank exits 1.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import select
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import __version__, checks, plot, runtime, summary
from .config import ConfigError, report_dir as default_report_dir
from .faults import Injector, parse_faults
from .report import (FAIL, SKIP, CheckResult, Culprit, Report, check_from_dict, clear_stale,
                     write_report)

BEAT_S = 0.25          # heartbeat period; a rank silent for DEAD_AFTER_S is taken as dead
DEAD_AFTER_S = 1.5
FINAL_WAIT_S = 10.0    # how long a non-zero rank waits for rank 0's report after an abort
# Messages of backend errors seen by a rank whose peer vanished: the rank is a victim.
_COMM_MARKERS = ("Connection closed by peer", "Connection reset by peer", "gloo/transport",
                 "Broken pipe", "NCCL communicator was aborted", "Timed out waiting")


@dataclass
class Context:
    """What a check's ``run(ctx)`` may use on its rank."""

    env: runtime.LaunchEnv
    backend: str
    device: torch.device
    config: dict[str, Any]
    faults: Injector
    report_dir: str
    storage_dir: str

    rank = property(lambda self: self.env.rank)
    world_size = property(lambda self: self.env.world_size)
    local_rank = property(lambda self: self.env.local_rank)
    timeout_s = property(lambda self: float(self.config["timeout"]))

    def section(self, name: str) -> dict[str, Any]:
        """The check's own options (its section in defaults.yaml)."""
        return self.config.get(name, {})


@dataclass
class Evidence:
    """What a check's ``judge(ev)`` sees on rank 0: every rank's observation, by rank."""

    name: str
    observations: list[dict[str, Any]]
    ranks: list[dict[str, Any]]
    config: dict[str, Any]

    world_size = property(lambda self: len(self.observations))

    def host(self, rank: int) -> str | None:
        return self.ranks[rank].get("host") if rank < len(self.ranks) else None

    def culprit(self, rank: int | None, reason: str) -> Culprit:
        """A culprit with the host filled in from the rank's identity."""
        return Culprit(rank, None if rank is None else self.host(rank), reason)

    def section(self, name: str | None = None) -> dict[str, Any]:
        return self.config.get(name or self.name, {})


class _Stop(Exception):
    """The run is being aborted; the reason is already posted to the store."""


class _Coordinator:
    """Store keys and the once-only finalisation shared by the main and watchdog threads."""

    def __init__(self, env, cfg, connect, started_at, t0):
        self.env, self.cfg, self.checks = env, cfg, cfg["checks"]
        self.started_at, self.t0 = started_at, t0
        self.store = connect(may_host=True)        # main thread's (rank 0 may host the store)
        self.wd_store = connect(may_host=False)    # watchdog's: a blocked call must not block it
        self.beat_store = connect(may_host=False)  # heartbeat's: it beats until the process ends
        self.stage = "init"
        self.deadline: float | None = None
        self.results: list[CheckResult] = []
        self.timings: dict[str, float] = {}
        self.ranks: list[dict] = []
        self.backend = "?"
        self.report_dir = ""
        self._lock = threading.Lock()
        self.finalized = False
        self.leaving = False  # set once this rank has its verdict: store errors are expected now
        self.stop = threading.Event()  # ends the heartbeat and watchdog threads on a clean exit
        self.threads: list[threading.Thread] = []

    # -- posting -------------------------------------------------------------------------
    def abort(self, store, kind: str, detail: dict | None = None) -> None:
        """Tell everyone the run stops, and why, from this rank's point of view."""
        body = {"rank": self.env.rank, "kind": kind, "stage": self.stage, **(detail or {})}
        try:  # the first reason stands: a SIGTERM after an error must not hide the error
            store.compare_set(f"abort/{self.env.rank}", "", json.dumps(body))
            store.add("abort", 1)
        except Exception:  # noqa: BLE001 — the store host may be gone; nothing left to tell
            pass

    def aborted(self, store) -> bool:
        return store.add("abort", 0) > 0

    def wait_all(self, store, prefix: str, what: str) -> None:
        """Poll until ``prefix/<r>`` exists for every rank, or raise _Stop (abort/deadline)."""
        keys = [f"{prefix}/{r}" for r in range(self.env.world_size)]
        pause = 0.001
        while not store.check(keys):
            if self.aborted(store):
                raise _Stop
            if self.deadline is not None and time.monotonic() > self.deadline:
                self.abort(store, "timeout", {"waiting_for": what})
                raise _Stop
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    # -- rank 0 ----------------------------------------------------------------------------
    def finalize(self, store, aborted: bool) -> Report | None:
        """Rank 0 writes the report once; returns it, or None if it was already written."""
        with self._lock:
            if self.finalized:
                return None
            self.finalized = True
        if aborted:
            self._judge_abort(store)
        self.timings["total_s"] = round(time.monotonic() - self.t0, 4)
        report = Report(version=__version__, started_at=self.started_at, backend=self.backend,
                        world_size=self.env.world_size, ranks=self._identities(store),
                        checks=self._with_unrun(), config=self.cfg, timings=self.timings,
                        error=self._first_error(store) if aborted else None,
                        run_id=self.env.run_id)
        path = write_report(report, self.report_dir)
        plot.write_busbw_png(report, self.report_dir)  # only with matplotlib installed
        summary.print_report(report, path)
        try:
            store.set("final", report.verdict)
        except Exception:  # noqa: BLE001
            pass
        return report

    def _identities(self, store) -> list[dict]:
        if len(self.ranks) == self.env.world_size:
            return self.ranks
        out = []
        for r in range(self.env.world_size):
            got = _try_get(store, f"rank/{r}")
            out.append(json.loads(got) if got else {"rank": r, "local_rank": None, "host": None,
                                                     "missing": "never connected to the store"})
        return out

    def _with_unrun(self) -> list[CheckResult]:
        done = {c.name for c in self.results}
        rest = [CheckResult(n, SKIP, summary=f"not run: the run stopped at {self.stage}")
                for n in self.checks if n not in done]
        return self.results + rest

    def _first_error(self, store) -> dict | None:
        for r in range(self.env.world_size):
            got = _try_get(store, f"abort/{r}")
            if got and json.loads(got).get("kind") == "error":
                e = json.loads(got)
                return {"rank": r, "host": self.ranks[r]["host"] if r < len(self.ranks) else None,
                        "type": e.get("type"), "message": e.get("message"), "stage": e["stage"]}
        return {"rank": None, "host": None, "type": "Aborted",
                "message": f"run aborted at {self.stage}", "stage": self.stage}

    def _judge_abort(self, store) -> None:
        """Name the culprits of the stage where the run stopped, from positive evidence."""
        stage = self.stage
        world = range(self.env.world_size)
        reasons = {r: json.loads(g) for r in world if (g := _try_get(store, f"abort/{r}"))}
        connected = {r for r in world if store.check([f"rank/{r}"])}
        arrive = "rank" if stage == "init" else f"arrive/{stage}"
        arrived = {r for r in world if store.check([f"{arrive}/{r}"])}
        finished = {r for r in world if store.check([f"obs/{stage}/{r}"])}
        dead = _dead_ranks(store, sorted(connected - {0}), exclude={
            r for r, a in reasons.items() if a["kind"] == "terminated"})
        ids = self._identities(store)

        def who(r, why):
            return Culprit(r, ids[r].get("host"), why)

        never = [who(r, f"never connected to the store at {self.env.master_addr}:"
                        f"{self.env.master_port} (not started, or cannot reach it)")
                 for r in world if r not in connected]
        raised = [who(r, f"raised {a.get('type')}: {a.get('message')}")
                  for r, a in sorted(reasons.items()) if a["kind"] == "error" and not a.get("comm")]
        died = [who(r, f"died during {stage} (no heartbeat for {DEAD_AFTER_S} s)"
                       if r in arrived else f"died before arriving at {stage}") for r in dead]
        timeout = self.cfg["timeout"]
        absent = [who(r, f"did not arrive at {stage} within {timeout} s (process alive: hung?)")
                  for r in connected if r not in arrived and r not in dead]
        stuck = [who(r, f"did not finish {stage} within {timeout} s (process alive)")
                 for r in world if r in arrived and r not in finished and r not in dead
                 and r not in reasons]
        comm = [who(r, f"communication failure: {a.get('message')}")
                for r, a in sorted(reasons.items()) if a["kind"] == "error" and a.get("comm")]
        culprits = (raised + died + never) or absent or stuck or comm or [
            Culprit(None, None, "aborted: " + "; ".join(f"rank {r} {a['kind']}"
                                                        for r, a in sorted(reasons.items())))]
        figures = {"arrived": sorted(arrived), "finished": sorted(finished), "dead": sorted(dead),
                   "aborts": [reasons[r] for r in sorted(reasons)]}
        judged = {c.name for c in self.results}
        # Outside a check (process-group init, between checks) the run itself failed: "launch".
        name = stage if stage in self.checks and stage not in judged else "launch"
        self.results.append(CheckResult(name, FAIL, summary=f"stopped at {stage}: "
                                        f"{culprits[0].reason}", culprits=culprits, figures=figures))


def _try_get(store, key: str) -> bytes | None:
    try:
        return store.get(key) if store.check([key]) else None
    except Exception:  # noqa: BLE001 — evidence gathering never raises
        return None


def _dead_ranks(store, world, exclude) -> list[int]:
    """Ranks whose heartbeat did not move over DEAD_AFTER_S (terminated ones excluded)."""
    before = {r: store.add(f"beat/{r}", 0) for r in world}
    time.sleep(DEAD_AFTER_S)
    return [r for r in world if r not in exclude and store.add(f"beat/{r}", 0) == before[r]]


def _beat(store, rank: int, stop: threading.Event) -> None:
    """Heartbeat thread: proves this process is alive until it exits, whatever else it does."""
    try:
        while not stop.is_set():
            store.add(f"beat/{rank}", 1)
            stop.wait(BEAT_S)
    except Exception:  # noqa: BLE001 — the store is gone; the watchdog reports that
        return


class _Watchdog(threading.Thread):
    """Enforces the deadline, reacts to aborts and SIGTERM even while main is stuck."""

    def __init__(self, coord: _Coordinator, wakeup_fd: int):
        super().__init__(name="ddp-smoke-watchdog", daemon=True)
        self.coord, self.wakeup_fd = coord, wakeup_fd

    def run(self) -> None:
        c, store = self.coord, self.coord.wd_store
        try:
            while not c.stop.is_set():
                if select.select([self.wakeup_fd], [], [], BEAT_S)[0]:
                    os.read(self.wakeup_fd, 64)
                    c.abort(store, "terminated", {"signal": "SIGTERM"})
                if c.deadline is not None and time.monotonic() > c.deadline:
                    c.abort(store, "timeout", {"waiting_for": c.stage})
                if c.aborted(store):
                    break
            else:
                return  # clean exit: the main thread stopped us
        except Exception as e:  # noqa: BLE001 — the store is gone: rank 0's side ended
            if c.leaving:
                return
            _leave(f"lost the coordination store at {c.env.master_addr}:{c.env.master_port} "
                   f"({type(e).__name__}); rank 0 or its node is gone", code=1)
        _exit_aborted(c, store)  # returns only when the main thread owns the exit


def _exit_aborted(c: _Coordinator, store) -> None:
    """Leave an aborted run with status 1, from the main thread or the watchdog.

    Rank 0 writes the report first; it returns instead when the other thread is writing it
    (that thread then owns the exit). Other ranks wait briefly for rank 0's report.
    """
    if c.env.rank == 0:
        if c.finalize(store, aborted=True) is not None:
            _leave(None, code=1)
        return
    if _wait_final(store, FINAL_WAIT_S) is None:
        _leave(f"run aborted at {c.stage}, and rank 0 wrote no report: rank 0 "
               f"({c.ranks[0]['host'] if c.ranks else c.env.master_addr}) is gone or stuck",
               code=1)
    _leave(f"run aborted at {c.stage}; rank 0 wrote the report", code=1)


def _wait_final(store, timeout_s: float) -> str | None:
    """Wait for rank 0's verdict while rank 0's heartbeat moves; say goodbye once read.

    Returns None when rank 0 wrote nothing within ``timeout_s`` or its heartbeat stopped
    for DEAD_AFTER_S (it died: no reason to wait out the whole bound).
    """
    end = time.monotonic() + timeout_s
    beat, beat_at = -1, time.monotonic()
    while time.monotonic() < end:
        try:
            if store.check(["final"]):
                store.add("bye", 1)
                return store.get("final").decode()
            now_beat = store.add("beat/0", 0)
        except Exception:  # noqa: BLE001 — rank 0 hosted the store and is gone
            return None
        if now_beat != beat:
            beat, beat_at = now_beat, time.monotonic()
        elif time.monotonic() - beat_at > DEAD_AFTER_S:
            return None
        time.sleep(0.05)
    return None


def _leave(message: str | None, code: int) -> None:
    """Exit now, from any thread, after flushing; the main thread may be stuck in C++."""
    if message:
        print(f"ddp-smoke rank {os.environ.get('RANK', '?')}: {message}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(cfg: dict[str, Any]) -> int:
    """Run the configured checks on this rank; return the process exit status."""
    t0 = time.monotonic()
    started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    env = runtime.LaunchEnv.from_environ()
    faults = parse_faults(cfg["fault"], cfg["checks"])
    if any(f.rank >= env.world_size for f in faults):
        raise ConfigError(f"key 'fault' = {cfg['fault']!r}: rank out of range for "
                          f"WORLD_SIZE={env.world_size}")
    for name in cfg["checks"]:  # imports cost seconds (DDP pulls in torch._dynamo): not timed
        validate = getattr(checks.load(name), "validate", None)
        if validate:  # bad options: exit 2 on every rank, before anyone waits for anyone
            validate(cfg.get(name, {}))
    coord_t0 = time.monotonic()
    backend = runtime.pick_backend(cfg["backend"])
    timeout = float(cfg["timeout"])
    rdir = default_report_dir(cfg, env.run_id)
    if env.rank == 0:
        _check_writable(rdir)
        clear_stale(rdir)  # a report left by another run must never read as this run's

    try:
        coord = _Coordinator(env, cfg, lambda may_host: _store(env, timeout, may_host),
                             started_at, t0)
    except (RuntimeError, OSError) as e:  # DistStoreError/DistNetworkError are RuntimeErrors
        _leave(f"cannot reach the coordination store at {env.master_addr}:{env.master_port} "
               f"within {timeout} s: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
               code=1)
    coord.backend, coord.report_dir = backend, rdir
    coord.timings["load_checks_s"] = round(coord_t0 - t0, 4)
    coord.timings["connect_store_s"] = round(time.monotonic() - coord_t0, 4)
    _start_threads(coord)

    device = runtime.bind_device(backend, env.local_rank)
    store = coord.store
    store.set(f"rank/{env.rank}", json.dumps(runtime.rank_record(env, device)))
    ctx = Context(env, backend, device, cfg, Injector(faults, env.rank), rdir,
                  cfg["storage_dir"] or os.path.join(rdir, "storage"))
    try:
        coord.deadline = time.monotonic() + timeout
        t = time.monotonic()
        runtime.init_process_group(env, backend, device, store, timeout + 15)
        coord.wait_all(store, "rank", "every rank to connect")
        _adopt_run_id(coord, ctx)
        coord.timings["rendezvous_s"] = round(time.monotonic() - t, 4)
        coord.ranks = [json.loads(store.get(f"rank/{r}")) for r in range(env.world_size)]
        t = time.monotonic()
        for name in cfg["checks"]:
            _run_check(coord, ctx, name)
        coord.timings["checks_s"] = round(time.monotonic() - t, 4)
        coord.stage, coord.deadline = "finish", None
    except _Stop:
        pass
    except Exception as e:  # noqa: BLE001 — init or harness failure on this rank
        coord.abort(store, "error", _error_detail(e))
    if coord.aborted(store):
        _exit_aborted(coord, store)
        time.sleep(FINAL_WAIT_S)  # the watchdog is finishing the report and owns the exit
        return 1
    if env.rank != 0:
        verdict = _wait_final(store, timeout + FINAL_WAIT_S)
        _shut_down(coord)
        return 0 if verdict == "pass" else 1
    report = coord.finalize(store, aborted=False)
    if report is None:  # the watchdog is finishing an abort and owns the exit
        time.sleep(FINAL_WAIT_S)
    if not env.agent_store:  # rank 0 hosts the store: let the others read the verdict first
        _wait_counter(store, "bye", env.world_size - 1, 5.0)
    _shut_down(coord)
    return 0 if report is not None and report.verdict == "pass" else 1


def _adopt_run_id(coord: _Coordinator, ctx: Context) -> None:
    """Rank 0's run id on every rank (drawn there when the launcher gave none), and the
    default folders named after it."""
    ctx.env = coord.env = runtime.share_run_id(ctx.env, coord.store)
    ctx.report_dir = default_report_dir(ctx.config, ctx.env.run_id)
    ctx.storage_dir = ctx.config["storage_dir"] or os.path.join(ctx.report_dir, "storage")


def _run_check(coord: _Coordinator, ctx: Context, name: str) -> None:
    env, store, timeout = ctx.env, coord.store, ctx.timeout_s
    module = checks.load(name)  # imported already by run(): a cache hit
    coord.stage, ctx.faults.check = name, name
    coord.deadline = time.monotonic() + timeout
    ctx.faults.before_arrival()
    store.set(f"arrive/{name}/{env.rank}", "1")
    coord.wait_all(store, f"arrive/{name}", f"every rank to arrive at {name}")
    coord.deadline = time.monotonic() + timeout  # a fresh bound for the work and the gather
    t = time.monotonic()
    try:
        ctx.faults.at_start()
        obs = {"ok": True, "data": module.run(ctx)}
    except Exception as e:  # noqa: BLE001 — a check that raises fails with its rank named
        detail = _error_detail(e)
        store.set(f"obs/{name}/{env.rank}", json.dumps({"ok": False, **detail}))
        coord.abort(store, "error", detail)
        raise _Stop from None
    obs["duration_s"] = round(time.monotonic() - t, 6)
    store.set(f"obs/{name}/{env.rank}", json.dumps(obs))
    if env.rank == 0:
        coord.wait_all(store, f"obs/{name}", f"every rank to finish {name}")
        got = [json.loads(store.get(f"obs/{name}/{r}")) for r in range(env.world_size)]
        coord.results.append(_judge(module, name, got, coord))


def _judge(module, name: str, got: list[dict], coord: _Coordinator) -> CheckResult:
    ev = Evidence(name, [g["data"] for g in got], coord.ranks, coord.cfg)
    try:
        # The JSON round trip makes a figure that cannot be written fail here, named.
        result = check_from_dict(json.loads(json.dumps(dataclasses.asdict(module.judge(ev)))))
    except Exception as e:  # noqa: BLE001 — a bug in the kit, not in the cluster
        result = CheckResult(name, FAIL, summary=f"judge raised {type(e).__name__}: {e}",
                             culprits=[Culprit(None, None, traceback.format_exc(limit=3))])
    result.duration_s = max(g["duration_s"] for g in got)
    return result


def _error_detail(e: BaseException) -> dict:
    message = str(e)
    comm = isinstance(e, getattr(dist, "DistError", ())) or any(m in message
                                                                for m in _COMM_MARKERS)
    return {"type": type(e).__name__, "message": message.splitlines()[0][:500] if message else "",
            "traceback": traceback.format_exc(limit=6), "comm": comm}


def _wait_counter(store, key: str, target: int, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while store.add(key, 0) < target and time.monotonic() < end:
        time.sleep(0.02)


def _store(env: runtime.LaunchEnv, timeout: float, may_host: bool):
    raw = runtime.connect_store(env, timeout, may_host=may_host)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"ddp_smoke/{restart}", raw)


def _start_threads(coord: _Coordinator) -> None:
    """Heartbeat and watchdog threads; SIGTERM wakes the watchdog through a pipe, wherever
    the main thread is."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    coord.threads = [threading.Thread(target=_beat, daemon=True, name="ddp-smoke-heartbeat",
                                      args=(coord.beat_store, coord.env.rank, coord.stop)),
                     _Watchdog(coord, r)]
    for t in coord.threads:
        t.start()


def _shut_down(coord: _Coordinator) -> None:
    """A clean exit: stop our threads before the interpreter does (a thread caught inside a
    store call at exit aborts the process), then tear the process group down."""
    coord.leaving = True
    coord.stop.set()
    for t in coord.threads:
        t.join(timeout=2 * BEAT_S + 1)
    if dist.is_initialized():
        dist.destroy_process_group()


def _check_writable(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write-test-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"--report-dir {path}: not writable ({e.strerror})") from None
