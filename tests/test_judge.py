"""LLM-as-judge rewards (`judge:<name>`), end to end against `grpolab serve` on 127.0.0.1 with the
real `openai` client: parsed scores equal an independent request's, the concurrency limit holds (the
server's decode steps count it), a hung or dead server stops the run in one line, a
resumed GRPO run asks nothing twice, and the API key stays out of every file and log. The judge
served is a random built-in GPT: its answers differ from prompt to prompt and hold a digit or not."""

import json
import math
import signal
import threading
import urllib.request

import openai
import pytest
import torch
from conftest import running_server

from grpolab.config.load import load_config
from grpolab.errors import ConfigError, RewardError
from grpolab.models import GPT, CharTokenizer, GPTConfig
from grpolab.models.checkpoint import save_checkpoint
from grpolab.rewards import judge
from grpolab.rewards.calling import RewardLog
from grpolab.rewards.combine import score
from grpolab.rewards.judge import parse_score
from grpolab.rewards.rubrics import RubricIndex

SECRET = "sk-test-9f8e7d6c5b4a-DO-NOT-LOG"
KEY_ENV = "GRPOLAB_TEST_JUDGE_KEY"
# answers are random characters: the score is their last digit, out of 9
JUDGE = {"model": "judge", "template": "Rate this: {completion}", "pattern": r"(\d)", "score_range": [0, 9],
         "max_tokens": 24, "api_key_env": KEY_ENV}


# ---------------------------------------------------------------- parsing and retrieval (no server)

@pytest.mark.parametrize("answer, kw, want", [
    ("The answer is fine. Score: 7", {}, 0.7),
    ("Score: 7, then 10 more", {}, 1.0),                  # the last number counts
    ("Score: 11", {}, None),                              # outside score_range
    ("no number here", {}, None),
    ("Score: 2.5 / 5", {"score_range": [1, 5]}, 1.0),
    ("Score: 2.5, I said", {"score_range": [1, 5]}, 0.375),
    ("Rating [[4]] of 5 (after 9 tries)", {"pattern": r"\[\[(\d+)\]\]", "score_range": [0, 5]}, 0.8),
    ("This is incorrect.", {"parser": "verdict"}, 0.0),     # 'correct' inside 'incorrect' is not a verdict
    ("Incorrect at first, but CORRECT in the end", {"parser": "verdict"}, 1.0),
    ("mostly right: partial", {"parser": "verdict", "verdicts": ["good", "partial", "bad"]}, 0.5),
    ("non-correct", {"parser": "verdict"}, None),
])
def test_parse_score(answer, kw, want):
    kw = {"parser": "number", **kw}
    got = parse_score(answer, **kw)
    assert got == (None if want is None else pytest.approx(want))


def test_rubric_retrieval_is_tfidf_cosine():
    rows = [{"question": "How many apples does Tom have after buying apples?", "rubric": "apples"},
            {"question": "A train leaves at noon; when does it arrive?", "rubric": "trains"},
            {"question": "Tom bakes a cake", "rubric": "cakes"}]
    index = RubricIndex(rows)
    q = "Sara has 3 apples and buys 2 more apples"
    # plainly: smoothed idf = ln((1 + n) / (1 + df)) + 1, tf-idf vectors, cosine
    docs = [r["question"].lower().replace("?", "").replace(";", "").split() for r in rows]
    n = len(docs)
    idf = {w: math.log((1 + n) / (1 + sum(w in d for d in docs))) + 1 for d in docs for w in d}

    def vec(words):
        v = {w: words.count(w) * idf[w] for w in set(words) if w in idf}
        norm = math.sqrt(sum(x * x for x in v.values())) or 1.0
        return {w: x / norm for w, x in v.items()}
    qv = vec(q.lower().split())
    want = [sum(x * vec(d).get(w, 0.0) for w, x in qv.items()) for d in docs]
    assert index.similarity(q) == pytest.approx(want)
    assert want[0] > 0 and want[1] == 0
    assert [r["rubric"] for r in index.top(q, 2)] == ["apples", "cakes" if want[2] > 0 else "trains"]


def test_request_has_the_rows_reference_rubric_and_retrieved_examples(tmp_path):
    (tmp_path / "rubrics.jsonl").write_text(
        json.dumps({"question": "How many apples are left?", "rubric": "count the apples"}) + "\n" +
        json.dumps({"question": "When does the train arrive?", "rubric": "check the clock"}) + "\n")
    cfg = load_config(None, ["reward.judges.j.base_url=http://127.0.0.1:1/v1", "reward.judges.j.model=m",
                             f"reward.judges.j.rubrics={tmp_path / 'rubrics.jsonl'}",
                             "reward.judges.j.rubric_examples=1", "reward.judges.j.system=Be strict.",
                             "reward.functions=[judge:j]"])
    j = judge.Judge("j", cfg.reward.judges["j"])
    body = j.body([{"role": "system", "content": "sys"}, {"role": "user", "content": "Ann has 3 apples."}],
                  "She has 3.", "#### 3", "exact number")
    assert body["messages"][0] == {"role": "system", "content": "Be strict."}
    text = body["messages"][1]["content"]
    for part in ("Ann has 3 apples.", "She has 3.", "#### 3", "exact number", "count the apples",
                 "from 0 (worst) to 10"):
        assert part in text
    assert "check the clock" not in text and "sys" not in text
    assert body["model"] == "m" and body["temperature"] == 0.0


@pytest.mark.parametrize("over, msg", [
    (["reward.functions=[judge:nope]"], r"reward.functions: 'judge:nope' names no judge; define reward.judges.nope"),
    (["reward.judges.j.api_key=sk-123"], r"unknown config key 'reward.judges.j.api_key'; did you mean "
                                         r"reward.judges.j.api_key_env\?"),
    (["reward.judges.j.api_key_env=sk-abc123-real"], r"api_key_env: give the NAME of an environment variable"),
    (["reward.judges.j.template=Grade {answer}"], r"template: unknown field \{answer\}"),
    (["reward.judges.j.template=Grade {question}"], r"template: must contain \{completion\}"),
    (["reward.judges.j.verdicts=[yes]", "reward.judges.j.parser=verdict"], r"verdicts: give at least two distinct"),
    (["reward.judges.j.base_url=localhost:8000"], r"base_url: give the judge server's API address"),
])
def test_judge_config_errors_name_the_key(over, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(None, ["reward.judges.j.base_url=http://127.0.0.1:1/v1", "reward.judges.j.model=m",
                           "reward.functions=[judge:j]", *over])


def test_a_missing_key_variable_is_one_line(monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    cfg = load_config(None, [f"reward.judges.j.{k}={json.dumps(v)}" for k, v in JUDGE.items()] +
                      ["reward.judges.j.base_url=http://127.0.0.1:1/v1", "reward.functions=[judge:j]"])
    with pytest.raises(RewardError,
                       match=f"reward.judges.j.api_key_env: the environment variable {KEY_ENV} is not set"):
        judge.configure(cfg.reward, None)


# ---------------------------------------------------------------- against `grpolab serve`

@pytest.fixture(scope="module")
def judge_ckpt(tmp_path_factory):
    tok = CharTokenizer()
    torch.manual_seed(2)   # a seed whose answers hold a digit about two times in three
    m = GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=2, n_head=2, n_embd=64, block_size=256))
    with torch.no_grad():   # peaked but input-dependent next-token choices
        m.lm_head.weight.mul_(10)
    return save_checkpoint(tmp_path_factory.mktemp("judge") / "checkpoints", 0, m.eval(), tokenizer=tok)


@pytest.fixture(scope="module")
def served(judge_ckpt):
    with running_server(judge_ckpt, "--name", "judge", "--max-batch", "16") as (url, proc):
        yield url, proc


@pytest.fixture
def key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, SECRET)


def _judge(url: str, cache_dir=None, **kw):
    over = {**JUDGE, "base_url": url + "/v1", **kw}
    cfg = load_config(None, [f"reward.judges.t.{k}={json.dumps(v)}" for k, v in over.items()] +
                      ["reward.functions=[judge:t]"])
    judge.configure(cfg.reward, cache_dir)
    return cfg


def _score(completions: list[str]) -> tuple[list, dict]:
    log = RewardLog(len(completions))
    _, per = score(["judge:t"], None, ["q"] * len(completions), completions, {}, log=log)
    return [None if math.isnan(x) else x for x in per["judge:t"].tolist()], log.mean_metrics()


def _health(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url + "/health", timeout=5).read())


COMPLETIONS = [f"answer {w} {i}" for i, w in enumerate("apple pear fig plum kiwi lime date yuzu sloe quince "
                                                        "grape melon".split())]


def test_scores_are_the_servers_answers_parsed(served, key):
    url, _ = served
    _judge(url, concurrency=4)
    got, metrics = _score(COMPLETIONS)
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    answers = [client.chat.completions.create(model="judge", max_tokens=24, temperature=0.0, messages=[
        {"role": "user", "content": f"Rate this: {c}"}]).choices[0].message.content for c in COMPLETIONS]
    want = [parse_score(a, "number", [0, 9], pattern=r"(\d)") for a in answers]
    assert got == pytest.approx(want)
    assert 2 <= sum(w is not None for w in want) < len(want) and len({w for w in want if w is not None}) >= 2
    assert metrics == {"judge/t/requests": len(COMPLETIONS), "judge/t/cached": 0, "judge/t/failed": 0,
                       "judge/t/unparsed": sum(w is None for w in want)}


@pytest.mark.slow
def test_concurrency_limit_holds_at_the_server(served, key):
    """With at most c requests in flight, the server needs at least (tokens of all answers) / c decode
    steps: each step samples one token for each request in its batch."""
    url, _ = served
    texts = [f"{c} again" for c in COMPLETIONS] * 2
    texts = [f"{t} #{i}" for i, t in enumerate(texts)]
    peak, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            h = _health(url)
            peak[0] = max(peak[0], h["running"] + h["waiting"])
    w = threading.Thread(target=watch)
    _judge(url, concurrency=2)
    before = _health(url)["steps"]
    w.start()
    try:
        _score(texts)
    finally:
        stop.set()
        w.join()
    steps = _health(url)["steps"] - before
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    tokens = sum(client.chat.completions.create(model="judge", max_tokens=24, temperature=0.0, messages=[
        {"role": "user", "content": f"Rate this: {t}"}]).usage.completion_tokens for t in texts)
    assert tokens > 4 * len(texts)
    assert steps >= tokens / 2, (steps, tokens)    # 4 at once would need only about tokens / 4
    assert peak[0] <= 2


def test_a_server_that_hangs_later_stops_the_run_at_its_timeout(served, key):
    url, proc = served
    _judge(url, timeout=0.5, max_retries=1, backoff=0.1, cache=False)
    _score(COMPLETIONS)   # the judge has answered before
    proc.send_signal(signal.SIGSTOP)   # the process still accepts connections, and never answers
    try:
        with pytest.raises(RewardError) as e:
            _score(["new one", "another one", "a third"])
    finally:
        proc.send_signal(signal.SIGCONT)
    # a step with no answer at all would train on nothing: it stops, saying why
    assert str(e.value) == (f"reward judge:t: the judge at {url}/v1 answered none of this step's 3 requests, each "
                            f"tried 2 times (reward.judges.t.max_retries = 1): no answer within 0.5 s "
                            f"(reward.judges.t.timeout); start or fix the judge server (train.resume=auto continues "
                            f"from the last checkpoint)")


def test_a_judge_that_never_parses_stops_the_run_in_one_line(served, key, tmp_path, capsys):
    from grpolab.cli import main
    url, _ = served
    over = {**JUDGE, "base_url": url + "/v1", "pattern": "(NEVER[0-9])"}
    args = ["train", *[f"reward.judges.t.{k}={json.dumps(v)}" for k, v in over.items()], "reward.functions=[judge:t]",
            *TRAIN, f"train.output_dir={tmp_path}"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("grpolab: reward error: reward judge:t: none of the judge's 8 answers so far holds a "
                          "score in [0, 9]"), err
    assert SECRET not in err


TRAIN = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "sft.steps=0", "data.train_size=16",
         "data.test_size=4", "eval.num_problems=4", "eval.k=2", "rollout.prompts_per_step=2",
         "rollout.num_generations=4", "rollout.max_new_tokens=8", "log.level=quiet", "log.samples_every=1",
         "log.tensorboard=true", "train.save_every=1", "train.keep_checkpoints=0"]


def _metrics(run_dir) -> list[dict]:
    return [{k: v for k, v in json.loads(ln).items() if not k.startswith(("time/", "perf/"))}
            for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_grpo_with_a_judge_resumes_from_its_cache_stops_at_a_dead_server_and_never_logs_the_key(
        judge_ckpt, tmp_path, key, capfd):
    import shutil

    from grpolab.jobs.train import run_train
    with running_server(judge_ckpt, "--name", "judge") as (url, proc):
        over = [f"reward.judges.t.{k}={json.dumps(v)}" for k, v in {**JUDGE, "base_url": url + "/v1",
                                                                   "max_retries": 1, "backoff": 0.05}.items()]
        base = [*over, "reward.functions=[judge:t]", *TRAIN]
        run_train(load_config(None, [*base, "train.max_steps=2", f"train.output_dir={tmp_path / 'a'}"]))
        first = _metrics(tmp_path / "a")
        assert [m["judge/t/requests"] for m in first] == [8, 8] and first[0]["judge/t/failed"] == 0
        assert any(m["judge/t/unparsed"] < 8 for m in first)   # some answers hold a score
        proc.kill()   # the judge server dies; the run goes on from its checkpoint
        proc.wait()
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    with pytest.raises(RewardError, match=r"^reward judge:t: the judge at .* answered none of this step's 8 "
                                          r"requests, each tried 2 times .*: cannot connect \(connection refused\)"):
        run_train(load_config(None, [*base, "train.max_steps=3", f"train.output_dir={tmp_path / 'b'}",
                                     f"train.resume={tmp_path / 'b' / 'checkpoints' / 'step_1'}"]))
    again = _metrics(tmp_path / "b")
    # step 2 again: every answer from the cache, no request sent, the same metrics to the bit
    # (the first run's final eval and watch keys, logged with its last step, are not in the longer run's step 2)
    first_step2 = {k: v for k, v in first[1].items() if not k.startswith(("eval/", "watch/"))}
    assert again[1] == {**first_step2, "judge/t/requests": 0, "judge/t/cached": 8}
    # step 3: the server is gone: the run stops at that step, with one line, and step 2's checkpoint kept
    assert len(again) == 2
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir()) == ["step_1", "step_2"]

    out = capfd.readouterr()
    assert SECRET not in out.out + out.err
    assert (tmp_path / "a" / "samples.jsonl").is_file() and (tmp_path / "a" / "judge_cache" / "t.jsonl").is_file()
    for run in ("a", "b"):
        assert f"api_key_env: {KEY_ENV}" in (tmp_path / run / "config.yaml").read_text()
        for f in (tmp_path / run).rglob("*"):
            if f.is_file():
                assert SECRET.encode() not in f.read_bytes(), f


def test_a_request_the_server_refuses_from_the_start_stops_in_one_line(served, key):
    url, _ = served
    _judge(url, model="no-such-model")
    with pytest.raises(RewardError, match=r"reward judge:t: the judge server at .* refused the request \(\d+: .*"
                                          r"no-such-model.*check reward.judges.t.model/base_url/api_key_env"):
        _score(["one", "two"])
