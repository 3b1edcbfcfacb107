"""The launcher's report, for runs whose worker never started (or never wrote one).

When preflight fails on a node, or srun cannot launch a task, or torchrun dies in the
rendezvous, no rank ever writes ``report.json``: the evidence is in the launcher's hands —
srun's per-node launch errors, each node's stderr, torchrun's logs, the preflight records.
This module reads them and writes a report of the same shape as the worker's (``Report``:
verdict fail, one failed check ``preflight`` or ``launch``, one culprit per node that did not
make it, ``rank`` null, ``host`` the launcher's node name, ``reason`` one line, never a
stack), then prints the job log's last line, which always names a verdict and its culprits.

    python -m ddp_smoke launch-report --stage preflight --report-dir DIR --nodes "a b c" \\
        [--launch-log FILE] [--exit N]
    python -m ddp_smoke launch-report --stage run --report-dir DIR --nodes "a b c" …

Files read, all under the report folder ``DIR`` (the sbatch and the image's entrypoint put
them there): ``preflight/<node>.json`` (records of this run id only), ``launch/<node>.<stage>.err``
(what the node's task printed on stderr), ``torchrun/<node>/…/attempt_0/<local rank>/`` (a
worker started there) and the launcher's own stderr given as ``--launch-log`` (srun's
``Task launch … failed on node X: …``).

Exit status: 0 when the stage passed (preflight: every node ok; run: the worker's verdict
pass), 1 on a failed stage or a report the folder could not take (its writer put it on its
stderr), 2 when the worker refused its input (its one-line error).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
from datetime import datetime, timezone

from .. import __version__
from ..coordination import lost
from ..model import FAIL, CheckResult, Culprit, Report
from . import REPORT_FOLLOWS, publish, report_in_stderr, unwritten
from .report import json_line

STAGES = ("preflight", "run")
CHECK = {"preflight": "preflight", "run": "launch"}
REASON_CHARS = 300
SHOWN = 8  # culprits on the log's last line; a 512-node failure stays one readable line
_EXCEPTION = re.compile(r"^\s*(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Interrupt|Exit)"
                        r"(?::\s|$)")
_CXX_NOTE = re.compile(r"^\[[WI]\d{4} ")  # torch's C++ log: [W1130 23:28:27.71 file.cpp:207]
_SHELL = re.compile(r"No such file or directory|command not found|Permission denied|"
                    r"No module named")
_REFUSED = re.compile(r"^rendezvous: cannot reach .*refused")
_STORE_UNREACHED = re.compile(r"trying to connect to|failed to connect|connection to the C10d "
                              r"store has failed|Connection refused", re.I)
_HOST_WAITED = re.compile(r"RendezvousTimeoutError")  # the c10d host saw too few nodes join
_PREFLIGHT_FAIL = re.compile(r"^ddp-smoke preflight: \S+ FAIL")
_LAUNCH_FAILED = re.compile(r"failed on node (\S+?):\s*(.*)")
_TASK_ENDED = re.compile(r"^srun: error: (\S+?): tasks? [\d,-]+: (.*)")
_STOPPED = re.compile(r"exit code (?:130|137|143)\b")  # 128 + SIGINT, SIGKILL, SIGTERM


def error_line(lines: list[str], strict: bool = False) -> str:
    """The one line that says what went wrong: the kit's own (``ddp-smoke: error:``, a
    preflight FAIL), else a Python exception's line (``ModuleNotFoundError: …``, the first of a
    chain: the cause), else an ``error:`` line or a shell's (``No such file …``), else (unless
    ``strict``) the last line. Never a stack frame, never a warning or info line of torch's
    C++ log (``[W1130 …]``: a node that merely waited prints those too)."""
    lines = [x.strip() for x in lines if x.strip() and not _CXX_NOTE.match(x.strip())]
    for test in (lambda x: x.startswith("ddp-smoke: error:") or bool(_PREFLIGHT_FAIL.match(x)),
                 lambda x: bool(_EXCEPTION.match(x)),
                 lambda x: "error:" in x.lower() or bool(_SHELL.search(x))):
        hit = next((x for x in lines if test(x)), None)
        if hit:
            return _short(hit)
    return _short(lines[-1]) if lines and not strict else ""


def failed_preflight(line: str) -> bool:
    """The line is a node's preflight FAIL line."""
    return bool(_PREFLIGHT_FAIL.match(line))


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= REASON_CHARS else text[:REASON_CHARS - 1] + "…"


def launch_errors(text: str) -> dict[str, str]:
    """srun's per-node errors, first one per node: a task that could not be launched, or
    one that exited with a status of its own. A task ended by a signal (``Terminated``,
    ``Killed``, or a shell's status 128+N for SIGINT, SIGKILL, SIGTERM: the task's bash saw its
    child killed) is left out: srun ends every task once one failed, and those are victims."""
    found: dict[str, str] = {}
    for raw in text.splitlines():
        m = _LAUNCH_FAILED.search(raw)
        if m:
            found.setdefault(m.group(1), f"task launch failed: {m.group(2).strip()}")
    for raw in text.splitlines():
        m = _TASK_ENDED.match(raw.strip())
        if m and m.group(1) not in found and m.group(2).startswith("Exited with") \
                and not _STOPPED.search(m.group(2)):
            found[m.group(1)] = f"srun: {m.group(2).strip()}"
    return found


def read_records(report_dir: str, run_id: str | None) -> dict[str, dict]:
    """This run's preflight records by node (another run's are ignored)."""
    out = {}
    for path in sorted(glob.glob(os.path.join(report_dir, "preflight", "*.json"))):
        try:
            with open(path) as f:
                record = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and (not run_id or record.get("run_id") == run_id):
            out[str(record.get("node"))] = record
    return out


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def node_stderr(report_dir: str, node: str, stage: str) -> str:
    return _read(os.path.join(report_dir, "launch", f"{node}.{stage}.err"))


def worker_started(report_dir: str, node: str) -> bool:
    """torchrun made a worker folder on that node (``--log-dir`` per node)."""
    return bool(glob.glob(os.path.join(report_dir, "torchrun", node, "*", "attempt_*", "*")))


def preflight_culprits(nodes: list[str], records: dict[str, dict], launch: dict[str, str],
                       report_dir: str) -> tuple[list[Culprit], list[str]]:
    """One culprit per node that did not pass preflight, with its one-line reason; and the
    victims: nodes with no record and no error of their own while another node failed
    (srun ends every task once one fails: theirs were stopped, not broken)."""
    host_record = next((r for r in records.values() if "joined" in r), None)
    said_hello = set((host_record or {}).get("joined", {}).values())
    # nodes the host heard fail (their hellos said why, or its path probe did) that the
    # launcher does not know (the image's: each pod knows itself)
    heard = {n: why for c in (host_record or {}).get("checks", []) if c.get("name") == "joined"
             for n, why in c.get("nodes", {}).items() if n not in nodes}
    culprits, found = [], {}
    for node in [*nodes, *heard]:
        record = records.get(node)
        if record is not None:
            failed = [c for c in record.get("checks", []) if not c.get("ok")
                      and c.get("name") != "joined"]  # the host's wait names the others
            own = [c for c in failed if "nodes" not in c]
            if own:
                reason = "; ".join(f"{c['name']}: {c['detail']}" for c in own)
                culprits.append(Culprit(None, node, _short(reason)))
            # the host's comparison of every node's interface MTU names those nodes
            culprits += [Culprit(None, n, _short(f"{c['name']}: {c['detail']}"))
                         for c in failed if "nodes" in c for n in c["nodes"]]
            continue
        if node in heard:  # its record is in its own folder: the host's word on it
            culprits.append(Culprit(None, node, _short(f"rendezvous host: {heard[node]}")))
            continue
        found[node] = _own_error(node, launch, node_stderr(report_dir, node, "preflight"))
    # Refused means nothing listened there: the host's preflight never came up.
    culprits, silent, blamed = _blame(nodes, culprits, found, "", _REFUSED, "never listened "
                                      "on the rendezvous port within the preflight's time: "
                                      "{n} node(s) were refused")
    if blamed:
        return blamed
    for node in silent:
        why = "no preflight record: the task never ran or was killed"
        if host_record is not None and node not in said_hello:
            why += "; it never said hello to the rendezvous host"
        culprits.append(Culprit(None, node, why))
    if not culprits and host_record is not None and not host_record.get("ok"):
        # Every node passed its own checks but the host heard from too few (Kubernetes: a
        # pod never left Pending): the host's line names the node ranks that never joined.
        culprits.append(Culprit(None, None, _short(host_record.get("reason", ""))))
    return culprits, []


def _own_error(node: str, launch: dict[str, str], stderr: str, strict: bool = False) -> str:
    """A node's own evidence: srun could not launch it, else the first error it printed,
    else srun's word that it exited with a status."""
    launched = launch.get(node, "")
    own = error_line(stderr.splitlines(), strict=strict)
    return launched if "launch failed" in launched else (own or launched)


def _blame(nodes: list[str], culprits: list[Culprit], found: dict[str, str], prefix: str,
           pattern, what: str):
    """(culprits, silent nodes, verdict): the nodes with an error of their own (``found``:
    node -> its error, "" when it said nothing) are culprits, and the verdict is them with the
    silent ones as victims; None when no node said anything. But when every failing node only
    failed to reach the rendezvous host, and the host (the launchers make the first node the
    store's) said nothing, or only that the others never joined it, the host was late (an image
    still being pulled) or never ran."""
    culprits = culprits + [Culprit(None, n, _short(prefix + why)) for n, why in found.items()
                           if why]
    silent = [n for n, why in found.items() if not why]
    host = nodes[0] if nodes else None
    # The host that came up after the others had given up then timed out waiting for them:
    # its only word is that nobody joined, which the others' errors already explain.
    waited = [k for k in culprits if k.host == host and _HOST_WAITED.search(k.reason)]
    others = [k for k in culprits if k not in waited]
    unreached = all(pattern.search(k.reason) for k in others)  # only failed to reach the host
    if others and waited and not unreached:
        # the others failed of their own accord: the host's timeout is their consequence
        return others, silent, (others, silent + [f"{host}: {waited[0].reason}"])
    if not others or (host not in silent and not waited) or not unreached:
        return culprits, silent, (culprits, silent) if culprits else None
    reason = (f"rendezvous host: {what.format(n=len(others))}; it started late or not at all"
              + (" (its own torchrun then timed out waiting for them)" if waited else ""))
    return culprits, silent, ([Culprit(None, host, reason)],
                              [f"{k.host}: {k.reason}" for k in others] +
                              [n for n in silent if n != host])


def run_culprits(nodes: list[str], launch: dict[str, str], report_dir: str,
                 exit_code: int | None) -> tuple[list[Culprit], list[str]]:
    """The nodes where no worker started, with the first error each printed (nodes with
    nothing of their own to say are victims when another node did); where all started,
    those whose worker printed an error; else one culprit naming no node."""
    found = {node: _own_error(node, launch, node_stderr(report_dir, node, "run"), strict=True)
             for node in nodes if not worker_started(report_dir, node)}
    culprits, silent, blamed = _blame(nodes, [], found, "no worker started: ", _STORE_UNREACHED,
                                      "its c10d store never answered: {n} node(s) could not "
                                      "connect to it")
    if blamed:
        return blamed
    culprits = [Culprit(None, n, "no worker started and torchrun printed nothing")
                for n in silent]
    for node in nodes if not culprits else []:
        text = "".join(_read(p) for p in sorted(glob.glob(
            os.path.join(report_dir, "torchrun", node, "*", "attempt_*", "*", "stderr.log"))))
        why = error_line([x for x in text.splitlines() if _EXCEPTION.match(x.split("]:", 1)[-1])])
        if why:
            culprits.append(Culprit(None, node, _short(f"worker ended without a report: {why}")))
    return culprits or [Culprit(None, None, f"workers started on every node but no report was "
                                            f"written (launcher exit {exit_code}); read the "
                                            "job's log")], []


def lost_culprits(records: dict[int, dict]) -> tuple[list[Culprit], list[str]]:
    """Workers ran, but the coordination store went silent and no rank could write (the node
    hosting it died with rank 0): one culprit per node whose ranks left no word in ``lost/``
    (they, or the store's node, are gone); the ranks that did leave one are victims."""
    first = records[min(records)]
    world = int(first.get("world_size") or 0)
    hosts = lost.hosts(records)
    stages = "/".join(sorted({str(r.get("stage")) for r in records.values()}))
    gone = (f"went silent with the coordination store at {first.get('store', '?')} during "
            f"{stages}")
    silent = [r for r in range(world) if r not in records]
    by_node: dict[str | None, list[int]] = {}
    for rank in silent:
        by_node.setdefault(hosts.get(rank), []).append(rank)
    culprits = [Culprit(ranks[0], node, _short(f"{gone}; no report and no word from it"))
                if len(ranks) == 1 else  # (Culprit.ranks is a link's two ends, not this)
                Culprit(None, node, _short(f"ranks {', '.join(map(str, ranks))} {gone}; no "
                                           "report and no word from them"))
                for node, ranks in by_node.items()]
    victims = [f"rank {r}{' ' + hosts[r] if r in hosts else ''}: lost the store, left "
               f"its word in lost/{r}.json" for r in sorted(records)]
    store = first.get("store", "?")  # every rank lived to say it lost the store: the store died
    return culprits or [Culprit(None, None, _short(
        f"the coordination store at {store} went away during {stages} while every rank was "
        "alive (each left its word in lost/): its process or its node died"))], victims


def build(stage: str, nodes: list[str], culprits: list[Culprit], victims: list[str],
          report_dir: str, run_id: str, launcher: str, records: dict[str, dict],
          summary: str = "") -> Report:
    """A report of the worker's shape: no ranks ran, one failed check names the nodes."""
    bad = {k.host for k in culprits}
    summary = summary or (f"{len(bad - {None})} of {len(nodes)} node(s) failed preflight"
                          if stage == "preflight" else
                          f"the worker did not run on {len(bad - {None})} of {len(nodes)} "
                          "node(s)")
    figures = {"nodes_expected": nodes,
               "nodes_ok": [n for n in nodes if n not in bad and n not in victims],
               "victims": [v if ": " in v else f"{v}: stopped by the launcher after the "
                                                 "failure above" for v in victims],
               "preflight_s": {n: r.get("duration_s") for n, r in records.items()}}
    check = CheckResult(CHECK[stage], FAIL, summary, culprits, figures)
    return Report(version=__version__,
                  started_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  backend="none", world_size=0, ranks=[], checks=[check],
                  config={"report_dir": report_dir}, run_id=run_id,
                  written_by=f"{launcher} launcher")


def own_report(report_dir: str, run_id: str) -> dict | None:
    """report.json in the folder when this run wrote it."""
    try:
        with open(os.path.join(report_dir, "report.json")) as f:
            report = json.load(f)
    except (OSError, ValueError):
        return None
    ok = isinstance(report, dict) and (not run_id or report.get("run_id") == run_id)
    return report if ok else None


def culprit_text(report: dict) -> str:
    """``check: who: reason; …`` for every culprit of a failed check."""
    parts = []
    for check in report.get("checks", []):
        for k in check.get("culprits", []) if check.get("status") == FAIL else []:
            who = k.get("host") or ("rank " + str(k.get("rank")) if k.get("rank") is not None
                                    else "")
            if k.get("rank") is not None and k.get("host"):
                who = f"rank {k['rank']} {k['host']}"
            parts.append(f"{check.get('name')}: {who + ': ' if who else ''}{k.get('reason')}")
    error = report.get("error")
    if error and not parts:
        parts.append(f"error: {error.get('message') if isinstance(error, dict) else error}")
    more = f"; (+{len(parts) - SHOWN} more in the report)" if len(parts) > SHOWN else ""
    return "; ".join(parts[:SHOWN]) + more


def last_line(verdict: str, detail: str, exit_code: int | None, path: str,
              launcher: str = "slurm") -> str:
    parts = [f"ddp-smoke: verdict {verdict}"] + ([detail] if detail else [])
    if exit_code is not None:  # the status of what the launcher ran: srun's, or torchrun's
        parts.append(f"{'srun' if launcher == 'slurm' else 'torchrun'} exit {exit_code}")
    parts += [f"report {path}", f"end {datetime.now().astimezone().isoformat(timespec='seconds')}"]
    return " · ".join(parts)


def main(argv: list[str]) -> int:
    """``python -m ddp_smoke launch-report …`` (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m ddp_smoke launch-report")
    p.add_argument("--stage", choices=STAGES, required=True)
    p.add_argument("--report-dir", required=True)
    p.add_argument("--nodes", required=True, help="the nodes launched, space-separated")
    p.add_argument("--launch-log", help="the launcher's stderr (srun's errors)")
    p.add_argument("--exit", type=int, dest="exit_code", help="the launcher's exit status")
    p.add_argument("--launcher", default="slurm")
    p.add_argument("--run-id", default=os.environ.get("DDP_SMOKE_RUN_ID", ""))
    a = p.parse_args(argv)
    nodes = a.nodes.split()
    launch = launch_errors(_read(a.launch_log)) if a.launch_log else {}
    path = os.path.join(a.report_dir, "report.json")
    records = read_records(a.report_dir, a.run_id)
    summary = ""
    if a.stage == "run":
        report = own_report(a.report_dir, a.run_id)
        if report is not None:
            verdict = str(report.get("verdict"))
            print(last_line(verdict, culprit_text(report), a.exit_code, path, a.launcher),
                  flush=True)
            return 0 if verdict == "pass" else 1
        stderr = {n: node_stderr(a.report_dir, n, "run") for n in nodes}
        # and each rank's own stderr file (torchrun --log-dir): the node's copy interleaves the
        # ranks' lines as torchrun's tee reads them, a long line in pieces (the campaign's
        # read_only.rank0.ddp_step.slurm.4x1: a 100 KB report cut by another rank's lines)
        own = [_read(f) for n in nodes for f in sorted(glob.glob(os.path.join(
            a.report_dir, "torchrun", n, "*", "attempt_*", "*", "stderr.log")))]
        said = next((x for text in [*stderr.values(), *own] if (x := report_in_stderr(text))
                     and (not a.run_id or x.report.get("run_id") == a.run_id)), None)
        if said is not None:  # the folder took no report (full, read-only): the writer said it
            # once more, whole, where no rank writes any more: the job's output keeps it
            print(f"ddp-smoke: error: {said.why}; {REPORT_FOLLOWS}\n"
                  f"{json_line(said.report)}", flush=True)
            print(last_line(str(said.report.get("verdict")), f"report kept only in the job's "
                            f"output ({said.why}); {culprit_text(said.report)}".rstrip("; "),
                            a.exit_code, path, a.launcher), flush=True)
            return 1  # a pass nobody kept is not one
        unkept = next((why for n in nodes for x in stderr[n].splitlines()
                       if (why := unwritten(x)) is not None), None)
        if unkept is not None:  # the same, its JSON line too long for the room the folder had
            print(last_line("unknown (report not kept)", f"{unkept}; {REPORT_FOLLOWS} in the "
                            "job's output", a.exit_code, path, a.launcher), flush=True)
            return 1
        refused = [error_line(stderr[n].splitlines() + [
            x for f in glob.glob(os.path.join(a.report_dir, "torchrun", n, "*", "attempt_*",
                                              "*", "std*.log")) for x in _read(f).splitlines()
            if "ddp-smoke: error:" in x]) for n in nodes]
        refused = [r for r in refused if "ddp-smoke: error:" in r]
        if refused:  # bad input: no report by design, the worker's own line says why
            print(last_line("none (no report)", f"bad input: {refused[0]}", a.exit_code, path,
                            a.launcher))
            return 2
        said = lost.read(a.report_dir, a.run_id)
        if said:  # the workers ran; the ranks that lost the store left their word
            culprits, victims = lost_culprits(said)
            summary = ("the workers ran, but the coordination store went silent and no rank "
                       "could write a report")
        else:
            culprits, victims = run_culprits(nodes, launch, a.report_dir, a.exit_code)
    else:
        culprits, victims = preflight_culprits(nodes, records, launch, a.report_dir)
        if not culprits:
            took = max((r.get("duration_s") or 0 for r in records.values()), default=0)
            print(f"ddp-smoke: preflight ok on {len(nodes)} node(s) in {took:.1f} s", flush=True)
            return 0
    report = build(a.stage, nodes, culprits, victims, a.report_dir, a.run_id, a.launcher,
                   records, summary)
    written = publish(report, a.report_dir, a.run_id, print_summary=False).path
    print(last_line(report.verdict, culprit_text(report.to_dict()), a.exit_code, written,
                    a.launcher), flush=True)
    return 1
