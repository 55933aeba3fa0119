"""The package's import structure, read from its source: no cycles, and every import (module level or
inside a function) points down the layers of docs/architecture.md, never up."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "grpolab"

# top to bottom; a module may import modules of its own layer (without a cycle) or of any layer below
LAYERS = [
    ["grpolab.__main__", "grpolab.cli"],
    ["grpolab.jobs"],
    ["grpolab.train", "grpolab.serve", "grpolab.sharding"],
    ["grpolab.rollout"],
    ["grpolab.config.load", "grpolab.config.validate"],
    ["grpolab.rewards"],
    ["grpolab.sandbox"],
    ["grpolab.models", "grpolab.algorithms"],
    ["grpolab.data"],
    ["grpolab.config", "grpolab.config.schema", "grpolab.monitor", "grpolab.distributed", "grpolab.utils"],
    ["grpolab", "grpolab.determinism", "grpolab.errors"],   # the root package: what must run before torch
]


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
    best = max((p for group in LAYERS for p in group if name == p or name.startswith(p + ".")), key=len)
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


def test_every_module_has_a_layer():
    missing = [m for m in modules() if not any(m == p or m.startswith(p + ".") for g in LAYERS for p in g)]
    assert not missing


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
    assert layer("grpolab.config.schema") > layer("grpolab.config.validate")


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
