"""Run untrusted Python (model-written programs) with a hard boundary: see `isolate` (namespaces,
read-only root, no network), `grader` (tests run outside the program's process) and `runner`
(the host side: sandboxes judging batches of programs in parallel, bounded by the timeout)."""

from .runner import Limits, SandboxError, Verdict, check_isolation, run_batch, run_program, run_programs

__all__ = ["Limits", "SandboxError", "Verdict", "check_isolation", "run_batch", "run_program", "run_programs"]
