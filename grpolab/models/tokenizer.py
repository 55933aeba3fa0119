"""Character tokenizer for the built-in model.

The vocabulary is fixed (printable ASCII plus newline, then special tokens), so a
checkpoint never depends on the data it was trained on and any text round-trips.
"""

from __future__ import annotations

import string

PAD, BOS, USER, ASSISTANT, END = "<|pad|>", "<|bos|>", "<|user|>", "<|assistant|>", "<|end|>"
# tool use (nanochat style): <|call|>NAME ARGS<|/call|> is sampled; <|out|>RESULT<|/out|> is written by the engine
CALL, CALL_END, OUT, OUT_END = "<|call|>", "<|/call|>", "<|out|>", "<|/out|>"
TOOL_TOKENS = (CALL, CALL_END, OUT, OUT_END)
SPECIAL_TOKENS = (PAD, BOS, USER, ASSISTANT, END, *TOOL_TOKENS)
_CHARS = "\n" + "".join(c for c in string.printable if 32 <= ord(c) < 127)
UNK_CHAR = "?"


class CharTokenizer:
    """Maps characters to ids one to one; special tokens come after the characters.

    Characters outside the alphabet encode as '?' (so `decode(encode(s)) == s` for
    any ASCII-printable text with newlines, and never fails on other input).
    """

    def __init__(self) -> None:
        self.chars = _CHARS
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        self.special = {tok: len(self.chars) + i for i, tok in enumerate(SPECIAL_TOKENS)}
        self.vocab_size = len(self.chars) + len(SPECIAL_TOKENS)
        self.pad_id = self.special[PAD]
        self.bos_id = self.special[BOS]
        self.user_id = self.special[USER]
        self.assistant_id = self.special[ASSISTANT]
        self.eos_id = self.special[END]
        self.stop_ids = (self.eos_id,)
        self.call_id, self.call_end_id, self.out_id, self.out_end_id = (self.special[t] for t in TOOL_TOKENS)
        self._id_to_special = {v: k for k, v in self.special.items()}
        self._tool_ids = {self.special[t] for t in TOOL_TOKENS}

    def encode(self, text: str, tool_tokens: bool = True) -> list[int]:
        """Character ids; the tool markers (<|call|>, <|/call|>, <|out|>, <|/out|>) become their special
        tokens unless `tool_tokens` is False (a tool's own output is encoded that way, so nothing it
        prints can pose as a marker)."""
        unk = self.stoi[UNK_CHAR]
        if not tool_tokens or "<|" not in text:
            return [self.stoi.get(c, unk) for c in text]
        out: list[int] = []
        i = 0
        while i < len(text):
            mark = next((t for t in TOOL_TOKENS if text.startswith(t, i)), None) if text[i] == "<" else None
            if mark:
                out.append(self.special[mark])
                i += len(mark)
            else:
                out.append(self.stoi.get(text[i], unk))
                i += 1
        return out

    def decode(self, ids, skip_special: bool = True) -> str:
        """Text of `ids`; special tokens are dropped with skip_special, except the tool markers, which are
        part of what the model wrote (samples and rewards see calls and results inline)."""
        out = []
        for i in ids:
            i = int(i)
            if i < len(self.chars):
                out.append(self.chars[i])
            elif not skip_special or i in self._tool_ids:
                out.append(self._id_to_special[i])
        return "".join(out)

    def tool_output_mask(self, ids: list[int]) -> list[bool]:
        """True at the tokens a tool wrote (from <|out|> through <|/out|>): context, never trained on."""
        mask, inside = [], False
        for i in ids:
            if i == self.out_id:
                inside = True
            mask.append(inside)
            if i == self.out_end_id:
                inside = False
        return mask

    def render_prompt(self, prompt) -> list[int]:
        """Chat prompt: <|bos|><|user|>{prompt}<|assistant|>; the model continues from here.

        A list of {role, content} messages renders as `render_conversation` does, then <|assistant|>
        (a single user turn, or system + user, is one <|user|> turn: the contents joined by newlines)."""
        if isinstance(prompt, list):
            return self.render_conversation(prompt)[0] + [self.assistant_id]
        return [self.bos_id, self.user_id, *self.encode(prompt), self.assistant_id]

    def render_conversation(self, messages: list[dict], train_from: int = 0) -> tuple[list[int], list[bool]]:
        """(ids, loss mask) of a conversation: <|bos|>, then each run of non-assistant messages as one
        <|user|> turn (contents joined by newlines), each assistant message as
        <|assistant|>{content}<|end|>. The mask marks the content and <|end|> of the assistant
        messages from index `train_from` on (what SFT trains)."""
        ids, mask = [self.bos_id], [False]
        user: list[str] = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                user.append(m["content"])
                continue
            if user:
                turn = [self.user_id, *self.encode("\n".join(user))]
                ids += turn
                mask += [False] * len(turn)
                user = []
            ids.append(self.assistant_id)
            mask.append(False)
            body = self.render_completion(m["content"])
            ids += body
            mask += [i >= train_from and not tool for tool in self.tool_output_mask(body)]
        if user:
            turn = [self.user_id, *self.encode("\n".join(user))]
            ids += turn
            mask += [False] * len(turn)
        return ids, mask

    def render_completion(self, completion: str) -> list[int]:
        """Assistant turn as trained in SFT: the text then <|end|>."""
        return [*self.encode(completion), self.eos_id]
