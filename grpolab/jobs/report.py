"""`grpolab report RUN_DIR`: RUN_DIR/report.html from the run's files."""

from __future__ import annotations

from pathlib import Path

from ..monitor.report import write_report


def run(run_dir: str | Path) -> Path:
    """Write the run's report.html; its path."""
    return write_report(run_dir)
