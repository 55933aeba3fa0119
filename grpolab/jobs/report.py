"""`grpolab report RUN_DIR`: RUN_DIR/report.html from the run's files."""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path

from ..monitor.report import write_report


def run(cfg: None, args: Namespace) -> Path:
    """`grpolab report RUN_DIR`: write the run's report.html; prints its path."""
    path = write_report(args.run_dir)
    print(path)
    return path
