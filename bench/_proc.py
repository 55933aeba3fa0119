"""A benchmark's subprocess, timed: wall seconds and CPU seconds (its own and its reaped children's)."""

from __future__ import annotations

import os
import subprocess
import time


def run_reaped(cmd: list[str], *, cwd, env: dict, stdout, stderr, timeout: float) -> tuple[int, float, float, bool]:
    """Run `cmd`, reaped here with wait4 rather than by Popen (wait4 reports its CPU time); killed past
    `timeout` seconds. Returns (exit code, wall s, CPU s, timed out)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=stdout, stderr=stderr)
    timed_out = False
    while True:
        pid, status, ru = os.wait4(p.pid, os.WNOHANG)
        if pid:
            break
        if not timed_out and time.perf_counter() - t0 > timeout:
            p.kill()
            timed_out = True
        time.sleep(0.05)
    p.returncode = os.waitstatus_to_exitcode(status)   # (so Popen does not try to reap it again)
    return p.returncode, time.perf_counter() - t0, ru.ru_utime + ru.ru_stime, timed_out
