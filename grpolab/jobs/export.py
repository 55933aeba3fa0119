"""`grpolab export CHECKPOINT OUT_DIR [--merge] [--dtype D]`: a standalone Hugging Face model
directory (weights, config, generation config, tokenizer) from any grpolab checkpoint, which
`AutoModelForCausalLM.from_pretrained` loads without grpolab.

- A Hugging Face checkpoint: re-saved without optimizer, RNG and reference files.
- A LoRA checkpoint of an HF model: with --merge, the adapters merged into the base weights
  (peft's merge_and_unload); without, peft's adapter directory (it needs its base model).
- The built-in GPT (LoRA merged in if it has adapters): converted to transformers' Arcee
  architecture, which is Llama's (pre-norm RMSNorm, RoPE, no biases) with a non-gated MLP,
  down(act(up(x))): with act = exact GELU that is the GPT's block exactly. Its character
  tokenizer becomes a `tokenizers` WordLevel tokenizer with the same ids and chat format.

Every export is loaded back and its logits compared with the checkpoint's (to 1e-5 of the largest
logit's size in float32);
a mismatch is an error, not a silent bad export. OUT_DIR is checked for writing before the model
loads; a write that fails (disk full, read-only file system) removes the partial export.
"""

from __future__ import annotations

import errno
import json
import shutil
from argparse import Namespace
from pathlib import Path

import torch
from safetensors import SafetensorError

from ..errors import ExportError
from ..models.checkpoint import load_model
from ..models.lora import has_lora
from ..models.tokenizer import ASSISTANT, BOS, END, PAD, SPECIAL_TOKENS, TOOL_TOKENS, UNK_CHAR, USER, CharTokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOLERANCE = {"float32": 1e-5, "bfloat16": 5e-2, "float16": 1e-2}



def run(cfg: None, args: Namespace) -> str:
    """`grpolab export CHECKPOINT OUT_DIR`: prints what it wrote."""
    line = run_export(args.checkpoint, args.out_dir, merge=args.merge, dtype=args.dtype)
    print(line)
    return line


def run_export(checkpoint: str | Path, out_dir: str | Path, merge: bool = False, dtype: str = "float32") -> str:
    """Write the export; returns a one-line description of what was written."""

    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    src, out = Path(checkpoint), Path(out_dir)
    if dtype not in DTYPES:
        raise ExportError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{str(out)!r} exists and is not empty; give a new directory")
    _check_writable(out)
    model, tok = load_model(src)
    model.eval()
    ids = torch.randint(0, min(model.config.vocab_size, 90), (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).float()
    try:
        if not hasattr(model, "hf"):   # the built-in GPT
            what = _export_gpt(model, out, dtype)
        elif has_lora(model) and not merge:
            model.hf.save_pretrained(str(out))
            tok.save(out)
            return f"{out}: LoRA adapter (peft layout) of {_adapter_base(src)}; --merge for a standalone model"
        else:
            hf = model.hf.merge_and_unload() if has_lora(model) else model.hf
            hf.to(DTYPES[dtype]).save_pretrained(str(out), safe_serialization=True)
            tok.save(out)
            what = f"{hf.config.model_type} model" + (" (LoRA merged)" if has_lora(model) else "")
    except (OSError, SafetensorError) as e:   # half an export is worse than none: remove it, say why in one line
        shutil.rmtree(out, ignore_errors=True)
        raise ExportError(f"{write_failure(e, out)}; the partial export was removed") from None
    _check(out, ids, expected, dtype)
    return f"{out}: {what}, {dtype}; loads with AutoModelForCausalLM.from_pretrained"


def write_failure(e: Exception, path: Path) -> str:
    """What went wrong writing under `path`, in words: a full disk, a read-only file system, or the error.
    (safetensors' writer reports the OS error only inside its message.)"""
    text = str(e)
    if getattr(e, "errno", None) == errno.ENOSPC or "No space left" in text or "StorageFull" in text:
        return f"disk full while writing {path}"
    if getattr(e, "errno", None) == errno.EROFS or "Read-only file system" in text or "ReadOnlyFilesystem" in text:
        return f"read-only file system: cannot write {path}"
    return f"cannot write {path}: {' '.join((getattr(e, 'strerror', None) or text).split())}"


def _check_writable(out: Path) -> None:
    """ExportError now, before the model loads, if OUT_DIR cannot be created or written."""
    try:
        if out.exists():
            probe = out / ".grpolab-write-test"
            probe.touch()
            probe.unlink()
        else:   # made and removed: the save creates it again (a failed load leaves nothing behind)
            out.mkdir(parents=True)
            out.rmdir()
    except OSError as e:
        raise ExportError(write_failure(e, out)) from None


def _adapter_base(src: Path) -> str:
    return json.loads((src / "adapter_config.json").read_text()).get("base_model_name_or_path", "?")


def _check(out: Path, ids: torch.Tensor, expected: torch.Tensor, dtype: str) -> None:
    """Load the export as any transformers user would and compare its logits with the checkpoint's."""
    from transformers import AutoModelForCausalLM
    loaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        got = loaded(input_ids=ids).logits.float()
    diff = float((got - expected).abs().max())
    # rounding grows with the logits' size: the tolerance is relative to the largest (at least 1)
    limit = TOLERANCE[dtype] * max(1.0, float(expected.abs().max()))
    if diff > limit:
        shutil.rmtree(out)
        raise ExportError(f"the exported model's logits differ from the checkpoint's by {diff:.3g} "
                          f"(> {limit:.3g}); nothing was written")


def _merged_gpt_state(model) -> dict[str, torch.Tensor]:
    """The GPT's weights with any LoRA adapters merged in, under the plain GPT's names."""
    if not has_lora(model):
        return dict(model.state_dict())
    from peft.tuners.lora import LoraLayer
    for m in model.modules():
        if isinstance(m, LoraLayer):
            m.merge()
    return {k.replace(".base_layer.", "."): v for k, v in model.state_dict().items() if ".lora_" not in k}


def _export_gpt(model, out: Path, dtype: str) -> str:
    try:
        from transformers import ArceeConfig, ArceeForCausalLM
    except ImportError:
        raise ExportError("exporting the built-in GPT needs transformers >= 4.53 (the Arcee architecture)") from None
    c = model.config
    sd = _merged_gpt_state(model)
    C, tok = c.n_embd, CharTokenizer()
    cfg = ArceeConfig(vocab_size=c.vocab_size, hidden_size=C, intermediate_size=4 * C, num_hidden_layers=c.n_layer,
                      num_attention_heads=c.n_head, num_key_value_heads=c.n_head, head_dim=C // c.n_head,
                      hidden_act="gelu", max_position_embeddings=c.block_size,
                      rms_norm_eps=torch.finfo(torch.float32).eps,   # F.rms_norm's default for float32
                      rope_parameters={"rope_type": "default", "rope_theta": float(c.rope_base)},
                      attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
                      bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    hf = ArceeForCausalLM(cfg)
    new = {"model.embed_tokens.weight": sd["wte.weight"], "lm_head.weight": sd["lm_head.weight"],
           "model.norm.weight": torch.ones(C)}
    for i in range(c.n_layer):
        qkv = sd[f"blocks.{i}.qkv.weight"]   # rows: H query heads, then H key heads, then H value heads
        p = f"model.layers.{i}."
        new.update({p + "self_attn.q_proj.weight": qkv[:C], p + "self_attn.k_proj.weight": qkv[C:2 * C],
                    p + "self_attn.v_proj.weight": qkv[2 * C:],
                    p + "self_attn.o_proj.weight": sd[f"blocks.{i}.proj.weight"],
                    p + "mlp.up_proj.weight": sd[f"blocks.{i}.fc.weight"],
                    p + "mlp.down_proj.weight": sd[f"blocks.{i}.fc_out.weight"],
                    p + "input_layernorm.weight": torch.ones(C), p + "post_attention_layernorm.weight": torch.ones(C)})
    hf.load_state_dict({k: v.detach().clone().contiguous() for k, v in new.items()}, strict=True)
    hf.generation_config.eos_token_id, hf.generation_config.pad_token_id = tok.eos_id, tok.pad_id
    hf.to(DTYPES[dtype]).save_pretrained(str(out), safe_serialization=True)
    char_tokenizer_for_hf().save_pretrained(str(out))
    return "built-in GPT as an Arcee (Llama-family) model"


# the built-in chat format: <|bos|><|user|>{the messages' contents, joined by newlines}<|assistant|>
CHAT_TEMPLATE = ("{{ '" + BOS + USER + "' }}{% for m in messages %}{% if not loop.first %}{{ '\n' }}{% endif %}"
                 "{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}{{ '" + ASSISTANT + "' }}{% endif %}")


def char_tokenizer_for_hf():
    """The character tokenizer as a transformers `PreTrainedTokenizerFast`: same ids, same chat format."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    ct = CharTokenizer()
    vocab = {ch: i for i, ch in enumerate(ct.chars)} | dict(ct.special)
    tk = Tokenizer(models.WordLevel(vocab, unk_token=UNK_CHAR))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")   # every character alone
    tk.decoder = decoders.Fuse()
    # the tool markers are part of what the model writes: added tokens, but not special ones, so a
    # decode that skips special tokens keeps them (as the built-in tokenizer's decode does)
    tk.add_special_tokens([t for t in SPECIAL_TOKENS if t not in TOOL_TOKENS])
    tk.add_tokens(list(TOOL_TOKENS))
    out = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=BOS, eos_token=END, pad_token=PAD,
                                  unk_token=UNK_CHAR)
    out.chat_template = CHAT_TEMPLATE
    return out
