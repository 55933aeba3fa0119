import functools
import json
import sys

import pytest
import torch
from conftest import GSM8K_DIR, GSM8K_SAMPLE

from grpolab.data.answers import extract_hash_answer
from grpolab.data.tasks.gsm8k import load_gsm8k
from grpolab.errors import RewardError, UnknownRewardError
from grpolab.rewards import REWARDS, get_reward, reward_name
from grpolab.rewards.accuracy import gsm8k_accuracy, math_accuracy
from grpolab.rewards.combine import score
from grpolab.rewards.format import boxed_content, think_format
from grpolab.rewards.length import length, make_length_reward
from grpolab.rewards.model import reward_model


@pytest.mark.parametrize("completion,answer,want", [
    ("2+3=5\n#### 5", "#### 5", 1.0),
    ("#### 1,234", "1234", 1.0),
    ("#### $1,234.00.", "#### 1234", 1.0),
    ("####   -7  ", "-7", 1.0),
    ("#### 7 apples", "7", 1.0),
    ("#### 3.50", "3.5", 1.0),
    ("#### 5\n#### 6", "6", 1.0),       # the last '####' counts
    ("#### 5\n#### 6", "5", 0.0),
    ("the answer is 5", "5", 0.0),      # no '####' line
    ("####", "5", 0.0),                  # '####' with no number
    ("#### -5", "5", 0.0),
    ("#### 12", "Natalia sold 48/2 = 24 clips.\n#### 72", 0.0),
    ("#### 72", "Natalia sold 48/2 = 24 clips.\n#### 72", 1.0),
    ("", "0", 0.0),
])
def test_gsm8k_accuracy_tricky_answers(completion, answer, want):
    assert gsm8k_accuracy(["p"], [completion], [answer]) == [want]


def gsm8k_test_file(source: str, gsm8k_dir):
    """A GSM8K test.jsonl: the sample the gsm8k_dir fixture writes, or the shared real file."""
    return (gsm8k_dir if source == "sample" else GSM8K_DIR) / "test.jsonl"


def gsm8k_references(source: str, gsm8k_dir, n: int) -> list[str]:
    """The first `n` worked solutions ('... #### N') of that file, read as plain JSON."""
    refs = [json.loads(line)["answer"] for line in gsm8k_test_file(source, gsm8k_dir).open()][:n]
    assert len(refs) == (len(GSM8K_SAMPLE["test"]) if source == "sample" else n)
    return refs


ON_REAL_GSM8K = pytest.param("real", marks=pytest.mark.skipif(not (GSM8K_DIR / "test.jsonl").exists(),
                                                              reason="shared GSM8K files not present"))


@pytest.mark.parametrize("source", ["sample", ON_REAL_GSM8K])
def test_gsm8k_accuracy_on_gsm8k_references(source, gsm8k_dir):
    refs = gsm8k_references(source, gsm8k_dir, 200)
    finals = [r.split("####")[-1].strip() for r in refs]          # as written: '13,500', '-1,250'
    assert gsm8k_accuracy(None, [f"#### {f}" for f in finals], refs) == [1.0] * len(refs)
    wrong = [f"#### {extract_hash_answer(r) + 1}" for r in refs]
    assert gsm8k_accuracy(None, wrong, refs) == [0.0] * len(refs)
    # the loader's canonical 'answer' column is the same reference as the full solution
    rows = load_gsm8k(str(gsm8k_test_file(source, gsm8k_dir)))[:len(refs)]
    assert [r["solution"] for r in rows] == refs
    assert gsm8k_accuracy(None, [f"#### {f}" for f in finals], [r["answer"] for r in rows]) == [1.0] * len(refs)
    assert gsm8k_accuracy(None, wrong, [r["answer"] for r in rows]) == [0.0] * len(refs)


def test_format_reward_and_registry():
    fmt = get_reward("format")
    assert fmt(None, ["1+1=2\n#### 2", "#### x", "2", "#### -3.", "so the answer #### 5", "#### 5\n#### x"]) == \
        [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    with pytest.raises(KeyError, match="unknown reward 'nope'.*gsm8k_accuracy"):
        get_reward("nope")


def test_weighted_sum_and_none_means_not_applicable(monkeypatch):
    from grpolab import rewards
    monkeypatch.setitem(rewards.REWARDS, "half", lambda prompts, completions, **_: [None, 0.5])
    total, per = score(["gsm8k_accuracy", "half"], [2.0, 1.0], ["a", "b"], ["#### 1", "#### 3"],
                       {"answer": ["1", "2"]})
    assert total.tolist() == [2.0, 0.5]
    assert per["gsm8k_accuracy"].tolist() == [1.0, 0.0]
    assert per["half"][0].isnan() and per["half"][1] == 0.5


@pytest.mark.parametrize("fn,msg", [
    (lambda prompts, completions, **_: 1 / 0, r"'bad' raised ZeroDivisionError"),
    (lambda prompts, completions, **_: [1.0], r"'bad' returned 1 values for 2 completions"),
    (lambda prompts, completions, **_: [1.0, float("nan")], r"'bad' returned nan for sample 1"),
    (lambda prompts, completions, **_: ["x", 1.0], r"'bad' returned 'x' for sample 0"),
])
def test_reward_errors_name_the_function_and_sample(monkeypatch, fn, msg):
    from grpolab import rewards
    monkeypatch.setitem(rewards.REWARDS, "bad", fn)
    with pytest.raises(RewardError, match=msg):
        score(["bad"], None, ["a", "b"], ["x", "y"], {})


# ---- math_accuracy (math-verify) ---------------------------------------------------------------

NATALIA = "Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips altogether.\n#### 72"


@pytest.mark.parametrize("completion,answer,want", [
    ("The answer is \\boxed{1/2}.", "0.5", 1.0),
    ("\\boxed{\\frac{3}{4}}", "3/4", 1.0),
    ("So it is $\\frac{3}{4}$", "\\frac{3}{4}", 1.0),
    ("#### 0.5", "\\frac12", 1.0),                 # bare LaTeX reference
    ("\\boxed{\\sqrt{2}}", "\\sqrt 2", 1.0),
    ("#### 1,234", "1234", 1.0),
    ("#### 1234", "1,234", 1.0),
    ("#### 1,234", "Step one.\n#### 1234", 1.0),   # GSM8K-style reference
    ("#### 72", NATALIA, 1.0),
    ("#### 24", NATALIA, 0.0),                     # 24 appears in the solution, but not after ####
    ("#### -1,000", "-1000", 1.0),
    ("\\boxed{-7}", "-7", 1.0),
    ("\\boxed{7}", "-7", 0.0),
    ("#### 3.50", "3.5", 1.0),
    ("#### 3.05", "3.5", 0.0),
    ("#### 0.333", "1/3", 0.0),
    ("#### $18", "18", 1.0),
    ("#### \\$18.00", "18", 1.0),
    ("The total is $18.", "18", 1.0),
    ("#### 5\n#### 6", "6", 1.0),                  # the last '####' counts
    ("#### 5\n#### 6", "5", 0.0),
    ("\\boxed{5}\n#### 6", "6", 1.0),              # '####' wins over \boxed
    ("\\boxed{5}\n#### 6", "5", 0.0),
    ("\\boxed{2.5}", 2.5, 1.0),                    # non-string reference
    ("I don't know", "5", 0.0),                    # no answer
    ("", "0", 0.0),
    ("\\frac{{{{(((( \\boxed{", "5", 0.0),          # garbage
])
def test_math_accuracy_tricky_answers(completion, answer, want):
    assert math_accuracy(["p"], [completion], [answer]) == [want]


def test_math_accuracy_batch_and_unparseable_reference_is_not_applicable():
    got = math_accuracy(None, ["\\boxed{4}", "#### 4", "#### 5"], ["4", "", "4"])
    assert got == [1.0, None, 0.0]
    assert get_reward("math_accuracy") is math_accuracy


def test_math_accuracy_off_the_main_thread():
    # math-verify's signal-based timeout cannot be installed outside the main thread
    import threading
    out = {}
    t = threading.Thread(target=lambda: out.update(r=math_accuracy(None, ["\\boxed{1/2}", "#### 3"], ["0.5", "4"])))
    t.start()
    t.join(30)
    assert out["r"] == [1.0, 0.0]


@pytest.mark.parametrize("source", ["sample", ON_REAL_GSM8K])
def test_math_accuracy_on_gsm8k_references(source, gsm8k_dir):
    refs = gsm8k_references(source, gsm8k_dir, 40)
    finals = [r.split("####")[-1].strip() for r in refs]
    assert math_accuracy(None, [f"so the answer is \\boxed{{{f}}}" for f in finals], refs) == [1.0] * len(refs)
    assert math_accuracy(None, [f"#### {f}" for f in finals], refs) == [1.0] * len(refs)
    wrong = [f"#### {extract_hash_answer(r) + 1}" for r in refs]
    assert math_accuracy(None, wrong, refs) == [0.0] * len(refs)


# ---- think_format --------------------------------------------------------------------------------

@pytest.mark.parametrize("completion,want", [
    ("<think>a</think><answer>b</answer>", 1.0),
    ("  <think>\nlet me see\n</think>\n\n<answer> 5 </answer>\n", 1.0),
    ("<think></think> <answer></answer>", 1.0),
    ("<think>a</think><answer>b</answer> extra", 0.0),     # trailing text
    ("ok <think>a</think><answer>b</answer>", 0.0),        # leading text
    ("<think>a</think> so <answer>b</answer>", 0.0),       # text between the blocks
    ("<answer>b</answer><think>a</think>", 0.0),           # wrong order
    ("<think>a</think>", 0.0),                             # no answer
    ("<answer>b</answer>", 0.0),                           # no think
    ("<think>a</think><think>c</think><answer>b</answer>", 0.0),
    ("<think>a <think> b</think><answer>b</answer>", 0.0),  # a tag twice
    ("<think>a</think><answer>b</answer></answer>", 0.0),
    ("<THINK>a</THINK><answer>b</answer>", 0.0),
    ("<think>a<answer>b</answer>", 0.0),
    ("", 0.0),
])
def test_think_format(completion, want):
    assert think_format(None, [completion]) == [want]
    assert get_reward("think_format")(None, [completion]) == [want]


# ---- length --------------------------------------------------------------------------------------

def test_length_reward():
    assert length(None, ["x" * 50, "", "x" * 75, "x" * 100, "x" * 25]) == [0.0, -1.0, -0.5, -1.0, -0.5]
    assert length(None, ["abcde", "abcdefghijklmno"], target_length=10) == [-0.5, -0.5]
    assert length(None, ["ab", "ab"], target_length=[2, 4]) == [0.0, -0.5]   # as a dataset column
    assert make_length_reward(4)(None, ["abcd", "ab"], target_length=99) == [0.0, -0.5]
    assert make_length_reward(4).__name__ == "length_4"
    with pytest.raises(ValueError, match=r"target must be > 0, got 0"):
        make_length_reward(0)
    total, per = score(["length"], [2.0], ["p"], ["x" * 40], {})
    assert total.tolist() == pytest.approx([-0.4]) and per["length"].tolist() == pytest.approx([-0.2])


# ---- registry, names ---------------------------------------------------------------------------

def test_registry_names_and_unknown_spec_message():
    assert set(REWARDS) >= {"gsm8k_accuracy", "format", "math_accuracy", "think_format", "length"}
    with pytest.raises(RewardError, match=r"unknown reward 'nope'.*math_accuracy.*module:function.*file\.py"
                                          r":function.*rm:") as info:
        get_reward("nope")
    assert isinstance(info.value, KeyError) and isinstance(info.value, UnknownRewardError)
    assert str(info.value).startswith("unknown reward")       # no KeyError quoting
    assert reward_name("math_accuracy") == "math_accuracy"
    assert reward_name("my/rewards.py:exclaim") == "exclaim"
    assert reward_name("pkg.mod:judge") == "judge"
    assert reward_name("rm:OpenAssistant/reward-model-deberta") == "rm_reward-model-deberta"
    assert reward_name("rm:./models/my rm/") == "rm_my_rm"


# ---- custom functions ----------------------------------------------------------------------------

EXCLAIM = "def exclaim(prompts, completions, **_):\n    return [float(c.count('!')) for c in completions]\n"


def test_custom_function_from_relative_file(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "my_rewards.py").write_text(EXCLAIM + "LIMIT = 3\n")
    monkeypatch.chdir(tmp_path)
    fn = get_reward("sub/my_rewards.py:exclaim")
    assert fn(None, ["hi!", "a!!b!"]) == [1.0, 3.0]
    assert get_reward(str(tmp_path / "sub" / "my_rewards.py") + ":exclaim") is fn   # loaded once
    total, per = score(["sub/my_rewards.py:exclaim", "length"], [1.0, 0.0], ["p", "q"], ["!", "!!"], {})
    assert total.tolist() == [1.0, 2.0]
    assert list(per) == ["sub/my_rewards.py:exclaim", "length"]            # keyed by the spec as given
    with pytest.raises(RewardError, match=r"'sub/my_rewards.py:nope'.*no attribute 'nope'.*exclaim"):
        get_reward("sub/my_rewards.py:nope")
    with pytest.raises(RewardError, match=r"'sub/my_rewards.py:LIMIT': 'LIMIT' is not callable \(it is a int"):
        get_reward("sub/my_rewards.py:LIMIT")


def test_custom_function_from_module_on_sys_path(tmp_path, monkeypatch):
    (tmp_path / "grpolab_test_rewardmod.py").write_text(EXCLAIM)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "grpolab_test_rewardmod", raising=False)
    try:
        assert get_reward("grpolab_test_rewardmod:exclaim")(None, ["!!"]) == [2.0]
    finally:
        sys.modules.pop("grpolab_test_rewardmod", None)


@pytest.mark.parametrize("spec,msg", [
    ("missing_file.py:fn", r"reward 'missing_file.py:fn': file 'missing_file.py' not found .*relative to the "
                           r"current directory"),
    ("grpolab_no_such_module_xyz:fn", r"'grpolab_no_such_module_xyz:fn': cannot import module "
                                      r"'grpolab_no_such_module_xyz' \(ModuleNotFoundError.*PYTHONPATH"),
    ("json:no_such_fn", r"'json:no_such_fn': module 'json' has no attribute 'no_such_fn'; functions defined "
                        r"there: .*dumps"),
    ("math:pi", r"'math:pi': 'pi' is not callable \(it is a float object\)"),
    ("broken.py:fn", r"'broken.py:fn': importing .*broken.py raised ZeroDivisionError: division by zero; fix"),
    ("broken.py:", r"'broken.py:': not a custom function spec"),
])
def test_custom_function_load_errors(tmp_path, monkeypatch, spec, msg):
    (tmp_path / "broken.py").write_text("x = 1 / 0\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RewardError, match=msg) as info:
        get_reward(spec)
    assert "\n" not in str(info.value)


def test_custom_function_errors_name_the_function_and_sample(tmp_path, monkeypatch):
    (tmp_path / "picky.py").write_text(
        "def picky(prompts, completions, **_):\n"
        "    return [1.0 / len(c) for c in completions]\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RewardError, match=r"'picky.py:picky' raised ZeroDivisionError: .* on sample 2 "
                                          r"\(completion ''\)"):
        score(["picky.py:picky"], None, ["a", "b", "c"], ["x", "yy", ""], {})
    # a callable that does not follow the contract fails with its spec named
    with pytest.raises(RewardError, match=r"reward function 'json:dumps' needs 'obj', which grpolab does not pass: "
                                          r"it calls reward functions by keyword with prompts, completions, "
                                          r"completion_ids, trainer_state, log_extra, log_metric and the dataset "
                                          r"columns \(none\)"):
        score(["json:dumps"], None, ["a"], ["x"], {})


def test_weights_must_match_functions():
    with pytest.raises(RewardError, match="2 reward weights for 1 reward functions"):
        score(["length"], [1.0, 2.0], ["a"], ["x"], {})


# ---- async reward functions ----------------------------------------------------------------------

def test_async_reward_functions_run_concurrently(monkeypatch):
    import asyncio
    import time

    from grpolab import rewards

    async def slow_a(prompts, completions, answer, **_):
        await asyncio.sleep(0.2)
        return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]

    async def slow_b(prompts, completions, **_):
        await asyncio.sleep(0.2)
        return [None, 0.25]

    monkeypatch.setitem(rewards.REWARDS, "slow_a", slow_a)
    monkeypatch.setitem(rewards.REWARDS, "slow_b", slow_b)
    t0 = time.perf_counter()
    total, per = score(["slow_a", "length", "slow_b"], [1.0, 0.0, 2.0], ["p", "q"], ["x", "y"],
                       {"answer": ["x", "z"]})
    elapsed = time.perf_counter() - t0
    assert elapsed < 0.35, f"async rewards ran one after another ({elapsed:.2f}s)"
    assert total.tolist() == [1.0, 0.5]
    assert per["slow_a"].tolist() == [1.0, 0.0] and per["slow_b"][0].isnan()


def test_async_reward_errors_name_the_function(monkeypatch):
    from grpolab import rewards

    async def bad(prompts, completions, **_):
        if "boom" in completions:
            raise ValueError("no")
        return [0.0] * len(completions)

    async def short(prompts, completions, **_):
        return [0.0]

    monkeypatch.setitem(rewards.REWARDS, "bad_async", bad)
    monkeypatch.setitem(rewards.REWARDS, "short_async", short)
    with pytest.raises(RewardError, match=r"'bad_async' raised ValueError: no on sample 1"):
        score(["bad_async"], None, ["a", "b"], ["ok", "boom"], {})
    with pytest.raises(RewardError, match=r"'short_async' returned 1 values for 2 completions"):
        score(["short_async"], None, ["a", "b"], ["x", "y"], {})


# ---- reward models -------------------------------------------------------------------------------

RM_WORDS = ["the", "cat", "sat", "on", "mat", "dog", "ran", "a", "big", "red", "hi", "hello", "<|user|>",
            "<|assistant|>"]


@pytest.fixture(scope="module")
def tiny_rm_dir(tmp_path_factory):
    """A tiny Llama sequence classifier + word-level tokenizer (no pad token) saved to disk."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "<s>", "</s>"] + RM_WORDS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", bos_token="<s>", eos_token="</s>")
    tok.chat_template = "{% for m in messages %}<|{{ m.role }}|> {{ m.content }} {% endfor %}"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=None,
                      max_position_embeddings=64)
    model = LlamaForSequenceClassification(cfg).eval()
    path = tmp_path_factory.mktemp("rm") / "tiny-rm"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@functools.lru_cache(maxsize=None)
def _plain_model(path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    return AutoModelForSequenceClassification.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def _plain_score(path, text: str) -> float:
    """logits[0, 0] of one unpadded sequence, straight from transformers."""
    model, tok = _plain_model(path)
    ids = tok(text, return_tensors="pt")["input_ids"]
    assert (ids != tok.unk_token_id).all(), text        # the test texts only use known words
    with torch.no_grad():
        return float(model(input_ids=ids).logits[0, 0])


def test_reward_model_scores_match_unbatched_forward(tiny_rm_dir, monkeypatch):
    monkeypatch.chdir(tiny_rm_dir.parent)
    spec = "rm:tiny-rm"
    fn = get_reward(spec)
    assert get_reward(f"rm:{tiny_rm_dir}") is fn and get_reward(spec) is fn     # loaded once
    assert fn.model.config.pad_token_id == fn.tokenizer.eos_token_id
    assert reward_name(spec) == "rm_tiny-rm"
    prompts = ["the cat", "a big red dog", "hi", "the dog ran on the mat"]
    completions = [" sat on the mat", " ran", " hello hello hello the cat sat", ""]
    want = [_plain_score(tiny_rm_dir, p + c) for p, c in zip(prompts, completions)]
    assert len(set(want)) == len(want)                   # the texts really score differently
    assert fn(prompts, completions) == pytest.approx(want, abs=1e-5)
    for bs in (1, 3):                                    # padded batches of other shapes agree too
        assert reward_model(str(tiny_rm_dir), batch_size=bs)(prompts, completions) == pytest.approx(want, abs=1e-5)
    monkeypatch.setattr(fn.tokenizer, "padding_side", "left")   # left padding relies on the attention mask
    assert fn(prompts, completions) == pytest.approx(want, abs=1e-5)
    total, per = score([spec], [2.0], prompts, completions, {"answer": ["x"] * 4})
    assert per[spec].tolist() == pytest.approx(want, abs=1e-5)
    assert total.tolist() == pytest.approx([2 * w for w in want], abs=1e-5)


def test_reward_model_uses_chat_template_for_messages(tiny_rm_dir):
    fn = get_reward(f"rm:{tiny_rm_dir}")
    prompts = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "the cat"}]]
    got = fn(prompts, ["hello", "sat on a mat"])
    want = [_plain_score(tiny_rm_dir, "<|user|> hi <|assistant|> hello "),
            _plain_score(tiny_rm_dir, "<|user|> the cat <|assistant|> sat on a mat ")]
    assert got == pytest.approx(want, abs=1e-5)


def test_reward_model_missing_directory():
    with pytest.raises(RewardError, match=r"'rm:./no/such/rm': directory './no/such/rm' not found"):
        get_reward("rm:./no/such/rm")


@pytest.mark.parametrize("completion, want", [
    ("so the answer is \\boxed{4}.", 1.0),
    ("\\boxed{\\frac{1}{2}}", 1.0),                      # nested braces
    ("\\boxed{}", 0.0),                                  # empty
    ("\\boxed{ }", 0.0),
    ("\\boxed{3", 0.0),                                  # never closed
    ("\\boxed{2} then \\boxed{", 1.0),                   # the last complete one counts
    ("the answer is 4", 0.0),
    ("\\fbox{4}", 0.0),
])
def test_boxed_format(completion, want):
    assert get_reward("boxed_format")(None, [completion]) == [want]
    assert REWARDS["boxed_format"](None, [[{"role": "assistant", "content": completion}]]) == [want]


def test_boxed_content_balances_nested_braces():
    text = "first \\boxed{1}, finally \\boxed{\\sqrt{2}+\\frac{3}{4}} done"
    assert boxed_content(text) == "\\sqrt{2}+\\frac{3}{4}"
    assert boxed_content("\\boxed{a} and \\boxed{b{c}") == "a"      # the last one never closes
