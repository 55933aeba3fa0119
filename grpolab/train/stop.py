"""Stopping a training run cleanly on SIGINT/SIGTERM: the step in progress finishes and is saved."""

from __future__ import annotations

import contextlib
import os
import signal
import threading

# the real one, taken at import: rewards.exit_guard replaces os._exit while reward functions run
_EXIT = os._exit
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopFlag:
    """Within `with`: SIGINT/SIGTERM set `.signal` instead of killing the step half-way. The first one is
    acknowledged at once (on stderr, by the process that `announce`s: rank 0); a second one raises
    KeyboardInterrupt wherever the step is (a reward function that does not return included).

    That KeyboardInterrupt can fail to arrive: code that catches it (a bare `except:` in a reward) or a
    main thread waiting in C that retries on signals (os.system) never lets it leave the `with`. So a
    watcher thread counts the signals too, from the wakeup fd the C-level handler writes to (no Python
    code of the main thread needed), and when the interrupt has not left the `with` GRACE seconds after
    the second signal, it says so in one line and ends the process with exit code 130."""

    ACK = "stopping after this step and saving; press Ctrl-C again to stop now"
    GRACE = 2.0   # seconds for the second signal's KeyboardInterrupt to unwind out of the `with`

    def __init__(self, announce: bool = True) -> None:
        self.signal: str | None = None
        self.announce = announce
        self._old: dict = {}
        self._held = False
        self._seen = 0                    # signals counted by the watcher (or the handler, without one)
        self._count_lock = threading.Lock()
        self._armed = False
        self._left = threading.Event()    # the `with` was left: the interrupt arrived
        self._exit_lock = threading.Lock()
        self._wake: tuple[int, int, int] | None = None   # (read fd, write fd, the wakeup fd before ours)

    def _handle(self, signum, _frame) -> None:
        if self._held:                # saving the final checkpoint: let it finish
            return
        name = signal.Signals(signum).name
        if self._wake is None:        # no watcher reading the wakeup fd: count here
            self._count(signum)
        if self.signal is not None:   # a second Ctrl-C: stop now
            raise KeyboardInterrupt(f"stopped at once by a second {name}; the step in progress is not saved "
                                    f"(the last checkpoint is intact)")
        self.signal = name
        if self.announce:   # os.write: a print could land inside another print of the main thread
            with contextlib.suppress(OSError):
                os.write(2, f"\ngrpolab: {name}: {self.ACK}\n".encode())

    def _count(self, signum: int) -> None:
        with self._count_lock:
            if self._held or self._armed:
                return
            self._seen += 1
            if self._seen < 2:
                return
            self._armed = True
        threading.Thread(target=self._deadline, args=(signal.Signals(signum).name,), name="grpolab-stop-deadline",
                         daemon=True).start()

    def _deadline(self, name: str) -> None:
        if self._left.wait(self.GRACE):
            return
        with self._exit_lock:   # held to the end: the `with` cannot be left (and say more) meanwhile
            if self._left.is_set() or self._held:
                return
            with contextlib.suppress(OSError):
                os.write(2, f"\ngrpolab: stopped at once by a second {name}; the code running did not stop when "
                            f"interrupted (it caught the KeyboardInterrupt, or waits in C code), so the process "
                            f"exits without unwinding; the step in progress is not saved (the last checkpoint is "
                            f"intact)\n".encode())
            _EXIT(130)

    def _watch(self, fd: int) -> None:
        """Count SIGINT/SIGTERM from the wakeup fd (one byte per signal) until it is closed."""
        while True:
            try:
                data = os.read(fd, 512)
            except OSError:
                break
            if not data:
                break
            for signum in data:
                if signum in _SIGNALS:
                    self._count(signum)
        os.close(fd)

    def _forget(self) -> None:
        """In a child forked while the flag is on (a reward's multiprocessing pool, a sandbox): the signals it
        gets are its own. Its handlers go back to what they were, and it lets go of the wakeup pipe, whose
        bytes would otherwise count as signals to the trainer (Pool.terminate() sends SIGTERM to each)."""
        with contextlib.suppress(ValueError):   # (not the main thread: nothing was installed there)
            for sig, old in self._old.items():
                signal.signal(sig, old)
            if self._wake is not None:
                signal.set_wakeup_fd(self._wake[2])
        if self._wake is not None:
            for fd in self._wake[:2]:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._old, self._wake = {}, None

    def hold(self) -> None:
        """From now on further signals are ignored (the stop is under way)."""
        self._held = True

    def __enter__(self):
        global _ACTIVE
        if threading.current_thread() is threading.main_thread():
            _ACTIVE = self
            for sig in _SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
            r, w = os.pipe()
            os.set_blocking(w, False)
            old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            if old != -1:   # someone else's (an event loop in the main thread): theirs stays, the handler counts
                signal.set_wakeup_fd(old)
                os.close(r)
                os.close(w)
            else:
                self._wake = (r, w, old)
                threading.Thread(target=self._watch, args=(r,), name="grpolab-stop-watch", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        global _ACTIVE
        with self._exit_lock:
            self._left.set()
        if _ACTIVE is self:
            _ACTIVE = None
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}
        if self._wake is not None:
            _, w, old = self._wake
            signal.set_wakeup_fd(old)
            os.close(w)   # the watcher reads the end of the pipe and closes its side
            self._wake = None


_ACTIVE: StopFlag | None = None   # the flag whose handlers are installed in this process


def _after_fork_in_child() -> None:
    if _ACTIVE is not None:
        _ACTIVE._forget()


os.register_at_fork(after_in_child=_after_fork_in_child)
