"""Console output: a progress line per step, sample tables, and messages, at three levels.

quiet: results and warnings only; normal: also a line per step; verbose: also tables of
sampled completions.
"""

from __future__ import annotations

import sys

LEVELS = {"quiet": 0, "normal": 1, "verbose": 2}


def fmt_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    m, s = divmod(seconds, 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"


def _short(text: str, width: int = 60) -> str:
    text = text.replace("\n", "\\n")
    return text if len(text) <= width else text[:width - 3] + "..."


class Console:
    def __init__(self, stream=None, quiet: bool = False, level: str = "normal") -> None:
        self.stream = stream or sys.stdout
        self.level = LEVELS["quiet" if quiet else level]
        self.last_pass1: float | None = None

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

    def step(self, m: dict, step: int, total: int, elapsed: float) -> None:
        if "eval/pass@1" in m:
            self.last_pass1 = m["eval/pass@1"]
        eta = elapsed / step * (total - step) if step else 0.0
        done = int(20 * step / max(total, 1))
        parts = [f"[{'#' * done}{'.' * (20 - done)}] step {step}/{total}", f"reward {m['reward']:.3f}"]
        if self.last_pass1 is not None:
            parts.append(f"pass@1 {self.last_pass1:.3f}")
        if "kl" in m:
            parts.append(f"kl {m['kl']:.4f}")
        parts += [f"len {m['completions/mean_length']:.1f}", f"{m['perf/gen_tokens_per_sec']:.0f} tok/s",
                  f"{m['time/step']:.2f}s/step", f"ETA {fmt_duration(eta)}"]
        self.info(" | ".join(parts))

    def progress(self, job: str, step: int, total: int, elapsed: float, parts: list[str]) -> None:
        """A progress line of an offline stage (sft, dpo, distill)."""
        eta = elapsed / step * (total - step) if step else 0.0
        done = int(20 * step / max(total, 1))
        self.info(" | ".join([f"[{'#' * done}{'.' * (20 - done)}] {job} step {step}/{total}", *parts,
                              f"ETA {fmt_duration(eta)}"]))

    def samples(self, step: int, records: list[dict]) -> None:
        """A small table of sampled completions (verbose level)."""
        if self.level < 2 or not records:
            return
        self._print(f"samples at step {step}:")
        self.table(["reward", "adv", "completion"],
                   [[r["reward"], r["advantage"], _short(r["completion"])] for r in records], always=True)

    def table(self, header: list[str], rows: list[list], always: bool = False) -> None:
        out = self._print if always else self.info
        cells = [header] + [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
        for j, r in enumerate(cells):
            out("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
            if j == 0:
                out("  ".join("-" * w for w in widths))
