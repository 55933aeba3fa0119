"""The package's import structure, read from its source: every module has a layer, no cycles, and every
import (module level or inside a function) points down the layer table of docs/architecture.md, never up."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "grpolab"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def read_layers(text: str) -> list[list[str]]:
    """The layer table of docs/architecture.md's "The layers" section, top to bottom: per row, the
    modules its first cell names in backticks. A folder (`grpolab/jobs/`) stands for its package and
    every module under it, written `grpolab.jobs.`; a file (`grpolab/cli.py`, `grpolab/__init__.py`) for
    that one module."""
    section = text.split("\n## The layers\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `grpolab")]
    layers = []
    for row in rows:
        names = []
        for path in re.findall(r"`([^`]+)`", row.split(" | ")[0]):
            if path.endswith("/"):
                names.append(path.rstrip("/").replace("/", ".") + ".")
            else:
                parts = path.removesuffix(".py").split("/")
                names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
        layers.append(names)
    return layers


# top to bottom; a module may import modules of its own layer (without a cycle) or of any layer below
LAYERS = read_layers(ARCHITECTURE.read_text())


def covers(entry: str, name: str) -> bool:
    """Whether a table entry holds module `name`: a folder its package and everything under it."""
    if entry.endswith("."):
        return name == entry[:-1] or name.startswith(entry)
    return name == entry


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports(name: str, path: Path, known: set[str]) -> dict[str, int]:
    """The grpolab modules `name` imports ({module: line}), at any depth of its code. Importing a.b.c
    also runs the packages a and a.b, so those count as imported too, except the packages `name` itself
    lies in (they are already running) and the root package (it runs first, for everyone)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            targets = [module] + [f"{module}.{a.name}" for a in node.names]
        for t in targets:
            parts = t.split(".")
            for i in range(2, len(parts) + 1):   # the module and the packages above it
                m = ".".join(parts[:i])
                if m in known and m != name and not name.startswith(m + "."):
                    found.setdefault(m, node.lineno)
    return found


def layer(name: str) -> int:
    """The row of the table holding `name` (the most specific entry that covers it); 0 is the top."""
    best = max((p for group in LAYERS for p in group if covers(p, name)), key=len)
    return next(i for i, group in enumerate(LAYERS) if best in group)


def graph() -> dict[str, dict[str, int]]:
    mods = modules()
    return {m: imports(m, p, set(mods)) for m, p in mods.items()}


def find_cycle(g: dict[str, dict[str, int]]) -> list[str] | None:
    """One import cycle of `g` as a list of modules, or None (depth-first search, three colours)."""
    colour, stack = {m: 0 for m in g}, []

    def visit(m: str) -> list[str] | None:
        colour[m] = 1
        stack.append(m)
        for n in sorted(g[m]):
            if n not in g:
                continue
            if colour[n] == 1:
                return stack[stack.index(n):] + [n]
            if colour[n] == 0 and (c := visit(n)):
                return c
        stack.pop()
        colour[m] = 2
        return None

    for m in sorted(g):
        if colour[m] == 0 and (c := visit(m)):
            return c
    return None


def test_the_table_is_read_from_the_docs():
    """docs/architecture.md's table, in DESIGN.md's order: the CLI on top, config and the leaves at the bottom."""
    assert LAYERS[0] == ["grpolab.cli", "grpolab.__main__"]
    assert LAYERS[2] == ["grpolab.api."] and LAYERS[3] == ["grpolab.jobs."]
    assert "grpolab.config." in LAYERS[-1] and "grpolab.errors" in LAYERS[-1]
    assert len({e for group in LAYERS for e in group}) == sum(len(group) for group in LAYERS)   # each entry once


def test_every_module_has_a_layer():
    missing = [m for m in modules() if not any(covers(p, m) for g in LAYERS for p in g)]
    assert not missing, "modules that docs/architecture.md's layer table does not name: " + ", ".join(missing)


def test_imports_point_down():
    up = [f"{m} -> {n} (line {line})" for m, targets in graph().items() for n, line in targets.items()
          if layer(n) < layer(m)]
    assert not up, "imports that run up the layers:\n" + "\n".join(sorted(up))


def test_no_import_cycles():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_checks_catch_what_they_should():
    """The cycle finder and the layer rule, on a made-up graph with a known cycle and a known upward arrow."""
    g = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert find_cycle(g) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": 1}, "b": {}, "d": {"a": 1, "b": 2}}) is None
    assert layer("grpolab.data.loading") > layer("grpolab.models.hf") > layer("grpolab.jobs.train")
    assert layer("grpolab.config.validate") > layer("grpolab.rewards") > layer("grpolab.rollout.source")
    assert layer("grpolab.train.some_new_module") == layer("grpolab.train")   # a folder holds its new modules
    assert not covers("grpolab.cli", "grpolab.cli_extra") and not covers("grpolab.jobs.", "grpolab.jobsx")
    assert read_layers("x\n## The layers\n| a | b |\n| `grpolab/a/`, `grpolab/b.py` | x `grpolab/c.py` |\n"
                       "| `grpolab/__init__.py` | y |\n## Next\n| `grpolab/d.py` | z |\n") == \
        [["grpolab.a.", "grpolab.b"], ["grpolab"]]


def test_the_sandbox_imports_nothing_outside_itself():
    """The sandbox's files also run on their own, as another user, from a copy outside the package."""
    outside = [f"{m} -> {n}" for m, targets in graph().items() if m.startswith("grpolab.sandbox")
               for n in targets if not n.startswith("grpolab.sandbox")]
    assert not outside


def test_no_package_import_inside_a_function():
    """Imports of the package's own modules sit at the top of each file, where the reader sees them."""
    hidden = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for sub in ast.walk(node):
                    if isinstance(sub, ast.ImportFrom) and (sub.level or (sub.module or "").startswith("grpolab")):
                        hidden.append(f"{name} line {sub.lineno}")
                    elif isinstance(sub, ast.Import) and any(a.name.startswith("grpolab") for a in sub.names):
                        hidden.append(f"{name} line {sub.lineno}")
    assert not hidden


def test_the_cli_imports_its_jobs_plainly():
    """cli.py imports every job at its top, like any other module: no importlib, no __import__."""
    tree = ast.parse((PACKAGE / "cli.py").read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "importlib" for a in node.names):
            found.append(f"import importlib (line {node.lineno})")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "importlib":
            found.append(f"from importlib (line {node.lineno})")
        elif isinstance(node, ast.Name) and node.id in ("importlib", "__import__"):
            found.append(f"{node.id} (line {node.lineno})")
        elif isinstance(node, ast.Attribute) and node.attr == "import_module":
            found.append(f"import_module (line {node.lineno})")
    assert not found, found


def test_the_trainers_are_short_functions_and_the_rl_trainer_only_orders_stages():
    """Issue 50's measure of the RL step as data: no function in grpolab/train/ over 60 lines, GRPOTrainer at
    most 300 (the stages are functions of their own files)."""
    long = []
    for path in sorted((PACKAGE / "train").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            size = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and size > 60:
                long.append(f"{path.name}:{node.name} ({size} lines)")
            if isinstance(node, ast.ClassDef) and node.name == "GRPOTrainer":
                assert size <= 300, f"GRPOTrainer is {size} lines"
    assert not long, long
