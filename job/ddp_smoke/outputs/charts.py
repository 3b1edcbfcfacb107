"""The page's charts, drawn here as inline SVG: no script, no library, sharp in print.

The primitives (line chart, heatmap, bars, sparkline) each return one ``<svg>`` element whose viewBox scales to the page's width (a phone's
too). Every string that reaches the SVG passes :func:`e` (``html.escape``); every mark carries
a ``<title>`` with its value, so colour is never the only way to read it.
"""
from __future__ import annotations

import html
import math

from .runs import _d, _l, _num, device_type, human_bytes

PALETTE = ("#0072b2", "#e69f00", "#009e73", "#cc79a7", "#56b4e9", "#d55e00", "#666666")
OK, BAD, WARN, SKIP = "#1a7f37", "#cf222e", "#bf8700", "#8c959f"


def e(value) -> str:
    """Escape anything for HTML text or a double-quoted attribute."""
    return html.escape(str(value), quote=True)


MAX_ROWS = 64  # ranks, hosts, bars: beyond this a table says how many more are in report.json


def fmt(v, digits: int = 4) -> str:
    v = _num(v)
    return "-" if v is None else f"{v:.{digits}g}"


def seconds(v) -> str:
    """A time as the terminal prints it: fixed point to the millisecond (0.000, never 2.5e-05)."""
    v = _num(v)
    return "-" if v is None else f"{v:.3f}"


def svg(w: int, h: int, label: str, body: list[str], grow: float | None = None) -> str:
    """An inline SVG as wide as the page allows (at most ``grow`` x its own width)."""
    style = f' style="max-width:{w * grow:.0f}px"' if grow else ""
    return (f'<svg class="chart"{style} viewBox="0 0 {w} {h}" role="img" aria-label="{e(label)}" '
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
                    f'text-anchor="end">{fmt(y, 3)}</text>')
    shown = -1e9  # a label only where it clears the last one (sizes 16 KiB and 16383 B meet)
    for x in xs:
        if px(x) - shown >= 58:
            shown = px(x)
            anchor = "end" if px(x) > W - R - 30 else "middle"  # the last one stays inside
            body.append(f'<text x="{px(x):.1f}" y="{H - B + 16}" class="tick" '
                        f'text-anchor="{anchor}">{e(human_bytes(x))}</text>')
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
                        f'<title>{e(name)} {e(human_bytes(x))}: {fmt(y)}</title></circle>')
        body.append(f'<text x="{L + 8 + 130 * n}" y="{H - 6}" class="legend" fill="{colour}">'
                    f'&#9632; {e(name)}</text>')
    for f in floors:
        x, y = px(f["x"]), py(f["y"])
        colour = OK if f.get("ok") else BAD
        body.append(f'<line x1="{x - 26:.1f}" x2="{x + 6:.1f}" y1="{y:.1f}" y2="{y:.1f}" '
                    f'stroke="{colour}" stroke-width="3" stroke-dasharray="5 3"><title>'
                    f'{e(f["label"])}</title></line><text x="{x - 28:.1f}" y="{y - 5:.1f}" '
                    f'class="tick" text-anchor="end" fill="{colour}">{e(f["label"])}</text>')
    return svg(W, H, label, body)


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
                        f'{stroke}><title>{e(names[i])} - {e(names[j])}: {fmt(v)} GB/s'
                        f'{" (slow)" if c["slow"] else ""}</title></rect>')
            if cell >= 36:
                body.append(f'<text x="{x + cell / 2:.1f}" y="{y + cell / 2 + 4:.1f}" '
                            f'class="cell" text-anchor="middle">{fmt(v, 2)}</text>')
    return svg(W, H, label, body, grow=1.5)


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
                    f'fill="{colour}"><title>{e(r["label"])}: {fmt(r["value"])} {e(unit)}'
                    f'</title></rect><text x="{L + r["value"] * scale + 4:.1f}" y="{y + 13}" '
                    f'class="tick">{fmt(r["value"])}</text>')
    for m in marks:
        x = L + m["value"] * scale
        body.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="2" y2="{H - 20}" '
                    f'stroke="{m["colour"]}" stroke-width="2" stroke-dasharray="4 3"/>'
                    f'<text x="{x:.1f}" y="{H - 6}" class="tick" text-anchor="middle" '
                    f'fill="{m["colour"]}">{e(m["label"])}</text>')
    return svg(W, H, label, body)


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


# -- the chart sections -------------------------------------------------------------------------

def checks_of(report: dict) -> list[dict]:
    return [_d(c) for c in _l(report.get("checks"))]


def check_of(report: dict, name: str) -> dict:
    return next((c for c in checks_of(report) if c.get("name") == name), {})


def _table(report: dict, check: str, key: str) -> tuple[dict, dict, list[dict]]:
    """A check, its figures and the rows of one of its figure lists (each a dict)."""
    c = check_of(report, check)
    f = _d(c.get("figures"))
    return c, f, [_d(r) for r in _l(f.get(key))]


def sec_bandwidth(report: dict) -> str:
    _, f, rows = _table(report, "bandwidth", "results")
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
                           "label": f"{fl.get('collective')} floor {fmt(y)}"})
    applied = _d(f.get("floors"))
    note = (f'<p class="muted">profile {e(f.get("profile"))}: '
            f'{e(applied.get("reason") or "floors applied" if applied else "no floors")}</p>')
    chart = line_chart(sorted(series.items()), floors,
                       f"busbw by message size, {f.get('world_size')} ranks", "busbw (GB/s)")
    return (f'<section id="bandwidth"><h2>Bandwidth <small>busbw as nccl-tests defines it; '
            f'GB = 1e9 B</small></h2>{note}{chart}</section>')


def sec_pairs(report: dict) -> str:
    pairs = _d(_d(check_of(report, "bandwidth").get("figures")).get("pairs"))
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
    ref = _num(pairs.get("reference_busbw_gbps"))
    labels = [names[n] for n in order]
    # one matrix per rail (a run with rails), else one for the nodes
    rails = {_d(r).get("index"): _d(r) for r in _l(pairs.get("rails"))}
    maps = []
    for rail in sorted({p.get("rail") for p in results}, key=str):
        cells = {}
        for p in results:
            a, b, v = p.get("node_a"), p.get("node_b"), _num(p.get("busbw_gbps"))
            if p.get("rail") == rail and a in pos and b in pos and v is not None:
                i, j = sorted((pos[a], pos[b]))
                cells[(i, j)] = {"busbw": v, "slow": bool(p.get("slow"))}
        title = "node-pair bandwidth matrix" + ("" if rail is None else f", rail {rail}")
        chart = heatmap(labels, cells, ref, title)
        if rail is not None:
            devices = sorted({str(d) for d in _l(rails.get(rail, {}).get("devices")) if d})
            chart = (f'<figure><figcaption>rail {e(rail)}'
                     f'{" (" + e(", ".join(devices)) + ")" if devices else ""}</figcaption>'
                     f'{chart}</figure>')
        maps.append(chart)
    key = "".join(f"<li>{e(h)}</li>" for h in labels[:MAX_ROWS])
    slowest = sorted(results, key=lambda p: _num(p.get("busbw_gbps")) or 0)[:10]
    table = "".join(f'<tr><td>{e(p.get("host_a"))} &lt;-&gt; {e(p.get("host_b"))}'
                    f'{"" if p.get("rail") is None else " rail " + e(p.get("rail"))}</td>'
                    f'<td class="num">{fmt(p.get("busbw_gbps"))}</td>'
                    f'<td>{"slow" if p.get("slow") else ""}</td></tr>' for p in slowest)
    per = " per rail, the rails at once" if rails else ""
    return (f'<section id="pairs"><h2>Node pairs{e(per)} <small>sendrecv busbw (GB/s), '
            f'{e(human_bytes(pairs.get("size_bytes")))} per exchange; reference {fmt(ref)} GB/s'
            f'</small></h2><div class="pairs">{"".join(maps)}'
            f'<ol class="key">{key}</ol></div><p class="muted">Colour: busbw against the '
            f'reference (green = at it, red = far below); outlined = judged slow; grey = not '
            f'paired.</p><div class="scroll"><table><thead><tr><th>slowest pairs</th>'
            f'<th>GB/s</th><th></th></tr></thead><tbody>{table}</tbody></table></div></section>')


def sec_compute(report: dict) -> str:
    c, f, ranks = _table(report, "compute", "ranks")
    if not ranks:
        return ""
    named = {k.get("rank") for k in map(_d, _l(c.get("culprits")))}
    out = []
    dtypes = list(dict.fromkeys(d for r in ranks for d in _d(r.get("matmul"))))
    # as the terminal: GFLOPS on CPU ranks; the sustained rate (median block), which the
    # compute check and the median and floor lines judge (the best block only in an older report)
    unit, scale = ("TFLOPS", 1.0) if device_type(report) == "cuda" else ("GFLOPS", 1e3)

    def rate(m: dict) -> float | None:
        v = _num(m.get("tflops_median", m.get("tflops")))
        return None if v is None else v * scale
    for dtype in dtypes:
        rows = [{"rank": r.get("rank"), "value": rate(_d(_d(r.get("matmul")).get(dtype))),
                 "label": f"rank {r.get('rank')} {r.get('host')}", "bad": r.get("rank") in named}
                for r in ranks]
        rows = [r for r in rows if r["value"] is not None]
        note = ""
        if len(rows) > MAX_ROWS:
            rows = sorted(rows, key=lambda r: r["value"])[:MAX_ROWS]
            note = f'<p class="muted">the {MAX_ROWS} slowest of {len(ranks)} ranks</p>'
        marks = []
        median = rate({"tflops": _d(f.get("median_tflops")).get(dtype)})
        if median is not None:
            marks.append({"value": median, "colour": "#333", "label": f"median {fmt(median)}"})
        floor = rate({"tflops": _d(f.get("floors")).get(dtype)})
        if floor is not None:
            marks.append({"value": floor, "colour": BAD, "label": f"floor {fmt(floor)}"})
        if rows:
            out.append(f'<h3>{e(dtype)} matmul, sustained (median block; {unit}, n = '
                       f'{e(f.get("matrix_size"))})</h3>'
                       f'{note}{bars(rows, marks, f"{dtype} {unit} per rank", unit)}')
    hbm = [r for r in ranks if _num(r.get("hbm_gbps")) is not None]
    if hbm:
        out.append(bars([{"label": f"rank {r.get('rank')} {r.get('host')}",
                          "value": _num(r["hbm_gbps"])} for r in hbm[:MAX_ROWS]], [],
                        "HBM copy GB/s per rank", "GB/s"))
    return f'<section id="compute"><h2>Compute per rank</h2>{"".join(out)}</section>'


def _rank_states(report: dict, world: int) -> list[list[tuple[str, str]]]:
    """Per rank, per phase: (state, text). States: ok, culprit, victim, fail, skip."""
    checks = checks_of(report)
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
    checks = checks_of(report)
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
        if w * W >= 6 * len(name[:10]):  # a name that fits its stage; the others in its <title>
            head.append(f'<text x="{(x + w / 2) * W:.1f}" y="12" class="tick" '
                        f'text-anchor="middle">{e(name[:10])}</text>')
        x += w
    rows = [f'<tr><th>ranks</th><th>{svg(W, H, "stages", head)}</th><th>where it stopped'
            f'</th></tr>']
    for signature, members in list(groups.items())[:MAX_ROWS]:
        body, x = [], 0.0
        for (state, text), (name, dur), w in zip(signature, phases, widths):
            body.append(f'<rect x="{x * W + 1:.1f}" y="2" width="{w * W - 2:.1f}" height="{H - 4}" '
                        f'fill="{colours.get(state, SKIP)}"><title>{e(name)}: {e(state)} '
                        f'({seconds(dur)} s) {e(text)}</title></rect>')
            x += w
        where = _where(signature, phases)
        hosts = list(dict.fromkeys(str(ranks[r].get("host")) for r in members if r < len(ranks)))
        label = _ranges(members) + (f" ({', '.join(hosts[:3])}{' …' if len(hosts) > 3 else ''})"
                                    if hosts else "")
        rows.append(f'<tr><td>{e(label)}</td><td>{svg(W, H, "stages of " + label, body)}</td>'
                    f'<td>{e(where)}</td></tr>')
    legend = " ".join(f'<span class="chip" style="background:{c}">{e(s)}</span>'
                      for s, c in colours.items())
    return (f'<section id="timeline"><h2>Timeline <small>stages per rank, width ~ time</small>'
            f'</h2><p>{legend}</p><div class="scroll"><table class="timeline">{"".join(rows)}'
            f'</table></div></section>')


def _where(signature: tuple, phases: list[tuple[str, float]]) -> str:
    """Where a group of ranks stopped: its first bad stage, else after its last stage that
    ran when later ones did not ("not run: the run stopped at …"), else finished."""
    for (state, text), (name, _) in zip(signature, phases):
        if state not in ("ok", "skip"):
            return f"{state} at {name}" + (f": {text}" if text else "")
    ran = [name for (state, _), (name, _) in zip(signature, phases) if state == "ok"]
    unrun = any(state == "skip" and text.startswith("not run") for state, text in signature)
    return f"stopped after {ran[-1]}" if unrun and ran else "finished"


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
