"""The HTML report of a run directory: read.py (the run's files) -> plots.py (the curves) -> page.py (the page)."""

from .page import write_pipeline_report, write_report
from .plots import OFFLINE_PLOTS, PLOTS, eval_endpoints

__all__ = ["OFFLINE_PLOTS", "PLOTS", "eval_endpoints", "write_pipeline_report", "write_report"]
