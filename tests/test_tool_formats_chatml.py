"""Hermes-style tools on a ChatML template that has none: SmolLM2-135M-Instruct's own tokenizer and template
(a plain <|im_start|>role ... <|im_end|> template that never reads `tools`). The tools go at the end of the
system message, calls are <tool_call>{json}</tool_call>, results a `user` turn of <tool_response> blocks,
checked here against conversations written out by hand. Templates that cannot carry tools stop the run
when the format is built, through the real CLI too, before any rollout."""

import json
import shutil
import sys

import pytest
import torch
from conftest import ROOT, run_cli

from grpolab.errors import ConfigError
from grpolab.models.hf import HFTokenizer, load_hf
from grpolab.models.logprobs import completion_logprobs
from grpolab.models.tiny_hf import save_tiny_model
from grpolab.rollout.engine import generate
from grpolab.rollout.keys import completion_keys
from grpolab.rollout.tool_decode import ToolUse
from grpolab.rollout.tool_formats import HermesFormat, is_chatml, tool_format
from grpolab.rollout.tools import CallRecord, ToolRunner, load_tools

sys.path.insert(0, str(ROOT / "scripts"))
import fetch_smollm2  # noqa: E402

SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"   # its template's default
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'


def tools_block(schemas: list[dict]) -> str:
    """The system-message block grpolab adds, written out plainly."""
    listed = "".join("\n" + json.dumps(s, ensure_ascii=False) for s in schemas)
    return ("# Tools\n\nYou can call the functions whose JSON schemas are listed inside <tools></tools>:\n<tools>"
            + listed + "\n</tools>\n\nTo call one, write its name and arguments as a JSON object inside "
            "<tool_call></tool_call> and end your turn:\n<tool_call>\n{\"name\": <function name>, \"arguments\": "
            "<arguments object>}\n</tool_call>\nEach result comes back inside <tool_response></tool_response>.")


def chatml(turns: list[tuple[str, str]], open_assistant: bool = True) -> str:
    """A ChatML conversation written out by hand."""
    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)
    return text + ("<|im_start|>assistant\n" if open_assistant else "")


@pytest.fixture(scope="module")
def smol_dir():
    return fetch_smollm2.fetch(fetch_smollm2.DEFAULT_OUT)


@pytest.fixture(scope="module")
def smol_hf_tok(smol_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(smol_dir))


@pytest.fixture
def tok(smol_hf_tok, smol_dir):
    """SmolLM2's tokenizer as grpolab wraps it; its template put back after each test."""
    original = (smol_dir / "chat_template.jinja").read_text()
    smol_hf_tok.chat_template = original
    yield HFTokenizer(smol_hf_tok)
    smol_hf_tok.chat_template = original


@pytest.fixture(scope="module")
def calc():
    return load_tools(["calculator"])


def schemas(tools) -> list[dict]:
    return [t.schema for t in tools.values()]


def ids(tok, text: str) -> list[int]:
    return tok.tok(text, add_special_tokens=False)["input_ids"]


def test_smollm2s_template_is_chatml_without_tools(tok, smol_dir):
    template = (smol_dir / "chat_template.jinja").read_text()
    assert "tools" not in template and is_chatml(tok.tok, template)
    assert not is_chatml(tok.tok, "{% for m in messages %}{{ m['content'] }}{% endfor %}")


def test_prompt_ids_carry_the_tools_in_the_system_message(tok, calc):
    fmt = tool_format(tok, schemas(calc), "SmolLM2-135M-Instruct")
    assert isinstance(fmt, HermesFormat)
    block = tools_block(schemas(calc))
    # no system message: the template's own default one comes first, then the tools (as Qwen2.5 does)
    want = chatml([("system", SMOL_SYSTEM + "\n\n" + block), ("user", "What is 12*34?")])
    assert tok.render_prompt("What is 12*34?") == ids(tok, want)
    assert tok.render_prompt([{"role": "user", "content": "What is 12*34?"}]) == ids(tok, want)
    # a system message of the prompt's own: the tools go after it
    msgs = [{"role": "system", "content": "You are a careful math tutor."}, {"role": "user", "content": "2+2?"}]
    want = chatml([("system", "You are a careful math tutor.\n\n" + block), ("user", "2+2?")])
    assert tok.render_prompt(msgs) == ids(tok, want)
    assert '"name": "calculator"' in tok.tok.decode(tok.render_prompt(msgs))


def test_a_sampled_call_parses_to_the_call(tok, calc):
    fmt = tool_format(tok, schemas(calc), "SmolLM2-135M-Instruct")
    end = [tok.tok.convert_tokens_to_ids("<|im_end|>")]
    assert fmt.triggers == tuple(tok.stop_ids) and end[0] in fmt.triggers
    assert fmt.calls_in(ids(tok, CALL) + end) == [("calculator", {"expression": "12*34"})]
    assert fmt.calls_in(ids(tok, "Let me work it out. " + CALL) + end) == [("calculator", {"expression": "12*34"})]
    # SmolLM2's own habit: a JSON list of calls in one block
    two = ('<tool_call>[{"name": "calculator", "arguments": {"expression": "1+1"}}, '
           '{"name": "f", "arguments": {}}]</tool_call>')
    assert fmt.calls_in(ids(tok, two) + end) == [("calculator", {"expression": "1+1"}), ("f", {})]
    assert fmt.calls_in(ids(tok, "The answer is 408.") + end) is None   # an ordinary end of turn
    bad = fmt.calls_in(ids(tok, "<tool_call>{oops}</tool_call>") + end)
    assert len(bad) == 1 and "not valid JSON" in str(bad[0])
    assert "without </tool_call>" in str(fmt.calls_in(ids(tok, "<tool_call>{") + end)[0])


def test_results_give_the_tokens_of_the_whole_conversation(tok, calc, smol_dir):
    """prompt + sampled call + render(results) + answer == the conversation written out by hand, token for token,
    and == what SmolLM2's own template renders for it with the results as a user turn."""
    fmt = tool_format(tok, schemas(calc), "SmolLM2-135M-Instruct")
    end = tok.tok.convert_tokens_to_ids("<|im_end|>")
    prompt = tok.render_prompt("What is 12*34?")
    records = [CallRecord("calculator", {"expression": "12*34"}, "408", False),
               CallRecord("calculator", {"expression": "3+4"}, "7", False)]
    results = fmt.render(records)
    assert tok.tok.decode(results) == ("\n<|im_start|>user\n<tool_response>\n408\n</tool_response>\n<tool_response>\n"
                                       "7\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    ours = prompt + ids(tok, CALL) + [end] + results + ids(tok, "It is 408.") + [end]
    turns = [("system", SMOL_SYSTEM + "\n\n" + tools_block(schemas(calc))), ("user", "What is 12*34?"),
             ("assistant", CALL),
             ("user", "<tool_response>\n408\n</tool_response>\n<tool_response>\n7\n</tool_response>"),
             ("assistant", "It is 408.")]
    by_hand = chatml(turns, open_assistant=False)
    assert ours == ids(tok, by_hand.removesuffix("\n"))
    original = (smol_dir / "chat_template.jinja").read_text()
    own = tok.tok.apply_chat_template([{"role": r, "content": c} for r, c in turns], tokenize=False,
                                      chat_template=original)
    assert own == by_hand
    assert fmt.render(records[:1]) == ids(tok, "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n"
                                               "<|im_start|>assistant\n")


def test_without_tools_the_template_renders_as_before(tok, calc, smol_dir):
    """The prelude that gives the template tools outputs nothing when there are none (a saved checkpoint
    keeps rendering plain chats exactly as the model's own template does), and a second build is the same."""
    original = (smol_dir / "chat_template.jinja").read_text()
    tool_format(tok, schemas(calc), "SmolLM2-135M-Instruct")
    assert tok.tok.chat_template != original
    chats = [[{"role": "user", "content": "hi"}],
             [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
              {"role": "assistant", "content": "yo"}],
             [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
              {"role": "user", "content": "c"}]]
    for chat in chats:
        for gen in (False, True):
            assert (tok.tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
                    == tok.tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen,
                                                   chat_template=original))
    first = tok.render_prompt("What is 12*34?")
    tool_format(tok, schemas(calc), "SmolLM2-135M-Instruct")   # the pipeline builds it more than once
    assert tok.render_prompt("What is 12*34?") == first


def test_a_saved_checkpoint_renders_tools_as_the_run_did(tok, calc, tmp_path):
    """The trainer saves the tokenizer with the template the run used: reloaded, with tools it renders the
    prompts it was trained on (also for transformers users calling apply_chat_template(tools=...))."""
    from transformers import AutoTokenizer
    tool_format(tok, schemas(calc), "SmolLM2-135M-Instruct")
    want = tok.render_prompt("What is 12*34?")
    tok.save(tmp_path)
    again = HFTokenizer(AutoTokenizer.from_pretrained(str(tmp_path)))
    assert again.tok.chat_template == tok.tok.chat_template
    assert again.tok.apply_chat_template([{"role": "user", "content": "What is 12*34?"}], tools=schemas(calc),
                                         add_generation_prompt=True, tokenize=False) == tok.tok.decode(want)
    tool_format(again, schemas(calc), "checkpoint")
    assert again.render_prompt("What is 12*34?") == want


CHATML_WITH_TOOLS = ("{% if tools %}<|im_start|>system\n"
                     "<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools> "
                     "call with <tool_call>{json}</tool_call><|im_end|>\n{% endif %}")
TURN = "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
GEN = "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
BROKEN = {
    "no tool support": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
    "drops tool results": CHATML_WITH_TOOLS + "{% for m in messages %}{% if m['role'] != 'tool' %}" + TURN
                          + "{% endif %}{% endfor %}" + GEN,
    "rewriting the turns": CHATML_WITH_TOOLS + "{{ messages | length }}{% for m in messages %}" + TURN
                           + "{% endfor %}" + GEN,
    "does not list the tools": "{# tools <tool_call> #}{% for m in messages %}" + TURN + "{% endfor %}" + GEN,
    "cannot render": CHATML_WITH_TOOLS + "{% for m in messages %}{% if m['role'] == 'tool' %}"
                     "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}" + TURN
                     + "{% endfor %}" + GEN,
    "does not end an assistant turn with a stop token": CHATML_WITH_TOOLS + "{% for m in messages %}"
                     "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}\n\n{% endfor %}" + GEN,
    "does not open an assistant turn": CHATML_WITH_TOOLS + "{% for m in messages %}" + TURN + "{% endfor %}"
                                       "{% if add_generation_prompt and messages[-1]['role'] != 'tool' %}"
                                       "<|im_start|>assistant\n{% endif %}",
}


def test_a_template_that_renders_the_last_turn_apart_still_works(tok, calc):
    """Like Qwen3's (an empty think block on a final assistant turn only): what counts is that the conversation
    with the results continues the prompt, not how a conversation ending on that turn looks."""
    tok.tok.chat_template = (CHATML_WITH_TOOLS +
                             "{% for m in messages %}{% if m['role'] == 'assistant' and loop.last %}"
                             "<|im_start|>assistant\n<think>\n\n</think>\n\n{{ m['content'] }}<|im_end|>\n"
                             "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n"
                             "</tool_response><|im_end|>\n{% else %}" + TURN + "{% endif %}{% endfor %}" + GEN)
    fmt = tool_format(tok, schemas(calc), "qwen3-like")
    assert tok.tok.decode(fmt.render([CallRecord("calculator", {}, "408", False)])) == (
        "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("why", list(BROKEN))
def test_templates_that_cannot_carry_tools_fail_when_the_format_is_built(tok, calc, why):
    tok.tok.chat_template = BROKEN[why]
    with pytest.raises(ConfigError, match=why) as e:
        tool_format(tok, schemas(calc), "my-model")
    msg = str(e.value)
    assert msg.startswith("rollout.tools: ") and "my-model" in msg and "\n" not in msg
    assert tok.tok.chat_template == BROKEN[why] and tok.tools is None   # the tokenizer is left as it was


@pytest.fixture(scope="module")
def gsm8k_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    rows = [{"question": "What is 12 times 34?", "answer": "12*34=408\n#### 408"}] * 4
    for split in ("train", "test"):
        (d / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"), layers=1, hidden=32, heads=2, intermediate=64)


@pytest.mark.slow
@pytest.mark.parametrize("why", ["no tool support", "rewriting the turns"])
def test_the_cli_stops_at_start_up_with_one_line(tmp_path, gsm8k_dir, tiny_dir, why):
    """`grpolab train` with rollout.tools on a model whose template cannot carry them: one line, exit 2,
    before any rollout (no metrics written). A template that rewrites earlier turns used to get past
    start-up and fail at the first tool call."""
    from transformers import AutoTokenizer
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_dir, model_dir)
    hf_tok = AutoTokenizer.from_pretrained(str(model_dir))
    hf_tok.chat_template = BROKEN[why]
    hf_tok.save_pretrained(str(model_dir))
    out = tmp_path / "run"
    r = run_cli("train", f"model.name_or_path={model_dir}", "data.task=gsm8k", f"data.train_path={gsm8k_dir}",
                "rollout.tools=[calculator]", "rollout.prompts_per_step=2", "rollout.num_generations=2",
                "rollout.max_new_tokens=16", "train.max_steps=1", f"train.output_dir={out}", "eval.num_problems=2",
                "train.threads=1", timeout=300)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("grpolab: config error: rollout.tools: "), r.stderr
    assert why in lines[0] and str(model_dir) in lines[0]
    assert not (out / "metrics.jsonl").exists() and not (out / "samples.jsonl").exists()


@pytest.mark.slow
def test_a_rollout_with_tools_on_the_real_model(smol_dir, calc):
    """Sampled rollouts of SmolLM2 with the calculator: the tools in every prompt, the completions end at
    <|im_end|>, and the trainer's log-probs of what was sampled match the sampler's."""
    model, tok = load_hf(str(smol_dir))
    fmt = tool_format(tok, schemas(calc), "SmolLM2-135M-Instruct")
    tu = ToolUse(fmt, ToolRunner(calc, timeout=5, max_output_chars=200), max_calls=2, max_completion_tokens=48)
    prompts = [tok.render_prompt(q) for q in ["What is 123*456? Use the calculator.", "What is 17*23?"]]
    G = 2
    keys = completion_keys(0, torch.arange(2).repeat_interleave(G), torch.arange(G).repeat(2))
    try:
        g = generate(model, prompts, num_generations=G, max_new_tokens=24, temperature=1.0, stop_ids=tok.stop_ids,
                     pad_id=tok.pad_id, keys=keys, tools=tu)
    finally:
        tu.close()
    assert all("<tools>" in tok.tok.decode(p) for p in prompts)
    assert len(g.tool_calls) == 4 and g.completion_mask.any(dim=1).all()
    end = tok.tok.convert_tokens_to_ids("<|im_end|>")
    for i in range(4):   # a row either stopped at <|im_end|> or ran out of room
        sampled = g.completion_ids[i][g.completion_mask[i]].tolist()
        assert bool(g.truncated[i]) or sampled[-1] == end
    assert not (g.tool_mask & g.completion_mask).any()   # tool tokens are never the policy's
    with torch.no_grad():
        lp = completion_logprobs(model, g.prompt_ids, g.prompt_mask, g.completion_ids, g.completion_mask,
                                 context_mask=g.context_mask)
    m = g.completion_mask
    assert torch.allclose(lp[m], g.sampler_logprobs[m], atol=3e-5)   # as tests/test_real_model.py holds them
