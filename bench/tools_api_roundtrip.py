"""Tool calling through `grpolab serve` on the tools demo's checkpoint: the real openai client runs the real
calculator for every call the model makes, on 40 held-out problems (greedy), then the same problems go
through the rollout engine; each API conversation must spell the engine's completion exactly.

    grpolab demo --config configs/tools_demo.yaml --out runs/tools eval.num_problems=20
    PYTHONPATH=. .venv/bin/python bench/tools_api_roundtrip.py runs/tools/checkpoints/step_60
"""
import json
import sys
import time
from pathlib import Path

import openai

from grpolab.data.tasks import arithmetic
from grpolab.models.checkpoint import load_model
from grpolab.rollout.engine import generate
from grpolab.rollout.tool_decode import ToolUse
from grpolab.rollout.tool_formats import BuiltinFormat
from grpolab.rollout.tools import ToolRunner, calculator, load_tools

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import running_server  # noqa: E402  (the tests' server launcher: a real `grpolab serve`)

CALC = load_tools(["calculator"])["calculator"].schema
ckpt = sys.argv[1]
rows = arithmetic.generate("test", 40, seed=7, cfg=arithmetic.ArithmeticConfig(min_ops=2, max_ops=3, max_operand=99,
                                                                              max_value=999))
with running_server(ckpt, "--name", "demo") as (url, proc):
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    API_TEXTS = []
    stats = {"rows": 0, "calls": 0, "right": 0, "stream_same": 0, "bad": 0}
    t0 = time.time()
    for i, row in enumerate(rows):
        msgs = [{"role": "user", "content": row["prompt"]}]
        for _ in range(6):
            r = client.chat.completions.create(model="demo", messages=msgs, tools=[CALC], temperature=0)
            s = client.chat.completions.create(model="demo", messages=msgs, tools=[CALC], temperature=0,
                                               stream=True)
            content, args, fin = "", "", None
            for ch in s:
                d = ch.choices[0].delta
                content += d.content or ""
                for tc in d.tool_calls or []:
                    args += tc.function.arguments or ""
                fin = ch.choices[0].finish_reason or fin
            m = r.choices[0].message
            whole_args = "".join(t.function.arguments for t in (m.tool_calls or []))
            same = (content or None) == m.content and args == whole_args and fin == r.choices[0].finish_reason
            stats["stream_same"] += same
            if i == 0:
                print("reply:", json.dumps(r.choices[0].model_dump(exclude_none=True)))
            if not m.tool_calls:
                break
            stats["calls"] += len(m.tool_calls)
            msgs.append(m.model_dump(exclude_none=True))
            for tc in m.tool_calls:
                out = calculator(**json.loads(tc.function.arguments))
                msgs.append({"role": "tool", "tool_call_id": tc.id, "content": out})
        text = ""
        for x in msgs[1:]:
            if x["role"] == "assistant":
                text += x.get("content") or ""
                for tc in x.get("tool_calls", []):
                    expression = json.loads(tc["function"]["arguments"])["expression"]
                    text += "<|call|>calculator " + expression + "<|/call|>"
            else:
                text += "<|out|>" + x["content"] + "<|/out|>"
        API_TEXTS.append(text + (m.content or ""))
        final = "".join(x.get("content") or "" for x in msgs[1:] if x["role"] == "assistant") + (m.content or "")
        stats["rows"] += 1
        stats["right"] += ("#### " + row["answer"].split("####")[-1].strip()) in final
        if i == 0:
            print("conversation:", json.dumps(msgs)[:1500], "| final:", m.content)
    stats["seconds"] = round(time.time() - t0, 1)
    print(stats)

# the same problems through the rollout engine (greedy, the real calculator): the API's conversation
# must spell the engine's completion exactly
model, tok = load_model(ckpt)
model.eval()
tu = ToolUse(BuiltinFormat(tok), ToolRunner(load_tools(["calculator"]), timeout=5, max_output_chars=500),
             max_calls=4, max_completion_tokens=100)
same = 0
for row, api in zip(rows, API_TEXTS):
    g = generate(model, [tok.render_prompt(row["prompt"])], num_generations=1, max_new_tokens=80, temperature=0.0,
                 stop_ids=tok.stop_ids, pad_id=tok.pad_id, tools=tu)
    eng = tok.decode(g.completion_ids[0][g.context_mask[0]].tolist())
    same += eng == api
    if eng != api:
        print("differs:", repr(eng), "|", repr(api))
print(f"API conversation == engine rollout on {same}/{len(rows)} problems")
tu.close()
