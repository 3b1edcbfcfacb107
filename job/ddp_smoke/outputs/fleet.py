"""A fleet memory that acts: who the kit drained and why, when it must not drain, and lemons.

Three rules, pure, on what the reports and the history index hold (docs/continuous.md):

* **The circuit breaker** (:func:`breaker`). When more than ``fleet.drain_max_share`` of a
  run's nodes failed, and at least two, the cause is likely one they share — the fabric, the
  storage, the image — not each node: ``--act`` then drains none, and says what the failing
  nodes have in common (the check, the words of their reasons, the folder or the network).
  A fabric fault that slows every node's links names every node of a run: drained one by
  one, a cluster would lose every node to one switch. Applied to the nodes of one run
  (``--act slurm-drain`` of a multi-node run) and, for ``node-check``, which sees one node per
  run, to the cluster: the nodes the kit has drained already plus this one.
* **Lemons** (:func:`lemons`). A node that failed in at least ``fleet.lemon_failures`` of its
  last ``fleet.lemon_runs`` runs is a lemon. Escalation, as repair crews work: first
  **reboot**; once it failed again after a reboot (its failing runs span two boot ids, read
  from ``/proc/sys/kernel/random/boot_id`` by the health check), **drain and RMA**. The runs
  are the evidence.
* **What node-check does to its Slurm node** (:func:`slurm_decision`): drain, resume its own
  drain, hold (the breaker), or leave a drain that is not the kit's as it is. The kit's drain
  reasons are written and read back here alone (:func:`drain_reason`, :func:`read_reason`):
  ``ddp-smoke <by>: <check>: <reason>``, ``<by>`` the run id or ``node-check``.
* **Drain records.** Every drain, resume or refusal the kit makes is recorded in the run's
  folder, ``actions.json`` (:func:`record`), with the run id and the reason; ``ddp-smoke
  history`` lists the nodes the kit drained and why (:func:`render`).

``actions.json``::

    {"format": "ddp-smoke-actions/1", "run_id": "…",
     "actions": [{"t": "2026-12-01T04:50:38+00:00", "node": "node2", "action": "drain",
                  "reason": "ddp-smoke node-check: preflight: interfaces: …", "done": true,
                  "detail": "scontrol: ok"}]}

``action``: ``drain``, ``resume`` (only a drain of the kit's own tier: a node drained by
hand, or by another tool, is never resumed), ``hold`` (the circuit breaker: not drained),
``label`` (a Kubernetes node's health label). ``done``: whether the command succeeded.
"""
from __future__ import annotations

import datetime
import difflib
import json
import os
import re

from ..config.launchenv import NODE_RUN_PREFIX
from .files import write_atomic

ACTIONS_FILE = "actions.json"
FORMAT = "ddp-smoke-actions/1"
ACTIONS = ("drain", "resume", "hold", "label")
DRAIN, RESUME, HOLD, LABEL = ACTIONS
REBOOT, RMA = "reboot", "drain and RMA"
_MIN_SHARED = 12  # characters two reasons must share to be quoted as their common words
_GAP = "…"        # where the failing nodes' reasons differ
# What a check's failure on many nodes at once most likely points at.
_SHARED_KIND = {"storage": "storage", "bandwidth": "fabric", "transport": "fabric",
                "rails": "fabric", "collectives": "fabric", "launch": "fabric",
                "environment": "image", "ddp_step": "image", "sampler_epochs": "image",
                "compute": "load or power", "training": "image",
                "health": "hardware or driver"}
_PREFLIGHT_KIND = {"report_dir": "storage", "interfaces": "fabric", "rendezvous": "fabric",
                   "joined": "fabric", "rendezvous_host": "fabric", "torch": "image",
                   "python": "image"}
REASON_CHARS = 160      # a Slurm node reason is one line in sinfo -R: keep it readable
_WORD_CHARS = 40        # a longer word in a reason too long is shortened in its middle
_UNSAFE = re.compile(r"[^A-Za-z0-9 _.,:;=+/@%()<>\[\]{}#~^*|'-]")  # nothing a shell expands
_KIT_REASON = re.compile(r"ddp-smoke (\S+): (.*)$")  # the kit's own drain reasons
NODE_CHECK = "node-check"  # node-check's drains: the ones it may lift
# A health finding is the hardware's, except a limit that a setting put on the node: the same
# CPU quota on every node is one configuration pushed to all of them (a slice, a pod limit).
_HEALTH_KIND = {"CPU quota": "the nodes' set-up"}


def tier(report: dict) -> str:
    """``node`` for a node-check run (its run id), else ``acceptance``."""
    return "node" if str(report.get("run_id") or "").startswith(NODE_RUN_PREFIX) else \
        "acceptance"


# -- the circuit breaker (pure) -------------------------------------------------------------

def breaker(failing: dict[str, list[dict]], nodes: int, max_share: float,
            where: dict[str, str] | None = None) -> dict | None:
    """Whether draining must stop because the cause is likely shared.

    Args:
        failing: node -> its reasons (``{"check", "reason"}``, as the report's hosts section
            has them), for every node that would be drained.
        nodes: how many nodes the share is of (the run's, or the cluster's).
        max_share: ``fleet.drain_max_share``.
        where: what the failing nodes had in common beside the reasons (e.g. the storage
            folder), ``{"storage": "/shared/reports/…"}``.

    Returns:
        None when draining may go ahead; else ``{"failing", "nodes", "max_share", "kind",
        "common", "line"}``: ``line`` is what to print and record.
    """
    n = len(failing)
    if n < 2 or nodes <= 0 or n / nodes <= max_share:
        return None
    kind, common = common_cause(failing, where or {})
    line = (f"circuit breaker: {n} of {nodes} nodes failed (more than {max_share:.0%}): "
            f"drained none; the cause is likely shared ({kind}): {common}")
    return {"failing": sorted(failing), "nodes": nodes, "max_share": max_share, "kind": kind,
            "common": common, "line": line}


def common_cause(failing: dict[str, list[dict]], where: dict[str, str]) -> tuple[str, str]:
    """(kind, what they have in common) of the failing nodes' reasons."""
    checks = None
    for reasons in failing.values():
        named = {r.get("check") for r in reasons}
        checks = named if checks is None else checks & named
    checks = sorted(c for c in checks or () if c)
    if not checks:
        return "unclear", "no check failed on all of them: " + "; ".join(
            f"{node}: {_first(reasons)}" for node, reasons in sorted(failing.items())[:3])
    check = checks[0]
    texts = [_masked(next(r["reason"] for r in reasons if r.get("check") == check), node)
             for node, reasons in failing.items()]
    kind = _kind(check, texts[0])
    said = f"every one failed {check}" + (f" (and {', '.join(checks[1:])})" if checks[1:] else "")
    shared = _shared(texts)
    if shared:
        said += f": {shared!r}"
    if kind in where:
        said += f"; all of them used {where[kind]}"
    return kind, said


def _first(reasons: list[dict]) -> str:
    return f"{reasons[0].get('check')}: {reasons[0].get('reason')}" if reasons else "?"


def _kind(check: str, reason: str) -> str:
    if check in ("preflight", "node-check"):
        return _PREFLIGHT_KIND.get(reason.split(":", 1)[0].strip(), "the node's set-up")
    if check == "health":
        return _HEALTH_KIND.get(reason.split(":", 1)[0].strip(), _SHARED_KIND[check])
    return _SHARED_KIND.get(check, "the run itself")


def _masked(reason: str, node: str) -> str:
    """A reason with the node's own name masked (what else differs, a rank or an address,
    only shortens the words they share)."""
    return re.sub(rf"(?<![\w.-]){re.escape(node)}(?![\w.-])", "<node>", reason) if node else reason


def _shared(texts: list[str]) -> str:
    """The words every text has, in their order, "…" where the texts differ ("held back in
    100%" and "in 98%": "held back in …"; "36 of 36 periods" and "37 of 37": "… of …
    periods"); "" when they share under _MIN_SHARED characters. Whole words only, and a
    number matches a number in its place, said only where the texts agree on it: "158 of 159"
    and "157 of 158" are "… of …", never a stray "158" that one text had elsewhere; words
    past the first difference are still said (the quota's cgroup and its action, after two
    nodes' differing throttled counts)."""
    words = texts[0].split()
    for other in texts[1:]:
        theirs, kept, a0, b0 = other.split(), [], 0, 0
        matcher = difflib.SequenceMatcher(None, [_token(w) for w in words],
                                          [_token(w) for w in theirs], autojunk=False)
        for a, b, size in matcher.get_matching_blocks():
            if a > a0 or b > b0:
                kept.append(_GAP)
            kept += [w if w == t else _GAP for w, t in zip(words[a:a + size], theirs[b:b + size])]
            a0, b0 = a + size, b + size
        words = [w for i, w in enumerate(kept) if w != _GAP or kept[i - 1:i] != [_GAP]]
    said = " ".join(w for w in words if w != _GAP)
    return " ".join(words).strip(" ;,:") if len(said) >= _MIN_SHARED else ""


def _token(word: str) -> str:
    """What a word matches by: a number (any word with a digit) matches any number."""
    return "#" if word != _GAP and any(c.isdigit() for c in word) else word


# -- the kit's drains (pure) ----------------------------------------------------------------

def drain_reason(host: dict, by: str) -> str:
    """``ddp-smoke <by>: <check>: <first conviction>``, one shell-safe line, bounded; ``by``:
    the run id, or :data:`NODE_CHECK`."""
    first, more = lead(host)
    text = f"ddp-smoke {by}: {first['check']}: {first['reason']}"
    words = _UNSAFE.sub(" ", text).split()
    if len(" ".join(words)) + len(more) > REASON_CHARS:
        # a long word (a path, a run id) shortened in its middle first: a finding says what
        # failed first and why last, a path between (measured: a full report folder's drain
        # ended inside the folder's path, its "No space left on device" cut off)
        words = [w if len(w) <= _WORD_CHARS else f"{w[:_WORD_CHARS // 2 - 2]}...{w[-12:]}"
                 for w in words]
    text = " ".join(words)
    if len(text) + len(more) > REASON_CHARS:
        text = text[:REASON_CHARS - len(more) - 3].rstrip() + "..."
    return text + more


def lead(host: dict) -> tuple[dict, str]:
    """The reason to show first (a conviction before a link) and "(+N more)" for the rest."""
    reasons = sorted(host["reasons"], key=lambda r: "link" in r)
    first = reasons[0] if reasons else {"check": "?", "reason": "named by ddp-smoke"}
    return first, f" (+{len(reasons) - 1} more)" if len(reasons) > 1 else ""


def read_reason(reason: str) -> dict | None:
    """A Slurm node's reason as the kit wrote it (:func:`drain_reason`): ``{"by", "check",
    "reason"}``, the hosts section's reason plus who drained; None for anyone else's."""
    m = _KIT_REASON.match(reason or "")
    if not m:
        return None
    check, _, why = m.group(2).partition(": ")
    return {"by": m.group(1), "check": check, "reason": why or m.group(2)}


def drained(state: str) -> bool:
    """A Slurm node state that takes no new jobs because someone drained it (DRAIN,
    DRAINING, DRAINED: ``IDLE+DRAIN`` …)."""
    return "DRAIN" in state.upper()


def slurm_decision(node: str, nodes: dict[str, dict], failed: bool, why: str,
                   reasons: list[dict], max_share: float) -> tuple[str | None, str, str]:
    """What node-check does to its Slurm node: ``(action or None, the line that says so, the
    reason to record)``.

    ``nodes``: every Slurm node's ``{"state", "reason"}``; ``failed``: this run failed (or
    the node is a lemon for RMA); ``why``: the drain reason it would write; ``reasons``: this
    node's reasons. A drain that is not node-check's own is never lifted or rewritten; the
    breaker counts the nodes the kit drained already plus this one."""
    state, reason = nodes[node]["state"], nodes[node]["reason"]
    own = (read_reason(reason) or {}).get("by") == NODE_CHECK
    if not failed:
        if drained(state) and own:
            return RESUME, f"resumed (its drain was node-check's own: {reason})", reason
        if drained(state):
            return None, f"left drained: drained by someone else (Reason={reason})", reason
        return None, "", ""
    if drained(state) and not own:
        return (None, f"left drained as it is: drained already by someone else "
                      f"(Reason={reason})", reason)
    if drained(state) and reason.startswith(why[:60]):
        return None, f"stays drained ({reason})", reason
    others = {n: [read_reason(v["reason"])] for n, v in nodes.items()
              if n != node and drained(v["state"]) and read_reason(v["reason"])}
    tripped = breaker({**others, node: reasons or [read_reason(why)]}, len(nodes), max_share)
    if tripped:
        return HOLD, f"not drained: {tripped['line']}", tripped["line"]
    return DRAIN, f"drained: Reason={why}", why


# -- lemons (pure) --------------------------------------------------------------------------

def lemons(runs: dict[str, list[dict]], failures: int, window: int) -> list[dict]:
    """The nodes failing in >= ``failures`` of their last ``window`` runs, with escalation.

    Args:
        runs: node -> its runs, oldest first: ``{"t", "run_id", "status" (good/suspect/bad),
            "reason", "boot_id" (or None)}``.

    Returns:
        ``{"node", "failed", "of", "action" (reboot | drain and RMA), "why", "evidence"
        (the failing runs)}`` per lemon, worst first.
    """
    out = []
    for node, history in runs.items():
        last = history[-window:]
        bad = [r for r in last if r["status"] == "bad"]
        if len(bad) < failures:
            continue
        boots = list(dict.fromkeys(r["boot_id"] for r in bad if r.get("boot_id")))
        if len(boots) >= 2:
            action, why = RMA, (f"it failed again after a reboot (its failing runs span "
                                f"{len(boots)} boots)")
        else:
            action, why = REBOOT, ("all its failures are from one boot" if boots else
                                   "no reboot seen since it started failing (no boot id "
                                   "recorded)")
        out.append({"node": node, "failed": len(bad), "of": len(last), "action": action,
                    "why": why, "evidence": bad})
    return sorted(out, key=lambda x: (x["action"] != RMA, -x["failed"], x["node"]))


def lemon_line(lemon: dict) -> str:
    """One line per lemon: the count, the action, why, and the runs as evidence."""
    runs = "; ".join(f"{r['run_id']}: {r['reason'] or 'failed'}"[:160]
                     for r in lemon["evidence"][-3:])
    return (f"lemon {lemon['node']}: failed {lemon['failed']} of its last {lemon['of']} runs "
            f"-> {lemon['action']} ({lemon['why']}); runs: {runs}")


# -- drain records (I/O) --------------------------------------------------------------------

def entry(node: str, action: str, reason: str, done: bool, detail: str = "") -> dict:
    """One action as ``actions.json`` holds it, stamped now."""
    if action not in ACTIONS:
        raise ValueError(f"action {action!r} not in {ACTIONS}")
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {"t": now, "node": node, "action": action, "reason": reason, "done": bool(done),
            "detail": detail}


def record(report_dir: str, run_id: str, entries: list[dict]) -> str | None:
    """Add ``entries`` to the run's ``actions.json`` (atomically); its path, or None when
    there is nothing to record. Raises OSError when the folder cannot be written."""
    if not entries:
        return None
    path = os.path.join(report_dir, ACTIONS_FILE)
    have = read(path)
    body = {"format": FORMAT, "run_id": run_id,
            "actions": (have["actions"] if have and have.get("run_id") == run_id else [])
            + entries}
    write_atomic(path, json.dumps(body, indent=1) + "\n")
    return path


def read(path: str) -> dict | None:
    """An ``actions.json``, or None when absent or not one of ours."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            body = json.load(f)
    except (OSError, ValueError):
        return None
    ok = isinstance(body, dict) and body.get("format") == FORMAT and \
        isinstance(body.get("actions"), list)
    return body if ok else None
