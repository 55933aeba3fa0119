"""Sandbox entry point, run by the host as `python -I -S launch.py HOST_PID` with a JSON batch on stdin.

A fresh interpreter, standard library only, single-threaded (as unshare(CLONE_NEWUSER) needs).
It reads the batch and the worker's source, enters the sandbox (unless the batch says not to) and
runs the judge, whose reports (one JSON line per program) are the only thing written to stdout.
It dies with the host process (PR_SET_PDEATHSIG), and the sandbox with it.
"""

import json
import os
import resource
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import isolate  # noqa: E402
import judge  # noqa: E402

JUDGE_MEMORY = 2 << 30


def main() -> None:
    isolate.die_with_parent(int(sys.argv[1]))   # the trainer dies -> this launcher, then the sandbox under it
    job = json.loads(sys.stdin.buffer.read())
    worker = judge.worker_source()
    sys.stdin.close()
    os.close(0)
    os.open(os.devnull, os.O_RDONLY)   # fd 0 again, /dev/null
    # one sandbox judges a batch of programs in turn (see judge.main)
    if job["isolate"]:
        isolate.enter(job["base"], job["show"], job["tmp_mb"])
        job["workdir"] = "/tmp"
    else:
        job["workdir"] = job["base"]
    # the reports' channel: a private copy of stdout; fd 1 becomes /dev/null, so a test that prints
    # cannot write a report line
    report = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    # the judge's own memory is bounded too (it decodes what the program sends); soft limit only, so
    # the worker can still be given reward.code_exec.memory_mb
    limit = max(JUDGE_MEMORY, (job["memory_mb"] + 1024) << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    judge.main(job, job["isolate"], worker, report)


if __name__ == "__main__":
    main()
