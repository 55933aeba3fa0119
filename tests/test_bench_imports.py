"""A script in bench/ runs with bench/ first on sys.path, so a bench file named like a package shadows that
package for every script there (bench/vllm.py did: TRL's import check then read vllm's version as 'N/A' and
bench/step.py could not run against TRL). Each package the bench scripts import is imported here as a script
there would import it."""

import ast
import subprocess
import sys

from conftest import ROOT

BENCH = ROOT / "bench"


def _top_level_imports(path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_no_bench_file_is_named_like_a_package_the_benches_or_their_libraries_import():
    stems = {p.stem for p in BENCH.glob("*.py")}
    imported = set().union(*(_top_level_imports(p) for p in BENCH.glob("*.py")))
    # the packages the libraries look for themselves (TRL and transformers probe vllm, deepspeed, ...)
    probed = {"vllm", "deepspeed", "flash_attn", "liger_kernel", "peft", "accelerate", "bitsandbytes", "wandb"}
    shadowing = sorted(stems & (probed | {n for n in imported if n not in stems or n in probed}))
    assert not shadowing, f"bench files shadowing packages: {shadowing}"
    for p in BENCH.glob("*.py"):   # a script importing a package of its own name imports itself
        assert p.stem not in _top_level_imports(p) or p.stem.startswith("_"), p


def test_the_benches_imports_run_with_bench_first_on_the_path():
    """Every import statement of the bench scripts (their packages' names, not bench's own modules), run as a
    script in bench/ runs it; statements of packages this Python lacks (vllm lives in .venv-vllm) are skipped."""
    stems = {p.stem for p in BENCH.glob("*.py")}
    statements = set()
    for p in BENCH.glob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                statements |= {f"import {a.name}" for a in node.names if a.name.split(".")[0] not in stems}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level \
                    and node.module.split(".")[0] not in stems | {"__future__"}:
                statements.add(ast.unparse(node))
    code = f"""
import importlib.util, sys
sys.path.insert(0, {str(BENCH)!r})   # as `python bench/<script>.py` has it
bad = []
for st in {sorted(statements)!r}:
    top = st.split()[1].split(".")[0]
    if importlib.util.find_spec(top) is None:
        continue
    try:
        exec(st, {{}})
    except Exception as e:
        bad.append(f"{{st}}: {{type(e).__name__}}: {{e}}")
print("\\n".join(bad) or "ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=BENCH, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "ok", r.stdout[-3000:] + r.stderr[-2000:]
