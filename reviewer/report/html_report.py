"""The HTML report: one self-contained file (inline CSS, inline SVG, no scripts, nothing fetched) that a person can open
from disk, mail, or attach to a ticket.

Per repository: the runs, the findings of the latest run grouped by severity (state and verification as badges, the
details folded), a lifecycle grid (each finding's state in every run), and one plot per measurement across commits:
the median of the repeats as a point, min-max as a whisker, a change beyond the noise (see reviewer/stats.py) in red.
A checkbox hides unverified findings with CSS alone.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from html import escape

from reviewer.store.db import SEVERITIES

STATE_COLOR = {"new": "#1f6feb", "persisting": "#9a6700", "fixed": "#1a7f37", "regressed": "#cf222e", None: "#6e7781"}
SEVERITY_COLOR = {"critical": "#8b0000", "high": "#cf222e", "medium": "#bf8700", "low": "#0969da", "info": "#6e7781"}

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#1f2328;background:#f6f8fa}
main{max-width:1200px;margin:0 auto;padding:16px 24px 48px}
h1{font-size:24px;margin:8px 0}h2{font-size:20px;margin:28px 0 8px;border-bottom:1px solid #d0d7de;padding-bottom:4px}
h3{font-size:16px;margin:18px 0 6px}.meta{color:#656d76}
.cards{display:flex;gap:12px;flex-wrap:wrap;margin:12px 0}
.card{background:#fff;border:1px solid #d0d7de;border-radius:8px;padding:8px 14px;min-width:90px}
.card b{display:block;font-size:22px}
table{border-collapse:collapse;background:#fff;width:100%;margin:6px 0}
th,td{border:1px solid #d0d7de;padding:4px 8px;text-align:left;vertical-align:top}th{background:#eef1f4}
.badge{display:inline-block;border-radius:10px;padding:0 8px;color:#fff;font-size:12px;white-space:nowrap}
.finding{background:#fff;border:1px solid #d0d7de;border-left:5px solid var(--sev);border-radius:6px;margin:6px 0;
padding:6px 10px}.finding .title{font-weight:600}.finding pre{white-space:pre-wrap;background:#f6f8fa;padding:6px;
margin:4px 0;max-height:300px;overflow:auto}code{background:#eef1f4;padding:0 3px;border-radius:3px}
.grid td.cell{text-align:center;min-width:28px}.plots{display:flex;flex-wrap:wrap;gap:12px}
.plot{background:#fff;border:1px solid #d0d7de;border-radius:8px;padding:6px}
body:has(#hide-unverified:checked) .unverified{display:none}
.toggle{position:fixed;top:8px;right:12px;background:#fff;border:1px solid #d0d7de;border-radius:6px;padding:4px 8px}
"""


def badge(text: str, color: str) -> str:
    return f'<span class="badge" style="background:{color}">{escape(text)}</span>'


def verified_badge(verified: bool | None) -> str:
    if verified is True:
        return badge("verified", "#1a7f37")
    if verified is False:
        return badge("not reproduced", "#cf222e")
    return badge("unverified", "#6e7781")


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering [lo, hi]."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / max(count - 1, 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.ceil(lo / step) * step
    ticks = []
    value = first
    while value <= hi + step * 1e-9:
        ticks.append(round(value, 12))
        value += step
    return ticks


def short_time(iso: str | None) -> str:
    """'2026-11-29T21:57:54.902665Z' -> '2026-11-29 21:57 UTC'."""
    return f"{iso[:10]} {iso[11:16]} UTC" if iso and len(iso) >= 16 else (iso or "")


def fmt(value: float) -> str:
    return f"{value:.4g}"


def svg_plot(series: dict, width: int = 560, height: int = 240) -> str:
    """One measurement across commits as inline SVG: median points joined by a line, min-max whiskers, changes beyond
    the noise in red with their percentage."""
    points = series["points"]
    left, right, top, bottom = 62, 16, 28, 56
    plot_w, plot_h = width - left - right, height - top - bottom
    lo = min(p["min"] for p in points)
    hi = max(p["max"] for p in points)
    pad = (hi - lo) * 0.12 or abs(hi) * 0.1 or 1.0
    lo, hi = lo - pad, hi + pad

    inset = 18  # keep the first and last points off the frame

    def x_of(i: int) -> float:
        if len(points) == 1:
            return left + plot_w / 2
        return left + inset + (plot_w - 2 * inset) * i / (len(points) - 1)

    def y_of(v: float) -> float:
        return top + plot_h * (1 - (v - lo) / (hi - lo))

    title = f"{series['persona']} / {series['name']} ({series['unit']})"
    parts = [f'<svg class="measurement" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}">',
             f'<text x="{left}" y="16" font-size="13" font-weight="600">{escape(title)}</text>',
             f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="#fff" stroke="#d0d7de"/>']
    for t in nice_ticks(lo, hi):
        y = y_of(t)
        parts.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eef1f4"/>')
        parts.append(f'<text x="{left - 6}" y="{y + 4:.1f}" font-size="11" text-anchor="end">{fmt(t)}</text>')
    rotate = len(points) > 6
    for i, p in enumerate(points):
        x = x_of(i)
        label = escape((p["commit"] or "?")[:7])
        if rotate:
            parts.append(f'<text x="{x:.1f}" y="{top + plot_h + 14}" font-size="10" text-anchor="end" '
                         f'transform="rotate(-40 {x:.1f} {top + plot_h + 14})">{label}</text>')
        else:
            parts.append(f'<text x="{x:.1f}" y="{top + plot_h + 16}" font-size="11" text-anchor="middle">{label}</text>')
    if len(points) > 1:
        path = " ".join(f"{'M' if i == 0 else 'L'}{x_of(i):.1f},{y_of(p['median']):.1f}" for i, p in enumerate(points))
        parts.append(f'<path d="{path}" fill="none" stroke="#57606a" stroke-width="1.5"/>')
    for i, p in enumerate(points):
        x, y = x_of(i), y_of(p["median"])
        change = p.get("change") or {}
        flagged = bool(change.get("changed"))
        color = "#cf222e" if flagged else "#0969da"
        tip = (f"run {p['run_id']} @ {p['commit'] or '?'}: median {fmt(p['median'])} {series['unit']}, "
               f"n={p['n']}, min {fmt(p['min'])}, max {fmt(p['max'])}")
        if change:
            tip += f"; vs previous x{change['ratio']:.3f}" + (f", p={change['p']:.3g}" if change["p"] is not None else "")
            tip += " (beyond noise)" if flagged else " (within noise)"
        cls = "point changed" if flagged else "point"
        parts.append(f'<g class="{cls}"><title>{escape(tip)}</title>')
        if p["max"] > p["min"]:
            y1, y2 = y_of(p["max"]), y_of(p["min"])
            parts.append(f'<line class="whisker" x1="{x:.1f}" x2="{x:.1f}" y1="{y1:.1f}" y2="{y2:.1f}" '
                         f'stroke="{color}" stroke-width="1.5"/>')
            for yy in (y1, y2):
                parts.append(f'<line x1="{x - 4:.1f}" x2="{x + 4:.1f}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="{color}"/>')
        parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{6 if flagged else 4}" fill="{color}"/>')
        if flagged:
            pct = (change["ratio"] - 1) * 100
            parts.append(f'<text x="{x:.1f}" y="{max(y_of(p["max"]) - 8, top + 10):.1f}" font-size="11" fill="{color}" '
                         f'text-anchor="middle" font-weight="600">{pct:+.0f}%</text>')
        parts.append("</g>")
    parts.append(f'<text x="{left}" y="{height - 6}" font-size="10" fill="#656d76">point: median of the repeats; '
                 f'bar: min-max; red: change beyond noise</text>')
    parts.append("</svg>")
    return "".join(parts)


def finding_html(f: dict) -> str:
    where = f" <code>{escape(f['file'])}{':' + str(f['line']) if f.get('line') else ''}</code>" if f.get("file") else ""
    classes = "finding" + ("" if f.get("verified") else " unverified")
    body = [f'<div class="{classes}" style="--sev:{SEVERITY_COLOR.get(f["severity"], "#6e7781")}">',
            f'{badge(f["severity"], SEVERITY_COLOR.get(f["severity"], "#6e7781"))} '
            f'{badge(f.get("state") or "no state", STATE_COLOR.get(f.get("state"), "#6e7781"))} '
            f'{verified_badge(f.get("verified"))} <span class="title">{escape(f["title"])}</span>{where} '
            f'<span class="meta">({escape(f["persona"])}, {escape(f["category"])})</span>']
    more = []
    if f.get("details"):
        more.append(f"<pre>{escape(f['details'])}</pre>")
    if f.get("repro_command") and "\n" in f["repro_command"]:  # a probe's script (docs/probes.md): keep its lines
        more.append(f"<div>Reproduce:</div><pre>{escape(f['repro_command'])}</pre>")
    elif f.get("repro_command"):
        more.append(f"<div>Reproduce: <code>{escape(f['repro_command'])}</code></div>")
    if f.get("evidence"):
        more.append(f"<div>Evidence:</div><pre>{escape(f['evidence'])}</pre>")
    if f.get("verification"):
        more.append(f"<div>Verification:</div><pre>{escape(f['verification'])}</pre>")
    if more:
        body.append("<details><summary>details</summary>" + "".join(more) + "</details>")
    body.append("</div>")
    return "".join(body)


def lifecycle_grid(runs: list[dict]) -> str:
    """Rows: findings by fingerprint; columns: runs; cells: the state in that run (blank: not reported)."""
    rows: dict[str, dict] = {}
    for run in runs:
        for f in run["findings"]:
            key = f.get("fingerprint") or f"id-{f['id']}"
            row = rows.setdefault(key, {"finding": f, "states": {}})
            row["finding"] = f  # the latest wording
            row["states"][run["id"]] = f.get("state")
    if not rows:
        return "<p class='meta'>No findings.</p>"
    head = "".join(f"<th title='run {r['id']}'>{escape((r['commit'] or '?')[:7])}<br><span class='meta'>#{r['id']}"
                   f"</span></th>" for r in runs)
    out = [f"<table class='grid'><tr><th>finding</th><th>persona</th>{head}</tr>"]
    for row in rows.values():
        f = row["finding"]
        cells = []
        for r in runs:
            state = row["states"].get(r["id"])
            cells.append(f"<td class='cell'>{badge(state or '?', STATE_COLOR.get(state, '#6e7781'))}</td>"
                         if r["id"] in row["states"] else "<td class='cell'></td>")
        out.append(f"<tr><td>{escape(f['title'])}</td><td>{escape(f['persona'])}</td>{''.join(cells)}</tr>")
    out.append("</table>")
    return "".join(out)


def render_html(runs: list[dict], history: list[dict], *, source: str, filters: str = "") -> str:
    generated = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    latest_findings = [f for r in _latest_per_repo(runs) for f in r["findings"]]
    states = {s: sum(1 for f in latest_findings if f.get("state") == s) for s in ("new", "persisting", "fixed", "regressed")}
    open_findings = [f for f in latest_findings if f.get("state") != "fixed"]
    verified = sum(1 for f in open_findings if f.get("verified"))
    out = ['<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           f"<title>Review report</title><style>{CSS}</style></head><body>",
           '<label class="toggle"><input type="checkbox" id="hide-unverified"> hide unverified findings</label><main>',
           "<h1>Review report</h1>",
           f"<div class='meta'>Generated {generated} from {escape(source)}{escape(filters)}. {len(runs)} run(s).</div>",
           "<div class='cards'>"
           f"<div class='card'><b>{len(open_findings)}</b>open findings (latest runs)</div>"
           f"<div class='card'><b>{verified}</b>verified</div>"
           + "".join(f"<div class='card' style='border-top:4px solid {STATE_COLOR[s]}'><b>{n}</b>{s}</div>"
                     for s, n in states.items())
           + "</div>"]
    if not runs:
        out.append("<p>No reviews match. Start one with <code>reviewer run &lt;repo&gt;</code>.</p>")
    for repo in dict.fromkeys(r["repo"] for r in runs):
        repo_runs = [r for r in runs if r["repo"] == repo]
        latest = repo_runs[-1]
        out.append(f"<section class='repository'><h2>{escape(repo or '?')}</h2>")
        out.append("<table><tr><th>run</th><th>commit</th><th>status</th><th>started</th><th>personas</th>"
                   "<th>findings</th></tr>")
        for r in repo_runs:
            personas = ", ".join(f"{escape(p['name'])}: {escape(p['status'])}" for p in r["personas"])
            out.append(f"<tr><td>#{r['id']}</td><td><code>{escape((r['commit'] or '?')[:12])}</code></td>"
                       f"<td>{escape(r['status'])}</td><td>{escape(short_time(r['started_at']))}</td><td>{personas}</td>"
                       f"<td>{findings_count(r['findings'])}</td></tr>")
        out.append("</table>")
        out.append(f"<h3>Findings in run #{latest['id']} @ <code>{escape((latest['commit'] or '?')[:12])}</code></h3>")
        if not latest["findings"]:
            out.append("<p class='meta'>No findings.</p>")
        for severity in SEVERITIES:
            group = [f for f in latest["findings"] if f["severity"] == severity]
            if group:
                out.append(f"<div class='severity-group' data-severity='{severity}'>")
                out.extend(finding_html(f) for f in group)
                out.append("</div>")
        out.append("<h3>Lifecycle</h3>")
        out.append(lifecycle_grid(repo_runs))
        repo_history = [h for h in history if h["repo"] == repo]
        out.append("<h3>Measurements across commits</h3>")
        if repo_history:
            out.append("<div class='plots'>" + "".join(f"<div class='plot'>{svg_plot(h)}</div>" for h in repo_history)
                       + "</div>")
        else:
            out.append("<p class='meta'>No measurements.</p>")
        out.append("</section>")
    out.append("</main></body></html>")
    return "\n".join(out)


def findings_count(findings: list[dict]) -> str:
    """'2', or '1 (+1 fixed)': fixed copies are not open findings."""
    fixed = sum(1 for f in findings if f.get("state") == "fixed")
    return f"{len(findings) - fixed}" + (f" (+{fixed} fixed)" if fixed else "")


def _latest_per_repo(runs: list[dict]) -> list[dict]:
    latest: dict[str, dict] = {}
    for r in runs:
        latest[r["repo"]] = r
    return list(latest.values())
