"""Reward models: one scalar score for (prompt, completion), read from a language model's hidden
state at the sequence's last token.

Two kinds behind one interface (`ids`, `forward`, `save_checkpoint_files`):
- BuiltinRewardModel: the built-in GPT as backbone plus a linear `score` head (no bias, as Hugging
  Face's), read at the <|end|> token that closes the assistant turn. Its checkpoint is the GPT's
  (model.safetensors + model_config.json, type 'builtin-rm').
- HFRewardModel: a Hugging Face AutoModelForSequenceClassification with one label, which pools
  the last non-pad token itself. Its checkpoint is the save_pretrained layout (LoRA merged in), so
  `rm:<dir>` and any Hugging Face tool load it as it is.
Both tokenize a pair exactly as the `rm:` reward does when it scores (training sees what scoring sees).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..data.supervised import as_sft_row, collate, encode
from ..utils.padding import pad_sequences
from .checkpoint import checkpoint_job, load_model, load_ref_weights
from .gpt import GPT, GPTConfig
from .logprobs import summed_logprobs
from .lora import add_lora, has_lora
from .reference import reference
from .tokenizer import CharTokenizer

BUILTIN_RM = "builtin-rm"


class BuiltinRewardModel(nn.Module):
    def __init__(self, backbone: GPT, tok: CharTokenizer | None = None) -> None:
        super().__init__()
        self.backbone = backbone
        self.score = nn.Linear(backbone.config.n_embd, 1, bias=False)
        # small random weights, as Hugging Face initialises its score heads: a zero head would pass no
        # gradient to the backbone, which then waits for the head alone to find a signal
        nn.init.normal_(self.score.weight, std=0.02)
        self.tok = tok or CharTokenizer()
        self.config = backbone.config
        self.lora: dict | None = None

    def ids(self, prompt, completion: str) -> list[int]:
        """The chat-rendered prompt, the completion and <|end|>; the last block_size tokens when longer
        (the end, where the answer is, is what the score needs)."""
        t = self.tok
        return (t.render_prompt(prompt) + t.encode(completion) + [t.eos_id])[-self.config.block_size:]

    def forward(self, batch: list[list[int]]) -> torch.Tensor:
        """(B,) float32 scores of token-id lists (right-padded here)."""
        dev = self.score.weight.device
        ids, valid = pad_sequences(batch, self.tok.pad_id, "right")
        ids, valid = ids.to(dev), valid.to(dev)
        h = self.backbone(ids, key_valid=valid, hidden=True)
        last = h[torch.arange(len(batch), device=dev), valid.sum(-1) - 1]
        return self.score(last.to(self.score.weight.dtype)).squeeze(-1).float()

    def add_lora(self, settings: dict) -> None:
        add_lora(self.backbone, settings)      # freezes the backbone, adapters trainable
        self.score.requires_grad_(True)        # the head is new: always trained
        self.lora = dict(settings)

    def lora_target(self) -> nn.Module:
        return self.backbone

    def set_gradient_checkpointing(self, on: bool) -> None:
        self.backbone.gradient_checkpointing = on

    def save_checkpoint_files(self, path: Path) -> None:
        save_file({k: v.detach().contiguous() for k, v in self.state_dict().items()}, str(path / "model.safetensors"))
        meta = {"type": BUILTIN_RM, **self.config.to_dict(), **({"lora": self.lora} if self.lora else {})}
        (path / "model_config.json").write_text(json.dumps(meta, indent=2))


def load_builtin_rm(path: str | Path, device: str = "cpu") -> BuiltinRewardModel:
    """A BuiltinRewardModel checkpoint (model_config.json type 'builtin-rm')."""
    p = Path(path)
    meta = json.loads((p / "model_config.json").read_text())
    meta.pop("type", None)
    lora = meta.pop("lora", None)
    rm = BuiltinRewardModel(GPT(GPTConfig(**meta)))
    if lora:
        rm.add_lora(lora)
    rm.load_state_dict(load_file(str(p / "model.safetensors")))
    return rm.to(device).eval()


def checkpoint_kind(path: str | Path) -> str | None:
    """'builtin-rm', 'builtin-gpt' (a policy), 'hf' (a config.json directory), 'adapter' or None."""
    p = Path(path).expanduser()
    if (p / "model_config.json").is_file():
        return json.loads((p / "model_config.json").read_text()).get("type", "builtin-gpt")
    if (p / "config.json").is_file():
        return "hf"
    if (p / "adapter_config.json").is_file():
        return "adapter"
    return None


def _max_length(tok) -> int | None:
    # tokenizers without a limit report a huge sentinel (int(1e30)); don't truncate then
    n = getattr(tok, "model_max_length", None)
    return n if isinstance(n, int) and n < 1_000_000 else None


def rm_input(tok, prompt, completion: str) -> tuple[str, bool]:
    """(text to score, whether the tokenizer should add its special tokens) for one sample: chat
    prompts through the tokenizer's chat template (completion as the assistant turn) when it has
    one, else the texts joined."""
    if isinstance(prompt, list):
        if getattr(tok, "chat_template", None):
            messages = list(prompt) + [{"role": "assistant", "content": completion}]
            # the template already writes BOS/EOS and role markers
            return tok.apply_chat_template(messages, tokenize=False), False
        prompt = "\n".join(str(m["content"]) for m in prompt) + "\n"
    return ("" if prompt is None else str(prompt)) + completion, True


class HFRewardModel(nn.Module):
    def __init__(self, hf, tok) -> None:
        super().__init__()
        if tok.pad_token is None:
            if tok.eos_token is None:
                raise ValueError("the tokenizer has neither a pad nor an eos token; set pad_token in its "
                                 "tokenizer_config.json")
            tok.pad_token = tok.eos_token
        # last-token pooling (Llama, Qwen, ...) finds each row's last non-pad token via config.pad_token_id,
        # so it must be the id the tokenizer pads with, or padded rows pool the wrong position
        hf.config.pad_token_id = tok.pad_token_id
        hf.config.get_text_config().pad_token_id = tok.pad_token_id
        self.hf, self.tok, self.config = hf, tok, hf.config
        self.lora: dict | None = None

    def ids(self, prompt, completion: str) -> list[int]:
        text, special = rm_input(self.tok, prompt, completion)
        n = _max_length(self.tok)
        return self.tok(text, add_special_tokens=special, truncation=n is not None, max_length=n)["input_ids"]

    def forward(self, batch: list[list[int]]) -> torch.Tensor:
        """(B,) float32 scores: logits[:, 0], padded on the tokenizer's side (HF pools the last real token)."""
        ids, mask = pad_sequences(batch, self.tok.pad_token_id, "left" if self.tok.padding_side == "left" else "right")
        dev = next(self.hf.parameters()).device
        return self.hf(input_ids=ids.to(dev), attention_mask=mask.long().to(dev)).logits[:, 0].float()

    def add_lora(self, settings: dict) -> None:
        import peft
        # SEQ_CLS: peft keeps the new score head fully trainable (modules_to_save)
        self.hf = peft.get_peft_model(self.hf, peft.LoraConfig(task_type="SEQ_CLS", **settings))
        self.lora = dict(settings)

    def lora_target(self) -> nn.Module:
        return self.hf

    def set_gradient_checkpointing(self, on: bool) -> None:
        if on:
            self.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def save_checkpoint_files(self, path: Path) -> None:
        """save_pretrained (adapters merged into a copy: the directory is a plain sequence classifier),
        the tokenizer, and under LoRA the adapter alone in adapter/ (what an exact resume reloads)."""
        if self.lora:
            copy.deepcopy(self.hf).merge_and_unload().save_pretrained(path)
            self.hf.save_pretrained(path / "adapter")
        else:
            self.hf.save_pretrained(path)
        self.tok.save_pretrained(path)


def load_hf_rm(source: str, dtype: torch.dtype = torch.float32, device: str = "cpu",
               trust_remote_code: bool = False) -> HFRewardModel:
    """A Hugging Face sequence classifier with one label from a directory or hub id: a reward model as
    it is, or a causal LM with a new score head (transformers initialises it, N(0, 0.02) for Llama)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging
    tok = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()   # its report of the new head, which is what training starts from
    hf_logging.disable_progress_bar()
    try:
        hf = AutoModelForSequenceClassification.from_pretrained(source, num_labels=1, dtype=dtype,
                                                                trust_remote_code=trust_remote_code)
    finally:
        hf_logging.set_verbosity(level)
    return HFRewardModel(hf.to(device), tok)


def _architectures(source: str) -> list[str]:
    """The `architectures` a local model directory's config.json lists ([] for a hub id)."""
    p = Path(source).expanduser() / "config.json"
    return (json.loads(p.read_text()).get("architectures") or []) if p.is_file() else []


class ImplicitRewardModel(nn.Module):
    """The reward a DPO checkpoint implies (Rafailov et al. 2023, "your language model is secretly a
    reward model"): r(x, y) = beta * (log pi(y|x) - log pi_ref(y|x)), summed over the completion's
    tokens (its stop token included), exactly the quantity `grpolab dpo` trained to rank chosen above
    rejected. The reference is the checkpoint's ref.safetensors, or under LoRA the policy with its
    adapters off. It keeps the language model's token-level structure, which a score head has to learn."""

    def __init__(self, policy, tok, ref=None, beta: float = 1.0) -> None:
        super().__init__()
        self.policy, self.ref, self.tok, self.beta = policy, ref, tok, beta
        self.config = policy.config

    def ids(self, prompt, completion: str):
        """The pair side as `grpolab dpo` encodes it: an Example (ids, loss mask on the completion)."""
        return encode(self.tok, as_sft_row(prompt, completion))

    def forward(self, batch: list) -> torch.Tensor:
        dev = next(self.policy.parameters()).device
        b = {k: v.to(dev) for k, v in collate(batch, self.tok.pad_id).items()}
        logp = summed_logprobs(self.policy, b)
        with reference(self.policy, self.ref) as r:
            ref = summed_logprobs(r, b)
        return self.beta * (logp - ref)


def load_implicit_rm(path: str | Path, device: str = "cpu") -> ImplicitRewardModel:
    """The implicit reward model of a `grpolab dpo` checkpoint; beta from its run's config.yaml."""
    import yaml

    p = Path(path)
    policy, tok = load_model(p, device=device)
    ref = None
    if not has_lora(policy):
        ref, _ = load_model(p, device=device)
        load_ref_weights(p, ref)
    run_cfg = p.parent.parent / "config.yaml"
    beta = (yaml.safe_load(run_cfg.read_text()) or {}).get("dpo", {}).get("beta", 1.0) if run_cfg.is_file() else 1.0
    return ImplicitRewardModel(policy.eval(), tok, ref.eval() if ref is not None else None, float(beta)).eval()


def is_dpo_checkpoint(path: str | Path) -> bool:
    return checkpoint_job(path) == "dpo"
