"""Another benchmark script loaded as a module by its path (bench/ is not a package): its helpers reused."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def bench_module(name: str) -> ModuleType:
    """bench/<name>.py as the module `_bench_<name>` (registered, so it loads once per process)."""
    key = f"_bench_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)
    return module
