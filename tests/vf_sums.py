"""A verifiers (0.4.0, verifiers.v1) taskset for tests/test_env_adapters.py, loaded by its id 'vf_sums' as
verifiers loads an installed environment package: sums to compute, a reward for the right total and a smaller
one for answering briefly."""

import verifiers.v1 as vf

__all__ = ["SumTaskset"]


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)

    @vf.reward(weight=0.5)
    async def brief(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply) <= 4)


class SumConfig(vf.TasksetConfig):
    count: int = 6


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self):
        for i in range(self.config.count):
            yield SumTask(SumData(prompt=f"What is {i} + {i + 1}?", system_prompt="Reply with the number only.",
                                  answer=str(2 * i + 1)), self.config.task)
