"""Run untrusted programs against tests, from the host side: batches of programs in parallel sandboxes.

A batch of programs gets a fresh `launch.py` process that enters its own namespaces (`isolate`:
user, mount, PID, network, IPC, UTS) and judges each program in PID, IPC and mount namespaces of
its own inside them (`isolate.confine`, `grader`); this side only sends the job, waits (never past
the job's timeouts plus a grace period, then kills the whole process group) and reads the grader's
one-line reports. Nothing a program leaves behind (processes, files in /tmp, SysV shared memory,
message queues) outlives it or reaches the next program.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

LAUNCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch.py")
FIX = ("enable unprivileged user namespaces (sudo sysctl -w kernel.unprivileged_userns_clone=1; on Ubuntu 24.04+ "
       "also sudo sysctl -w kernel.apparmor_restrict_unprivileged_userns=0), or set "
       "reward.code_exec.unsafe_no_sandbox: true to run programs without isolation")



class SandboxError(RuntimeError):
    """The sandbox cannot be set up on this machine, or a job is malformed. (Defined here, not in
    grpolab/errors.py: the sandbox's files also run on their own, outside the package.)"""


@dataclass(frozen=True)
class Limits:
    """What one program may use. `timeout` is wall-clock seconds for all of its tests together."""
    timeout: float = 10.0
    memory_mb: int = 1024      # address space of the program's process
    max_procs: int = 32        # processes (and threads) the program may have at once
    max_output: int = 1 << 20  # stdout bytes per stdio test case
    file_mb: int = 16          # largest file it may write
    tmp_mb: int = 64           # size of its private /tmp
    tmp_inodes: int = 4096     # files and dirs in its /tmp (each costs kernel memory outside tmp_mb)
    shm_mb: int = 16           # SysV shared memory its IPC namespace may hold, in all (outside memory_mb)


@dataclass(frozen=True)
class Verdict:
    passed: int
    total: int
    status: str    # passed | failed | timeout | crashed | load_error | missing | error
    detail: str = ""

    @property
    def score(self) -> float:
        return self.passed / self.total if self.total else 0.0


def python_executable() -> tuple[str, list[str]]:
    """(the base interpreter, dirs to show in the sandbox for it): never a virtualenv's python, so
    the project's files stay out of the sandbox."""
    exe = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    show = [os.path.realpath(sys.base_prefix)]
    if not exe.startswith(show[0] + os.sep):
        show.append(os.path.dirname(exe))
    return exe, show


def run_program(program: str, tests: dict, limits: Limits = Limits(), *, unsafe: bool = False) -> Verdict:
    """Run `program` against `tests` in a fresh sandbox; never raises for anything the program does.

    tests: {"mode": "check", "test": code defining check(candidate), "entry_point": name,
            "prefix": trusted code run before the test (the prompt)} or
           {"mode": "stdio", "cases": [{"input": str, "output": str}, ...]}.
    """
    return run_batch([(program, tests)], limits, unsafe=unsafe)[0]


def run_batch(jobs: list[tuple[str, dict]], limits: Limits = Limits(), *, unsafe: bool = False) -> list[Verdict]:
    """Verdicts of (program, tests) jobs judged one after another in one sandbox, each program in PID,
    IPC and mount namespaces of its own there (its own /tmp and shared memory, gone when it ends), so
    they cannot reach each other; one sandbox per batch saves setting one up per program (a process
    start-up: ~5x the cost of confining one). When a sandbox stops early (it died), the programs it
    had not judged go to a fresh one; a program that stops it when it is the first one judged gets
    'error'. Each sandbox is waited for at most len(its jobs) * timeout plus a grace period, every
    program's set-up and teardown included."""
    out: list[Verdict] = []
    while len(out) < len(jobs):
        got = _one_sandbox(jobs[len(out):], limits, unsafe)
        out += got[:-1] if got[-1] is None else got
    return out


def _one_sandbox(jobs: list[tuple[str, dict]], limits: Limits, unsafe: bool) -> list:
    """Verdicts of a prefix of `jobs` from one sandbox, then None for the first job without a report
    (when the sandbox stopped early); every job has a verdict when the list does not end in None."""
    exe, show = python_executable()
    base = tempfile.mkdtemp(prefix="grpolab-sandbox-")
    batch = {"programs": [{"program": p, "tests": t} for p, t in jobs], "isolate": not unsafe, "base": base,
             "show": show, "python": exe, "timeout": limits.timeout, "memory_mb": limits.memory_mb,
             "max_procs": limits.max_procs, "max_output": limits.max_output, "file_mb": limits.file_mb,
             "tmp_mb": limits.tmp_mb, "tmp_inodes": limits.tmp_inodes, "shm_mb": limits.shm_mb}
    wait = len(jobs) * limits.timeout + max(5.0, limits.timeout)
    try:
        with _LIVE_LOCK:
            if _STOPPING.is_set():   # Ctrl-C: start no more sandboxes
                raise KeyboardInterrupt
            proc = subprocess.Popen([exe, "-I", "-S", "-B", LAUNCH, str(os.getpid())], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, cwd="/",
                                    close_fds=True)
            _LIVE.add(proc)
        try:
            out, err = proc.communicate(json.dumps(batch).encode(), timeout=wait)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, err = proc.communicate()
        finally:
            _kill_group(proc)
            with _LIVE_LOCK:
                _LIVE.discard(proc)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return _verdicts(out, err, proc.returncode, len(jobs))


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _verdicts(out: bytes, err: bytes, code: int, n: int) -> list:
    found: list[Verdict] = []
    for line in out.decode("utf-8", "replace").splitlines():
        if not found and line.startswith("ISOLATION "):
            raise SandboxError(f"cannot isolate programs on this machine ({line[len('ISOLATION '):]}); {FIX}")
        if line.startswith('{"i"'):
            msg = json.loads(line)
            if int(msg["i"]) != len(found):
                break
            r = msg["report"]
            found.append(Verdict(int(r["passed"]), int(r["total"]), str(r["status"]), str(r["detail"])))
    if not found and n:
        tail = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [f"exit code {code}"]
        return [Verdict(0, 1, "error", f"the judge gave no report: {tail[0][:300]}")]
    return found if len(found) == n else found + [None]


_LIVE: set[subprocess.Popen] = set()   # sandboxes running now (their process groups)
_LIVE_LOCK = threading.Lock()
_STOPPING = threading.Event()


def _stop_all() -> None:
    """Ctrl-C (or any error) in the caller: kill every running sandbox, so the pool's threads return at once."""
    _STOPPING.set()
    with _LIVE_LOCK:
        live = list(_LIVE)
    for proc in live:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def run_programs(jobs: list[tuple[str, dict]], limits: Limits = Limits(), *, max_concurrent: int = 0,
                 unsafe: bool = False) -> list[Verdict]:
    """Verdicts of (program, tests) jobs, in order: `max_concurrent` sandboxes (0 = cores) each judge
    every max_concurrent-th job. Ctrl-C kills every sandbox at once and re-raises."""
    workers = min(max_concurrent or os.cpu_count() or 1, len(jobs))
    if workers <= 1:
        return run_batch(jobs, limits, unsafe=unsafe)
    parts = [jobs[w::workers] for w in range(workers)]
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpolab-sandbox")
    try:
        results = list(pool.map(lambda part: run_batch(part, limits, unsafe=unsafe), parts))
    except BaseException:
        _stop_all()
        raise
    finally:
        pool.shutdown(wait=True)
        _STOPPING.clear()
    out: list[Verdict] = [None] * len(jobs)  # type: ignore[list-item]
    for w, res in enumerate(results):
        out[w::workers] = res
    return out


_CHECKED: set[bool] = set()
_CHECK_LOCK = threading.Lock()


def check_isolation() -> None:
    """Raise SandboxError (with the fix) unless a sandboxed program runs and is judged here. Cached."""
    with _CHECK_LOCK:
        if True in _CHECKED:
            return
        v = run_program("print(int(input()) + 1)", {"mode": "stdio", "cases": [{"input": "1", "output": "2"}]},
                        Limits(timeout=10.0))
        if v.status != "passed":
            raise SandboxError(f"the sandbox self-test failed ({v.status}: {v.detail}); {FIX}")
        _CHECKED.add(True)
