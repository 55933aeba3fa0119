"""`grpolab generate MODEL --in PROMPTS.jsonl --out OUT.jsonl`: offline batch generation.

Every input row's prompt (a string, or a list of chat messages) is rendered as training renders
it, sampled `n` times by the continuous batcher (the server's engine, same sampling keys) and
written to OUT as soon as it finishes. A rerun skips the rows already in OUT, so an interrupted
job resumes where it stopped; with a seed (default 0) a row's completions do not depend on which
rows ran beside it, so a resumed job writes what an uninterrupted one would. When every row is
done, OUT is rewritten in input order. With `--score`, the configured reward functions score each
completion (dataset columns passed by name, as in training).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import yaml

from ..data.loading import check_roles
from ..errors import ConfigError, DataError
from ..monitor.console import Console, fmt_duration
from ..rewards import judge
from ..rewards.combine import check_signatures, score
from ..rewards.runtime import RewardRuntime
from ..utils.files import write_atomic
from .batcher import BadSampling, Job, SamplingParams
from .model_loader import load_engine

SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "min_tokens", "presence_penalty",
                 "frequency_penalty", "repetition_penalty")
OUTPUT_KEYS = ("index", "completions", "finish_reasons", "completion_tokens", "rewards", "scores")


def sampling_settings(pairs: list[str]) -> dict:
    """`key=value` sampling settings (the server's names; values parsed as YAML, so stop='["\\n"]' is a list)."""
    out = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key not in SAMPLING_KEYS:
            raise ConfigError(f"{key!r} is not a sampling setting; use one of {', '.join(SAMPLING_KEYS)} "
                             f"(or a dotted config key for scoring, e.g. reward.functions=[gsm8k_accuracy])")
        v = yaml.safe_load(value) if value else None
        if key == "stop":
            if not (isinstance(v, str) or isinstance(v, list) and all(isinstance(x, str) for x in v)):
                raise ConfigError(f"stop: {value!r} is not a string or a list of them, e.g. 'stop=[\"\\n\\n\"]'")
        elif key in ("max_tokens", "top_k", "seed", "min_tokens"):
            if not isinstance(v, int) or isinstance(v, bool):
                raise ConfigError(f"{key}: {value!r} is not an integer")
        elif not isinstance(v, (int, float)) or isinstance(v, bool):
            raise ConfigError(f"{key}: {value!r} is not a number")
        out[key] = v
    try:   # the ranges, checked where the server checks them, before any model is loaded
        sampling_params(out, out.get("max_tokens") or max(1, out.get("min_tokens", 0)), 1)
    except BadSampling as e:
        raise ConfigError(f"{e.param}: {e}") from None
    return out


def sampling_params(settings: dict, max_tokens: int, n: int) -> SamplingParams:
    """SamplingParams from `sampling_settings`' output; generate's default seed is 0 (a resumed job
    writes what an uninterrupted one would)."""
    rest = {k: v for k, v in settings.items() if k not in ("max_tokens", "seed")}
    return SamplingParams(max_tokens=max_tokens, n=n, seed=settings.get("seed", 0), **rest)


def read_prompts(path: str) -> list[dict]:
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: line {n} is not JSON ({e.msg})") from None
            if not isinstance(row, dict) or "prompt" not in row:
                raise DataError(f"{path}: line {n} has no 'prompt' (each line: an object with a 'prompt' string "
                                f"or a list of chat messages)")
            if not isinstance(row["prompt"], (str, list)):
                raise DataError(f"{path}: line {n}: 'prompt' must be a string or a list of messages")
            if isinstance(row["prompt"], list) and all(isinstance(m, dict) and "role" in m for m in row["prompt"]):
                check_roles(row["prompt"], f"{path}: line {n}", "prompt")   # the server's and training's rule
            clash = [k for k in OUTPUT_KEYS if k in row]
            if clash:
                raise DataError(f"{path}: line {n} has the column {clash[0]!r}, which generate writes; rename it")
            rows.append(row)
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def _done_rows(path: Path) -> dict[int, dict]:
    """Rows already written to OUT (a line cut short by a crash is dropped, and the file rewritten without it)."""
    if not path.exists():
        return {}
    done, good = {}, []
    lines = path.read_text().splitlines()
    for line in lines:
        try:
            row = json.loads(line)
            done[int(row["index"])] = row
            good.append(line)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
    if len(good) < len(lines):   # the appends that follow must not land after a broken line
        write_atomic(path, "".join(line + "\n" for line in good))
    return done


def run_generate(model_path: str, in_path: str, out_path: str, *, n: int = 1, settings: dict | None = None,
                 max_batch: int = 64, score_cfg=None, dtype: str = "float32", device: str = "cpu",
                 max_model_len: int | None = None, console: Console | None = None) -> dict:
    """Generate for every row of `in_path` not yet in `out_path`; returns counts and throughput.
    `score_cfg`: a Config whose reward functions score the completions (None: no scoring)."""

    console = console or Console()
    settings = dict(settings or {})
    rows = read_prompts(in_path)
    out = Path(out_path)
    if out.parent:
        out.parent.mkdir(parents=True, exist_ok=True)
    if not out.exists():   # can OUT be written at all? Found now, not after the model has loaded
        out.touch()
        out.unlink()
    done = _done_rows(out)
    if done and max(done) >= len(rows):
        raise DataError(f"{out_path} holds row {max(done)}, but {in_path} has {len(rows)} rows: "
                        f"is it the output of another input?")
    runtime = None
    if score_cfg is not None:
        columns = sorted({k for r in rows for k in r if k != "prompt"})
        if score_cfg.reward.judges:   # judge answers cached beside OUT
            judge.configure(score_cfg.reward, Path(out_path).parent / "judge_cache")
        # reward.timeout; code_exec's sandbox keeps the defaults (reward.code_exec is not read here)
        runtime = RewardRuntime(timeout=float(score_cfg.reward.timeout))
        check_signatures(list(score_cfg.reward.functions), columns, rows=rows, source=in_path)
    # prefill_chunk 0: offline, no stream waits on a prefill, so prompts prefill whole as they are admitted
    batcher, tok, context = load_engine(model_path, max_batch=max_batch, max_model_len=max_model_len,
                                        dtype=dtype, device=device, prefill_chunk=0)
    todo = [i for i in range(len(rows)) if i not in done]
    finished: list[int] = []   # rows whose every choice has ended, in order of finishing
    jobs = {}
    for i in todo:
        try:
            ids = tok.render_prompt(rows[i]["prompt"])
        except ValueError as e:
            raise DataError(f"{in_path}: row index {i}: {e}") from None
        room = context - len(ids)
        max_tokens = settings.get("max_tokens") or room
        if room < 1 or max_tokens > room:
            raise DataError(f"{in_path}: row index {i}: the prompt is {len(ids)} tokens; with max_tokens {max_tokens} "
                            f"that exceeds the model's context of {context} tokens")
        if settings.get("min_tokens", 0) > max_tokens:
            raise DataError(f"{in_path}: row index {i}: the prompt is {len(ids)} tokens, which leaves {room} of the "
                            f"model's context of {context} for the completion, fewer than min_tokens "
                            f"{settings['min_tokens']}")
        jobs[i] = Job(ids, sampling_params(settings, max_tokens, n),
                      lambda job, choice, i=i: job.done and finished.append(i), draw=i)
    console.info(f"generate: {len(todo)} rows to do ({len(done)} already in {out_path}), n={n}, "
                 f"max batch {max_batch}")
    for i in todo:
        batcher.submit(jobs[i])
    t0 = time.perf_counter()
    try:
        written, tokens = _decode_and_write(batcher, jobs, rows, finished, out, score_cfg, runtime, console,
                                            len(done), len(todo), t0)
        # all rows done: rewrite in input order
        final = _done_rows(out)
        write_atomic(out, "".join(json.dumps(final[i]) + "\n" for i in sorted(final)))
    except OSError as e:   # a write's error names no file: name OUT (the rows written so far are kept)
        if e.filename is None:
            raise OSError(e.errno, e.strerror, out_path) from e
        raise
    except KeyboardInterrupt:
        have = len(_done_rows(out))
        raise KeyboardInterrupt(f"interrupted: {have} of {len(rows)} rows are in {out_path}; run the same command "
                                f"again to do the rest") from None
    elapsed = time.perf_counter() - t0
    console.result(f"wrote {out_path}: {len(final)} rows ({written} new in {elapsed:.1f}s)")
    return {"rows": len(final), "new": written, "seconds": elapsed, "tokens": tokens}


def _decode_and_write(batcher, jobs: dict, rows: list[dict], finished: list[int], out: Path, score_cfg,
                      runtime: RewardRuntime | None, console: Console, n_done: int, n_todo: int,
                      t0: float) -> tuple[int, int]:
    """Step the batcher until every job is done, appending each finished row to OUT (flushed at once, so
    an interruption keeps it); (rows written, completion tokens)."""
    last, written, tokens = 0.0, 0, 0
    with open(out, "a") as f:
        while not batcher.idle():
            batcher.step()
            for i in finished:
                job = jobs[i]
                row = {"index": i, **rows[i], "completions": [c.text for c in job.choices],
                       "finish_reasons": [c.finish_reason for c in job.choices],
                       "completion_tokens": [len(c.tokens) for c in job.choices]}
                if score_cfg is not None:
                    row.update(_score(score_cfg, runtime, rows[i], row["completions"]))
                f.write(json.dumps(row) + "\n")
                f.flush()
                written += 1
                tokens += sum(row["completion_tokens"])
            finished.clear()
            now = time.perf_counter() - t0
            if written and (now - last > 5 or written == n_todo):
                last = now
                rate = written / now
                bar = int(20 * (n_done + written) / len(rows))
                console.info(f"[{'#' * bar}{'.' * (20 - bar)}] generate {n_done + written}/{len(rows)} rows | "
                             f"{rate:.1f} rows/s | {tokens / now:.0f} tok/s | "
                             f"ETA {fmt_duration((n_todo - written) / rate)}")
        os.fsync(f.fileno())
    return written, tokens


def _score(cfg, runtime: RewardRuntime, row: dict, completions: list[str]) -> dict:
    k = len(completions)
    columns = {c: [row[c]] * k for c in row if c != "prompt"}
    total, per = score(list(cfg.reward.functions), cfg.reward.weights, [row["prompt"]] * k, completions, columns,
                       runtime=runtime)
    return {"rewards": total.tolist(),
            "scores": {name: [None if v != v else v for v in t.tolist()] for name, t in per.items()}}
