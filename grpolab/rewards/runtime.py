"""The reward settings a run scores under, passed explicitly: reward.timeout for each reward function's
call, and reward.code_exec's sandbox (the code_exec reward's programs and the python tool's).

Built from the config (`RewardRuntime.from_config`; `check`ed once per run by jobs/inputs.configure_rewards) and
handed to `combine.score`, `code_exec` and the tool loader. A default-constructed one holds the schema's
defaults."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Callable

from ..config import CodeExecConfig, RewardConfig
from ..sandbox import Limits
from ..sandbox.runner import check_isolation

_CODE = CodeExecConfig()


@dataclass(frozen=True)
class RewardRuntime:
    """What reward calls need from the run's config; frozen, so one run's settings cannot drift."""
    timeout: float = float(RewardConfig.timeout)   # seconds one reward function may take per batch; 0 = no limit
    limits: Limits = field(default_factory=Limits)   # each sandboxed program's
    max_concurrent: int = _CODE.max_concurrent      # programs run at once; 0 = the number of cores
    unsafe: bool = _CODE.unsafe_no_sandbox          # programs run without the sandbox (rlimits only)

    @classmethod
    def from_config(cls, reward: RewardConfig) -> RewardRuntime:
        """The runtime of the reward section `reward` (no side effects: `check` is the run's one check)."""
        cfg = reward.code_exec
        return cls(timeout=float(reward.timeout),
                   limits=Limits(timeout=cfg.timeout, memory_mb=cfg.memory_mb, max_procs=cfg.max_procs,
                                 max_output=cfg.max_output, tmp_mb=cfg.tmp_mb, tmp_inodes=cfg.tmp_inodes,
                                 shm_mb=cfg.shm_mb),
                   max_concurrent=cfg.max_concurrent, unsafe=cfg.unsafe_no_sandbox)

    def check(self, warn: Callable[[str], None] | None = None, sandbox: bool = True) -> None:
        """Once per run: warn when the sandbox is off; else, with `sandbox` (code_exec or the python tool is
        used), make sure it works on this machine (SandboxError with the fix if not)."""
        if self.unsafe:
            msg = ("reward.code_exec.unsafe_no_sandbox is true: model-written programs run WITHOUT isolation, as "
                   "this user, with only resource limits")
            (warn or (lambda m: print(f"warning: {m}", file=sys.stderr)))(msg)
        elif sandbox:
            check_isolation()
