"""Run one cell for real and compare what happened with what is right.

The cell's launcher starts the worker with the campaign's configuration (checks long enough
to strike inside, a short deadline); the runner watches the run's own coordination store until
the cell's stage is reached (the ranks' arrival there, or for the join a rank's identity),
strikes with the real fault (a signal by PID, a cgroup limit, tc or iptables in the nodes'
namespaces, the report folder filled or made read-only; the injected kinds are given to the
worker as ``--fault`` at the start), waits for the launcher to end by itself within the
cell's bound, undoes the fault, and reads what the run left: the report (or its JSON line on
stderr), each rank's ``lost/`` record, the exit status, the time from the fault to the report.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import time
from pathlib import Path

from ddp_smoke.outputs import REPORT_FOLLOWS
from tests.campaign import launchers, matrix
from tests.checks import health_replay
from tests.campaign.matrix import BAD_INPUT, FAIL, LOST, PASS, Cell, Expect
from tests.launch import paced
from tests.sandbox import faults

CONFIG = """\
# The fault campaign's worker configuration: every check long enough to strike inside.
sampler_epochs: {{samples: 20000, epochs: 4}}
collectives: {{sizes_bytes: [256, 4200000{large}]}}
storage: {{file_bytes: 8388608}}
bandwidth: {{max_bytes_cpu: 4194304, pair_bytes_cpu: 1048576, pair_rounds: 3}}
compute: {{blocks: {blocks}, block_s: 0.1}}
health: {{sdc_size_cpu: 1024, sdc_repeats: 10}}
{rails}"""
# The collectives' largest size, there to strike inside that check, and only there: before
# another check's strike it is only time the deadline must cover (beside the Slurm sandbox's
# start, 3 ranks' collectives took over the 15 s deadline, 4.4 s alone: an oom cell at
# bandwidth never reached bandwidth). A slow node or link carries every later byte at the
# fault's rate (200 mbit) and needs no strike inside: with it the check outlasted the
# deadline (still inside reduce_scatter #36, 16.8 MB, at 15 s).
LARGE_COLLECTIVE = ", 16800000"
_SIGNALS = {"sigkill": signal.SIGKILL, "sigsegv": signal.SIGSEGV, "sigabrt": signal.SIGABRT,
            "sigterm": signal.SIGTERM, "sigstop": signal.SIGSTOP}
_SRUN_LABEL = re.compile(r"^\[[^\]\s]+\]:")  # srun --label: "[node:task]:" before each line
_INJECT = {"exit": "crash", "hang": "hang", "stall": "stall", "sdc": "sdc"}
LOGGED = "ddp-smoke-report.json: "  # docker/pod.sh's log line of the report


@dataclasses.dataclass
class Got:
    verdict: str
    culprits: frozenset
    text: str           # the culprits' reasons (or the output, with no report)
    writer: str | None
    status: int | None
    report_s: float | None  # fault to report (or the last lost record)
    end_s: float            # fault to the launcher's end
    note: str = ""
    lost: int = 0           # ranks that left their word in lost/
    paced: frozenset = frozenset()  # named only by checks that failed on pace alone


def _to_compare(g: Got, cell: Cell) -> tuple[str, frozenset]:
    """The verdict and culprits to compare. A check failed on pace alone (every culprit a
    rank the others waited for: tests.launch.paced) in a cell whose fault is not about pace
    is what these two shared cores' scheduler did beside another test (measured: a healthy
    rank 2 named for 0.6 s of waits before rank 1's OOM kill): left out. For the slow kinds
    pace is the finding."""
    if cell.kind in matrix.SLOW:
        return g.verdict, g.culprits | g.paced
    if g.verdict == FAIL and not g.culprits and g.paced:
        return PASS, g.culprits
    return g.verdict, g.culprits


@dataclasses.dataclass
class Row:
    cell: Cell
    expect: Expect
    got: Got
    wall_s: float

    @property
    def problems(self) -> list[str]:
        e, g, out = self.expect, self.got, []
        if g.note.startswith("error"):
            return [g.note]
        verdict, culprits = _to_compare(g, self.cell)
        if verdict != e.verdict:
            out.append(f"verdict {verdict}, expected {e.verdict}")
        if culprits != e.culprits:
            out.append(f"culprits {_show(culprits)}, expected {_show(e.culprits)}")
        out += [f"no {w!r}" for w in e.words if w not in g.text]
        if e.verdict == LOST and g.lost != e.lost:
            out.append(f"{g.lost} ranks left their word in lost/, expected {e.lost}")
        if e.writers and g.writer not in e.writers:
            out.append(f"written by {g.writer}, expected {'/'.join(sorted(e.writers))}")
        exits = e.exits(self.cell.launcher)
        if verdict != g.verdict:  # a pass but for pace: the kit's status says fail
            exits |= dataclasses.replace(e, verdict=g.verdict).exits(self.cell.launcher)
        if e.ends and g.status not in exits:
            out.append(f"exit {g.status}, expected {sorted(exits)}")
        bound = matrix.report_bound_s(self.cell)
        if e.verdict in (FAIL, LOST) and (g.report_s is None or g.report_s > bound):
            out.append(f"report after {g.report_s} s, bound {bound:g} s")
        if e.ends and g.end_s > matrix.END_BOUND_S:
            out.append(f"launcher ended after {g.end_s:.0f} s, bound {matrix.END_BOUND_S:g} s")
        return out

    @property
    def ok(self) -> bool:
        return not self.problems


def _show(culprits: frozenset) -> str:
    parts = []
    for c in sorted(culprits, key=str):
        parts.append({"rank": lambda: f"rank {c[1]}", "link": lambda: f"link {c[1]}-{c[2]}",
                      "host": lambda: f"node {c[1]}" if isinstance(c[1], int) else
                      f"host {c[1]}", "job": lambda: "the job"}[c[0]]())
    return "{" + ", ".join(parts) + "}"


def compute_blocks(cell: Cell) -> int:
    """Twenty 0.1 s blocks of compute for a rank with a core of its own, fewer where a node's
    ranks share cores: the node's compute lasts about 2 s of wall time alone either way (long
    enough to strike inside). Twenty blocks for each of four ranks on two cores took 4.3 s
    alone and over the 15 s deadline under CI's load (gpu_xid79.store_node.health.image.1x4:
    every rank "did not finish compute within 15.0 s"). Cores as the compute check counts
    them (its affinity mask)."""
    from ddp_smoke.checks.api import usable_cores  # (imports torch: not at the module's import)
    return max(5, round(20 * min(1.0, usable_cores() / cell.per_node)))


def worker_args(cell: Cell, config: Path) -> list[str]:
    args = ["--backend", "gloo", "--level", "quick", "--timeout", f"{matrix.TIMEOUT_S:g}",
            "--config", str(config)]
    if cell.kind in _INJECT:
        args += ["--fault", f"{cell.rank}:{_INJECT[cell.kind]}@{cell.stage}"]
    if cell.nodes > 1 and cell.per_node > 1:  # the protocol of a large run (auto: > 2,500)
        args += ["--node-speaker", "on"]
    return args


def run(cell: Cell, parts: launchers.Parts, work: Path) -> Row:
    """Run ``cell`` for real in ``work`` (a fresh folder); never raises for the run's own
    failures (those are the row's)."""
    t0 = time.monotonic()
    expect = matrix.expect(cell)
    work.mkdir(parents=True)
    config = work / "campaign.yaml"
    config.write_text(CONFIG.format(
        large=LARGE_COLLECTIVE if cell.stage == "collectives" and
        cell.kind not in ("slow_node", "slow_link", "slow_rail") else "",
        rails="rails: [eth0, eth1]\n" if cell.kind in matrix.RAILS else "",
        blocks=compute_blocks(cell)))
    marker = f"cmp{os.getpid()}-{int(time.time() * 1000) % 10**8}"
    dup = (cell.peer_node, cell.node) if cell.kind == "dup_hostname" else None
    if dup and dup[0] > dup[1]:
        dup = (dup[1], dup[0])
    with contextlib.ExitStack() as undo:
        folder = None
        if cell.kind in matrix.FOLDER:
            folder = undo.enter_context(faults.SmallFolder(work / "reports"))
            if cell.stage == "join":  # the launchers' report folders exist; nothing more fits
                for sub in ("report", "reports"):
                    (folder.path / sub).mkdir(mode=0o777)
                    os.chmod(folder.path / sub, 0o1777)
                _hit_folder(cell, folder)
        def before(hosts):  # a node's interface named otherwise: before the launcher looks
            if cell.kind == "missing_interface":
                undo.enter_context(faults.renamed_interface(hosts[cell.node]))

        skewed = undo.enter_context(faults.other_torch(work / "other-torch")) \
            if cell.kind == "torch_skew" else None

        def node_env(node: int) -> dict:  # the fault's node reads a recorded node's GPUs,
            site = matrix.SITE_ENV.get(cell.kind, {})  # or runs another torch
            if cell.kind in matrix.REPLAYED and node == cell.node:
                recording = health_replay.DATA / matrix.REPLAYED[cell.kind].file
                return {**site, "DDP_SMOKE_HEALTH_REPLAY": str(recording)}
            if skewed and node == cell.node:
                return {**site, "PYTHONPATH": str(skewed)}
            return site
        try:
            launch = launchers.start(cell, parts, work, folder.path if folder else work,
                                     worker_args(cell, config), marker, dup, before, node_env)
        except Exception as e:  # noqa: BLE001 — a launcher that cannot start is this row's
            return Row(cell, expect, Got("none", frozenset(), "", None, None, None, 0.0,
                                         f"error: could not start: {e}"), time.monotonic() - t0)
        undo.callback(launch.stop)
        if getattr(launch, "net", None) is not None:
            undo.callback(launch.net.down)
        started = time.monotonic()
        try:
            struck = _strike(cell, launch, parts, undo, folder)
        except Exception as e:  # noqa: BLE001
            struck, note = None, f"error: strike: {type(e).__name__}: {e}"
        else:
            note = ""
        at = struck or started
        report_at = _wait_end(launch, at, expect.ends)
        end_s = time.monotonic() - at
        got = _read(cell, launch, at, report_at, end_s)
        got.note = note or got.note
        left = launch.workers()
        if launch.running() or left:
            got.note = got.note or (f"still running after {end_s:.0f} s: stopped; ranks "
                                    f"{_where(left)}")
    return Row(cell, expect, got, time.monotonic() - t0)


def _hit_folder(cell: Cell, folder) -> None:
    if cell.kind == "disk_full":
        folder.fill()
    else:
        folder.read_only()


def _strike(cell: Cell, launch, parts, undo: contextlib.ExitStack, folder) -> float | None:
    """Wait for the cell's stage, then strike; the moment struck (None: nothing to strike
    after the start, the fault was in place before it)."""
    k = cell.kind
    if k in _INJECT and cell.stage != "join":
        return _arrived(cell, launch)
    if k in _INJECT or k in ("dup_hostname", "missing_interface", "torch_skew",
                             *matrix.REPLAYED) or (
            k in matrix.FOLDER and cell.stage == "join"):
        return None
    network = k in matrix.NETWORK
    if network and cell.stage == "join":
        _network(cell, launch, undo)  # in place before any rank connects
        return None
    end = time.monotonic() + matrix.STRIKE_WAIT_S
    # A lasting fault (a folder, the network, a quota) is in place from the stage's start: at
    # the first arrival there, before any rank's work in it. A sudden one strikes inside the
    # stage: once every rank has arrived and the work begins.
    lasting = k in matrix.FOLDER or network or k == "slow_rank"
    stage = cell.stage
    if k in matrix.FOLDER and stage == "storage":
        # its writes to the folder take milliseconds, less than one poll (a read-only folder
        # came after them: read_only.rank0.storage.submit.1x4 passed); in place from the
        # check before it instead, which writes nothing there
        stage = matrix.STAGES[matrix.STAGES.index(stage) - 1]
    # the store killed at join: once every rank connected to it (before, a rank still
    # starting finds no store at all: another fault, which leaves no word in lost/)
    key = ("connect/all" if stage == "join" and k == "store_killed" else
           f"rank/{cell.rank}" if stage == "join" else
           f"arrive/{stage}/0/{cell.rank}" if lasting else f"arrive/{stage}/0/all")
    worker = {}  # the struck rank's process, for the kinds that strike it

    def found() -> bool:
        if k == "store_killed" or network or k in matrix.FOLDER:
            return True
        worker["pid"] = launch.workers().get(cell.rank)
        return worker["pid"] is not None
    if _reached(launch, key, end, found) is None:
        raise RuntimeError(f"the run never reached {cell.stage} (waited for {key})")
    pid = worker.get("pid")
    if k in _SIGNALS:
        os.kill(pid, _SIGNALS[k])
    elif k == "oom":
        undo.enter_context(faults.MemoryLimit(pid, f"ddp-campaign-oom-{pid}"))
    elif k == "slow_rank" and launch.containers and cell.per_node == 1:
        # the pod's CPU limit, as Kubernetes sets it: on the pod's own cgroup, which its rank
        # reads (a cgroup made outside the pod is not in its cgroup namespace)
        launch.containers[cell.node].c.engine.docker("update", "--cpus", "0.15",
                                                     launch.containers[cell.node].c.name)
    elif k == "slow_rank":
        quota = undo.enter_context(faults.CpuQuota(0.15, f"ddp-campaign-cpu-{pid}"))
        quota.add(pid)
    elif k == "store_killed":
        holder = launch.store_pid()
        if holder is None:
            raise RuntimeError("no process holds the store")
        os.kill(holder, signal.SIGKILL)
    elif k in matrix.FOLDER:
        _hit_folder(cell, folder)
    elif network:
        _network(cell, launch, undo)
    return time.monotonic()


def _arrived(cell: Cell, launch) -> float | None:
    """An injected fault strikes inside the worker, at its stage: the moment another rank
    arrived there (the faulty one may never: a hang), not the launch, whose start and checks
    before the stage are no part of the fault's bound (a stall in a Slurm run's bandwidth
    check measured 39-42 s from the launch on a slow machine, against a 35 s bound). None
    when no other rank arrived before the run ended: then the launch's moment."""
    key = f"arrive/{cell.stage}/0/{(cell.rank + 1) % cell.world}"
    return _reached(launch, key, time.monotonic() + matrix.STRIKE_WAIT_S)


def _reached(launch, key: str, end: float, found=lambda: True) -> float | None:
    """The moment the run posted ``key`` with ``found()`` true, polled every 20 ms until
    ``end`` (monotonic) while the launch runs; None if it never did."""
    while time.monotonic() <= end and launch.running():
        if found() and launch.has(key):
            return time.monotonic()
        time.sleep(0.02)
    return None


def _network(cell: Cell, launch, undo: contextlib.ExitStack) -> None:
    a, b = launch.hosts[cell.node], launch.hosts[cell.peer_node]
    subnet = {"10.231.9": launchers.HOSTS_SUBNET, "10.231.10": launchers.SLURM_SUBNET,
              "10.231.11": launchers.PODS_SUBNET,
              "10.231.12": launchers.DUP_SUBNET}[a.addr.rsplit(".", 1)[0]]
    made = {"slow_link": lambda: faults.slow_link(a, b), "slow_node": lambda: faults.slow_node(a),
            "dead_link": lambda: faults.cut_link(a, b),
            "dead_node": lambda: faults.cut_node(a, subnet),
            "blackhole": lambda: faults.blackhole(a, b),
            "lossy_link": lambda: faults.lossy_link(a, b, 0.03),
            "lossy_one_way": lambda: faults.lossy_link(a, b, 0.03, both_ways=False),
            "flapping_link": lambda: faults.flapping_link(a, b),
            "slow_rail": lambda: faults.slow_node(a, rail=1),
            "dead_rail": lambda: faults.dead_interface(a, rail=1)}
    if cell.kind in made:
        undo.enter_context(made[cell.kind]())


def _wait_end(launch, at: float, ends: bool = True) -> float | None:
    """Wait for the launcher to end by itself (END_BOUND_S at most; for one expected not to,
    until its workers are gone and the report is there); when the report appeared
    (monotonic), or None."""
    report, seen = launch.report_dir / "report.json", None
    end = at + matrix.END_BOUND_S
    while time.monotonic() < end:
        if seen is None and report.exists():
            seen = time.monotonic()
        # the launcher's end, and its workers' (a killed launcher leaves them orphaned: they
        # still have their word to leave). Polled every round: a group of node launchers
        # stops the others once one failed, as srun does, only when polled.
        running = launch.running()
        if not launch.workers() and (not running or (not ends and seen)):
            break
        time.sleep(0.2)
    if seen is None and report.exists():
        seen = at + max(0.0, report.stat().st_mtime - (time.time() - (time.monotonic() - at)))
    return seen


def _where(workers: dict[int, int]) -> str:
    """rank: pid, state and kernel wait channel of each worker still alive (a hang's clue)."""
    out = []
    for rank, pid in sorted(workers.items()):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            wchan = Path(f"/proc/{pid}/wchan").read_text()
        except OSError:
            continue
        out.append(f"{rank}: pid {pid} {state} {wchan}")
    return ", ".join(out) or "none"


def _read(cell: Cell, launch, at: float, report_at: float | None, end_s: float) -> Got:
    if cell.launcher in matrix.NODE_TIER:
        return _read_node_tier(launch, at, end_s)
    out = launch.output()
    status = _status(cell, launch, out)
    report, writer = None, None
    path = launch.report_dir / "report.json"
    if launch.logged:  # as its users read it: the log line of the pod that holds it
        for part in out.split(LOGGED)[1:]:
            with contextlib.suppress(ValueError):  # (docker's log splits a line every 16 KiB)
                report = json.JSONDecoder().raw_decode("".join(part.splitlines()))[0]
                break
    elif path.exists():
        with contextlib.suppress(ValueError, OSError):
            report = json.loads(path.read_text())
    for part in out.split(REPORT_FOLLOWS)[1:] if report is None else []:
        # each copy in turn: a rank's own, cut where torchrun's tee interleaved other lines,
        # and the launcher's whole one after the run (the Slurm template's)
        tail = [_SRUN_LABEL.sub("", ln) for ln in part.splitlines()]
        first = next((i for i, ln in enumerate(tail) if ln.startswith("{")), None)
        if first is not None:  # docker's log splits a line every 16 KiB: joined again (a
            with contextlib.suppress(ValueError):  # JSON line holds no raw newline)
                report = json.JSONDecoder().raw_decode("".join(tail[first:]))[0]
                writer, report_at = "stderr", report_at or at
                break
    lost = sorted((launch.report_dir / "lost").glob("*.json")) \
        if (launch.report_dir / "lost").is_dir() else []
    report_s = None if report_at is None else round(report_at - at, 1)
    said = []  # the folder took no report: the error line before its JSON line says why
    if writer == "stderr":
        said = out.split(REPORT_FOLLOWS, 1)[0].rstrip().splitlines()[-1:]
    by_launcher = bool(report and str(report.get("written_by")).endswith(" launcher"))
    if report is None or (by_launcher and lost):  # the launcher's report quotes lost/
        if lost:
            last = max(p.stat().st_mtime for p in lost)
            report_s = round(end_s - (time.time() - last), 1)
            said = " | ".join(p.read_text(errors="replace")[:400] for p in lost)
            return Got(LOST, frozenset(), f"{said} | {out[-2000:]}", None, status, report_s,
                       end_s, f"{len(lost)} lost records", len(lost))
        verdict = BAD_INPUT if "ddp-smoke: error:" in out else "none"
        # the kit's own lines first, wherever they are (each pod's log, in node order), then
        # the output's end
        said = "\n".join(ln for ln in out.splitlines() if ln.startswith("ddp-smoke"))
        return Got(verdict, frozenset(), f"{said[-3000:]}\n{out[-2000:]}", None, status, None,
                   end_s)
    culprits, slow, reasons = set(), set(), []
    # a host by its node number (machines' names differ): a node where no rank ran by name
    nodes = {i.get("host"): i.get("group_rank") for i in report.get("ranks") or []
             if i.get("host") and i.get("group_rank") is not None} or {
                 name: n for n, name in enumerate(launch.names or [h.name for h in launch.hosts])}
    on_pace = paced(report)
    for check in report.get("checks", []):
        if check.get("status") != "fail":
            continue
        named = slow if check["name"] in on_pace else culprits
        for k in check.get("culprits", []):
            reasons.append(k.get("reason", ""))
            if k.get("ranks"):
                named.add(("link", *sorted(k["ranks"])[:2]))
            elif k.get("rank") is not None:
                named.add(("rank", k["rank"]))
            elif k.get("host"):  # a node's own finding, or one the launcher named
                named.add(("host", nodes.get(k["host"], k["host"])))
            else:
                named.add(("job",))
    writer = writer or report.get("written_by") or "rank 0"
    return Got(report.get("verdict", "none"), frozenset(culprits), " | ".join(
        reasons + said), writer, status, report_s, end_s, paced=frozenset(slow))


def _read_node_tier(launch, at: float, end_s: float) -> Got:
    """The node tier's outcome is the cluster's (``launch.findings()``: the nodes the kit
    drained under Slurm, or the DaemonSet labelled fail), as hosts by node index, with their
    reasons, from the fault to the last word seen; none when no node said anything."""
    failed, seen, note = launch.findings()
    status = launch.status()
    verdict = "none" if status is None else FAIL if failed else PASS
    report_s = round(max(seen) - at, 1) if seen else None
    text = " | ".join(failed.values()) or launch.output()[-2000:]
    return Got(verdict, frozenset(("host", i) for i in failed), text, "node-check", status,
               report_s, end_s, note)


def _status(cell: Cell, launch, out: str) -> int | None:
    status = launch.status()
    if cell.launcher == "smoke_local" and status not in (None, 0):
        m = re.findall(r"\] Error (\d+)", out)  # make's line names the kit's own status
        if m:
            return int(m[-1])
        if "Killed" in out:
            return -9
    return status
