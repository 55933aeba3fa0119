"""Enter a sandbox: new user, mount, PID, network, IPC and UTS namespaces, a read-only root; and
confine each program in PID, IPC and mount namespaces of its own inside it.

Runs in the launcher process (`launch.py`, a fresh single-threaded interpreter), standard library
only. `enter(...)` returns in the sandbox's init process (PID 1 of a new PID namespace) and never in
the two processes above it, which wait and exit with its status:

    launcher P (host)  -- writes C's uid/gid maps (root on the host maps the sandbox to 'nobody')
      C  unshare(user, mnt, pid, net, ipc, uts)
        G  PID 1: builds the new root, pivots into it, forbids nested user namespaces -> returns
          J  per program (`confine`): unshare(pid, ipc, mnt)
            J' PID 1 of the program's namespaces: its own /tmp, /proc, IPC ceilings; drops every
               capability, seccomp -> returns, and judges the program

What a program sees: /usr, /bin, /lib*, /etc and the Python installation, read-only; a fresh /proc
(its /proc/sys read-only); a /dev with null, zero, full, random, urandom (no /dev/shm: POSIX shared
memory is not available); a private tmpfs at /tmp capped in size and in inodes (the only writable
place). Nothing else of the host (no home, no project, no run directory, no network: the new
network namespace has only a loopback that is down), nothing of another program (G, which keeps
its capabilities to confine the next program, is outside the program's PID namespace).

Memory a program can pin outside its RLIMIT_AS is capped: SysV shared memory, message queues and
semaphores of its private IPC namespace (kernel.shm*, msg*, sem) and its POSIX message queues
(fs.mqueue.*), set from inside before privileges are dropped and then frozen (/proc/sys read-only,
no nested user namespaces: a new IPC namespace would come with the kernel's unlimited defaults);
its IPC namespace and its /tmp are freed when it ends. A seccomp filter denies memfd_create
(anonymous files, capped by nothing but RLIMIT_FSIZE per file), and on kernels that do not let a
namespace's owner set its IPC limits (before 5.19), the IPC calls themselves. When G exits the
kernel kills every process left in the sandbox, daemons included; C and G also die with their
parent (PR_SET_PDEATHSIG), so killing P's process group from the host tears the whole tree down.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 32, 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 1, 4, 24, 38, 47
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(os.uname().machine)   # (not `platform`: slow to import)
NOBODY = 65534
# statvfs flag -> mount flag: a bind remount must keep the flags the host mount has (they are locked)
_KEEP = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
         (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME))
DEVICES = ("null", "zero", "full", "random", "urandom")
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32", "/etc")

_libc = ctypes.CDLL(None, use_errno=True)


class IsolationError(OSError):
    pass


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise IsolationError(err, f"{what}: {os.strerror(err)}")


def _mount(src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {src or fstype or ''} on {target}")


def _prctl(option: int, arg: int, arg3: int = 0) -> int:
    return _libc.prctl(option, ctypes.c_ulong(arg), ctypes.c_ulong(arg3), ctypes.c_ulong(0), ctypes.c_ulong(0))


def die_with_parent(parent: int | None) -> None:
    """SIGKILL when the parent exits. (A parent outside our PID namespace reads as 0 there: then
    only the prctl; the host's kill of the launcher's process group covers the race.)"""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent is not None and os.getppid() != parent:   # the parent died before the prctl took effect
        os._exit(137)


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _bind_ro(src: str, dst: str) -> None:
    """Bind `src` (and the mounts under it) at `dst`, then make each of those mounts read-only."""
    _mount(src, dst, None, MS_BIND | MS_REC)
    with open("/proc/self/mountinfo") as f:
        points = [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4]) for line in f]
    for p in sorted(m for m in points if m == dst or m.startswith(dst.rstrip("/") + "/")):
        try:
            st = os.statvfs(p)
        except OSError:
            continue
        keep = 0
        for st_flag, ms_flag in _KEEP:
            if st.f_flag & st_flag:
                keep |= ms_flag
        _mount(None, p, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)


def _mkdirs(path: str) -> None:
    os.makedirs(path, exist_ok=True)


def open_sources(extra_dirs: list[str]) -> list[tuple[str, int | str]]:
    """(path, O_PATH fd or symlink target) of each dir to show, opened by the launcher: the sandbox's
    own user may not be allowed to walk to them (a Python under /root, when the host user is root)."""
    out: list[tuple[str, int | str]] = []
    for d in list(SYSTEM_DIRS) + extra_dirs:
        if any(d == p or d.startswith(p.rstrip("/") + "/") for p, _ in out):
            continue   # already shown through a parent
        if os.path.islink(d):   # merged-/usr systems: /bin -> usr/bin
            out.append((d, os.readlink(d)))
        elif os.path.isdir(d):
            out.append((d, os.open(d, os.O_PATH | os.O_DIRECTORY)))
    return out


def _build_root(base: str, sources: list[tuple[str, int | str]]) -> None:
    """The new root at `base` (a tmpfs): system dirs read-only, /dev, /proc, an empty /tmp."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)   # nothing we mount here propagates to the host
    _mount("tmpfs", base, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=4m,nr_inodes=1024")
    for d, src in sources:
        if isinstance(src, str):
            _mkdirs(os.path.dirname(base + d))
            os.symlink(src, base + d)
        else:
            _mkdirs(base + d)
            _bind_ro(f"/proc/self/fd/{src}", base + d)
            os.close(src)
    dev = base + "/dev"
    _mkdirs(dev)
    _mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k,nr_inodes=64")
    for name in DEVICES:
        open(f"{dev}/{name}", "w").close()
        _mount(f"/dev/{name}", f"{dev}/{name}", None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{dev}/{name}")
    _mount(None, dev, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NOEXEC)
    _mkdirs(base + "/proc")
    _mount("proc", base + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _mkdirs(base + "/tmp")   # each program gets its own tmpfs here (see confine)
    # into the new root; the old one is detached, so no path leads back to the host's files
    os.chdir(base)
    if SYS_PIVOT_ROOT is not None:
        _check(_libc.syscall(SYS_PIVOT_ROOT, b".", b"."), "pivot_root")
        _check(_libc.umount2(b".", MNT_DETACH), "umount old root")
    else:   # other architectures: chroot (no escape without CAP_SYS_CHROOT, dropped below)
        os.chroot(".")
    os.chdir("/")
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def ipc_ceilings(shm_mb: int) -> dict[str, str]:
    """/proc/sys path -> value: the ceilings of a program's IPC namespace. SysV shared memory in all:
    shm_mb (shmall counts pages); message queues: 16 of 16 KiB; semaphores: 32 sets of 32; POSIX
    message queues: 4 of 10 x 8 KiB (and RLIMIT_MSGQUEUE in the grader)."""
    page = os.sysconf("SC_PAGE_SIZE")
    out = {"kernel/shmmax": shm_mb << 20, "kernel/shmall": (shm_mb << 20) // page, "kernel/shmmni": 32,
           "kernel/msgmni": 16, "kernel/msgmax": 8192, "kernel/msgmnb": 16384, "kernel/sem": "32\t1024\t32\t32",
           "fs/mqueue/queues_max": 4, "fs/mqueue/msg_max": 10, "fs/mqueue/msgsize_max": 8192}
    return {k: str(v) for k, v in out.items()}


# no nested user namespaces (a new IPC namespace would come with the kernel's unlimited defaults), nor
# namespaces the sandbox never makes; PID, IPC and mount namespaces stay allowed for `confine` (a program,
# with no capabilities, cannot make those without a user namespace of its own)
USER_CEILINGS = {f"user/max_{kind}_namespaces": "0" for kind in ("user", "net", "uts", "cgroup", "time")}


def _set_sysctls(values: dict[str, str]) -> bool:
    """Write each /proc/sys value and check it took; False when the kernel refuses one (EACCES/EPERM)."""
    ok = True
    for key, value in values.items():
        path = "/proc/sys/" + key
        if not os.path.exists(path):   # a kernel without this object (or namespace kind): nothing to cap
            continue
        try:
            _write(path, value)
            with open(path) as f:
                got = f.read().split()
        except PermissionError:
            ok = False
            continue
        if got != value.split():
            raise IsolationError(1, f"setting {key.replace('/', '.')} in the sandbox: wanted {value}, "
                                    f"got {' '.join(got)}")
    return ok


def cap_kernel_objects(shm_mb: int) -> bool:
    """Set `ipc_ceilings` in this (new) IPC namespace, then make /proc/sys read-only: the ipc sysctls
    are writable by the namespace's root user (which the program is, with no capabilities), so the
    read-only mount is what keeps the program from raising them again. False when the kernel does
    not let a namespace's owner set its IPC limits (before Linux 5.19): the caller then denies the
    IPC calls themselves (`deny_syscalls`)."""
    capped = _set_sysctls(ipc_ceilings(shm_mb))
    _mount("/proc/sys", "/proc/sys", None, MS_BIND | MS_REC)
    _mount(None, "/proc/sys", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    return capped


# seccomp: (audit arch, syscall numbers) per machine; a denied call fails with EPERM
SECCOMP_ARCH = {
    "x86_64": (0xC000003E, {"memfd_create": 319, "memfd_secret": 447, "shmget": 29, "msgget": 68, "semget": 64,
                            "mq_open": 240}),
    "aarch64": (0xC00000B7, {"memfd_create": 279, "memfd_secret": 447, "shmget": 194, "msgget": 186, "semget": 190,
                             "mq_open": 180}),
}
# anonymous files: memory outside RLIMIT_AS that no namespace caps (64 fds x file_mb each, per process)
ALWAYS_DENIED = ("memfd_create", "memfd_secret")
IPC_CALLS = ("shmget", "msgget", "semget", "mq_open")   # denied too where their limits cannot be set
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
_BPF_LD_ABS, _BPF_JEQ, _BPF_JGE, _BPF_RET = 0x20, 0x15, 0x35, 0x06
_RET_ALLOW, _RET_EPERM = 0x7FFF0000, 0x00050000 | 1


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


def deny_syscalls(names: tuple[str, ...]) -> None:
    """A seccomp filter (this process and everything it starts; needs no_new_privs): `names` fail with
    EPERM, and so does every syscall of another ABI (32-bit, x32), whose numbers the filter does not know."""
    machine = os.uname().machine
    if machine not in SECCOMP_ARCH:
        if set(names) - set(ALWAYS_DENIED):
            raise IsolationError(1, f"cannot cap IPC memory on {machine}: no namespaced limits and no seccomp table")
        return   # memfd stays open here (documented)
    audit, numbers = SECCOMP_ARCH[machine]
    ins = [(_BPF_LD_ABS, 0, 0, 4), (_BPF_JEQ, 1, 0, audit), (_BPF_RET, 0, 0, _RET_EPERM), (_BPF_LD_ABS, 0, 0, 0)]
    checks = ([(_BPF_JGE, 0x40000000)] if machine == "x86_64" else []) + [(_BPF_JEQ, numbers[n]) for n in names]
    deny = len(ins) + len(checks) + 1   # index of the final EPERM, after the ALLOW
    for code, k in checks:
        ins.append((code, deny - (len(ins) + 1), 0, k))
    ins += [(_BPF_RET, 0, 0, _RET_ALLOW), (_BPF_RET, 0, 0, _RET_EPERM)]
    prog = (_SockFilter * len(ins))(*[_SockFilter(*i) for i in ins])
    fprog = _SockFprog(len(ins), prog)
    _check(_prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog)), "seccomp")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_privileges() -> None:
    """No capabilities now or after any exec, no way to gain them (no_new_privs), and not
    dumpable: a sandboxed program can neither ptrace this process nor read its /proc memory or fds."""
    for cap in range(64):
        if _prctl(PR_CAPBSET_DROP, cap) != 0 and ctypes.get_errno() == 22:   # EINVAL: past the last cap
            break
    _prctl(PR_CAP_AMBIENT, 4)   # PR_CAP_AMBIENT_CLEAR_ALL
    data = (_CapData * 2)()
    _check(_libc.capset(ctypes.byref(_CapHeader(0x20080522, 0)), data), "capset")
    _check(_prctl(PR_SET_NO_NEW_PRIVS, 1), "no_new_privs")
    _prctl(PR_SET_DUMPABLE, 0)


def _fail(fd: int, msg: str) -> None:
    os.write(fd, ("ISOLATION " + msg.replace("\n", " ") + "\n").encode())
    os._exit(71)


def _wait_and_exit(pid: int) -> None:
    _, status = os.waitpid(pid, 0)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


def enter(base: str, extra_dirs: list[str], report_fd: int = 1) -> None:
    """Become PID 1 of a fresh sandbox rooted at a new tmpfs mounted on `base` (an empty dir).

    Returns only in that process, which keeps its capabilities inside the sandbox's user namespace
    (to `confine` each program) and must run nothing of a program's. A failure to set up writes one
    line 'ISOLATION <reason>' to `report_fd` and exits 71."""
    launcher = os.getpid()
    ready_r, ready_w = os.pipe()
    maps_r, maps_w = os.pipe()
    child = os.fork()
    if child:   # P: map the child's root to an unprivileged host user, then wait
        os.close(ready_w)
        os.close(maps_r)
        if os.read(ready_r, 1) != b"1":
            _wait_and_exit(child)
        uid, gid = (NOBODY, NOBODY) if os.geteuid() == 0 else (os.geteuid(), os.getegid())
        try:
            _write(f"/proc/{child}/setgroups", "deny")
            _write(f"/proc/{child}/uid_map", f"0 {uid} 1\n")
            _write(f"/proc/{child}/gid_map", f"0 {gid} 1\n")
            os.write(maps_w, b"1")
        except OSError as e:
            os.kill(child, signal.SIGKILL)
            _fail(report_fd, f"writing the sandbox's uid map: {e}")
        _wait_and_exit(child)
    # C
    os.close(ready_r)
    os.close(maps_w)
    die_with_parent(launcher)
    try:
        _check(_libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC
                             | CLONE_NEWUTS), "unshare")
    except IsolationError as e:
        os.write(ready_w, b"0")
        _fail(report_fd, str(e))
    os.write(ready_w, b"1")
    if os.read(maps_r, 1) != b"1":
        os._exit(71)
    # opened as the host user still (the sandbox's own user may not reach a Python under /root), and
    # after unshare: a bind mount's source must be in our mount namespace
    sources = open_sources(extra_dirs)
    try:   # become the namespace's root (the mapped host user): files we create need a mapped owner
        os.setresgid(0, 0, 0)
        os.setresuid(0, 0, 0)
    except OSError as e:
        _fail(report_fd, f"switching to the sandbox's user: {e}")
    die_with_parent(launcher)   # again: unshare and setresuid changed our credentials, which clears it
    init = os.fork()
    if init:
        _wait_and_exit(init)
    # G: PID 1 of the new namespace
    die_with_parent(None)
    try:
        _build_root(base, sources)
        if not _set_sysctls(USER_CEILINGS):
            raise IsolationError(1, "cannot forbid nested user namespaces (user.max_user_namespaces)")
        _check(_prctl(PR_SET_NO_NEW_PRIVS, 1), "no_new_privs")
        _prctl(PR_SET_DUMPABLE, 0)   # no process of a program can ptrace or read this one
    except Exception as e:  # noqa: BLE001 - any failure to isolate is reported, never run unisolated
        _fail(report_fd, f"{type(e).__name__}: {e}")
    # PID 1 ignores signals it has no handler for; keep it that way for the ones Python handles
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update({"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8",
                       "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"})
    sys.path[:] = [p for p in sys.path if os.path.isdir(p)]


def confine(report_fd: int, tmp_mb: int, tmp_inodes: int, shm_mb: int) -> int:
    """Fork, as os.fork does: the caller (the sandbox's PID 1, privileged in its namespace) gets the
    child's pid and waits for it; the child returns 0 as PID 1 of namespaces of its own (PID, IPC,
    mount) inside the sandbox: a fresh /tmp (tmpfs, tmp_mb and tmp_inodes), a fresh /proc with
    /proc/sys read-only, the IPC ceilings set (`cap_kernel_objects`), every capability dropped, the
    seccomp filter on. So a program's processes, files, shared memory and queues all end with it, and
    the next program starts from nothing, for the cost of a fork (not a new sandbox). A failure writes
    'ISOLATION <reason>' to `report_fd` and exits 71."""
    pid = os.fork()
    if pid:
        return pid
    try:   # the intermediate child: the new PID namespace holds only the children it forks
        _check(_libc.unshare(CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWNS), "unshare (the program's namespaces)")
    except IsolationError as e:
        _fail(report_fd, str(e))
    init = os.fork()
    if init:
        _wait_and_exit(init)   # its exit frees the mount and IPC namespaces: inside the caller's wait
    try:
        # inodes capped too: each costs kernel memory outside `size` (1M empty dirs: ~820 MB, and seconds to free)
        _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
               f"mode=1777,size={tmp_mb}m,nr_inodes={max(16, tmp_inodes)}")
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)   # this PID namespace's
        ipc_capped = cap_kernel_objects(shm_mb)
        drop_privileges()
        deny_syscalls(ALWAYS_DENIED + (() if ipc_capped else IPC_CALLS))
    except Exception as e:  # noqa: BLE001 - any failure to isolate is reported, never run unisolated
        _fail(report_fd, f"{type(e).__name__}: {e}")
    return 0
