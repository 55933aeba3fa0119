"""A self-contained HTML report of a run directory: `write_report(run_dir) -> run_dir/report.html`.

Reads what training writes (metrics.jsonl; optionally samples.jsonl, summary.json, eval.json,
eval_before.json, config.yaml), draws the training curves with matplotlib (PNG files under
run_dir/report/, also embedded in the HTML as base64 data URIs so the page stands alone), and lists
sampled completions from the first and last logged step. Every plot is always written: one whose data the run did not
log says so, so the set of files is the same for every run.
"""

from __future__ import annotations

import base64
import datetime as _dt
import html
import io
import json
import math
from pathlib import Path

PLOTS = ("reward", "eval", "length", "kl", "entropy", "clip_ratio", "timing", "grad_lr")
OFFLINE_PLOTS = ("loss", "eval", "grad_lr")   # sft, distill; dpo adds "preference"
TIME_ORDER = ("time/generate", "time/reward", "time/ref_and_advantages", "time/update")
SAMPLES_PER_END = 4
NOT_LOGGED = "not logged in this run"
NO_VALUE = "–"   # a cell with no value (missing, or NaN: a fresh model's "before"), as on the console


# ---------------------------------------------------------------------------- reading

def _read_jsonl(path: Path) -> list[dict]:
    """JSON objects, one a line; blank lines and a torn last line (a run still writing) are skipped."""
    rows = []
    if not path.exists():
        return rows
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                continue
            raise ValueError(f"{path}: line {i + 1} is not JSON") from None
        if isinstance(obj, dict):
            rows.append(obj)
    return rows


def _read_json(path: Path):
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None


def _num(v) -> float | None:
    """A finite float, or None for missing / NaN / inf / non-numeric values."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def _steps(rows: list[dict]) -> list[float]:
    return [float(r["step"]) if _num(r.get("step")) is not None else float(i + 1) for i, r in enumerate(rows)]


def _series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) where the row has a finite value for `key`."""
    xs, ys = [], []
    for x, r in zip(_steps(rows), rows):
        v = _num(r.get(key))
        if v is not None:
            xs.append(x)
            ys.append(v)
    return xs, ys


def _keys(rows: list[dict]) -> list[str]:
    seen: dict[str, None] = {}
    for r in rows:
        for k in r:
            seen.setdefault(k, None)
    return list(seen)


# ---------------------------------------------------------------------------- formatting

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


# ---------------------------------------------------------------------------- plots

def _placeholder(ax, title: str, why: str = NOT_LOGGED) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, color="0.4", fontsize=11)
    ax.set_xticks([])
    ax.set_yticks([])


def _plot_reward(ax, rows, keys) -> None:
    xs, ys = _series(rows, "reward")
    fn_keys = [k for k in keys if k.startswith("rewards/") and k.endswith("/mean")]
    if not ys and not any(_series(rows, k)[1] for k in fn_keys):
        return _placeholder(ax, "reward")
    if ys:
        ax.plot(xs, ys, color="C0", lw=2, label="reward (mean)")
        band = [(x, y, _num(r.get("reward_std")))
                for x, y, r in zip(_steps(rows), [_num(r.get("reward")) for r in rows], rows)]
        band = [(x, y, s) for x, y, s in band if y is not None and s is not None]
        if band:
            bx = [b[0] for b in band]
            ax.fill_between(bx, [b[1] - b[2] for b in band], [b[1] + b[2] for b in band],
                            color="C0", alpha=0.15, label="± reward_std")
    for i, k in enumerate(fn_keys):
        fx, fy = _series(rows, k)
        if fy:
            ax.plot(fx, fy, lw=1, ls="--", color=f"C{(i + 1) % 10}", label=k[len("rewards/"):-len("/mean")])
    ax.set_title("reward")
    ax.set_xlabel("step")
    ax.legend(fontsize=7, loc="best")


def eval_endpoints(summary, ev, ev_before) -> tuple[dict, dict]:
    """(before, after): the held-out eval of the starting and the final model, from summary.json's
    before/after, else from eval_before.json / eval.json (`grpolab train` writes no summary.json; a
    short run logs no eval rows to metrics.jsonl). Keys without the 'eval/' prefix."""
    def plain(d) -> dict:
        return {k.removeprefix("eval/"): v for k, v in d.items()} if isinstance(d, dict) else {}
    summary = summary if isinstance(summary, dict) else {}
    return plain(summary.get("before")) or plain(ev_before), plain(summary.get("after")) or plain(ev)


def _plot_eval(ax, rows, keys, before: dict, after: dict, last_step) -> None:
    """eval/* rows of metrics.jsonl over the steps, and the before (step 0) and after (last step) evals."""
    eval_keys = [k for k in keys if k.startswith("eval/")]
    names = [n for n in dict.fromkeys([k[len("eval/"):] for k in eval_keys] + list(before) + list(after))
             if n != "loss" and not isinstance(before.get(n, after.get(n)), (dict, list))]
    # (a loss goes on the loss plot; the rest are accuracies)
    drew = False
    for i, name in enumerate(names):
        color = f"C{i % 10}"
        xs, ys = _series(rows, "eval/" + name)
        if ys:
            ax.plot(xs, ys, marker="o", ms=3, lw=1.5, color=color, label=name)
            drew = True
        b, a = _num(before.get(name)), _num(after.get(name))
        if b is not None:
            ax.plot([0], [b], marker="s", ms=7, mfc="none", mew=1.5, color=color, ls="none",
                    label=None if ys else name)
            drew = True
        if a is not None:
            ax.plot([last_step], [a], marker="D", ms=7, mfc="none", mew=1.5, color=color, ls="none",
                    label=None if ys or b is not None else name)
            drew = True
        if b is not None and a is not None and not ys:
            ax.plot([0, last_step], [b, a], color=color, lw=1, ls=":")
    if not drew:
        return _placeholder(ax, "held-out eval")
    ax.set_title("held-out eval" + (" (squares: before, diamonds: after)" if before or after else ""))
    ax.set_xlabel("step")
    ax.legend(fontsize=7, loc="best")


def _plot_twin(ax, rows, title, placeholder, left, right, right_color, *, right_from_zero=False,
               right_sci=False) -> None:
    """Two series on one step axis: `left` = (key, label) on the left y-axis in C0, `right` dashed on a twin."""
    lx, ly = _series(rows, left[0])
    rx, ry = _series(rows, right[0])
    if not ly and not ry:
        return _placeholder(ax, placeholder)
    ax.set_title(title)
    ax.set_xlabel("step")
    if ly:
        ax.plot(lx, ly, color="C0")
        ax.set_ylabel(left[1], color="C0")
    if ry:
        ax2 = ax.twinx()
        ax2.plot(rx, ry, color=right_color, ls="--")
        ax2.set_ylabel(right[1], color=right_color)
        if right_from_zero:
            ax2.set_ylim(bottom=0)
        if right_sci:
            ax2.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))


def _plot_single(ax, rows, key, title, why=NOT_LOGGED) -> None:
    xs, ys = _series(rows, key)
    if not ys:
        return _placeholder(ax, title, why)
    ax.plot(xs, ys, color="C0")
    ax.set_title(title)
    ax.set_xlabel("step")


def _plot_loss(ax, rows) -> None:
    """An offline stage's training loss, and the held-out loss (eval/loss) where it was evaluated."""
    xs, ys = _series(rows, "loss")
    ex, ey = _series(rows, "eval/loss")
    if not ys and not ey:
        return _placeholder(ax, "loss")
    if ys:
        ax.plot(xs, ys, color="C0", lw=1, label="train loss")
    if ey:
        ax.plot(ex, ey, color="C3", marker="o", ms=4, lw=1.5, label="held-out loss")
    ax.set_title("loss")
    ax.set_xlabel("step")
    ax.legend(fontsize=7, loc="best")


def _plot_preference(ax, rows) -> None:
    """DPO's implicit rewards (chosen, rejected, margin) and the share of pairs ranked right."""
    series = [(k, _series(rows, f"rewards/{k}")) for k in ("chosen", "rejected", "margins")]
    if not any(ys for _, (_, ys) in series):
        return _placeholder(ax, "implicit rewards")
    for i, (k, (xs, ys)) in enumerate(series):
        if ys:
            ax.plot(xs, ys, color=f"C{i}", label=f"rewards/{k}")
    ax.set_title("DPO implicit rewards")
    ax.set_xlabel("step")
    ax.legend(fontsize=7, loc="upper left")
    ax_, ay = _series(rows, "rewards/accuracies")
    if ay:
        ax2 = ax.twinx()
        ax2.plot(ax_, ay, color="C3", ls="--")
        ax2.set_ylabel("rewards/accuracies", color="C3")
        ax2.set_ylim(0, 1.05)


def plot_names(keys: list[str]) -> tuple[str, ...]:
    """The plots of a run: RL runs (a reward) get PLOTS; offline stages (a loss, no reward) get theirs."""
    if "reward" in keys or "loss" not in keys:
        return PLOTS + (("tools",) if "tools/calls_per_completion" in keys else ())
    return OFFLINE_PLOTS + (("preference",) if "rewards/margins" in keys else ())


def _plot_clip(ax, rows) -> None:
    drew = False
    for i, (k, label) in enumerate([("clip_ratio/low_mean", "low"), ("clip_ratio/high_mean", "high"),
                                    ("clip_ratio/region_mean", "region")]):
        xs, ys = _series(rows, k)
        if ys:
            ax.plot(xs, ys, color=f"C{i}", label=label)
            drew = True
    if not drew:
        return _placeholder(ax, "clip ratio")
    ax.set_title("clip ratio (fraction of tokens clipped)")
    ax.set_xlabel("step")
    ax.legend(fontsize=7, loc="best")


def _plot_timing(ax, rows, keys) -> None:
    phases = [k for k in TIME_ORDER if k in keys]
    phases += [k for k in keys if k.startswith("time/") and k != "time/step" and k not in phases]
    phases = [k for k in phases if _series(rows, k)[1]]
    if not phases:
        return _placeholder(ax, "time per step")
    idx = [i for i, r in enumerate(rows) if any(_num(r.get(k)) is not None for k in phases)]
    xs = [_steps(rows)[i] for i in idx]
    stacks = [[_num(rows[i].get(k)) or 0.0 for i in idx] for k in phases]
    ax.stackplot(xs, *stacks, labels=[k[len("time/"):] for k in phases], alpha=0.8)
    tx, ty = _series(rows, "time/step")
    if ty:
        ax.plot(tx, ty, color="k", lw=1, ls="--", label="step (total)")
    ax.set_title("time per step")
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=7, loc="upper left")


def _draw_plots(rows, summary, out_dir: Path, endpoints: tuple[dict, dict] = ({}, {})) -> list[tuple[str, str]]:
    """Write out_dir/<name>.png for each of PLOTS; returns [(name, base64 PNG)].

    `endpoints`: (before, after) held-out evals (eval_endpoints). Uses matplotlib's object API
    (Figure + the Agg canvas) rather than pyplot, so it neither switches the caller's backend nor
    leaves figures registered anywhere."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    keys = _keys(rows)
    steps = _steps(rows)
    last_step = max(steps) if steps else float((summary or {}).get("steps") or 0)
    out_dir.mkdir(parents=True, exist_ok=True)
    drawers = {
        "reward": lambda ax: _plot_reward(ax, rows, keys),
        "eval": lambda ax: _plot_eval(ax, rows, keys, *endpoints, last_step),
        "length": lambda ax: _plot_twin(ax, rows, "completion length", "completion length",
                                        ("completions/mean_length", "mean length (tokens)"),
                                        ("completions/clipped_ratio", "clipped ratio (hit max_new_tokens)"), "C3",
                                        right_from_zero=True),
        "kl": lambda ax: _plot_single(ax, rows, "kl", "KL to reference",
                                      "not logged in this run (no KL term)"),
        "entropy": lambda ax: _plot_single(ax, rows, "entropy", "policy entropy (per token)"),
        "clip_ratio": lambda ax: _plot_clip(ax, rows),
        "timing": lambda ax: _plot_timing(ax, rows, keys),
        "grad_lr": lambda ax: _plot_twin(ax, rows, "grad norm and learning rate", "grad norm / lr",
                                         ("grad_norm", "grad_norm"), ("lr", "lr"), "C2", right_sci=True),
        "loss": lambda ax: _plot_loss(ax, rows),
        "preference": lambda ax: _plot_preference(ax, rows),
        "tools": lambda ax: _plot_twin(ax, rows, "tool calls", "tool calls",
                                       ("tools/calls_per_completion", "calls per completion"),
                                       ("tools/error_rate", "error rate (per call)"), "C3", right_from_zero=True),
    }
    images = []
    for name in plot_names(keys):
        fig = Figure(figsize=(6.0, 3.4), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        drawers[name](ax)
        if ax.get_xticks().size:   # a placeholder has no ticks and no grid
            ax.grid(alpha=0.3)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100)
        fig.clear()
        data = buf.getvalue()
        (out_dir / f"{name}.png").write_bytes(data)
        images.append((name, base64.b64encode(data).decode("ascii")))
    return images


# ---------------------------------------------------------------------------- sections

def _summary_section(summary) -> str:
    if not isinstance(summary, dict):
        return ""
    before = summary.get("before") or {}
    after = summary.get("after") or {}
    rows = []
    for k in dict.fromkeys(list(before) + list(after)):
        b, a = before.get(k), after.get(k)
        nb, na = _num(b), _num(a)
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


def _last_values_section(rows) -> str:
    """The last finite value of every scalar metric, and its median over the run."""
    out = []
    for k in _keys(rows):
        if k == "step":
            continue
        _, ys = _series(rows, k)
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
        rew = ", ".join(f"{name}={_fmt(_num(v))}" for name, v in rewards.items()) \
            if isinstance(rewards, dict) else str(rewards)
        parts.append(
            '<div class="sample">'
            f"<div class=\"meta\">reward <b>{_e(_num(r.get('reward')))}</b> · advantage "
            f"<b>{_e(_num(r.get('advantage')))}</b>" + (f" · {_e(rew)}" if rew else "") + "</div>"
            f"<div class=\"label\">prompt</div><pre>{_e(_prompt_text(r.get('prompt')))}</pre>"
            f"<div class=\"label\">completion</div><pre>{_e(str(r.get('completion', '')))}</pre>"
            "</div>")
    return "".join(parts)


def _samples_section(samples: list[dict]) -> str:
    steps = sorted({s["step"] for s in samples if _num(s.get("step")) is not None})
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
"""


# ---------------------------------------------------------------------------- entry point

def write_report(run_dir: str | Path) -> Path:
    """Write run_dir/report.html (and its plots under run_dir/report/); returns the HTML path."""
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}: not a training run directory")
    rows = _read_jsonl(metrics_path)
    samples = _read_jsonl(run_dir / "samples.jsonl")
    summary = _read_json(run_dir / "summary.json")
    ev = _read_json(run_dir / "eval.json")
    endpoints = eval_endpoints(summary, ev, _read_json(run_dir / "eval_before.json"))
    config_path = run_dir / "config.yaml"
    config_text = config_path.read_text(encoding="utf-8", errors="replace") if config_path.is_file() else None

    note = ""
    try:
        import matplotlib  # noqa: F401 - only to find out whether plots can be drawn
        images = _draw_plots(rows, summary if isinstance(summary, dict) else None, run_dir / "report", endpoints)
    except ImportError:
        images = []
        note = '<p class="note">No plots: they need matplotlib (pip install matplotlib).</p>'

    steps = _steps(rows)
    _, rew = _series(rows, "reward")
    head = [["steps logged", len(rows)]]
    if steps:
        head.append(["last step", int(max(steps)) if max(steps).is_integer() else max(steps)])
    if rew:
        head += [["reward, first step", rew[0]], ["reward, last step", rew[-1]]]
    _, tps = _series(rows, "perf/gen_tokens_per_sec")
    if tps:
        head.append(["generation tokens/s (median)", sorted(tps)[len(tps) // 2]])
    _, ts = _series(rows, "time/step")
    if ts:
        head.append(["time per step, s (median)", sorted(ts)[len(ts) // 2]])

    figs = "".join(f'<figure><img alt="{_e(name)}" src="data:image/png;base64,{b64}">'
                   f'<figcaption><a href="report/{_e(name)}.png">{_e(name)}.png</a></figcaption></figure>'
                   for name, b64 in images)
    body = [
        f"<h1>grpolab run report: {_e(run_dir.resolve().name)}</h1>",
        f"<p>{_e(str(run_dir.resolve()))} · generated "
        f"{_e(_dt.datetime.now().isoformat(timespec='seconds'))}</p>",
        _table(["", "value"], head),
        _summary_section(summary),
        _eval_section(ev),
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


# ---------------------------------------------------------------------------- multi-stage runs

STAGE_METRICS = ("greedy_accuracy", "pass@1", "pass@8", "loss")


def write_pipeline_report(root: str | Path) -> Path:
    """root/report.html of a multi-stage run (pipeline.json): the held-out eval after every stage, as a
    table and a plot, with links to each stage's own report."""
    root = Path(root)
    stages = (_read_json(root / "pipeline.json") or {}).get("stages") or []
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
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        fig = Figure(figsize=(7.0, 3.6), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        for i, m in enumerate(acc):
            pts = [(j, _num((s.get("eval") or {}).get(m))) for j, s in enumerate(stages)]
            pts = [(j, v) for j, v in pts if v is not None]
            ax.plot([j for j, _ in pts], [v for _, v in pts], marker="o", color=f"C{i}", label=m)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_title("held-out eval after each stage")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100)
        (root / "stages.png").write_bytes(buf.getvalue())
        img = f'<img alt="stages" src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode("ascii")}">'
    page = ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
            f"<title>grpolab pipeline: {_e(root.resolve().name)}</title><style>{CSS}</style></head><body>"
            f"<h1>grpolab pipeline report: {_e(root.resolve().name)}</h1>"
            f"<h2>Held-out eval after every stage</h2>{table}{img}</body></html>\n")
    out = root / "report.html"
    out.write_text(page, encoding="utf-8")
    return out
