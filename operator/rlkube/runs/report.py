"""`rlkube report RUN [RUN_B]`: one self-contained HTML file of a run (or two, overlaid): the reward and eval curves,
loss, KL, entropy, lag, throughput and the agent counters from `metrics.jsonl` / `evaluation.jsonl`, and a browser of
the kept samples (`samples.jsonl`, docs/design.md §5.7) with a diff of one prompt's samples at two versions.

Self-contained: the charts are SVG drawn here, the browser a few lines of inline JavaScript, the data inline JSON;
the file loads nothing at view time (no network, no CDN). A run is a local run's output directory, or a TrainingJob's
name, whose samples are read through the API server (rlkube.runs.kube); a cluster job's metrics live in its events
stream and trackers, not in a file, so its report shows the samples and the curves the samples themselves give
(reward per kept step).
"""

from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlkube.contract import samples as contract

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")
# (title, [(metrics key, label)], source) of each chart; source "metrics" (per step) or "evaluation" (per version).
CHARTS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("Reward", (("reward_mean", "training reward (per step)"), ("eval:reward_mean", "eval reward (per version)"))),
    ("Loss", (("loss", "loss"),)),
    ("KL", (("kl", "kl (to the sampler)"), ("ref_kl", "ref_kl (to the reference)"))),
    ("Entropy", (("entropy", "entropy"),)),
    ("Lag", (("lag_max", "lag_max (versions)"),)),
    ("Throughput", (("tokens_per_s", "tokens/s"),)),
    ("Turns and tool calls", (("turns_per_episode", "turns per episode"),
                              ("tool_calls_per_episode", "tool calls per episode"))),
    ("Agent counters (whole run)", (("episode_tool_calls", "tool calls"), ("episode_tool_errors", "tool errors"),
                                    ("episode_truncated", "truncated episodes"), ("episode_drifted", "drifted"))),
)


@dataclass
class Run:
    name: str
    metrics: list[dict[str, Any]] = field(default_factory=list)
    evaluations: list[dict[str, Any]] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return list(contract.read_rows(path)) if path.exists() else []


def load_run(run: str, namespace: str = "default", kubeconfig: str | None = None,
             context: str | None = None) -> Run:
    path = Path(run)
    if path.is_dir():
        name = path.resolve().name
        job = path / "job.json"
        if job.exists():
            try:
                name = json.loads(job.read_text()).get("name") or name
            except ValueError:
                pass
        from rlkube.runs.samples import local_rows

        r = Run(name, _jsonl(path / "metrics.jsonl"), _jsonl(path / "evaluation.jsonl"), local_rows(path))
        if not r.metrics:
            r.notes.append(f"{path}: no metrics.jsonl (written when `rlkube local` ends)")
        return r
    if "/" in run or run.startswith("."):
        raise FileNotFoundError(f"{run}: no such run directory")
    from rlkube.runs.samples import rows_of

    r = Run(run, samples=rows_of(run, namespace, kubeconfig, context))
    r.notes.append(f"{namespace}/{run}: a cluster job's metrics are in its events stream and trackers; the curves "
                   "here come from its kept samples")
    steps: dict[int, list[float]] = {}
    for s in r.samples:
        if s.get("kind") == contract.TRAIN and isinstance(s.get("reward"), int | float):
            steps.setdefault(int(s["step"]), []).append(float(s["reward"]))
    r.metrics = [{"step": k, "reward_mean": sum(v) / len(v)} for k, v in sorted(steps.items())]
    return r


def _series(run: Run, key: str) -> list[tuple[float, float]]:
    if key.startswith("eval:"):
        key = key[5:]
        return [(float(e["version"]), float(e[key])) for e in run.evaluations
                if isinstance(e.get("version"), int | float) and _finite(e.get(key))]
    return [(float(m["step"]), float(m[key])) for m in run.metrics
            if isinstance(m.get("step"), int | float) and _finite(m.get(key))]


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1000 or abs(v) < 0.01:
        return f"{v:.2e}"
    return f"{v:.3g}"


def svg_chart(title: str, lines: list[tuple[str, str, str, list[tuple[float, float]]]], width: int = 440,
              height: int = 230) -> str:
    """A line chart as inline SVG: `lines` are (label, colour, dash, points). Empty string when no line has a
    point."""
    lines = [ln for ln in lines if ln[3]]
    if not lines:
        return ""
    left, right, top, bottom = 58, 12, 26, 40
    xs = [p[0] for ln in lines for p in ln[3]]
    ys = [p[1] for ln in lines for p in ln[3]]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        y0, y1 = y0 - (abs(y0) * 0.1 or 1), y1 + (abs(y1) * 0.1 or 1)
    pw, ph = width - left - right, height - top - bottom

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return top + (1 - (y - y0) / (y1 - y0)) * ph

    parts = [f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="{html.escape(title)}">',
             f'<text x="{left}" y="16" class="ctitle">{html.escape(title)}</text>',
             f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" class="plot"/>']
    for i in range(5):
        yv = y0 + (y1 - y0) * i / 4
        y = sy(yv)
        parts.append(f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>'
                     f'<text x="{left - 4}" y="{y + 3:.1f}" class="tick" text-anchor="end">{_fmt(yv)}</text>')
        xv = x0 + (x1 - x0) * i / 4
        x = sx(xv)
        parts.append(f'<text x="{x:.1f}" y="{top + ph + 14}" class="tick" text-anchor="middle">{_fmt(xv)}</text>')
    parts.append(f'<text x="{left + pw / 2}" y="{height - 4}" class="tick" text-anchor="middle">step / version'
                 '</text>')
    for label, color, dash, pts in lines:
        pts = sorted(pts)
        d = " ".join(f"{'M' if i == 0 else 'L'}{sx(x):.1f},{sy(y):.1f}" for i, (x, y) in enumerate(pts))
        parts.append(f'<path class="series" d="{d}" stroke="{color}" fill="none" stroke-width="1.6"'
                     + (f' stroke-dasharray="{dash}"' if dash else "") + f'><title>{html.escape(label)}</title></path>')
        if len(pts) <= 40:
            parts += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.2" fill="{color}"/>' for x, y in pts]
    legend_y = top + 12
    for label, color, dash, _ in lines:
        parts.append(f'<line x1="{left + 8}" x2="{left + 26}" y1="{legend_y - 4}" y2="{legend_y - 4}" '
                     f'stroke="{color}" stroke-width="2"' + (f' stroke-dasharray="{dash}"' if dash else "") + "/>"
                     f'<text x="{left + 30}" y="{legend_y}" class="legend">{html.escape(label)}</text>')
        legend_y += 13
    parts.append("</svg>")
    return "".join(parts)


def charts(runs: list[Run]) -> list[str]:
    out = []
    for title, keys in CHARTS:
        lines = []
        for ri, run in enumerate(runs):
            for ki, (key, label) in enumerate(keys):
                name = f"{run.name}: {label}" if len(runs) > 1 else label
                color = COLORS[(ri * len(keys) + ki) % len(COLORS)] if len(runs) == 1 else COLORS[ri % len(COLORS)]
                dash = "" if len(runs) == 1 or ki == 0 else "5,3"
                lines.append((name, color, dash, _series(run, key)))
        chart = svg_chart(title, lines)
        if chart:
            out.append(chart)
    return out


def _summary(run: Run) -> str:
    m = run.metrics
    rewards = [x["reward_mean"] for x in m if _finite(x.get("reward_mean"))]
    last = m[-1] if m else {}
    parts = [f"<b>{html.escape(run.name)}</b>", f"steps {last.get('step', '-')}",
             f"samples kept {len(run.samples)}"]
    if rewards:
        parts.append(f"reward first {rewards[0]:.3f} -> last {rewards[-1]:.3f}")
    if run.evaluations:
        first, last_eval = run.evaluations[0], run.evaluations[-1]
        parts.append(f"eval {_num(first.get('reward_mean'))} (v{first.get('version')}) -> "
                     f"{_num(last_eval.get('reward_mean'))} (v{last_eval.get('version')})")
    for key, label in (("episode_episodes", "episodes"), ("episode_turns", "turns"),
                       ("episode_tool_calls", "tool calls"), ("episode_tool_errors", "tool errors")):
        if key in last:
            parts.append(f"{label} {last[key]}")
    return " &middot; ".join(parts)


def _num(v: Any) -> str:
    return f"{v:.3f}" if _finite(v) else "-"


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:18px;color:#222;background:#fafafa}
h1{font-size:20px;margin:0 0 6px} h2{font-size:16px;margin:18px 0 6px}
.summary{font-size:13px;margin:2px 0} .note{font-size:12px;color:#a60}
.charts{display:flex;flex-wrap:wrap;gap:10px}
.chart{background:#fff;border:1px solid #ddd;border-radius:4px}
.plot{fill:#fff;stroke:#bbb} .grid{stroke:#eee} .tick{font-size:10px;fill:#555} .ctitle{font-size:13px;font-weight:600}
.legend{font-size:10px;fill:#333}
table{border-collapse:collapse;font-size:12px;background:#fff;width:100%}
th,td{border:1px solid #ddd;padding:3px 5px;vertical-align:top;text-align:left}
th{background:#f0f0f0;position:sticky;top:0}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.turn{white-space:pre-wrap;font-family:ui-monospace,Menlo,Consolas,monospace;margin:1px 0;padding:1px 3px;border-radius:3px}
.turn.model{background:#eef5ff} .turn.environment{background:#f3f3f3;color:#555;border-left:3px solid #aaa}
.turn .role{font-size:10px;color:#888;margin-right:4px}
.prompt{white-space:pre-wrap;font-family:ui-monospace,Menlo,Consolas,monospace;color:#444}
.controls{font-size:12px;margin:6px 0} .controls input,.controls select{font-size:12px;margin-right:8px}
.diff{white-space:pre-wrap;font-family:ui-monospace,Menlo,Consolas,monospace;background:#fff;border:1px solid #ddd;
padding:6px;font-size:12px} .diff del{background:#fdd;text-decoration:line-through} .diff ins{background:#dfd;
text-decoration:none} .scroll{max-height:560px;overflow:auto}
"""

JS = r"""
(function(){
  const data = JSON.parse(document.getElementById('samples-data').textContent);
  const rows = data.rows;
  const el = id => document.getElementById(id);
  const esc = s => String(s === undefined || s === null ? '' : s).replace(/[&<>"]/g,
    c => ({'&':'&amp;','<':'&lt;','>':'&gt;','"':'&quot;'}[c]));
  const num = (v, d) => (typeof v === 'number') ? v.toFixed(d) : '-';
  function turnsHtml(r){
    const turns = (r.turns && r.turns.length) ? r.turns : [{role:'model', text:r.completion, masked:false}];
    return turns.map(t => '<div class="turn ' + esc(t.role) + '"><span class="role">' + esc(t.role) +
      (t.masked ? ' (masked)' : '') + '</span>' + esc(t.text) + '</div>').join('');
  }
  function render(){
    const kind = el('f-kind').value, run = el('f-run').value, step = el('f-step').value.trim();
    const minr = parseFloat(el('f-minr').value);
    const out = [];
    for (const r of rows){
      if (kind && r.kind !== kind) continue;
      if (run && r.run !== run) continue;
      if (step !== '' && String(r.step) !== step) continue;
      if (!isNaN(minr) && !(typeof r.reward === 'number' && r.reward >= minr)) continue;
      const ep = r.episode || {};
      out.push('<tr><td>' + esc(r.run) + '</td><td>' + esc(r.kind) + '</td><td class="num">' + esc(r.step) +
        '</td><td class="num">' + esc(r.weight_version) + '</td><td class="num">' + esc(r.lag === undefined ? '-' : r.lag) +
        '</td><td class="prompt">' + esc(r.prompt) + '</td><td>' + turnsHtml(r) + '</td><td class="num">' +
        num(r.reward, 3) + '</td><td class="num">' + num(r.advantage, 3) + '</td><td>' + esc(r.finish_reason) +
        '</td><td class="num">' + esc(ep.turns === undefined ? '-' : ep.turns) + '</td><td class="num">' +
        esc(ep.tool_calls === undefined ? '-' : ep.tool_calls) + '</td></tr>');
    }
    el('sample-rows').innerHTML = out.join('');
    el('sample-count').textContent = out.length + ' of ' + rows.length + ' samples';
  }
  // The diff view: one prompt's samples at two versions (the evaluation's fixed prompts, or any prompt kept twice).
  const byPrompt = new Map();
  rows.forEach((r, i) => {
    const key = r.run + '\u0000' + (r.prompt_key || r.prompt);
    if (!byPrompt.has(key)) byPrompt.set(key, []);
    byPrompt.get(key).push(i);
  });
  const prompts = [...byPrompt.entries()].filter(([k, v]) => new Set(v.map(i => rows[i].weight_version + '/' +
    rows[i].step)).size > 1);
  function tokens(s){ return String(s).split(/(\s+)/).filter(x => x.length); }
  function diff(a, b){
    const x = tokens(a), y = tokens(b), n = x.length, m = y.length;
    const L = Array.from({length: n + 1}, () => new Int32Array(m + 1));
    for (let i = n - 1; i >= 0; i--) for (let j = m - 1; j >= 0; j--)
      L[i][j] = x[i] === y[j] ? L[i + 1][j + 1] + 1 : Math.max(L[i + 1][j], L[i][j + 1]);
    const out = []; let i = 0, j = 0;
    while (i < n && j < m){
      if (x[i] === y[j]){ out.push(esc(x[i])); i++; j++; }
      else if (L[i + 1][j] >= L[i][j + 1]) out.push('<del>' + esc(x[i++]) + '</del>');
      else out.push('<ins>' + esc(y[j++]) + '</ins>');
    }
    while (i < n) out.push('<del>' + esc(x[i++]) + '</del>');
    while (j < m) out.push('<ins>' + esc(y[j++]) + '</ins>');
    return out.join('');
  }
  function text(r){
    const turns = (r.turns && r.turns.length) ? r.turns : [{role:'model', text:r.completion}];
    return turns.map(t => (t.masked ? '[env] ' : '') + t.text).join('\n');
  }
  function label(i){ const r = rows[i]; return r.kind + ' step ' + r.step + ' (weights v' + r.weight_version +
    ', reward ' + num(r.reward, 3) + ')'; }
  function fillVersions(){
    const p = prompts[el('d-prompt').value];
    const opts = p ? p[1].map(i => '<option value="' + i + '">' + esc(label(i)) + '</option>').join('') : '';
    el('d-a').innerHTML = opts; el('d-b').innerHTML = opts;
    if (p) el('d-b').selectedIndex = p[1].length - 1;
    showDiff();
  }
  function showDiff(){
    const a = rows[el('d-a').value], b = rows[el('d-b').value];
    el('diff').innerHTML = (a && b) ? diff(text(a), text(b)) : 'No prompt was kept at two versions.';
  }
  el('d-prompt').innerHTML = prompts.map(([k, v], i) => '<option value="' + i + '">' +
    esc((rows[v[0]].run + ': ' + rows[v[0]].prompt).slice(0, 120)) + ' (' + v.length + ')</option>').join('');
  ['f-kind', 'f-run', 'f-step', 'f-minr'].forEach(id => el(id).addEventListener('input', render));
  el('d-prompt').addEventListener('change', fillVersions);
  el('d-a').addEventListener('change', showDiff); el('d-b').addEventListener('change', showDiff);
  render(); fillVersions();
  document.body.setAttribute('data-ready', '1');
})();
"""


def render(runs: list[Run]) -> str:
    rows = [{**r, "run": run.name} for run in runs for r in run.samples]
    data = json.dumps({"rows": rows}, ensure_ascii=False).replace("</", "<\\/")
    names = " vs ".join(html.escape(r.name) for r in runs)
    kinds = sorted({str(r.get("kind")) for r in rows})
    run_opts = "".join(f'<option value="{html.escape(r.name)}">{html.escape(r.name)}</option>' for r in runs)
    kind_opts = "".join(f'<option value="{html.escape(k)}">{html.escape(k)}</option>' for k in kinds)
    notes = "".join(f'<p class="note">{html.escape(n)}</p>' for r in runs for n in r.notes)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>rlkube report: {names}</title>
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:">
<style>{CSS}</style></head>
<body>
<h1>rlkube report: {names}</h1>
{"".join(f'<p class="summary">{_summary(r)}</p>' for r in runs)}
{notes}
<h2>Curves</h2>
<div class="charts" id="charts">{"".join(charts(runs))}</div>
<h2>Samples <span id="sample-count" class="summary"></span></h2>
<div class="controls">run <select id="f-run"><option value="">all</option>{run_opts}</select>
kind <select id="f-kind"><option value="">all</option>{kind_opts}</select>
step <input id="f-step" size="6" placeholder="any"> min reward <input id="f-minr" size="6" placeholder="any"></div>
<div class="scroll"><table id="samples"><thead><tr><th>run</th><th>kind</th><th>step</th><th>weights</th><th>lag</th>
<th>prompt</th><th>completion (turns; masked: out of the loss)</th><th>reward</th><th>advantage</th><th>finish</th>
<th>turns</th><th>tool calls</th></tr></thead><tbody id="sample-rows"></tbody></table></div>
<h2>One prompt at two versions</h2>
<div class="controls">prompt <select id="d-prompt"></select> from <select id="d-a"></select> to
<select id="d-b"></select></div>
<div id="diff" class="diff"></div>
<script type="application/json" id="samples-data">{data}</script>
<script>{JS}</script>
</body></html>
"""


def cli(args) -> int:
    import sys

    if len(args.runs) > 2:
        print("rlkube report: one run, or two to overlay", file=sys.stderr)
        return 2
    try:
        runs = [load_run(r, args.namespace, args.kubeconfig, args.context) for r in args.runs]
    except FileNotFoundError as exc:
        print(exc, file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"rlkube report: {exc}", file=sys.stderr)
        return 1
    if len(runs) == 2 and runs[0].name == runs[1].name:  # two runs of one job: tell them apart
        runs[0].name, runs[1].name = f"{runs[0].name} (A)", f"{runs[1].name} (B)"
    out = Path(args.output or f"report-{'-vs-'.join(r.name for r in runs)}.html")
    out.write_text(render(runs), encoding="utf-8")
    print(out)
    return 0
