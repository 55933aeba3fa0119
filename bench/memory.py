"""Peak memory and seconds of one GRPO step, ours and TRL's GRPOTrainer, in four modes:
full fine-tuning, full + activation checkpointing, LoRA r=16, LoRA + checkpointing.

The step: 4 prompts x 8 completions, each prompt exactly 64 tokens and each completion exactly
128 (ours: rollout.ignore_eos; TRL: min_new_tokens), beta 0.04 (a KL reference: ours and TRL's
LoRA modes use the adapter-free base, the full modes a frozen copy), temperature 1, AdamW lr
1e-5, float32, CPU, 2 threads, the same reward function (grpolab.rewards.length) on both sides.
The model: a random Llama built here, 512 wide x 10 layers, 32,000-token vocabulary (tied), about
48M parameters; its tokenizer is a WordLevel one with one token per character plus filler
tokens up to 32,000, so any sampled id decodes.

Each (trainer, mode) runs in fresh processes (one for memory with glibc's malloc made to unmap
freed blocks, so resident memory follows the live tensors; one for time with the default
allocator): load, one step, and report
  * process_peak_mb: VmHWM of the whole process (imports, model, reference, the step);
  * step_peak_mb: the rise of resident memory during the step over just before it (VmHWM reset
    with /proc/self/clear_refs before the step);
  * seconds: the step's wall time (one step: noisy; compare ratios, not absolutes).
Ours: 'GRPOTrainer.train_step()'. TRL: its first optimizer step inside `Trainer.train()`,
between the `on_step_begin` and `on_step_end` callbacks.

    .venv/bin/python bench/memory.py [--only ours|trl] [--layers 10]

Prints ONE JSON line: per trainer and mode the three numbers, ours/TRL ratios, and
LoRA+checkpointing's peak relative to full fine-tuning for each trainer.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = {"full": (0, False), "full+ckpt": (0, True), "lora16": (16, False), "lora16+ckpt": (16, True)}
PROMPTS, G, PROMPT_TOKENS, NEW_TOKENS, BETA, LR, THREADS, VOCAB = 4, 8, 64, 128, 0.04, 1e-5, 2, 32000


def _status(key: str) -> float:
    return int(next(ln for ln in open("/proc/self/status") if ln.startswith(key)).split()[1]) / 1024


PEAK_SO_FAR = [0.0]   # the process's peak before the last reset


def _reset_peak() -> float:
    PEAK_SO_FAR[0] = max(PEAK_SO_FAR[0], _status("VmHWM"))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")   # VmHWM back to the current resident size
    return _status("VmRSS")


def build_model(out: Path, layers: int, intermediate: int = 1376, tie: bool = True) -> None:
    """The random Llama and its character-level WordLevel tokenizer (32,000 entries)
    (bench/step.py --shape realistic builds its model here too: 8 layers, MLP 1024, untied head)."""
    import string

    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    chars = ["\n", *[c for c in string.printable if 32 <= ord(c) < 127]]
    specials = ["<|end|>", "<|pad|>"]
    vocab = {t: i for i, t in enumerate(chars + specials)}
    vocab.update({f"<t{i}>": i for i in range(len(vocab), VOCAB)})
    tk = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|end|>", pad_token="<|pad|>", unk_token="?")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512,
                      tie_word_embeddings=tie, eos_token_id=vocab["<|end|>"], pad_token_id=vocab["<|pad|>"],
                      bos_token_id=None)
    model = LlamaForCausalLM(cfg)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = cfg.eos_token_id, cfg.pad_token_id
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))


def rows(n: int = PROMPTS, tokens: int = PROMPT_TOKENS) -> list[dict]:
    """n prompts of exactly `tokens` characters (= tokens)."""
    from grpolab.data.tasks import arithmetic
    out = []
    for r in arithmetic.generate("train", n, seed=0):
        p = (r["prompt"] + " " * tokens)[:tokens]
        out.append({"prompt": p, "answer": r["answer"]})
    return out


def run_ours(model_dir: Path, lora: int, ckpt: bool) -> dict:
    import torch

    from grpolab.config.load import config_from_dict
    from grpolab.jobs.inputs import load_policy
    from grpolab.monitor.console import Console
    from grpolab.train.grpo import GRPOTrainer
    torch.set_num_threads(THREADS)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = config_from_dict({
            "model": {"name_or_path": str(model_dir), "lora_rank": lora, "lora_alpha": 2.0 * max(lora, 1),
                      "gradient_checkpointing": ckpt},
            "algorithm": {"preset": "grpo", "beta": BETA},
            "rollout": {"prompts_per_step": PROMPTS, "num_generations": G, "max_new_tokens": NEW_TOKENS,
                        "temperature": 1.0, "ignore_eos": True},
            "reward": {"functions": ["length"]},
            "optim": {"lr": LR, "beta2": 0.999, "warmup_steps": 0, "max_grad_norm": 1.0},
            "train": {"max_steps": 10, "threads": THREADS, "output_dir": tmp},
            "log": {"level": "quiet", "samples_every": 0},
        })
        console = Console(stream=sys.stderr, level="quiet")
        data = rows()
        model, tok = load_policy(cfg, data, console)
        tr = GRPOTrainer(cfg, model, tok, data, [], tmp, console)
        before = _reset_peak()
        t = time.perf_counter()
        tr.train_step()
        seconds = time.perf_counter() - t
        g = tr.last_batch.gen
        assert tuple(g.completion_ids.shape) == (PROMPTS * G, NEW_TOKENS) and bool(g.completion_mask.all())
    return {"seconds": round(seconds, 2), "step_peak_mb": round(_status("VmHWM") - before, 1)}


def run_trl(model_dir: Path, lora: int, ckpt: bool) -> dict:
    import dataclasses

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpolab.rewards.length import length
    torch.set_num_threads(THREADS)
    names = {f.name for f in dataclasses.fields(GRPOConfig)}
    ck = {"gradient_checkpointing": ckpt, **({"activation_checkpointing": ckpt} if "activation_checkpointing" in names
                                             else {})}
    out: dict = {}

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            out["before"] = _reset_peak()
            out["t"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            out["seconds"] = round(time.perf_counter() - out["t"], 2)
            out["step_peak_mb"] = round(_status("VmHWM") - out["before"], 1)

    peft_config = None
    if lora:
        from peft import LoraConfig
        peft_config = LoraConfig(r=lora, lora_alpha=2 * lora, target_modules="all-linear", task_type="CAUSAL_LM")
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp, max_steps=1, seed=0, per_device_train_batch_size=PROMPTS * G,
            gradient_accumulation_steps=1, num_generations=G, generation_batch_size=PROMPTS * G,
            num_iterations=1, shuffle_dataset=False, max_completion_length=NEW_TOKENS,
            generation_kwargs={"min_new_tokens": NEW_TOKENS}, temperature=1.0, top_p=1.0, top_k=0,
            beta=BETA, loss_type="grpo", learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
            optim="adamw_torch", adam_beta2=0.999, max_grad_norm=1.0, model_init_kwargs={"dtype": "float32"},
            bf16=False, fp16=False, use_cpu=True, use_vllm=False, report_to="none", logging_strategy="no",
            save_strategy="no", eval_strategy="no", disable_tqdm=True, log_completions=False, **ck)
        trainer = GRPOTrainer(model=str(model_dir), reward_funcs=[length], args=args,
                              train_dataset=Dataset.from_list(rows()), callbacks=[Clock()], peft_config=peft_config)
        trainer.train()
    return {"seconds": out["seconds"], "step_peak_mb": out["step_peak_mb"]}


def child(which: str, mode: str, model_dir: Path) -> None:
    lora, ckpt = MODES[mode]
    res = (run_ours if which == "ours" else run_trl)(model_dir, lora, ckpt)
    res["process_peak_mb"] = round(max(PEAK_SO_FAR[0], _status("VmHWM")), 1)
    print(json.dumps(res))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=["ours", "trl"])
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--child", nargs=3, metavar=("WHICH", "MODE", "MODEL_DIR"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child[0], a.child[1], Path(a.child[2]))
        return
    try:
        import trl
        trl_version = trl.__version__
    except ImportError:
        trl_version = None
    sides = [a.only] if a.only else ["ours"] + (["trl"] if trl_version else [])
    res: dict = {"bench": "grpo_step_memory", "malloc_mmap_threshold_for_memory": 65536, "prompts": PROMPTS,
                 "completions": G, "prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS, "beta": BETA,
                 "vocab": VOCAB, "layers": a.layers, "trl": trl_version}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "llama"
        build_model(model_dir, a.layers)
        for side in sides:
            res[side] = {}
            for mode in MODES:
                print(f"{side} {mode} ...", file=sys.stderr, flush=True)
                # memory: glibc's malloc maps blocks of 64 KiB or more on their own and unmaps them when
                # freed (a fixed threshold), so resident memory follows the live tensors instead of
                # what the allocator keeps cached from earlier phases; time: a second run with the
                # default allocator (mapping each block costs time)
                runs = {}
                for what, extra in (("memory", {"MALLOC_MMAP_THRESHOLD_": "65536"}), ("time", {})):
                    r = subprocess.run([sys.executable, __file__, "--child", side, mode, str(model_dir)],
                                       capture_output=True, text=True,
                                       env={**os.environ, "OMP_NUM_THREADS": str(THREADS), **extra})
                    if r.returncode:
                        raise SystemExit(f"{side} {mode} failed:\n{r.stderr[-3000:]}")
                    runs[what] = json.loads(r.stdout.strip().splitlines()[-1])
                res[side][mode] = {"step_peak_mb": runs["memory"]["step_peak_mb"],
                                   "process_peak_mb": runs["memory"]["process_peak_mb"],
                                   "seconds": runs["time"]["seconds"]}
    for side in sides:
        for k in ("step_peak_mb", "process_peak_mb"):
            res[f"{side}_lora_ckpt_vs_full_{k}"] = round(res[side]["lora16+ckpt"][k] / res[side]["full"][k], 3)
    if "trl" in res and "ours" in res:
        res["ours_vs_trl"] = {m: {k: round(res["ours"][m][k] / res["trl"][m][k], 3)
                                  for k in ("step_peak_mb", "process_peak_mb", "seconds")} for m in MODES}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
