"""``report.html``: one self-contained page, built from report.json alone.

For the people who read a run without having run it (the vendor replacing a GPU, the colleague
signing off a cluster, the on-call engineer): the verdict and the culprits first, with the next
commands; then the hosts, busbw by size against the profile's floor, the node-pair heatmap, per
rank compute, each rank's training step times, a timeline of stages per rank with where the run
stopped, the victims, the run's identity, and each host's and GPU's history when the report's
root holds earlier runs.

Design, and why:

* No script at all, and a Content-Security-Policy that forbids loading anything (no font, no
  image, no script from anywhere; images only as ``data:``): the page works offline, on an
  air-gapped cluster, and a browser test can treat any console message as an error.
* Charts are inline SVG drawn here, in Python: they scale on a phone (viewBox, width 100 %) and
  print sharp. Colours carry no meaning alone; every mark also has a text or a ``<title>``.
* Every string from the report passes ``html.escape``: host names, reasons and messages come
  from the cluster (and from whoever can set a hostname or an environment variable).
* A report that is partial (a run that died early), of another version or not even a dict
  still renders: each section draws what it has, and a section that cannot says why, in place.

Rank 0 calls :func:`write` after report.json on every run that writes a report;
``ddp-smoke render report.json`` (:func:`main`) rebuilds the page from any report.
"""
from __future__ import annotations

import json
import os
import sys

from .. import __version__
from ..errors import ConfigError, ReportWriteError
from ..model import finite, injected, rail_label
from . import history
from .runs import _d, _l, _num
from .files import write_atomic
from .hosts import hosts_section, next_commands
from .training_chart import sec_training
from .report import as_dict, practice_note
from .charts import (MAX_ROWS, check_of, checks_of, e, fmt, seconds, sec_bandwidth, sec_compute,
                     sec_pairs, sec_timeline, sparkline)

FILENAME = "report.html"



# -- sections -------------------------------------------------------------------------------

def _hosts(report: dict) -> list[dict]:
    hosts = report.get("hosts")
    if isinstance(hosts, list) and all(isinstance(h, dict) and h.get("host") for h in hosts):
        return hosts
    return hosts_section(report)  # an older report without the section


def _who(c: dict) -> str:
    rail = f" · {rail_label(c['rail'])}" if isinstance(c.get("rail"), dict) else ""
    if c.get("rank") is not None:
        return e(f"rank {c.get('rank')} ({c.get('host')}){rail}")
    ranks, hosts = _l(c.get("ranks")), _l(c.get("hosts"))
    if ranks or hosts:
        ends = [f"{h} (rank {r})" for r, h in zip(ranks or [None] * len(hosts), hosts or ranks)]
        return "link " + " &lt;-&gt; ".join(e(x) for x in ends) + e(rail)
    return e(f"{rail_label(c['rail'])}, every node") if rail else "no single rank"


def _chip(verdict) -> str:
    v = str(verdict or "unknown").lower()
    return f'<span class="chip {e(v)}">{e(v)}</span>'


def sec_verdict(report: dict) -> str:
    verdict = str(report.get("verdict") or "unknown").lower()
    checks = checks_of(report)
    passed = sum(c.get("status") == "pass" for c in checks)
    failed = [str(c.get("name")) for c in checks if c.get("status") == "fail"]
    total = _num(_d(report.get("timings")).get("total_s"))
    line = f"{passed}/{len(checks)} checks passed"
    line += f" in {total:.2f} s" if total is not None else ""
    line += f"; failed: {', '.join(failed)}" if failed else ""
    err = _d(report.get("error"))
    extra = (f'<p class="error">{e(err.get("type"))}: {e(err.get("message"))}'
             f'{" (rank " + e(err.get("rank")) + ")" if err.get("rank") is not None else ""}'
             '</p>') if err else ""
    who = (f"{e(report.get('world_size', '?'))} ranks on {e(report.get('nodes', '?'))} node(s), "
           f"backend {e(report.get('backend', '?'))} &middot; run {e(report.get('run_id') or '?')}")
    practice = (f'<p id="practice" class="practice">{e(practice_note(report))}: the failures '
                'below test the alerting path; no host is to blame and none is listed to drain'
                '</p>') if injected(report) else ""
    return (f'<header class="verdict {e(verdict)}"><h1><span id="verdict">{e(verdict.upper())}'
            f'</span> <small>ddp-smoke</small></h1>{practice}<p>{e(line)}</p><p>{who}</p>{extra}'
            '</header>')


def sec_culprits(report: dict) -> str:
    rows = []
    for c in checks_of(report):
        for k in _l(c.get("culprits")):
            k = _d(k)
            where = f'<div class="muted">at {e(k["where"])}</div>' if k.get("where") else ""
            rows.append(f'<li class="culprit"><b>{_who(k)}</b> <span class="muted">'
                        f'{e(c.get("name"))}</span><div>{e(k.get("reason"))}</div>{where}</li>')
    if not rows:
        fail = report.get("verdict") != "pass"
        text = ("no culprit named: the evidence names no rank, host or link (see the checks)"
                if fail else "none: every check passed")
        return f'<section id="culprits"><h2>Culprits</h2><p>{e(text)}</p></section>'
    return (f'<section id="culprits"><h2>Culprits</h2><ul class="culprits">{"".join(rows)}'
            f'</ul></section>')


def sec_next(report: dict) -> str:
    lines = next_commands(_hosts(report), str(report.get("run_id") or ""))
    if not lines or injected(report):  # nothing to drain after a failure made on purpose
        return ""
    return (f'<section id="next"><h2>Next steps <small>(printed, not run)</small></h2>'
            f'<pre>{e(chr(10).join(lines))}</pre></section>')


def sec_hosts(report: dict, hist: dict | None) -> str:
    hosts = _hosts(report)
    # a practice run's hosts are named by a failure made on purpose: "practice", never "bad"
    practice = injected(report)

    def status(h: dict) -> str:
        return "practice" if practice and h.get("status") != "good" else h.get("status")
    past = {h["entity"]: h for h in (hist or {}).get("hosts", [])}
    order = {"bad": 0, "suspect": 1}
    ranked = sorted(hosts, key=lambda h: order.get(h.get("status"), 2))
    shown = [h for h in ranked if h.get("status") != "good"] + \
        [h for h in ranked if h.get("status") == "good"][:MAX_ROWS]
    rows = []
    for h in shown:
        reasons = "".join(f'<li>{e(_d(r).get("check"))}: {e(_d(r).get("reason"))}</li>'
                          for r in _l(h.get("reasons")))
        node = " ".join(f'{k.split("_")[0]} {e(h[k])}' for k in ("slurm_node", "k8s_node")
                        if h.get(k))
        node += "".join(f'<div>{e(rail_label(r))}: {_chip(status(r))}</div>'
                        for r in map(_d, _l(h.get("rails"))))
        ranks = _l(h.get("ranks"))
        rank_text = ", ".join(str(r) for r in ranks[:16]) + (" …" if len(ranks) > 16 else "")
        cell = ""
        if hist is not None:
            p = past.get(h.get("host"))
            cell = "<td>" + (_history_cell(p) if p else '<span class="muted">none</span>') \
                + "</td>"
        rows.append(f'<tr><td><b>{e(h.get("host"))}</b><div class="muted">{node}</div></td>'
                    f'<td>{_chip(status(h))}</td><td>{e(rank_text)}</td>'
                    f'<td><ul class="plain">{reasons}</ul></td>{cell}</tr>')
    more = len(hosts) - len(shown)
    tail = f'<p class="muted">and {more} more good hosts (report.json, good_hosts.txt)</p>' \
        if more > 0 else ""
    counts = ", ".join(f"{sum(status(h) == v for h in hosts)} {v}"
                       for v in ("practice", "bad", "suspect", "good")
                       if v != "practice" or practice)
    head = "<th>history</th>" if hist is not None else ""
    return (f'<section id="hosts"><h2>Hosts <small>{e(counts)}</small></h2><div class="scroll">'
            f'<table><thead><tr><th>host</th><th>status</th><th>ranks</th><th>reasons</th>'
            f'{head}</tr></thead><tbody>{"".join(rows)}</tbody></table></div>{tail}</section>')


def _history_cell(ent: dict) -> str:
    out = []
    for r in ent["figures"]:
        flag = ' <span class="chip bad">degrading</span>' if r["degrading"] else ""
        change = "" if r["change"] is None else f" {r['change']:+.0%}"
        label = (f"{r['figure']}: {' '.join(fmt(v) for v in r['values'][-12:])} {r['unit']}")
        out.append(f'<div class="hist">{sparkline(r["values"][-24:], r["degrading"], label)} '
                   f'<span class="muted">{e(r["figure"])}</span> {fmt(r["last"])}'
                   f'{e(change)}{flag}</div>')
    if ent.get("statuses"):
        statuses = " ".join(v for v, _ in ent["statuses"][-12:])
        out.append(f'<div class="muted">statuses: {e(statuses)}</div>')
    return "".join(out)


def sec_checks(report: dict) -> str:
    rows = []
    for c in checks_of(report):
        status = str(c.get("status") or "?")
        rows.append(f'<tr><td>{e(c.get("name"))}</td><td>{_chip(status)}</td>'
                    f'<td class="num">{seconds(c.get("duration_s"))}</td>'
                    f'<td>{e(c.get("summary") or "")}</td></tr>')
    return (f'<section id="checks"><h2>Checks</h2><div class="scroll"><table><thead><tr>'
            f'<th>check</th><th>status</th><th>s</th><th>result</th></tr></thead><tbody>'
            f'{"".join(rows)}</tbody></table></div></section>')


def sec_gpus(report: dict) -> str:
    """Every GPU the health check read, per node: identity, the rank using it, its worst finding."""
    health = check_of(report, "health") or {}
    nodes = [_d(n) for n in _l(_d(health.get("figures")).get("nodes"))]
    rows = []
    for n in nodes:
        for g in [_d(g) for g in _l(n.get("gpus"))][:MAX_ROWS]:
            status = str(g.get("status") or "ok")
            rows.append(f'<tr><td>{e(n.get("host"))}</td><td class="num">{e(g.get("index"))}</td>'
                        f'<td>{e(g.get("bus_id"))}</td><td>{e(g.get("serial"))}</td>'
                        f'<td class="num">{e(g.get("rank"))}</td>'
                        f'<td>{_chip("pass" if status == "ok" else status)}</td>'
                        f'<td class="num">{e(g.get("temp_max_c"))}</td>'
                        f'<td>{e(g.get("pcie_busy"))}</td><td class="num">'
                        f'{e(g.get("nvlink_up"))}</td></tr>')
    if not rows:
        return ""
    replayed = [n.get("host") for n in nodes if n.get("replay")]
    note = (f'<p class="muted">replayed from a recording, not the hardware: '
            f'{e(", ".join(str(h) for h in replayed))}</p>' if replayed else "")
    return (f'<section id="gpus"><h2>GPUs</h2>{note}<div class="scroll"><table><thead><tr>'
            f'<th>host</th><th>GPU</th><th>bus id</th><th>serial</th><th>rank</th>'
            f'<th>health</th><th>max °C</th><th>PCIe under load</th><th>NVLink up</th></tr>'
            f'</thead><tbody>{"".join(rows)}</tbody></table></div></section>')


def sec_victims(report: dict) -> str:
    rows = []
    for c in checks_of(report):
        for v in map(_d, _l(_d(c.get("figures")).get("victims"))):
            rows.append(f'<tr><td>{e(v.get("rank"))}</td><td>{e(v.get("host"))}</td>'
                        f'<td>{e(c.get("name"))}</td><td>{e(v.get("state"))}</td></tr>')
    if not rows:
        return ""
    more = f'<p class="muted">{len(rows) - MAX_ROWS} more in report.json</p>' \
        if len(rows) > MAX_ROWS else ""
    return (f'<section id="victims"><h2>Victims <small>stopped by the culprit, not at fault'
            f'</small></h2><div class="scroll"><table><thead><tr><th>rank</th><th>host</th>'
            f'<th>check</th><th>what it was doing</th></tr></thead><tbody>'
            f'{"".join(rows[:MAX_ROWS])}</tbody></table></div>{more}</section>')


def sec_history(hist: dict | None) -> str:
    if not hist:
        return ""
    s = hist["settings"]
    rows = []
    for ent in hist.get("hosts", []) + hist.get("gpus", []):
        if ent["figures"]:
            rows.append(f'<tr><td>{e(ent["label"])}</td><td>{_history_cell(ent)}</td></tr>')
    note = "" if hist.get("complete") else " (index not complete within the run's budget)"
    return (f'<section id="history"><h2>History <small>{e(hist["runs"])} runs under '
            f'{e(hist["root"])}{e(note)}</small></h2><p class="muted">degrading = more than '
            f'{e(s.get("margin_cpu"))} (CPU) / {e(s.get("margin"))} (GPU) below the median of the '
            f'{e(s.get("window"))} runs before (at least {e(s.get("min_runs"))}); '
            f'<code>ddp-smoke history {e(hist["root"])}</code> prints them all.</p>'
            f'<div class="scroll"><table><tbody>{"".join(rows)}</tbody></table></div></section>')


def _launcher(report: dict) -> str:
    env = next((_d(x) for x in _l(_d(check_of(report, "environment").get("figures")).get("env"))),
               {})
    for key, name in (("SLURM_JOB_ID", "Slurm job"), ("SUBMITIT_FOLDER", "submitit"),
                      ("KUBERNETES_SERVICE_HOST", "Kubernetes"),
                      ("TORCHELASTIC_RUN_ID", "torchrun")):
        if env.get(key):
            return f"{name} {env[key]}" if key == "SLURM_JOB_ID" else name
    rid = str(report.get("run_id") or "")
    return rid.split("-")[0] if "-" in rid else "?"


def sec_identity(report: dict) -> str:
    versions = next((_d(v) for v in _l(_d(check_of(report, "environment").get("figures"))
                                       .get("versions"))), {})
    cfg = _d(report.get("config"))
    facts = [("run id", report.get("run_id")), ("started", report.get("started_at")),
             ("launcher", _launcher(report)), ("ddp-smoke", report.get("version")),
             ("backend", report.get("backend")), ("level", cfg.get("level")),
             ("profile", cfg.get("profile") or "cpu"),
             *[(k, v) for k, v in versions.items() if v]]
    timings = ", ".join(f"{k} {seconds(v) if k.endswith('_s') else fmt(v)}"
                        for k, v in _d(report.get("timings")).items())
    dl = "".join(f"<dt>{e(k)}</dt><dd>{e(v)}</dd>" for k, v in facts if v is not None)
    ranks = [_d(r) for r in _l(report.get("ranks"))]
    chain = {c.get("rank"): c for c in map(_d, _l(_d(check_of(report, "rails")
                                                       .get("figures")).get("ranks")))}
    rows = []
    for r in ranks[:MAX_ROWS]:
        ident = _d(r.get("identity"))
        gpu = " ".join(str(x) for x in (r.get("gpu_name"), r.get("gpu_bus_id"),
                                        ident.get("gpu_serial")) if x)
        link = chain.get(r.get("rank"), {})  # the rails check's rank -> NIC chain
        nic = " ".join(str(x) for x in (link.get("sent_on"), _d(link.get("nic")).get("pci"),
                                        link.get("link")) if x)
        rows.append(f'<tr><td>{e(r.get("rank"))}</td><td>{e(r.get("local_rank"))}</td>'
                    f'<td>{e(r.get("host"))}</td><td>{e(r.get("device"))}</td><td>{e(gpu)}</td>'
                    f'<td>{e(nic)}</td>'
                    f'<td>{e(r.get("route_address") or r.get("missing") or "")}</td></tr>')
    more = f'<p class="muted">and {len(ranks) - MAX_ROWS} more ranks in report.json</p>' \
        if len(ranks) > MAX_ROWS else ""
    forensics = "".join(f'<li>rank {e(_d(x).get("rank"))}: {e(_d(x).get("stacks"))}, '
                        f'{e(_d(x).get("flight_recorder"))}</li>'
                        for x in _l(report.get("forensics"))[:MAX_ROWS])
    forensics = f"<h3>Forensics (on each rank's node)</h3><ul>{forensics}</ul>" if forensics \
        else ""
    return (f'<section id="identity"><h2>Run</h2><dl>{dl}</dl><p class="muted">timings (s): '
            f'{e(timings)}</p><div class="scroll"><table><thead><tr><th>rank</th><th>local</th>'
            f'<th>host</th><th>device</th><th>GPU</th><th>NIC (rail)</th><th>address</th></tr>'
            f'</thead><tbody>'
            f'{"".join(rows)}</tbody></table></div>{more}{forensics}</section>')


CSS = """
:root{color-scheme:light}*{box-sizing:border-box}
body{margin:0;font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;
color:#1f2328;background:#f6f8fa}
main{max-width:1080px;margin:0 auto;padding:12px}
section,header{background:#fff;border:1px solid #d0d7de;border-radius:8px;padding:12px 16px;
margin:0 0 12px}
h1{margin:0;font-size:2em}h1 small{font-size:.45em;font-weight:normal;opacity:.8}
h2{margin:0 0 8px;font-size:1.2em}h2 small,h3 small{font-weight:normal;color:#57606a}
h3{font-size:1em;margin:12px 0 4px}
header.verdict p{margin:4px 0}
header.pass{background:#dafbe1;border-color:#1a7f37}header.fail{background:#ffebe9;
border-color:#cf222e}header.pass h1{color:#1a7f37}header.fail h1{color:#cf222e}
.error{font-family:ui-monospace,monospace;font-size:.9em}
.practice{background:#fff1a8;border:2px dashed #9a6700;padding:6px 10px;font-weight:bold}
.muted{color:#57606a;font-size:.9em}
.culprits{padding-left:18px}.culprit{margin:0 0 8px}
pre{background:#f6f8fa;padding:8px;overflow-x:auto;white-space:pre-wrap;word-break:break-all;
font-size:.85em}
.scroll{overflow-x:auto}
table{border-collapse:collapse;width:100%;font-size:.9em}
th,td{border-bottom:1px solid #d8dee4;padding:4px 6px;text-align:left;vertical-align:top}
td.num{text-align:right;font-variant-numeric:tabular-nums}
ul.plain{margin:0;padding-left:16px}
.chip{display:inline-block;padding:0 8px;border-radius:10px;background:#d0d7de;font-size:.85em;
color:#000}
.chip.pass,.chip.good{background:#aceebb}.chip.fail,.chip.bad{background:#ffcecb}
.chip.suspect,.chip.practice{background:#fff1a8}.chip.skip{background:#eaeef2}
svg.chart{width:100%;height:auto;max-width:760px;display:block}
table.timeline svg.chart{min-width:260px}
svg.spark{width:120px;height:26px;vertical-align:middle}
.hist{white-space:nowrap}
.plot{fill:#fff;stroke:#d0d7de}.grid{stroke:#eaeef2}
.tick{font-size:11px;fill:#57606a}.axis{font-size:12px;fill:#1f2328}.legend{font-size:12px}
.cell{font-size:10px;fill:#000}.diag{fill:#57606a}.unmeasured{fill:#eaeef2}
.pairs{display:flex;flex-wrap:wrap;gap:12px;align-items:flex-start}
.pairs svg.chart{max-width:520px;flex:1 1 280px}.key{font-size:.85em;margin:0}
dl{display:grid;grid-template-columns:max-content 1fr;gap:2px 12px;margin:0}
dt{color:#57606a}dd{margin:0;word-break:break-all}
footer{color:#57606a;font-size:.8em;text-align:center;padding:8px}
@media (max-width:600px){body{font-size:14px}main{padding:6px}
section,header{padding:8px 10px}h1{font-size:1.6em}}
@media print{body{background:#fff}main{max-width:none;padding:0}
section,header{border:none;border-top:1px solid #999;border-radius:0;break-inside:avoid}
.scroll{overflow:visible}*{-webkit-print-color-adjust:exact;print-color-adjust:exact}}
"""


def render(report, hist: dict | None = None, source: str = "report.json") -> str:
    """The whole page (pure). ``report`` is a report.json dict; anything else renders too."""
    problems = []
    if not isinstance(report, dict):
        problems.append(f"the report is not a JSON object but {type(report).__name__}")
        report = {}
    missing = [k for k in ("verdict", "run_id", "ranks", "checks") if k not in report]
    if missing and report:
        problems.append(f"the report lacks {', '.join(missing)}: partial or another version")
    parts = []
    sections = [sec_verdict, sec_culprits, sec_next, lambda r: sec_hosts(r, hist), sec_checks,
                sec_gpus, sec_bandwidth, sec_pairs, sec_compute, sec_training, sec_timeline,
                sec_victims, lambda r: sec_history(hist), sec_identity]
    for section in sections:
        try:
            parts.append(section(report))
        except Exception as ex:  # noqa: BLE001 — one odd field must not cost the whole page
            name = getattr(section, "__name__", "section").replace("sec_", "")
            parts.append(f'<section><p class="error">{e(name)}: not drawn ({e(type(ex).__name__)}'
                         f': {e(ex)})</p></section>')
    warn = "".join(f'<section id="problems"><p class="error">{e(p)}</p></section>'
                   for p in problems)
    verdict = str(report.get("verdict") or "unknown").upper()
    verdict += " (PRACTICE)" if injected(report) else ""
    title = f"ddp-smoke {verdict} · {report.get('run_id') or source}"
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; "
            "style-src 'unsafe-inline'; img-src data:\">"
            f"<title>{e(title)}</title><style>{CSS}</style></head><body><main>"
            f"{parts[0]}{warn}{''.join(parts[1:])}<footer>ddp-smoke {e(__version__)} page from "
            f"{e(source)}; every figure is in report.json</footer></main></body></html>\n")


def write(report, report_dir: str, history_budget_s: float | None = 2.0) -> str | None:
    """Rank 0: write ``report_dir/report.html`` (atomically) beside report.json; its path.

    Never raises: the verdict is on disk already; a page that cannot be written costs one
    line on stderr.
    """
    path = os.path.join(report_dir, FILENAME)
    try:
        data = report if isinstance(report, dict) else finite(as_dict(report))  # as the JSON
        hist = _history(data, os.path.join(report_dir, "report.json"), history_budget_s)
        write_atomic(path, render(data, hist, source=os.path.join(report_dir, "report.json")))
        return path
    except Exception as ex:  # noqa: BLE001
        print(f"ddp-smoke: {FILENAME} not written ({type(ex).__name__}: {ex})", file=sys.stderr)
        return None


def _history(report: dict, report_path: str, budget_s: float | None) -> dict | None:
    try:
        return history.for_report(report, report_path, budget_s)
    except Exception as ex:  # noqa: BLE001 — history is extra; the page comes without it
        print(f"ddp-smoke: history not drawn ({type(ex).__name__}: {ex})", file=sys.stderr)
        return None


def render_file(report_path: str, output: str | None = None) -> str:
    """``ddp-smoke render``: rebuild the page of any report.json; return the page's path.

    Raises:
        ConfigError: the report cannot be read or is not JSON, or the page cannot be written.
    """
    try:
        with open(report_path, encoding="utf-8", errors="replace") as f:
            data = json.load(f)
    except OSError as ex:
        raise ConfigError(f"render: {report_path}: {ex.strerror}") from None
    except ValueError as ex:
        raise ConfigError(f"render: {report_path}: not JSON ({ex})") from None
    out = output or os.path.join(os.path.dirname(os.path.abspath(report_path)), FILENAME)
    hist = _history(data, os.path.abspath(report_path), None) if isinstance(data, dict) else None
    try:
        write_atomic(out, render(data, hist, source=report_path))
    except ReportWriteError as ex:
        raise ConfigError(f"render: {ex}") from None
    return out
