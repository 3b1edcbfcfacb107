"""The page's training section: each rank's step times, drawn as the other charts (charts.py).

One row per rank on a common millisecond axis: a bar to the median step, split into the
compute-only median (forward and backward on the rank's unsharded copy) and the rest (the
exposed communication and the sharded optimizer step); a whisker from the median to the p90;
a dot for every measured step. A rank the check named is drawn red. Nothing is drawn when the
check did not run (the quick level skips it) or measured no step.
"""
from __future__ import annotations

from .charts import BAD, MAX_ROWS, PALETTE, _nice_max, check_of, e, fmt, svg
from .runs import _d, _l, _num

COMPUTE, EXPOSED = PALETTE[0], PALETTE[1]


def _ms(v) -> float | None:
    v = _num(v)
    return None if v is None or v < 0 else v * 1e3


def step_chart(rows: list[dict], label: str) -> str:
    """Rows of ``{"label", "median", "p90", "compute", "steps", "bad"}`` (ms) on one axis."""
    W, L, R, row = 720, 190, 70, 22
    H = 30 + row * len(rows)
    top = _nice_max(max([v for r in rows for v in (r["median"], r["p90"], r["compute"] or 0,
                                                   *r["steps"])] + [1e-9]))
    scale = (W - L - R) / top

    def x(v: float) -> float:
        return L + v * scale

    body = []
    for i in range(6):
        v = top * i / 5
        body.append(f'<line x1="{x(v):.1f}" x2="{x(v):.1f}" y1="2" y2="{H - 22}" class="grid"/>'
                    f'<text x="{x(v):.1f}" y="{H - 8}" class="tick" text-anchor="middle">'
                    f'{fmt(v, 3)}</text>')
    for n, r in enumerate(rows):
        y, mid = 6 + row * n, 6 + row * n + row / 2
        med, p90, comp = r["median"], r["p90"], min(r["compute"] or 0.0, r["median"])
        name = e(r["label"])
        body.append(f'<text x="{L - 6}" y="{mid + 4:.1f}" class="tick" text-anchor="end">'
                    f'{name}</text>'
                    f'<rect x="{L}" y="{y + 3}" width="{max(0.5, comp * scale):.1f}" '
                    f'height="{row - 6}" fill="{BAD if r["bad"] else COMPUTE}"><title>{name}: '
                    f'compute only {fmt(r["compute"])} ms (median)</title></rect>'
                    f'<rect x="{x(comp):.1f}" y="{y + 3}" width="{(med - comp) * scale:.1f}" '
                    f'height="{row - 6}" fill="{EXPOSED}"><title>{name}: exposed communication '
                    f'and optimizer {fmt(med - comp)} ms</title></rect>'
                    f'<line x1="{x(med):.1f}" x2="{x(p90):.1f}" y1="{mid:.1f}" y2="{mid:.1f}" '
                    f'stroke="#333" stroke-width="2"><title>{name}: step median {fmt(med)} ms, '
                    f'p90 {fmt(p90)} ms</title></line><line x1="{x(p90):.1f}" '
                    f'x2="{x(p90):.1f}" y1="{y + 5}" y2="{y + row - 5}" stroke="#333" '
                    f'stroke-width="2"/>')
        for k, s in enumerate(r["steps"]):
            body.append(f'<circle cx="{x(s):.1f}" cy="{mid:.1f}" r="2.5" fill="#000" '
                        f'fill-opacity="0.45"><title>{name}: step {k + 1} {fmt(s)} ms</title>'
                        f'</circle>')
        body.append(f'<text x="{x(max(p90, *r["steps"], med)) + 6:.1f}" y="{mid + 4:.1f}" '
                    f'class="tick">{fmt(med, 3)}</text>')
    return svg(W, H, label, body)


def sec_training(report: dict) -> str:
    c = check_of(report, "training")
    f = _d(c.get("figures"))
    named = {k.get("rank") for k in map(_d, _l(c.get("culprits")))}
    rows = []
    for k in map(_d, _l(f.get("ranks"))):
        med, p90 = _ms(k.get("step_s_median")), _ms(k.get("step_s_p90"))
        if med is None or p90 is None:
            continue
        steps = [v for v in map(_ms, _l(k.get("step_s"))) if v is not None]
        bad = k.get("rank") in named
        rows.append({"label": f"rank {k.get('rank')} {k.get('host')}{' (named)' if bad else ''}",
                     "median": med,
                     "p90": max(p90, med), "compute": _ms(k.get("compute_s_median")),
                     "steps": steps, "bad": bad})
    if not rows:
        return ""
    note = ""
    if len(rows) > MAX_ROWS:
        rows = sorted(rows, key=lambda r: -r["median"])[:MAX_ROWS]
        note = f'<p class="muted">the {MAX_ROWS} slowest of {len(_l(f.get("ranks")))} ranks</p>'
    m = _d(f.get("model"))
    params = _num(m.get("params"))
    mesh = "x".join(str(v) for v in _l(f.get("mesh")))
    what = (f"{str(f.get('layout') or '?').upper()} {mesh}, "
            f"{fmt(None if params is None else params / 1e6, 3)} M parameters, batch "
            f"{m.get('micro_batch')}x{m.get('seq_len')} tokens a rank")
    rate = (f"job {fmt(f.get('tokens_per_s'))} tokens/s"
            + (f", MFU median {fmt(100 * f['mfu_median'], 3)} %"
               if _num(f.get("mfu_median")) is not None else ""))
    legend = (f'<span class="chip" style="background:{COMPUTE};color:#fff">compute only '
              f'(median)</span> <span class="chip" style="background:{EXPOSED}">exposed '
              f'communication and optimizer</span> whisker: median to p90; dots: each step')
    return (f'<section id="training"><h2>Training step per rank <small>{e(what)}; ms</small>'
            f'</h2><p class="muted">{e(rate)}</p>{note}'
            f'{step_chart(rows, "training step time per rank (ms)")}'
            f'<p class="key">{legend}</p></section>')
