"""A memory across runs: every report under a folder of runs, per host and per GPU.

The launchers put each run in its own folder under one root (``reports/<run id>/``, Slurm's
``REPORT_ROOT/<job id>/``, ``/reports/<run id>/`` in a pod). :func:`refresh` reads every
``report.json`` under a root into an SQLite index beside them (``ROOT/.ddp-smoke-history.sqlite``,
standard library only). The index is a cache, never the record: a report whose path, size or
mtime changed is read again, a report that went is dropped, and an index that is unreadable or
of another schema is rebuilt from the reports. So thousands of runs cost one ``stat`` each.

Figures kept, each named with what makes two runs comparable (size, dtype, rank count), all
"higher is better":

* per host: the best node-pair busbw of the host (bandwidth check's pairs, multi-node runs;
  the best of its pairs, so that one slow link does not mark both ends), and, on single-node
  runs, each collective's busbw at the largest size swept (that node's own fabric);
* per GPU, by serial where pynvml could read it, else its UUID, else ``host:local_rank`` (a CPU
  slot on CPU runs): compute's sustained matmul rate per dtype — its median block, the figure
  the compute check judges, in the terminal's unit (TFLOPS on a GPU, GFLOPS on a CPU slot) —
  and HBM copy bandwidth. Not the best block: a device held back for most of the run (a
  throttled GPU, a CPU quota) keeps its best block, and only the sustained rate shows the fall;
  and the training check's tokens/s of the rank (its median step) and its MFU (% of the
  profile's peak; GPU runs only), named with the layout and mesh (so the world size), the
  model's parameters and the batch (micro_batch x seq_len).

Practice runs (``--fault``, ``injected`` in the report) are indexed but left out of every
series, trend and host status list (``statuses:``): a failure made on purpose is no drift of
the cluster's. ``--include-practice`` puts them back, each value and status marked ``*``.

A figure is **degrading** in its latest run when it fell more than a margin below its own median
over the runs before (the last ``window`` of them, at least ``min_runs``), even while it is still
above the profile's floor: config keys ``history.margin`` (GPU runs), ``history.margin_cpu``
(CPU runs, which share cores with the whole host), ``history.window``, ``history.min_runs``.

Used by ``ddp-smoke history ROOT`` (:func:`main`) and by the page (``outputs/page.py``), which
draws each host's history when the report's root holds earlier runs.
"""
from __future__ import annotations

import datetime
import os
import statistics
import time

from ..config import defaults as config_defaults
from ..errors import ConfigError

from . import fleet
from .runs import INDEX_NAME, REPORT, Index, _d, _l, gpu_key, run_time

SPARKS = "▁▂▃▄▅▆▇█"


def defaults() -> dict:
    """The ``history`` section of the package's defaults.yaml (and the ``fleet`` section's
    lemon rule)."""
    d = config_defaults()
    return {**d["history"], "lemon_failures": d["fleet"]["lemon_failures"],
            "lemon_runs": d["fleet"]["lemon_runs"]}


# -- judging a series (pure) ----------------------------------------------------------------

def trend(values: list[float], margin: float, window: int, min_runs: int) -> dict:
    """The latest value against its own median of the runs before it.

    Returns:
        ``{"last", "median" (None with fewer than min_runs earlier runs), "change" (fraction,
        negative = fell), "prior" (how many runs the median is over), "degrading"}``.
    """
    last, prior = values[-1], values[:-1][-window:]
    if len(prior) < max(1, min_runs):
        return {"last": last, "median": None, "change": None, "prior": len(prior),
                "degrading": False}
    median = statistics.median(prior)
    change = (last - median) / median if median > 0 else None
    return {"last": last, "median": median, "change": change, "prior": len(prior),
            "degrading": change is not None and change < -margin}


def spark(values: list[float]) -> str:
    """A one-line sparkline, lowest value to highest of the series."""
    lo, hi = min(values), max(values)
    span = hi - lo
    return "".join(SPARKS[int((v - lo) / span * (len(SPARKS) - 1)) if span > 0 else 3]
                   for v in values)


def summarize(index: Index, kind: str, entities: list[tuple[str, str]] | None = None,
              until: float | None = None) -> list[dict]:
    """Per entity and figure: the values across runs and the trend (for the CLI and page)."""
    s = index.settings
    out = []
    for entity, label in (entities if entities is not None else index.entities(kind)):
        rows = []
        for figure, entry in index.series(kind, entity, until).items():
            values = [p[3] for p in entry["points"]]
            margin = index.margin(entry)
            rows.append({"figure": figure, "unit": entry["unit"], "values": values,
                         "runs": [p[2] for p in entry["points"]], "margin": margin,
                         "practice": [p[4] is not None for p in entry["points"]],
                         **trend(values, margin, s["window"], s["min_runs"])})
        statuses = index.host_statuses(entity, until) if kind == "host" else []
        out.append({"kind": kind, "entity": entity, "label": label, "figures": rows,
                    "statuses": statuses, "degrading": any(r["degrading"] for r in rows)})
    return out


# -- for the page ---------------------------------------------------------------------------

def for_report(report: dict, report_path: str, budget_s: float | None = 2.0) -> dict | None:
    """History of this report's hosts and GPUs from the runs beside it, or None without any.

    The root is the folder that holds the report's folder. Its index is used and kept fresh when
    ``ddp-smoke history`` made one; otherwise the runs are read into one in memory and nothing
    is written there (a ``--report-dir /tmp/x`` leaves /tmp as it was).
    Runs that started after this one are left out, so an old report re-rendered shows the
    history it had. ``budget_s`` bounds the walk and the reading (rank 0 before the verdict).
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(report_path)))
    if not _has_history(root, os.path.abspath(report_path)):
        return None
    deadline = None if budget_s is None else time.monotonic() + budget_s
    index = Index(root, {**defaults(), **_d(_d(report.get("config")).get("history"))},
                  create=False)
    try:
        stats = index.refresh(deadline)
        until = run_time(report, time.time())
        hosts = [h for h in dict.fromkeys(_d(r).get("host") for r in _l(report.get("ranks")))
                 if h]
        gpus = [gpu_key(_d(r))[0] for r in _l(report.get("ranks"))]
        return {"root": root, "index": index.path, "runs": len(index.runs()),
                "complete": stats["complete"], "settings": index.settings,
                "hosts": summarize(index, "host", index.entities("host", hosts), until),
                "gpus": summarize(index, "gpu", index.entities("gpu", gpus), until)}
    finally:
        index.close()


def _has_history(root: str, mine: str) -> bool:
    if os.path.exists(os.path.join(root, INDEX_NAME)):
        return True
    try:
        with os.scandir(root) as entries:
            for i, e in enumerate(entries):
                if i > 10000:  # a huge folder that is no report root (e.g. /tmp): leave it
                    return False
                other = os.path.join(root, e.name, REPORT)
                if e.is_dir(follow_symlinks=False) and other != mine and os.path.exists(other):
                    return True
    except OSError:
        pass
    return False


# -- ddp-smoke history ROOT -----------------------------------------------------------------

def _fmt(v) -> str:
    return "-" if v is None else f"{v:.4g}"


def _marked(text: str, practice: bool) -> str:
    """A value or host status of a practice run, shown only with --include-practice: ``*``."""
    return text + "*" if practice else text


def render(index: Index, shown: int = 6) -> str:
    """The text ``ddp-smoke history`` prints (pure given the index)."""
    s, runs = index.settings, index.runs()
    st = index.stats
    when = lambda t: datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime(  # noqa: E731
        "%Y-%m-%d %H:%M")
    span = f", {when(runs[0][1])} .. {when(runs[-1][1])} UTC" if runs else ""
    margin = (f"{s['margin_override']:.0%}" if s.get("margin_override") is not None else
              f"the latest run's history.margin (default {s['margin']:.0%} on GPU, "
              f"{s['margin_cpu']:.0%} on CPU runs)")
    practice = index.practice_runs()
    kept = ("; * = a practice run (--fault), shown with --include-practice"
            if s.get("include_practice") else
            f"; {practice} practice run(s) (--fault) left out: --include-practice shows them"
            if practice else "")
    lines = [f"# ddp-smoke history: {len(runs)} run(s) under {index.root}{span}{kept}",
             f"# index {index.path}: {st['read']} report(s) read now, {st['removed']} gone, "
             f"{st['unreadable']} unreadable",
             f"# degrading = the latest value more than {margin} below the median of the "
             f"{s['window']} runs before it (at least {s['min_runs']}); values oldest -> newest",
             "# compute: the sustained rate (median block), the figure its verdict judges; "
             "GFLOPS on a CPU slot, TFLOPS on a GPU",
             "# training: the rank's tokens/s over its median step, and MFU (% of the profile's "
             "peak, GPU runs), per layout, mesh, model size and batch"]
    flagged = []
    for kind, title in (("host", "host"), ("gpu", "device")):
        for ent in summarize(index, kind):
            head = f"{title} {ent['label']}"
            if ent["statuses"]:
                head += "  statuses: " + " ".join(_marked(v, p)
                                                  for v, p in ent["statuses"][-shown:])
            lines.append(f"\n{head}")
            for r in ent["figures"]:
                tail = list(zip(r["values"], r["practice"]))[-shown:]
                more = "… " if len(r["values"]) > shown else ""
                change = "" if r["change"] is None else f"{r['change']:+.0%} vs median " \
                    f"{_fmt(r['median'])} of {r['prior']}"
                flag = "  DEGRADING" if r["degrading"] else ""
                lines.append(f"  {r['figure'] + ' (' + r['unit'] + ')':<42} runs {len(r['values']):>4}"
                             f"  {spark(r['values'][-24:]):<24}  {more}"
                             f"{' '.join(_marked(_fmt(v), p) for v, p in tail)}   {change}{flag}")
                if r["degrading"]:
                    flagged.append(f"{title} {ent['entity']}: {r['figure']} {_fmt(r['last'])} "
                                   f"{r['unit']}, {-r['change']:.0%} below its median "
                                   f"{_fmt(r['median'])} of the {r['prior']} runs before "
                                   f"(margin {r['margin']:.0%}; run {r['runs'][-1]})")
    lines.append("")
    lines += [f"degrading: {f}" for f in flagged] or ["degrading: none"]
    return "\n".join(lines + fleet_lines(index, shown=3 * shown))


def fleet_lines(index: Index, shown: int = 18) -> list[str]:
    """The fleet memory (outputs/fleet.py): what the kit did to nodes and why (its last
    ``shown`` actions, and the nodes its records leave drained), then the lemons."""
    s, acts = index.settings, index.actions()
    when = lambda t: str(t)[:16].replace("T", " ")  # noqa: E731 — ISO, UTC, to the minute
    lines = ["", f"# fleet: the kit's drains, resumes and refusals ({len(acts)} recorded, "
                 "actions.json beside each report); sinfo -R has the live state"]
    for a in acts[-shown:]:
        fate = "" if a["done"] else f" — not done: {a['detail']}"
        lines.append(f"  {when(a['t'])}  {a['action']:<6} {a['node']:<16} run {a['run_id']}: "
                     f"{a['reason']}{fate}")
    latest: dict[str, dict] = {}
    for a in acts:
        if a["action"] in (fleet.DRAIN, fleet.RESUME) and a["done"]:
            latest[a["node"]] = a
    held = [f"{n} ({a['reason']})" for n, a in latest.items() if a["action"] == fleet.DRAIN]
    lines.append(f"drained by ddp-smoke: {'; '.join(held) if held else 'none'}")
    found = fleet.lemons(index.host_runs(), s["lemon_failures"], s["lemon_runs"])
    lines.append(f"# lemons: failed in >= {s['lemon_failures']} of their last "
                 f"{s['lemon_runs']} runs (fleet.lemon_failures, fleet.lemon_runs)")
    return lines + ([fleet.lemon_line(x) for x in found] or ["lemons: none"])


def run(root: str, margin: float | None = None, window: int | None = None,
        min_runs: int | None = None, include_practice: bool = False) -> str:
    """``ddp-smoke history ROOT``: refresh the index and return the text to print.

    Raises:
        ConfigError: ROOT is not a folder, or a setting is out of its range.
    """
    if not os.path.isdir(root):
        raise ConfigError(f"history: {root}: not a folder")
    if margin is not None and not 0 <= margin < 1:
        raise ConfigError(f"history: --margin {margin}: expected a fraction >= 0 and < 1")
    if any(v is not None and v < 1 for v in (window, min_runs)):
        raise ConfigError("history: --window and --min-runs: expected integers >= 1")
    settings = {"margin_override": margin, "include_practice": include_practice}
    settings.update({k: v for k, v in (("window", window), ("min_runs", min_runs)) if v})
    index = Index(root, {**defaults(), **settings})
    try:
        index.refresh()
        return render(index)
    finally:
        index.close()
