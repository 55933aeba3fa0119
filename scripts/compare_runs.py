"""Compare two run directories' metrics.jsonl, summary.json and eval.json files: every key equal (same keys, same order,
same values) except timing ones. The check behind a refactor that must keep the bits.

    python scripts/compare_runs.py BASE_DIR NEW_DIR   # e.g. two `grpolab demo --out DIR` runs
"""
import json
import sys
from pathlib import Path

TIMING_KEYS = {"wall_seconds", "rollout_tokens_per_sec", "seconds", "elapsed"}


def timing(key: str) -> bool:
    last = key.rsplit("/", 1)[-1]
    return (key.startswith(("time/", "perf/")) or "/time/" in key or "/perf/" in key or key in TIMING_KEYS
            or last in TIMING_KEYS or "seconds" in last or last.endswith(("_sec", "_per_sec", "_s")))


def walk(a, b, path, out):
    if isinstance(a, dict) and isinstance(b, dict):
        ka, kb = [k for k in a if not timing(k)], [k for k in b if not timing(k)]
        if ka != kb:   # timing keys aside (an async resume logs time/worker_start once more)
            out.append(f"{path}: keys differ: {ka} vs {kb}")
        for k in a:
            if k in b and not timing(k):
                walk(a[k], b[k], f"{path}/{k}", out)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            out.append(f"{path}: lengths {len(a)} vs {len(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            walk(x, y, f"{path}[{i}]", out)
    elif a != b and not (a != a and b != b):   # NaN == NaN here
        out.append(f"{path}: {a!r} vs {b!r}")


def main(base: str, new: str) -> int:
    base, new, out = Path(base), Path(new), []
    names = sorted({p.relative_to(base).as_posix() for f in ("metrics.jsonl", "summary.json", "eval.json")
                    for p in base.rglob(f)})
    if not names:
        print(f"nothing to compare: no metrics.jsonl, summary.json or eval.json under {base}")
        return 2
    for name in names:
        a, b = base / name, new / name
        if not b.exists():
            out.append(f"{name}: missing in {new}")
            continue
        if name.endswith(".jsonl"):
            ra = [json.loads(x) for x in a.read_text().splitlines() if x.strip()]
            rb = [json.loads(x) for x in b.read_text().splitlines() if x.strip()]
        else:
            ra, rb = json.loads(a.read_text()), json.loads(b.read_text())
        walk(ra, rb, name, out)
        print(f"{name}: compared")
    for line in out:
        print("DIFF", line)
    print("IDENTICAL (timing keys excepted)" if not out else f"{len(out)} differences")
    return 1 if out else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
