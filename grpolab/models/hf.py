"""Hugging Face causal LMs behind the same small interface as the built-in GPT.

The rollout engine and the trainer call `model(ids, key_valid=..., cache=..., logits_to_keep=...)`
and `model.new_cache(batch, max_len)`, and read prompts through `tokenizer.render_prompt`.
`HFPolicy` and `HFTokenizer` adapt an `AutoModelForCausalLM` and its tokenizer to that,
using the model's own KV cache (a `DynamicCache`).

Positions come from the attention mask (cumulative count of real tokens), so left-padded
prompts and right-padded completions see exactly the positions they would see alone.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import urllib.error
import urllib.request
import warnings
from pathlib import Path

import torch
import torch.nn as nn

from ..errors import ConfigError, DataError
from .lean_decode import LeanCache, LeanDecoder, is_lora, linear_weights, unsupported_reason

# peft (adding or loading adapters) still calls transformers' renamed is_gradient_checkpointing
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFTokenizer:
    """Renders prompts (plain text as is, message lists through the chat template) to ids."""

    def __init__(self, tokenizer, extra_stop_ids: tuple[int, ...] = ()) -> None:
        self.tok = tokenizer
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token; set one so completions can end")
        if tokenizer.pad_token_id is None:
            # Padding is masked everywhere, so any id works; eos is the usual choice.
            tokenizer.pad_token = tokenizer.eos_token
        self.eos_id = int(tokenizer.eos_token_id)
        self.pad_id = int(tokenizer.pad_token_id)
        self.stop_ids = tuple(dict.fromkeys((self.eos_id, *extra_stop_ids)))
        self.vocab_size = len(tokenizer)
        self.tools: list[dict] | None = None   # tool schemas for the chat template (rollout.tools)

    def render_prompt(self, prompt, tools: list[dict] | None = None) -> list[int]:
        """Token ids the model continues from. A list of {role, content} messages goes through the
        chat template with the generation prompt; a string is tokenized as it is (with BOS if the
        tokenizer adds one). With tools (`tools`, else the tokenizer's own), a string prompt is one user
        message, since the template is what tells the model its tools."""
        tools = tools or self.tools
        if tools and isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if isinstance(prompt, list):
            self._need_template("a prompt is a list of chat messages")
            text = self.tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False,
                                                **({"tools": tools} if tools else {}))
            return self.tok(text, add_special_tokens=False)["input_ids"]
        return self.tok(prompt)["input_ids"]

    def render_conversation(self, messages: list[dict], train_from: int = 0) -> tuple[list[int], list[bool]]:
        """(ids, loss mask) of a conversation through the chat template. The mask marks the tokens of
        each assistant message from index `train_from` on as the template renders it (its end-of-turn
        token included): the text between the template of the messages before it (with the
        generation prompt) and the template up to and including it."""
        self._need_template("a row is a conversation (chat messages)")

        def text(msgs, gen=False):
            return self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen) if msgs else ""
        full = text(messages)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant" or i < train_from:
                continue
            before, upto = text(messages[:i], gen=True), text(messages[:i + 1])
            if not (upto.startswith(before) and full.startswith(upto)):
                raise ValueError(f"the chat template does not render message {i} as a continuation of the "
                                 f"ones before it (it rewrites earlier turns), so its tokens cannot be told "
                                 f"apart; train on prompt/completion rows instead")
            spans.append((len(before), len(upto)))
        enc = self.tok(full, add_special_tokens=False, return_offsets_mapping=True)
        mask = [any(a <= start < b for a, b in spans) for start, _ in enc["offset_mapping"]]
        return list(enc["input_ids"]), mask

    def _need_template(self, why: str) -> None:
        """DataError (a ValueError: the server answers it with a 400) when the tokenizer has no chat
        template. Every training prompt and row is rendered once before training starts, so this
        stops the run there, not mid-run."""
        if not getattr(self.tok, "chat_template", None):
            name = getattr(self.tok, "name_or_path", "") or "the model"
            raise DataError(f"{why}, but the tokenizer of {name} has no chat template; give plain-text "
                            f"prompt/completion rows (and no data.system_prompt, which makes prompts "
                            f"messages), or a model with a chat template (an -Instruct one)")

    def render_completion(self, completion: str) -> list[int]:
        return [*self.tok(completion, add_special_tokens=False)["input_ids"], self.eos_id]

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids, skip_special: bool = True) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def save(self, path: str | Path) -> None:
        self.tok.save_pretrained(str(path))


class HFCache:
    """The model's DynamicCache plus what HF needs beside it: the attention mask so far and
    how many real tokens each row has seen (its next position)."""

    def __init__(self, past) -> None:
        self.past = past
        self.mask: torch.Tensor | None = None   # (B, T_so_far) long
        self.count: torch.Tensor | None = None  # (B,) real tokens so far

    def repeat_interleave(self, n: int) -> "HFCache":
        """Each row n times (a prompt prefilled once, shared by its n samples). Reuses the storage."""
        self.past.batch_repeat_interleave(n)
        self.mask = self.mask.repeat_interleave(n, dim=0)
        self.count = self.count.repeat_interleave(n, dim=0)
        return self

    def select(self, rows: torch.Tensor) -> "HFCache":
        """Only `rows` (indices, e.g. the rows still decoding). Reuses the object."""
        self.past.batch_select_indices(rows)
        self.mask, self.count = self.mask[rows], self.count[rows]
        return self


# architectures whose logits are lm_head(last hidden state), nothing more (no soft-capping, no scale)
PLAIN_HEAD_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "gpt2", "gpt_neox", "smollm3"})


class HFPolicy(nn.Module):
    """An `AutoModelForCausalLM` with the engine's calling convention."""

    def __init__(self, hf_model, lean_decode: bool = True) -> None:
        super().__init__()
        self.hf = hf_model
        self.config = hf_model.config
        self.lean_decode = lean_decode

    def new_cache(self, batch: int, max_len: int) -> HFCache | LeanCache:
        """A preallocated `LeanCache` when the lean sampling path supports this model, else HF's DynamicCache."""
        if self.lean_decode and unsupported_reason(self.hf, max_len) is None:
            return LeanDecoder(self.hf, max_len).new_cache(batch, max_len)
        from transformers import DynamicCache
        return HFCache(DynamicCache(config=self.hf.config))

    @property
    def has_plain_head(self) -> bool:
        """Whether logits are exactly the output embedding applied to the decoder's last hidden state
        (no soft-capping or scaling), so `forward(hidden=True)` + `head` may stand in for the logits."""
        return self.config.model_type in PLAIN_HEAD_TYPES

    def causal_lm(self):
        """The transformers model itself (under a peft wrapper, the base model with its adapters)."""
        return self.hf.get_base_model() if hasattr(self.hf, "get_base_model") else self.hf

    def merged_weights(self) -> dict[str, torch.Tensor]:
        """The weights the policy computes with, under the plain transformers model's names: LoRA adapters
        merged in (W + scale * B @ A, as `linear_weights` adds them), the model itself left untouched.
        What an inference engine (rollout/vllm_engine.py) is given."""
        lm = self.causal_lm()
        out = {}
        for name, m in lm.named_modules():
            if is_lora(m):
                w, b = linear_weights(m)
                out[f"{name}.weight"] = w.detach()
                if b is not None:
                    out[f"{name}.bias"] = b.detach()
        for k, v in lm.state_dict().items():
            if ".lora_" not in k and ".base_layer." not in k:
                out.setdefault(k, v.detach())
        return out

    def prefix_cache(self) -> HFCache | None:
        """An empty HF cache that autograd can flow through, for running a group's shared prompt once in
        the log-prob passes (models/logprobs.py); None where a cache may drop keys (sliding-window layers)
        or the logits are not a plain head over hidden states."""
        from transformers import DynamicCache
        if not self.has_plain_head:
            return None
        past = DynamicCache(config=self.causal_lm().config)
        if any(type(layer).__name__ != "DynamicLayer" for layer in getattr(past, "layers", [])):
            return None
        return HFCache(past)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits from `forward(..., hidden=True)`'s output."""
        return self.causal_lm().get_output_embeddings()(h)

    def forward(self, idx: torch.Tensor, key_valid: torch.Tensor | None = None,
                cache: HFCache | LeanCache | None = None, logits_to_keep: int = 0,
                hidden: bool = False, segments: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V), or of the last `logits_to_keep` positions. Semantics as `GPT.forward`.
        With `hidden` (models with `has_plain_head`), the decoder's last hidden states instead (with an
        `HFCache`: through it, e.g. from `prefix_cache`).
        `segments` (packed sequences, no cache): positions restart at each segment and a 4-D mask keeps
        each segment to itself."""
        if isinstance(cache, LeanCache):
            return cache.decoder.forward(idx, key_valid, cache, logits_to_keep)
        if key_valid is None:
            key_valid = torch.ones_like(idx, dtype=torch.bool)
        valid = key_valid.long()
        start = cache.count if cache is not None and cache.count is not None else torch.zeros_like(valid[:, 0])
        pos = (start[:, None] + valid.cumsum(-1) - 1).clamp(min=0)
        if segments is not None:
            valid, pos = _packed_mask_and_positions(key_valid, segments)
        if hidden and cache is None:
            h = self.causal_lm().base_model(input_ids=idx, attention_mask=valid, position_ids=pos,
                                              use_cache=False).last_hidden_state
            return h[:, -logits_to_keep:] if logits_to_keep else h
        if cache is None:
            out = self.hf(input_ids=idx, attention_mask=valid, position_ids=pos, use_cache=False,
                          logits_to_keep=logits_to_keep)
            return out.logits
        cache.mask = valid if cache.mask is None else torch.cat([cache.mask, valid], dim=1)
        cache.count = start + valid.sum(-1)
        if hidden:   # hidden states through the cache (a shared prompt's keys and values, with autograd)
            out = self.causal_lm().base_model(input_ids=idx, attention_mask=cache.mask, position_ids=pos,
                                              use_cache=True, **_cache_kwarg(self.causal_lm(), cache.past))
            cache.past = _cache_out(out)
            h = out.last_hidden_state
            return h[:, -logits_to_keep:] if logits_to_keep else h
        out = self.hf(input_ids=idx, attention_mask=cache.mask, position_ids=pos, use_cache=True,
                      logits_to_keep=logits_to_keep, **_cache_kwarg(self.causal_lm(), cache.past))
        cache.past = _cache_out(out)
        return out.logits

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def save(self, path: str | Path, state_dict: dict | None = None) -> None:
        """save_pretrained layout; `state_dict` (HF names) in place of the model's own, e.g. gathered shards."""
        self.hf.save_pretrained(str(path), safe_serialization=True, state_dict=state_dict)


def _cache_kwarg(causal_lm, past) -> dict:
    """The KV cache as the model's forward names it: `cache` (transformers >= 5.2x, which warns on the
    old name) or `past_key_values`."""
    return {"cache" if "cache" in inspect.signature(causal_lm.forward).parameters else "past_key_values": past}


def _cache_out(out):
    """The KV cache an output carries, under either name."""
    return out.cache if getattr(out, "cache", None) is not None else out.past_key_values


def _packed_mask_and_positions(key_valid: torch.Tensor, segments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, 1, T, T) boolean mask (causal, within a segment, real keys; every query sees itself) and
    positions counted from each segment's start."""
    T = segments.size(1)
    idx = torch.arange(T, device=segments.device)
    causal = idx[None, :] <= idx[:, None]
    same = segments[:, :, None] == segments[:, None, :]
    mask = (causal[None] & same & key_valid[:, None, :]) | torch.eye(T, dtype=torch.bool, device=segments.device)[None]
    first = torch.ones_like(segments, dtype=torch.bool)
    first[:, 1:] = segments[:, 1:] != segments[:, :-1]
    start = torch.cummax(torch.where(first, idx[None].expand_as(segments), 0), dim=1).values
    return mask[:, None], idx[None] - start


def _stop_ids_from(model) -> tuple[int, ...]:
    """Extra end-of-turn ids from the generation config (chat models often list several)."""
    gc = getattr(model, "generation_config", None)
    eos = getattr(gc, "eos_token_id", None) if gc is not None else None
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))


def resolve_device(device: str, key: str = "model.device") -> torch.device:
    """The torch device for `device` (cpu | cuda | cuda:N | auto); ConfigError naming `key` (the config key
    or flag it came from) when it asks for CUDA that this machine does not have."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            why = "this torch was built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ConfigError(f"{key}: {device!r}, but {why}; use cpu (or auto: CUDA where there is one)")
        index = torch.device(device).index
        if index is not None and index >= torch.cuda.device_count():
            raise ConfigError(f"{key}: {device!r}, but this machine has {torch.cuda.device_count()} CUDA "
                              f"device(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return torch.device(device)


HUB_PROBE_TIMEOUT = 5.0   # seconds to wait for the hub's answer before counting it unreachable


def hub_unreachable() -> str | None:
    """Why the Hugging Face Hub cannot be asked for files (HF_HUB_OFFLINE, or one request to its endpoint
    failed), or None. huggingface_hub retries an unreachable hub 5 times per file with backoff, printing
    two lines a try (12 lines, about 46 s, for a model and its tokenizer): one request says it first."""
    from huggingface_hub import constants
    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    try:
        urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=HUB_PROBE_TIMEOUT)
    except urllib.error.HTTPError:
        return None   # the hub answered (with an error status): it is reachable
    except (OSError, ValueError) as e:   # URLError, timeouts, refused connections; ValueError: a malformed endpoint
        reason = getattr(e, "reason", None) or e
        return f"the hub at {constants.ENDPOINT} cannot be reached ({reason})"
    return None


@contextlib.contextmanager
def quiet_hub(offline: bool = False):
    """Within: huggingface_hub's retry warnings are not printed (the caller reports a failure in one line);
    with `offline`, nothing asks the hub (files come from the Hugging Face cache). HF_HUB_OFFLINE is read
    once, when huggingface_hub is imported, so its constant is set here: `local_files_only` alone does not
    reach every lookup (transformers' adapter_config.json check asks the hub again, with retries)."""
    from huggingface_hub import constants
    log = logging.getLogger("huggingface_hub")
    level, was_offline = log.level, constants.HF_HUB_OFFLINE
    log.setLevel(logging.ERROR)
    constants.HF_HUB_OFFLINE = was_offline or offline
    try:
        yield
    finally:
        log.setLevel(level)
        constants.HF_HUB_OFFLINE = was_offline


def gguf_file(path: str | Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one `.gguf` of a directory without a config.json
    (a model shipped as llama.cpp's single file). None for anything else; ValueError for a directory with several."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return p
    if p.is_dir() and not (p / "config.json").is_file():
        found = sorted(p.glob("*.gguf"))
        if len(found) > 1:
            raise FileNotFoundError(f"{str(p)!r} holds {len(found)} .gguf files ({', '.join(f.name for f in found)}); "
                                    f"name one of them")
        return found[0] if found else None
    return None


def _load_gguf(file: Path, dtype: str, device: torch.device) -> tuple[HFPolicy, HFTokenizer]:
    """A GGUF model through transformers' GGUF loader: its weights dequantised to `dtype` (so a quantised
    file trains as the full-precision model of those values), its tokenizer and chat template from the file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader)
    except ImportError:
        raise ImportError("GGUF models need the gguf package: pip install 'grpolab[hf]'") from None
    with quiet_hub(offline=True):
        tok = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=DTYPES[dtype],
                                                     local_files_only=True)
    # the weights are plain tensors now: saved checkpoints and exports are ordinary safetensors models
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.to(device)
    model.eval()
    return HFPolicy(model), HFTokenizer(tok, extra_stop_ids=_stop_ids_from(model))


def load_hf(name_or_path: str, dtype: str = "float32", device: str = "cpu",
            trust_remote_code: bool = False) -> tuple[HFPolicy, HFTokenizer]:
    """Load an `AutoModelForCausalLM` and its tokenizer from a local directory, a GGUF file (or a directory
    holding one), or a hub id."""
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise ImportError("Hugging Face models need transformers: pip install 'grpolab[hf]'") from None

    hf_logging.disable_progress_bar()  # our console reports progress; per-shard bars are noise

    gguf = gguf_file(name_or_path)
    if gguf is not None:
        return _load_gguf(gguf, dtype, resolve_device(device))
    local = Path(name_or_path)
    looks_local = local.exists() or name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
    if looks_local and not (local / "config.json").is_file():
        raise FileNotFoundError(f"model.name_or_path: {name_or_path!r} is not a model directory "
                                f"(no config.json); give a saved Hugging Face model or a hub id")
    device = resolve_device(device)   # before the download: a CUDA mistake is found at once
    # a hub id the hub cannot be asked for: the Hugging Face cache alone, with no retries
    offline = None if looks_local else hub_unreachable()
    opts = {"trust_remote_code": trust_remote_code, **({"local_files_only": True} if offline else {})}
    try:
        with quiet_hub(offline=bool(offline)):
            tok = AutoTokenizer.from_pretrained(name_or_path, **opts)
            model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=DTYPES[dtype], **opts)
    except OSError as e:
        if offline:
            raise FileNotFoundError(f"model.name_or_path: {name_or_path!r} is not a local directory nor in the "
                                    f"Hugging Face cache, and {offline}; download it where there is a network "
                                    f"(`hf download {name_or_path}`) or give a model directory") from None
        raise FileNotFoundError(f"model.name_or_path: could not load {name_or_path!r} "
                                f"({str(e).splitlines()[0]})") from None
    model.to(device)
    model.eval()
    return HFPolicy(model), HFTokenizer(tok, extra_stop_ids=_stop_ids_from(model))


def load_hf_adapter(path: str, dtype: str = "float32", device: str = "cpu") -> tuple[HFPolicy, HFTokenizer]:
    """A LoRA checkpoint (peft's adapter layout): its base model, named in adapter_config.json, with
    the adapter on top, trainable."""
    import json

    from peft import PeftModel
    base = json.loads((Path(path) / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base:
        raise FileNotFoundError(f"{path!r}: adapter_config.json names no base_model_name_or_path")
    try:
        policy, tok = load_hf(base, dtype=dtype, device=device)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{path!r} is a LoRA adapter of {base!r}, which cannot be loaded: {e}") from None
    policy.hf = PeftModel.from_pretrained(policy.hf, path, is_trainable=True)
    return policy, tok
