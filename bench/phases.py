"""Where the time to verdict goes: the worker and the bare tutorial, phase by phase.

Not a test: it prints a table. Runs ``torchrun --standalone --nproc-per-node=2`` on this file,
which then runs either the unchanged worker (``python -m ddp_smoke`` at the quick level) or
bench/tutorial.py, with marks taken around the phases: process start (from /proc), interpreter
ready, ``import torch`` done, ``init_process_group``, DDP construction (its first call imports
torch._dynamo), the harness's own ``timings`` from the report, the return of ``harness.run``
and the process exit; the parent adds torchrun's start and end. Marks wrap functions from the
outside (no change to the kit); each phase is the median over ROUNDS alternating runs of
rank 0's figure (the first process start and the last exit over both ranks for torchrun's
own share). The 1-minute load average is printed.

    .venv/bin/python bench/phases.py [ROUNDS]
"""
from __future__ import annotations

import time

T_TOP = time.time()  # noqa: E402 — first thing: the interpreter is up

import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

TORCHRUN = [".venv/bin/torchrun", "--standalone", "--nproc-per-node=2"]
_MARKS: dict[str, float] = {"top": T_TOP}


def _process_start_epoch() -> float:
    """This process's exec time, from /proc (clock ticks after boot; 10 ms resolution)."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat") as f:
        boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _wrap(owner, name: str, label: str) -> None:
    inner = getattr(owner, name)

    def wrapped(*args, **kwargs):
        _MARKS.setdefault(f"{label}_start", time.time())
        try:
            return inner(*args, **kwargs)
        finally:
            _MARKS.setdefault(f"{label}_end", time.time())
    setattr(owner, name, wrapped)


def _dump() -> None:
    _MARKS["exit"] = time.time()
    _MARKS["exec"] = _process_start_epoch()
    with open(os.environ["PHASES_TRACE"], "a") as f:
        f.write(json.dumps({"rank": int(os.environ["RANK"]), **_MARKS}) + "\n")


def traced(kind: str, argv: list[str]) -> None:
    """In a torchrun worker: import torch, set the marks, run the worker or the tutorial."""
    import torch  # noqa: F401
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    _MARKS["torch_imported"] = time.time()
    _wrap(dist, "init_process_group", "init_pg")
    _wrap(dist, "destroy_process_group", "destroy_pg")
    _wrap(DistributedDataParallel, "__init__", "ddp_init")
    if kind == "tutorial":
        import runpy
        runpy.run_path("bench/tutorial.py", run_name="__main__")
        _dump()
        return
    from ddp_smoke import cli, harness
    from ddp_smoke.coordination import ending, liveness
    _wrap(harness, "run", "harness_run")
    _wrap(ending, "finalize", "finalize")
    _wrap(liveness, "shut_down", "shutdown")
    exit_now = os._exit

    def leave(code):
        _dump()
        exit_now(code)
    os._exit = leave  # the worker leaves through os._exit: mark it first
    cli.main(argv)


PHASES = [  # (label, start mark, end mark); missing marks leave the cell empty
    ("torchrun start -> worker process", "launch", "exec_first"),
    ("process -> interpreter ready", "exec", "top"),
    ("import torch", "top", "torch_imported"),
    ("cli, harness import, config", "torch_imported", "harness_run_start"),
    ("  load_checks (imports: DDP's dynamo)", "harness_run_start", "load_checks_end"),
    ("  connect store (1 connection)", "load_checks_end", "connect_store_end"),
    ("  threads, device, identity record", "connect_store_end", "init_pg_start"),
    ("init_process_group", "init_pg_start", "init_pg_end"),
    ("  rendezvous rest (wait for all ranks)", "init_pg_end", "rendezvous_end"),
    ("  checks", "rendezvous_end", "checks_end"),
    ("  checks end -> finalize", "checks_end", "finalize_start"),
    ("  finalize (report.json, junit, summary)", "finalize_start", "finalize_end"),
    ("  finalize -> shut down", "finalize_end", "shutdown_start"),
    ("  shut down (thread joins, destroy pg)", "shutdown_start", "shutdown_end"),
    ("  shut down -> harness.run returns", "shutdown_end", "harness_run_end"),
    ("DDP construction (first: import dynamo)", "ddp_init_start", "ddp_init_end"),
    ("tutorial: DDP step, gather, print", "ddp_init_end", "destroy_pg_start"),
    ("destroy_process_group", "destroy_pg_start", "destroy_pg_end"),
    ("last mark -> process exit", "last", "exit"),
    ("last exit -> torchrun returns", "exit_last", "done"),
]


def _with_derived(ranks: list[dict], launch: float, done: float, report: dict | None) -> dict:
    m = dict(next(r for r in ranks if r["rank"] == 0))
    m.update(launch=launch, done=done, exec_first=min(r["exec"] for r in ranks),
             exit_last=max(r["exit"] for r in ranks))
    if report:  # the harness's own timings, laid out from the start of harness.run
        t = report["timings"]
        m["load_checks_end"] = m["harness_run_start"] + t["load_checks_s"]
        m["connect_store_end"] = m["load_checks_end"] + t["connect_store_s"]
        m["rendezvous_end"] = m["init_pg_start"] + t["rendezvous_s"]  # it starts with init
        m["checks_end"] = m["rendezvous_end"] + t["checks_s"]
    m["last"] = max(v for k, v in m.items() if k not in ("exit", "done", "exit_last"))
    return m


def _run(kind: str, root: str, i: int) -> dict:
    trace = os.path.join(root, f"{kind}-{i}.jsonl")
    rdir = os.path.join(root, f"report-{i}")
    args = [] if kind == "tutorial" else ["--", "--level", "quick", "--backend", "gloo",
                                          "--report-dir", rdir]
    launch = time.time()
    p = subprocess.run(TORCHRUN + [__file__, f"--{kind}", *args], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PHASES_TRACE": trace})
    done = time.time()
    if p.returncode:  # a failed run is reported and left out, the others still count
        tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        print(f"# {kind} run {i} failed (exit {p.returncode}): {tail[:200]}", flush=True)
        return None
    with open(trace) as f:
        ranks = [json.loads(line) for line in f]
    report = None
    if kind == "worker":
        with open(os.path.join(rdir, "report.json")) as f:
            report = json.load(f)
    return _with_derived(ranks, launch, done, report)


def main(rounds: int) -> None:
    load = os.getloadavg()[0]
    runs: dict[str, list[dict]] = {"tutorial": [], "worker": []}
    with tempfile.TemporaryDirectory(prefix="ddp-smoke-phases-") as root:
        for i in range(rounds):
            for kind in (("tutorial", "worker") if i % 2 == 0 else ("worker", "tutorial")):
                got = _run(kind, root, i)
                if got:
                    runs[kind].append(got)
    print(f"# where the time goes (s, median of {rounds} alternating runs, rank 0; 2 gloo ranks; "
          f"worker at --level quick); load (1 min) {load:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after")
    print(f"# {'phase':<42} {'tutorial':>9} {'worker':>9}")
    for label, a, b in PHASES + [("total (torchrun wall)", "launch", "done")]:
        cells = []
        for kind in ("tutorial", "worker"):
            if kind == "worker" and label.startswith("tutorial"):
                cells.append(f"{'-':>9}")
                continue
            values = [m[b] - m[a] for m in runs[kind] if a in m and b in m]
            cells.append(f"{statistics.median(values):>9.3f}" if values else f"{'-':>9}")
        print(f"  {label:<42} {cells[0]} {cells[1]}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("--tutorial", "--worker"):
        traced(sys.argv[1][2:], sys.argv[3:] if sys.argv[2:3] == ["--"] else sys.argv[2:])
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
