"""The environment adapters against the real packages: reasoning-gym's datasets and scorers, a verifiers (0.4.0)
taskset loaded by id and scored by its rubric, an OpenEnv environment on a real local server (uvicorn, its
WebSocket session), a TextArena game. Each is checked against the package used directly, in the test."""

import asyncio
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import _free_port, run_cli, wait_healthy
from test_envs import _segments, game_model  # noqa: F401 - the tiny chat model that plays guessing games

from grpolab.config.load import load_config
from grpolab.envs import reasoning_gym as rg_adapter
from grpolab.envs.openenv_env import OpenEnvEnvironment, observation_text
from grpolab.envs.textarena_env import TextArenaEnvironment
from grpolab.envs.turns import TurnRenderer
from grpolab.envs.verifiers_env import load_rows
from grpolab.errors import ConfigError, EnvError
from grpolab.jobs.inputs import load_data
from grpolab.rewards import get_reward
from grpolab.rewards.task_packages import verifiers
from grpolab.rollout.engine import generate
from grpolab.rollout.env_decode import EnvUse
from grpolab.rollout.keys import completion_keys

reasoning_gym = pytest.importorskip("reasoning_gym")
textarena = pytest.importorskip("textarena")
TESTS = Path(__file__).parent


# ------------------------------------------------------------------ reasoning-gym
def _rg_cfg(*extra):
    return load_config(None, ["data.task=reasoning_gym:chain_sum", "data.task_config={min_terms: 2, max_terms: 3}",
                              "data.train_size=40", "data.test_size=30", "reward.functions=[reasoning_gym]", *extra])


def test_reasoning_gym_rows_are_the_packages_entries_and_the_test_rows_are_held_out():
    cfg = _rg_cfg()
    train, test = load_data(cfg)
    direct = reasoning_gym.create_dataset("chain_sum", size=40, seed=cfg.train.seed, min_terms=2, max_terms=3)
    assert [r["reasoning_gym"]["question"] for r in train] == [direct[i]["question"] for i in range(40)]
    assert [r["answer"] for r in train] == [str(direct[i]["answer"]) for i in range(40)]
    assert train[0]["prompt"][0]["role"] == "system" and "<answer>" in train[0]["prompt"][0]["content"]
    assert test and not {r["reasoning_gym"]["question"] for r in test} & {r["reasoning_gym"]["question"] for r in train}
    assert cfg.eval.reward == "reasoning_gym"
    again, _ = load_data(_rg_cfg())
    assert [r["answer"] for r in again] == [r["answer"] for r in train]


def test_the_reasoning_gym_reward_is_the_tasks_scorer_on_the_tagged_answer():
    train, _ = load_data(_rg_cfg())
    fn = get_reward("reasoning_gym")
    entries = [r["reasoning_gym"] for r in train[:3]]
    answers = [str(e["answer"]) for e in entries]
    completions = [f"so <answer>{answers[0]}</answer>",                 # tagged, right
                   f"<answer>{int(answers[1]) + 1}</answer>",            # tagged, wrong
                   f"the total is {answers[2]}."]                        # untagged: the last number (numeric answer)
    score = reasoning_gym.get_score_answer_fn("chain_sum")
    expect = [score(answers[0], entries[0]), score(str(int(answers[1]) + 1), entries[1]), score(answers[2], entries[2])]
    assert fn(completions=completions, reasoning_gym=entries) == expect == [1.0, 0.0, 1.0]
    assert fn(completions=["no answer here"], reasoning_gym=[entries[0]]) == [0.0]
    assert fn(completions=["x"], reasoning_gym=[None]) == [None]
    assert rg_adapter.extract_answer("<answer>a</answer> then <answer> b </answer>") == "b"
    assert rg_adapter.extract_answer("words only", "cat") is None       # non-numeric reference: tags only


@pytest.mark.parametrize("args, says", [
    (["data.task=reasoning_gym:no_such_task"], "reasoning-gym has no dataset 'no_such_task'"),
    (["data.task=reasoning_gym:chain_sum", "data.task_config.bogus=1"], "chain_sum has no field 'bogus'"),
    (["data.task=reasoning_gym:chain_sum", "data.task_config.min_terms=9", "data.task_config.max_terms=2"],
     "refused its config"),
])
def test_reasoning_gym_config_mistakes_are_one_line(args, says):
    cfg = load_config(None, [*args, "reward.functions=[reasoning_gym]", "data.train_size=5"])
    with pytest.raises(ConfigError, match=says):
        load_data(cfg)


def test_a_reasoning_gym_task_with_the_gsm8k_reward_is_refused():
    with pytest.raises(ConfigError, match=r"set reward.functions=\[reasoning_gym\]"):
        load_config(None, ["data.task=reasoning_gym:chain_sum"])
    with pytest.raises(ConfigError, match="data.task_config: configures"):
        load_config(None, ["data.task_config.min_terms=2"])


@pytest.mark.slow
def test_grpolab_eval_on_a_reasoning_gym_task(game_model, tmp_path):  # noqa: F811
    _, _, model_dir = game_model
    r = run_cli("eval", str(model_dir), "data.task=reasoning_gym:chain_sum", "reward.functions=[reasoning_gym]",
                "data.train_size=10", "data.test_size=6", "eval.num_problems=6", "eval.k=2",
                "rollout.max_new_tokens=8", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "eval.json").read_text())
    assert set(res) >= {"greedy_accuracy", "pass@1", "pass@2"}


# ------------------------------------------------------------------ verifiers
def test_a_verifiers_taskset_loads_by_id_and_its_rubric_scores():
    rows = load_rows("verifiers:vf_sums", {"count": 4}, None)
    assert [r["prompt"] for r in rows] == [[{"role": "system", "content": "Reply with the number only."},
                                            {"role": "user", "content": f"What is {i} + {i + 1}?"}] for i in range(4)]
    assert [r["answer"] for r in rows] == ["1", "3", "5", "7"]
    completions = ["1", "3 is the sum", "six", "7"]
    got = asyncio.run(verifiers(prompts=[r["prompt"] for r in rows], completions=completions,
                                verifiers=[r["verifiers"] for r in rows]))
    # the taskset's rewards worked out plainly: 1.0 x (reply == answer) + 0.5 x (len(reply) <= 4)
    expect = [1.0 * (c.strip() == r["answer"]) + 0.5 * (len(c) <= 4) for c, r in zip(completions, rows)]
    assert got == expect == [1.5, 0.0, 0.5, 1.5]
    with pytest.raises(ConfigError, match="verifiers has no taskset 'no_such_taskset'"):
        load_rows("verifiers:no_such_taskset", {}, None)
    with pytest.raises(ConfigError, match="could not be loaded"):
        load_rows("verifiers:vf_sums", {"count": "many"}, None)


def test_a_verifiers_task_holds_out_rows_and_refuses_an_eval_without_them():
    cfg = load_config(None, ["data.task=verifiers:vf_sums", "data.task_config.count=10", "data.val_size=3",
                             "reward.functions=[verifiers]"])
    train, test = load_data(cfg)
    assert len(train) == 7 and len(test) == 3 and cfg.eval.reward == "verifiers"
    from grpolab.errors import DataError
    with pytest.raises(DataError, match="hold out part of it with data.val_size"):
        load_data(load_config(None, ["data.task=verifiers:vf_sums", "reward.functions=[verifiers]"]))


# ------------------------------------------------------------------ OpenEnv
@pytest.fixture(scope="module")
def openenv_server(tmp_path_factory):
    # its output goes to a file: the server logs every closed session, and a pipe nobody reads would fill and
    # stall it
    log = open(tmp_path_factory.mktemp("openenv") / "server.log", "w+")
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "openenv_guess:app", "--host", "127.0.0.1",
                             "--port", str(port), "--log-level", "warning"], cwd=TESTS, stdout=log,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 60)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_an_openenv_episode_is_the_servers_game(openenv_server):
    env = OpenEnvEnvironment(openenv_server)
    assert env.first_prompt(4) == [{"role": "user", "content": "Game 4: guess my number from 1 to 9."}]
    target = random.Random(4).randint(1, 9)                      # the server's rule, worked out here
    env.reset({"prompt": env.first_prompt(4), "seed": 4})
    low = env.step(f"I say {target - 1}" if target > 1 else "no idea")
    assert low.messages == [{"role": "user", "content": "higher" if target > 1 else "say a number"}]
    assert low.reward == 0.0 and not low.done
    win = env.step(f"{target}")
    assert (win.messages, win.reward, win.done) == ([], 1.0, True)
    env.close()
    with pytest.raises(EnvError, match="another first observation"):
        OpenEnvEnvironment(openenv_server).reset({"prompt": [{"role": "user", "content": "not it"}], "seed": 4})
    assert observation_text({"board": [1, 2]}) == '{"board": [1, 2]}'


def test_episodes_on_an_openenv_server_through_the_engine(openenv_server, game_model):  # noqa: F811
    model, tok, _ = game_model
    env = OpenEnvEnvironment(openenv_server)
    rows = [{"prompt": env.first_prompt(s), "seed": s} for s in (1, 2)]
    use = EnvUse(lambda: OpenEnvEnvironment(openenv_server), TurnRenderer(tok), "openenv", max_turns=3,
                 max_tokens=60, timeout=30)
    prompts = [tok.render_prompt(r["prompt"]) for r in rows]
    keys = completion_keys(0, torch.arange(2).repeat_interleave(2), torch.arange(2).repeat(2))
    gen = generate(model, prompts, num_generations=2, max_new_tokens=40, temperature=1.0, stop_ids=tok.stop_ids,
                   pad_id=tok.pad_id, keys=keys, tools=use.bind(rows))
    for b, ep in enumerate(gen.episodes):
        target = random.Random(rows[b // 2]["seed"]).randint(1, 9)   # the server's rule, worked out here
        n = int(gen.context_mask[b].sum())
        turns = [tok.decode(gen.completion_ids[b, s:e].tolist())
                 for is_env, s, e in _segments(gen.tool_mask[b, :n].tolist()) if not is_env]
        said = [re.search(r"\d+", t) for t in turns]
        assert ep["turns"] == len(turns) and 1 <= len(turns) <= 3
        assert ep["done"] == (said[-1] is not None and int(said[-1].group()) == target)
        assert ep["rewards"] == [float(m is not None and int(m.group()) == target) for m in said]


@pytest.mark.slow
def test_grpolab_train_with_data_task_env_on_an_openenv_server(openenv_server, game_model, tmp_path):  # noqa: F811
    _, _, model_dir = game_model
    out = tmp_path / "run"
    r = run_cli("train", f"model.name_or_path={model_dir}", "data.task=env", f"env.name=openenv:{openenv_server}",
                "data.train_size=6", "reward.functions=[env]", "rollout.prompts_per_step=2", "env.max_turns=4",
                "rollout.num_generations=2", "rollout.max_new_tokens=24", "rollout.max_completion_tokens=60",
                "train.max_steps=2", "eval.num_problems=2", "eval.k=2", "data.test_size=2", "train.threads=1",
                f"train.output_dir={out}", "log.samples_every=1")
    assert r.returncode == 0, r.stderr
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert "rewards/env/mean" in metrics[0] and "env/turns" in metrics[0]
    assert "eval/greedy_accuracy" in metrics[-1] or any(k.startswith("eval/") for k in metrics[-1])
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert all("episode" in s and s["prompt"][-1]["content"].startswith("Game ") for s in samples)


# ------------------------------------------------------------------ TextArena
def test_a_textarena_game_as_an_environment_is_the_game_played_directly():
    env = TextArenaEnvironment("GuessTheNumber-v0")
    prompt = env.first_prompt(7)
    env.reset({"prompt": prompt, "seed": 7})
    game = textarena.make("GuessTheNumber-v0-raw")
    game.reset(num_players=1, seed=7)
    first = game.get_observation()[1]
    assert prompt[0]["content"] == "\n".join(m for who, m, *_ in first if who == -1).strip()
    for move in ("[5]", "maybe [12]", "no move"):
        reply = env.step(move)
        done, _ = game.step(move)
        assert reply.done == done
        if not done:
            said = "\n".join(m for who, m, *_ in game.get_observation()[1] if who == -1).strip()
            assert reply.messages == [{"role": "user", "content": said}]
    with pytest.raises(ConfigError, match="textarena has no game"):
        from grpolab.envs.textarena_env import factory
        factory("textarena:NoSuchGame-v0")
