"""Calling an environment's code safely: every call (make, reset, step, close, first_prompt) runs in a daemon
thread under env.timeout (a hung environment cannot keep the process alive) with os._exit guarded as it is for
reward functions (rewards/exit_guard.py): an environment that calls os._exit(0) would otherwise end the run with
exit 0, no message and no metrics, as if it had finished. Any failure is one EnvError line naming the call."""

from __future__ import annotations

from typing import Callable

from ..errors import EnvError
from ..rewards import exit_guard
from ..utils.threads import call_all


def call_envs(name: str, calls: list[Callable[[], object]], wheres: list, timeout: float) -> list:
    """Every call's value, all at once; EnvError for the first that fails (in order), 'environment <name>: <its
    where>' leading the line: it raised, it had not returned within `timeout` seconds, or it called os._exit (even
    when it caught what that raised). A where is read (str()) only then: a call may keep in it how far it got."""
    mark = exit_guard.mark()
    with exit_guard.guard():
        results = call_all(calls, timeout, "grpolab-env")
    exits = [code for code, _ in exit_guard.calls_since(mark)]
    out = []
    for where, (ok, got) in zip(wheres, results):
        where = f"environment {name}: {where}"
        if ok is None:
            raise EnvError(f"{where}: no answer within env.timeout={timeout:g}s")
        if not ok:
            if isinstance(got, SystemExit) and exits:
                raise _exited(where, got.code)
            raise EnvError(f"{where}: raised {_raised(got)}") from got
        out.append(got)
    if exits:   # a call caught the SystemExit os._exit raised (or it came from a thread of the environment's own)
        which = wheres[0] if len(wheres) == 1 else f"{wheres[0]} (or another of the {len(wheres)} calls then)"
        raise _exited(f"environment {name}: {which}", exits[0], " (and caught the SystemExit it raised)")
    return out


def _exited(where: str, code: object, how: str = "") -> EnvError:
    return EnvError(f"{where}: called os._exit({code!r}){how}, which would end the run as if it had finished; end "
                    f"the episode with Reply(done=True), or raise an exception to stop the run")


def _raised(e: BaseException) -> str:
    """'ValueError: why' (the first line); sys.exit() said as such."""
    if isinstance(e, SystemExit):
        return f"SystemExit ({0 if e.code is None else e.code!r}: sys.exit() inside an environment)"
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__
