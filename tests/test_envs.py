"""Multi-turn episodes in an environment (envs/, rollout/env_decode.py) on a real tiny chat model.

A tiny Llama is taught a guessing game's turns (a number, then 'higher'/'lower', then another number), so its
episodes take several turns; tests/env_cases.py holds the environments. The token contract is checked against
independent computations: the chat template's own rendering of the whole conversation, the trainer's log-probs
of the whole stream, and the environment's reply worked out plainly from the text it was given."""

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, run_cli

from grpolab.envs.turns import TurnRenderer
from grpolab.errors import ConfigError, EnvError
from grpolab.models.hf import load_hf
from grpolab.models.logprobs import token_logprobs
from grpolab.models.tiny_hf import save_tiny_model
from grpolab.rollout.engine import generate
from grpolab.rollout.env_decode import EnvUse
from grpolab.rollout.keys import completion_keys

sys.path.insert(0, str(Path(__file__).parent))
import env_cases  # noqa: E402

GAMES = [("5", "higher", "7"), ("5", "lower", "3"), ("4", "higher", "6"), ("6", "lower", "2")]
ROWS = [{"prompt": [{"role": "user", "content": "guess my number"}], "answer": a} for a in ("7", "3")]


@pytest.fixture(scope="module")
def game_model(tmp_path_factory):
    """The tiny Llama after 60 steps on the game's conversations (all four in one padded batch)."""
    d = save_tiny_model(tmp_path_factory.mktemp("env_model"), layers=2, hidden=64, heads=2, intermediate=128)
    model, tok = load_hf(str(d))
    convs = [[{"role": "user", "content": "guess my number"}, {"role": "assistant", "content": a},
              {"role": "user", "content": h}, {"role": "assistant", "content": b}] for a, h, b in GAMES]
    data = [tok.render_conversation(c) for c in convs]
    width = max(len(ids) for ids, _ in data)
    ids = torch.tensor([x + [tok.pad_id] * (width - len(x)) for x, _ in data])
    valid = torch.tensor([[True] * len(x) + [False] * (width - len(x)) for x, _ in data])
    loss_mask = torch.tensor([m + [False] * (width - len(m)) for _, m in data])[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    model.train()
    for _ in range(60):
        logp = token_logprobs(model, ids, valid)
        loss = -(logp * loss_mask).sum() / loss_mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.save(d / "trained")
    tok.save(d / "trained")
    return model, tok, d / "trained"


def _episodes(model, tok, env=env_cases.Guess, max_turns=3, max_tokens=60, timeout=10.0, G=4):
    use = EnvUse(env, TurnRenderer(tok), "test", max_turns=max_turns, max_tokens=max_tokens, timeout=timeout)
    prompts = [tok.render_prompt(r["prompt"]) for r in ROWS]
    keys = completion_keys(0, torch.arange(len(ROWS)).repeat_interleave(G), torch.arange(G).repeat(len(ROWS)))
    return generate(model, prompts, num_generations=G, max_new_tokens=40, temperature=1.0, stop_ids=tok.stop_ids,
                    pad_id=tok.pad_id, keys=keys, tools=use.bind(ROWS)), prompts


def _segments(mask_row: list[bool]) -> list[tuple[bool, int, int]]:
    """(is_env, start, end) runs of a row's context."""
    runs, start = [], 0
    for i in range(1, len(mask_row) + 1):
        if i == len(mask_row) or mask_row[i] != mask_row[start]:
            runs.append((mask_row[start], start, i))
            start = i
    return runs


def test_a_reply_is_the_templates_text_after_the_turn(game_model):
    """render(messages) == what apply_chat_template puts between the assistant's end-of-turn token and the next
    assistant turn, in a real conversation (not the stand-in it was derived from)."""
    _, tok, _ = game_model
    r = TurnRenderer(tok)
    conv = [{"role": "system", "content": "play"}, {"role": "user", "content": "guess my number"},
            {"role": "assistant", "content": "5"}]
    reply = [{"role": "user", "content": "higher, and hurry"}]
    full = tok.tok.apply_chat_template(conv + reply, tokenize=False, add_generation_prompt=True)
    upto = tok.tok.apply_chat_template(conv, tokenize=False)
    cut = upto.rindex("<|im_end|>") + len("<|im_end|>")
    assert tok.decode(r.render(reply), skip_special=False) == full[cut:]
    assert tok.decode(r.render(reply), skip_special=False).endswith("<|im_start|>assistant\n")


def test_episodes_keep_the_sampled_tokens_and_append_each_reply_once(game_model):
    model, tok, _ = game_model
    env_cases.SEEN.clear()
    gen, prompts = _episodes(model, tok)
    stop = set(tok.stop_ids)
    renderer = TurnRenderer(tok)
    multi = 0
    for b in range(gen.completion_ids.size(0)):
        ids = gen.completion_ids[b].tolist()
        env_mask = gen.tool_mask[b].tolist()
        sampled = gen.completion_mask[b].tolist()
        n = int(gen.context_mask[b].sum())
        assert not any(e and s for e, s in zip(env_mask, sampled))          # no position is both
        assert all(gen.sampler_logprobs[b, i] == 0 for i in range(n) if env_mask[i])
        target = int(ROWS[b // 4]["answer"])
        runs = _segments(env_mask[:n])
        texts = [tok.decode(ids[s:e]) for is_env, s, e in runs if not is_env]
        messages = list(ROWS[b // 4]["prompt"])
        for j, (is_env, s, e) in enumerate(runs):
            if is_env:
                continue
            assert ids[e - 1] in stop or e == n                        # a turn ends at its stop token
            said = re.search(r"\d+", tok.decode(ids[s:e]))
            messages.append({"role": "assistant", "content": tok.decode(ids[s:e])})
            if j + 1 < len(runs):                                      # the environment replied: worked out plainly
                hint = "say a number" if said is None else ("higher" if int(said.group()) < target else "lower")
                _, s2, e2 = runs[j + 1]
                assert ids[s2:e2] == renderer.render([{"role": "user", "content": hint}])
                messages.append({"role": "user", "content": hint})
        ep = gen.episodes[b]
        assert ep["turns"] == len(texts)
        multi += ep["turns"] > 1
        # the stream is what the chat template makes of the same conversation (no re-tokenized drift)
        stream = tok.decode(prompts[b // 4] + ids[:n], skip_special=False)
        assert stream + "\n" == tok.tok.apply_chat_template(messages, tokenize=False)
        # each sampled token's log-prob is the trainer's, on the whole stream
        full = torch.tensor([prompts[b // 4] + ids[:n]])
        lp = token_logprobs(model, full, torch.ones_like(full, dtype=torch.bool))[0, len(prompts[b // 4]) - 1:]
        for i in range(n):
            if sampled[i]:
                assert abs(float(lp[i]) - float(gen.sampler_logprobs[b, i])) < 1e-4
    assert multi >= 2, gen.episodes                                    # the game did go past one turn
    # what the environments were given is the decoded turns, in order
    assert sorted(t for _, _, t in env_cases.SEEN) == sorted(
        tok.decode(gen.completion_ids[b, s:e].tolist()) for b in range(gen.completion_ids.size(0))
        for is_env, s, e in _segments(gen.tool_mask[b, :int(gen.context_mask[b].sum())].tolist()) if not is_env)


def test_the_slotted_decode_runs_episodes_as_the_eager_engine_does(game_model):
    """Episodes on the slotted decode (the GPU's captured step, eagerly here): a row that ends a turn pauses until
    the host's look, the environment's reply is fed into its slot and the next turn follows; the eager engine's
    streams, masks, episode records and log-probs, with episodes cut by the token budget too, and on 4 slots refilled
    as episodes end (the same bits as all at once)."""
    from grpolab.rollout import slot_decode
    model, tok, _ = game_model
    prompts = [tok.render_prompt(r["prompt"]) for r in ROWS]
    G = 4
    keys = completion_keys(0, torch.arange(len(ROWS)).repeat_interleave(G), torch.arange(G).repeat(len(ROWS)))
    kw = dict(num_generations=G, max_new_tokens=40, temperature=1.0, stop_ids=tok.stop_ids, pad_id=tok.pad_id,
              keys=keys)

    def use(max_tokens):
        return EnvUse(env_cases.Guess, TurnRenderer(tok), "test", max_turns=3, max_tokens=max_tokens).bind(ROWS)

    def rows(g):
        n = g.context_mask.sum(-1).tolist()
        return [(g.completion_ids[b, :n[b]].tolist(), g.tool_mask[b, :n[b]].tolist(), g.truncated[b].item())
                for b in range(len(n))]

    # 40 tokens cut episodes; without stop tokens (rollout.ignore_eos) a row whose episode is over samples on
    for max_tokens, stops in ((60, tok.stop_ids), (40, tok.stop_ids), (60, ())):
        seen, gens = [], []
        for slots in (False, True):
            env_cases.SEEN.clear()
            gens.append(generate(model, prompts, tools=use(max_tokens), slots=slots, **{**kw, "stop_ids": stops}))
            seen.append(sorted(env_cases.SEEN))   # the turns' texts, as each environment got them
        eager, slotted = gens
        assert rows(slotted) == rows(eager) and slotted.episodes == eager.episodes and seen[0] == seen[1]
        torch.testing.assert_close(slotted.sampler_logprobs, eager.sampler_logprobs, atol=1e-5, rtol=1e-5)
        assert any(e["turns"] > 1 for e in eager.episodes)
        assert max_tokens == 60 or any(e["cut"] for e in eager.episodes)
    refilled = slot_decode.generate(model, prompts, top_k=0, top_p=1.0, graphs=False, rows_per_matmul=4, max_slots=4,
                                    session=use(60).session(len(prompts) * G, 40, "cpu"), **{**kw, "stop_ids": ()})
    assert rows(refilled) == rows(slotted) and refilled.episodes == slotted.episodes
    assert torch.equal(refilled.sampler_logprobs, slotted.sampler_logprobs)


def test_an_episode_ends_at_its_turn_limit_and_its_reward_is_the_sum(game_model):
    model, tok, _ = game_model
    gen, _ = _episodes(model, tok, max_turns=1)
    assert all(e["turns"] == 1 for e in gen.episodes)
    assert not bool(gen.tool_mask.any())                               # nothing appended after the last turn
    gen, _ = _episodes(model, tok, max_turns=3)
    for e in gen.episodes:
        assert e["reward"] == sum(e["rewards"]) and len(e["rewards"]) == e["turns"] <= 3
        assert e["done"] == (e["rewards"][-1] == 1.0)


def test_a_reply_with_no_room_left_ends_the_episode_there(game_model):
    """Room for the first turn and not for a reply after it: every episode the first turn did not win ends
    `cut` after one turn, nothing appended; with room, the same episodes go on."""
    model, tok, _ = game_model
    reply = len(TurnRenderer(tok).render([{"role": "user", "content": "again"}]))
    gen, _ = _episodes(model, tok, env=env_cases.Again, max_tokens=reply + 2)   # fits an empty episode only
    assert all(n >= 2 for n in gen.completion_mask.sum(-1).tolist())   # a number and the end of the turn ...
    assert all(e["cut"] and e["turns"] == 1 for e in gen.episodes)     # ... leave no room for the reply
    assert not bool(gen.tool_mask.any())
    roomy, _ = _episodes(model, tok, env=env_cases.Again, max_tokens=200)
    assert all(not e["cut"] and e["turns"] == 3 for e in roomy.episodes) and bool(roomy.tool_mask.any())


@pytest.mark.parametrize("env, says", [
    (env_cases.Raises, "raised ValueError: the board is on fire"),
    (env_cases.NaNReward, "the reward is nan, not a finite number"),
    (env_cases.LongReply, "more than the whole episode's rollout.max_completion_tokens=60 leaves"),
    (env_cases.Hangs, "no answer within env.timeout=1s"),
])
def test_a_broken_environment_stops_the_rollout_with_one_line(game_model, env, says):
    model, tok, _ = game_model
    with pytest.raises(EnvError) as e:
        _episodes(model, tok, env=env, timeout=1.0, G=1)
    assert says in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith("environment test: episode ")


TURN = "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
GEN = "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
BROKEN_TEMPLATES = {   # each fails one of the start-up checks a reply's rendering depends on
    "rewriting the turns": "{{ messages | length }}{% for m in messages %}" + TURN + "{% endfor %}" + GEN,
    "drops an environment's reply": "{% for m in messages %}{% if loop.index < 3 %}" + TURN + "{% endif %}"
                                    "{% endfor %}" + GEN,
    "does not end an assistant turn with a stop token": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                                                        "{{ m['content'] }}\n\n{% endfor %}" + GEN,
    "does not open an assistant turn": "{% for m in messages %}" + TURN + "{% endfor %}"
                                       "{% if add_generation_prompt and messages | length < 3 %}"
                                       "<|im_start|>assistant\n{% endif %}",
}


@pytest.mark.parametrize("why", list(BROKEN_TEMPLATES))
def test_a_template_that_cannot_carry_replies_is_refused_at_start_up(game_model, why):
    _, tok, _ = game_model
    kept = tok.tok.chat_template
    tok.tok.chat_template = BROKEN_TEMPLATES[why]
    try:
        with pytest.raises(ConfigError, match=why) as e:
            TurnRenderer(tok, "my-model")
    finally:
        tok.tok.chat_template = kept
    assert str(e.value).startswith("env.name: the chat template of my-model ") and "\n" not in str(e.value)


def test_a_model_without_a_chat_template_is_refused():
    from grpolab.models import CharTokenizer
    with pytest.raises(ConfigError, match="no chat template"):
        TurnRenderer(CharTokenizer())


def _train_args(model_dir: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", f"model.name_or_path={model_dir}", "data.task=files", f"data.train_path={data}",
            f"env.name={ROOT / 'tests/env_cases.py'}:Guess", "env.max_turns=3", "reward.functions=[env]",
            "rollout.prompts_per_step=2", "rollout.num_generations=4", "rollout.max_new_tokens=24",
            "rollout.max_completion_tokens=60", "rollout.temperature=1.0", "eval.num_problems=0",
            "train.threads=1", f"train.output_dir={out}", "log.samples_every=1", "log.samples_per_step=8",
            "optim.lr=1e-3", *extra]


@pytest.fixture()
def game_rows(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "guess my number"}], "answer": a} for a in ("7", "3", "6", "2")]
    path = tmp_path / "game.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow
def test_grpo_in_an_environment_through_the_cli_and_resume_mid_run(game_model, game_rows, tmp_path):
    """`grpolab train` with env.name: episodes in samples.jsonl, rewards/env in the metrics; a run resumed from
    its step-2 checkpoint writes the same metrics as the run that never stopped."""
    _, _, model_dir = game_model
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    args = ["train.max_steps=4", "train.save_every=2", "train.keep_checkpoints=0"]
    r = run_cli(*_train_args(model_dir, game_rows, straight, *args))
    assert r.returncode == 0, r.stderr
    metrics = [json.loads(x) for x in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert all("rewards/env/mean" in m for m in metrics)
    assert any(m["env/turns"] > 1 for m in metrics) and all(m["env/turns"] <= 3 for m in metrics)
    samples = [json.loads(x) for x in (straight / "samples.jsonl").read_text().splitlines()]
    assert any("<|im_start|>user" in s["completion"] or "higher" in s["completion"] or "lower" in s["completion"]
               for s in samples), samples[:2]
    shutil.copytree(straight, resumed)
    r = run_cli(*_train_args(model_dir, game_rows, resumed, *args,
                             f"train.resume={resumed / 'checkpoints' / 'step_2'}"))
    assert r.returncode == 0, r.stderr

    def strip(path):
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "perf/"))}
                for line in open(path)]
    assert strip(straight / "metrics.jsonl") == strip(resumed / "metrics.jsonl")


@pytest.mark.slow
def test_a_hanging_environment_ends_the_run_with_one_line_and_exit_2(game_model, game_rows, tmp_path):
    _, _, model_dir = game_model
    args = _train_args(model_dir, game_rows, tmp_path / "run", "train.max_steps=1", "env.timeout=1")
    args = [a.replace(":Guess", ":Hangs") for a in args]
    r = run_cli(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "env error: environment " in lines[0] and "env.timeout=1s" in lines[0], r.stderr
