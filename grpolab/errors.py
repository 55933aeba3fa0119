"""The errors a user can meet, each ending a command with one line and exit code 2 (see cli.py).

A leaf module: every layer raises these without importing anything above it.
"""


class ConfigError(ValueError):
    """A config mistake; the message names the key and how to fix it."""


class DataError(ValueError):
    """A dataset problem, in one line: which file, which row, which column, and how to fix it."""


class RewardError(RuntimeError):
    """A reward function failed, returned something unusable, or could not be loaded; the message names it."""


class UnknownRewardError(RewardError, KeyError):
    """A reward spec names no registered reward and is not an rm:/module:fn/file.py:fn spec.

    Also a KeyError so callers doing dict-style lookups (`except KeyError`) keep working.
    """

    # KeyError's str() wraps the message in quotes; keep the plain one-line message
    __str__ = Exception.__str__


class EnvError(RuntimeError):
    """An environment raised, hung, returned a malformed reply or a non-finite reward, or replied past the
    episode's token budget; the message names the environment, the episode and the turn."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used (e.g. it holds pickled objects); the message says which file and why."""


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. too many non-finite steps); the message says why and what to change."""


class ExportError(RuntimeError):
    """The checkpoint cannot be exported as asked; the message says why."""


class NonFiniteLogits(RuntimeError):
    """The model produced NaN/inf logits while sampling (its weights have diverged)."""


class ToolCallError(ValueError):
    """A call the model wrote that cannot be run (unparsable, unknown tool, bad arguments)."""
