"""Render a `report.Report` as one self-contained HTML file (`write_report` writes it): inline
CSS, SVG drawn by inline JavaScript from the data embedded as JSON, no network. The attempts
table and the summary are plain HTML, so they read without scripts; the charts need them.

DOM contract (the tests and anyone scripting the page rely on it): each chart is
`svg.chart[data-field=loss|samples_per_s]`; each attempt's curve is
`path.curve[data-attempt][data-points]`; markers are `.marker` elements with
`data-kind` = failure | degrade | checkpoint | bad_checkpoint and, for failures,
`data-failure` = the failure kind; stragglers are rows `section.stragglers tr[data-rank]`.
"""

from __future__ import annotations

import html
import json
import time
from pathlib import Path
from typing import Any

from rtrain.supervisor.commands.human_units import human_duration
from rtrain.supervisor.commands.report import AttemptRow, Report, gather
from rtrain.supervisor.core.atomic_write import write_atomic
from rtrain.supervisor.core.errors import UsageError
from rtrain.supervisor.records.recovery import PHASES, seconds

# One colour per failure kind (FailureKind values), shared by markers, chips and the table.
KIND_COLORS = {
    "crash": "#d62728", "oom_gpu": "#ff7f0e", "oom_host": "#8c564b", "hang": "#9467bd",
    "nonfinite": "#e377c2", "preempted": "#7f7f7f", "startup": "#17202a",
    "lost_device": "#17becf", "data": "#bcbd22", "bad_checkpoint": "#2ca02c",
    "memory_pressure": "#c49c94",
}
OTHER_COLOR = "#555555"


def _esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def _chip(kind: str) -> str:
    color = KIND_COLORS.get(kind)
    if color is None:
        return f'<span class="outcome">{_esc(kind)}</span>'
    return f'<span class="chip" style="background:{color}">{_esc(kind)}</span>'


def _stuck(a: AttemptRow) -> str:
    """At a hang, the stuck-rank summary on a line of its own (unless the reason holds it)."""
    if not a.stuck or a.stuck in a.reason:
        return ""
    return f'<div class="stuck">{_esc(a.stuck)}</div>'


def _row(a: AttemptRow) -> str:
    end = ("-" if a.returncode is None and a.signal is None
           else f"signal {a.signal}" if a.signal else f"exit {a.returncode}")
    settings = " ".join(f"{k}={v}" for k, v in a.settings.items()) or "-"
    cells = [str(a.attempt), _when(a.start),
             human_duration(a.duration_s) if a.duration_s is not None else "-",
             (f"{a.resume_from} (from {a.tier})" if a.tier and a.resume_from
              else a.resume_from or "fresh"), f"{a.level}: {settings}",
             "-" if a.last_step is None else f"{a.last_step:,}", end]
    return ("<tr>" + "".join(f"<td>{_esc(c)}</td>" for c in cells)
            + f"<td>{_chip(a.outcome)}</td><td>{_esc(a.reason or '-')}{_stuck(a)}</td>"
            + f"<td>{_esc(a.decision or '-')}</td></tr>")


def _costs(rep: Report) -> str:
    """The "time lost to failures" table: per kind, each phase's total (mean per failure)."""
    if not rep.failure_costs:
        return ""
    head = "".join(f"<th>{_esc(p.replace('_', ' '))}</th>" for p in PHASES)
    rows = []
    for c in rep.failure_costs:
        cells = []
        for p in (*PHASES, "total"):
            v = c.phases.get(p)
            cells.append("-" if v is None else f"{seconds(v[0])} ({seconds(v[1])})")
        rows.append(f'<tr data-failure="{_esc(c.kind)}"><td>{_chip(c.kind)}</td>'
                    f"<td>{c.count}</td><td><b>{_esc(seconds(c.lost_s))}</b></td>"
                    f"<td>{c.steps_lost:,}</td>"
                    + "".join(f"<td>{_esc(x)}</td>" for x in cells) + "</tr>")
    return ('\n  <section><h2>Time lost to failures</h2>\n'
            '  <p class="muted">Per failure kind: from the failure to the relaunched attempt\'s '
            "first step, phase by phase, as total (mean per failure); time lost adds the steps "
            "run again at the run's step time.</p>\n"
            '  <table class="costs"><thead><tr><th>kind</th><th>failures</th><th>time lost</th>'
            f"<th>steps run again</th>{head}<th>to first step</th></tr></thead>\n  <tbody>\n"
            + "\n".join(rows) + "\n  </tbody></table></section>")


def _stragglers(rep: Report) -> str:
    """The "stragglers" table: each rank found slower than the others, with its node."""
    if not rep.stragglers:
        return ""
    rows = [f'<tr data-rank="{_esc(e.get("rank"))}"><td>{_esc(e.get("attempt"))}</td>'
            f'<td>{_esc(e.get("step"))}</td><td>{_esc(e.get("rank"))}</td>'
            f'<td>{_esc(e.get("host") or "-")}</td><td>{_esc(e.get("ratio"))}</td>'
            f'<td>{_esc(e.get("detail") or "")}</td></tr>' for e in rep.stragglers]
    return ('\n  <section class="stragglers"><h2>Stragglers</h2>\n'
            '  <p class="muted">Ranks whose busy time per step was consistently above the other '
            "ranks' ([straggler] factor): the others wait for them.</p>\n"
            '  <table><thead><tr><th>attempt</th><th>step</th><th>rank</th><th>node</th>'
            "<th>times slower</th><th>detail</th></tr></thead>\n  <tbody>\n"
            + "\n".join(rows) + "\n  </tbody></table></section>")


def _data_json(rep: Report) -> str:
    data = rep.to_json()
    data["colors"] = {**KIND_COLORS, "other": OTHER_COLOR}
    # "</script>" inside a string must not end the script element.
    return json.dumps(data, default=str, allow_nan=False).replace("<", "\\u003c")


def write_report(run_dir: Path, output: Path, *, key: bytes | None = None) -> Path:
    """Gather and render the report of `run_dir` into `output` (one self-contained HTML file)."""
    output = Path(output)
    page = render(gather(run_dir, key=key))
    try:  # readable by others where the directory lets them in: a report is for sharing
        write_atomic(output, page, mode=0o644, durable=False)
    except OSError as e:  # a read-only run dir: say where else to write it
        raise UsageError(f"cannot write the report to {output} ({e.strerror}): pass "
                         "-o FILE somewhere writable") from None
    return output


def render(rep: Report) -> str:
    """The whole page as a string."""
    failures = " ".join(f"{_chip(k)}&nbsp;{n}" for k, n in sorted(rep.failures.items())) \
        or "none"
    checkpoints = sum(1 for m in rep.markers if m.kind == "checkpoint")
    rows = "\n".join(_row(a) for a in rep.attempts) or \
        '<tr><td colspan="10">no attempt launched</td></tr>'
    legend = "".join(
        f'<span class="key"><i style="background:{c}"></i>{_esc(k)}</span>'
        for k, c in KIND_COLORS.items() if k in rep.failures)
    return _PAGE.format(
        title=_esc(f"rtrain report: {rep.run_dir.name or rep.run_dir}"),
        run_dir=_esc(rep.run_dir), status=_esc(rep.status), reason=_esc(rep.reason or "-"),
        generated=_esc(_when(rep.generated)), attempts=len(rep.attempts), failures=failures,
        checkpoints=checkpoints, rows=rows, legend=legend, css=_CSS, js=_JS,
        skipped=rep.skipped_saves, mirror=_mirror(rep.mirror),
        ckpt_age="-" if rep.checkpoint_age_s is None
        else f"{human_duration(rep.checkpoint_age_s)} old",
        warning=f'\n  <div class="warning">warning: {_esc(rep.warning)}</div>' if rep.warning
        else "",
        data=_data_json(rep), costs=_costs(rep), stragglers=_stragglers(rep))


def _mirror(m: dict[str, Any] | None) -> str:
    """The mirror's fact: the newest step on it and how far behind it is, or nothing."""
    if m is None:
        return ""
    if m["uploaded_step"] is None:
        text = "nothing uploaded"
    else:
        behind = m.get("behind_steps")
        text = f"step {m['uploaded_step']}" + (f", {behind} behind" if behind else ", current")
    final = m.get("final")
    if final is not None and not final.get("made_it"):
        text += f"; the final step {final.get('step')} did not make it"
    elif m.get("failing"):
        text += "; failing"
    return f'\n    <span>mirror <b class="mirror">{_esc(text)}</b></span>'


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>{css}</style></head>
<body>
<header>
  <h1>rtrain report <span class="dir">{run_dir}</span></h1>
  <div class="facts">
    <span>status <b class="status-{status}">{status}</b></span>
    <span>attempts <b>{attempts}</b></span>
    <span>failures {failures}</span>
    <span>checkpoints on disk <b>{checkpoints}</b></span>
    <span>newest checkpoint <b class="ckpt-age">{ckpt_age}</b></span>
    <span>saves skipped <b class="skipped-saves">{skipped}</b></span>{mirror}
    <span class="muted">generated {generated}</span>
  </div>
  <div class="reason">{reason}</div>{warning}
</header>
<main>
  <section><h2>Loss</h2><div class="plot" id="plot-loss"></div></section>
  <section><h2>Throughput (samples/s)</h2><div class="plot" id="plot-rate"></div></section>
  <div class="legend">
    <span class="key"><i class="line"></i>attempt curves</span>{legend}
    <span class="key"><i class="dash"></i>degradation</span>
    <span class="key"><i class="diamond"></i>checkpoint</span>
    <span class="key"><i class="cross">&#x2715;</i>bad checkpoint</span>
  </div>
  <noscript><p class="muted">The charts need JavaScript; the table below does not.</p></noscript>
  <section><h2>Attempts</h2>
  <table><thead><tr><th>#</th><th>started</th><th>duration</th><th>resumed from</th>
  <th>rung: settings</th><th>last step</th><th>end</th><th>outcome</th><th>reason</th>
  <th>decision</th></tr></thead>
  <tbody>
{rows}
  </tbody></table></section>{costs}{stragglers}
</main>
<div id="tip" hidden></div>
<script type="application/json" id="rtrain-data">{data}</script>
<script>{js}</script>
</body></html>
"""

_CSS = """
:root{--fg:#1d2330;--muted:#6b7280;--grid:#e5e7eb;--bg:#fff;--panel:#f8fafc}
*{box-sizing:border-box}
body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;
 color:var(--fg);background:var(--bg)}
header{padding:14px 24px 8px;border-bottom:1px solid var(--grid);background:var(--panel)}
h1{font-size:19px;margin:0 0 6px}h1 .dir{font-weight:400;color:var(--muted);font-size:14px}
h2{font-size:14px;margin:14px 0 4px;color:#374151}
.facts{display:flex;flex-wrap:wrap;gap:18px;align-items:center}
.reason{color:var(--muted);margin-top:4px}
.warning{color:#b91c1c;margin-top:4px;font-weight:600}
.muted{color:var(--muted)}
.status-finished{color:#15803d}.status-gave_up{color:#b91c1c}.status-running{color:#1d4ed8}
main{padding:0 24px 24px}
.plot{width:100%;height:250px}
svg.chart{display:block;width:100%;height:100%}
svg .axis text{fill:var(--muted);font-size:11px}
svg .grid line{stroke:var(--grid)}
svg .curve{fill:none;stroke-width:1.8;stroke-linejoin:round}
svg .marker-failure line{stroke-width:1.6}
svg .marker-degrade line{stroke:#0f766e;stroke-dasharray:5 4;stroke-width:1.4}
svg .marker-degrade text{fill:#0f766e;font-size:11px}
svg .marker-checkpoint path{fill:#2563eb}
svg .marker-bad_checkpoint text{fill:#b91c1c;font-size:12px;font-weight:700}
svg .empty{fill:var(--muted);font-size:13px}
.legend{display:flex;flex-wrap:wrap;gap:14px;margin:8px 0;color:#374151;font-size:12px}
.key{display:inline-flex;align-items:center;gap:5px}
.key i{display:inline-block;width:11px;height:11px;border-radius:2px}
.key i.line{height:3px;background:#2563eb}.key i.dash{height:0;border-top:2px dashed #0f766e}
.key i.diamond{width:8px;height:8px;background:#2563eb;transform:rotate(45deg)}
.key i.cross{width:auto;height:auto;color:#b91c1c;font-style:normal;font-weight:700}
table{border-collapse:collapse;width:100%;font-size:12.5px}
th,td{border-bottom:1px solid var(--grid);padding:5px 8px;text-align:left;vertical-align:top}
th{background:var(--panel);font-weight:600}
.chip{color:#fff;border-radius:9px;padding:1px 8px;font-size:12px;white-space:nowrap}
#tip{position:fixed;pointer-events:none;background:#111827;color:#fff;padding:5px 8px;
 border-radius:4px;font-size:12px;max-width:420px;white-space:pre-line;z-index:2}
"""

_JS = r"""
(function(){
"use strict";
const D = JSON.parse(document.getElementById("rtrain-data").textContent);
const NS = "http://www.w3.org/2000/svg";
const SHADES = ["#2563eb","#059669","#7c3aed","#db2777","#0891b2","#65a30d","#ea580c","#4f46e5"];
const tip = document.getElementById("tip");

function el(name, attrs, parent, text){
  const e = document.createElementNS(NS, name);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}
function ticks(lo, hi, n){
  if (!(hi > lo)) { hi = lo + 1; }
  const raw = (hi - lo) / n, mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map(f => f * mag).find(s => raw <= s);
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(v);
  return out;
}
function fmt(v){
  const a = Math.abs(v);
  if (a >= 1e6) return (v / 1e6).toPrecision(3) + "M";
  if (a >= 1e4) return (v / 1e3).toPrecision(3) + "k";
  if (a !== 0 && a < 1e-2) return v.toExponential(1);
  return String(+v.toPrecision(4));
}
function hint(node, text){
  node.addEventListener("mousemove", ev => {
    tip.hidden = false; tip.textContent = text;
    tip.style.left = (ev.clientX + 12) + "px"; tip.style.top = (ev.clientY + 12) + "px";
  });
  node.addEventListener("mouseleave", () => { tip.hidden = true; });
}

function chart(holder, field){
  const W = Math.max(holder.clientWidth, 320), H = holder.clientHeight || 250;
  const m = {l: 58, r: 16, t: 18, b: 30};
  const svg = el("svg", {class: "chart", "data-field": field, viewBox: `0 0 ${W} ${H}`,
                         preserveAspectRatio: "none"}, holder);
  const pts = D.points.filter(p => p[field] !== null && isFinite(p[field]));
  const steps = D.points.map(p => p.step).concat(
      D.markers.filter(k => k.step !== null).map(k => k.step));
  if (!steps.length) steps.push(0, 1);
  let x0 = Math.min(...steps), x1 = Math.max(...steps);
  if (x1 === x0) { x1 = x0 + 1; }
  const vals = pts.map(p => p[field]);
  const pos = vals.length && vals.every(v => v > 0);
  const log = field === "loss" && pos && Math.max(...vals) / Math.min(...vals) > 50;
  const tf = v => log ? Math.log10(v) : v;
  let y0 = vals.length ? Math.min(...vals.map(tf)) : 0;
  let y1 = vals.length ? Math.max(...vals.map(tf)) : 1;
  if (!log && field === "samples_per_s") y0 = Math.min(0, y0);
  if (y1 === y0) { y1 = y0 + Math.abs(y0 || 1) * 0.1; y0 = y0 - Math.abs(y0 || 1) * 0.1; }
  const pad = (y1 - y0) * 0.06; y1 += pad; if (!(field === "samples_per_s" && y0 === 0)) y0 -= pad;
  const X = s => m.l + (s - x0) / (x1 - x0) * (W - m.l - m.r);
  const Y = v => H - m.b - (tf(v) - y0) / (y1 - y0) * (H - m.t - m.b);
  const Yt = t => H - m.b - (t - y0) / (y1 - y0) * (H - m.t - m.b);

  const grid = el("g", {class: "grid"}, svg), axis = el("g", {class: "axis"}, svg);
  for (const t of ticks(y0, y1, 5)) {
    el("line", {x1: m.l, x2: W - m.r, y1: Yt(t), y2: Yt(t)}, grid);
    el("text", {x: m.l - 6, y: Yt(t) + 4, "text-anchor": "end"}, axis,
       log ? fmt(Math.pow(10, t)) : fmt(t));
  }
  for (const t of ticks(x0, x1, 8)) {
    el("line", {x1: X(t), x2: X(t), y1: m.t, y2: H - m.b}, grid);
    el("text", {x: X(t), y: H - m.b + 15, "text-anchor": "middle"}, axis, fmt(t));
  }
  el("text", {x: W - m.r, y: H - 2, "text-anchor": "end"}, axis, "step");
  if (log) el("text", {x: m.l + 4, y: m.t - 5}, axis, "log scale");

  // Markers under the curves: failures, degradations, checkpoints.
  const marks = el("g", {class: "markers"}, svg);
  for (const k of D.markers) {
    if (k.step === null) continue;
    const x = X(k.step);
    if (k.kind === "failure") {
      const c = D.colors[k.label] || D.colors.other;
      const g = el("g", {class: "marker marker-failure", "data-kind": "failure",
                         "data-failure": k.label}, marks);
      el("line", {x1: x, x2: x, y1: m.t, y2: H - m.b, stroke: c}, g);
      el("path", {d: `M${x - 6},${m.t - 10}L${x + 6},${m.t - 10}L${x},${m.t}Z`, fill: c}, g);
      hint(g, `attempt ${k.attempt}: ${k.label} at step ${k.step}\n${k.detail}`);
    } else if (k.kind === "degrade") {
      const g = el("g", {class: "marker marker-degrade", "data-kind": "degrade"}, marks);
      el("line", {x1: x + 3, x2: x + 3, y1: m.t, y2: H - m.b}, g);
      el("text", {x: x + 6, y: m.t + 12}, g, "\u25bc " + k.label);
      hint(g, `degraded after attempt ${k.attempt}: ${k.detail}`);
    } else if (k.kind === "checkpoint") {
      const g = el("g", {class: "marker marker-checkpoint", "data-kind": "checkpoint"}, marks);
      const y = H - m.b;
      el("path", {d: `M${x},${y - 6}L${x + 5},${y}L${x},${y + 6}L${x - 5},${y}Z`}, g);
      const when = k.time ? new Date(k.time * 1000).toLocaleString() : "";
      hint(g, `${k.label} (step ${k.step})\ncommitted ${when}`);
    } else if (k.kind === "bad_checkpoint") {
      const g = el("g", {class: "marker marker-bad_checkpoint", "data-kind": "bad_checkpoint"},
                   marks);
      el("text", {x: x, y: H - m.b + 4, "text-anchor": "middle"}, g, "\u2715");
      hint(g, `${k.label}: ${k.detail}`);
    }
  }

  // One curve per attempt: a resumed attempt replays steps on its own line.
  const byAttempt = new Map();
  for (const p of pts) {
    if (!byAttempt.has(p.attempt)) byAttempt.set(p.attempt, []);
    byAttempt.get(p.attempt).push(p);
  }
  const curves = el("g", {class: "curves"}, svg);
  let i = 0;
  for (const [attempt, list] of byAttempt) {
    const color = SHADES[i++ % SHADES.length];
    const d = list.map((p, j) => (j ? "L" : "M") + X(p.step).toFixed(1) + "," +
                                 Y(p[field]).toFixed(1)).join("");
    const path = el("path", {class: "curve", d: d, stroke: color, "data-attempt": attempt,
                             "data-points": list.length}, curves);
    if (list.length === 1) {
      el("circle", {class: "dot", cx: X(list[0].step), cy: Y(list[0][field]), r: 2.5,
                    fill: color}, curves);
    }
    const last = list[list.length - 1];
    hint(path, `attempt ${attempt}: ${list.length} points, last step ${last.step}, ` +
               `${field} ${fmt(last[field])}`);
  }
  if (!pts.length) {
    el("text", {class: "empty", x: W / 2, y: H / 2, "text-anchor": "middle"}, svg,
       field === "loss" ? "no loss reported (rtrain.heartbeat(loss=...) sends it)"
                        : "no throughput reported (rtrain.heartbeat(samples=...))");
  }
}

function draw(){
  for (const [id, field] of [["plot-loss", "loss"], ["plot-rate", "samples_per_s"]]) {
    const holder = document.getElementById(id);
    holder.textContent = "";
    chart(holder, field);
  }
}
draw();
let pending = 0;
window.addEventListener("resize", () => {
  clearTimeout(pending); pending = setTimeout(draw, 100);
});
})();
"""
