"""Run configuration (being split into schema, loading and validation)."""

from .schema import *  # noqa: F401,F403
from .schema import _apply, _flatten  # noqa: F401  (grpolab/stages.py)
