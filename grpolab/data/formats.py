"""Rows as other tools write them, turned into grpolab's own rows.

Recognised by their columns (LLaMA-Factory's data/README.md for alpaca and sharegpt):
    alpaca    instruction, input, output (+ system, history [[query, response], ...]); pairs: chosen and
              rejected strings instead of output. The user turn is `instruction\\ninput` (the non-empty ones).
    sharegpt  conversations: [{from, value}, ...] with from = human | gpt | function_call | observation
              (+ a leading system turn, or a system column; a tools column); pairs: the conversation ends
              with a human turn and chosen / rejected are single {from, value} messages.
    text      TRL's language-modelling rows: the whole text is trained on (SFT only).

sharegpt roles map onto the chat roles (data/messages.py): human -> user, gpt -> assistant,
observation -> tool (the chat template renders tool results), function_call -> assistant, its text
wrapped as a Hermes `<tool_call>` block: the form grpolab's tool path (rollout/tool_formats.py) reads
from Hugging Face chat models. A tools column (JSON schemas) is written into the system message, since
the rows are rendered through the chat template without a tools argument.

Keys (data.prompt_key and the others) may be dotted: `extra_info.question` reads row['extra_info']['question']
(a column literally named 'extra_info.question' wins).
"""

from __future__ import annotations

import json

from ..errors import DataError

MISSING = object()

SFT_FORMATS = ("prompt + completion (TRL; columns data.prompt_key, data.response_key)",
               "messages (TRL/OpenAI conversation)", "text (TRL language modelling)",
               "alpaca (instruction, input, output)", "sharegpt (conversations of {from, value})")
PAIR_FORMATS = ("prompt + chosen + rejected (TRL explicit prompt)",
                "chosen + rejected (TRL implicit prompt: texts or conversations with a shared start)",
                "alpaca (instruction, input, chosen, rejected)",
                "sharegpt (conversations, chosen and rejected {from, value} messages)")
PROMPT_FORMATS = ("prompt + answer (columns data.prompt_key, data.answer_key; verl's prompt messages and "
                  "reward_model.ground_truth)", "alpaca (instruction, input, output)",
                  "sharegpt (conversations of {from, value})")

SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "observation": "tool", "function_call": "assistant",
                  "system": "system"}
USER_SIDE, MODEL_SIDE = ("human", "observation"), ("gpt", "function_call")
TEXT_KEY = "text"


def formats_hint(formats: tuple[str, ...], what: str) -> str:
    """The phrase an error ends with when a row fits none of `formats`."""
    return f"the {what} formats grpolab reads are: " + "; ".join(formats)


def dig(row: dict, key: str) -> object:
    """row[key]; for a dotted key 'a.b' not itself a column, row['a']['b']; MISSING when absent."""
    if key in row:
        return row[key]
    value: object = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return MISSING
        value = value[part]
    return value


def has(row: dict, key: str | None) -> bool:
    return key is not None and dig(row, key) is not MISSING


def is_sharegpt(row: dict) -> bool:
    return isinstance(row.get("conversations"), list)


def is_alpaca(row: dict) -> bool:
    return "instruction" in row


# ---------------------------------------------------------------- message pieces


def _text(value: object, where: str, what: str, allow_empty: bool = False) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or (not allow_empty and not value.strip()):
        shown = "empty" if isinstance(value, str) else f"a {type(value).__name__}"
        raise DataError(f"{where}: {what} must be non-empty text, got {shown}; fill it in or drop the row")
    return value


def tool_call_text(value: str) -> str:
    """A sharegpt function_call turn as assistant text: a Hermes `<tool_call>` block around its JSON."""
    return f"<tool_call>\n{value.strip()}\n</tool_call>"


def tools_text(tools: object) -> str:
    """A tools column (JSON schemas, as a list or a JSON string) as text for the system message."""
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            pass   # free text: written as it is
    if isinstance(tools, list):
        body = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    else:
        body = tools if isinstance(tools, str) else json.dumps(tools, ensure_ascii=False)
    return ("Tools you may call, one call written as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>:\n"
            + body)


def _system_turn(system: object, tools: object, where: str) -> list[dict]:
    parts = []
    if system not in (None, ""):
        parts.append(_text(system, where, "'system'"))
    if tools not in (None, "", []):
        parts.append(tools_text(tools))
    return [{"role": "system", "content": "\n\n".join(parts)}] if parts else []


# ---------------------------------------------------------------- alpaca


def alpaca_prompt(row: dict, where: str) -> list[dict]:
    """[system], the history's (user, assistant) turns, then the user turn `instruction\\ninput`."""
    msgs = _system_turn(row.get("system"), row.get("tools"), where)
    history = row.get("history") or []
    if not isinstance(history, list):
        raise DataError(f"{where}: 'history' must be a list of [query, response] pairs, got {type(history).__name__}")
    for j, turn in enumerate(history):
        if not (isinstance(turn, (list, tuple)) and len(turn) == 2):
            raise DataError(f"{where}: 'history' item {j} must be a [query, response] pair, got {turn!r:.60}")
        msgs += [{"role": "user", "content": _text(turn[0], where, f"'history' item {j} query")},
                 {"role": "assistant", "content": _text(turn[1], where, f"'history' item {j} response")}]
    parts = [_text(row.get(k), where, repr(k), allow_empty=True) for k in ("instruction", "input")
             if row.get(k) is not None]
    query = "\n".join(p for p in parts if p)
    if not query.strip():
        raise DataError(f"{where}: 'instruction' and 'input' are both empty; fill one in or drop the row")
    return msgs + [{"role": "user", "content": query}]


def alpaca_sft(row: dict, where: str) -> dict:
    """An SFT conversation; every assistant turn, the history's included (as LLaMA-Factory trains), is learned."""
    if "output" not in row:
        raise DataError(f"{where}: alpaca row has no 'output' column; columns are {sorted(row)}")
    out = _text(row["output"], where, "'output'")
    return {"messages": alpaca_prompt(row, where) + [{"role": "assistant", "content": out}], "train_from": 0}


def alpaca_pair(row: dict, where: str) -> dict:
    return {"prompt": alpaca_prompt(row, where), "chosen": _text(row.get("chosen"), where, "'chosen'"),
            "rejected": _text(row.get("rejected"), where, "'rejected'")}


def alpaca_prompt_row(row: dict, where: str) -> tuple[list[dict], str | None]:
    """(the prompt messages, `output` as the reference answer or None)."""
    out = row.get("output")
    return alpaca_prompt(row, where), (_text(out, where, "'output'") if out not in (None, "") else None)


# ---------------------------------------------------------------- sharegpt


def sharegpt_message(m: object, where: str, what: str) -> dict:
    if not (isinstance(m, dict) and m.get("from") in SHAREGPT_ROLES and "value" in m):
        raise DataError(f"{where}: {what} must be {{'from': one of {', '.join(SHAREGPT_ROLES)}, 'value': text}}, "
                        f"got {m!r:.80}")
    value = _text(m["value"], where, f"{what} value")
    if m["from"] == "function_call":
        value = tool_call_text(value)
    return {"role": SHAREGPT_ROLES[m["from"]], "content": value}


def sharegpt_conversation(row: dict, where: str) -> list[dict]:
    """[system], then the turns. As LLaMA-Factory requires, human/observation turns sit at even positions
    and gpt/function_call turns at odd ones; a leading system turn replaces the system column."""
    turns = row["conversations"]
    system = row.get("system")
    if turns and isinstance(turns[0], dict) and turns[0].get("from") == "system":
        system, turns = turns[0].get("value"), turns[1:]
    msgs = _system_turn(system, row.get("tools"), where)
    for j, m in enumerate(turns):
        side = USER_SIDE if j % 2 == 0 else MODEL_SIDE
        if not isinstance(m, dict) or m.get("from") not in side:
            got = m.get("from") if isinstance(m, dict) else m
            raise DataError(f"{where}: conversations turn {j} is {got!r:.40}, expected {' or '.join(side)} (sharegpt "
                            f"turns alternate: human/observation, then gpt/function_call)")
        msgs.append(sharegpt_message(m, where, f"conversations turn {j}"))
    return msgs


def sharegpt_sft(row: dict, where: str) -> dict:
    msgs = sharegpt_conversation(row, where)
    if not msgs or msgs[-1]["role"] != "assistant":
        raise DataError(f"{where}: conversations must end with a gpt or function_call turn to train on")
    return {"messages": msgs, "train_from": 0}


def sharegpt_pair(row: dict, where: str) -> dict:
    msgs = sharegpt_conversation(row, where)
    if not msgs or msgs[-1]["role"] == "assistant":
        raise DataError(f"{where}: a sharegpt pair's conversations must end with a human or observation turn "
                        f"(the prompt); chosen and rejected are the answers")
    sides = {}
    for k in ("chosen", "rejected"):
        m = row.get(k)
        if not isinstance(m, dict) or m.get("from") not in MODEL_SIDE:
            raise DataError(f"{where}: {k!r} must be one {{'from': 'gpt' or 'function_call', 'value': text}} "
                            f"message, got {m!r:.60}")
        sides[k] = [sharegpt_message(m, where, repr(k))]
    return {"prompt": msgs, **sides}


def sharegpt_prompt_row(row: dict, where: str) -> tuple[list[dict], str | None]:
    """(the turns before the last gpt turn, that turn's text as the reference answer); a conversation
    ending with a human turn is all prompt, with no answer."""
    msgs = sharegpt_conversation(row, where)
    if msgs and msgs[-1]["role"] == "assistant":
        msgs, last = msgs[:-1], msgs[-1]["content"]
        answer = None if row["conversations"][-1].get("from") == "function_call" else last
    else:
        answer = None
    if not any(m["role"] == "user" for m in msgs):
        raise DataError(f"{where}: conversations hold no human turn to prompt with")
    return msgs, answer


# ---------------------------------------------------------------- TRL implicit prompt


def shared_text_prefix(chosen: str, rejected: str) -> int:
    """Length of the prompt TRL's extract_prompt takes from two texts: their common prefix, each side keeping
    at least one character, with a space just before the split moved to the completions."""
    n = 0
    while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
        n += 1
    if n and chosen[n - 1] == " ":
        n -= 1
    return n
