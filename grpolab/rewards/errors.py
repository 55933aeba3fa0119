"""Errors raised when resolving or running reward functions."""

from __future__ import annotations


class RewardError(RuntimeError):
    """A reward function failed, returned something unusable, or could not be loaded; the message names it."""


class UnknownRewardError(RewardError, KeyError):
    """A reward spec names no registered reward and is not an rm:/module:fn/file.py:fn spec.

    Also a KeyError so callers doing dict-style lookups (`except KeyError`) keep working.
    """

    # KeyError's str() wraps the message in quotes; keep the plain one-line message
    __str__ = Exception.__str__
