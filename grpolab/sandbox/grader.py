"""The grader: runs a program's tests from outside the program's process and counts what passed.

Runs inside the sandbox as its PID 1 (or, unsandboxed, as the launcher), standard library only.
The program runs in a separate worker process that never sees a test or an expected output:

- `check` mode (HumanEval/MBPP rows: `test` code defining `check(candidate)`, and `entry_point`):
  the test code runs here, in the grader; `candidate` and every other name the test takes from the
  program are proxies whose calls go to the worker and come back as plain values (`wire`). The
  program cannot patch the test, its asserts or `check`, cannot print a verdict, and exiting or
  crashing only makes the remaining calls fail. Names the row's trusted prompt defines (helpers
  such as HumanEval's `poly`) are taken from the prompt, not from the program.
- `stdio` mode (rows with `test_cases`: [{"input", "output"}]): each case runs the program as a
  script with the input on stdin; a case passes when the program exits 0 and its stdout matches
  (trailing whitespace ignored), compared here.
- `output` mode (the python tool): the program runs once as a script; the report carries what it
  printed (stdout and stderr).

Reports go to a private copy of the grader's stdout, one JSON line per program; the grader's own
stdout and stderr are /dev/null, so nothing a test prints can pass for a report.
"""

from __future__ import annotations

import ast
import builtins
import json
import os
import resource
import select
import signal
import struct
import time

try:
    from . import wire
except ImportError:   # run by launch.py as a plain script
    import wire

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
MSGQUEUE_BYTES = 256 << 10   # POSIX message queues' memory (outside RLIMIT_AS); see also isolate.ipc_ceilings


class Timeout(BaseException):
    """The job's wall-clock budget ran out (a BaseException: test code's `except Exception` cannot eat it)."""


class RemoteError(Exception):
    """The program raised an exception that is not a built-in one."""


class Grader:
    """Judges one program (`job`: program, tests, limits); `run()` -> its report."""

    def __init__(self, job: dict, worker_src: str, isolated: bool) -> None:
        self.job = job
        self.worker_src = worker_src
        self.isolated = isolated
        self.deadline = time.monotonic() + float(job["timeout"])
        self.workdir = job["workdir"]
        self.pid = None   # the worker

    # ------------------------------------------------------------ processes
    def _limits(self) -> None:
        """In the worker, before exec: its resource limits."""
        j = self.job
        cpu = max(1, int(float(j["timeout"]) + 1))
        for res, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, j["memory_mb"] << 20),
                           (resource.RLIMIT_FSIZE, j["file_mb"] << 20), (resource.RLIMIT_NOFILE, 64),
                           (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, j["max_procs"]),
                           (resource.RLIMIT_MSGQUEUE, MSGQUEUE_BYTES)):
            soft, hard = resource.getrlimit(res)
            value = value if hard == resource.RLIM_INFINITY else min(value, hard)
            resource.setrlimit(res, (value, value))

    def spawn(self, argv: list[str], fds: dict[int, int]) -> int:
        """Fork and exec `argv` with `fds` ({target fd: our fd}) and nothing else open."""
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": self.workdir, "LANG": "C.UTF-8",
               "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1", "TMPDIR": self.workdir}
        pid = os.fork()
        if pid == 0:
            try:
                os.setsid()
                os.chdir(self.workdir)
                high = max(*fds, *fds.values()) + 1   # staged out of the way: targets may be sources
                for target, fd in fds.items():
                    os.dup2(fd, high + target)
                for target in fds:
                    os.dup2(high + target, target)
                os.closerange(max(fds) + 1, 1 << 16)
                self._limits()
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                signal.signal(signal.SIGPIPE, signal.SIG_DFL)
                os.execve(argv[0], argv, env)
            finally:
                os._exit(127)
        self.pid = pid
        return pid

    def kill_all(self) -> None:
        """Kill the worker and everything it started. In the sandbox (PID 1 of its own namespace)
        that is every other process there, daemons included; unsandboxed, the worker's session."""
        if self.isolated:
            assert os.getpid() == 1, "kill(-1) outside a PID namespace would kill the host's processes"
            try:
                os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:
                pass
        elif self.pid is not None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        while True:   # reap (PID 1 inherits every orphan)
            try:
                pid, _ = os.waitpid(-1, 0)
            except ChildProcessError:
                break
        self.pid = None

    def remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise Timeout()
        return left

    # ------------------------------------------------------------ check mode
    def read_exact(self, fd: int, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            ready, _, _ = select.select([fd], [], [], self.remaining())
            if not ready:
                raise Timeout()
            chunk = os.read(fd, min(n - len(out), 1 << 20))
            if not chunk:
                raise EOFError("the program's process ended")
            out += chunk
        return bytes(out)

    def rpc(self, msg: dict):
        data = wire.frame(msg)
        try:
            while data:
                select.select([], [self.req], [], self.remaining())
                data = data[os.write(self.req, data):]
            n = struct.unpack(">I", self.read_exact(self.resp, 4))[0]
            if n > wire.MAX_FRAME:
                raise EOFError("the program's process sent garbage")
            return wire.parse(self.read_exact(self.resp, n))
        except (BrokenPipeError, ValueError) as e:
            raise EOFError(f"the program's process ended or sent garbage ({type(e).__name__})") from None

    def remote(self, name: str):
        judge = self

        def call(*args, **kwargs):
            reply = judge.rpc({"call": name, "args": wire.encode(list(args)),
                               "kwargs": [[k, wire.encode(v)] for k, v in kwargs.items()]})
            if "ok" in reply:
                return wire.decode(reply["ok"])
            kind, msg = reply["error"]
            cls = getattr(builtins, str(kind), None)
            if isinstance(cls, type) and issubclass(cls, Exception):
                raise cls(msg)
            raise RemoteError(f"{kind}: {msg}")
        call.__name__ = name
        return call

    def run_check(self) -> dict:
        t = self.job["tests"]
        prefix, test, entry = t.get("prefix") or "", t["test"], t.get("entry_point")
        ns: dict = {"__name__": "__judge__", "__builtins__": builtins}
        trusted = _defined(prefix) | _defined(test)
        wanted = sorted((_free(prefix + "\n" + test) - trusted - set(dir(builtins))) | ({entry} if entry else set()))
        req_r, self.req = os.pipe()
        self.resp, resp_w = os.pipe()
        null = os.open(os.devnull, os.O_RDWR)
        src = self.worker_src
        self.spawn([self.job["python"], "-I", "-S", "-c", src], {0: null, 1: null, 2: null, 3: req_r, 4: resp_w})
        for fd in (req_r, resp_w, null):
            os.close(fd)
        try:
            hello = self.rpc({"program": self.job["program"], "names": wanted})
        except (Timeout, EOFError) as e:
            return _report(0, 1, "timeout" if isinstance(e, Timeout) else "crashed",
                           "the program did not finish loading" if isinstance(e, Timeout) else str(e))
        if not isinstance(hello, dict) or not isinstance(hello.get("names", {}), dict):
            return _report(0, 1, "crashed", "the program's process sent garbage")
        if "load_error" in hello:
            return _report(0, 1, "load_error", str(hello["load_error"])[:500])
        exec(compile(prefix, "<prompt>", "exec"), ns)
        names = hello.get("names", {})
        for name in wanted:   # only the names asked for: a program cannot replace a builtin or a prompt helper
            kind = names.get(name)
            if kind == "call":
                ns[name] = self.remote(name)
            elif isinstance(kind, list) and len(kind) == 2:
                ns[name] = wire.decode(kind[1])
        if entry and names.get(entry) != "call":
            return _report(0, 1, "missing", f"the program defines no function {entry!r}")
        try:
            exec(compile(test, "<test>", "exec"), ns)
            if "check" in ns:
                ns["check"](ns[entry] if entry else None)
        except Timeout:
            return _report(0, 1, "timeout", f"the tests did not finish in {self.job['timeout']}s")
        except EOFError as e:
            return _report(0, 1, "crashed", str(e))
        except Exception as e:   # noqa: BLE001 - a failed assert or a raised error: the test failed
            return _report(0, 1, "failed", f"{type(e).__name__}: {str(e)[:300]}")
        return _report(1, 1, "passed", "")

    # ------------------------------------------------------------ stdio mode
    def execute(self, program: str, stdin_text: str, *, merge_stderr: bool) -> tuple[int | None, bytes]:
        """Run the program as a script: (exit code, stdout), the code None when it printed more than
        max_output bytes (the output then ends there). With merge_stderr, stderr goes to the same pipe."""
        path = os.path.join(self.workdir, "program.py")
        with open(path, "w") as f:
            f.write(program)
        inp = os.path.join(self.workdir, "input.txt")
        with open(inp, "w") as f:
            f.write(stdin_text)
        stdin = os.open(inp, os.O_RDONLY)
        null = os.open(os.devnull, os.O_RDWR)
        out_r, out_w = os.pipe()
        self.spawn([self.job["python"], "-I", "-S", path], {0: stdin, 1: out_w, 2: out_w if merge_stderr else null})
        for fd in (stdin, null, out_w):
            os.close(fd)
        cap, out = int(self.job["max_output"]), bytearray()
        try:
            while True:
                ready, _, _ = select.select([out_r], [], [], self.remaining())
                if not ready:
                    raise Timeout()
                chunk = os.read(out_r, 1 << 16)
                if not chunk:
                    break
                out += chunk
                if len(out) > cap:
                    return None, bytes(out[:cap])
            while True:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    break
                time.sleep(0.002)
                self.remaining()
        finally:
            os.close(out_r)
        return os.waitstatus_to_exitcode(status), bytes(out)

    def run_case(self, program: str, case: dict) -> tuple[bool, str]:
        code, out = self.execute(program, str(case.get("input", "")), merge_stderr=False)
        if code is None:
            return False, f"printed more than {self.job['max_output']} bytes"
        if code != 0:
            return False, f"exit code {code}"
        if _lines(out.decode("utf-8", "replace")) != _lines(str(case.get("output", ""))):
            return False, "wrong output"
        return True, ""

    def run_stdio(self) -> dict:
        cases = self.job["tests"]["cases"]
        passed, detail, status = 0, "", "passed"
        for i, case in enumerate(cases):
            try:
                ok, why = self.run_case(self.job["program"], case)
            except Timeout:
                ok, why, status = False, f"no result in the {self.job['timeout']}s budget", "timeout"
            finally:
                self.kill_all()
            passed += ok
            if not ok and not detail:
                detail = f"case {i}: {why}"
            if status == "timeout":
                break
        if passed < len(cases) and status == "passed":
            status = "failed"
        return _report(passed, len(cases), status, detail)

    def run_output(self) -> dict:
        """`output` mode (the python tool): run the script once; the report's detail is what it printed
        (stdout and stderr together, at most max_output bytes); passed = it exited 0."""
        try:
            code, out = self.execute(self.job["program"], "", merge_stderr=True)
        except Timeout:
            return _report(0, 1, "timeout", f"no result in the {self.job['timeout']}s budget")
        text = out.decode("utf-8", "replace")
        if code is None:
            return _report(0, 1, "failed", text + f"\n[output cut at {self.job['max_output']} bytes]")
        return _report(int(code == 0), 1, "passed" if code == 0 else "failed", text)

    def run(self) -> dict:
        mode = self.job["tests"]["mode"]
        try:
            return self.run_stdio() if mode == "stdio" else self.run_output() if mode == "output" else self.run_check()
        finally:
            self.kill_all()
            for fd in (getattr(self, "req", None), getattr(self, "resp", None)):
                if fd is not None:
                    os.close(fd)


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.rstrip().splitlines()]


def _report(passed: int, total: int, status: str, detail: str) -> dict:
    return {"passed": passed, "total": total, "status": status, "detail": detail}


def _defined(code: str) -> set[str]:
    """Top-level names `code` binds (functions, classes, assignments, imports)."""
    out: set[str] = set()
    for node in ast.parse(code).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names}
        else:
            out |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return out


def _free(code: str) -> set[str]:
    """Every name `code` reads (a superset of its free names; the defined ones are taken out by the caller)."""
    return {n.id for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def worker_source() -> str:
    """The worker's program text (wire.py + worker.py), read before the grader enters the sandbox."""
    here = os.path.dirname(WORKER)
    with open(os.path.join(here, "wire.py")) as a, open(WORKER) as b:
        return a.read() + "\n" + b.read()


def _clear(path: str) -> None:
    """Empty the work dir between programs (iteratively: a program may nest dirs thousands deep)."""
    stack, dirs = [path], []
    while stack:
        d = stack.pop()
        os.chmod(d, 0o700)   # a program may leave a dir it made read-only
        dirs.append(d)
        with os.scandir(d) as it:
            for entry in it:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                else:
                    os.unlink(entry.path)
    for d in reversed(dirs[1:]):
        os.rmdir(d)


def main(batch: dict, isolated: bool, worker_src: str, report_fd: int) -> None:
    """Grade batch["programs"] one after another; one JSON line per program on `report_fd` as it
    finishes. Between programs every process the last one left is killed and the work dir is emptied;
    when it cannot be emptied the grader stops, and the host runs the rest in a fresh sandbox. (In the
    sandbox, launch.py judges each program in namespaces of its own instead: see isolate.confine.)"""
    limits = {k: v for k, v in batch.items() if k != "programs"}
    for i, item in enumerate(batch["programs"]):
        try:
            report = Grader({**limits, **item}, worker_src, isolated).run()
        except Exception as e:  # noqa: BLE001 - a malformed test is this program's error, not the batch's
            report = _report(0, 1, "error", f"the grader failed: {type(e).__name__}: {str(e)[:300]}")
        os.write(report_fd, (json.dumps({"i": i, "report": report}) + "\n").encode())
        try:
            _clear(batch["workdir"])
        except (OSError, RecursionError):
            return
