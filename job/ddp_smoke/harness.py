"""The run loop: what every rank does, top to bottom.

1. validate what only the launcher's environment can say (faults against the world size);
   rank 0 prepares the report folder (:func:`ddp_smoke.outputs.prepare`);
2. connect to the coordination store and start the heartbeat and the watchdog
   (:mod:`ddp_smoke.coordination`);
3. post this rank's identity, agree on the run id and the backend, join the process group;
4. run every check (:mod:`ddp_smoke.checks`): arrive, ``run``, post the observation; rank 0
   gathers and ``judge``\\ s; repeat mode goes round again;
5. rank 0 writes the report (:func:`ddp_smoke.outputs.publish`) and every rank exits with the
   verdict: 0 for pass, 1 otherwise.

Any rank that errs, times out or is terminated posts an abort; from then on the watchdog owns
the exit (:mod:`ddp_smoke.coordination.ending`), and the writer blames the stopped stage.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from . import checks, outputs
from .checks.api import Context, Evidence
from .config import prelaunch, report_dir as default_report_dir
from .config.faults import Injector, parse_faults
from .config.launchenv import LaunchEnv
from .coordination import (ending, fate, forensics, hosting, keys, liveness, lost, progress, rails,
                           reach, records, retransmits, runtime, signing, stopped_run, stragglers)
from .coordination.protocol import Coordinator, Run, Stop
from .coordination.store import Connection, look_period, wait_key
from .errors import ConfigError
from .model import FAIL, CheckResult, Culprit, check_from_dict


def run(cfg: dict[str, Any]) -> int:
    """Run the configured checks on this rank; return the process exit status."""
    t0 = time.monotonic()
    started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    env = LaunchEnv.from_environ()
    fate.mark_kernel_log()  # an OOM kill it later names must be this run's, not a reused PID's
    faults = parse_faults(cfg["fault"], cfg["checks"])
    prelaunch.check_run(cfg, env.world_size)  # what `make smoke-local` checked before launch
    rails.check(cfg, env)  # the rail interface this rank will bind exists on its node
    checks.load_all(cfg["checks"])  # not timed: imports (a cache hit in a forked rank)
    coord_t0 = time.monotonic()
    timeout = float(cfg["timeout"])
    rdir = default_report_dir(cfg, env.run_id)
    # Every rank writes there (forensics, NCCL logs): an unwritable folder is bad input on every
    # rank before any connects; rank 0 (the writer) tests room; a rank without the id, the parent.
    known = env.rank == 0 or cfg["report_dir"] or env.run_id_shared
    outputs.check_writable(rdir if known else os.path.dirname(rdir) or ".", room=env.rank == 0)
    if known:  # a fatal signal's traceback, for blame (else once the join names the folder)
        ending.at_leave(fate.last_words(rdir, env.rank))
    if env.rank == 0:
        prelaunch.hold(rdir, env.run_id)  # one live run per folder
        outputs.prepare(rdir)  # a report left by another run must never read as this run's
        lost.clear(rdir, env.run_id)  # nor its ranks' last words
    try:
        c = Coordinator(env, cfg, lambda may_host: _store(env, timeout, may_host), _publish,
                        started_at, t0)
    except (RuntimeError, OSError) as e:  # DistStoreError/DistNetworkError are RuntimeErrors
        ending.leave(f"cannot reach the coordination store at {env.store_address} within "
                     f"{timeout} s: {(str(e) or type(e).__name__).splitlines()[0]}", code=1)
    c.locate(env, rdir)
    c.timed("load_checks_s", round(coord_t0 - t0, 4))
    c.timed("connect_store_s", round(time.monotonic() - coord_t0, 4))
    progress.RECORDER.keep = stragglers.keep_per_rank(env.world_size)
    c.liveness.start()
    reach.listen(env, c.store, cfg["diagnosis"])  # before the process group: its set-up may hang

    store = c.store
    try:
        c.enter("init", timeout)
        t = time.monotonic()
        ctx = _join(c, store, faults)
        ending.at_leave(fate.last_words(c.run.report_dir, env.rank))  # the run's folder, now known
        c.timed("rendezvous_s", round(time.monotonic() - t, 4))
        for name in cfg["checks"]:  # checks that watch the whole run start watching now
            getattr(checks.load(name), "begin", lambda _: None)(ctx)
        t = time.monotonic()
        while True:
            ctx.faults.iteration = c.iteration
            for name in cfg["checks"]:
                _run_check(c, ctx, name)
            if not _another_iteration(c, store, t):
                break
            c.next_iteration()
        c.timed("checks_s", round(time.monotonic() - t, 4))
        c.timed("iterations", c.iteration + 1)
        c.enter("finish", None)
    except Stop:
        pass
    except ConfigError as e:  # a rank of another secret or build: one line, exit 2
        print(f"ddp-smoke: error: {e}", file=sys.stderr)
        ending.leave(None, code=2)
    except Exception as e:  # noqa: BLE001 — init or harness failure on this rank
        c.abort(store, records.ErrorAbort, **records.error_detail(e))
    try:
        return _finish(c, store)
    except (RuntimeError, OSError) as e:  # the store went away: one JSON line, no traceback
        if c.liveness.leaving:
            raise
        ending.give_up(c, e)
        return 1


def _finish(c: Coordinator, store) -> int:
    """After the checks: leave an aborted run, or wait for (or write) the report. While the
    liveness thread writes the report of an aborted run, this thread keeps the heartbeat."""
    env, timeout = c.env, float(c.cfg["timeout"])
    if c.aborted(store):
        if c.claim_exit():
            ending.exit_aborted(c, store)
        c.liveness.keep_beating(store)  # the liveness thread owns the exit
        return 1
    if env.rank != 0:
        heard = ending.await_report(c, store, timeout + ending.FINAL_WAIT_S)  # or TAKE_OVER
        if heard == ending.TAKE_OVER:  # rank 0 died after the checks: write what it judged
            c.abort(store, records.StoppedAbort, why="rank 0 stopped before writing the report")
            if ending.finalize(c, store, aborted=True) is None:
                c.liveness.keep_beating(store)  # the liveness thread is writing it
            return 1
        liveness.shut_down(c)
        return 0 if heard == "pass" else 1
    written = ending.finalize(c, store, aborted=False)  # the verdict, or None
    if written is None:  # the liveness thread is finishing an abort and owns the exit
        c.liveness.keep_beating(store)
    if not env.agent_store and not env.store:  # rank 0 hosts the store: the others read first
        wait_key(store, keys.every(keys.BYE), 5.0, c.poll_max)
    liveness.shut_down(c)
    return 0 if written == "pass" else 1


def _join(c: Coordinator, store, faults: list) -> Context:
    """Identity, run id, backend and device, then the process group: this rank's Context."""
    env, cfg = c.env, c.cfg
    pick = runtime.pick_backend(cfg["backend"])
    device, device_error = _bind(pick, env)
    store.set(keys.of(keys.RANK, env.rank), json.dumps(runtime.rank_record(env, device)))
    if env.store:  # the store host's report of last resort needs the run's shape
        hosting.post_meta(store, env.world_size, cfg, os.path.abspath(c.run.report_dir),
                          c.run.started_at)
    c.arrive(store, keys.CONNECT, "every rank to connect", mine=pick)
    # the first records of the others: another secret or build stops here (exit 2)
    picks = signing.peers(store, [keys.of(keys.CONNECT, r) for r in range(env.world_size)]
                          if env.rank == 0 else [keys.of(keys.CONNECT, 0)])
    env = runtime.share_run_id(env, lambda key, value: c.tell_all(store, key, value),
                               lambda key: c.await_flag(store, key, "rank 0's run id"))
    rdir = default_report_dir(cfg, env.run_id)  # named after rank 0's id
    c.locate(env, rdir)
    backend = c.agree_backend(store, cfg["backend"], pick, picks)
    rails.bind(c, store, cfg["rails"], backend)  # gloo: each rank's rail, before the group
    runtime.nccl_log_env(backend, rdir)  # before NCCL's first init: transport check
    if device_error:
        c.abort(store, records.ErrorAbort, type="DeviceError", message=device_error,
                reason=device_error)
        raise Stop
    forensics.flight_recorder_env(rdir)  # before the process group is created
    timeout = float(cfg["timeout"]) + 15
    runtime.init_process_group(env, backend, device, runtime.process_group_store(env, timeout),
                               timeout)
    c.meet(store)
    return Context(env, backend, device, cfg, Injector(faults, env.rank, fate.drop_current), rdir,
                   cfg["storage_dir"] or os.path.join(rdir, "storage"))


def _bind(pick: str, env: LaunchEnv) -> tuple[torch.device, str | None]:
    """This rank's device, or CPU and the reason it could not have its GPU."""
    try:
        return runtime.bind_device(pick, env.local_rank), None
    except runtime.DeviceError as e:
        return torch.device("cpu"), str(e)


def _run_check(c: Coordinator, ctx: Context, name: str) -> None:
    store, timeout = c.store, ctx.timeout_s
    module = checks.load(name)  # imported already by run(): a cache hit
    c.enter(name, timeout)
    ctx.faults.check = name
    ctx.faults.before_arrival()
    c.arrive(store, keys.of(keys.ARRIVE, c.key(name)), f"every rank to arrive at {name}")
    c.enter(name, timeout)  # a fresh bound for the work and the gather
    t, held = time.monotonic(), ctx.held_s()
    progress.RECORDER.spent()  # this check's collectives only
    try:
        ctx.faults.at_start()
        progress.RECORDER.stall = ctx.faults.stalling
        data = module.run(ctx)
    except Exception as e:  # noqa: BLE001 — a check that raises fails with its rank named
        c.abort(store, records.ErrorAbort, **records.error_detail(e))
        raise Stop from None
    c.post_observation(store, name, records.Observation(
        data=data, duration_s=round(time.monotonic() - t, 6), waits=progress.RECORDER.spent(),
        cpu=ctx.cpu_pace(held), tcp=retransmits.COUNTER.take()))
    if ctx.rank == 0:
        c.post_result(store, _judge(module, name, c.gather(store, name), c))


def _judge(module, name: str, got: list[dict], c: Coordinator) -> CheckResult:
    ev = Evidence(name, [g["data"] for g in got], list(c.run.ranks), c.cfg)
    try:
        # The JSON round trip makes a figure that cannot be written fail here, named.
        result = check_from_dict(json.loads(json.dumps(dataclasses.asdict(module.judge(ev)))))
    except Exception as e:  # noqa: BLE001 — a bug in the kit, not in the cluster
        result = CheckResult(name, FAIL, summary=f"judge raised {type(e).__name__}: {e}",
                             culprits=[Culprit(None, None, traceback.format_exc(limit=3))])
    result.duration_s = max(g["duration_s"] for g in got)
    retransmits.attach(result, [g.get("tcp") for g in got], c.run.ranks, c.cfg)
    stragglers.attach(result, [g.get("waits") for g in got], ev.culprit, c.run,
                      [g.get("cpu") for g in got])
    return result


def _another_iteration(c: Coordinator, store, started: float) -> bool:
    """Repeat mode: rank 0 decides whether another pass over the checks starts (``--repeat``
    counts them, ``--duration`` watches the clock); every rank follows its decision."""
    cfg = c.cfg
    if cfg["duration"] is None:
        return c.iteration + 1 < cfg["repeat"]
    key = keys.of(keys.NEXT, c.iteration)
    if c.env.rank == 0:
        another = time.monotonic() - started < cfg["duration"]
        c.tell_all(store, key, "1" if another else "0")
        return another
    return c.await_flag(store, key, "rank 0 to decide on another iteration") == b"1"


def _publish(run: Run, store, error: dict | None, found: dict[int, dict]) -> str:
    """The writer's report, from the run it judged or adopted; returns the verdict.
    ``store``: the caller's connection (the main thread may be waiting on it, a turn away)."""
    report = stopped_run.report_of(run.stopped(), started_at=run.started_at, backend=run.backend,
                             config=run.cfg, timings=dict(run.timings), run_id=run.env.run_id,
                             error=error, forensics=found, security=signing.section(store))
    return outputs.publish(report, run.report_dir, run.env.run_id).verdict


def _store(env: LaunchEnv, timeout: float, may_host: bool):
    """The rank's one connection to the store: its threads share it in turns; records signed."""
    raw = runtime.connect_store(env, timeout, may_host=may_host)
    scope = f"ddp_smoke/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    shared = Connection(dist.PrefixStore(scope, raw), look_period(env.world_size))
    return signing.wrap(shared, scope, env)
