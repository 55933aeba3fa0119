"""Sandbox entry point, run by the host as `python -I -S launch.py HOST_PID` with a JSON batch on stdin.

A fresh interpreter, standard library only, single-threaded (as unshare(CLONE_NEWUSER) needs).
It reads the batch and the worker's source, enters the sandbox (unless the batch says not to) and
runs the grader, whose reports (one JSON line per program) are the only thing written to stdout.
It dies with the host process (PR_SET_PDEATHSIG), and the sandbox with it.
"""

import json
import os
import resource
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import grader  # noqa: E402
import isolate  # noqa: E402

JUDGE_MEMORY = 2 << 30


def grade_each_confined(job: dict, worker: str, report_fd: int) -> None:
    """In the sandbox's PID 1: each program judged by a child confined in namespaces of its own
    (isolate.confine), one after another; its report comes back over a pipe and goes out under its
    index. A child that gives none (the grader died) gets 'error'; the next program is unaffected."""
    limits = {k: v for k, v in job.items() if k != "programs"}
    for i, item in enumerate(job["programs"]):
        r, w = os.pipe()
        pid = isolate.confine(w, job["tmp_mb"], job["tmp_inodes"], job["shm_mb"])
        if pid == 0:   # the program's grader, confined
            os.close(r)
            os.close(report_fd)
            try:
                report = grader.Grader({**limits, **item}, worker, True).run()
            except Exception as e:  # noqa: BLE001 - a malformed test is this program's error, not the batch's
                report = grader._report(0, 1, "error", f"the grader failed: {type(e).__name__}: {str(e)[:300]}")
            data = json.dumps(report).encode()
            while data:
                data = data[os.write(w, data):]
            os._exit(0)
        os.close(w)
        chunks = []
        while True:
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
        os.close(r)
        _, status = os.waitpid(pid, 0)   # the child's namespaces (its /tmp, its IPC objects) end with it
        data = b"".join(chunks)
        if data.startswith(b"ISOLATION "):   # the program could not be confined: never judged unconfined
            os.write(report_fd, data.split(b"\n")[0] + b"\n")
            return
        try:
            report = json.loads(data)
            if not isinstance(report, dict) or set(report) != {"passed", "total", "status", "detail"}:
                raise ValueError(report)
        except ValueError:
            code = os.waitstatus_to_exitcode(status)
            report = grader._report(0, 1, "error", f"the grader gave no report (exit status {code})")
        os.write(report_fd, (json.dumps({"i": i, "report": report}) + "\n").encode())


def main() -> None:
    isolate.die_with_parent(int(sys.argv[1]))   # the trainer dies -> this launcher, then the sandbox under it
    job = json.loads(sys.stdin.buffer.read())
    worker = grader.worker_source()
    sys.stdin.close()
    os.close(0)
    os.open(os.devnull, os.O_RDONLY)   # fd 0 again, /dev/null
    if job["isolate"]:   # this process becomes the sandbox's PID 1 (see isolate)
        isolate.enter(job["base"], job["show"])
        job["workdir"] = "/tmp"
    else:
        job["workdir"] = job["base"]
    # the reports' channel: a private copy of stdout; fd 1 becomes /dev/null, so a test that prints
    # cannot write a report line
    report = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    # the grader's own memory is bounded too (it decodes what the program sends); soft limit only, so
    # the worker can still be given reward.code_exec.memory_mb
    limit = max(JUDGE_MEMORY, (job["memory_mb"] + 1024) << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    if job["isolate"]:
        grade_each_confined(job, worker, report)
    else:   # one after another in the host's work dir, emptied between two (see grader.main)
        grader.main(job, False, worker, report)


if __name__ == "__main__":
    main()
