"""Console output: a progress line per step, sample tables, and messages, at three levels.

quiet: results and warnings only; normal: also a line per step; verbose: also tables of
sampled completions.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable

from .reward_hacking import ACCURACY_KEY, FLAG_KEY, Verdict

LEVELS = {"quiet": 0, "normal": 1, "verbose": 2}
PROGRESS_SECONDS = 10.0   # inside a long step, a progress line at most this often
NO_VALUE = "\u2013"       # what a table shows where there is no value (an en dash, not 'nan')


def fmt_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    m, s = divmod(seconds, 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"


def eta_seconds(elapsed: float, steps_done: int, steps_left: int) -> float:
    """Seconds left at the pace of this process's steps: `elapsed` seconds for the `steps_done` steps it
    ran (after a resume: the steps since the restart, not the global step)."""
    return elapsed / steps_done * steps_left if steps_done > 0 else 0.0


def progress_bar(step: int, total: int) -> str:
    done = int(20 * step / max(total, 1))
    return f"[{'#' * done}{'.' * (20 - done)}]"


def progress_line(job: str, step: int, total: int, eta: float, parts: list[str]) -> str:
    """An offline stage's (or the warm start's) progress line: bar, step, the job's numbers, ETA."""
    return " | ".join([f"{progress_bar(step, total)} {job} step {step}/{total}", *parts, f"ETA {fmt_duration(eta)}"])


def cell(c) -> str:
    """A table cell: floats to 3 decimals, None (no value) as an en dash."""
    if c is None:
        return NO_VALUE
    return f"{c:.3f}" if isinstance(c, float) else str(c)


def _short(text: str, width: int = 60) -> str:
    text = text.replace("\n", "\\n")
    return text if len(text) <= width else text[:width - 3] + "..."


class Console:
    def __init__(self, stream=None, quiet: bool = False, level: str = "normal") -> None:
        self.stream = stream or sys.stdout
        self.level = LEVELS["quiet" if quiet else level]
        self.last_pass1: float | None = None
        self.last_accuracy: float | None = None   # the latest held-out greedy accuracy, shown on every step line
        self.hacking = False                      # the reward-hacking flag of the latest eval

    def start_run(self) -> None:
        """A new run on this console (a pipeline's next stage): the step lines show only its own evals."""
        self.last_pass1 = self.last_accuracy = None
        self.hacking = False

    @property
    def quiet(self) -> bool:
        return self.level == 0

    def _print(self, msg: str, stream=None) -> None:
        print(msg, file=stream or self.stream, flush=True)

    def info(self, msg: str) -> None:
        if self.level >= 1:
            self._print(msg)

    def result(self, msg: str) -> None:
        """Always shown: final tables and where results were written."""
        self._print(msg)

    def warn(self, msg: str) -> None:
        self._print(f"warning: {msg}", sys.stderr)

    def evaluated(self, step: int, row: dict, verdict: Verdict | None = None) -> None:
        """A GRPO eval's metrics (`row`: eval/* and watch/*): kept for the step lines, and one warning when the
        reward-hacking flag turns on (none while it stays on)."""
        self.last_accuracy = row.get(ACCURACY_KEY, self.last_accuracy)
        self.last_pass1 = row.get("eval/pass@1", self.last_pass1)
        flagged = bool(row.get(FLAG_KEY))
        if flagged and not self.hacking:
            why = verdict.describe() if verdict is not None else "see metrics.jsonl"
            self.warn(f"possible reward hacking at step {step}: {why} ({FLAG_KEY}=1; docs/watching.md#reward-hacking)")
        self.hacking = flagged

    def step(self, m: dict, step: int, total: int, elapsed: float, start_step: int = 0) -> None:
        """A GRPO step's line. `elapsed`: seconds since this process started training at `start_step`."""
        if "eval/pass@1" in m:
            self.last_pass1 = m["eval/pass@1"]
        if ACCURACY_KEY in m:
            self.last_accuracy = m[ACCURACY_KEY]
        eta = eta_seconds(elapsed, step - start_step, total - step)
        parts = [f"{progress_bar(step, total)} step {step}/{total}", f"reward {m['reward']:.3f}"]
        if self.last_accuracy is not None:
            parts.append(f"eval acc {self.last_accuracy:.3f}")
        if self.last_pass1 is not None:
            parts.append(f"pass@1 {self.last_pass1:.3f}")
        if "kl" in m:
            parts.append(f"kl {m['kl']:.4f}")
        parts += [f"len {m['completions/mean_length']:.1f}", f"{m['perf/gen_tokens_per_sec']:.0f} tok/s",
                  f"{m['time/step']:.2f}s/step", f"ETA {fmt_duration(eta)}"]
        self.info(" | ".join(parts))

    def progress(self, job: str, step: int, total: int, elapsed: float, parts: list[str], start_step: int = 0) -> None:
        """A progress line of an offline stage (sft, dpo, rm, distill)."""
        self.info(progress_line(job, step, total, eta_seconds(elapsed, step - start_step, total - step), parts))

    def samples(self, step: int, records: list[dict]) -> None:
        """A small table of sampled completions (verbose level)."""
        if self.level < 2 or not records:
            return
        self._print(f"samples at step {step}:")
        self.table(["reward", "adv", "completion"],
                   [[r["reward"], r["advantage"], _short(r["completion"])] for r in records], always=True)

    def table(self, header: list[str], rows: list[list], always: bool = False) -> None:
        out = self._print if always else self.info
        cells = [header] + [[cell(c) for c in r] for r in rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
        for j, r in enumerate(cells):
            out("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
            if j == 0:
                out("  ".join("-" * w for w in widths))


class StepProgress:
    """Progress inside a long step: the trainer names the phase (rollout, score, update, eval) and adds rows
    and tokens as they are done; a background thread prints a line through `say` at most every `interval`
    seconds, and only once the step has run that long (quick steps print nothing extra). Console output
    only: it reads counters, never the numbers the run computes. `say` None: off."""

    def __init__(self, say: Callable[[str], None] | None, interval: float = PROGRESS_SECONDS) -> None:
        self.say, self.interval = say, interval
        self.label = ""
        self.phase: str | None = None
        self.rows = self.total_rows = self.tokens = 0
        self._t_step = self._t_phase = self._t_said = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def on(self) -> bool:
        return self.say is not None

    def start_step(self, label: str) -> None:
        self.label, self.phase = label, None
        self._t_step = time.monotonic()

    def start_phase(self, phase: str, total_rows: int = 0) -> None:
        self.phase, self.total_rows, self.rows, self.tokens = phase, total_rows, 0, 0
        self._t_phase = time.monotonic()

    def add(self, rows: int = 0, tokens: int = 0) -> None:
        self.rows += rows
        self.tokens += tokens

    def end_step(self) -> None:
        self.phase = None

    def line(self, now: float | None = None) -> str | None:
        """The line to print now, or None (no step running, or it has not run `interval` seconds yet)."""
        now = time.monotonic() if now is None else now
        if self.phase is None or now - self._t_step < self.interval or now - self._t_said < self.interval:
            return None
        spent = max(now - self._t_phase, 1e-9)
        parts = [f"  {self.label}: {self.phase} for {fmt_duration(spent)}"]
        if self.total_rows:   # none done yet: the phase's size (a rollout's rows all finish together)
            parts.append(f"{self.rows}/{self.total_rows} rows" if self.rows else f"{self.total_rows} rows")
        if self.tokens:
            parts.append(f"{self.tokens} tokens, {self.tokens / spent:.0f} tok/s")
        return ", ".join(parts)

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, max(0.01, self.interval))):
            msg = self.line()
            if msg is not None:
                self._t_said = time.monotonic()
                self.say(msg)

    def __enter__(self) -> "StepProgress":
        if self.say is not None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="grpolab-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
