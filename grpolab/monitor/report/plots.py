"""The report's training curves (matplotlib): one PNG per plot, always written; a plot whose data the
run did not log says so, so every run has the same set of files."""

from __future__ import annotations

import base64
import io
from pathlib import Path

from ..reward_hacking import Z, series_from_rows, verdicts
from .read import metric_keys, num, series, step_values

PLOTS = ("reward", "eval", "reward_vs_accuracy", "length", "kl", "entropy", "clip_ratio", "timing", "grad_lr")


OFFLINE_PLOTS = ("loss", "eval", "grad_lr")   # sft, distill; dpo adds "preference"


TIME_ORDER = ("time/generate", "time/reward", "time/ref_and_advantages", "time/update")


NOT_LOGGED = "not logged in this run"


def _placeholder(ax, title: str, why: str = NOT_LOGGED) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, color="0.4", fontsize=11)
    ax.set_xticks([])
    ax.set_yticks([])


def _plot_reward(ax, rows, keys) -> None:
    xs, ys = series(rows, "reward")
    fn_keys = [k for k in keys if k.startswith("rewards/") and k.endswith("/mean")]
    if not ys and not any(series(rows, k)[1] for k in fn_keys):
        return _placeholder(ax, "reward")
    if ys:
        ax.plot(xs, ys, color="C0", lw=2, label="reward (mean)")
        band = [(x, y, num(r.get("reward_std")))
                for x, y, r in zip(step_values(rows), [num(r.get("reward")) for r in rows], rows)]
        band = [(x, y, s) for x, y, s in band if y is not None and s is not None]
        if band:
            bx = [b[0] for b in band]
            ax.fill_between(bx, [b[1] - b[2] for b in band], [b[1] + b[2] for b in band],
                            color="C0", alpha=0.15, label="± reward_std")
    for i, k in enumerate(fn_keys):
        fx, fy = series(rows, k)
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
        xs, ys = series(rows, "eval/" + name)
        if ys:
            ax.plot(xs, ys, marker="o", ms=3, lw=1.5, color=color, label=name)
            drew = True
        b, a = num(before.get(name)), num(after.get(name))
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


def _plot_reward_vs_accuracy(ax, rows) -> None:
    """Training reward and held-out greedy accuracy (± Z standard errors) on one step axis; the windows of the evals
    the reward-hacking watch flagged are shaded red (monitor/reward_hacking.py)."""
    rewards, evals = series_from_rows(rows)
    _, acc = series(rows, "eval/greedy_accuracy")
    if not rewards or not acc:
        return _placeholder(ax, "reward vs held-out accuracy", "no held-out evals in metrics.jsonl (train.eval_every)")
    ax.plot([s for s, _ in rewards], [r for _, r in rewards], color="C0", lw=1.2, label="training reward")
    ax.set_ylabel("training reward", color="C0")
    ax.set_xlabel("step")
    ax2 = ax.twinx()
    ex, ey = series(rows, "eval/greedy_accuracy")
    if evals:   # with standard errors: error bars
        ax2.errorbar([s for s, _, _ in evals], [a for _, a, _ in evals], yerr=[Z * se for _, _, se in evals],
                     color="C3", marker="o", ms=4, lw=1.5, capsize=3, label=f"held-out accuracy (± {Z:g} s.e.)")
    else:
        ax2.plot(ex, ey, color="C3", marker="o", ms=4, lw=1.5, label="held-out accuracy")
    ax2.set_ylabel("held-out greedy accuracy", color="C3")
    flagged = [v for v in verdicts(rewards, evals) if v.flagged]
    for i, v in enumerate(flagged):
        ax.axvspan(v.first_step, v.step, color="red", alpha=0.12, lw=0, label="reward hacking?" if i == 0 else None)
    ax.set_title("training reward vs held-out accuracy" + (" (flagged: red)" if flagged else ""))
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=7, loc="best")


def _plot_twin(ax, rows, title, placeholder, left, right, right_color, *, right_from_zero=False,
               right_sci=False) -> None:
    """Two series on one step axis: `left` = (key, label) on the left y-axis in C0, `right` dashed on a twin."""
    lx, ly = series(rows, left[0])
    rx, ry = series(rows, right[0])
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
    xs, ys = series(rows, key)
    if not ys:
        return _placeholder(ax, title, why)
    ax.plot(xs, ys, color="C0")
    ax.set_title(title)
    ax.set_xlabel("step")


def _plot_loss(ax, rows) -> None:
    """An offline stage's training loss, and the held-out loss (eval/loss) where it was evaluated."""
    xs, ys = series(rows, "loss")
    ex, ey = series(rows, "eval/loss")
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
    curves = [(k, series(rows, f"rewards/{k}")) for k in ("chosen", "rejected", "margins")]
    if not any(ys for _, (_, ys) in curves):
        return _placeholder(ax, "implicit rewards")
    for i, (k, (xs, ys)) in enumerate(curves):
        if ys:
            ax.plot(xs, ys, color=f"C{i}", label=f"rewards/{k}")
    ax.set_title("DPO implicit rewards")
    ax.set_xlabel("step")
    ax.legend(fontsize=7, loc="upper left")
    ax_, ay = series(rows, "rewards/accuracies")
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
        xs, ys = series(rows, k)
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
    phases = [k for k in phases if series(rows, k)[1]]
    if not phases:
        return _placeholder(ax, "time per step")
    idx = [i for i, r in enumerate(rows) if any(num(r.get(k)) is not None for k in phases)]
    xs = [step_values(rows)[i] for i in idx]
    stacks = [[num(rows[i].get(k)) or 0.0 for i in idx] for k in phases]
    ax.stackplot(xs, *stacks, labels=[k[len("time/"):] for k in phases], alpha=0.8)
    tx, ty = series(rows, "time/step")
    if ty:
        ax.plot(tx, ty, color="k", lw=1, ls="--", label="step (total)")
    ax.set_title("time per step")
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=7, loc="upper left")


def draw_plots(rows, summary, out_dir: Path, endpoints: tuple[dict, dict] = ({}, {})) -> list[tuple[str, str]]:
    """Write out_dir/<name>.png for each of PLOTS; returns [(name, base64 PNG)].

    `endpoints`: (before, after) held-out evals (eval_endpoints). Uses matplotlib's object API
    (Figure + the Agg canvas) rather than pyplot, so it neither switches the caller's backend nor
    leaves figures registered anywhere."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    keys = metric_keys(rows)
    steps = step_values(rows)
    last_step = max(steps) if steps else float((summary or {}).get("steps") or 0)
    out_dir.mkdir(parents=True, exist_ok=True)
    drawers = {
        "reward": lambda ax: _plot_reward(ax, rows, keys),
        "eval": lambda ax: _plot_eval(ax, rows, keys, *endpoints, last_step),
        "reward_vs_accuracy": lambda ax: _plot_reward_vs_accuracy(ax, rows),
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


def plot_stages(stages: list[dict], labels: list[str], metrics: list[str]) -> bytes:
    """A multi-stage run's held-out `metrics` after each stage, as PNG bytes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(7.0, 3.6), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for i, m in enumerate(metrics):
        pts = [(j, num((s.get("eval") or {}).get(m))) for j, s in enumerate(stages)]
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
    return buf.getvalue()
