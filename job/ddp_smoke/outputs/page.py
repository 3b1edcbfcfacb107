"""``report.html``: one self-contained page, built from report.json alone.

For the people who read a run without having run it (the vendor replacing a GPU, the colleague
signing off a cluster, the on-call engineer): the verdict and the culprits first, with the next
commands; then the hosts, busbw by size against the profile's floor, the node-pair heatmap, per
rank compute, a timeline of stages per rank with where the run stopped, the victims, the run's
identity, and each host's and GPU's history when the report's root holds earlier runs.

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

import html
import json
import math
import os
import sys

from .. import __version__
from . import history

FILENAME = "report.html"
MAX_ROWS = 64  # ranks, hosts, bars: beyond this a table says how many more are in report.json
PALETTE = ("#0072b2", "#e69f00", "#009e73", "#cc79a7", "#56b4e9", "#d55e00", "#666666")
OK, BAD, WARN, SKIP = "#1a7f37", "#cf222e", "#bf8700", "#8c959f"

_d, _l, _num, human_bytes = history._d, history._l, history._num, history.human_bytes


def e(value) -> str:
    """Escape anything for HTML text or a double-quoted attribute."""
    return html.escape(str(value), quote=True)


def _fmt(v, digits: int = 4) -> str:
    v = _num(v)
    return "-" if v is None else f"{v:.{digits}g}"


# -- SVG pieces -------------------------------------------------------------------------------

def _svg(w: int, h: int, label: str, body: list[str]) -> str:
    return (f'<svg class="chart" viewBox="0 0 {w} {h}" role="img" aria-label="{e(label)}" '
            f'xmlns="http://www.w3.org/2000/svg"><title>{e(label)}</title>{"".join(body)}</svg>')


def _nice_max(v: float) -> float:
    if v <= 0:
        return 1.0
    step = 10 ** math.floor(math.log10(v))
    for m in (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10):
        if m * step >= v:
            return m * step
    return 10 * step


def line_chart(series: list[tuple[str, list[tuple[float, float]]]],
               floors: list[dict], label: str, ylabel: str) -> str:
    """y against log2(x), one line per series; floors as marks at their x with their value."""
    W, H, L, R, T, B = 720, 330, 62, 20, 14, 58
    xs = sorted({x for _, pts in series for x, _ in pts} | {f["x"] for f in floors})
    ys = [y for _, pts in series for _, y in pts] + [f["y"] for f in floors]
    if not xs or not ys:
        return '<p class="muted">nothing measured</p>'
    lo, hi = math.log2(xs[0]), math.log2(xs[-1])
    ymax = _nice_max(max(ys))

    def px(x):
        return L + (W - L - R) * ((math.log2(x) - lo) / (hi - lo) if hi > lo else 0.5)

    def py(y):
        return T + (H - T - B) * (1 - y / ymax)

    body = [f'<rect x="{L}" y="{T}" width="{W - L - R}" height="{H - T - B}" class="plot"/>']
    for i in range(6):
        y = ymax * i / 5
        body.append(f'<line x1="{L}" x2="{W - R}" y1="{py(y):.1f}" y2="{py(y):.1f}" '
                    f'class="grid"/><text x="{L - 6}" y="{py(y) + 4:.1f}" class="tick" '
                    f'text-anchor="end">{_fmt(y, 3)}</text>')
    every = max(1, math.ceil(len(xs) / 9))
    for i, x in enumerate(xs):
        if i % every == 0 or i == len(xs) - 1:
            body.append(f'<text x="{px(x):.1f}" y="{H - B + 16}" class="tick" '
                        f'text-anchor="middle">{e(human_bytes(x))}</text>')
    body.append(f'<text x="{(L + W - R) / 2}" y="{H - B + 34}" class="axis" '
                f'text-anchor="middle">message size (bytes, nccl-tests\' S)</text>'
                f'<text x="14" y="{(T + H - B) / 2}" class="axis" text-anchor="middle" '
                f'transform="rotate(-90 14 {(T + H - B) / 2})">{e(ylabel)}</text>')
    for n, (name, pts) in enumerate(series):
        colour = PALETTE[n % len(PALETTE)]
        pts = sorted(pts)
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        body.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        for x, y in pts:
            body.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{colour}">'
                        f'<title>{e(name)} {e(human_bytes(x))}: {_fmt(y)}</title></circle>')
        body.append(f'<text x="{L + 8 + 130 * n}" y="{H - 6}" class="legend" fill="{colour}">'
                    f'&#9632; {e(name)}</text>')
    for f in floors:
        x, y = px(f["x"]), py(f["y"])
        colour = OK if f.get("ok") else BAD
        body.append(f'<line x1="{x - 26:.1f}" x2="{x + 6:.1f}" y1="{y:.1f}" y2="{y:.1f}" '
                    f'stroke="{colour}" stroke-width="3" stroke-dasharray="5 3"><title>'
                    f'{e(f["label"])}</title></line><text x="{x - 28:.1f}" y="{y - 5:.1f}" '
                    f'class="tick" text-anchor="end" fill="{colour}">{e(f["label"])}</text>')
    return _svg(W, H, label, body)


def _ratio_colour(r: float) -> str:
    r = min(1.0, max(0.0, r))
    return f"hsl({120 * r:.0f},60%,{78 - 18 * r:.0f}%)"


def heatmap(names: list[str], cells: dict[tuple[int, int], dict], ref: float | None,
            label: str) -> str:
    """A symmetric node-pair matrix: colour = busbw / reference, slow pairs outlined."""
    n = len(names)
    cell = max(8, min(44, 640 // max(n, 1)))
    L, T = 34, 22
    W, H = L + cell * n + 10, T + cell * n + 10
    body = []
    for i in range(n):
        body.append(f'<text x="{L - 4}" y="{T + cell * i + cell / 2 + 4:.1f}" class="tick" '
                    f'text-anchor="end">{i + 1}</text>')
        body.append(f'<text x="{L + cell * i + cell / 2:.1f}" y="{T - 6}" class="tick" '
                    f'text-anchor="middle">{i + 1}</text>')
        for j in range(n):
            x, y = L + cell * j, T + cell * i
            c = cells.get((min(i, j), max(i, j)))
            if i == j:
                body.append(f'<rect x="{x}" y="{y}" width="{cell}" height="{cell}" '
                            f'class="diag"/>')
                continue
            if c is None:
                body.append(f'<rect x="{x}" y="{y}" width="{cell}" height="{cell}" '
                            f'class="unmeasured"><title>{e(names[i])} - {e(names[j])}: not '
                            f'measured</title></rect>')
                continue
            v = c["busbw"]
            fill = _ratio_colour(v / ref) if ref else "#ddd"
            stroke = ' stroke="#000" stroke-width="3"' if c["slow"] else ""
            body.append(f'<rect x="{x}" y="{y}" width="{cell}" height="{cell}" fill="{fill}"'
                        f'{stroke}><title>{e(names[i])} - {e(names[j])}: {_fmt(v)} GB/s'
                        f'{" (slow)" if c["slow"] else ""}</title></rect>')
            if cell >= 36:
                body.append(f'<text x="{x + cell / 2:.1f}" y="{y + cell / 2 + 4:.1f}" '
                            f'class="cell" text-anchor="middle">{_fmt(v, 2)}</text>')
    return _svg(W, H, label, body)


def bars(rows: list[dict], marks: list[dict], label: str, unit: str) -> str:
    """Horizontal bars (rank label, value, bad?) with vertical reference marks."""
    W, L, R, row = 720, 190, 70, 20
    H = 26 + row * len(rows)
    top = max([r["value"] for r in rows] + [m["value"] for m in marks] + [1e-12])
    scale = (W - L - R) / (top * 1.05)
    body = []
    for i, r in enumerate(rows):
        y = 6 + row * i
        colour = BAD if r.get("bad") else PALETTE[0]
        body.append(f'<text x="{L - 6}" y="{y + 13}" class="tick" text-anchor="end">'
                    f'{e(r["label"])}</text><rect x="{L}" y="{y + 2}" '
                    f'width="{max(1.0, r["value"] * scale):.1f}" height="{row - 6}" '
                    f'fill="{colour}"><title>{e(r["label"])}: {_fmt(r["value"])} {e(unit)}'
                    f'</title></rect><text x="{L + r["value"] * scale + 4:.1f}" y="{y + 13}" '
                    f'class="tick">{_fmt(r["value"])}</text>')
    for m in marks:
        x = L + m["value"] * scale
        body.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="2" y2="{H - 20}" '
                    f'stroke="{m["colour"]}" stroke-width="2" stroke-dasharray="4 3"/>'
                    f'<text x="{x:.1f}" y="{H - 6}" class="tick" text-anchor="middle" '
                    f'fill="{m["colour"]}">{e(m["label"])}</text>')
    return _svg(W, H, label, body)


def sparkline(values: list[float], degrading: bool, label: str) -> str:
    W, H = 120, 26
    if not values:
        return ""
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    step = (W - 8) / max(1, len(values) - 1)
    pts = [(4 + step * i if len(values) > 1 else W / 2, H - 4 - (v - lo) / span * (H - 8))
           for i, v in enumerate(values)]
    colour = BAD if degrading else PALETTE[0]
    x, y = pts[-1]
    return (f'<svg class="spark" viewBox="0 0 {W} {H}" role="img" aria-label="{e(label)}" '
            f'xmlns="http://www.w3.org/2000/svg"><title>{e(label)}</title><polyline points="'
            + " ".join(f"{a:.1f},{b:.1f}" for a, b in pts) +
            f'" fill="none" stroke="{colour}" stroke-width="1.5"/><circle cx="{x:.1f}" '
            f'cy="{y:.1f}" r="2.5" fill="{colour}"/></svg>')


# -- sections -------------------------------------------------------------------------------

def _checks(report: dict) -> list[dict]:
    return [_d(c) for c in _l(report.get("checks"))]


def _check(report: dict, name: str) -> dict:
    return next((c for c in _checks(report) if c.get("name") == name), {})


def _hosts(report: dict) -> list[dict]:
    hosts = report.get("hosts")
    if isinstance(hosts, list) and all(isinstance(h, dict) and h.get("host") for h in hosts):
        return hosts
    from .. import triage
    return triage.hosts_section(report)  # an older report without the section


def _who(c: dict) -> str:
    if c.get("rank") is not None:
        return e(f"rank {c.get('rank')} ({c.get('host')})")
    ranks, hosts = _l(c.get("ranks")), _l(c.get("hosts"))
    if ranks or hosts:
        ends = [f"{h} (rank {r})" for r, h in zip(ranks or [None] * len(hosts), hosts or ranks)]
        return "link " + " &lt;-&gt; ".join(e(x) for x in ends)
    return "no single rank"


def _chip(verdict) -> str:
    v = str(verdict or "unknown").lower()
    return f'<span class="chip {e(v)}">{e(v)}</span>'


def sec_verdict(report: dict) -> str:
    verdict = str(report.get("verdict") or "unknown").lower()
    checks = _checks(report)
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
    return (f'<header class="verdict {e(verdict)}"><h1><span id="verdict">{e(verdict.upper())}'
            f'</span> <small>ddp-smoke</small></h1><p>{e(line)}</p><p>{who}</p>{extra}</header>')


def sec_culprits(report: dict) -> str:
    rows = []
    for c in _checks(report):
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
    from .. import triage
    lines = triage.next_commands(_hosts(report), str(report.get("run_id") or ""))
    if not lines:
        return ""
    return (f'<section id="next"><h2>Next steps <small>(printed, not run)</small></h2>'
            f'<pre>{e(chr(10).join(lines))}</pre></section>')


def sec_hosts(report: dict, hist: dict | None) -> str:
    hosts = _hosts(report)
    past = {h["entity"]: h for h in (hist or {}).get("hosts", [])}
    order = {"bad": 0, "suspect": 1}
    ranked = sorted(hosts, key=lambda h: order.get(h.get("verdict"), 2))
    shown = [h for h in ranked if h.get("verdict") != "good"] + \
        [h for h in ranked if h.get("verdict") == "good"][:MAX_ROWS]
    rows = []
    for h in shown:
        reasons = "".join(f'<li>{e(_d(r).get("check"))}: {e(_d(r).get("reason"))}</li>'
                          for r in _l(h.get("reasons")))
        node = " ".join(f'{k.split("_")[0]} {e(h[k])}' for k in ("slurm_node", "k8s_node")
                        if h.get(k))
        ranks = _l(h.get("ranks"))
        rank_text = ", ".join(str(r) for r in ranks[:16]) + (" …" if len(ranks) > 16 else "")
        cell = ""
        if hist is not None:
            p = past.get(h.get("host"))
            cell = "<td>" + (_history_cell(p) if p else '<span class="muted">none</span>') \
                + "</td>"
        rows.append(f'<tr><td><b>{e(h.get("host"))}</b><div class="muted">{node}</div></td>'
                    f'<td>{_chip(h.get("verdict"))}</td><td>{e(rank_text)}</td>'
                    f'<td><ul class="plain">{reasons}</ul></td>{cell}</tr>')
    more = len(hosts) - len(shown)
    tail = f'<p class="muted">and {more} more good hosts (report.json, good_hosts.txt)</p>' \
        if more > 0 else ""
    counts = ", ".join(f"{sum(h.get('verdict') == v for h in hosts)} {v}"
                       for v in ("bad", "suspect", "good"))
    head = "<th>history</th>" if hist is not None else ""
    return (f'<section id="hosts"><h2>Hosts <small>{e(counts)}</small></h2><div class="scroll">'
            f'<table><thead><tr><th>host</th><th>verdict</th><th>ranks</th><th>reasons</th>'
            f'{head}</tr></thead><tbody>{"".join(rows)}</tbody></table></div>{tail}</section>')


def _history_cell(ent: dict) -> str:
    out = []
    for r in ent["figures"]:
        flag = ' <span class="chip bad">degrading</span>' if r["degrading"] else ""
        change = "" if r["change"] is None else f" {r['change']:+.0%}"
        label = (f"{r['figure']}: {' '.join(_fmt(v) for v in r['values'][-12:])} {r['unit']}")
        out.append(f'<div class="hist">{sparkline(r["values"][-24:], r["degrading"], label)} '
                   f'<span class="muted">{e(r["figure"])}</span> {_fmt(r["last"])}'
                   f'{e(change)}{flag}</div>')
    if ent.get("verdicts"):
        out.append(f'<div class="muted">verdicts: {e(" ".join(ent["verdicts"][-12:]))}</div>')
    return "".join(out)


def sec_checks(report: dict) -> str:
    rows = []
    for c in _checks(report):
        status = str(c.get("status") or "?")
        rows.append(f'<tr><td>{e(c.get("name"))}</td><td>{_chip(status)}</td>'
                    f'<td class="num">{_fmt(c.get("duration_s"), 3)}</td>'
                    f'<td>{e(c.get("summary") or "")}</td></tr>')
    return (f'<section id="checks"><h2>Checks</h2><div class="scroll"><table><thead><tr>'
            f'<th>check</th><th>status</th><th>s</th><th>result</th></tr></thead><tbody>'
            f'{"".join(rows)}</tbody></table></div></section>')


def sec_bandwidth(report: dict) -> str:
    c = _check(report, "bandwidth")
    f = _d(c.get("figures"))
    rows = [_d(r) for r in _l(f.get("results"))]
    if not rows:
        return ""
    series: dict[str, list] = {}
    for r in rows:
        x, y = _num(r.get("size_bytes")), _num(r.get("busbw_gbps"))
        if x and x > 0 and y is not None:
            series.setdefault(str(r.get("collective")), []).append((x, y))
    floors = []
    for fl in _l(_d(f.get("floors")).get("results")):
        fl = _d(fl)
        x, y = _num(fl.get("size_bytes")), _num(fl.get("min_busbw_gbps"))
        if x and x > 0 and y is not None:
            floors.append({"x": x, "y": y, "ok": fl.get("ok"),
                           "label": f"{fl.get('collective')} floor {_fmt(y)}"})
    applied = _d(f.get("floors"))
    note = (f'<p class="muted">profile {e(f.get("profile"))}: '
            f'{e(applied.get("reason") or "floors applied" if applied else "no floors")}</p>')
    chart = line_chart(sorted(series.items()), floors,
                       f"busbw by message size, {f.get('world_size')} ranks", "busbw (GB/s)")
    return (f'<section id="bandwidth"><h2>Bandwidth <small>busbw as nccl-tests defines it; '
            f'GB = 1e9 B</small></h2>{note}{chart}</section>')


def sec_pairs(report: dict) -> str:
    pairs = _d(_d(_check(report, "bandwidth").get("figures")).get("pairs"))
    results = [_d(p) for p in _l(pairs.get("results"))]
    if not results:
        skipped = pairs.get("skipped")
        return (f'<section id="pairs"><h2>Node pairs</h2><p class="muted">{e(skipped)}</p>'
                f'</section>') if skipped and (_num(report.get("nodes")) or 0) > 1 else ""
    names: dict[int, str] = {}
    for p in results:
        for side in ("a", "b"):
            if isinstance(p.get(f"node_{side}"), int):
                names[p[f"node_{side}"]] = str(p.get(f"host_{side}"))
    order = sorted(names)
    pos = {node: i for i, node in enumerate(order)}
    cells = {}
    for p in results:
        a, b, v = p.get("node_a"), p.get("node_b"), _num(p.get("busbw_gbps"))
        if a in pos and b in pos and v is not None:
            i, j = sorted((pos[a], pos[b]))
            cells[(i, j)] = {"busbw": v, "slow": bool(p.get("slow"))}
    ref = _num(pairs.get("reference_busbw_gbps"))
    labels = [names[n] for n in order]
    key = "".join(f"<li>{e(h)}</li>" for h in labels[:MAX_ROWS])
    slowest = sorted(results, key=lambda p: _num(p.get("busbw_gbps")) or 0)[:10]
    table = "".join(f'<tr><td>{e(p.get("host_a"))} &lt;-&gt; {e(p.get("host_b"))}</td>'
                    f'<td class="num">{_fmt(p.get("busbw_gbps"))}</td>'
                    f'<td>{"slow" if p.get("slow") else ""}</td></tr>' for p in slowest)
    return (f'<section id="pairs"><h2>Node pairs <small>sendrecv busbw (GB/s), '
            f'{e(human_bytes(pairs.get("size_bytes")))} per exchange; reference {_fmt(ref)} GB/s'
            f'</small></h2><div class="pairs">'
            f'{heatmap(labels, cells, ref, "node-pair bandwidth matrix")}'
            f'<ol class="key">{key}</ol></div><p class="muted">Colour: busbw against the '
            f'reference (green = at it, red = far below); outlined = judged slow; grey = not '
            f'paired.</p><div class="scroll"><table><thead><tr><th>slowest pairs</th>'
            f'<th>GB/s</th><th></th></tr></thead><tbody>{table}</tbody></table></div></section>')


def sec_compute(report: dict) -> str:
    c = _check(report, "compute")
    f = _d(c.get("figures"))
    ranks = [_d(r) for r in _l(f.get("ranks"))]
    if not ranks:
        return ""
    named = {k.get("rank") for k in map(_d, _l(c.get("culprits")))}
    out = []
    dtypes = list(dict.fromkeys(d for r in ranks for d in _d(r.get("matmul"))))
    for dtype in dtypes:
        rows = [{"rank": r.get("rank"), "value": _num(_d(_d(r.get("matmul")).get(dtype))
                                                      .get("tflops")),
                 "label": f"rank {r.get('rank')} {r.get('host')}", "bad": r.get("rank") in named}
                for r in ranks]
        rows = [r for r in rows if r["value"] is not None]
        note = ""
        if len(rows) > MAX_ROWS:
            rows = sorted(rows, key=lambda r: r["value"])[:MAX_ROWS]
            note = f'<p class="muted">the {MAX_ROWS} slowest of {len(ranks)} ranks</p>'
        marks = []
        median = _num(_d(f.get("median_tflops")).get(dtype))
        if median is not None:
            marks.append({"value": median, "colour": "#333", "label": f"median {_fmt(median)}"})
        floor = _num(_d(f.get("floors")).get(dtype))
        if floor is not None:
            marks.append({"value": floor, "colour": BAD, "label": f"floor {_fmt(floor)}"})
        if rows:
            out.append(f'<h3>{e(dtype)} matmul (TFLOPS, n = {e(f.get("matrix_size"))})</h3>'
                       f'{note}{bars(rows, marks, f"{dtype} TFLOPS per rank", "TFLOPS")}')
    hbm = [r for r in ranks if _num(r.get("hbm_gbps")) is not None]
    if hbm:
        out.append(bars([{"label": f"rank {r.get('rank')} {r.get('host')}",
                          "value": _num(r["hbm_gbps"])} for r in hbm[:MAX_ROWS]], [],
                        "HBM copy GB/s per rank", "GB/s"))
    return f'<section id="compute"><h2>Compute per rank</h2>{"".join(out)}</section>'


def _rank_states(report: dict, world: int) -> list[list[tuple[str, str]]]:
    """Per rank, per phase: (state, text). States: ok, culprit, victim, fail, skip."""
    checks = _checks(report)
    states = [[("ok", "")] for _ in range(world)]  # the start phase: every rank that has a row
    for c in checks:
        status = c.get("status")
        f = _d(c.get("figures"))
        culprits = [_d(k) for k in _l(c.get("culprits"))]
        guilty: dict[int, str] = {}
        for k in culprits:
            for r in ([k.get("rank")] if k.get("rank") is not None else _l(k.get("ranks"))):
                if isinstance(r, int):
                    guilty[r] = str(k.get("reason") or "")
        victims = {v.get("rank"): str(v.get("state") or "") for v in map(_d, _l(f.get("victims")))}
        progress = _d(f.get("progress"))
        for r in range(world):
            if status == "skip":
                states[r].append(("skip", str(c.get("summary") or "")))
            elif status != "fail":
                states[r].append(("ok", ""))
            elif r in guilty:
                states[r].append(("culprit", guilty[r]))
            elif r in victims:
                states[r].append(("victim", victims[r]))
            else:
                p = _d(progress.get(str(r)))
                text = (f"{'in' if p.get('inside') else 'after'} {p.get('op')} #{p.get('seq')}"
                        if p.get("op") else "")
                states[r].append(("fail" if not culprits or any(k.get("rank") is None and
                                                                not k.get("ranks")
                                                                for k in culprits)
                                  else "ok", text))
    return states


def sec_timeline(report: dict) -> str:
    checks = _checks(report)
    ranks = [_d(r) for r in _l(report.get("ranks"))]
    world = len(ranks) or int(_num(report.get("world_size")) or 0)
    if not checks or not world:
        return ""
    t = _d(report.get("timings"))
    start = sum(_num(t.get(k)) or 0 for k in ("load_checks_s", "connect_store_s", "rendezvous_s"))
    phases = [("start", start)] + [(str(c.get("name")), _num(c.get("duration_s")) or 0)
                                   for c in checks]
    total = sum(d for _, d in phases) or 1.0
    widths = [max(d / total, 0.04) for _, d in phases]
    widths = [w / sum(widths) for w in widths]
    states = _rank_states(report, world)
    groups: dict[tuple, list[int]] = {}
    for r in range(world):
        groups.setdefault(tuple(states[r]), []).append(r)
    colours = {"ok": OK, "culprit": BAD, "victim": WARN, "fail": "#e8a0a0", "skip": "#d0d7de"}
    W, H = 420, 18
    head = []
    x = 0.0
    for (name, dur), w in zip(phases, widths):
        head.append(f'<text x="{(x + w / 2) * W:.1f}" y="12" class="tick" text-anchor="middle">'
                    f'{e(name[:10])}</text>')
        x += w
    rows = [f'<tr><th>ranks</th><th>{_svg(W, H, "stages", head)}</th><th>where it stopped'
            f'</th></tr>']
    for signature, members in list(groups.items())[:MAX_ROWS]:
        body, x = [], 0.0
        for (state, text), (name, dur), w in zip(signature, phases, widths):
            body.append(f'<rect x="{x * W + 1:.1f}" y="2" width="{w * W - 2:.1f}" height="{H - 4}" '
                        f'fill="{colours.get(state, SKIP)}"><title>{e(name)}: {e(state)} '
                        f'({_fmt(dur, 3)} s) {e(text)}</title></rect>')
            x += w
        last = next(((s, txt, n) for (s, txt), (n, _) in zip(reversed(signature),
                                                            reversed(phases)) if s != "skip"),
                    ("ok", "", "start"))
        stopped = [s for s, _ in signature if s == "skip"]
        where = ("finished" if not stopped and last[0] == "ok" else
                 f"{last[0]} at {last[2]}" + (f": {last[1]}" if last[1] else ""))
        hosts = list(dict.fromkeys(str(ranks[r].get("host")) for r in members if r < len(ranks)))
        label = _ranges(members) + (f" ({', '.join(hosts[:3])}{' …' if len(hosts) > 3 else ''})"
                                    if hosts else "")
        rows.append(f'<tr><td>{e(label)}</td><td>{_svg(W, H, "stages of " + label, body)}</td>'
                    f'<td>{e(where)}</td></tr>')
    legend = " ".join(f'<span class="chip" style="background:{c}">{e(s)}</span>'
                      for s, c in colours.items())
    return (f'<section id="timeline"><h2>Timeline <small>stages per rank, width ~ time</small>'
            f'</h2><p>{legend}</p><div class="scroll"><table class="timeline">{"".join(rows)}'
            f'</table></div></section>')


def _ranges(ranks: list[int]) -> str:
    out, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    text = ", ".join(out[:8]) + (" …" if len(out) > 8 else "")
    return ("rank " if len(ranks) == 1 else "ranks ") + text


def sec_victims(report: dict) -> str:
    rows = []
    for c in _checks(report):
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
    env = next((_d(x) for x in _l(_d(_check(report, "environment").get("figures")).get("env"))),
               {})
    for key, name in (("SLURM_JOB_ID", "Slurm job"), ("SUBMITIT_FOLDER", "submitit"),
                      ("KUBERNETES_SERVICE_HOST", "Kubernetes"),
                      ("TORCHELASTIC_RUN_ID", "torchrun")):
        if env.get(key):
            return f"{name} {env[key]}" if key == "SLURM_JOB_ID" else name
    rid = str(report.get("run_id") or "")
    return rid.split("-")[0] if "-" in rid else "?"


def sec_identity(report: dict) -> str:
    versions = next((_d(v) for v in _l(_d(_check(report, "environment").get("figures"))
                                       .get("versions"))), {})
    cfg = _d(report.get("config"))
    facts = [("run id", report.get("run_id")), ("started", report.get("started_at")),
             ("launcher", _launcher(report)), ("ddp-smoke", report.get("version")),
             ("backend", report.get("backend")), ("level", cfg.get("level")),
             ("profile", cfg.get("profile") or "cpu"),
             *[(k, v) for k, v in versions.items() if v]]
    timings = ", ".join(f"{k} {_fmt(v, 3)}" for k, v in _d(report.get("timings")).items())
    dl = "".join(f"<dt>{e(k)}</dt><dd>{e(v)}</dd>" for k, v in facts if v is not None)
    ranks = [_d(r) for r in _l(report.get("ranks"))]
    rows = []
    for r in ranks[:MAX_ROWS]:
        ident = _d(r.get("identity"))
        gpu = " ".join(str(x) for x in (r.get("gpu_name"), r.get("gpu_bus_id"),
                                        ident.get("gpu_serial")) if x)
        rows.append(f'<tr><td>{e(r.get("rank"))}</td><td>{e(r.get("local_rank"))}</td>'
                    f'<td>{e(r.get("host"))}</td><td>{e(r.get("device"))}</td><td>{e(gpu)}</td>'
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
            f'<th>host</th><th>device</th><th>GPU</th><th>address</th></tr></thead><tbody>'
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
.chip.suspect{background:#fff1a8}.chip.skip{background:#eaeef2}
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
                sec_bandwidth, sec_pairs, sec_compute, sec_timeline, sec_victims,
                lambda r: sec_history(hist), sec_identity]
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
    from ..report import write_atomic  # late: report imports the triage this module uses

    path = os.path.join(report_dir, FILENAME)
    try:
        data = report if isinstance(report, dict) else json.loads(report.to_json())
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


def main(argv: list[str]) -> int:
    """``ddp-smoke render REPORT.json [-o OUT.html]``; exit 2 with one line on bad input."""
    from ..cli import Parser
    from ..config import ConfigError

    p = Parser(prog="ddp-smoke render",
               description="Rebuild report.html from a report.json (any version, partial too).")
    p.add_argument("report", metavar="REPORT.json")
    p.add_argument("-o", "--output", metavar="OUT.html",
                   help="where to write the page (default: report.html beside the report)")
    try:
        args = p.parse_args(argv)
        try:
            with open(args.report, encoding="utf-8", errors="replace") as f:
                data = json.load(f)
        except OSError as ex:
            raise ConfigError(f"render: {args.report}: {ex.strerror}") from None
        except ValueError as ex:
            raise ConfigError(f"render: {args.report}: not JSON ({ex})") from None
    except ConfigError as ex:
        print(f"ddp-smoke: error: {ex}", file=sys.stderr)
        return 2
    from ..report import ReportWriteError, write_atomic

    out = args.output or os.path.join(os.path.dirname(os.path.abspath(args.report)), FILENAME)
    hist = _history(data, os.path.abspath(args.report), None) if isinstance(data, dict) else None
    try:
        write_atomic(out, render(data, hist, source=args.report))
    except ReportWriteError as ex:
        print(f"ddp-smoke: error: {ex}", file=sys.stderr)
        return 2
    print(out)
    return 0
