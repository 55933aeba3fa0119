"""Console output: one progress line per step, tables, and messages."""

from __future__ import annotations

import sys


def fmt_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    m, s = divmod(seconds, 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"


class Console:
    def __init__(self, stream=None, quiet: bool = False) -> None:
        self.stream = stream or sys.stdout
        self.quiet = quiet

    def info(self, msg: str) -> None:
        if not self.quiet:
            print(msg, file=self.stream, flush=True)

    def step(self, m: dict, step: int, total: int, elapsed: float) -> None:
        eta = elapsed / step * (total - step) if step else 0.0
        parts = [f"step {step}/{total}", f"reward {m['reward']:.3f}"]
        if "kl" in m:
            parts.append(f"kl {m['kl']:.4f}")
        parts += [f"len {m['completions/mean_length']:.1f}", f"{m['perf/gen_tokens_per_sec']:.0f} tok/s",
                  f"{m['time/step']:.2f}s/step", f"ETA {fmt_duration(eta)}"]
        if "eval/pass@1" in m:
            parts.insert(2, f"pass@1 {m['eval/pass@1']:.3f}")
        self.info(" | ".join(parts))

    def table(self, header: list[str], rows: list[list]) -> None:
        cells = [header] + [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
        for j, r in enumerate(cells):
            self.info("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
            if j == 0:
                self.info("  ".join("-" * w for w in widths))
