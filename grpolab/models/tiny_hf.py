"""Build a tiny Llama-architecture Hugging Face model and tokenizer locally (no hub).

Used by the tests, the benchmarks and `configs/gsm8k_tiny_hf.yaml` (through
`grpolab tiny-model DIR`): random weights and a byte-level BPE tokenizer trained on the
spot, saved in the `save_pretrained` layout, so every Hugging Face code path runs for real
on a CPU in seconds.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..data.tasks import arithmetic
from ..utils.files import writing_into

# ChatML-style template: enough to exercise conversational prompts end to end. With `tools=` it lists
# them in a system turn and renders `tool` messages Qwen2.5's way (a user turn of <tool_response>s), so
# the Hermes-style tool-call path runs without a hub model.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools (call one as <tool_call>{\"name\": ..., \"arguments\": {...}}"
    "</tool_call>):{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user\n"
    "{% else %}{{ '\\n' }}{% endif %}"
    "<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]


def _default_texts() -> list[str]:
    rows = arithmetic.generate("train", 2000, seed=0)
    return [r["prompt"] + "\n" + r["answer"] for r in rows]


def build_tokenizer(texts: list[str] | None = None, vocab_size: int = 512):
    """A byte-level BPE `PreTrainedTokenizerFast` with ChatML specials and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(texts or _default_texts(), trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|pad|>",
                                  bos_token=None, unk_token=None)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tiny_llama(vocab_size: int, hidden: int = 128, layers: int = 4, heads: int = 4,
                     intermediate: int = 512, max_positions: int = 1024, seed: int = 0,
                     eos_token_id: int | None = None, pad_token_id: int | None = None,
                     kv_heads: int | None = None):
    """A random Llama; `kv_heads` (default: `heads`) fewer than `heads` gives grouped-query attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads or heads, intermediate_size=intermediate,
                      max_position_embeddings=max_positions, tie_word_embeddings=True,
                      eos_token_id=eos_token_id, pad_token_id=pad_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def save_tiny_model(out_dir: str | Path, texts: list[str] | None = None, vocab_size: int = 512,
                    **model_kwargs) -> Path:
    """Tokenizer + tiny Llama saved to `out_dir`; loadable with `AutoModelForCausalLM.from_pretrained`."""
    out = Path(out_dir)
    tok = build_tokenizer(texts, vocab_size)
    model = build_tiny_llama(len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                             **model_kwargs)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    with writing_into(out):
        model.save_pretrained(str(out), safe_serialization=True)
        tok.save_pretrained(str(out))
    return out
