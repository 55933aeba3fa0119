"""The report's HTML page: `write_report(run_dir) -> run_dir/report.html`, and the page of a multi-stage run.

Reads what training writes (metrics.jsonl; optionally samples.jsonl, summary.json, eval.json,
eval_before.json, config.yaml), draws the curves (plots.py; PNG files under run_dir/report/, also
embedded in the HTML as base64 data URIs so the page stands alone), and lists sampled completions
from the first and last logged step."""

from __future__ import annotations

import base64
import datetime as _dt
import html
import math
from pathlib import Path

from ..reward_hacking import STDERR_KEY, WINDOW, Z, series_from_rows, verdicts
from .plots import draw_plots, eval_endpoints, plot_stages
from .read import metric_keys, num, read_json, read_jsonl, series, step_values

SAMPLES_PER_END = 4


NO_VALUE = "–"   # a cell with no value (missing, or NaN: a fresh model's "before"), as on the console




def _fmt(v) -> str:
    if v is None:
        return NO_VALUE
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):   # no value, not a number to read (an inf loss is one: it stays "inf")
            return NO_VALUE
        if not math.isfinite(v):
            return str(v)
        if abs(v) >= 1e3:
            return f"{v:.1f}"
        if v != 0 and abs(v) < 1e-3:
            return f"{v:.3e}"
        return f"{v:.4g}"
    return str(v)


def _e(v) -> str:
    return html.escape(v if isinstance(v, str) else _fmt(v))


def _table(header: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _prompt_text(prompt) -> str:
    if isinstance(prompt, list):
        parts = []
        for m in prompt:
            if isinstance(m, dict):
                parts.append(f"[{m.get('role', '?')}] {m.get('content', '')}")
            else:
                parts.append(str(m))
        return "\n".join(parts)
    return "" if prompt is None else str(prompt)




def _summary_section(summary) -> str:
    if not isinstance(summary, dict):
        return ""
    before = summary.get("before") or {}
    after = summary.get("after") or {}
    rows = []
    for k in dict.fromkeys(list(before) + list(after)):
        b, a = before.get(k), after.get(k)
        nb, na = num(b), num(a)
        rows.append([k, b, a, na - nb if nb is not None and na is not None else None])
    out = "<h2>Before / after (summary.json)</h2>"
    if rows:
        out += _table(["metric (held-out)", "before", "after", "change"], rows)
    extra = [[k, summary.get(k)] for k in ("steps", "seed", "wall_seconds", "rollout_tokens_per_sec")
             if k in summary]
    extra += [[k, v] for k, v in summary.items()
              if k not in ("before", "after", "steps", "seed", "wall_seconds", "rollout_tokens_per_sec")
              and not isinstance(v, (dict, list))]
    if extra:
        out += _table(["", "value"], extra)
    return out


def _eval_section(ev) -> str:
    if not isinstance(ev, dict) or not ev:
        return ""
    rows = [[k, v] for k, v in ev.items() if not isinstance(v, (dict, list))]
    return "<h2>Final eval (eval.json)</h2>" + _table(["metric", "value"], rows) if rows else ""


def _watch_sections(rows) -> tuple[str, str]:
    """(warning box, table): the reward-hacking watch's flags, and held-out accuracy next to the training reward
    at every eval of metrics.jsonl (monitor/reward_hacking.py); ("", "") without eval rows or without a reward
    (an offline stage)."""
    rewards, evals = series_from_rows(rows)
    acc_rows = [r for r in rows if num(r.get("eval/greedy_accuracy")) is not None]
    if not acc_rows or not rewards:
        return "", ""
    judged = {v.step: v for v in verdicts(rewards, evals)}
    stderr_steps = {s for s, _, _ in evals}
    table, prev = [], 0
    for r in acc_rows:
        step = r.get("step")
        since = [x for s, x in rewards if prev < s <= step] if isinstance(step, int) else []
        prev = step if isinstance(step, int) else prev
        v = judged.get(step)
        if v is not None:
            flag = "FLAGGED" if v.flagged else "ok"
        else:
            flag = "no standard error logged" if step not in stderr_steps else f"no verdict (needs {WINDOW} evals)"
        table.append([step, sum(since) / len(since) if since else None, num(r.get("eval/greedy_accuracy")),
                      num(r.get(STDERR_KEY)), num(r.get("eval/pass@1")), flag])
    section = ("<h2>Training reward and held-out accuracy</h2>"
               + _table(["eval step", "training reward (mean since the eval before)", "held-out greedy accuracy",
                         "standard error", "pass@1", "reward-hacking watch"], table))
    flagged = [v for v in judged.values() if v.flagged]
    if not flagged:
        return "", section
    steps = ", ".join(str(v.step) for v in flagged)
    items = "".join(f"<li>step {_e(v.step)}: {_e(v.describe())}</li>" for v in flagged)
    box = (f'<div class="warn" id="reward-hacking"><b>Possible reward hacking at step{"s" if len(flagged) > 1 else ""} '
           f"{_e(steps)}</b>: held-out accuracy fell by more than {Z:g} standard errors over the last evals while "
           f"the training reward did not fall. The reward may no longer measure the task: read the samples "
           f"(samples.jsonl) of those steps.<ul>{items}</ul></div>")
    return box, section


def _last_values_section(rows) -> str:
    """The last finite value of every scalar metric, and its median over the run."""
    out = []
    for k in metric_keys(rows):
        if k == "step":
            continue
        _, ys = series(rows, k)
        if not ys:
            continue
        med = sorted(ys)[len(ys) // 2]
        out.append([k, ys[-1], med, len(ys)])
    if not out:
        return ""
    return ("<details><summary>Last logged value of every metric</summary>"
            + _table(["metric", "last", "median", "steps logged"], out) + "</details>")


def _samples_block(title: str, recs: list[dict]) -> str:
    parts = [f"<h3>{_e(title)}</h3>"]
    for r in recs:
        rewards = r.get("rewards") or {}
        rew = ", ".join(f"{name}={_fmt(num(v))}" for name, v in rewards.items()) \
            if isinstance(rewards, dict) else str(rewards)
        parts.append(
            '<div class="sample">'
            f"<div class=\"meta\">reward <b>{_e(num(r.get('reward')))}</b> · advantage "
            f"<b>{_e(num(r.get('advantage')))}</b>" + (f" · {_e(rew)}" if rew else "") + "</div>"
            f"<div class=\"label\">prompt</div><pre>{_e(_prompt_text(r.get('prompt')))}</pre>"
            f"<div class=\"label\">completion</div><pre>{_e(str(r.get('completion', '')))}</pre>"
            "</div>")
    return "".join(parts)


def _samples_section(samples: list[dict]) -> str:
    steps = sorted({s["step"] for s in samples if num(s.get("step")) is not None})
    if not steps:
        return ""
    first, last = steps[0], steps[-1]
    out = "<h2>Sampled completions (samples.jsonl)</h2>"
    out += _samples_block(f"start of training: step {first}",
                          [s for s in samples if s.get("step") == first][:SAMPLES_PER_END])
    if last != first:
        out += _samples_block(f"end of training: step {last}",
                              [s for s in samples if s.get("step") == last][:SAMPLES_PER_END])
    return out


CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;max-width:1280px;margin:2em auto;\
padding:0 1em;color:#222}
h1{font-size:1.5em} h2{font-size:1.2em;border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
h3{font-size:1.05em}
table{border-collapse:collapse;margin:.6em 0;font-size:.9em}
td,th{border:1px solid #ddd;padding:.25em .6em;text-align:left} th{background:#f5f5f5}
.plots{display:flex;flex-wrap:wrap;gap:8px} .plots figure{margin:0} \
.plots img{width:600px;max-width:100%;border:1px solid #eee}
pre{background:#f7f7f7;border:1px solid #e5e5e5;padding:.5em;white-space:pre-wrap;word-break:break-word;\
font-size:.85em;max-height:30em;overflow:auto}
.sample{border-left:3px solid #4c78a8;padding-left:.8em;margin:1em 0} .label{color:#666;font-size:.8em;margin-top:.3em}
.meta{font-size:.9em} .note{color:#a60}
.warn{background:#fdecea;border:2px solid #c0392b;color:#611a15;padding:.6em 1em;margin:1em 0;border-radius:4px}
"""




def write_report(run_dir: str | Path) -> Path:
    """Write run_dir/report.html (and its plots under run_dir/report/); returns the HTML path."""
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}: not a training run directory")
    rows = read_jsonl(metrics_path)
    samples = read_jsonl(run_dir / "samples.jsonl")
    summary = read_json(run_dir / "summary.json")
    ev = read_json(run_dir / "eval.json")
    endpoints = eval_endpoints(summary, ev, read_json(run_dir / "eval_before.json"))
    config_path = run_dir / "config.yaml"
    config_text = config_path.read_text(encoding="utf-8", errors="replace") if config_path.is_file() else None

    note = ""
    try:
        import matplotlib  # noqa: F401 - only to find out whether plots can be drawn
        images = draw_plots(rows, summary if isinstance(summary, dict) else None, run_dir / "report", endpoints)
    except ImportError:
        images = []
        note = '<p class="note">No plots: they need matplotlib (pip install matplotlib).</p>'

    steps = step_values(rows)
    _, rew = series(rows, "reward")
    head = [["steps logged", len(rows)]]
    if steps:
        head.append(["last step", int(max(steps)) if max(steps).is_integer() else max(steps)])
    if rew:
        head += [["reward, first step", rew[0]], ["reward, last step", rew[-1]]]
    _, tps = series(rows, "perf/gen_tokens_per_sec")
    if tps:
        head.append(["generation tokens/s (median)", sorted(tps)[len(tps) // 2]])
    _, ts = series(rows, "time/step")
    if ts:
        head.append(["time per step, s (median)", sorted(ts)[len(ts) // 2]])

    warn_box, watch_table = _watch_sections(rows)
    figs = "".join(f'<figure><img alt="{_e(name)}" src="data:image/png;base64,{b64}">'
                   f'<figcaption><a href="report/{_e(name)}.png">{_e(name)}.png</a></figcaption></figure>'
                   for name, b64 in images)
    body = [
        f"<h1>grpolab run report: {_e(run_dir.resolve().name)}</h1>",
        f"<p>{_e(str(run_dir.resolve()))} · generated "
        f"{_e(_dt.datetime.now().isoformat(timespec='seconds'))}</p>",
        _table(["", "value"], head),
        warn_box,
        _summary_section(summary),
        _eval_section(ev),
        watch_table,
        "<h2>Training curves</h2>" + note + f'<div class="plots">{figs}</div>',
        _last_values_section(rows),
        _samples_section(samples),
    ]
    if config_text is not None:
        body.append(f"<h2>Config (config.yaml)</h2><pre>{html.escape(config_text)}</pre>")
    page = ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
            f"<title>grpolab report: {_e(run_dir.resolve().name)}</title><style>{CSS}</style></head>"
            "<body>" + "\n".join(b for b in body if b) + "</body></html>\n")
    out = run_dir / "report.html"
    out.write_text(page, encoding="utf-8")
    return out




STAGE_METRICS = ("greedy_accuracy", "pass@1", "pass@8", "loss")


def write_pipeline_report(root: str | Path) -> Path:
    """root/report.html of a multi-stage run (pipeline.json): the held-out eval after every stage, as a
    table and a plot, with links to each stage's own report."""
    root = Path(root)
    stages = (read_json(root / "pipeline.json") or {}).get("stages") or []
    labels = [f"{s.get('stage')}-{s.get('job')}" for s in stages]
    metrics = [m for m in STAGE_METRICS if any(m in (s.get("eval") or {}) for s in stages)]
    rows = []
    for label, s in zip(labels, stages):
        ev = s.get("eval") or {}
        note = ""
        if s.get("rm_eval"):
            note = f"reward model: held-out pair accuracy {_fmt(s['rm_eval'].get('accuracy'))}"
        if s.get("sample"):
            st = s["sample"]
            note = (f"{st.get('pairs', st.get('accepted'))} {'pairs' if s.get('pairs') else 'rows'} "
                    f"from {st.get('samples')} samples")
        link = f'<a href="{_e(Path(s.get("dir", "")).name)}/report.html">{_e(label)}</a>' \
            if s.get("checkpoint") or s.get("reward_model") else _e(label)
        rows.append([link] + [_e(ev.get(m)) for m in metrics] + [_e(note)])
    table = "<table><tr>" + "".join(f"<th>{_e(h)}</th>" for h in ["stage", *metrics, "note"]) + "</tr>" + \
        "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows) + "</table>"
    img = ""
    acc = [m for m in metrics if m != "loss"]
    if acc:
        png = plot_stages(stages, labels, acc)
        (root / "stages.png").write_bytes(png)
        img = f'<img alt="stages" src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">'
    page = ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
            f"<title>grpolab pipeline: {_e(root.resolve().name)}</title><style>{CSS}</style></head><body>"
            f"<h1>grpolab pipeline report: {_e(root.resolve().name)}</h1>"
            f"<h2>Held-out eval after every stage</h2>{table}{img}</body></html>\n")
    out = root / "report.html"
    out.write_text(page, encoding="utf-8")
    return out
