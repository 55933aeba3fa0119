"""TRL's and verl's reward functions, used unchanged as grpolab rewards.

Each test computes the library's own answer by calling its function directly, the way TRL's
GRPOTrainer (keywords, conversational completions) or verl's reward manager (per sample,
compute_score(data_source, solution_str, ground_truth, extra_info)) calls it, and compares it with
what grpolab's reward path (`combine.score`, the trainer) computed.
"""

import json
import math

import pytest
import torch
from test_grpo import TINY, make_trainer

from grpolab.errors import RewardError
from grpolab.rewards import get_reward, reward_names
from grpolab.rewards.calling import RewardLog, TrainerState
from grpolab.rewards.combine import check_signatures, score

trl_rewards = pytest.importorskip("trl.rewards")

# every public function of trl.rewards, with the spec that makes a reward of it (factories called
# with arguments) and whether TRL supports it on plain-text (non-conversational) prompts
TRL_SPECS = {
    "accuracy_reward": ("trl.rewards:accuracy_reward", False),
    "reasoning_accuracy_reward": ("trl.rewards:reasoning_accuracy_reward", False),
    "think_format_reward": ("trl.rewards:think_format_reward", False),
    "get_cosine_scaled_reward": ("trl.rewards:get_cosine_scaled_reward(max_len=12)", False),
    "get_repetition_penalty_reward": ("trl.rewards:get_repetition_penalty_reward(ngram_size=2, max_penalty=-0.5)",
                                      True),
    "get_soft_overlong_punishment": ("trl.rewards:get_soft_overlong_punishment(max_completion_len=10, "
                                     "soft_punish_cache=4)", True),
}


def _trl_function(name):
    """The reward function TRL's user would pass to GRPOTrainer(reward_funcs=[...])."""
    fn = getattr(trl_rewards, name)
    if name == "get_cosine_scaled_reward":
        return fn(max_len=12)
    if name == "get_repetition_penalty_reward":
        return fn(ngram_size=2, max_penalty=-0.5)
    if name == "get_soft_overlong_punishment":
        return fn(max_completion_len=10, soft_punish_cache=4)
    return fn


def _trl_call(name, prompts, completions, completion_ids, columns, step=0, max_steps=1):
    """TRL's own call (GRPOTrainer._calculate_rewards): by keyword, conversational completions as
    one assistant message each, None -> NaN. Returns (values, {column: logged values})."""
    logged = {}
    if isinstance(prompts[0], list):
        completions = [[{"role": "assistant", "content": c}] for c in completions]
    out = _trl_function(name)(prompts=prompts, completions=completions, completion_ids=completion_ids,
                              trainer_state=TrainerState(global_step=step, max_steps=max_steps),
                              log_extra=lambda col, vals: logged.__setitem__(col, list(vals)),
                              log_metric=lambda *_: None, **columns)
    return [math.nan if v is None else float(v) for v in out], logged


def _same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (math.isnan(g) and math.isnan(w)) or g == pytest.approx(w, abs=1e-6), (got, want)


def test_every_public_trl_reward_is_covered():
    public = {n for n in dir(trl_rewards) if not n.startswith("_") and callable(getattr(trl_rewards, n))}
    assert public == set(TRL_SPECS), "trl.rewards changed: add the new functions to TRL_SPECS"


# completions chosen so that every TRL function gives several different values, None included
COMPLETIONS = [
    "<think>\nsplit it in three\n</think>\nThe answer is \\boxed{\\frac{1}{3}}",
    "\\boxed{\\frac{1}{2}}",
    "<think>a</think> so $\\frac{1}{3}$ it is",
    "<think>x<think>y</think> \\boxed{3}",
    "no idea",
    "<think>long</think> \\boxed{7}",
]
SOLUTIONS = ["\\frac{1}{3}", "\\frac{1}{3}", "\\frac{1}{3}", "3", "7", "\\frac{"]
IDS = [[1, 2, 1, 2, 1, 2], [5] * 12, [], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [4, 4], [9, 8, 9, 8, 7, 6, 7, 6]]
CHAT = [[{"role": "system", "content": "Think first."}, {"role": "user", "content": f"Question {i}?"}]
        for i in range(len(COMPLETIONS))]


@pytest.mark.parametrize("name", sorted(TRL_SPECS))
def test_trl_reward_values_match_trls_own_call(name):
    spec, plain_ok = TRL_SPECS[name]
    for prompts in [CHAT] + ([[f"Question {i}?" for i in range(len(COMPLETIONS))]] if plain_ok else []):
        log = RewardLog(len(COMPLETIONS))
        total, per = score([spec], [2.0], prompts, COMPLETIONS, {"solution": SOLUTIONS},
                           completion_ids=IDS, log=log)
        want, logged = _trl_call(name, prompts, COMPLETIONS, IDS, {"solution": SOLUTIONS})
        _same(per[spec].tolist(), want)
        _same(total.tolist(), [0.0 if math.isnan(w) else 2 * w for w in want])
        assert len(set(w for w in want if not math.isnan(w))) >= 2, want   # the comparison is not all one value
        short = reward_names([spec])[spec]
        assert {k: v for k, v in log.columns.items()} == {f"{short}/{k}": v for k, v in logged.items()}


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _files_data(tmp_path, system_prompt):
    rows = [{"prompt": f"What is {a} divided by {b}?", "solution": f"\\frac{{{a}}}{{{b}}}"}
            for a, b in [(1, 3), (2, 5), (3, 7), (1, 2)]]
    path = _write_jsonl(tmp_path / "fracs.jsonl", rows)
    out = ["data.task=files", f"data.train_path={path}", f"data.test_path={path}", "sft.steps=0",
           "eval.num_problems=2", "eval.k=1", "train.max_steps=1", "log.samples_every=1"]
    return out + ([f"data.system_prompt={system_prompt}"] if system_prompt else [])


@pytest.mark.parametrize("system_prompt", ["Think, then answer.", None])
def test_trl_rewards_in_a_real_training_step(tmp_path, system_prompt):
    names = sorted(n for n, (_, plain_ok) in TRL_SPECS.items() if system_prompt or plain_ok)
    specs = [TRL_SPECS[n][0] for n in names]
    tr = make_trainer(tmp_path, *_files_data(tmp_path, system_prompt), f"reward.functions={json.dumps(specs)}")
    history = tr.train()
    b = tr.last_batch
    assert isinstance(b.prompts[0], list) == bool(system_prompt)
    ids = [row[m].tolist() for row, m in zip(b.gen.completion_ids, b.gen.completion_mask)]
    for name, spec in zip(names, specs):
        want, logged = _trl_call(name, b.prompts, b.completions, ids, {"solution": b.columns["solution"]})
        _same(b.reward_columns[spec].tolist(), want)
        short = reward_names(specs)[spec]
        valid = [w for w in want if not math.isnan(w)]
        assert valid    # every solution parses, so no function is 'not applicable' everywhere
        assert history[-1][f"rewards/{short}/mean"] == pytest.approx(sum(valid) / len(valid), abs=1e-6)
        assert bool(logged) == (name in ("accuracy_reward", "reasoning_accuracy_reward"))
        for col, vals in logged.items():   # log_extra columns reach samples.jsonl, one value per sample
            assert b.logged[f"{short}/{col}"] == vals
    samples = [json.loads(line) for line in open(tmp_path / "samples.jsonl")]
    if system_prompt:
        assert samples[0]["logged"]["accuracy_reward/solution"] == b.columns["solution"][0]


PROGRESS = """
def progress(completions, completion_ids, trainer_state, log_metric, **kwargs):
    log_metric("progress/batch_size", len(completions))
    log_metric("reward", -1000.0)      # a built-in metric's name: the built-in value is kept
    log_metric("progress/epoch", trainer_state.epoch)
    return [trainer_state.global_step / trainer_state.max_steps + len(ids) for ids in completion_ids]
"""


def test_trainer_state_completion_ids_and_log_metric(tmp_path):
    (tmp_path / "progress.py").write_text(PROGRESS)
    tr = make_trainer(tmp_path, "train.max_steps=2", f"reward.functions=[{tmp_path / 'progress.py'}:progress]")
    history = tr.train()
    B = tr.cfg.rollout.prompts_per_step * tr.cfg.rollout.num_generations
    for step, m in enumerate(history):
        # reward = global_step / max_steps + completion length in tokens (stop token included)
        assert m["rewards/progress/mean"] == pytest.approx(step / 2 + m["completions/mean_length"], abs=1e-5)
        assert m["progress/batch_size"] == B
        assert m["reward"] == pytest.approx(m["rewards/progress/mean"], abs=1e-5)   # the only reward, weight 1
        # passes over the train prompts before this step: 2 prompts per step out of the rows kept
        assert m["progress/epoch"] == pytest.approx(step * 2 / tr.sampler.n)
    assert len({m["rewards/progress/mean"] - m["completions/mean_length"] for m in history}) == 2


def test_builtin_rewards_take_both_completion_forms():
    texts = ["#### 4", "so \\boxed{4}", "<think>a</think> <answer>4</answer>", "x" * 30, ""]
    chat = [[{"role": "user", "content": "q"}]] * len(texts)
    for name in ("gsm8k_accuracy", "math_accuracy", "format", "think_format", "length"):
        _, plain = score([name], None, ["q"] * len(texts), texts, {"answer": ["4"] * len(texts)})
        _, conv = score([name], None, chat, texts, {"answer": ["4"] * len(texts)})
        assert torch.equal(plain[name].nan_to_num(-9), conv[name].nan_to_num(-9)), name
    # the values differ between completions, so the comparison above means something
    assert score(["math_accuracy"], None, chat, texts, {"answer": ["4"] * 5})[1]["math_accuracy"].tolist() == \
        [1.0, 1.0, 0.0, 0.0, 0.0]


def test_completions_are_messages_only_for_conversational_prompts(monkeypatch):
    from grpolab import rewards
    seen = {}
    monkeypatch.setitem(rewards.REWARDS, "spy", lambda completions, **kw: seen.setdefault("c", completions) and
                        [0.0] * len(completions))
    score(["spy"], None, [[{"role": "user", "content": "q"}]], ["hi"], {})
    assert seen.pop("c") == [[{"role": "assistant", "content": "hi"}]]
    score(["spy"], None, ["q"], ["hi"], {})
    assert seen.pop("c") == ["hi"]


def test_reward_functions_cannot_edit_the_dataset_rows(monkeypatch):
    from grpolab import rewards

    def vandal(prompts, answer, **_):
        prompts[0].append({"role": "assistant", "content": "x"})
        answer[0] = "changed"
        return [0.0] * len(answer)
    monkeypatch.setitem(rewards.REWARDS, "vandal", vandal)
    prompt, answers = [{"role": "user", "content": "q"}], ["4"]
    score(["vandal"], None, [prompt], ["hi"], {"answer": answers})
    assert prompt == [{"role": "user", "content": "q"}] and answers == ["4"]


# ---- signatures that fit neither convention ------------------------------------------------------

@pytest.mark.slow
def test_misfit_signature_is_one_line_before_the_first_rollout(tmp_path):
    (tmp_path / "r.py").write_text("def gold(completions, gold_answer):\n    return [0.0] * len(completions)\n"
                                   "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                   "    return 0.0\n"
                                   "def textonly(text):\n    return 0.0\n")
    with pytest.raises(RewardError) as e:
        check_signatures([f"{tmp_path}/r.py:gold"], ["prompt", "answer", "solution"])
    msg = str(e.value)
    assert "\n" not in msg
    assert "needs 'gold_answer', which grpolab does not pass: it calls reward functions by keyword with prompts, " \
           "completions, completion_ids, trainer_state, log_extra, log_metric and the dataset columns " \
           "(answer, solution)" in msg and "add **kwargs" in msg
    with pytest.raises(RewardError, match=r"needs 'data_source', 'solution_str', 'ground_truth'.*prefix the spec "
                                          r"with 'verl:'"):
        check_signatures([f"{tmp_path}/r.py:compute_score"], ["answer"])
    with pytest.raises(RewardError, match=r"'verl:.*r.py:textonly' needs 'text', which grpolab does not pass: it "
                                          r"calls reward functions by keyword with data_source, solution_str, "
                                          r"ground_truth, extra_info; .*per-sample arguments"):
        get_reward(f"verl:{tmp_path}/r.py:textonly")
    # and through the CLI, before any rollout: one line, exit code 2 or 1, no traceback
    from conftest import run_cli
    res = run_cli("train", *TINY, f"train.output_dir={tmp_path / 'run'}", "sft.steps=0",
                  f"reward.functions=[{tmp_path}/r.py:gold]")
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "needs 'gold_answer'" in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_factory_call_specs(tmp_path):
    (tmp_path / "f.py").write_text(
        "calls = []\n"
        "def make(scale, offset=0.0):\n"
        "    calls.append(scale)\n"
        "    def scaled(completions, **kw):\n"
        "        return [scale * len(c) + offset for c in completions]\n"
        "    return scaled\n"
        "def not_a_factory(x):\n    return 3\n")
    spec = f"{tmp_path}/f.py:make(0.5, offset=1.0)"
    _, per = score([spec], None, ["p", "q"], ["ab", "abcd"], {})
    assert per[spec].tolist() == [2.0, 3.0]
    assert get_reward(spec) is get_reward(spec)          # made once: a stateful reward keeps its state
    with pytest.raises(RewardError, match=r"not_a_factory\(\.\.\.\) returned a int, not a function"):
        get_reward(f"{tmp_path}/f.py:not_a_factory(1)")
    with pytest.raises(RewardError, match=r"the arguments must be Python literals"):
        get_reward(f"{tmp_path}/f.py:make(scale=open)")
    with pytest.raises(RewardError, match=r"calling make\(\.\.\.\) raised TypeError"):
        get_reward(f"{tmp_path}/f.py:make(nope=1)")


def test_reward_names_stay_unique():
    specs = ["verl:a/gsm8k.py:compute_score", "verl:pkg.math_reward:compute_score",
             "m.py:g(a=1)", "m.py:g(a=2)", "trl.rewards:get_soft_overlong_punishment(max_completion_len=8, "
                                           "soft_punish_cache=2)", "format"]
    assert reward_names(specs) == {
        specs[0]: "gsm8k.compute_score", specs[1]: "math_reward.compute_score", specs[2]: "m.g", specs[3]: "m.g_2",
        specs[4]: "soft_overlong_punishment_reward", specs[5]: "format"}   # TRL's name: the made function's


# ---- verl ----------------------------------------------------------------------------------------

def _f32(values):
    """`values` as the float32 reward columns store them."""
    return torch.tensor(values, dtype=torch.float32).tolist()


def _verl(module):
    return pytest.importorskip(f"verl.utils.reward_score.{module}" if module else "verl.utils.reward_score")


GSM_COMPLETIONS = ["She has 29 eggs.\n#### 29", "#### 875", "#### 227.5", "The answer is 29", "#### -75",
                   "#### 126,000", "####29"]


def test_verl_gsm8k_scorer_unchanged(gsm8k_dir):
    gsm8k = _verl("gsm8k")
    from grpolab.data.tasks.gsm8k import load_gsm8k
    rows = load_gsm8k(str(gsm8k_dir), "train")
    rows = (rows + rows)[:len(GSM_COMPLETIONS)]
    cols = {k: [r.get(k) for r in rows] for k in ("answer", "solution")}
    for spec, kwargs in [("verl:verl.utils.reward_score.gsm8k:compute_score", {}),
                         ("verl:verl.utils.reward_score.gsm8k:compute_score(method='flexible', format_score=0.1)",
                          {"method": "flexible", "format_score": 0.1})]:
        _, per = score([spec], None, [r["prompt"] for r in rows], GSM_COMPLETIONS, cols)
        want = [float(gsm8k.compute_score(c, r["answer"], **kwargs)) for c, r in zip(GSM_COMPLETIONS, rows)]
        assert per[spec].tolist() == _f32(want)
        assert len(set(want)) >= 2, want


def test_verl_rows_ground_truth_and_data_source_dispatch(gsm8k_dir):
    rs = _verl(None)
    # verl's own row format: the reference in reward_model.ground_truth wins over an answer column
    cols = {"data_source": ["openai/gsm8k", "openai/gsm8k", "HuggingFaceH4/MATH-500", "HuggingFaceH4/MATH-500"],
            "reward_model": [{"ground_truth": "29", "style": "rule"}, {"ground_truth": "30", "style": "rule"},
                             {"ground_truth": "\\frac{1}{2}", "style": "rule"},
                             {"ground_truth": "\\frac{1}{2}", "style": "rule"}],
            "answer": ["30", "29", "0", "0"], "extra_info": [{"index": i} for i in range(4)]}
    completions = ["#### 29", "#### 29", "so \\boxed{\\frac{1}{2}}", "so \\boxed{\\frac{1}{3}}"]
    spec = "verl:verl.utils.reward_score:default_compute_score"
    _, per = score([spec], None, ["q"] * 4, completions, cols)
    want = [float(rs.default_compute_score(s, c, rm["ground_truth"], x)) for s, c, rm, x in
            zip(cols["data_source"], completions, cols["reward_model"], cols["extra_info"])]
    assert per[spec].tolist() == _f32(want) and want == [1.0, 0.0, 1.0, 0.0]


def test_verl_math_scorer_unchanged():
    math_reward = _verl("math_reward")
    completions = ["so \\boxed{\\frac{1}{2}}", "\\boxed{0.5}", "\\boxed{2}", "no box 2", "\\boxed{\\sqrt{2}}"]
    truths = ["\\frac{1}{2}", "\\frac{1}{2}", "2", "2", "\\sqrt{2}"]
    spec = "verl:verl.utils.reward_score.math_reward:compute_score"
    _, per = score([spec], None, ["q"] * 5, completions, {"answer": truths})
    want = [float(math_reward.compute_score(c, t)) for c, t in zip(completions, truths)]
    assert per[spec].tolist() == _f32(want) and len(set(want)) == 2


VERL_FILE = """
calls = []

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    calls.append(extra_info)
    extra_info["seen"] = True          # verl hands each call its own dict
    return {"score": len(solution_str) / 10, "length": len(solution_str),
            "right_source": data_source == "openai/gsm8k", "has_truth": ground_truth is not None, "note": "n",
            "verl_keys": "num_turns" in extra_info and extra_info["rollout_reward_scores"] == {}, "mean": -5.0}

def batch_score(data_sources, solution_strs, ground_truths, extra_infos, bonus=0.0):
    return [len(s) / 10 + bonus for s in solution_strs]

async def async_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str.count("#"))
"""


def test_verl_custom_dict_batch_and_async_in_a_training_step(tmp_path, gsm8k_dir):
    (tmp_path / "my_reward.py").write_text(VERL_FILE)
    f = tmp_path / "my_reward.py"
    specs = [f"verl:{f}:compute_score", f"verl:{f}:batch_score(bonus=1.0)", f"verl:{f}:async_score"]
    tr = make_trainer(tmp_path, "data.task=gsm8k", f"data.train_path={gsm8k_dir}", "data.max_prompt_length=0",
                      "model.block_size=256", "train.max_steps=1", "log.samples_every=1",
                      f"reward.functions={json.dumps(specs)}")
    m = tr.train()[-1]
    b = tr.last_batch
    lengths = [len(c) for c in b.completions]
    assert b.reward_columns[specs[0]].tolist() == pytest.approx([n / 10 for n in lengths])
    assert b.reward_columns[specs[1]].tolist() == pytest.approx([n / 10 + 1.0 for n in lengths])
    assert b.reward_columns[specs[2]].tolist() == [float(c.count("#")) for c in b.completions]
    # the dict's other numeric keys are logged as rewards/<name>/<key>, means over the samples
    assert m["rewards/compute_score/length"] == pytest.approx(sum(lengths) / len(lengths))
    assert m["rewards/compute_score/right_source"] == 1.0 and m["rewards/compute_score/has_truth"] == 1.0
    assert m["rewards/compute_score/verl_keys"] == 1.0
    # an extra key named 'mean' does not overwrite the reward's own mean
    assert m["rewards/compute_score/mean"] == pytest.approx(sum(lengths) / len(lengths) / 10, abs=1e-6)
    assert "rewards/compute_score/note" not in m
    first = json.loads(open(tmp_path / "samples.jsonl").readline())
    assert first["logged"]["compute_score/note"] == "n" and first["logged"]["compute_score/length"] == lengths[0]
    # rows that carry extra_info: the function writing into it edits neither the rows nor another call's dict
    infos = [{"index": 0}, {"index": 1}]
    import importlib
    mod = importlib.import_module(get_reward(specs[0]).verl_function.__module__)
    mod.calls.clear()
    score([specs[0]], None, ["q", "q"], ["a", "b"], {"answer": ["1", "2"], "extra_info": infos})
    assert infos == [{"index": 0}, {"index": 1}]
    assert [c["index"] for c in mod.calls] == [0, 1] and mod.calls[0] is not mod.calls[1]


def test_verl_dict_without_score_is_one_line(tmp_path):
    (tmp_path / "v.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                   "    return {'acc': 1.0}\n")
    with pytest.raises(RewardError, match=r"returned a dict without 'score' for sample 0 \(keys \['acc'\]\)"):
        score([f"verl:{tmp_path}/v.py:compute_score"], None, ["q"], ["x"], {"answer": ["1"]})


def test_dataset_column_named_like_an_argument_is_an_error():
    with pytest.raises(RewardError, match=r"dataset column 'completions' has the name of an argument grpolab "
                                          r"passes .*rename the column"):
        score(["length"], None, ["q"], ["x"], {"completions": ["y"]})
    with pytest.raises(RewardError, match=r"dataset column 'trainer_state'"):
        check_signatures(["length"], ["prompt", "trainer_state"])


def test_rows_get_a_data_source_unless_they_have_one(tmp_path, gsm8k_dir):
    from grpolab.config.load import load_config
    from grpolab.jobs.inputs import load_data
    path = _write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "a", "answer": "1"},
                                                  {"prompt": "b", "answer": "2", "data_source": "mine"}])
    for overrides, want in [(["data.train_size=5", "data.test_size=3"], ["grpolab/arithmetic"]),
                            (["data.task=gsm8k", f"data.train_path={gsm8k_dir}"], ["openai/gsm8k"]),
                            (["data.task=files", f"data.train_path={path}", f"data.test_path={path}"],
                             [path, "mine"])]:
        train, test = load_data(load_config(None, overrides))
        assert sorted({r["data_source"] for r in train + test}) == sorted(want), overrides


def _docs_reward_yaml():
    import re

    import yaml
    from conftest import ROOT
    blocks = re.findall(r"```yaml\n(.*?)```", (ROOT / "docs" / "hf.md").read_text(), re.S)
    block = next(b for b in blocks if "trl.rewards:think_format_reward" in b)
    return yaml.safe_load(block)


def test_docs_trl_and_verl_example_trains(tmp_path, gsm8k_dir):
    pytest.importorskip("verl.utils.reward_score.gsm8k")
    ex = _docs_reward_yaml()
    specs = ex["reward"]["functions"]
    tr = make_trainer(tmp_path, "data.task=gsm8k", f"data.train_path={gsm8k_dir}", "data.max_prompt_length=0",
                      "model.block_size=256", "train.max_steps=1", f"reward.functions={json.dumps(specs)}",
                      f"reward.weights={json.dumps(ex['reward']['weights'])}",
                      f"data.system_prompt={ex['data']['system_prompt']}")
    m = tr.train()[-1]
    b = tr.last_batch
    assert isinstance(b.prompts[0], list)       # chat prompts, so TRL's functions get messages
    names = reward_names(specs)
    gsm8k = _verl("gsm8k")
    ids = b.completion_id_lists()
    for spec in specs:
        if spec.startswith("verl:"):
            want = [float(gsm8k.compute_score(c, a)) for c, a in zip(b.completions, b.columns["answer"])]
        else:
            name = next(n for n, (s, _) in TRL_SPECS.items() if s.split("(")[0] == spec.split("(")[0])
            assert spec == TRL_SPECS[name][0] or name == "get_soft_overlong_punishment"
            fn = _trl_function(name) if spec == TRL_SPECS[name][0] else \
                trl_rewards.get_soft_overlong_punishment(max_completion_len=64, soft_punish_cache=16)
            msgs = [[{"role": "assistant", "content": c}] for c in b.completions]
            want = [math.nan if v is None else float(v) for v in
                    fn(prompts=b.prompts, completions=msgs, completion_ids=ids, **b.columns)]
        _same(b.reward_columns[spec].tolist(), want)
        assert f"rewards/{names[spec]}/mean" in m


def test_columns_trl_does_not_pass_are_not_passed(monkeypatch):
    from grpolab import rewards
    seen = {}
    monkeypatch.setitem(rewards.REWARDS, "spy", lambda completions, **kw: seen.update(kw) or [0.0])
    score(["spy"], None, ["q"], ["sampled"], {"prompt": ["q"], "completion": ["reference"], "answer": ["1"],
                                              "completion_ids": [[7]]})
    assert "prompt" not in seen and "completion" not in seen and seen["answer"] == ["1"]
    assert seen["completion_ids"] == [[]]     # grpolab's (none given here), not the dataset's column


def test_reward_spec_mistakes_are_config_errors():
    from grpolab.config.load import load_config
    from grpolab.errors import ConfigError
    with pytest.raises(ConfigError, match=r"reward.functions: reward 'm:f\(x=open\)': the arguments must be "
                                          r"Python literals"):
        load_config(None, ['reward.functions=["m:f(x=open)"]'])
    with pytest.raises(ConfigError, match=r"reward.functions: a reward is listed twice"):
        load_config(None, ["reward.functions=[format, format]"])
    # the docs' quoting (docs/hf.md): a spec with commas inside one quoted list item stays one spec
    cfg = load_config(None, ['reward.functions=["trl.rewards:get_repetition_penalty_reward(ngram_size=3, '
                             'max_penalty=-1.0)"]'])
    assert cfg.reward.functions == ["trl.rewards:get_repetition_penalty_reward(ngram_size=3, max_penalty=-1.0)"]


ECHO = """
calls = []

def echo(completions, log_extra, **kwargs):
    calls.append(len(completions))
    log_extra("text", list(completions))
    # first round: only the first group (4 completions) varies, so dynamic sampling keeps one group and
    # samples again; later rounds: every group varies
    return [float(sum(map(ord, c)) % 7) if len(calls) > 1 or i < 4 else 0.0 for i, c in enumerate(completions)]
"""


def test_logged_columns_stay_aligned_through_dynamic_sampling(tmp_path):
    (tmp_path / "echo.py").write_text(ECHO)
    spec = f"{tmp_path / 'echo.py'}:echo"
    tr = make_trainer(tmp_path, "algorithm.dynamic_sampling=true", "algorithm.max_sampling_rounds=3",
                      "rollout.prompts_per_step=3", f"reward.functions=[{spec}]")
    assert tr.cfg.rollout.num_generations == 4
    batch, stats = tr.collect()
    assert stats["dynamic_sampling/rounds"] == 2 and len(batch) == 3 * 4
    # rows were filtered and concatenated across rounds: each logged value is still its own completion's
    assert batch.logged["echo/text"] == batch.completions
    assert batch.reward_columns[spec].tolist() == [float(sum(map(ord, c)) % 7) for c in batch.completions]


UNSCORED = """
def sometimes(completions, **kwargs):
    # None ('not applicable') for completions of even length: those rows are scored by no function
    return [None if len(c) % 2 == 0 else float(len(c) % 5) for c in completions]
"""


def test_rows_no_function_scored_are_out_of_the_baseline(tmp_path):
    (tmp_path / "s.py").write_text(UNSCORED)
    tr = make_trainer(tmp_path, "rollout.prompts_per_step=4", f"reward.functions=[{tmp_path / 's.py'}:sometimes]")
    batch, _ = tr.collect()
    tr.advantages(batch, None)
    ok = [len(c) % 2 == 1 for c in batch.completions]
    assert 0 < sum(ok) < len(ok) and batch.scorable.tolist() == ok
    eps = tr.cfg.algorithm.adv_eps
    for g in batch.group_ids.unique().tolist():
        rows = [i for i in range(len(batch)) if batch.group_ids[i] == g]
        vals = [float(len(batch.completions[i]) % 5) for i in rows if ok[i]]
        mean = sum(vals) / len(vals) if vals else 0.0
        std = (sum((v - mean) ** 2 for v in vals) / len(vals)) ** 0.5 if vals else 0.0
        for i in rows:   # TRL's rule: unscorable rows get 0; the others are z-scored among the scorable
            want = 0.0 if not ok[i] or len(vals) < 2 or std == 0 else \
                (len(batch.completions[i]) % 5 - mean) / (std + eps)
            assert float(batch.advantages[i]) == pytest.approx(want, abs=1e-5), (g, i)


ASYNC_LOCKED = """
import asyncio
lock = None

async def locked(completions, **kwargs):
    global lock
    lock = lock or asyncio.Lock()      # bound to the loop of the first call, as a client or semaphore would be
    async with lock:
        await asyncio.sleep(0)
    return [1.0] * len(completions)
"""


def test_async_reward_state_survives_across_steps(tmp_path):
    (tmp_path / "a.py").write_text(ASYNC_LOCKED)
    for _ in range(3):
        _, per = score([f"{tmp_path}/a.py:locked"], None, ["q"], ["x"], {})
        assert per[f"{tmp_path}/a.py:locked"].tolist() == [1.0]


def test_tensor_and_numpy_returns_are_taken_as_trl_takes_them(monkeypatch):
    import numpy as np

    from grpolab import rewards
    monkeypatch.setitem(rewards.REWARDS, "t", lambda completions, **kw: torch.tensor([1.5, 2.0]))
    monkeypatch.setitem(rewards.REWARDS, "n", lambda completions, **kw: np.array([0.5, 1.0]))
    monkeypatch.setitem(rewards.REWARDS, "s", lambda completions, log_metric, **kw:
                        log_metric("m", torch.tensor(3.0)) or [np.float32(0.25), torch.tensor(1.0)])
    log = RewardLog(2)
    _, per = score(["t", "n", "s"], None, ["a", "b"], ["x", "y"], {}, log=log)
    assert [per[k].tolist() for k in "tns"] == [[1.5, 2.0], [0.5, 1.0], [0.25, 1.0]]
    assert log.mean_metrics() == {"m": 3.0}


def test_misspelt_verl_reward_kwargs_are_an_error():
    _verl("gsm8k")
    with pytest.raises(RewardError, match=r"compute_score takes no argument 'format_scor'; check the spelling"):
        get_reward("verl:verl.utils.reward_score.gsm8k:compute_score(format_scor=0.5)")
