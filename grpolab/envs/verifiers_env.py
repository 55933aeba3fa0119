"""verifiers (0.4.0, its `verifiers.v1` API) tasksets as grpolab rows, scored by each task's own rubric.

    data.task: verifiers:<taskset id>     e.g. verifiers:my_env_pkg (an installed package exporting one Taskset)
    reward.functions: [verifiers]

The taskset is loaded as verifiers loads one (`vf.load_taskset`), with its own config class; data.task_config
gives that config's fields.
A row's prompt is the task's system prompt and prompt as chat messages, its answer the task's `answer` field
where it has one. The `verifiers` reward (rewards/task_packages.py, through `score`) makes the finished rollout a
verifiers Trace (the prompt, then the completion as the assistant's turn) and awaits the task's `score(trace)`:
the weighted sum of its @vf.reward functions (rewards needing a sandbox runtime or an LLM judge
are skipped by verifiers without one).

In verifiers 0.4.0 a multi-turn environment is a harness program that calls the model over an OpenAI-compatible
endpoint itself; grpolab's Environment contract (reset/step) has no hook into that loop, so verifiers tasksets
run here as single-turn tasks. The package is an extra: `pip install 'grpolab[envs]'`.
"""

from __future__ import annotations

import time

from ..config.names import VERIFIERS_TASK as TASK_PREFIX
from ..errors import ConfigError, DataError


def _package():
    try:
        import verifiers.v1 as vf
    except ImportError:
        raise ConfigError("data.task: verifiers tasksets need the verifiers package; "
                          "pip install 'grpolab[envs]'") from None
    return vf


def load_rows(task: str, config: dict, system_prompt: str | None) -> list[dict]:
    """Every task of the taskset as a row {"prompt", "answer", "verifiers": the Task}."""
    vf = _package()
    name = task[len(TASK_PREFIX):]
    try:
        taskset = vf.load_taskset(vf.taskset_config_type(name)(id=name, **config))
    except ModuleNotFoundError as e:
        raise ConfigError(f"data.task: verifiers has no taskset {name!r} ({e}); install its package") from None
    except Exception as e:   # noqa: BLE001 - its config validation, in one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(f"data.task: verifiers taskset {name!r} could not be loaded: {type(e).__name__}: {first}") \
            from None
    rows = [_row(t, system_prompt) for t in taskset]
    if not rows:
        raise DataError(f"data.task={task}: the taskset has no tasks")
    return rows


def _messages(data) -> list[dict]:
    msgs = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        return msgs + [{"role": "user", "content": data.prompt}]
    return msgs + [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in data.prompt or []]


def _row(task, system_prompt: str | None) -> dict:
    prompt = _messages(task.data)
    if system_prompt:
        prompt = [{"role": "system", "content": system_prompt}, *[m for m in prompt if m["role"] != "system"]]
    answer = getattr(task.data, "answer", None)
    return {"prompt": prompt, "answer": None if answer is None else str(answer), "verifiers": task}


def _trace(vf, task, prompt: list[dict], text: str):
    from verifiers.v1.graph import prepare_turn
    from verifiers.v1.trace import AgentInfo, TraceTask
    trace = vf.Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                     agent=AgentInfo(config=vf.AgentConfig()))
    kinds = {"system": vf.SystemMessage, "user": vf.UserMessage, "assistant": vf.AssistantMessage}
    msgs = [kinds[m["role"]](content=m["content"]) for m in prompt]
    prepare_turn(trace, msgs).commit(vf.Response(id="grpolab", created=int(time.time()), model="grpolab",
                                                 message=vf.AssistantMessage(content=text), finish_reason="stop"))
    return trace


async def score(task, prompt: list[dict] | str, completion: str) -> float | None:
    """The task's rubric on the completion, as the finished trace's reward (None when `task` is not a task)."""
    vf = _package()
    if not isinstance(task, vf.Task):
        return None
    msgs = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    trace = _trace(vf, task, msgs, completion)
    await task.score(trace)
    return float(trace.reward)
