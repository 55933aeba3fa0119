"""Stopping a training run cleanly on SIGINT/SIGTERM: the step in progress finishes and is saved."""

from __future__ import annotations

import contextlib
import os
import signal
import threading


class StopFlag:
    """Within `with`: SIGINT/SIGTERM set `.signal` instead of killing the step half-way. The first one is
    acknowledged at once (on stderr, by the process that `announce`s: rank 0); a second one raises
    KeyboardInterrupt wherever the step is (a reward function that does not return included)."""

    ACK = "stopping after this step and saving; press Ctrl-C again to stop now"

    def __init__(self, announce: bool = True) -> None:
        self.signal: str | None = None
        self.announce = announce
        self._old: dict = {}
        self._held = False

    def _handle(self, signum, _frame) -> None:
        if self._held:                # saving the final checkpoint: let it finish
            return
        name = signal.Signals(signum).name
        if self.signal is not None:   # a second Ctrl-C: stop now
            raise KeyboardInterrupt(f"stopped at once by a second {name}; the step in progress is not saved "
                                    f"(the last checkpoint is intact)")
        self.signal = name
        if self.announce:   # os.write: a print could land inside another print of the main thread
            with contextlib.suppress(OSError):
                os.write(2, f"\ngrpolab: {name}: {self.ACK}\n".encode())

    def hold(self) -> None:
        """From now on further signals are ignored (the stop is under way)."""
        self._held = True

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}
