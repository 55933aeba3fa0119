"""The sandbox against programs that pin memory outside RLIMIT_AS or reach the next program through
the kernel: SysV shared memory and message queues, /tmp inodes, nested namespaces (issue 34).

Each hostile program's success would RAISE its score; the host's shared memory (`Shmem:` in
/proc/meminfo) is sampled from a thread while the programs run, so a pass means the memory never
left the sandbox's ceiling, not only that the program failed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from grpolab.rewards.code import code_exec
from grpolab.rewards.runtime import RewardRuntime
from grpolab.sandbox import Limits, run_batch, run_program
from grpolab.sandbox.isolate import ipc_ceilings

MB = 1 << 20
SLACK_MB = 48   # other processes on the host may move Shmem a little while a test runs; the hole moved it by GBs

# ctypes prelude of every hostile program: the SysV calls the reproduction used
SYSV = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
libc.shmdt.argtypes = [ctypes.c_void_p]
IPC_CREAT, IPC_PRIVATE = 0o1000, 0
"""

# pins as much SysV shared memory as it can: 128 MB segments as in the issue, then smaller ones;
# memset so the pages are real; detached and never removed (IPC_RMID), so they outlive the process
SHM_BOMB = SYSV + """
import time
def f():
    pinned = 0
    for size in (128 << 20, 8 << 20, 1 << 20):
        while pinned < (1 << 30):   # 1 GB is plenty to show the hole (the issue saw 3-6 GB)
            seg = libc.shmget(IPC_PRIVATE, ctypes.c_size_t(size), IPC_CREAT | 0o600)
            if seg < 0:
                break
            addr = libc.shmat(seg, None, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                break
            ctypes.memset(addr, 1, size)
            libc.shmdt(ctypes.c_void_p(addr))
            pinned += size
    time.sleep(0.3)   # hold it while the host samples
    return pinned >> 20
"""
WANTS_GB = "def check(candidate):\n    got = candidate()\n    assert got >= 1024, got\n"   # the attack's success passes


def _shmem_kb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1])
    raise AssertionError("no Shmem line in /proc/meminfo")


class ShmemPeak:
    """The host's Shmem, sampled every 10 ms in a thread while the block runs: rise = peak - before (MB)."""

    def __enter__(self):
        self.before = _shmem_kb()
        self.peak, self.samples, self._done = self.before, 0, threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, _shmem_kb())
            self.samples += 1
            time.sleep(0.01)

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()
        self.after = _shmem_kb()

    @property
    def rise_mb(self) -> float:
        return (self.peak - self.before) / 1024


def _mb_pinned(detail: str) -> int:
    assert detail.startswith("AssertionError: "), detail
    return int(detail.split(": ", 1)[1])


def test_sysv_shm_bomb_stays_within_shm_mb_on_the_host():
    limits = Limits(timeout=5.0, memory_mb=256)
    with ShmemPeak() as host:
        v = run_program(SHM_BOMB, {"mode": "check", "test": WANTS_GB, "entry_point": "f"}, limits)
    assert v.status == "failed", v
    pinned = _mb_pinned(v.detail)
    assert 0 < pinned <= limits.shm_mb   # shared memory works in the sandbox, up to its ceiling
    assert host.samples >= 20 and host.rise_mb < limits.shm_mb + SLACK_MB, (host.rise_mb, pinned)
    assert (host.after - host.before) / 1024 < SLACK_MB   # and it is freed with the sandbox


@pytest.mark.slow
def test_the_code_exec_reward_keeps_a_batch_of_shm_bombs_bounded():
    """The issue's reproduction: 8 programs through the code_exec reward, memory_mb=256,
    max_concurrent=1 (one after another, so any segment left behind would add up)."""
    runtime = RewardRuntime(limits=Limits(timeout=5.0, memory_mb=256), max_concurrent=1)
    with ShmemPeak() as host:
        got = code_exec(None, ["```python\n" + SHM_BOMB + "```"] * 8, test=WANTS_GB, entry_point="f",
                        runtime=runtime)
    assert got == [0.0] * 8
    assert host.rise_mb < Limits().shm_mb + SLACK_MB, host.rise_mb   # not 8 x 16 MB: each one's is freed
    assert (host.after - host.before) / 1024 < SLACK_MB


# A leaves a SysV segment, a message queue and a /tmp file behind, under keys B knows; B reports what it finds
KEY = 0x67727031
LEAVER = SYSV + f"""
def f():
    seg = libc.shmget({KEY}, 4096, IPC_CREAT | 0o666)
    addr = libc.shmat(seg, None, 0)
    ctypes.memmove(addr, b"from-A", 6)
    libc.shmdt(ctypes.c_void_p(addr))
    q = libc.msgget({KEY}, IPC_CREAT | 0o666)
    msg = ctypes.create_string_buffer(ctypes.sizeof(ctypes.c_long) + 6)
    ctypes.memmove(ctypes.addressof(msg), ctypes.byref(ctypes.c_long(1)), ctypes.sizeof(ctypes.c_long))
    ctypes.memmove(ctypes.addressof(msg) + ctypes.sizeof(ctypes.c_long), b"from-A", 6)
    sent = libc.msgsnd(q, msg, 6, 0)
    open("/tmp/from-A", "w").write("from-A")
    return int(seg >= 0 and q >= 0 and sent == 0)
"""
READER = SYSV + f"""
def f():
    found = []
    seg = libc.shmget({KEY}, 0, 0)
    if seg >= 0:
        addr = libc.shmat(seg, None, 0)
        found.append(ctypes.string_at(addr, 6).decode())
    q = libc.msgget({KEY}, 0)
    if q >= 0:
        buf = ctypes.create_string_buffer(64)
        n = libc.msgrcv(q, buf, 32, 0, 0o4000)   # IPC_NOWAIT
        found.append(buf.raw[ctypes.sizeof(ctypes.c_long):ctypes.sizeof(ctypes.c_long) + max(n, 0)].decode())
    if os.path.exists("/tmp/from-A"):
        found.append(open("/tmp/from-A").read())
    return found
"""


def test_a_program_cannot_reach_what_the_previous_one_left():
    leaver = {"mode": "check", "test": "def check(c):\n    assert c() == 1\n", "entry_point": "f"}
    reader = {"mode": "check", "test": "def check(c):\n    got = c()\n    assert 'from-A' in got, got\n",
              "entry_point": "f"}
    a, b = run_batch([(LEAVER, leaver), (READER, reader)], Limits(timeout=5.0))
    assert a.status == "passed", a   # A did leave all three
    assert b.status == "failed" and b.detail == "AssertionError: []", b
    # the reader does find them when they are in its own sandbox: the probe can see what it looks for
    both = LEAVER.replace("def f():", "def leave():") + READER.replace(SYSV, "") + "\nleave()\n"
    (c,) = run_batch([(both, reader)], Limits(timeout=5.0))
    assert c.status == "passed", c


def test_the_ceilings_cannot_be_raised_from_inside():
    """The program is its namespace's root user (with no capabilities): /proc/sys is read-only to it, and it
    cannot make a nested user namespace (whose new IPC namespace would have the kernel's unlimited defaults)."""
    probe = SYSV + """
def f():
    out = {"shmall": open("/proc/sys/kernel/shmall").read().split()}
    out["all"] = {k: open("/proc/sys/" + k).read().split() for k in KEYS}   # as the program sees them
    try:
        with open("/proc/sys/kernel/shmall", "w") as sysctl:
            sysctl.write("99999999")
        out["write"] = "ok"
    except OSError as e:
        out["write"] = e.errno
    out["unshare"] = libc.unshare(0x10000000 | 0x08000000)   # CLONE_NEWUSER | CLONE_NEWIPC
    return out
"""
    ceilings = {k: v.split() for k, v in ipc_ceilings(Limits().shm_mb).items() if os.path.exists("/proc/sys/" + k)}
    want = {"shmall": [str((Limits().shm_mb * MB) // os.sysconf("SC_PAGE_SIZE"))], "all": ceilings, "write": 30,
            "unshare": -1}
    test = f"def check(c):\n    got = c()\n    assert got == {want!r}, got\n"
    v = run_program(f"KEYS = {sorted(ceilings)!r}\n" + probe, {"mode": "check", "test": test, "entry_point": "f"},
                    Limits(timeout=5.0))
    assert v.status == "passed", v   # 30: EROFS


INODE_BOMB = """
import os
def f():
    made = 0
    try:
        while made < 1_000_000:
            os.mkdir("/tmp/d%d" % made)
            made += 1
    except OSError:
        pass
    return made
"""
INODE_BOMB_FOREVER = """
import os
def f():
    i = 0
    while True:   # keeps trying past the ceiling, until the timeout
        try:
            os.mkdir("/tmp/d%d" % i)
        except OSError:
            pass
        i += 1
"""


def test_an_inode_bomb_in_tmp_is_stopped_at_tmp_inodes():
    limits = Limits(timeout=5.0)
    t0 = time.monotonic()
    v = run_program(INODE_BOMB, {"mode": "check", "test": "def check(c):\n    n = c()\n    assert n >= 1_000_000, n\n",
                                 "entry_point": "f"}, limits)
    assert v.status == "failed", v
    assert 0 < int(v.detail.split(": ", 1)[1]) <= limits.tmp_inodes, v
    assert time.monotonic() - t0 < limits.timeout


@pytest.mark.slow
def test_a_program_that_keeps_bombing_returns_within_its_timeout_and_teardown():
    limits = Limits(timeout=2.0)
    t0 = time.monotonic()
    v = run_program(INODE_BOMB_FOREVER, {"mode": "check", "test": "def check(c):\n    c()\n", "entry_point": "f"},
                    limits)
    wall = time.monotonic() - t0
    assert v.status == "timeout", v
    assert wall < limits.timeout + 2.0, wall   # set-up and teardown (its /tmp freed) included, well inside GRACE


@pytest.mark.parametrize("shm_mb", [0, 4])
def test_shm_mb_is_the_ceiling(shm_mb):
    v = run_program(SHM_BOMB, {"mode": "check", "test": WANTS_GB, "entry_point": "f"},
                    Limits(timeout=5.0, shm_mb=shm_mb))
    assert v.status == "failed" and _mb_pinned(v.detail) == shm_mb, v


MEMFD_BOMB = """
import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
def f():
    fds, pinned = [], 0
    while pinned < (1 << 30):   # 16 MB (file_mb) per anonymous file, 60 files: ~1 GB outside RLIMIT_AS
        try:
            fd = os.memfd_create("x")
        except OSError as e:
            return [e.errno, pinned >> 20]
        if libc.fallocate(fd, 1, ctypes.c_long(0), ctypes.c_long(16 << 20)) != 0:   # FALLOC_FL_KEEP_SIZE
            return [ctypes.get_errno(), pinned >> 20]
        fds.append(fd)
        pinned += 16 << 20
        if len(fds) >= 60:
            break
    time.sleep(0.3)
    return [0, pinned >> 20]
"""


def test_memfd_files_are_denied():
    limits = Limits(timeout=5.0, memory_mb=256)
    test = "def check(c):\n    got = c()\n    assert got[1] >= 512, got\n"
    with ShmemPeak() as host:
        v = run_program(MEMFD_BOMB, {"mode": "check", "test": test, "entry_point": "f"}, limits)
    assert v.status == "failed" and v.detail == "AssertionError: [1, 0]", v   # EPERM at the first memfd_create
    assert host.rise_mb < SLACK_MB, host.rise_mb


DENY_IN_A_CHILD = """
import ctypes, os, sys
from grpolab.sandbox import isolate
assert isolate._prctl(isolate.PR_SET_NO_NEW_PRIVS, 1) == 0
isolate.deny_syscalls(tuple(sys.argv[1:]))
libc = ctypes.CDLL(None, use_errno=True)
shm = libc.shmget(0, 4096, 0o1600)
print(shm if shm < 0 else "made", ctypes.get_errno() if shm < 0 else 0)
if shm >= 0:
    libc.shmctl(shm, 0, None)   # IPC_RMID: this child is in the host's IPC namespace
try:
    os.close(os.memfd_create("x"))
    print("memfd ok")
except OSError as e:
    print("memfd", e.errno)
"""


@pytest.mark.skipif(os.uname().machine not in ("x86_64", "aarch64"), reason="seccomp table for x86_64 and aarch64")
def test_the_seccomp_fallback_denies_the_ipc_calls():
    """Where the kernel does not let the sandbox set its IPC limits (before 5.19) the IPC calls are denied
    instead: the filter itself, in a real child process (this kernel takes the limits, so the sandbox
    does not need the fallback here)."""
    def run(*names: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", DENY_IN_A_CHILD, *names], capture_output=True, text=True,
                              timeout=30)

    both = run("memfd_create", "memfd_secret", "shmget", "msgget", "semget", "mq_open")
    assert both.returncode == 0, both.stderr
    assert both.stdout.split("\n")[:2] == ["-1 1", "memfd 1"]   # EPERM, EPERM
    memfd_only = run("memfd_create")
    assert memfd_only.stdout.split("\n")[:2] == ["made 0", "memfd 1"], memfd_only.stderr


def test_no_process_a_program_can_see_holds_a_capability():
    """The sandbox's PID 1 keeps its capabilities (inside the sandbox's user namespace) to confine each
    program; it must be out of every program's sight and reach: the program sees only its own PID
    namespace, where every process (its judge included) has none."""
    probe = """
import os
def f():
    caps = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open("/proc/%s/status" % p) as st:
                    caps[int(p)] = [l.split()[1] for l in st if l.startswith(("CapEff", "CapPrm"))]
            except OSError:
                pass
    return sorted(caps.items())
"""
    test = ("def check(c):\n    got = c()\n    assert len(got) >= 2 and got[0][0] == 1, got\n"
            "    assert all(v == ['0000000000000000'] * 2 for _, v in got), got\n")
    v = run_program(probe, {"mode": "check", "test": test, "entry_point": "f"}, Limits(timeout=5.0))
    assert v.status == "passed", v
