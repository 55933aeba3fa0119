"""A reward function with TRL's signature, importable by module and by file: tests/test_python_api.py hands it to
grpolab.GRPOTrainer as a function and names it in a `grpolab train` config by its file."""


def reward_len(completions, **kwargs):
    return [-abs(20 - len(c)) for c in completions]
