"""grpolab.monitor.report: the HTML run report built from a run directory's files."""

import base64
import io
import json
import math
import re
import sys

import pytest

from grpolab.monitor.report import OFFLINE_PLOTS, PLOTS, eval_endpoints, write_report

PNG_SIG = b"\x89PNG\r\n\x1a\n"
STEPS = 20
EVAL_STEPS = (5, 10, 15, 20)


def _metrics_row(step: int, *, full: bool = True) -> dict:
    t = step / STEPS
    m = {"step": step, "reward": 0.2 + 0.5 * t, "reward_std": 0.3 - 0.1 * t, "frac_reward_zero_std": 0.5 - 0.3 * t,
         "rewards/math_accuracy/mean": 0.1 + 0.6 * t, "rewards/math_accuracy/std": 0.3,
         "rewards/format/mean": 0.5 + 0.4 * t, "rewards/format/std": 0.2,
         "loss": 0.01 * math.sin(step), "entropy": 1.5 - 0.5 * t,
         "clip_ratio/low_mean": 0.01 * t, "clip_ratio/high_mean": 0.02 * t, "clip_ratio/region_mean": 0.03 * t,
         "grad_norm": 1.0 + 0.1 * math.cos(step), "lr": 1e-6 * min(1.0, step / 5),
         "completions/mean_length": 120 - 2 * step, "completions/clipped_ratio": 0.25 - 0.01 * step,
         "perf/gen_tokens_per_sec": 900.0 + step}
    if full:
        m["kl"] = 0.001 * step
        m.update({"time/generate": 2.0, "time/reward": 0.1, "time/ref_and_advantages": 0.4, "time/update": 1.2,
                  "time/step": 3.75})
        if step in EVAL_STEPS:
            m.update({"eval/greedy_accuracy": 0.3 + 0.01 * step, "eval/pass@1": 0.25 + 0.01 * step,
                      "eval/pass@8": 0.6 + 0.01 * step, "eval/maj@8": 0.4 + 0.01 * step})
    return m


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _sample(step, i, completion):
    return {"step": step, "prompt": [{"role": "system", "content": "Think, then answer after ####."},
                                     {"role": "user", "content": f"What is {i} + {step}?"}],
            "completion": completion, "reward": 1.0 if i % 2 else 0.0,
            "rewards": {"math_accuracy": 1.0 if i % 2 else 0.0, "format": None}, "advantage": 0.5 - i * 0.25}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    _write_jsonl(d / "metrics.jsonl", [_metrics_row(s) for s in range(1, STEPS + 1)])
    samples = [_sample(1, i, f"early answer {i} <b>bold?</b> & more\n#### {i}") for i in range(6)]
    samples += [_sample(10, i, f"middle step completion {i}") for i in range(2)]
    samples += [_sample(STEPS, i, f"late answer {i} x<y\n#### {i + STEPS}") for i in range(6)]
    _write_jsonl(d / "samples.jsonl", samples)
    (d / "summary.json").write_text(json.dumps({
        "before": {"greedy_accuracy": 0.3125, "pass@1": 0.2875, "pass@8": 0.6125},
        "after": {"greedy_accuracy": 0.5625, "pass@1": 0.4875, "pass@8": 0.8125},
        "steps": STEPS, "seed": 1234, "wall_seconds": 321.5, "rollout_tokens_per_sec": 910.5}))
    (d / "config.yaml").write_text("model:\n  name: tiny  # <not a tag>\ntrain:\n  max_steps: 20\n")
    out = write_report(d)
    return d, out, out.read_text(encoding="utf-8")


def _check_png(data: bytes):
    assert data[:8] == PNG_SIG
    from PIL import Image
    with Image.open(io.BytesIO(data)) as im:
        im.verify()
    with Image.open(io.BytesIO(data)) as im:
        assert im.size[0] > 0 and im.size[1] > 0


def test_full_report_files_and_images(full_run):
    d, out, page = full_run
    assert out == d / "report.html" and out.is_file()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    pngs = sorted((d / "report").glob("*.png"))
    assert {p.stem for p in pngs} == set(PLOTS) and len(pngs) >= 6
    for p in pngs:
        _check_png(p.read_bytes())
    embedded = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(embedded) == len(PLOTS) >= 6
    for b64 in embedded:
        _check_png(base64.b64decode(b64))
    # the embedded image is the file written beside it
    assert base64.b64decode(embedded[0]) == (d / "report" / f"{PLOTS[0]}.png").read_bytes()
    assert "not logged in this run" not in page   # nothing to placeholder here; placeholders are in PNGs only


def test_full_report_tables_samples_config(full_run):
    d, _, page = full_run
    # summary.json numbers: before, after, change and run facts
    for s in ("0.3125", "0.5625", "0.25", "0.2875", "0.4875", "0.6125", "0.8125", "1234", "321.5", "910.5"):
        assert s in page, s
    assert "greedy_accuracy" in page and "pass@8" in page
    # samples: escaped, from the first and last step only, at most 4 each
    assert "&lt;b&gt;bold?&lt;/b&gt; &amp; more" in page
    assert "<b>bold?</b>" not in page
    assert "late answer 0 x&lt;y" in page
    assert "start of training: step 1" in page and f"end of training: step {STEPS}" in page
    assert "early answer 3" in page and "early answer 4" not in page
    assert "late answer 3" in page and "late answer 4" not in page
    assert "middle step completion" not in page
    assert "What is 0 + 1?" in page and "[system] Think, then answer after ####." in page
    assert "math_accuracy=1" in page and "format=–" in page
    # config, escaped inside <pre>
    assert "&lt;not a tag&gt;" in page and "max_steps: 20" in page


def test_missing_metrics_names_the_directory(tmp_path):
    d = tmp_path / "not_a_run"
    d.mkdir()
    with pytest.raises(FileNotFoundError, match="not_a_run"):
        write_report(d)
    assert not (d / "report.html").exists()


def test_a_garbage_metrics_line_is_one_line_naming_it(tmp_path):
    from conftest import run_cli
    d = tmp_path / "run"
    d.mkdir()
    (d / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n{garbage\n{"step": 2, "reward": 0.7}\n')
    r = run_cli("report", str(d), timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [f"grpolab: data error: {d / 'metrics.jsonl'}: line 2 is not JSON "
                                             f"('{{garbage'); fix or remove that line"], r.stderr
    assert not (d / "report.html").exists()
    (d / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n{"step": 2, "rew')   # torn last line: a live run
    assert run_cli("report", str(d), timeout=120).returncode == 0


def test_minimal_metrics_without_kl_eval_time(tmp_path):
    rows = [_metrics_row(s, full=False) for s in range(1, 6)]
    rows[2]["reward"] = float("nan")       # NaN values are skipped, not plotted
    rows[3].pop("entropy")                 # and any key may be missing on a step
    _write_jsonl(tmp_path / "metrics.jsonl", rows)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "rew')         # a torn last line of a run still writing
    page = write_report(tmp_path).read_text(encoding="utf-8")
    pngs = sorted((tmp_path / "report").glob("*.png"))
    assert len(pngs) == len(PLOTS)
    for p in pngs:
        _check_png(p.read_bytes())
    assert len(re.findall(r'src="data:image/png;base64,', page)) == len(PLOTS)
    assert "Sampled completions" not in page and "summary.json" not in page and "config.yaml" not in page


def test_without_matplotlib_still_writes_tables(tmp_path, monkeypatch):
    _write_jsonl(tmp_path / "metrics.jsonl", [_metrics_row(s) for s in range(1, 4)])
    (tmp_path / "eval.json").write_text(json.dumps({"greedy_accuracy": 0.4375, "pass@1": 0.375}))
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # `import matplotlib` now raises ImportError
    page = write_report(tmp_path).read_text(encoding="utf-8")
    assert "pip install matplotlib" in page and "data:image/png" not in page
    assert "0.4375" in page and "eval.json" in page


# ---------------------------------------------------------------- short runs: the before/after eval

C0 = (31, 119, 180)   # matplotlib's first colour: the first eval metric's markers; a placeholder is grey text


def _c0_pixels(png: bytes) -> int:
    from PIL import Image
    with Image.open(io.BytesIO(png)) as im:
        raw = im.convert("RGB").tobytes()
    return sum(1 for i in range(0, len(raw), 3) if all(abs(raw[i + j] - C0[j]) <= 12 for j in range(3)))


def test_eval_endpoints_prefer_summary_then_eval_files():
    summary = {"before": {"greedy_accuracy": 0.1}, "after": {"greedy_accuracy": 0.4}}
    ev, ev_before = {"greedy_accuracy": 0.5, "pass@1": 0.3}, {"eval/greedy_accuracy": 0.2}
    assert eval_endpoints(summary, ev, ev_before) == ({"greedy_accuracy": 0.1}, {"greedy_accuracy": 0.4})
    # `grpolab train` writes no summary.json; sft's eval_before.json keeps the eval/ prefix
    assert eval_endpoints(None, ev, ev_before) == ({"greedy_accuracy": 0.2}, ev)
    # a fresh model's summary has an empty "before": eval_before.json is empty too
    assert eval_endpoints({"before": {}, "after": {"loss": 2.0}}, None, {}) == ({}, {"loss": 2.0})
    assert eval_endpoints(None, None, None) == ({}, {})


def test_short_run_plots_the_final_eval_from_eval_json(tmp_path):
    """A short `grpolab train` run: no eval rows in metrics.jsonl, no summary.json, but eval.json. The eval
    plot draws it (at the last step) instead of saying "not logged"; without eval.json it is a placeholder."""
    rows = [_metrics_row(s, full=False) for s in range(1, 4)]
    for name, with_eval in (("bare", False), ("short", True)):
        d = tmp_path / name
        d.mkdir()
        _write_jsonl(d / "metrics.jsonl", rows)
        if with_eval:
            (d / "eval.json").write_text(json.dumps({"greedy_accuracy": 0.375, "pass@1": 0.25, "maj@8": 0.5}))
        write_report(d)
    placeholder = (tmp_path / "bare" / "report" / "eval.png").read_bytes()
    drawn = (tmp_path / "short" / "report" / "eval.png").read_bytes()
    _check_png(drawn)
    assert _c0_pixels(placeholder) == 0
    assert _c0_pixels(drawn) > 20   # greedy_accuracy's diamond


def test_offline_run_plots_before_and_after_and_prints_a_dash_for_no_value(tmp_path):
    """sft from a fresh model: summary.json's before is empty and eval_before.json is {}; a NaN (no
    value) in any table is printed as a dash, never "nan"."""
    _write_jsonl(tmp_path / "metrics.jsonl", [{"step": s, "loss": 3.0 - 0.1 * s, "grad_norm": 1.0, "lr": 1e-3}
                                               for s in range(1, 4)])
    (tmp_path / "eval_before.json").write_text("{}")
    (tmp_path / "summary.json").write_text(json.dumps(
        {"job": "sft", "before": {"loss": float("nan")}, "after": {"loss": 2.5, "greedy_accuracy": 0.125},
         "steps": 3, "seed": 0}))
    (tmp_path / "eval.json").write_text(json.dumps({"loss": 2.5, "greedy_accuracy": 0.125, "pass@8": float("nan")}))
    page = write_report(tmp_path).read_text(encoding="utf-8")
    assert {p.stem for p in (tmp_path / "report").glob("*.png")} == set(OFFLINE_PLOTS)
    assert _c0_pixels((tmp_path / "report" / "eval.png").read_bytes()) > 20
    cells = re.findall(r"<td>([^<]*)</td>", page)
    assert "nan" not in [c.lower() for c in cells] and "NaN" not in page
    # loss: before (NaN) -> dash, after 2.5, change -> dash; pass@8's NaN in eval.json -> dash
    assert re.search(r"<td>loss</td><td>–</td><td>2\.5</td><td>–</td>", page), page
    assert re.search(r"<td>pass@8</td><td>–</td>", page)


def test_evals_without_a_standard_error_are_listed_but_not_judged(full_run):
    """A run logged before the reward-hacking watch (no watch/greedy_accuracy_stderr): its evals are listed next
    to the training reward since the eval before, and no verdict is drawn from them."""
    _, _, page = full_run
    table = page[page.index("<h2>Training reward and held-out accuracy</h2>"):page.index("<h2>Training curves")]
    cells = re.findall(r"<tr><td>(\d+)</td><td>([^<]*)</td><td>([^<]*)</td>", table)
    # the mean reward of steps 1-5, 6-10, ...: 0.2 + 0.5 * step / 20 averaged over them
    want = [(str(s), sum(0.2 + 0.5 * t / STEPS for t in range(s - 4, s + 1)) / 5, 0.3 + 0.01 * s) for s in EVAL_STEPS]
    assert [(s, float(r), float(a)) for s, r, a in cells] == [(s, pytest.approx(r, abs=1e-4), pytest.approx(a))
                                                             for s, r, a in want]
    assert table.count("no standard error logged") == len(EVAL_STEPS)
    assert 'class="warn"' not in page


def test_an_offline_run_with_evals_has_no_reward_table(tmp_path):
    """sft logs eval/greedy_accuracy but no reward: nothing to set it next to, no reward-hacking table."""
    _write_jsonl(tmp_path / "metrics.jsonl", [{"step": s, "loss": 3.0 - 0.1 * s, "eval/greedy_accuracy": 0.1 * s}
                                              for s in range(1, 4)])
    page = write_report(tmp_path).read_text(encoding="utf-8")
    assert "Training reward and held-out accuracy" not in page and 'class="warn"' not in page
