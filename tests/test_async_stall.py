"""A rollout worker that stops without dying (SIGSTOP, Ctrl-Z, a frozen machine): the trainer names it after
train.worker_stall_timeout and ends the run (exit 2, the last checkpoint kept, an exact resume after), and Ctrl-C
is heard while the trainer waits on it: acknowledged once, the second one stops at once (exit 130)."""

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, run_cli, wait_for_rows
from test_async import _alive, _args, _same_run, _workers

STOPPED = "the run stopped (the last checkpoint is kept: train.resume=auto continues it)"


def _start(tmp_path, out, *extra):
    return subprocess.Popen([sys.executable, "-m", "grpolab.cli", *_args(tmp_path, out, "train.async_steps=2",
                                                                         *extra, pause=0.15)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _first_worker(proc, timeout=300.0) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        found = _workers(proc.pid)
        if found:
            return found[0]
        time.sleep(0.01)
    raise AssertionError("no rollout worker appeared")


def _finish(proc, workers):
    try:
        _, err = proc.communicate(timeout=240)
    finally:
        for p in workers:   # never leave a stopped process behind, whatever the test found
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return err


@pytest.mark.slow
def test_a_worker_stopped_mid_run_is_named_and_the_resume_is_exact(tmp_path):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert run_cli(*_args(tmp_path, straight, "train.async_steps=2")).returncode == 0
    proc = _start(tmp_path, stopped, "train.worker_stall_timeout=3")
    wait_for_rows(stopped / "metrics.jsonl", 3, proc)
    workers = _workers(proc.pid)
    os.kill(workers[0], signal.SIGSTOP)
    err = _finish(proc, workers)
    assert proc.returncode == 2, (proc.returncode, err)
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"grpolab: training error: rollout worker 1 (pid {workers[0]}) has shown no sign of "
                           f"life for "), err
    assert "train.worker_stall_timeout = 3 s" in last and last.endswith(STOPPED), last
    assert "Traceback" not in err
    assert not any(_alive(p) for p in workers)   # the stopped worker was killed, not left behind
    assert len((stopped / "metrics.jsonl").read_text().splitlines()) < 8
    r = run_cli(*_args(tmp_path, stopped, "train.async_steps=2"), "train.resume=auto")
    assert r.returncode == 0, r.stderr
    _same_run(straight, stopped)


@pytest.mark.slow
def test_a_worker_stopped_as_it_starts_is_named(tmp_path):
    proc = _start(tmp_path, tmp_path / "run", "train.worker_stall_timeout=3")
    worker = _first_worker(proc)
    os.kill(worker, signal.SIGSTOP)
    err = _finish(proc, [worker])
    assert proc.returncode == 2, (proc.returncode, err)
    assert f"rollout worker 1 (pid {worker}) has shown no sign of life" in err.strip().splitlines()[-1], err
    assert "Traceback" not in err and not _alive(worker)


@pytest.mark.slow
def test_ctrl_c_is_heard_while_waiting_on_a_stopped_worker(tmp_path):
    """train.worker_stall_timeout=0 waits forever: only Ctrl-C ends the wait, and it must be heard."""
    proc = _start(tmp_path, tmp_path / "run", "train.worker_stall_timeout=0")
    wait_for_rows(tmp_path / "run" / "metrics.jsonl", 2, proc)
    workers = _workers(proc.pid)
    os.kill(workers[0], signal.SIGSTOP)
    time.sleep(2)   # the trainer is now waiting on the stopped worker (its batches run 2 steps ahead)
    os.kill(proc.pid, signal.SIGINT)
    deadline = time.time() + 120
    seen = ""
    while time.time() < deadline and "press Ctrl-C again" not in seen:   # the first one is acknowledged
        seen += os.read(proc.stderr.fileno(), 4096).decode()
    assert "stopping after this step and saving; press Ctrl-C again to stop now" in seen, seen
    os.kill(proc.pid, signal.SIGINT)
    err = seen + _finish(proc, workers)
    assert proc.returncode == 130, (proc.returncode, err)
    assert "stopped at once by a second SIGINT" in err and "Traceback" not in err, err
    assert not any(_alive(p) for p in workers)
