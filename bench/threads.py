"""train.threads on an idle and a contended machine: does the default (all cores) slow down when
another process shares the cores? Runs the real CLI in fresh processes, alternating the modes.

    .venv/bin/python bench/threads.py --rounds 3
    .venv/bin/python bench/threads.py --rounds 3 -- train train.max_steps=3 sft.steps=10

modes (every one a separate `grpolab` process, same config and seed):
  t1      train.threads=1
  t0_old  train.threads=0 (all cores), OpenMP's default wait policy: torch is imported before grpolab,
          so the OpenMP runtime starts before grpolab can set OMP_WAIT_POLICY (what grpolab did before)
  t0_new  train.threads=0 as `grpolab` runs it now (grpolab/determinism.py: OMP_WAIT_POLICY=PASSIVE,
          GOMP_SPINCOUNT=3000)

conditions:
  idle       nothing else started by the benchmark (other users of the machine still count)
  contended  one busy-loop python process per core runs for the whole measurement

Prints one JSON line per process (wall and CPU seconds of the grpolab process, the last step's loss
and grad norm as hex floats), then one summary line per condition and mode: medians, the ratio to t1
in the same condition, and whether every process computed the same loss bits. A process still
running after --timeout seconds is stopped and counted at that time ("timed_out": true, no bits):
the medians are then lower bounds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _proc import run_reaped  # (bench/ is on the path when this file runs as a script)

ROOT = Path(__file__).resolve().parents[1]
MODES = ("t1", "t0_old", "t0_new")
# OpenMP/MKL variables that would change what a mode measures; each mode starts from none of them
# (MKL_* are set by grpolab itself in every mode, as in a normal run)
CLEAN = ("OMP_", "GOMP_", "KMP_", "MKL_")
HOG = "while True:\n    pass\n"
# the old start-up order: the OpenMP runtime (libgomp, loaded with torch) reads its environment once,
# when it is loaded, so importing torch first leaves it with its defaults
OLD_MAIN = "import sys, runpy, torch; sys.argv[0] = 'grpolab'; runpy.run_module('grpolab', run_name='__main__')"


def command(mode: str, args: list[str], out: str) -> list[str]:
    threads = "1" if mode == "t1" else "0"
    cli = [*args, f"train.threads={threads}", f"train.output_dir={out}", "log.level=quiet"]
    if mode == "t0_old":
        return [sys.executable, "-c", OLD_MAIN, *cli]
    return [sys.executable, "-m", "grpolab", *cli]


def last_losses(out: str) -> dict:
    """The last metrics row's loss and grad norm, exact (hex)."""
    rows = [json.loads(ln) for ln in Path(out, "metrics.jsonl").read_text().splitlines() if ln.strip()]
    last = rows[-1]
    return {k: float(last[k]).hex() for k in ("loss", "grad_norm") if k in last}


def run_once(mode: str, args: list[str], condition: str, timeout: float) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(CLEAN)}
    with tempfile.TemporaryDirectory() as out, tempfile.TemporaryFile() as err:
        code, wall, cpu, timed_out = run_reaped(command(mode, args, out), cwd=ROOT, env=env,
                                                stdout=subprocess.DEVNULL, stderr=err, timeout=timeout)
        row = {"condition": condition, "mode": mode, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3)}
        if timed_out:
            return {**row, "timed_out": True, "bits": None}
        if code != 0:
            err.seek(0)
            raise SystemExit(f"{mode} failed ({code}): {err.read().decode(errors='replace')[-2000:]}")
        return {**row, "bits": last_losses(out)}


def start_hogs(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(n)]


def stop_hogs(hogs: list[subprocess.Popen]) -> None:
    for h in hogs:
        h.kill()
        h.wait()


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    bits = {json.dumps(r["bits"], sort_keys=True) for r in rows if r["bits"] is not None}
    for cond in ("idle", "contended"):
        base = statistics.median(r["wall_s"] for r in rows if r["condition"] == cond and r["mode"] == "t1")
        for mode in MODES:
            sel = [r for r in rows if r["condition"] == cond and r["mode"] == mode]
            wall = statistics.median(r["wall_s"] for r in sel)
            cpu = statistics.median(r["cpu_s"] for r in sel)
            out.append({"summary": True, "condition": cond, "mode": mode, "runs": len(sel),
                        "timed_out": sum(bool(r.get("timed_out")) for r in sel),
                        "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "wall_vs_t1": round(wall / base, 2),
                        "same_bits_everywhere": len(bits) == 1})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="processes per mode and condition (alternated)")
    ap.add_argument("--hogs", type=int, default=os.cpu_count() or 1, help="busy-loop processes when contended")
    ap.add_argument("--timeout", type=float, default=600, help="seconds before a process is stopped")
    ap.add_argument("args", nargs="*", default=["sft", "sft.steps=15"],
                    help="the grpolab command to time (default: sft sft.steps=15)")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # stop the hogs on a plain kill too
    print(json.dumps({"cpus": os.cpu_count(), "hogs": a.hogs, "rounds": a.rounds, "command": a.args,
                      "loadavg_start": os.getloadavg()}), flush=True)
    rows = []
    for i in range(a.rounds):
        for cond in ("idle", "contended"):
            hogs = start_hogs(a.hogs) if cond == "contended" else []
            try:
                # rotate the order each round so that no mode always runs first after a switch
                for mode in MODES[i % 3:] + MODES[:i % 3]:
                    r = run_once(mode, a.args, cond, a.timeout)
                    r["round"] = i
                    rows.append(r)
                    print(json.dumps(r), flush=True)
            finally:
                stop_hogs(hogs)
    for s in summarize(rows):
        print(json.dumps(s), flush=True)
    print(json.dumps({"loadavg_end": os.getloadavg()}), flush=True)


if __name__ == "__main__":
    main()
