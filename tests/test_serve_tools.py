"""Tool calling through `grpolab serve`'s chat API with the real `openai` client: the model's call comes
back as `tool_calls`, the client's `tool` message goes back in rendered as training renders results, and
the model answers. Two tiny models are trained here (a few seconds of SFT) to make one call greedily and
answer after its result: the built-in GPT (`<|call|>` format) and a tiny HF Llama with a ChatML template
(Hermes `<tool_call>` format). The parser is also checked alone: streamed token by token or whole, the
same calls and content."""

import copy
import importlib.resources
import json
import random
import shutil
import sys

import jsonschema
import openai
import pytest
import torch
from conftest import ROOT, overfit, running_server
from starlette.testclient import TestClient
from transformers import AutoTokenizer

from grpolab.data.supervised import Example, collate, encode
from grpolab.models import GPT, CharTokenizer, GPTConfig
from grpolab.models.checkpoint import save_checkpoint
from grpolab.models.hf import HFTokenizer, load_hf
from grpolab.models.tiny_hf import build_tokenizer, save_tiny_model
from grpolab.rollout.tool_formats import BuiltinFormat, tool_format
from grpolab.rollout.tools import CallRecord, load_tools
from grpolab.serve.api import create_app
from grpolab.serve.model_loader import load_engine
from grpolab.serve.requests import ChatRequest, Server
from grpolab.serve.tool_calls import BUILTIN_MARKS, HERMES_MARKS, CallParser, parse_reply

sys.path.insert(0, str(ROOT / "scripts"))
import fetch_smollm2  # noqa: E402

CALC = load_tools(["calculator"])["calculator"].schema   # what training's chat template was given
Q = "What is 12*34?"
HERMES_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>'


def _after_call(model: str, result: str = "408") -> ChatRequest:
    """The request that sends the calculator's result back after the model's call."""
    call = {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "12*34"}'}}
    return ChatRequest(model=model, tools=[CALC], messages=[
        {"role": "user", "content": Q}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": result}])


@pytest.fixture(scope="module")
def builtin_server(tmp_path_factory):
    """The built-in GPT trained on rollouts as the tools demo writes them (call, engine's result, answer)."""
    tok = CharTokenizer()
    torch.manual_seed(0)
    model = GPT(GPTConfig(tok.vocab_size, n_layer=2, n_head=2, n_embd=64, block_size=128))
    rows = [encode(tok, {"prompt": Q, "completion": "<|call|>calculator 12*34<|/call|><|out|>408<|/out|>It is 408."}),
            encode(tok, {"prompt": "Hi", "completion": "Hello."})]
    overfit(model, collate(rows, 0), 300, 1e-2)
    ckpt = save_checkpoint(tmp_path_factory.mktemp("serve_tools") / "checkpoints", 0, model, tokenizer=tok)
    with running_server(ckpt, "--name", "gpt") as (url, proc):
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A tiny Llama (ChatML template with a tools slot) trained on a rollout laid out as training lays it:
    prompt with tools, the call and end of turn, the result as HermesFormat renders it, the answer."""
    d = save_tiny_model(tmp_path_factory.mktemp("hf_serve_tools"), layers=2, hidden=64, heads=2, intermediate=128)
    model, tok = load_hf(str(d))
    fmt = tool_format(tok, [CALC], "tiny")
    prompt = tok.render_prompt(Q)
    result = fmt.render([CallRecord("calculator", {"expression": "12*34"}, "408", False)])
    call, answer = tok.encode(HERMES_CALL) + [tok.eos_id], tok.encode("It is 408.") + [tok.eos_id]
    tok.tools = None
    hi, hello = tok.render_prompt([{"role": "user", "content": "Hi"}]), tok.encode("Hello.") + [tok.eos_id]
    rows = [Example(prompt + call + result + answer,
                    [False] * len(prompt) + [True] * len(call) + [False] * len(result) + [True] * len(answer)),
            Example(hi + hello, [False] * len(hi) + [True] * len(hello))]
    overfit(model, collate(rows, 0), 150, 3e-3)
    model.hf.save_pretrained(str(d), safe_serialization=True)
    return d, prompt + call + result


@pytest.fixture(scope="module")
def hf_server(hf_model):
    with running_server(hf_model[0], "--name", "llm") as (url, proc):
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _stream(client, **kw):
    """A streamed reply joined as a client joins it: content, tool calls by index, finish reason."""
    content, calls, finish, first = "", {}, None, {}
    for ch in client.chat.completions.create(stream=True, **kw):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            if tc.id:
                assert c["id"] is None   # the id, type and name come once, first
                c["id"], first[tc.index] = tc.id, tc.function.arguments
                c["name"] += tc.function.name
            else:
                assert tc.function.name is None
            c["arguments"] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def _round_trip(client, model, tools):
    """call -> tool message -> answer, plain and streamed; returns the two replies."""
    msgs = [{"role": "user", "content": Q}]
    r = client.chat.completions.create(model=model, messages=msgs, tools=tools, temperature=0, max_tokens=100)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert len(c.message.tool_calls) == 1
    tc = c.message.tool_calls[0]
    assert tc.id.startswith("call_") and tc.type == "function" and tc.function.name == "calculator"
    assert json.loads(tc.function.arguments) == {"expression": "12*34"}
    content, calls, finish = _stream(client, model=model, messages=msgs, tools=tools, temperature=0, max_tokens=100)
    assert (content, finish) == ("", "tool_calls")
    assert [(x["name"], json.loads(x["arguments"])) for x in calls] == [("calculator", {"expression": "12*34"})]
    assert calls[0]["id"].startswith("call_")
    msgs += [c.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": tc.id, "content": "408"}]
    r2 = client.chat.completions.create(model=model, messages=msgs, tools=tools, temperature=0, max_tokens=60)
    assert r2.choices[0].message.content == "It is 408." and r2.choices[0].finish_reason == "stop"
    assert not r2.choices[0].message.tool_calls
    assert _stream(client, model=model, messages=msgs, tools=tools, temperature=0, max_tokens=60) == \
        ("It is 408.", [], "stop")
    return r, r2


@pytest.mark.slow
def test_builtin_model_round_trip(builtin_server):
    _round_trip(builtin_server, "gpt", [CALC])
    # without tools (and with tool_choice none) the same prompt is plain text: the call stays in the content
    for kw in ({}, {"tools": [CALC], "tool_choice": "none"}):
        r = builtin_server.chat.completions.create(model="gpt", messages=[{"role": "user", "content": Q}],
                                                   temperature=0, max_tokens=40, **kw)
        assert r.choices[0].message.content.startswith("<|call|>calculator 12*34<|/call|>")
        assert r.choices[0].message.tool_calls is None


@pytest.mark.slow
def test_builtin_forced_tool_choice_and_unknown_names(builtin_server):
    # "Hi" gets a plain answer; a named tool_choice makes the reply start with that call's opening
    hi = [{"role": "user", "content": "Hi"}]
    r = builtin_server.chat.completions.create(model="gpt", messages=hi, tools=[CALC], temperature=0, max_tokens=20)
    assert r.choices[0].message.content == "Hello." and r.choices[0].finish_reason == "stop"
    for choice in ("required", {"type": "function", "function": {"name": "calculator"}}):
        r = builtin_server.chat.completions.create(model="gpt", messages=[{"role": "user", "content": Q}],
                                                   tools=[CALC], tool_choice=choice, temperature=0, max_tokens=40)
        assert r.choices[0].finish_reason == "tool_calls"
        assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"expression": "12*34"}
    # streamed with n=2 and log-probs: every sampled token's log-prob is sent once, each choice ends in its call
    chunks = list(builtin_server.chat.completions.create(
        model="gpt", messages=[{"role": "user", "content": Q}], tools=[CALC], temperature=0, max_tokens=40, n=2,
        stream=True, logprobs=True, stream_options={"include_usage": True}))
    tokens, finish, names = {0: 0, 1: 0}, {}, {0: "", 1: ""}
    for ch in chunks:
        for c in ch.choices:
            tokens[c.index] += len(c.logprobs.content) if c.logprobs else 0
            finish[c.index] = c.finish_reason or finish.get(c.index)
            names[c.index] += "".join(t.function.name or "" for t in c.delta.tool_calls or [])
    assert finish == {0: "tool_calls", 1: "tool_calls"} and names == {0: "calculator", 1: "calculator"}
    assert tokens == {0: 18, 1: 18} and chunks[-1].usage.completion_tokens == 36   # <|call|>calculator 12*34<|/call|>
    # the model calls "calculator", which this request did not give: the call is content, as written
    schema = {"type": "object", "properties": {"q": {"type": "string"}}}
    other = {"type": "function", "function": {"name": "lookup", "parameters": schema}}
    r = builtin_server.chat.completions.create(model="gpt", messages=[{"role": "user", "content": Q}],
                                               tools=[other], temperature=0, max_tokens=40)
    assert r.choices[0].message.content == "<|call|>calculator 12*34<|/call|>"
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_bad_tools_get_one_clear_400(builtin_server):
    msgs = [{"role": "user", "content": Q}]
    cases = [({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name"),
             ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
             ({"tools": [CALC], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
             ({"tool_choice": "required"}, "tool_choice"),
             ({"tools": [CALC], "tool_choice": "sometimes"}, "tool_choice")]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            builtin_server.chat.completions.create(model="gpt", messages=msgs, max_tokens=5, **kw)
        assert e.value.body["param"] == param, e.value.body
    bad = [*msgs, {"role": "tool", "tool_call_id": "call_x", "content": "1"}]
    with pytest.raises(openai.BadRequestError) as e:
        builtin_server.chat.completions.create(model="gpt", messages=bad, tools=[CALC], max_tokens=5)
    assert e.value.body["param"] == "messages[1].tool_call_id" and "tool_call_id" in e.value.body["message"]


def test_builtin_prompt_is_the_rollout_layout():
    """The server's prompt for call + result is token for token what a rollout holds at that point."""
    tok = CharTokenizer()
    app = Server(None, tok, "gpt", 128)
    r = _after_call("gpt", "408 <|call|>")
    out = BuiltinFormat(tok).render([CallRecord("calculator", "12*34", "408 <|call|>", False)])
    assert app.chat_prompt(r) == tok.render_prompt(Q) + tok.encode("<|call|>calculator 12*34<|/call|>") + out


@pytest.mark.slow
def test_hf_model_round_trip(hf_server, hf_model):
    r, _ = _round_trip(hf_server, "llm", [CALC])
    assert r.usage.prompt_tokens > 40   # the tools' schemas are in the prompt
    # a named tool_choice: the reply starts inside that call (its name written for the model), which it completes
    named = {"type": "function", "function": {"name": "calculator"}}
    r = hf_server.chat.completions.create(model="llm", messages=[{"role": "user", "content": Q}], tools=[CALC],
                                          tool_choice=named, temperature=0, max_tokens=60)
    assert r.choices[0].finish_reason == "tool_calls"
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"expression": "12*34"}
    # tool_choice none: no tools in the prompt, nothing parsed
    r = hf_server.chat.completions.create(model="llm", messages=[{"role": "user", "content": Q}], tools=[CALC],
                                          tool_choice="none", temperature=0, max_tokens=30)
    assert r.choices[0].message.tool_calls is None and r.usage.prompt_tokens < 40


@pytest.mark.slow
def test_hf_forced_calls_are_held_to_the_tools_schema(hf_server):
    """tool_choice "required" or a named function: the call is decoded under the tool's parameters schema (as
    vLLM's guided tool calls), so it always parses, with valid arguments. Unconstrained, the model answers "Hi"
    with "Hello." inside the forced opening, which came back as content (issue 48); these tools it never saw."""
    lookup = {"type": "object", "properties": {"unit": {"enum": ["cm", "m"]}, "exact": {"type": "boolean"}},
              "required": ["unit", "exact"], "additionalProperties": False}
    flag = {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"],
            "additionalProperties": False}
    schemas = {"lookup": lookup, "flag": flag}
    tools = [{"type": "function", "function": {"name": k, "parameters": v}} for k, v in schemas.items()]
    hi = [{"role": "user", "content": "Hi"}]
    for choice, names in (("required", {"lookup", "flag"}), ({"type": "function", "function": {"name": "flag"}},
                                                             {"flag"})):
        r = hf_server.chat.completions.create(model="llm", messages=hi, tools=tools, tool_choice=choice, n=8,
                                              temperature=1.0, seed=1, max_tokens=150)
        for c in r.choices:
            assert c.finish_reason == "tool_calls" and c.message.content is None, c
            (call,) = c.message.tool_calls
            assert call.function.name in names
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
            assert call.function.arguments == json.dumps(json.loads(call.function.arguments))   # Hermes' spacing
    # the trained call is still written as trained
    r = hf_server.chat.completions.create(model="llm", messages=[{"role": "user", "content": Q}], tools=[CALC],
                                          tool_choice="required", temperature=0, max_tokens=150)
    assert r.choices[0].message.tool_calls, r.choices[0]
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"expression": "12*34"}
    # a forced call is the reply: a response_format for its content cannot hold too
    with pytest.raises(openai.BadRequestError) as e:
        hf_server.chat.completions.create(model="llm", messages=hi, tools=tools, tool_choice="required",
                                          response_format={"type": "json_object"}, max_tokens=5)
    assert e.value.body["param"] == "tool_choice" and "response_format" in e.value.body["message"]


@pytest.mark.slow
def test_hf_prompt_is_the_rollout_layout_and_non_tool_templates_are_refused(hf_model, tmp_path):
    d, rollout = hf_model
    batcher, tok, context = load_engine(str(d))
    server = Server(batcher, tok, "llm", context)
    r = _after_call("llm")
    assert server.chat_prompt(r) == rollout
    # a template that neither reads tools nor writes ChatML: tools are one 400 naming the field
    plain = tmp_path / "plain"
    shutil.copytree(d, plain)
    cfg = json.loads((plain / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool role') }}"
                            "{% endif %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    (plain / "tokenizer_config.json").write_text(json.dumps(cfg))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    batcher, tok, context = load_engine(str(plain))
    app = create_app(Server(batcher, tok, "plain", context))
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", max_retries=0, http_client=TestClient(app))
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="plain", messages=[{"role": "user", "content": Q}], tools=[CALC])
    assert e.value.body["param"] == "tools" and "no tool support" in e.value.body["message"]
    # a template that refuses a conversation (its raise_exception): a 400 with its words, not a 500
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="plain", messages=_after_call("plain").messages)
    assert e.value.body["param"] == "messages" and "no tool role" in e.value.body["message"]


def test_template_that_renders_tool_calls_itself():
    """Qwen2.5's own template (as TRL ships it) renders an assistant's `tool_calls` itself: the server hands
    them over with the arguments as objects, and the prompt after the call and its result is the rollout's."""
    hf = build_tokenizer()
    hf.chat_template = (importlib.resources.files("trl") / "chat_templates" / "qwen2_5.jinja").read_text()
    train_tok, serve_tok = HFTokenizer(hf), HFTokenizer(copy.deepcopy(hf))
    fmt = tool_format(train_tok, [CALC], "qwen-template")
    result = fmt.render([CallRecord("calculator", {"expression": "12*34"}, "408", False)])
    server = Server(None, serve_tok, "q", 4096)
    r = _after_call("q")
    assert server.chat_prompt(r) == train_tok.render_prompt(Q) + train_tok.encode(HERMES_CALL) + [hf.eos_token_id] \
        + result


# ---------------------------------------------------------------- the parser alone
TOOLS = {"calculator": ["expression"], "add": ["a", "b"]}
CASES = [
    (HERMES_MARKS, "Let me compute.\n" + HERMES_CALL + "\n",
     "Let me compute.\n\n", [("calculator", {"expression": "12*34"})]),
    (HERMES_MARKS, HERMES_CALL + "\n<tool_call>\n" + '[{"name": "add", "arguments": {"a": 1, "b": 2}}]' +
     "\n</tool_call>", "\n", [("calculator", {"expression": "12*34"}), ("add", {"a": 1, "b": 2})]),
    (HERMES_MARKS, "<tool_call>{not json}</tool_call> a < b <tool_", "<tool_call>{not json}</tool_call> a < b <tool_",
     []),
    (HERMES_MARKS, '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "nope", "arguments": {}}</tool_call>', []),
    (HERMES_MARKS, "plain answer < 5", "plain answer < 5", []),
    (BUILTIN_MARKS, "<|call|>calculator 2+3<|/call|>", None, [("calculator", {"expression": "2+3"})]),
    (BUILTIN_MARKS, 'so <|call|>add {"a": 2, "b": 40}<|/call|>', "so ", [("add", {"a": 2, "b": 40})]),
    (BUILTIN_MARKS, "<|call|>add 2 40<|/call|>", "<|call|>add 2 40<|/call|>", []),   # add takes 2 arguments
    (BUILTIN_MARKS, "<|call|>calculator 2+", "<|call|>calculator 2+", []),          # never closed
]


@pytest.mark.parametrize("marks,text,content,calls", CASES)
def test_parser_whole_and_streamed_agree(marks, text, content, calls):
    got_content, got_calls = parse_reply(marks, TOOLS, text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    rng = random.Random(0)
    for split in ("chars", "random"):   # cumulative snapshots, as a stream delivers them
        cuts = list(range(1, len(text) + 1)) if split == "chars" else sorted(rng.sample(range(1, len(text)), 3))
        p, events = CallParser(marks, TOOLS), []
        for i in cuts:
            events += p.feed(text[:i])
        events += p.feed(text, done=True)
        streamed = "".join(x for k, x in events if k == "content")
        assert (streamed or None) == content
        assert [(c.name, c.arguments) for k, c in events if k == "call"] == \
            [(c.name, c.arguments) for c in got_calls]
        # no piece of a call's text is ever streamed as content
        if calls:
            assert all("<tool_call>" not in x and "<|call|>" not in x for k, x in events if k == "content")


@pytest.mark.slow
def test_chatml_template_without_tools_gets_trainings_prelude():
    """SmolLM2-Instruct's template never reads tools: the server gives them the way training does (grpolab's
    prelude), and the conversation after a call is token for token the rollout's."""
    d = fetch_smollm2.fetch(fetch_smollm2.DEFAULT_OUT)
    train_tok, serve_tok = (HFTokenizer(AutoTokenizer.from_pretrained(str(d))) for _ in range(2))
    fmt = tool_format(train_tok, [CALC], "smol")
    result = fmt.render([CallRecord("calculator", {"expression": "12*34"}, "408", False)])
    prompt = train_tok.render_prompt(Q)
    server = Server(None, serve_tok, "smol", 8192)
    ask = [{"role": "user", "content": Q}]
    assert server.chat_prompt(ChatRequest(model="smol", tools=[CALC], messages=ask)) == prompt
    call = train_tok.encode(HERMES_CALL) + [train_tok.eos_id]
    assert server.chat_prompt(_after_call("smol")) == prompt + call + result
    # without tools the template renders as SmolLM2's own
    plain = HFTokenizer(AutoTokenizer.from_pretrained(str(d)))
    assert server.chat_prompt(ChatRequest(model="smol", messages=ask)) == plain.render_prompt(ask)
