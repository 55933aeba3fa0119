"""rollout.repetition_penalty / presence_penalty / frequency_penalty / min_tokens in the built-in rollout
engine: the tokens and log-probs against a plain greedy decode with the formula written out here, min_tokens'
ban, keyed sampling that does not depend on the batch, the config's refusals, and a short GRPO run."""

import json
import math

import pytest
import torch
from conftest import overfit, penalized, run_cli
from test_grpo import make_trainer

from grpolab.config.load import load_config
from grpolab.errors import ConfigError
from grpolab.models import GPT, CharTokenizer, GPTConfig
from grpolab.rollout.engine import generate
from grpolab.rollout.keys import completion_keys
from grpolab.rollout.tool_decode import ToolUse
from grpolab.rollout.tool_formats import BuiltinFormat
from grpolab.rollout.tools import ToolRunner, load_tools

TOK = CharTokenizer()
PROMPTS = ["Tom has 3 apples and buys 4 more. ", "Sum 1+2? "]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=TOK.vocab_size, n_layer=2, n_head=2, n_embd=64, block_size=256))
    with torch.no_grad():   # x3: greedy far from ties, and the penalties able to change it
        m.lm_head.weight.mul_(3.0)
    return m.eval()


def _logits(model, ids: list[int]) -> list[float]:
    with torch.no_grad():
        return model(torch.tensor([ids]))[0, -1].tolist()


def _log_softmax(x: list[float]) -> list[float]:
    top = max(x)
    z = top + math.log(sum(math.exp(v - top) for v in x if v > -math.inf))
    return [v - z for v in x]


def _greedy(model, prompt: list[int], steps: int, process, stops=TOK.stop_ids) -> tuple[list[int], list[float]]:
    """A plain greedy decode: a full forward per step, `process(logits, out)`, argmax, until one of `stops`;
    the chosen token's log-prob under the processed logits."""
    out, lps = [], []
    for _ in range(steps):
        x = process(_logits(model, prompt + out), out)
        best = max(range(len(x)), key=x.__getitem__)
        out.append(best)
        lps.append(_log_softmax(x)[best])
        if best in stops:
            break
    return out, lps


@pytest.mark.parametrize("presence,frequency,repetition", [(1.5, 0.0, 1.0), (0.0, 0.9, 1.0), (0.0, 0.0, 1.8),
                                                           (0.0, 0.0, 0.6), (-0.5, 0.4, 1.3)])
def test_each_penalty_equals_a_plain_greedy_decode(model, presence, frequency, repetition):
    prompts = [TOK.encode(p) for p in PROMPTS]
    n = 30
    g = generate(model, prompts, num_generations=2, max_new_tokens=n, temperature=0.0, stop_ids=(), pad_id=TOK.pad_id,
                 presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition)
    for r in range(4):
        p = prompts[r // 2]
        want, lps = _greedy(model, p, n, lambda x, out: penalized(p, out, x, presence, frequency, repetition), ())
        assert g.completion_ids[r].tolist() == want
        # the recorded log-prob is the token's under the penalized distribution (the one it was drawn from)
        assert g.sampler_logprobs[r].tolist() == pytest.approx(lps, abs=1e-4)
    plain, _ = _greedy(model, prompts[0], n, lambda x, out: x, ())
    assert g.completion_ids[0].tolist() != plain   # the penalty changed this decode


class _EosFirst(torch.nn.Module):
    """The tiny model with `bias` on the end token's logit (8: it ends every completion at once, unless banned)."""

    def __init__(self, m: GPT, bias: float = 8.0) -> None:
        super().__init__()
        self.m = m
        self.bias = torch.zeros(TOK.vocab_size)
        self.bias[TOK.eos_id] = bias

    def forward(self, *a, **k):
        return self.m(*a, **k) + self.bias

    def new_cache(self, *a):
        return self.m.new_cache(*a)


def test_min_tokens_bans_the_stop_token_until_reached(model):
    eager = _EosFirst(model)
    p = TOK.encode(PROMPTS[0])
    kw = dict(num_generations=1, max_new_tokens=12, temperature=0.0, stop_ids=TOK.stop_ids, pad_id=TOK.pad_id)
    assert generate(eager, [p], **kw).completion_ids[0].tolist() == [TOK.eos_id]
    g = generate(eager, [p], min_tokens=4, **kw)
    with torch.no_grad():
        want, lps = _greedy(eager, p, 12, lambda x, out: [-math.inf if i == TOK.eos_id and len(out) < 4 else v
                                                          for i, v in enumerate(x)])
    assert want[-1] == TOK.eos_id and len(want) == 5
    assert g.completion_ids[0][g.completion_mask[0]].tolist() == want and not bool(g.truncated[0])
    assert g.sampler_logprobs[0, :5].tolist() == pytest.approx(lps, abs=1e-4)
    # sampled: no row stops before 4 tokens; each stops right after (the +8 wins once allowed)
    keys = completion_keys(3, torch.zeros(8, dtype=torch.long), torch.arange(8))
    s = generate(eager, [p], **{**kw, "num_generations": 8, "temperature": 1.0}, keys=keys, min_tokens=4)
    assert s.completion_mask.sum(-1).min() >= 5
    assert all(TOK.eos_id not in row[:4] for row in s.completion_ids.tolist())


def test_penalized_sampling_is_the_same_alone_and_in_a_batch(model):
    ends = _EosFirst(model, 2.0)   # rows end at different lengths: finished rows leave the decode batch
    prompts = [TOK.encode(p) for p in (*PROMPTS, "A longer third prompt, to pad the others: ")]
    G = 3
    keys = completion_keys(11, torch.arange(3).repeat_interleave(G), torch.arange(G).repeat(3))
    pen = dict(presence_penalty=0.8, frequency_penalty=0.3, repetition_penalty=1.4, min_tokens=5)
    kw = dict(max_new_tokens=24, temperature=1.0, top_k=20, stop_ids=TOK.stop_ids, pad_id=TOK.pad_id, **pen)
    batch = generate(ends, prompts, num_generations=G, keys=keys, **kw)
    assert len({tuple(r) for r in batch.completion_ids.tolist()}) == 9
    assert len(set(batch.completion_mask.sum(-1).tolist())) > 4
    for r in range(9):
        alone = generate(ends, [prompts[r // G]], num_generations=1, keys=keys[r:r + 1], **kw)
        n = int(alone.completion_mask[0].sum())
        assert n == int(batch.completion_mask[r].sum())
        assert alone.completion_ids[0, :n].tolist() == batch.completion_ids[r, :n].tolist()
        assert torch.allclose(alone.sampler_logprobs[0, :n], batch.sampler_logprobs[r, :n], atol=1e-5)
    # a sampled row's log-probs: the penalized logits' log-softmax, recomputed plainly (top-k does not enter it)
    p, out = prompts[0], batch.completion_ids[0][batch.completion_mask[0]].tolist()
    want = []
    for t, tok in enumerate(out):
        x = penalized(p, out[:t], _logits(ends, p + out[:t]), 0.8, 0.3, 1.4)
        x = [-math.inf if i == TOK.eos_id and t < 5 else v for i, v in enumerate(x)]
        want.append(_log_softmax(x)[tok])
    assert batch.sampler_logprobs[0, :len(out)].tolist() == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("override,msg", [
    ("rollout.repetition_penalty=0", "rollout.repetition_penalty: must be > 0 (1.0 = off), got 0"),
    ("rollout.repetition_penalty=-1.2", "rollout.repetition_penalty: must be > 0"),
    ("rollout.presence_penalty=2.5", "rollout.presence_penalty: must be in [-2, 2] (0.0 = off), got 2.5"),
    ("rollout.frequency_penalty=-3", "rollout.frequency_penalty: must be in [-2, 2]"),
    ("rollout.frequency_penalty=nan", "rollout.frequency_penalty: must be a finite number"),
    ("rollout.min_tokens=-1", "rollout.min_tokens: must be in [0, rollout.max_new_tokens=32], got -1"),
    ("rollout.min_tokens=33", "rollout.min_tokens: must be in [0, rollout.max_new_tokens=32], got 33"),
    ("rollout.max_slots=-1", "rollout.max_slots: must be >= 0 (0 = every row at once), got -1"),
])
def test_out_of_range_values_are_refused_with_the_fix(override, msg):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value).startswith(msg) and "\n" not in str(e.value)


@pytest.mark.slow
def test_cli_refuses_a_bad_penalty_in_one_line_exit_2(tmp_path):
    r = run_cli("train", "rollout.presence_penalty=3", f"train.output_dir={tmp_path}")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "rollout.presence_penalty" in r.stderr


def _metrics(out):
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "perf/"))}
            for line in open(out / "metrics.jsonl")]


@pytest.mark.slow
def test_grpo_runs_with_a_penalty_and_defaults_change_nothing(tmp_path):
    runs = {}
    for name, extra in [("plain", []), ("defaults", ["rollout.repetition_penalty=1.0", "rollout.presence_penalty=0",
                                                      "rollout.frequency_penalty=0", "rollout.min_tokens=0"]),
                        ("penalty", ["rollout.repetition_penalty=1.3"])]:
        t = make_trainer(tmp_path / name, "train.max_steps=2", *extra)
        t.train()
        runs[name] = _metrics(tmp_path / name)
    assert runs["defaults"] == runs["plain"]
    pen, plain = runs["penalty"], runs["plain"]
    assert [m["step"] for m in pen] == [1, 2] and all(math.isfinite(m["loss"]) for m in pen)
    # the sampler's log-probs are the penalized ones: they differ from the trainer's policy log-probs,
    # while without a penalty the two agree to float error
    assert pen[0]["rollout/logprob_abs_diff"] > 1e-3 > plain[0]["rollout/logprob_abs_diff"]


SCRIPT = "<|call|>calculator 12*34<|/call|><|out|>408<|/out|>=408 so 408"


@pytest.fixture(scope="module")
def caller():
    """A tiny GPT trained here to write SCRIPT after the prompt 'one' (the tool's output masked out of the
    loss, as SFT does), so its greedy decode calls the calculator."""
    from grpolab.data.supervised import collate, encode
    torch.manual_seed(0)
    m = GPT(GPTConfig(TOK.vocab_size, n_layer=1, n_head=2, n_embd=64, block_size=128))
    # 300 steps: at 200 the greedy decode wrote the call on one 2-core EPYC and not on another (other CPU
    # kernels round differently); at 300 it writes it with a margin
    return overfit(m, collate([encode(TOK, {"prompt": "one", "completion": SCRIPT})], TOK.pad_id), 300)


def test_with_tools_a_tools_output_counts_as_context_like_the_prompt(caller):
    """Each sampled token of a penalized greedy decode that calls a tool is the argmax of the formula over
    the sequence so far: the prompt and the tool's output (fed, not sampled) under the repetition penalty
    only, the sampled tokens under all three."""
    prompt = TOK.render_prompt("one")
    tools = ToolUse(BuiltinFormat(TOK), ToolRunner(load_tools(["calculator"]), timeout=5, max_output_chars=50))
    try:
        g = generate(caller, [prompt], num_generations=1, max_new_tokens=80, temperature=0.0, stop_ids=TOK.stop_ids,
                     pad_id=TOK.pad_id, tools=tools, repetition_penalty=1.3, presence_penalty=0.5,
                     frequency_penalty=0.2)
    finally:
        tools.close()
    assert g.tool_calls[0][0]["output"] == "408"
    ids = g.completion_ids[0].tolist()
    sampled, fed = g.completion_mask[0].tolist(), g.tool_mask[0].tolist()
    for t in range(len(ids)):
        if sampled[t]:
            context = prompt + [ids[j] for j in range(t) if fed[j]]
            out = [ids[j] for j in range(t) if sampled[j]]
            x = penalized(context, out, _logits(caller, prompt + ids[:t]), 0.5, 0.2, 1.3)
            assert max(range(len(x)), key=x.__getitem__) == ids[t]
            assert g.sampler_logprobs[0, t].item() == pytest.approx(_log_softmax(x)[ids[t]], abs=1e-5)
    assert sum(sampled) > 10 and sum(fed) > 3
