"""Tool calls on a Hugging Face chat model: the tokenizer's chat template lists the tools (`tools=`),
the model writes a Hermes-style <tool_call>{json}</tool_call> and ends its turn, the engine appends
the result as a `tool` message rendered by the template and the model answers. A tiny local Llama
(random init) is trained here to make that call, so everything runs without a network."""

import pytest
import torch

from grpolab.errors import ConfigError
from grpolab.models.hf import load_hf
from grpolab.models.logprobs import completion_logprobs, token_logprobs
from grpolab.models.tiny_hf import save_tiny_model
from grpolab.rollout.engine import generate
from grpolab.rollout.keys import completion_keys
from grpolab.rollout.tool_decode import ToolUse
from grpolab.rollout.tool_formats import HermesFormat, tool_format
from grpolab.rollout.tools import CallRecord, ToolRunner, load_tools

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    d = save_tiny_model(tmp_path_factory.mktemp("hf_tools"), layers=2, hidden=64, heads=2, intermediate=128)
    model, tok = load_hf(str(d))
    tools = load_tools(["calculator"])
    fmt = tool_format(tok, [t.schema for t in tools.values()], "tiny")
    assert isinstance(fmt, HermesFormat)
    prompt = tok.render_prompt("What is 12 times 34?")
    result = fmt.render([CallRecord("calculator", {"expression": "12*34"}, "408", False)])
    answer = tok.encode("It is 408.") + [tok.eos_id]
    call = tok.encode(CALL) + [tok.eos_id]
    ids = torch.tensor([prompt + call + result + answer])
    loss_mask = torch.tensor([[False] * len(prompt) + [True] * len(call) + [False] * len(result)
                              + [True] * len(answer)])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(150):
        logp = token_logprobs(model, ids, torch.ones_like(ids, dtype=torch.bool))
        loss = -(logp * loss_mask[:, 1:]).sum() / loss_mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    tu = ToolUse(fmt, ToolRunner(tools, timeout=5, max_output_chars=200), max_calls=2, max_completion_tokens=200)
    yield model, tok, tu, prompt
    tu.close()


@pytest.mark.slow
def test_template_renders_tools_and_results(tool_model):
    _, tok, tu, prompt = tool_model
    text = tok.tok.decode(prompt)
    assert '"name": "calculator"' in text and "What is 12 times 34?" in text   # the schema reached the prompt
    out = tok.tok.decode(tu.format.render([CallRecord("calculator", {}, "408", False),
                                           CallRecord("calculator", {}, "7", False)]))
    assert out == ("\n<|im_start|>user\n<tool_response>\n408\n</tool_response>\n<tool_response>\n7\n"
                   "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    ends = [tok.eos_id]
    assert tu.format.calls_in(tok.encode("plain answer") + ends) is None   # an ordinary end of turn
    assert tu.format.calls_in(tok.encode(CALL) + ends) == [("calculator", {"expression": "12*34"})]
    bad = tu.format.calls_in(tok.encode("<tool_call>{not json}</tool_call>") + ends)
    assert len(bad) == 1 and "not valid JSON" in str(bad[0])
    two = tu.format.calls_in(tok.encode(CALL + CALL.replace("12*34", "1+1")) + ends)
    assert [c[1]["expression"] for c in two] == ["12*34", "1+1"]


def test_hf_model_calls_the_tool_end_to_end(tool_model):
    model, tok, tu, prompt = tool_model
    g = generate(model, [prompt], num_generations=1, max_new_tokens=150, temperature=0.0, stop_ids=tok.stop_ids,
                 pad_id=tok.pad_id, tools=tu)
    assert g.tool_calls == [[{"name": "calculator", "arguments": {"expression": "12*34"}, "output": "408",
                              "error": False}]]
    text = tok.tok.decode(g.completion_ids[0][g.context_mask[0]].tolist(), skip_special_tokens=False)
    assert text.startswith(CALL + "<|im_end|>\n<|im_start|>user\n<tool_response>\n408\n</tool_response>")
    assert text.endswith("<|im_start|>assistant\nIt is 408.<|im_end|>")
    assert not bool(g.truncated[0])


@pytest.mark.parametrize("lean", [True, False])
def test_hf_sampler_and_trainer_logprobs_agree(tool_model, lean):
    model, tok, tu, prompt = tool_model
    model.lean_decode = lean
    try:
        G = 6
        keys = completion_keys(3, torch.zeros(G, dtype=torch.long), torch.arange(G))
        g = generate(model, [prompt], num_generations=G, max_new_tokens=150, temperature=1.0, stop_ids=tok.stop_ids,
                     pad_id=tok.pad_id, keys=keys, tools=tu)
    finally:
        model.lean_decode = True
    assert sum(len(c) for c in g.tool_calls) >= 3 and g.tool_mask.any()
    with torch.no_grad():
        lp = completion_logprobs(model, g.prompt_ids, g.prompt_mask, g.completion_ids, g.completion_mask,
                                 context_mask=g.context_mask)
    m = g.completion_mask
    assert torch.allclose(lp[m], g.sampler_logprobs[m], atol=1e-5)


def test_templates_without_tool_support_are_refused(tool_model):
    _, tok, _, _ = tool_model
    saved = tok.tok.chat_template
    try:
        tok.tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        with pytest.raises(ConfigError, match="has no tool support"):
            tool_format(tok, [], "my-model")
        tok.tok.chat_template = "{% if tools %}[AVAILABLE_TOOLS]{{ tools }}{% endif %}{{ messages }}"
        with pytest.raises(ConfigError, match="tool-call syntax grpolab does not parse"):
            tool_format(tok, [], "my-model")
    finally:
        tok.tok.chat_template = saved


@pytest.mark.slow
def test_grpo_on_an_hf_model_with_tools_through_the_cli(tool_model, tmp_path):
    """`grpolab train` on the tool-calling Llama: the calls run inside the rollouts and the records show them."""
    import json

    from conftest import run_cli
    model, tok, _, _ = tool_model
    model_dir = tmp_path / "model"
    model.save(model_dir)
    tok.save(model_dir)
    rows = [{"question": "What is 12 times 34?", "answer": "12*34=408\n#### 408"}] * 4
    for split in ("train", "test"):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    r = run_cli("train", f"model.name_or_path={model_dir}", "data.task=gsm8k", f"data.train_path={tmp_path}",
                "rollout.tools=[calculator]", "rollout.prompts_per_step=2", "rollout.num_generations=4",
                "rollout.max_new_tokens=120", "rollout.max_completion_tokens=200", "train.max_steps=1",
                "rollout.temperature=0.5",
                f"train.output_dir={out}", "eval.num_problems=2", "eval.k=1", "train.threads=1",
                "log.samples_every=1", "log.samples_per_step=8")
    assert r.returncode == 0, r.stderr
    m = json.loads((out / "metrics.jsonl").read_text())
    assert m["tools/calls_per_completion"] > 0 and m["tools/calls/calculator"] == m["tools/calls_per_completion"]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    called = [s for s in samples if s["tool_calls"]]
    assert called and all(c["output"] == "408" for s in called for c in s["tool_calls"] if not c["error"])
    assert any("<tool_call>" in s["completion"] and "<tool_response>\n408\n</tool_response>" in s["completion"]
               for s in called)
