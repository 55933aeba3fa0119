"""Callbacks handed over from Python (grpolab.api's trainers): the methods of TRL's and transformers' TrainerCallback
(on_train_begin, on_step_end, on_log, on_evaluate, on_save, on_train_end), called with (args, state, control) as
transformers calls them, on every rank. A callback that sets control.should_training_stop ends the run after that
step, saved as at its end."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainerState:
    """What a callback reads (transformers' name and fields): the step reached, the run's length and each step's
    metrics so far."""
    global_step: int = 0
    max_steps: int = 0
    log_history: list[dict] = field(default_factory=list)
    is_world_process_zero: bool = True


@dataclass
class CallbackControl:
    """What a callback may ask: should_training_stop is honoured; the other flags are transformers' and unread."""
    should_training_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False


class Hooks:
    """The run's callbacks, `args` (the caller's config object) passed to each."""

    def __init__(self, callbacks: list | tuple = (), args: Any = None, main: bool = True) -> None:
        self.callbacks, self.args = list(callbacks), args
        self.state = TrainerState(is_world_process_zero=main)
        self.control = CallbackControl()

    def _call(self, event: str, **kwargs: Any) -> None:
        for cb in self.callbacks:
            fn = getattr(cb, event, None)
            if fn is not None:
                out = fn(self.args, self.state, self.control, **kwargs)
                if out is not None and hasattr(out, "should_training_stop"):   # transformers' callbacks may return it
                    self.control = out

    @property
    def stop(self) -> bool:
        return bool(self.control.should_training_stop)

    def begin(self, step: int, max_steps: int) -> None:
        self.state.global_step, self.state.max_steps = step, max_steps
        self._call("on_train_begin")

    def step_end(self, step: int, metrics: dict) -> None:
        self.state.global_step = step
        self.state.log_history.append(dict(metrics))
        self._call("on_step_end")
        self._call("on_log", logs=dict(metrics))

    def evaluated(self, step: int, metrics: dict) -> None:
        self.state.global_step = step
        self._call("on_evaluate", metrics=dict(metrics))

    def saved(self) -> None:
        self._call("on_save")

    def end(self) -> None:
        self._call("on_train_end")
