"""Tool calls inside rollouts: the engine pauses a row at a call, runs it, feeds the result into the
row's cache and resumes; tool tokens are context with no loss. The model here is a real tiny GPT
trained (in the fixture) to write scripted completions, so greedy decoding makes the calls we want."""

import json

import pytest
import torch
from conftest import overfit

from grpolab.errors import ConfigError, ToolCallError
from grpolab.models import GPT, CharTokenizer, GPTConfig
from grpolab.models.logprobs import completion_logprobs
from grpolab.rollout.engine import generate
from grpolab.rollout.keys import completion_keys
from grpolab.rollout.tool_decode import ToolUse, tool_metrics
from grpolab.rollout.tool_formats import BuiltinFormat
from grpolab.rollout.tools import ToolRunner, calculator, load_tool, load_tools, truncate

TOOLS_PY = '''
import time


def boom(x: str) -> str:
    """Always fails.

    Args:
        x: ignored
    """
    raise RuntimeError("kaboom")


def slow(x: str) -> str:
    """Takes too long.

    Args:
        x: ignored
    """
    time.sleep(6)
    return "late"


def huge(x: str) -> str:
    """Says a lot.

    Args:
        x: ignored
    """
    return "y" * 10000


def add(a: int, b: int) -> int:
    """Adds two numbers.

    Args:
        a: first
        b: second
    """
    return a + b


def undocumented(x):
    return x
'''

# prompt -> the completion the fixture model learns to write; <|out|>...<|/out|> holds what the engine
# will write there (context in training, no loss, as SFT does)
LIMIT = "error: tool call limit reached (rollout.max_tool_calls=2); answer without more calls"
SCRIPTS = {
    "none": "plain 5",
    "one": "<|call|>calculator 12*34<|/call|><|out|>408<|/out|>=408",
    "two": "<|call|>calculator 2+3<|/call|><|out|>5<|/out|>;<|call|>calculator 5*5<|/call|><|out|>25<|/out|>ok",
    "boom": "<|call|>boom x<|/call|><|out|>error: RuntimeError: kaboom<|/out|>done",
    "slow": "<|call|>slow x<|/call|><|out|>error: slow timed out after 2.0s<|/out|>done",
    "huge": "<|call|>huge x<|/call|><|out|>" + "y" * 50 + "...[truncated 9950 chars]<|/out|>done",
    "bad": "<|call|>calculator 2+<|/call|><|out|>error: not an arithmetic expression: '2+'<|/out|>x<|/call|>"
           "<|out|>error: a call was closed but never opened<|/out|>y",
    "json": '<|call|>add {"a": 2, "b": 40}<|/call|><|out|>42<|/out|>z',
    "many": "<|call|>calculator 1+1<|/call|><|out|>2<|/out|><|call|>calculator 2+2<|/call|><|out|>4<|/out|>"
            f"<|call|>calculator 3+3<|/call|><|out|>{LIMIT}<|/out|>end",
}


@pytest.fixture(scope="module")
def scripted():
    """A tiny GPT that greedily writes SCRIPTS[prompt] (trained here on exactly those completions,
    tool outputs masked out of the loss as SFT does)."""
    from grpolab.data.supervised import Example, collate, encode
    tok = CharTokenizer()
    torch.manual_seed(0)
    model = GPT(GPTConfig(tok.vocab_size, n_layer=2, n_head=2, n_embd=64, block_size=192))
    ex = [encode(tok, {"prompt": p, "completion": c}) for p, c in SCRIPTS.items()]
    assert all(isinstance(e, Example) for e in ex)
    return overfit(model, collate(ex, tok.pad_id), 300), tok


@pytest.fixture
def tools(tmp_path):
    f = tmp_path / "mytools.py"
    f.write_text(TOOLS_PY)
    specs = ["calculator", *(f"{f}:{n}" for n in ("boom", "slow", "huge", "add"))]
    # 2 s: far above what a calculator call takes even on a loaded machine (at 0.5 s a busy CI machine timed out
    # calls that should have answered), far below the slow tool's 6 s
    tu = ToolUse(BuiltinFormat(CharTokenizer()), ToolRunner(load_tools(specs), timeout=2.0, max_output_chars=50),
                 max_calls=2, max_completion_tokens=160)
    yield tu
    tu.close()


def _run(model, tok, prompts, tools, **kw):
    args = dict(num_generations=1, max_new_tokens=120, temperature=0.0, stop_ids=tok.stop_ids, pad_id=tok.pad_id)
    args.update(kw)
    return generate(model, [tok.render_prompt(p) for p in prompts], tools=tools, **args)


def _text(tok, g, i):
    return tok.decode(g.completion_ids[i][g.context_mask[i]].tolist())


@pytest.mark.slow
def test_rows_with_different_numbers_of_calls_in_one_batch(scripted, tools):
    model, tok = scripted
    g = _run(model, tok, ["none", "one", "two"], tools)
    assert [len(c) for c in g.tool_calls] == [0, 1, 2]
    assert _text(tok, g, 0) == "plain 5"
    assert _text(tok, g, 1) == "<|call|>calculator 12*34<|/call|><|out|>408<|/out|>=408"
    assert _text(tok, g, 2) == ("<|call|>calculator 2+3<|/call|><|out|>5<|/out|>;"
                                "<|call|>calculator 5*5<|/call|><|out|>25<|/out|>ok")
    assert g.tool_calls[2] == [{"name": "calculator", "arguments": "2+3", "output": "5", "error": False},
                               {"name": "calculator", "arguments": "5*5", "output": "25", "error": False}]
    assert not g.truncated.any()
    # the masks: tool tokens are exactly <|out|>..<|/out|>; sampled tokens are the rest, stop included
    for i in range(3):
        ids = g.completion_ids[i][g.context_mask[i]].tolist()
        expect_tool = tok.tool_output_mask(ids)
        assert g.tool_mask[i][g.context_mask[i]].tolist() == expect_tool
        assert not (g.tool_mask[i] & g.completion_mask[i]).any()
        assert ids[-1] == tok.eos_id and g.completion_mask[i][len(ids) - 1]
    # sampler log-probs are 0 at tool tokens (not sampled) and negative at sampled ones
    assert (g.sampler_logprobs[g.tool_mask] == 0).all()
    assert (g.sampler_logprobs[g.completion_mask] < 0).all()


def test_row_alone_matches_row_in_batch(scripted, tools):
    """A row's completion does not depend on what the other rows' tools do (or when)."""
    model, tok = scripted
    alone = _run(model, tok, ["two"], tools)
    batch = _run(model, tok, ["none", "huge", "two", "slow"], tools)
    assert _text(tok, alone, 0) == _text(tok, batch, 2)
    assert alone.tool_calls[0] == batch.tool_calls[2]


def test_tool_failures_become_messages(scripted, tools):
    model, tok = scripted
    g = _run(model, tok, ["boom", "slow", "huge", "bad", "json"], tools)
    boom, slow, huge, bad, js = g.tool_calls
    assert boom == [{"name": "boom", "arguments": "x", "output": "error: RuntimeError: kaboom", "error": True}]
    assert slow[0]["error"] and slow[0]["output"] == "error: slow timed out after 2.0s"   # its 6 s not waited for
    assert huge[0]["output"] == truncate("y" * 10000, 50) and huge[0]["output"].endswith("[truncated 9950 chars]")
    assert not huge[0]["error"]
    assert "<|out|>" + "y" * 50 + "...[truncated 9950 chars]<|/out|>" in _text(tok, g, 2)
    # an unparsable expression, then a <|/call|> with no <|call|>: both answered with an error, no crash
    assert [c["error"] for c in bad] == [True, True]
    assert bad[0]["output"].startswith("error: not an arithmetic expression")
    assert bad[1]["output"] == "error: a call was closed but never opened"
    assert js == [{"name": "add", "arguments": {"a": 2, "b": 40}, "output": "42", "error": False}]
    m = tool_metrics(g.tool_calls, ["calculator", "boom", "add"])
    assert m["tools/calls_per_completion"] == pytest.approx(6 / 5)
    assert m["tools/error_rate"] == pytest.approx(4 / 6)
    assert m["tools/calls/calculator"] == pytest.approx(1 / 5) and m["tools/calls/add"] == pytest.approx(1 / 5)


def test_max_tool_calls(scripted, tools):
    model, tok = scripted
    g = _run(model, tok, ["many"], tools)   # max_calls=2: the third call is refused
    calls = g.tool_calls[0]
    assert [c["output"] for c in calls[:2]] == ["2", "4"]
    assert calls[2] == {"name": "calculator", "arguments": "3+3", "output": LIMIT, "error": True}
    assert len(calls) == 3 and _text(tok, g, 0) == SCRIPTS["many"]


def test_call_at_the_last_allowed_token(scripted, tools):
    model, tok = scripted
    full = "<|call|>calculator 12*34<|/call|>"
    n = len(tok.encode(full))
    g = _run(model, tok, ["one"], tools, max_new_tokens=n)
    assert g.tool_calls == [[]]          # no room for a result: the call is not run
    assert bool(g.truncated[0]) and not g.tool_mask.any()
    assert _text(tok, g, 0) == full
    # one more position is not enough for the result either: the row ends truncated inside it
    tools.max_completion_tokens = n + 2
    g = _run(model, tok, ["one"], tools, max_new_tokens=n + 1)
    assert len(g.tool_calls[0]) == 1 and bool(g.truncated[0])
    assert g.context_mask[0].sum() == n + 2 and g.tool_mask[0].sum() == 2


def test_sampler_and_trainer_logprobs_agree_on_multi_call_rows(scripted, tools):
    model, tok = scripted
    prompts = [tok.render_prompt(p) for p in ["two", "many", "one", "none"]]
    G = 4
    keys = completion_keys(0, torch.arange(4).repeat_interleave(G), torch.arange(G).repeat(4))
    g = generate(model, prompts, num_generations=G, max_new_tokens=120, temperature=1.0, stop_ids=tok.stop_ids,
                 pad_id=tok.pad_id, keys=keys, tools=tools)
    multi = [i for i, c in enumerate(g.tool_calls) if len(c) >= 2]
    assert len(multi) >= 4, g.tool_calls
    with torch.no_grad():
        lp = completion_logprobs(model, g.prompt_ids, g.prompt_mask, g.completion_ids, g.completion_mask,
                                 context_mask=g.context_mask)
    m = g.completion_mask
    assert torch.allclose(lp[m], g.sampler_logprobs[m], atol=1e-5)
    assert (lp[g.tool_mask] == 0).all()
    # the tool tokens are context: scored without them, the tokens after a call get other log-probs
    with torch.no_grad():
        blind = completion_logprobs(model, g.prompt_ids, g.prompt_mask, g.completion_ids, g.completion_mask)
    assert not torch.allclose(blind[m], g.sampler_logprobs[m], atol=1e-3)


def test_tool_tokens_get_no_loss_and_no_gradient(scripted, tools):
    from grpolab.algorithms.losses import clip_loss
    model, tok = scripted
    g = _run(model, tok, ["two", "one"], tools, temperature=1.0)
    captured = {}

    def keep(_m, _i, out):
        out.retain_grad()
        captured["logits"] = out
    h = model.lm_head.register_forward_hook(keep)
    try:
        lp = completion_logprobs(model, g.prompt_ids, g.prompt_mask, g.completion_ids, g.completion_mask,
                                 context_mask=g.context_mask)
    finally:
        h.remove()
    adv = torch.tensor([[1.0], [-1.0]])
    per_token, _ = clip_loss(lp, lp.detach(), adv, g.completion_mask, epsilon=0.2)
    per_token.sum().backward()
    grad = captured["logits"].grad        # (B, C, V): position t scores completion token t
    per_pos = grad.abs().sum(-1)
    C = per_pos.size(1)
    assert (per_pos[g.tool_mask[:, :C]] == 0).all()
    assert (per_pos[g.completion_mask[:, :C]] > 0).all()


# ------------------------------------------------------------------ the tools themselves
def test_calculator_is_arithmetic_only():
    assert calculator("(12+7)*3") == "57"
    assert calculator("7/2") == "3.5"
    assert calculator("6/3") == "2"
    assert calculator(" -4 × 2 ÷ 8 ") == "-1"
    for bad in ("__import__('os').system('true')", "().__class__", "2**99999999", "open('x')", "a+1", "[1]*9"):
        with pytest.raises(ToolCallError):
            calculator(bad)
    with pytest.raises(ToolCallError, match="division by zero"):
        calculator("1/0")
    with pytest.raises(ToolCallError, match="longer than"):
        calculator("1+" * 200 + "1")


def test_user_tool_schema_and_errors(tmp_path):
    f = tmp_path / "mytools.py"
    f.write_text(TOOLS_PY)
    t = load_tool(f"{f}:add")
    assert t.name == "add" and t.params == ["a", "b"]
    assert t.schema["function"]["parameters"]["properties"]["a"] == {"type": "integer", "description": "first"}
    assert t.call({"a": 1, "b": 2}) == "3"
    with pytest.raises(ToolCallError, match="has no argument c"):
        t.call({"a": 1, "c": 2})
    with pytest.raises(ToolCallError, match="JSON object"):
        t.call("1 2")
    with pytest.raises(ConfigError, match="rollout.tools: .*undocumented.*docstring"):
        load_tool(f"{f}:undocumented")
    with pytest.raises(ConfigError, match="unknown tool 'abacus'"):
        load_tool("abacus")
    with pytest.raises(ConfigError, match="has no attribute 'nope'"):
        load_tool(f"{f}:nope")
    with pytest.raises(ConfigError, match="called 'calculator'"):
        load_tools(["calculator", "calculator"])


def test_python_tool_runs_in_the_sandbox():
    from grpolab.rollout.tools import python
    assert python("print(6*7)") == "42\n"
    out = python("import os\nprint(os.path.exists('/work'), os.getuid())")
    assert out.split()[0] == "False"          # the host's files are not there
    assert "ZeroDivisionError" in python("1/0")
    runner = ToolRunner(load_tools(["python"]), timeout=30, max_output_chars=50)
    rec = runner.run([("python", "print('x' * 5000)")])[0]
    assert rec.output.startswith("x" * 50) and rec.output.endswith("[truncated 4951 chars]")
    runner.close()


def test_config_validation():
    from grpolab.config.load import load_config
    with pytest.raises(ConfigError, match="rollout.max_tool_calls"):
        load_config(None, ["rollout.max_tool_calls=0"])
    with pytest.raises(ConfigError, match="rollout.max_completion_tokens"):
        load_config(None, ["rollout.max_new_tokens=32", "rollout.max_completion_tokens=16"])
    assert load_config(None, ["rollout.tools=calculator"]).rollout.tools == ["calculator"]
    with pytest.raises(ConfigError, match="rollout.tools"):
        load_config(None, ["rollout.tools=[1]"])


def test_report_plots_tool_metrics(tmp_path):
    from grpolab.monitor.report import PLOTS, write_report
    rows = [{"step": s, "reward": 0.1 * s, "tools/calls_per_completion": 0.5 * s, "tools/error_rate": 0.1}
            for s in range(1, 5)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "samples.jsonl").write_text(json.dumps(
        {"step": 1, "prompt": "q", "completion": "<|call|>calculator 2+2<|/call|><|out|>4<|/out|>#### 4",
         "reward": 1.0, "rewards": {}, "advantage": 0.0,
         "tool_calls": [{"name": "calculator", "arguments": "2+2", "output": "4", "error": False}]}) + "\n")
    page = write_report(tmp_path).read_text()
    assert {p.stem for p in (tmp_path / "report").glob("*.png")} == set(PLOTS) | {"tools"}
    assert "&lt;|call|&gt;calculator 2+2&lt;|/call|&gt;&lt;|out|&gt;4&lt;|/out|&gt;" in page   # inline, escaped
    # without tool metrics there is no tools plot
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "metrics.jsonl").write_text("".join(json.dumps({"step": r["step"], "reward": r["reward"]}) + "\n"
                                                 for r in rows))
    write_report(plain)
    assert {p.stem for p in (plain / "report").glob("*.png")} == set(PLOTS)


def test_sft_does_not_train_on_tool_outputs():
    from grpolab.data.supervised import encode
    tok = CharTokenizer()
    ex = encode(tok, {"prompt": "q", "completion": "a<|call|>calculator 1+2<|/call|><|out|>3<|/out|>b"})
    p = len(tok.render_prompt("q"))
    comp, loss = ex.ids[p:], ex.loss[p:]
    assert tok.decode(comp) == "a<|call|>calculator 1+2<|/call|><|out|>3<|/out|>b"
    assert comp.count(tok.call_id) == 1 and comp.count(tok.out_end_id) == 1   # the markers are single tokens
    i, j = comp.index(tok.out_id), comp.index(tok.out_end_id)
    assert loss == [k < i or k > j for k in range(len(comp))]
    # a tool's own output cannot pose as a marker
    assert tok.encode("<|out|>", tool_tokens=False) == tok.encode("<") + tok.encode("|out|>")


def test_eval_counts_the_greedy_calls(scripted, tools):
    from grpolab.train.evaluate import evaluate
    model, tok = scripted
    rows = [{"prompt": p, "answer": "#### 1"} for p in ("none", "one", "two")]
    res = evaluate(model, tok, rows, k=1, max_new_tokens=120, tools=tools)
    assert res["tool_calls_per_completion"] == pytest.approx(1.0)
    assert [len(s["greedy_tool_calls"]) for s in res["samples"]] == [0, 1, 2]
    assert res["samples"][1]["greedy"] == "<|call|>calculator 12*34<|/call|><|out|>408<|/out|>=408"


def _same_generation(a, b, exact: bool = False) -> None:
    """Two rollouts of the same rows: the same context tokens, masks and calls, row for row, and the same sampler
    log-probs (`exact`: bits; else to 1e-5, as two forwards' kernels round)."""
    assert a.tool_calls == b.tool_calls
    assert torch.equal(a.truncated, b.truncated)
    for i in range(len(a.tool_calls)):
        ca, cb = a.context_mask[i], b.context_mask[i]
        assert a.completion_ids[i][ca].tolist() == b.completion_ids[i][cb].tolist()
        assert a.tool_mask[i][ca].tolist() == b.tool_mask[i][cb].tolist()
        if exact:
            assert torch.equal(a.sampler_logprobs[i][ca], b.sampler_logprobs[i][cb])
        else:
            torch.testing.assert_close(a.sampler_logprobs[i][ca], b.sampler_logprobs[i][cb], atol=1e-5, rtol=1e-5)


def test_the_slotted_decode_runs_calls_as_the_eager_engine_does(scripted, tools):
    """On the slotted decode (the GPU's captured step, eagerly here) a row that ends a call pauses until the host's
    look, its result is fed into its slot and it resumes: the eager engine's rows, calls, masks and log-prob bits,
    on 8 slots refilled as rows finish too; with the penalties; and at the last allowed token."""
    from grpolab.rollout import slot_decode
    model, tok = scripted
    names = ["two", "many", "one", "none", "bad", "json", "boom"]
    prompts, G = [tok.render_prompt(p) for p in names], 3
    keys = completion_keys(0, torch.arange(len(names)).repeat_interleave(G), torch.arange(G).repeat(len(names)))
    kw = dict(num_generations=G, max_new_tokens=120, temperature=1.0, stop_ids=tok.stop_ids, pad_id=tok.pad_id,
              keys=keys, tools=tools)
    eager = generate(model, prompts, slots=False, **kw)
    assert sum(len(c) >= 2 for c in eager.tool_calls) >= 4, eager.tool_calls
    slotted = generate(model, prompts, slots=True, **kw)
    _same_generation(slotted, eager)
    kw.pop("tools")
    refilled = slot_decode.generate(model, prompts, top_k=0, top_p=1.0, graphs=False, rows_per_matmul=4,
                                    max_slots=8, session=tools.session(len(prompts) * G, 120, "cpu"), **kw)
    assert slot_decode.last_split(model)["steps"] > 120   # more steps than one pass: the slots were refilled
    _same_generation(refilled, slotted, exact=True)
    pen = dict(repetition_penalty=1.2, frequency_penalty=0.3, min_tokens=3)
    _same_generation(generate(model, prompts, slots=True, tools=tools, **kw, **pen),
                     generate(model, prompts, slots=False, tools=tools, **kw, **pen))
    n = len(tok.encode("<|call|>calculator 12*34<|/call|>"))
    for new, total in ((n, 160), (n + 1, n + 2)):   # no room for the result; room for part of it
        tools.max_completion_tokens = total
        one = dict(prompts=[tok.render_prompt("one")], num_generations=1, max_new_tokens=new, temperature=0.0,
                   stop_ids=tok.stop_ids, pad_id=tok.pad_id, tools=tools)
        _same_generation(generate(model, slots=True, **one), generate(model, slots=False, **one))
