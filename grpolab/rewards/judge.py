"""LLM-as-judge rewards: spec 'judge:<name>' asks the model behind an OpenAI-compatible API
(reward.judges.<name>: `grpolab serve`, vLLM, a hosted API) to grade each completion, and parses
a score from its answer.

One call: each completion's request (the template filled with the question, the completion, the
row's reference `answer` and `rubric` columns, and rubrics retrieved as examples) -> the disk
cache, keyed by the whole request -> the others sent at most `concurrency` at a time, each retried
on connection errors, timeouts, 429 and 5xx with exponential backoff -> the answer parsed (a number
in score_range mapped to [0, 1], or a verdict word mapped from 1 for the first to 0 for the last).
A request that still fails, or an answer that does not parse, gives None ("not applicable": it
adds nothing to the reward) and counts in the step's metrics (judge/<name>/failed, .../unparsed).
These stop the run with one line instead: a step in which every request sent failed (the judge is
down, unreachable, hangs past `timeout` or answers 5xx: the line says which, with the URL), a
judge none of whose answers has ever parsed, a request the server refuses outright (401, 404, ...)
before any has succeeded, and an answer that is not a chat completion (not JSON, or JSON without
choices[0].message.content: a wrong base_url, or not an OpenAI-compatible server). Training on
rewards the judge never gave would go on with nothing to learn from.

The API key comes from the environment variable named by api_key_env and goes only into the
request's header: never into config.yaml, the logs, the cache or samples.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import os
import re
from pathlib import Path

from ..errors import RewardError
from .calling import completion_text
from .rubrics import load_rubrics

PREFIX = "judge:"

_BODY = """
{examples}
Question:
{question}

Reference answer (empty if none):
{reference}

Rubric (empty if none):
{rubric}

Response:
{completion}

"""
NUMBER_TEMPLATE = ("Grade the response to the question below." + _BODY +
                   'Give a score from {min} (worst) to {max} (best). End with the line "Score: N".')
VERDICT_TEMPLATE = "Judge the response to the question below." + _BODY + "End with one word from: {verdicts}."

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_CONFIGURED: dict[str, "Judge"] = {}


def question_text(prompt) -> str:
    """The question a judge sees: a text prompt, or the last user message of a conversation."""
    if isinstance(prompt, list):
        users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        return str((users or prompt)[-1].get("content", "")) if (users or prompt) else ""
    return "" if prompt is None else str(prompt)


def parse_score(answer: str, parser: str, score_range=(0, 10), verdicts=("correct", "incorrect"),
                pattern: str | None = None) -> float | None:
    """The reward in [0, 1] an answer gives, or None when it holds no score.

    number: the pattern's first group (default: the last number in the answer), which must lie in
    score_range = [lo, hi]; reward (x - lo) / (hi - lo). verdict: the pattern's group (default: the
    last whole word that is one of `verdicts`, any case); verdict i of n gives 1 - i / (n - 1)."""
    # the pattern's first group of each match (findall gives tuples when it has several groups)
    groups = [g[0] if isinstance(g, tuple) else g for g in re.findall(pattern, answer)] if pattern is not None else None
    if parser == "number":
        found = groups if groups is not None else _NUMBER.findall(answer)
        if not found:
            return None
        try:
            x = float(found[-1])
        except ValueError:
            return None
        lo, hi = score_range
        return (x - lo) / (hi - lo) if lo <= x <= hi else None
    words = [v.lower() for v in verdicts]
    if groups is not None:
        found = [w for w in (g.strip().lower() for g in groups) if w in words]
    else:
        alternatives = "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))
        found = [w.lower() for w in re.findall(rf"(?<![\w-])({alternatives})(?![\w-])", answer, flags=re.IGNORECASE)]
    if not found:
        return None
    return 1.0 - words.index(found[-1]) / (len(words) - 1)


class AnswerCache:
    """Answers on disk, one JSON line per request key: appended (and flushed) as each arrives, so a
    run killed mid-step keeps what it paid for; a torn last line is skipped when read."""

    def __init__(self, path: Path | None) -> None:
        self.path, self.answers = path, {}
        if path is not None and path.is_file():
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                    self.answers[rec["key"]] = rec["answer"]
                except (ValueError, KeyError, TypeError):
                    continue

    def get(self, key: str) -> str | None:
        return self.answers.get(key)

    def put(self, key: str, answer: str) -> None:
        self.answers[key] = answer
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps({"key": key, "answer": answer}) + "\n")


def request_key(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


class Judge:
    """The reward function of one configured judge (an async callable, so combine.score runs it in
    its event loop alongside other async rewards)."""

    def __init__(self, name: str, jc, cache_dir: Path | None = None) -> None:
        self.name, self.jc = name, jc
        self.__name__ = PREFIX + name
        self.template = jc.template or (NUMBER_TEMPLATE if jc.parser == "number" else VERDICT_TEMPLATE)
        self.cache = AnswerCache(cache_dir / f"{name}.jsonl" if jc.cache and cache_dir is not None else None)
        self.rubrics = None
        if jc.rubrics:
            self.rubrics = load_rubrics(jc.rubrics, f"reward.judges.{name}.rubrics")
        # a group's G samples share their question: retrieve its examples once
        self.examples = functools.lru_cache(maxsize=4096)(self._examples)
        if jc.api_key_env and jc.api_key_env not in os.environ:
            raise RewardError(f"reward.judges.{name}.api_key_env: the environment variable {jc.api_key_env} is not "
                              f"set; export it before the run")
        self._client = None
        self._sem: asyncio.Semaphore | None = None
        self.answered = 0   # answers received (or read from the cache), over the run
        self.parsed = 0     # ... of which parsed
        self.succeeded = 0  # requests that got an answer from the server

    # ---------------------------------------------------------------- requests
    def _examples(self, question: str) -> str:
        if self.rubrics is None or not self.jc.rubric_examples:
            return ""
        rows = self.rubrics.top(question, self.jc.rubric_examples)
        return "\n" + "\n".join(f"Example question:\n{r['question']}\nIts rubric:\n{r['rubric']}\n" for r in rows)

    def body(self, prompt, completion: str, reference, rubric) -> dict:
        """The chat-completion request for one completion (also its cache key, less nothing secret)."""
        jc, q = self.jc, question_text(prompt)
        text = self.template.format(
            question=q, completion=completion, reference="" if reference is None else str(reference),
            rubric="" if rubric is None else str(rubric), examples=self.examples(q),
            min=_plain(jc.score_range[0]), max=_plain(jc.score_range[1]), verdicts=", ".join(jc.verdicts))
        messages = ([{"role": "system", "content": jc.system}] if jc.system else []) + \
            [{"role": "user", "content": text}]
        return {"model": jc.model, "messages": messages, "max_tokens": jc.max_tokens, "temperature": jc.temperature}

    def client(self):
        if self._client is None:   # made inside the event loop that uses it
            try:
                import openai
            except ImportError:
                raise RewardError(f"reward {PREFIX}{self.name}: needs the openai client: pip install openai") from None
            key = os.environ[self.jc.api_key_env] if self.jc.api_key_env else "EMPTY"
            self._client = openai.AsyncOpenAI(base_url=self.jc.base_url, api_key=key, timeout=self.jc.timeout,
                                              max_retries=0)
            self._sem = asyncio.Semaphore(self.jc.concurrency)
        return self._client

    async def ask(self, body: dict, counts: dict) -> str | None:
        """The judge's answer to one request, or None after max_retries retries (counts["why"]: what
        happened to the last try, in words)."""
        import openai
        client = self.client()
        async with self._sem:
            for attempt in range(self.jc.max_retries + 1):
                if attempt:
                    await asyncio.sleep(self.jc.backoff * 2 ** (attempt - 1))
                counts["requests"] += 1
                try:
                    raw = await client.chat.completions.with_raw_response.create(**body)
                    answer = self._content(raw.http_response.content)
                    self.succeeded += 1
                    return answer
                except openai.APITimeoutError:   # (an APIConnectionError too: first)
                    counts["why"] = f"no answer within {self.jc.timeout:g} s (reward.judges.{self.name}.timeout)"
                    continue
                except openai.APIConnectionError as e:
                    counts["why"] = f"cannot connect ({_cause(e)})"
                    continue
                except openai.APIStatusError as e:
                    if e.status_code in (408, 409, 429) or e.status_code >= 500:   # busy or failing: try again
                        counts["why"] = f"HTTP {e.status_code} {_first_bytes(e.response.content)}"
                        continue
                    # another 4xx: the request itself is wrong, and retrying cannot help
                    if self.succeeded == 0:
                        raise RewardError(f"reward {PREFIX}{self.name}: the judge server at {self.jc.base_url} refused "
                                          f"the request ({e.status_code}: {_one_line(e.message)}); check "
                                          f"reward.judges.{self.name}.model/base_url/api_key_env") from None
                    counts["why"] = f"HTTP {e.status_code} {_first_bytes(e.response.content)}"
                    return None
        return None

    def _content(self, data: bytes) -> str:
        """choices[0].message.content of a chat-completion body ('' for none); RewardError when the body is
        not one (the client would fail on it with a JSONDecodeError or an AttributeError)."""
        try:
            r = json.loads(data)
        except ValueError:
            r = None
        choices = r.get("choices") if isinstance(r, dict) else None
        if isinstance(choices, list) and not choices:
            return ""
        message = choices[0].get("message") if isinstance(choices, list) and isinstance(choices[0], dict) else None
        content = message.get("content", "") if isinstance(message, dict) else 0
        if content is None or isinstance(content, str):
            return content or ""
        raise RewardError(f"reward {PREFIX}{self.name}: the judge's answer is malformed ("
                          f"{'not JSON' if r is None else 'JSON without choices[0].message.content'}): "
                          f"{_first_bytes(data)}; check that reward.judges.{self.name}.base_url ({self.jc.base_url}) "
                          f"is an OpenAI-compatible API")

    # ---------------------------------------------------------------- the reward
    async def __call__(self, prompts, completions, answer=None, rubric=None, log_metric=None, **_) -> list:
        n = len(completions)
        texts = [completion_text(c) for c in completions]
        prompts = prompts if prompts is not None else [None] * n
        refs = answer if answer is not None else [None] * n
        rubrics = rubric if rubric is not None else [None] * n
        bodies = [self.body(p, t, a, r) for p, t, a, r in zip(prompts, texts, refs, rubrics)]
        keys = [request_key(b) for b in bodies]
        answers: list[str | None] = [self.cache.get(k) for k in keys]
        counts = {"requests": 0}
        cached = sum(a is not None for a in answers)
        todo: dict[str, list[int]] = {}   # identical requests in one batch are sent once
        for i, a in enumerate(answers):
            if a is None:
                todo.setdefault(keys[i], []).append(i)
        got = await asyncio.gather(*(self.ask(bodies[idx[0]], counts) for idx in todo.values()))
        if got and all(a is None for a in got):
            # not one request answered: the judge is down, and every reward would be None
            jc = self.jc
            raise RewardError(f"reward {PREFIX}{self.name}: the judge at {jc.base_url} answered none of this step's "
                              f"{len(got)} requests, each tried {jc.max_retries + 1} times "
                              f"(reward.judges.{self.name}.max_retries = {jc.max_retries}): "
                              f"{counts.get('why', 'no answer')}; start or "
                              f"fix the judge server (train.resume=auto continues from the last checkpoint)")
        for (key, idx), a in zip(todo.items(), got):
            if a is not None:
                self.cache.put(key, a)
                for i in idx:
                    answers[i] = a
        jc = self.jc
        scores = [None if a is None else parse_score(a, jc.parser, jc.score_range, jc.verdicts, jc.pattern)
                  for a in answers]
        failed = sum(a is None for a in answers)
        unparsed = sum(a is not None and s is None for a, s in zip(answers, scores))
        self.answered += n - failed
        self.parsed += n - failed - unparsed
        if self.answered and not self.parsed:
            first = next(a for a in answers if a is not None)
            raise RewardError(f"reward {PREFIX}{self.name}: none of the judge's {self.answered} answers so far holds a "
                              f"{'score in ' + str(list(jc.score_range)) if jc.parser == 'number' else 'verdict'} "
                              f"(first: {_one_line(first)[:80]!r}); fix reward.judges.{self.name}.template or "
                              f".pattern")
        if log_metric is not None:
            for k, v in (("requests", counts["requests"]), ("cached", cached), ("failed", failed),
                         ("unparsed", unparsed)):
                log_metric(f"judge/{self.name}/{k}", v)
        return scores


def _cause(e: BaseException) -> str:
    """What a connection error comes down to: the OS's words for the deepest error with an errno
    ('connection refused'), else the deepest message."""
    why, x = str(e), e
    while x is not None:
        if isinstance(x, OSError) and x.errno:
            return os.strerror(x.errno).lower()
        why = str(x) or why
        x = x.__cause__ or x.__context__
    return why


def _first_bytes(data: bytes, n: int = 80) -> str:
    """The body's first n bytes, quoted on one line (and how long it was, when cut)."""
    text = repr(re.sub(r"\s+", " ", data[:n].decode("utf-8", "replace")))
    return f"{text} (first {n} of {len(data)} bytes)" if len(data) > n else text


def _plain(x) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _one_line(text) -> str:
    return " ".join(str(text).split())


def configure(reward, cache_dir: str | Path | None) -> None:
    """Build the judges `reward.functions` lists (`judge:<name>`, set up in reward.judges), their answers
    cached under `cache_dir`; get_judge resolves the specs to them. Judges defined but not listed are
    not built (nor their API key variables required)."""
    listed = {f[len(PREFIX):] for f in reward.functions if f.startswith(PREFIX)}
    _CONFIGURED.clear()
    for name, jc in reward.judges.items():
        if name in listed:
            _CONFIGURED[name] = Judge(name, jc, Path(cache_dir) if cache_dir is not None else None)


def get_judge(spec: str) -> Judge:
    name = spec[len(PREFIX):]
    if name not in _CONFIGURED:
        raise RewardError(f"reward {spec!r}: no judge named {name!r} is configured; define reward.judges.{name} "
                          f"(base_url, model, ...)")
    return _CONFIGURED[name]
