"""Hostile programs through the code_exec reward, inside one real GRPO training step.

One module-scoped fixture builds a real trainer (built-in tiny model, data.task=files, no warm
start) on a jsonl file with one row per adversarial program and runs one training step:
rollout.prompts_per_step is the number of rows, so every row is drawn exactly once, with G=2
completions. The reward is a user reward file that calls the real
`grpolab.rewards.code.code_exec` on the row's `program` column instead of the sampled completion
(the tiny random model cannot write these programs), under reward.code_exec.timeout=2 and
max_concurrent=2. Each attack is written so that its success would RAISE its score above the
honest one (`expected`), or would show on the host (a file, a process, a connection).

After the step the tests check: the trainer survived and the step completed within its time
budget; every row scored its honest score, for the intended reason (the sandbox's verdict status);
no file outside the sandbox changed (sentinels); no process of the sandboxes survived (/proc scan);
nothing connected to a socket the test listens on at 127.0.0.1.

Holes found while writing this file stay as tests (the `inject_*` rows of the step, and
`test_no_hole_*`, which need two programs in one sandbox in a known order and so call the
reward directly; since issue 34 each program there has PID, IPC and mount namespaces of its own,
and these keep checking that nothing one leaves reaches the next).
"""

from __future__ import annotations

import json
import math
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from grpolab.config.load import load_config
from grpolab.jobs.common import setup_torch
from grpolab.jobs.inputs import configure_rewards
from grpolab.jobs.train import build_trainer
from grpolab.monitor.console import Console
from grpolab.rewards.code import code_exec
from grpolab.rewards.runtime import RewardRuntime
from grpolab.sandbox import Limits, run_program
from grpolab.train.run import Run

ROOT = Path(__file__).resolve().parents[1]          # the project dir
HOME = Path.home()
HOST_TMP = Path("/tmp")
TIMEOUT, MAX_CONCURRENT, G = 2.0, 2, 2
TAG_ENV = "GRPOLAB_ADVERSARIAL_TEST_TAG"            # set in the trainer's env: the launchers inherit it
LAUNCH_MARK, WORKER_MARK = "grpolab/sandbox/launch.py", "# grpolab sandbox worker"

# ---------------------------------------------------------------------------- the matrix
# Each program starts with `C = {...}` (the run's paths, port and markers; see _context).
# check rows: `test` defines check(candidate), entry point f. stdio rows: `cases` [(input, output)].


def _check(name, expected, program, test, status, detail="", prompt=None):
    return {"name": name, "expected": expected, "program": program, "test": test, "cases": None,
            "status": status, "detail": detail, "prompt": prompt}


def _stdio(name, expected, program, cases, status, detail=""):
    return {"name": name, "expected": expected, "program": program, "test": None, "cases": cases,
            "status": status, "detail": detail, "prompt": None}


PLUS_ONE = "def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(41) == 42\n"
RETURNS_ONE = "def check(candidate):\n    assert candidate() == 1\n"

ROWS = [
    # ---- resources: each would pass if the limit were not there, or would take the host down
    _check("fork_bomb", 0.0, """
import os, time
while True:            # fork as fast as the process limit allows, in every child too
    try:
        os.fork()
    except OSError:
        time.sleep(0.01)
def f():
    return 1
""", RETURNS_ONE, "timeout", "did not finish loading"),
    _check("infinite_loop", 0.0, """
def f(x):
    while True:
        pass
""", PLUS_ONE, "timeout", ""),
    _check("sleep_forever", 0.0, """
import time
def f(x):
    time.sleep(10 ** 6)
    return x + 1
""", PLUS_ONE, "timeout", ""),
    _check("alloc_50gb", 0.0, """
def f():
    try:
        b = bytearray(50 << 30)
        b[-1] = 1
        return 1
    except MemoryError:
        return 0
""", RETURNS_ONE, "failed", "AssertionError"),
    _check("alloc_4gb", 0.0, """
def f():   # fits this host's memory: only the sandbox's limit (memory_mb) stops it
    try:
        b = bytearray(4 << 30)
        b[-1] = 1
        return 1
    except MemoryError:
        return 0
""", RETURNS_ONE, "failed", "AssertionError"),
    _stdio("print_1gb", 0.0, """
import sys
print(int(input()) + 1)
sys.stdout.flush()
chunk = "x" * (1 << 20) + "\\n"
for _ in range(1024):
    sys.stdout.write(chunk)
""", [("1", "2")], "failed", "printed more than 1048576 bytes"),
    _check("deep_recursion", 0.0, """
import sys
sys.setrecursionlimit(10 ** 6)
def f(n):   # recurses through C (map, max): the C stack overflows
    return 0 if n == 0 else 1 + max(map(f, [n - 1]))
""", "def check(candidate):\n    assert candidate(10 ** 6) == 10 ** 6\n", "crashed", ""),
    _check("ignore_sigterm", 0.0, """
import signal
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGXCPU):
    signal.signal(s, signal.SIG_IGN)
def f(x):
    while True:
        pass
""", PLUS_ONE, "timeout", ""),
    _stdio("stdio_thread_spins_forever", 0.0, """
import threading
print(int(input()) + 1, flush=True)
def spin():
    while True:
        pass
threading.Thread(target=spin).start()   # not a daemon: the process never exits
""", [("1", "2")], "timeout", ""),
    _stdio("read_stdin_forever", 0.0, """
import sys
while True:
    sys.stdin.read()
""", [("1", "2")], "timeout", ""),
    # ---- escaping the sandbox: each would pass only from the host
    _check("tcp_to_host_listener", 0.0, """
import socket
def f():
    for host in ("127.0.0.1", "localhost"):
        try:
            s = socket.create_connection((host, C["port"]), timeout=1)
            s.sendall(b"escaped")
            s.close()
            return 1
        except OSError:
            pass
    return 0
""", RETURNS_ONE, "failed", "AssertionError"),
    _check("write_home", 0.0, """
def f():
    try:
        with open(C["home_file"], "w") as out:
            out.write("escaped")
        return 1
    except OSError:
        return 0
""", RETURNS_ONE, "failed", "AssertionError"),
    _check("write_project_dir", 0.0, """
def f():
    try:
        with open(C["project_file"], "w") as out:
            out.write("escaped")
        return 1
    except OSError:
        return 0
""", RETURNS_ONE, "failed", "AssertionError"),
    _check("host_tmp_read_and_write", 0.0, """
import os
def f():
    try:   # the sandbox's own /tmp is private: writing there succeeds, and must not reach the host
        with open(C["tmp_file"], "w") as out:
            out.write("escaped")
    except OSError:
        pass
    return 1 if os.path.exists(C["tmp_sentinel"]) else 0   # the host's /tmp is visible
""", RETURNS_ONE, "failed", "AssertionError"),
    _check("read_run_dir_config", 0.0, """
def f():
    for p in (C["run_config"], "/proc/1/root" + C["run_config"], "/proc/self/root" + C["run_config"],
              "/proc/1/cwd/config.yaml"):
        try:
            with open(p) as src:
                return src.read()
        except OSError:
            pass
    return ""
""", "def check(candidate):\n    assert 'output_dir' in candidate()\n", "failed", "AssertionError"),
    _check("read_home_secret", 0.0, """
def f():
    try:
        with open(C["home_secret"]) as src:
            return src.read()
    except OSError:
        return ""
""", None, "failed", "AssertionError"),   # the test (with the secret) is written by _jsonl_rows
    _check("delete_project_sentinel", 0.0, """
import os
def f():
    try:
        os.remove(C["project_sentinel"])
        return 1
    except OSError:
        return 0
""", RETURNS_ONE, "failed", "AssertionError"),
    _check("kill_own_process_group", 0.0, """
import os
def f(x):
    os.killpg(0, 9)
    return x + 1
""", PLUS_ONE, "crashed", ""),
    # ---- cheating the judge
    _check("os_exit_0_before_tests", 0.0, """
import os
os._exit(0)
def f(x):
    return x + 1
""", PLUS_ONE, "crashed", ""),
    _check("sys_exit_0_before_tests", 0.0, """
import sys
sys.exit(0)
def f(x):
    return x + 1
""", PLUS_ONE, "load_error", "SystemExit"),
    _check("defines_its_own_check", 0.0, """
import builtins
def check(candidate):
    pass
builtins.check = check
def f(x):
    return 0
""", PLUS_ONE, "failed", "AssertionError"),
    _check("patches_assertion_error", 0.0, """
import builtins
class Never(Exception):
    pass
builtins.AssertionError = Never
builtins.Exception = Never
def f(x):
    return 0
""", PLUS_ONE, "failed", "AssertionError"),
    _check("returns_always_equal_object", 0.0, """
class Anything:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = object.__hash__
def f(x):
    return Anything()
""", PLUS_ONE, "failed", "WireError"),
    _check("returns_always_equal_int_subclass", 0.0, """
class Anything(int):
    def __eq__(self, other):
        return True
    __hash__ = int.__hash__
def f(x):
    return Anything(0)
""", PLUS_ONE, "failed", "AssertionError"),
    _stdio("stdio_prints_answer_then_exit_1", 0.0, """
import sys
print(int(input()) + 1, flush=True)
sys.exit(1)
""", [("1", "2"), ("41", "42")], "failed", "case 0: exit code 1"),
    # ---- controls: correct programs that also do something hostile; they must keep their full score
    _check("control_kill_parent", 1.0, """
import os, signal
def f(x):
    for pid in (os.getppid(), 1):
        for sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGSTOP):
            try:
                os.kill(pid, sig)
            except OSError:
                pass
    return x + 1
""", PLUS_ONE, "passed", ""),
    _check("control_spinning_thread", 1.0, """
import threading
def spin():
    while True:
        pass
threading.Thread(target=spin).start()
def f(x):
    return x + 1
""", PLUS_ONE, "passed", ""),
    _check("control_double_fork_daemon", 1.0, """
import os, sys, time
pid = os.fork()
if pid == 0:
    os.setsid()
    if os.fork() == 0:
        code = "import time; time.sleep(31.4159); open(%r, 'w').write('daemon') # %s" % (C["daemon_file"], C["marker"])
        os.execv(sys.executable, [sys.executable, "-c", code, C["marker"]])
    os._exit(0)
os.waitpid(pid, 0)
def daemon_running():
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open("/proc/%s/cmdline" % p, "rb") as src:
                    if C["marker"].encode() in src.read():
                        return True
            except OSError:
                pass
    return False
def f(x):   # right only once the daemon runs: the row proves a live daemon was there to kill
    for _ in range(100):
        if daemon_running():
            return x + 1
        time.sleep(0.02)
    return None
""", PLUS_ONE, "passed", ""),
    _stdio("control_deletes_its_workdir", 1.0, """
import os, shutil
for name in os.listdir(os.getcwd()):
    p = os.path.join(os.getcwd(), name)
    shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.remove(p)
print(int(input()) + 1)
""", [("1", "2"), ("41", "42")], "passed", ""),
    _stdio("stdio_one_of_two", 0.5, """
n = int(input())
print(n + 1 if n < 5 else 0)
""", [("1", "2"), ("41", "42")], "failed", "case 1: wrong output"),
    # ---- a program adds names to the ones the judge asked for (the judge takes only those it asked for)
    _check("inject_builtin_abs", 0.0, """
import sys
sys._getframe(1).f_locals["first"]["names"].append("abs")   # the worker's request from the judge
def abs(x):
    return 0
def f(x):
    return 123.0
""", "def check(candidate):\n    assert abs(candidate(3.75) - 0.75) < 1e-6\n",
           status="failed", detail="AssertionError"),
    _check("inject_prompt_helper", 0.0, """
import sys
sys._getframe(1).f_locals["first"]["names"].append("poly")
def poly(xs, x):
    return 0
def f(xs):
    return 42.0
""", "def check(candidate):\n    assert poly([1, 2], candidate([1, 2])) == 0\n",
           status="failed", detail="AssertionError",
           prompt="def poly(xs, x):\n    return sum(c * x ** i for i, c in enumerate(xs))\n"),
]
NAMES = [r["name"] for r in ROWS]
assert len(set(NAMES)) == len(NAMES)

REWARD_FILE = '''
import json, time
from grpolab.rewards import code
from grpolab.rewards.runtime import RewardRuntime


def adversarial(prompts, completions, program, runtime=None, **kw):
    """The real code_exec reward, on the row's program instead of the sampled completion (in a
    ```python fence, as a chat model writes it: a text prompt is not taken for code to continue),
    in the run's sandbox (`runtime`, which grpolab passes to a reward that names it).
    Logs what it returned, the limits it ran under and each program's verdict (the sandbox's own
    verdicts, passed through unchanged) to LOG."""
    verdicts, real = [], code.run_programs
    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        verdicts.extend(out)
        return out
    t0 = time.perf_counter()
    code.run_programs = recording
    try:
        out = code.code_exec(prompts, ["```python\\n" + p + "```" for p in program], runtime=runtime, **kw)
    finally:
        code.run_programs = real
    s = runtime if runtime is not None else RewardRuntime()
    with open(LOG, "a") as log:
        log.write(json.dumps({"seconds": time.perf_counter() - t0, "timeout": s.limits.timeout,
                              "memory_mb": s.limits.memory_mb, "max_procs": s.limits.max_procs,
                              "max_output": s.limits.max_output, "max_concurrent": s.max_concurrent,
                              "unsafe": s.unsafe, "names": kw["name"], "rewards": out,
                              "verdicts": [[v.status, v.detail] for v in verdicts]}) + "\\n")
    return out
'''


# ---------------------------------------------------------------------------- host-side detectors
def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _ancestors() -> set[int]:
    out, pid = set(), os.getpid()
    while pid > 1:
        out.add(pid)
        stat = _read(f"/proc/{pid}/stat").decode(errors="replace")
        pid = int(stat.rsplit(")", 1)[1].split()[1]) if stat else 0
    return out


def survivors(tag: str, marker: str) -> list[str]:
    """Processes on this host left by this run's sandboxes: any with `marker` in its command line
    (the daemon), any started with this run's tag in its environment (the launchers and the
    sandboxes' PID 1s inherit the trainer's environment), and any launcher or worker in the PID
    namespace of one of those. (Other sessions on the machine may run sandboxes of their own; they
    lack the tag.)"""
    mine = _ancestors()
    host_ns = os.readlink("/proc/self/ns/pid")
    found, tagged_ns, sandboxy = [], set(), []
    for p in os.listdir("/proc"):
        if not p.isdigit() or int(p) in mine:
            continue
        cmd = _read(f"/proc/{p}/cmdline").replace(b"\0", b" ").decode(errors="replace")
        if not cmd:
            continue
        env = _read(f"/proc/{p}/environ")
        try:
            ns = os.readlink(f"/proc/{p}/ns/pid")
        except OSError:
            ns = None
        if marker in cmd:
            found.append(f"{p}: {cmd[:120]}")
        elif f"{TAG_ENV}={tag}".encode() in env.split(b"\0"):
            found.append(f"{p}: {cmd[:120]}")
            if ns != host_ns:   # a sandbox's PID 1: its namespace holds the sandbox's workers
                tagged_ns.add(ns)
        elif LAUNCH_MARK in cmd or WORKER_MARK in cmd:
            sandboxy.append((p, ns, cmd))
    found += [f"{p}: [{'worker' if WORKER_MARK in cmd else 'launcher'} in a tagged sandbox] {cmd[:120]}"
              for p, ns, cmd in sandboxy if ns in tagged_ns]
    return found


def connections(listener: socket.socket) -> list[bytes]:
    """What connected to the listening socket (each connection's first bytes)."""
    got = []
    while select.select([listener], [], [], 0)[0]:
        conn, _ = listener.accept()
        conn.settimeout(0.5)
        try:
            got.append(conn.recv(100) or b"<connected>")
        except OSError:
            got.append(b"<connected>")
        conn.close()
    return got


def file_state(paths: list[Path]) -> dict[str, tuple | None]:
    out = {}
    for p in paths:
        try:
            st = p.stat()
            out[str(p)] = (st.st_size, st.st_mtime_ns, p.read_bytes())
        except FileNotFoundError:
            out[str(p)] = None
    return out


def tagged_files(tag: str) -> list[str]:
    """Every file named with this run's tag in the places the programs aimed at."""
    return sorted(str(p) for d in (HOME, ROOT, HOST_TMP) for p in d.glob(f"*{tag}*"))


# ---------------------------------------------------------------------------- the training step
def _context(run_dir: Path, tag: str, port: int) -> dict:
    return {"port": port, "marker": f"grpolab-adversarial-daemon-{tag}",
            "home_file": str(HOME / f".grpolab-adv-{tag}-written"),
            "home_secret": str(HOME / f".grpolab-adv-{tag}-secret"),
            "project_file": str(ROOT / f".grpolab-adv-{tag}-written"),
            "project_sentinel": str(ROOT / f".grpolab-adv-{tag}-sentinel"),
            "tmp_file": str(HOST_TMP / f"grpolab-adv-{tag}-written"),
            "tmp_sentinel": str(HOST_TMP / f"grpolab-adv-{tag}-sentinel"),
            "daemon_file": str(HOST_TMP / f"grpolab-adv-{tag}-daemon"),
            "run_config": str(run_dir / "config.yaml")}


def _jsonl_rows(ctx: dict, secret: str) -> list[dict]:
    out = []
    for i, r in enumerate(ROWS):
        test = r["test"]
        if r["name"] == "read_home_secret":
            test = f"def check(candidate):\n    assert candidate().strip() == {secret!r}\n"
        out.append({"prompt": r["prompt"] or f"Row {i}: {r['name'].replace('_', ' ')}?",   # '?': not Python
                    "name": r["name"], "expected": r["expected"],
                    "program": f"C = {ctx!r}\n" + r["program"].lstrip("\n"),
                    "test": test, "entry_point": "f" if test else None,
                    "test_cases": [{"input": a, "output": b} for a, b in r["cases"]] if r["cases"] else None})
    return out


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("adversarial")
    run_dir = tmp / "run"
    tag = uuid.uuid4().hex[:12]
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    ctx = _context(run_dir, tag, listener.getsockname()[1])
    secret = f"secret-{uuid.uuid4().hex}"
    sentinels = {Path(ctx["project_sentinel"]): b"project sentinel\n", Path(ctx["tmp_sentinel"]): b"tmp sentinel\n",
                 Path(ctx["home_secret"]): (secret + "\n").encode()}
    for p, data in sentinels.items():
        p.write_bytes(data)
    watched = [*sentinels, *(Path(ctx[k]) for k in ("home_file", "project_file", "tmp_file", "daemon_file"))]
    before = file_state(watched)
    saved_tag = os.environ.get(TAG_ENV)
    try:
        data = tmp / "adversarial.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in _jsonl_rows(ctx, secret)))
        log = tmp / "reward_calls.jsonl"
        reward = tmp / "adversarial_reward.py"
        reward.write_text(f"LOG = {str(log)!r}\n" + REWARD_FILE)
        cfg = load_config(None, [
            "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=128", "sft.steps=0",
            "data.task=files", f"data.train_path={data}", f"data.test_path={data}", "data.train_size=0",
            f"rollout.prompts_per_step={len(ROWS)}", f"rollout.num_generations={G}", "rollout.max_new_tokens=4",
            "eval.num_problems=1", "eval.k=1", "train.max_steps=1", "train.threads=1", f"train.output_dir={run_dir}",
            f"reward.functions=[{reward}:adversarial]", f"reward.code_exec.timeout={TIMEOUT}",
            f"reward.code_exec.max_concurrent={MAX_CONCURRENT}"])
        setup_torch(cfg)
        run = Run(cfg, "grpo")
        run.start()   # as `grpolab train` does: the run dir holds config.yaml
        trainer = build_trainer(cfg, run, Console(quiet=True))
        c = cfg.reward.code_exec
        want = (c.timeout, c.memory_mb, c.max_procs, c.max_output, c.max_concurrent)
        os.environ[TAG_ENV] = tag   # the sandboxes started from here on carry it (see survivors)
        t0 = time.perf_counter()
        error = None
        try:
            history = trainer.train()
        except BaseException as e:  # noqa: BLE001 - the trainer must survive; reported by the tests
            error, history = f"{type(e).__name__}: {e}", []
        wall = time.perf_counter() - t0
        left_now = survivors(tag, ctx["marker"])
        left = left_now
        for _ in range(25):   # the teardown is synchronous; a little grace only to tell a race from a survivor
            if not left:
                break
            time.sleep(0.2)
            left = survivors(tag, ctx["marker"])
        _restore_env(saved_tag)
        calls = [json.loads(x) for x in log.open()] if log.exists() else []
        # the limits the user reward's code_exec calls ran under: the trainer's runtime, passed to it
        configured_by_trainer = bool(calls) and all(
            (x["timeout"], x["memory_mb"], x["max_procs"], x["max_output"], x["max_concurrent"]) == want for x in calls)
        yield {"trainer": trainer, "history": history, "error": error, "wall": wall, "cfg": cfg,
               "configured_by_trainer": configured_by_trainer, "calls": calls, "survivors_at_end": left_now,
               "survivors": left,
               "connections": connections(listener), "before": before, "after": file_state(watched),
               "sentinels": {str(p): d for p, d in sentinels.items()}, "tagged_files": tagged_files(tag),
               "expected_files": sorted(str(p) for p in sentinels), "run_dir": run_dir, "tag": tag, "ctx": ctx,
               "data": data}
    finally:
        listener.close()
        for p in sentinels:
            p.unlink(missing_ok=True)
        for f in tagged_files(tag):   # should be none: the tests report them
            Path(f).unlink(missing_ok=True)
        _restore_env(saved_tag)


def _restore_env(saved: str | None) -> None:
    if saved is None:
        os.environ.pop(TAG_ENV, None)
    else:
        os.environ[TAG_ENV] = saved


BY_NAME = {r["name"]: r for r in ROWS}


def _results(step) -> dict[str, list[tuple[float, str, str]]]:
    """name -> (reward in the training batch, verdict status, verdict detail) of each of its G completions."""
    assert step["error"] is None, step["error"]
    b = step["trainer"].last_batch
    (col,) = b.reward_columns.values()
    (call,) = step["calls"]
    assert call["names"] == b.columns["name"] and len(call["verdicts"]) == len(col)
    out: dict[str, list[tuple[float, str, str]]] = {}
    for name, v, (status, detail) in zip(b.columns["name"], col.tolist(), call["verdicts"]):
        out.setdefault(name, []).append((v, status, detail))
    return out


# ---------------------------------------------------------------------------- the tests
@pytest.mark.slow
def test_the_step_completes_within_its_budget_and_uses_every_row_once(step):
    assert step["error"] is None, step["error"]   # the trainer survived every program
    assert step["trainer"].step == 1 and len(step["history"]) == 1
    m = step["history"][0]
    assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])
    lines = (step["run_dir"] / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["step"] == 1
    # prompts_per_step = rows: each row drawn once, with its G completions
    assert Counter(step["trainer"].last_batch.columns["name"]) == {n: G for n in NAMES}
    # one reward call, made under the configured limits
    (call,) = step["calls"]
    assert (call["timeout"], call["max_concurrent"], call["unsafe"]) == (TIMEOUT, MAX_CONCURRENT, False)
    n_programs = len(ROWS) * G
    assert len(call["rewards"]) == n_programs
    # wall time: every program a full timeout (+1 s of start-up and teardown) in its sandbox, plus the trainer
    budget = math.ceil(n_programs / MAX_CONCURRENT) * (TIMEOUT + 1) + 30
    assert step["wall"] <= budget, (step["wall"], budget)
    # the reward call itself: within the runner's bound (per sandbox: its jobs * timeout + a 5 s grace) + 5 s
    assert call["seconds"] <= math.ceil(n_programs / MAX_CONCURRENT) * TIMEOUT + 5 + 5, call["seconds"]
    # the training batch holds what the reward returned (one function, weight 1), and the metric its mean
    assert step["trainer"].last_batch.rewards.tolist() == pytest.approx(call["rewards"])
    assert m["rewards/adversarial/mean"] == pytest.approx(sum(call["rewards"]) / n_programs, abs=1e-6)
    # code_exec's own status rates, over all programs
    want = Counter(BY_NAME[n]["status"] for n in step["trainer"].last_batch.columns["name"])
    for status in ("timeout", "load_error", "crashed"):
        assert m[f"code_exec/{status}_rate"] == pytest.approx(want[status] / n_programs), status


@pytest.mark.parametrize("name", NAMES)
def test_each_program_gets_its_honest_score(step, name):
    row = BY_NAME[name]
    got = _results(step)[name]
    assert [score for score, _, _ in got] == [row["expected"]] * G, f"{name}: {got}, honest score {row['expected']}"
    for _, status, detail in got:   # and for the intended reason
        assert status == row["status"] and row["detail"] in detail, f"{name}: {got}"


def test_no_file_outside_the_sandbox_changed(step):
    assert step["after"] == step["before"]
    for path, data in step["sentinels"].items():
        assert Path(path).read_bytes() == data, path
    for key in ("home_file", "project_file", "tmp_file", "daemon_file"):
        assert not Path(step["ctx"][key]).exists(), step["ctx"][key]
    # nothing else named with this run's tag appeared in $HOME, the project dir or /tmp
    assert step["tagged_files"] == step["expected_files"]


def test_no_process_survives_the_step(step):
    assert step["survivors_at_end"] == [], step["survivors_at_end"]
    assert step["survivors"] == []


def test_nothing_connected_to_the_host_listener(step):
    assert step["connections"] == []


def test_configure_rewards_applies_reward_code_exec_when_code_exec_is_listed(step, tmp_path):
    """The wiring the step above relies on when the built-in name is listed (jobs/inputs.configure_rewards,
    which build_trainer calls: the runtime it returns is the one the trainer's score() calls pass)."""
    cfg = load_config(None, [
        "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=128", "sft.steps=0",
        "data.task=files", f"data.train_path={step['data']}", f"data.test_path={step['data']}",
        "rollout.num_generations=2", "rollout.max_new_tokens=4", f"train.output_dir={tmp_path}",
        "reward.functions=[code_exec]", "reward.code_exec.timeout=3.5", "reward.code_exec.max_concurrent=3",
        "reward.code_exec.memory_mb=300", "reward.code_exec.max_procs=7", "reward.code_exec.max_output=999"])
    runtime = configure_rewards(cfg, Console(quiet=True))
    assert (runtime.limits, runtime.max_concurrent, runtime.unsafe) == (
        Limits(timeout=3.5, memory_mb=300, max_procs=7, max_output=999), 3, False)


def test_the_trainer_applies_reward_code_exec_to_a_user_reward_calling_code_exec(step):
    assert step["configured_by_trainer"]


# ---------------------------------------------------------------------------- holes between programs
# These need two programs in one sandbox, in a known order: the reward is called directly (the same
# code_exec, max_concurrent=1: one sandbox judges the jobs in order, each confined in namespaces of its own).
HONEST_STDIO = "print(int(input()) + 1)\n"
STDIO_CASES = [{"input": "1", "output": "2"}]


def _code_exec_in_one_sandbox(programs):
    return code_exec(None, programs, test_cases=[STDIO_CASES] * len(programs),
                     runtime=RewardRuntime(limits=Limits(timeout=TIMEOUT), max_concurrent=1))


def test_no_hole_deep_workdir_zeroes_the_rest_of_the_batch():
    deep = "import os\nfor _ in range(1200):\n    os.mkdir('a')\n    os.chdir('a')\nprint(int(input()) + 1)\n"
    assert _code_exec_in_one_sandbox([deep, HONEST_STDIO, HONEST_STDIO]) == [1.0, 1.0, 1.0]


def test_no_hole_readonly_dir_zeroes_later_stdio_programs():
    hostile = ("import os\nprint(int(input()) + 1)\nfor n in ('program.py', 'input.txt'):\n    p = '/tmp/' + n\n"
               "    os.unlink(p)\n    os.mkdir(p)\n    open(p + '/x', 'w').close()\n    os.chmod(p, 0o555)\n")
    assert _code_exec_in_one_sandbox([hostile, HONEST_STDIO, HONEST_STDIO]) == [1.0, 1.0, 1.0]


DECODE_BOMB = """
import os, struct
def f():   # answers the judge's call itself: one 64 MiB frame of 22 million empty lists
    n = (64 << 20) - 8
    os.write(4, struct.pack(">I", n // 3 * 3 + 8) + b'{"ok":[')
    left, chunk = n // 3 - 1, b"[]," * (1 << 16)
    while left > 0:
        k = min(left, 1 << 16)
        os.write(4, chunk[:3 * k])
        left -= k
    os.write(4, b"[]]}")
    import time
    time.sleep(100)
"""


def test_no_hole_a_64mib_reply_bloats_the_judge_and_zeroes_the_next_program():
    tag = uuid.uuid4().hex[:12]
    peak, done = [0], threading.Event()

    def watch():   # the largest resident size of this call's sandbox processes (tagged launchers, PID 1)
        while not done.is_set():
            for p in os.listdir("/proc"):
                if p.isdigit() and f"{TAG_ENV}={tag}".encode() in _read(f"/proc/{p}/environ").split(b"\0"):
                    for line in _read(f"/proc/{p}/status").decode(errors="replace").splitlines():
                        if line.startswith("VmRSS:"):
                            peak[0] = max(peak[0], int(line.split()[1]) >> 10)
            time.sleep(0.05)

    saved_tag = os.environ.get(TAG_ENV)
    os.environ[TAG_ENV] = tag
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        got = code_exec(None, [DECODE_BOMB, "def f():\n    return 1\n"], test=RETURNS_ONE, entry_point="f",
                        runtime=RewardRuntime(limits=Limits(timeout=1.0), max_concurrent=1))
    finally:
        done.set()
        watcher.join()
        _restore_env(saved_tag)
    assert peak[0] > 0   # the watcher saw the sandbox
    assert got == [0.0, 1.0] and peak[0] < 1024, (got, f"judge peak RSS {peak[0]} MiB")


# ---------------------------------------------------------------------------- the detectors can fail
def test_the_detectors_see_what_they_look_for(tmp_path):
    tag, marker = uuid.uuid4().hex[:12], f"grpolab-adversarial-daemon-{uuid.uuid4().hex[:12]}"
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    procs = [subprocess.Popen(sleeper + [marker]),   # a surviving daemon
             subprocess.Popen(sleeper + [LAUNCH_MARK], env={**os.environ, TAG_ENV: tag}),   # a launcher
             subprocess.Popen(sleeper + [LAUNCH_MARK], env={**os.environ, TAG_ENV: "another-run"})]
    try:
        time.sleep(0.3)
        found = survivors(tag, marker)
        assert any(str(procs[0].pid) == f.split(":")[0] for f in found)
        assert any(str(procs[1].pid) == f.split(":")[0] for f in found)
        assert not any(str(procs[2].pid) == f.split(":")[0] for f in found)   # another session's sandbox
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait()
    assert survivors(tag, marker) == []
    # a real sandbox, seen while it runs: its launchers, its PID 1 and the worker in its namespace
    saved = os.environ.get(TAG_ENV)
    os.environ[TAG_ENV] = tag
    try:
        box = threading.Thread(target=run_program, args=("import time\ntime.sleep(60)\ndef f():\n    return 1\n",
                               {"mode": "check", "test": RETURNS_ONE, "entry_point": "f"}, Limits(timeout=1.5)))
        box.start()
        time.sleep(0.7)
        running = survivors(tag, marker)
        box.join()
    finally:
        _restore_env(saved)
    assert sum(LAUNCH_MARK in f for f in running) >= 3 and sum("[worker" in f for f in running) == 1, running
    assert survivors(tag, marker) == []
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        assert connections(listener) == []
        with socket.create_connection(listener.getsockname(), timeout=1) as c:
            c.sendall(b"hi")
            time.sleep(0.1)
            assert connections(listener) == [b"hi"]
    f = tmp_path / "sentinel"
    f.write_bytes(b"a")
    before = file_state([f, tmp_path / "absent"])
    f.write_bytes(b"b")
    (tmp_path / "absent").write_bytes(b"")
    after = file_state([f, tmp_path / "absent"])
    assert after[str(f)] != before[str(f)] and after[str(tmp_path / "absent")] is not None
