"""Format rewards: is the answer where a parser will find it?"""

from __future__ import annotations

import re

from ..data.answers import extract_hash_answer
from .calling import completion_texts


def answer_format(prompts, completions, **_) -> list[float]:
    """1.0 when gsm8k_accuracy's reader finds an answer, else 0.0: a number on the line after
    the last '####' (which may stand mid-line). So gsm8k_accuracy 1 implies format 1."""
    return [1.0 if extract_hash_answer(c) is not None else 0.0 for c in completion_texts(completions)]


def boxed_content(text: str) -> str | None:
    """The text inside the last complete \\boxed{...} of `text` (nested braces balanced), else None."""
    start = text.rfind("\\boxed{")
    while start != -1:
        depth, i = 1, start + len("\\boxed{")
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i:j]
        start = text.rfind("\\boxed{", 0, start)   # this one never closes: try the one before
    return None


def boxed_format(prompts, completions, **_) -> list[float]:
    """1.0 when the completion has a complete, non-empty \\boxed{...} (where math answers are read first)."""
    return [1.0 if (b := boxed_content(c)) is not None and b.strip() else 0.0
            for c in completion_texts(completions)]


# DeepSeek-R1-Zero's template: '<think> ... </think> <answer> ... </answer>' and nothing else
_THINK_ANSWER = re.compile(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", re.DOTALL)
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def think_format(prompts, completions, **_) -> list[float]:
    """1.0 when the completion is exactly '<think>…</think>' + whitespace + '<answer>…</answer>'.

    Leading/trailing whitespace is allowed; each of the four tags must occur exactly once
    (so a nested or repeated tag inside the think/answer text fails).
    """
    return [1.0 if _THINK_ANSWER.fullmatch(c) and all(c.count(t) == 1 for t in _TAGS) else 0.0
            for c in completion_texts(completions)]
