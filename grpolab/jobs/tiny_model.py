"""`grpolab tiny-model OUT`: a tiny random Llama with a BPE tokenizer (Hugging Face layout) for CPU runs."""

from __future__ import annotations

import json
from argparse import Namespace

from ..errors import ConfigError
from ..models.tiny_hf import SPECIALS, save_tiny_model


def run(cfg: None, args: Namespace) -> str:
    """`grpolab tiny-model OUT`: prints where it wrote."""
    path = run_tiny_model(args.out, args.data, vocab_size=args.vocab_size)
    print(f"wrote {path}")
    return path


def run_tiny_model(out: str, data: str | None = None, vocab_size: int = 512) -> str:
    """Write the model to `out`; its tokenizer trains on `data`'s question/prompt and answer texts
    (default: arithmetic problems). The path written."""
    least = 256 + len(SPECIALS)   # byte-level BPE: every byte, and the special tokens
    if vocab_size < least:
        raise ConfigError(f"--vocab-size: {vocab_size} is below {least} (the 256 bytes and {len(SPECIALS)} special "
                          f"tokens every tokenizer of this kind has)")
    texts = None
    if data:
        with open(data) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        texts = [str(r.get("question", r.get("prompt", ""))) + "\n" + str(r.get("answer", "")) for r in rows]
    return save_tiny_model(out, texts, vocab_size=vocab_size)
