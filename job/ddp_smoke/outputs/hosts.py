"""Good and bad hosts: the decision an acceptance run ends with, and what to do next.

The report's ``hosts`` section lists every host that ran a rank, in rank order::

    {"host": "gpu07", "status": "good" | "suspect" | "bad", "ranks": [8, 9, …],
     "slurm_node": "gpu07",          # where the rank recorded SLURMD_NODENAME
     "k8s_node": "node-a1",          # where the pod recorded NODE_NAME (spec.nodeName)
     "reasons": [{"check": "compute", "rank": 9, "reason": "…"},
                 {"check": "bandwidth", "link": ["gpu03", "gpu07"], "ranks": [2, 8],
                  "reason": "…"},
                 {"check": "bandwidth", "rank": 11, "rail": {"index": 3, "device": "mlx5_3",
                  "port": 1}, "reason": "…"}],
     "rails": [{"index": 3, "device": "mlx5_3", "port": 1, "status": "bad"}]}

``rails`` (only on a host a culprit names by its rail) lists the host's rails at fault: bad
when a culprit names the rail of this host, suspect when it is an end of a link on that rail.

Each host's status, from the culprits of every check: a culprit naming a host (or a rank, whose host
the ranks list gives) makes it **bad**; a link culprit, which names two ends (``hosts`` /
``ranks``), makes both ends **suspect**, since a cable, a switch port or either NIC may be at
fault, unless other evidence makes one of them bad; a host nobody names is **good**. Culprits
that name no host (a missed floor, a run-level abort) leave every host as it is: the run
failed, but no host is to blame.

Rank 0 then writes ``bad_hosts.txt``, ``suspect_hosts.txt`` and ``good_hosts.txt`` beside the
report (one host name per line, atomically; tools feed them to ``--exclude``) and
``bad_rails.txt``, one bad rail per line (``gpu07 rail 3 mlx5_3``), and, when a host is not
good, prints the commands an operator would run next, just before the verdict line: drain
(``scontrol update … State=DRAIN Reason=…``), re-test
without the bad nodes (``sbatch --exclude=…``), re-test a suspect link alone, and cordon and
label the Kubernetes node; each only for the launcher that ran (Slurm lines for ranks that
recorded a Slurm node, kubectl lines for pods that recorded their node; none on a laptop, none
for an injected fault). It runs none of them, except with ``--act slurm-drain``: then, under
Slurm only, rank 0 runs the scontrol lines for the bad hosts (rank 0 needs the Slurm privileges
to drain: an operator's or SlurmUser's job). It drains none when more than
``fleet.drain_max_share`` of the run's hosts are bad (the circuit breaker,
:mod:`ddp_smoke.outputs.fleet`: a shared cause, not each host), and records every drain and
refusal in ``actions.json`` beside the report.

A practice run (``--fault``) leaves all three lists empty: a script that drains from
bad_hosts.txt must find nothing to drain after a failure made on purpose, and a practice run
vouches for no host either. Its ``hosts`` section in report.json keeps the hosts' statuses (the
alerting path under test reads it), beside ``injected``.

Everything here but :func:`finish` and :func:`drain` is pure; scontrol runs in
:mod:`.act`, the kit's one actuator.
"""
from __future__ import annotations

import os
import shlex
import sys

from ..model import get_field, injected, rail_label
from . import fleet
from .act import drain_argv as slurm_drain_argv, slurm_drain_all
from .files import write_atomic

GOOD, SUSPECT, BAD = "good", "suspect", "bad"
HOST_STATUSES = (GOOD, SUSPECT, BAD)
LISTS = {BAD: "bad_hosts.txt", SUSPECT: "suspect_hosts.txt", GOOD: "good_hosts.txt"}
RAIL_LIST = "bad_rails.txt"
DRAIN_BUDGET_S = 5.0    # slurmctld answers in milliseconds; a stuck one must not hold the exit


# -- the hosts section (pure) ---------------------------------------------------------------

def culprit_hosts(culprit, ranks: list[dict]) -> tuple[list[str], bool]:
    """The hosts a culprit names, and whether it names a link (both ends only suspect).

    Args:
        culprit: a Culprit or its dict; ``hosts``/``ranks`` (both ends of a link) are optional.
        ranks: the report's per-rank records, to find a rank's host.

    Returns:
        (hosts, is_link): distinct host names in order; ``is_link`` when the culprit names
        two or more different hosts. A link inside one host convicts that host.
    """
    def host_of(rank):
        ok = isinstance(rank, int) and 0 <= rank < len(ranks)
        return ranks[rank].get("host") if ok else None

    named = list(get_field(culprit, "hosts") or [])
    named += [host_of(r) for r in (get_field(culprit, "ranks") or [])]
    named = [h for h in named if h]
    if not named:
        named = [get_field(culprit, "host") or host_of(get_field(culprit, "rank"))]
    hosts = [h for h in dict.fromkeys(named) if h]
    return hosts, len(hosts) > 1


def hosts_section(report) -> list[dict]:
    """Every host with its status and the reasons from all checks (see the module docstring).

    Args:
        report: a :class:`ddp_smoke.model.Report`, or a report.json dict.

    Returns:
        One entry per host, in order of its first rank; hosts named only by culprits (no
        rank record) follow.
    """
    ranks = list(get_field(report, "ranks") or [])
    hosts: dict[str, dict] = {}
    for r in ranks:
        if r.get("host"):
            entry = _entry(hosts, r["host"])
            entry["ranks"].append(r.get("rank"))
            for key in ("slurm_node", "k8s_node"):
                if r.get(key):
                    entry.setdefault(key, r[key])
    for check in get_field(report, "checks") or []:
        for culprit in get_field(check, "culprits") or []:
            named, link = culprit_hosts(culprit, ranks)
            reason = {"check": get_field(check, "name"), "reason": get_field(culprit, "reason")}
            if link:
                reason = {**reason, "link": named, "ranks": list(get_field(culprit, "ranks") or [])}
            elif get_field(culprit, "rank") is not None:
                reason = {**reason, "rank": get_field(culprit, "rank")}
            if get_field(culprit, "rail"):
                reason = {**reason, "rail": get_field(culprit, "rail")}
            for host in named:
                _entry(hosts, host)["reasons"].append(reason)
    for entry in hosts.values():
        entry["status"] = _status(entry["reasons"])
        rails = _rails(entry["reasons"])
        if rails:
            entry["rails"] = rails
    return list(hosts.values())


def _rails(reasons: list[dict]) -> list[dict]:
    """The host's rails that reasons name: bad when one names it, suspect as a link end only."""
    out: dict = {}
    for r in reasons:
        rail = r.get("rail")
        if isinstance(rail, dict):
            key = rail.get("index")
            was = out.get(key, {}).get("status")
            status = BAD if "link" not in r or was == BAD else SUSPECT
            out[key] = {**rail, "status": status}
    return [out[k] for k in sorted(out, key=lambda k: (k is None, k))]


def _entry(hosts: dict, host: str) -> dict:
    return hosts.setdefault(host, {"host": host, "status": GOOD, "ranks": [], "reasons": []})


def _status(reasons: list[dict]) -> str:
    if any("link" not in r for r in reasons):
        return BAD
    return SUSPECT if reasons else GOOD


def by_status(hosts: list[dict]) -> dict[str, list[dict]]:
    """The hosts section split by status, each list in the section's order."""
    return {v: [h for h in hosts if h["status"] == v] for v in HOST_STATUSES}


def host_lists(hosts: list[dict]) -> dict[str, str]:
    """The text of bad_hosts.txt, suspect_hosts.txt and good_hosts.txt (one host a line), and
    of bad_rails.txt (``host rail N device``, one bad rail a line)."""
    split = by_status(hosts)
    out = {name: "".join(f"{h['host']}\n" for h in split[v]) for v, name in LISTS.items()}
    out[RAIL_LIST] = "".join(f"{h['host']} rail {r.get('index')} {r.get('device') or '-'}\n"
                             for h in hosts for r in h.get("rails", []) if r["status"] == BAD)
    return out


# -- next steps (pure) ----------------------------------------------------------------------

def drain_argv(host: dict, run_id: str) -> list[str]:
    """The scontrol command that drains one bad host's Slurm node."""
    return slurm_drain_argv(host.get("slurm_node") or host["host"],
                            fleet.drain_reason(host, run_id))


def next_commands(hosts: list[dict], run_id: str) -> list[str]:
    """Shell lines an operator would run next, for the hosts that are not good.

    Slurm lines use the Slurm node name each rank recorded, Kubernetes lines the node name a
    pod recorded; both fall back to the host name.
    """
    split = by_status(hosts)
    lines = []
    # Only the launcher's own commands: Slurm lines for hosts whose ranks ran in a Slurm job
    # (SLURMD_NODENAME), kubectl lines for pods (NODE_NAME). A laptop gets neither.
    bad = [h for h in split[BAD] if h.get("slurm_node")]
    suspect = [h for h in split[SUSPECT] if h.get("slurm_node")]
    for h in bad:
        argv = drain_argv(h, run_id)
        lines.append(" ".join(shlex.quote(a) for a in argv[:-1]) +
                     f' Reason="{argv[-1][len("Reason="):]}"')
    if bad:
        exclude = ",".join(h["slurm_node"] for h in bad)
        lines.append(f"sbatch --exclude={shlex.quote(exclude)} slurm/ddp_smoke.sbatch")
    slurm = {h["host"]: h["slurm_node"] for h in hosts if h.get("slurm_node")}
    convicted = {h["host"] for h in bad}
    links = dict.fromkeys(tuple(r["link"]) for h in suspect for r in h["reasons"] if "link" in r)
    # A pair is judged against the others: a re-test of a link alone has no reference, so it
    # takes a good host along.
    witness = [h["host"] for h in split[GOOD] if h["host"] in slurm][:1]
    for link in links:
        if convicted.isdisjoint(link) and set(link) <= set(slurm):  # with a bad end, draining that end is the re-test
            nodes = ",".join(slurm.get(end, end) for end in [*link, *witness])
            lines.append(f"sbatch --nodes={len(link) + len(witness)} "
                         f"--nodelist={shlex.quote(nodes)} slurm/ddp_smoke.sbatch "
                         "--checks bandwidth   # re-test the link")
    for h in split[BAD]:
        if not h.get("k8s_node"):
            continue
        node = shlex.quote(h["k8s_node"])
        lines += [f"kubectl cordon {node}",
                  f"kubectl label node {node} ddp-smoke/result=fail --overwrite"]
    return lines


def render(hosts: list[dict], run_id: str, report_dir: str, act: str | None,
           injected: str | None = None, held: bool = False) -> list[str]:
    """What rank 0 prints just before the verdict when a host is not good (nothing otherwise).
    ``injected``: the run's ``--fault``; its failures were made on purpose, so no command that
    takes a host out of service is printed for them, and the lists are empty. ``held``: the
    circuit breaker stopped ``--act slurm-drain`` (:func:`held_by_breaker`): it ran none."""
    split = by_status(hosts)
    if not split[BAD] and not split[SUSPECT]:
        return []
    # a practice run's hosts are named by a failure made on purpose: "practice", never "bad"
    counts = ", ".join(f"{len(split[v])} {v}" for v in (BAD, SUSPECT, GOOD)) if not injected \
        else f"{len(split[BAD]) + len(split[SUSPECT])} practice, {len(split[GOOD])} good"
    lists = ", ".join([*LISTS.values()] + ([RAIL_LIST] if any(h.get("rails") for h in hosts)
                                           else []))
    where = (f"practice run: lists ({lists}) left empty in {report_dir}" if injected else
             f"lists ({lists}) in {report_dir}")
    lines = [f"# hosts: {counts}; {where}"]
    for h in split[BAD] + split[SUSPECT]:
        first, more = fleet.lead(h)
        label = "practice" if injected else h["status"]
        rails = "".join(f" · {rail_label(r)} {'practice' if injected else r['status']}"
                        for r in h.get("rails", []))
        lines.append(f"#   {label:<7} {h['host']:<20}{rails} {first['check']}: "
                     f"{first['reason']}{more}")
    if injected:
        return lines + [f"# next steps: none; the failures were injected (--fault {injected}), "
                        "the alerting path is what was tested"]
    commands = next_commands(hosts, run_id)
    if not commands:
        return lines + ["# next steps: take the bad hosts out of service before the next job "
                        "(no Slurm or Kubernetes node names in this run: no commands for them)"]
    ran = "" if not any(c.startswith("scontrol ") for c in commands) else \
        " (--act slurm-drain ran none: the circuit breaker held)" if act == "slurm-drain" and \
        held else " (--act slurm-drain ran the scontrol lines)" if act == "slurm-drain" else \
        "; --act slurm-drain runs the scontrol lines"
    lines.append(f"# next steps, not run{ran}:")
    return lines + [f"  {c}" for c in commands]


# -- rank 0's outputs (I/O) -----------------------------------------------------------------

def drain(hosts: list[dict], run_id: str, environ=os.environ, report_dir: str | None = None,
          max_share: float = 1.0, where: dict | None = None) -> list[str]:
    """``--act slurm-drain``: run scontrol for each bad host; return one line per outcome.

    Only under Slurm (``SLURM_JOB_ID`` set) and only for hosts whose ranks recorded their Slurm
    node name: a host name guessed into a NodeName could drain another machine. None at all
    when more than ``max_share`` of the hosts are bad (:func:`ddp_smoke.outputs.fleet.breaker`;
    ``where``: what they shared). The calls run side by side under one deadline,
    DRAIN_BUDGET_S: the other ranks are waiting for rank 0's verdict meanwhile (10 s at most
    after an abort), and must not be told rank 0 is gone. Each outcome is recorded in
    ``report_dir``'s actions.json.
    """
    bad = by_status(hosts)[BAD]
    if not bad:
        return []
    if not environ.get("SLURM_JOB_ID"):
        return ["--act slurm-drain: not inside a Slurm job (no SLURM_JOB_ID); nothing drained"]
    tripped = held_by_breaker(hosts, max_share, where)
    if tripped:
        _record(report_dir, run_id, [fleet.entry(n, fleet.HOLD, tripped["line"], True)
                                     for n in tripped["failing"]])
        return [f"--act slurm-drain: {tripped['line']}"]
    out = [f"--act slurm-drain: {h['host']} not drained: its ranks recorded no SLURMD_NODENAME"
           for h in bad if not h.get("slurm_node")]
    reasons = {h["slurm_node"]: fleet.drain_reason(h, run_id) for h in bad
               if h.get("slurm_node")}
    whys = slurm_drain_all(reasons, DRAIN_BUDGET_S, dict(environ))
    done = []
    for node, reason in reasons.items():
        why = whys[node]
        done.append(fleet.entry(node, fleet.DRAIN, reason, why is None, why or "scontrol: ok"))
        out.append(f"--act slurm-drain: {node} " + (
            "drained" if why is None else f"NOT drained ({why}); run by hand: "
                                          f"{shlex.join(slurm_drain_argv(node, reason))}"))
    _record(report_dir, run_id, done)
    return out


def held_by_breaker(hosts: list[dict], max_share: float,
                    where: dict | None = None) -> dict | None:
    """The circuit breaker on this run's bad hosts (:func:`ddp_smoke.outputs.fleet.breaker`):
    None when they may be drained (pure)."""
    bad = by_status(hosts)[BAD]
    return fleet.breaker({h.get("slurm_node") or h["host"]: h["reasons"] for h in bad},
                         len(hosts), max_share, where)


def _record(report_dir: str | None, run_id: str, entries: list[dict]) -> None:
    if report_dir:
        try:
            fleet.record(report_dir, run_id, entries)
        except OSError as e:  # the drains happened: saying so matters more than the file
            print(f"ddp-smoke: actions not recorded in {report_dir}: {e}", file=sys.stderr)


def shared_parts(report) -> dict[str, str]:
    """What every rank of the run shared that a shared cause may sit in: the storage folder
    (and its filesystem), for the circuit breaker's message."""
    for check in get_field(report, "checks") or []:
        if get_field(check, "name") == "storage":
            figures = get_field(check, "figures") or {}
            types = "/".join(sorted({str(t) for t in figures.get("fs_types") or [] if t}))
            if figures.get("dir"):
                return {"storage": f"{figures['dir']}" + (f" ({types})" if types else "")}
    return {}


def _untrusted(security: dict) -> str | None:
    """Why ``--act`` must not act on this run's verdict, if it must not: the store held
    records the run did not write, or its records were not signed."""
    if security.get("findings"):
        return (f"--act slurm-drain: nothing drained: the store held "
                f"{len(security['findings'])} record(s) not written by this run (see the "
                "report's security section); drain by hand after a look")
    if security and not security.get("signed"):
        return ("--act slurm-drain: nothing drained: this run's records were not signed "
                "(no DDP_SMOKE_SECRET from the launcher)")
    return None


def finish(report, report_dir: str, run_id: str) -> list[str]:
    """Rank 0, after the report is written: host lists, ``--act``; returns the lines to print
    before the verdict (the hosts that are not good, next steps). Never raises: the verdict is
    already on disk and must reach every rank."""
    try:
        hosts = hosts_section(report)
        practice = injected(report)
        lists = host_lists([] if practice else hosts)
        for name, text in lists.items():
            write_atomic(os.path.join(report_dir, name), text)
        config = get_field(report, "config") or {}
        asked = config.get("act")
        refused = _untrusted(get_field(report, "security") or {}) if asked else None
        share = (config.get("fleet") or {}).get("drain_max_share", 1.0)
        where = shared_parts(report)
        lines = render(hosts, run_id, report_dir, None if refused else asked, injected=practice,
                       held=bool(held_by_breaker(hosts, share, where)))
        if refused:
            lines.append(f"# {refused}")
        elif asked == "slurm-drain":
            lines += [f"# {m}" for m in drain(hosts, run_id, report_dir=report_dir,
                                              max_share=share, where=where)]
        return lines
    except Exception as e:  # noqa: BLE001
        print(f"ddp-smoke: host lists not written: {type(e).__name__}: {e}", file=sys.stderr)
        return []
