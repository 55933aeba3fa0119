"""Format rewards: is the answer where a parser will find it?"""

from __future__ import annotations

import re

_ANSWER_LINE = re.compile(r"^####[ \t]*[-+−$]?\s*[\d.,]*\d", re.MULTILINE)


def answer_format(prompts, completions, **_) -> list[float]:
    """1.0 when the completion has a line '#### <number>', else 0.0."""
    return [1.0 if _ANSWER_LINE.search(c) else 0.0 for c in completions]
