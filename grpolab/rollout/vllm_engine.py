"""vLLM as the rollout engine (rollout.source=vllm), colocated: one engine inside the trainer's process.

The engine is created once with random weights of the policy's architecture and is given the policy's
weights, in memory, before every rollout that follows an optimizer step (`load_weights`; LoRA adapters
merged in by the caller). Each completion is one request whose seed is its completion key
(rollout/keys.py), so a completion does not depend on which other requests share the batch. Each
request asks for the sampled token's log-prob in vLLM's `processed_logprobs` mode: under the
distribution it sampled from (after the penalties and min_tokens, temperature, top-k and top-p), which
is what the importance ratio against the trainer's own log-probs needs.

In-process means `VLLM_ENABLE_V1_MULTIPROCESSING=0` (no spawned engine or worker; weights cross no
process boundary). Starting vLLM that way touches the host process, and the engine undoes it: it
reseeds torch's global generator (restored), replaces `torch.set_num_threads` with a no-op (restored),
and, with its default thread binding, pins the process to part of the cores
(`VLLM_CPU_OMP_THREADS_BIND=nobind` unless the user set it).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import tempfile
import warnings
from collections.abc import Iterable

import torch

from ..errors import ConfigError
from ..utils.padding import pad_sequences
from .decode_loop import check_finite
from .generation import Generation

_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",   # the engine runs in this process
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",     # keep the trainer's cores and threads
        "VLLM_CONFIGURE_LOGGING": "0"}             # vLLM's INFO lines stay out of the trainer's console


def _missing(why: str) -> ConfigError:
    return ConfigError(f"rollout.source: vllm needs vLLM in this Python ({why}); on a CPU machine run `make "
                       f"vllm` and use .venv-vllm/bin/grpolab, on a GPU pip install 'grpolab[vllm]' (docs/vllm.md)")


def check_vllm_installed() -> None:
    """The ConfigError `import_vllm` would raise when vLLM is not installed, without importing it (the
    trainer's check before rollout workers, which import it in their own processes, start)."""
    if importlib.util.find_spec("vllm") is None:
        raise _missing("No module named 'vllm'")


def import_vllm():
    """The vllm module, or one ConfigError saying how to install it."""
    for k, v in _ENV.items():
        os.environ.setdefault(k, v)
    logging.getLogger("vllm").setLevel(logging.ERROR)   # its start-up and per-call INFO/WARNING lines
    try:
        import vllm
    except ImportError as e:
        raise _missing(e.msg) from None
    return vllm


class VLLMEngine:
    """One in-process vLLM engine for the architecture a transformers `config` describes (its weights
    random until `load_weights`)."""

    def __init__(self, config, *, dtype: str = "float32", max_model_len: int | None = None,
                 gpu_memory_utilization: float = 0.2, kv_cache_gb: float | None = None, enforce_eager: bool = True,
                 prefix_caching: bool = True, seed: int = 0, trust_remote_code: bool = False) -> None:
        vllm = import_vllm()
        self.SamplingParams = vllm.SamplingParams
        self.RequestError = importlib.import_module("vllm.exceptions").VLLMValidationError
        # vLLM reads the architecture from a directory: the policy's config.json alone (however the policy was
        # loaded: hub id, GGUF file, checkpoint); load_format=dummy, as the weights come from load_weights
        self.dir = tempfile.TemporaryDirectory(prefix="grpolab-vllm-")
        config.save_pretrained(self.dir.name)
        model = getattr(config, "name_or_path", "") or "the policy"
        rng, set_threads = torch.get_rng_state(), torch.set_num_threads
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)   # deprecations inside vLLM's start-up
                self.llm = vllm.LLM(model=self.dir.name, dtype=dtype, max_model_len=max_model_len, seed=seed,
                                    gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
                                    kv_cache_memory_bytes=None if kv_cache_gb is None else int(kv_cache_gb * 2**30),
                                    enable_prefix_caching=prefix_caching, load_format="dummy",
                                    logprobs_mode="processed_logprobs", skip_tokenizer_init=True,
                                    trust_remote_code=trust_remote_code)
                # one token now: what vLLM checks only when it runs (e.g. CPU attention's head sizes) fails here
                self.llm.generate([{"prompt_token_ids": [0]}], self.SamplingParams(max_tokens=1, detokenize=False),
                                  use_tqdm=False)
        except Exception as e:   # vLLM's own checks (memory, context length, architecture): their first line
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"rollout.source=vllm: vLLM could not start on {model}: {msg}") from e
        finally:
            torch.set_rng_state(rng)
            torch.set_num_threads = set_threads
        self.weights_version: int | None = None   # the trainer step whose weights the engine holds

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Replace the engine's weights (Hugging Face names; vLLM fuses q/k/v and gate/up itself).
        vLLM's in-place reload: on CPU the linear layers are repacked after loading, which a plain
        `model.load_weights` on the running model cannot do."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(weights)})
        self.llm.reset_prefix_cache()   # cached prompt keys/values were computed with the old weights
        self.weights_version = version

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()
        self.dir.cleanup()

    def generate(self, prompts: list[list[int]], *, num_generations: int = 1, max_new_tokens: int = 64,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, stop_ids: tuple[int, ...] = (),
                 pad_id: int = 0, keys: torch.Tensor | None = None, repetition_penalty: float = 1.0,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0, min_tokens: int = 0) -> Generation:
        """`rollout.engine.generate`'s contract on vLLM: rows [i*G, (i+1)*G) belong to prompt i; each row
        stops at one of `stop_ids` (kept, as the built-in engine keeps it) or after max_new_tokens. The
        penalties and min_tokens go to vLLM's SamplingParams as they are (its min_tokens bans `stop_ids`:
        with ignore_eos they are its only stop tokens); its processed log-probs then include them."""
        G = num_generations
        B = len(prompts) * G
        if keys is not None and keys.numel() != B:
            raise ValueError(f"keys: {keys.numel()} for {len(prompts)} prompts x {G} generations")
        seeds = [None] * B if keys is None else [int(k) for k in keys.tolist()]
        # temperature 0: vLLM samples greedily and drops top-k/top-p itself, as the built-in engine does
        params = [self.SamplingParams(
            n=1, temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=max_new_tokens, seed=s, logprobs=0,
            ignore_eos=True, stop_token_ids=list(stop_ids), detokenize=False, repetition_penalty=repetition_penalty,
            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, min_tokens=min_tokens)
            for s in seeds]
        requests = [{"prompt_token_ids": list(p)} for p in prompts for _ in range(G)]
        try:
            outs = self.llm.generate(requests, params, use_tqdm=False)
        except self.RequestError as e:   # a request beyond what the engine was set up for (e.g. its context)
            raise ConfigError(f"rollout.source=vllm: {str(e).splitlines()[0]} (vllm.max_model_len)") from None
        ids, lps, truncated = [], [], []
        for o in outs:
            c = o.outputs[0]
            toks = list(c.token_ids)
            ids.append(toks)
            lps.append([float(d[t].logprob) for t, d in zip(toks, c.logprobs)])
            truncated.append(not (toks and toks[-1] in stop_ids))
        c_ids, c_mask = pad_sequences(ids, pad_id, "right")
        c_lp = torch.zeros(c_ids.shape, dtype=torch.float32)
        for i, row in enumerate(lps):
            c_lp[i, :len(row)] = torch.tensor(row, dtype=torch.float32)
        p_ids, p_mask = pad_sequences(prompts, pad_id, "left")
        check_finite(c_lp, c_mask)
        return Generation(prompt_ids=p_ids.repeat_interleave(G, dim=0), prompt_mask=p_mask.repeat_interleave(G, dim=0),
                          completion_ids=c_ids, completion_mask=c_mask, sampler_logprobs=c_lp.masked_fill(~c_mask, 0.0),
                          truncated=torch.tensor(truncated))
