from grpolab.models.tokenizer import SPECIAL_TOKENS


def test_round_trip_ascii_and_newlines(tok):
    text = "Mia has 7 shells.\n7+5=12\n#### 12 ~{}|`"
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(text)) == len(text)


def test_special_tokens_are_distinct_and_skipped(tok):
    ids = [tok.special[s] for s in SPECIAL_TOKENS]
    assert len(set(ids)) == len(SPECIAL_TOKENS)
    assert all(i >= len(tok.chars) for i in ids)
    assert max(ids) == tok.vocab_size - 1
    p = tok.render_prompt("1+1?")
    assert p[0] == tok.bos_id and p[1] == tok.user_id and p[-1] == tok.assistant_id
    assert tok.decode(p) == "1+1?"
    assert tok.decode(p, skip_special=False) == "<|bos|><|user|>1+1?<|assistant|>"
    assert tok.render_completion("#### 2")[-1] == tok.eos_id


def test_unknown_characters_become_question_mark(tok):
    assert tok.decode(tok.encode("héllo")) == "h?llo"
