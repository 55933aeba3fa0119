"""The GRPO loop: sample groups, score, compute advantages, update, log. Read top to bottom.

One step:
    rows -> rollout engine (G completions per prompt, sampler log-probs)
         -> reward functions (weighted total)
         -> group-relative advantages
         -> clipped-ratio policy loss + beta * KL(policy || reference), aggregated over the
            global batch, accumulated over micro-batches, mu optimizer passes
         -> metrics.jsonl, periodic eval and checkpoint
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from .. import distributed as dist
from .. import sharding
from ..algorithms.advantages import (
    TOKEN_ESTIMATORS,
    compute_advantages,
    compute_gae,
    compute_reinforce_plus_plus,
    compute_remax,
    token_level_rewards,
)
from ..algorithms.aggregate import aggregate
from ..algorithms.kl import apply_kl_in_reward, kl_penalty
from ..algorithms.losses import compute_policy_loss
from ..algorithms.ref_sync import ref_sync
from ..algorithms.rollout_correction import rollout_correction
from ..algorithms.shaping import dynamic_sampling_keep, overlong_penalty
from ..config import Config
from ..data.stream import RowStream
from ..errors import ConfigError, NonFiniteLogits, TrainingError
from ..models import set_gradient_checkpointing
from ..models.checkpoint import load_model, load_training_state, read_ref_state
from ..models.logprobs import completion_logprobs
from ..models.reference import frozen_reference, reference
from ..monitor.report.read import read_jsonl
from ..monitor.reward_hacking import Watch
from ..rewards import reward_name, reward_names, wants_policy
from ..rewards.combine import RewardLog, TrainerState, check_signatures, number_mean, score
from ..rewards.intrinsic import PolicyView
from ..rollout.batch import RolloutBatch, cat_batches
from ..rollout.engine import sample
from ..rollout.keys import completion_keys
from ..rollout.tool_decode import build_tool_use, tool_metrics
from ..rollout.vllm_engine import VLLMEngine, check_vllm_installed
from ..rollout.worker_pool import WorkerPool
from .base import Trainer
from .critic import CriticTrainer
from .evaluate import evaluate, score_samples
from .memory_budget import check_run_memory, model_shape
from .rollouts_ahead import RolloutsAhead
from .schedule import lr_factor


class GRPOTrainer(Trainer):
    """The RL step on the trainer shell (train/base.py): rollout, scoring, advantages, the mu-pass update,
    the critic's hooks; checkpoints add the prompts' position, the std filter's average and the critic."""

    job = "grpo"
    collective = True   # with several ranks every skip and stop is decided over all of them
    bad_data = "check the reward functions"

    def __init__(self, cfg: Config, model, tokenizer, train_rows: list[dict], test_rows: list[dict],
                 run_dir: str | Path, console=None) -> None:
        self.world = dist.world_from_env()
        if self.world.size > 1:
            self._check_world(cfg)
        # before any batch is allocated: a rollout or eval batch larger than the memory is one line, not the
        # kernel's OOM killer (train/memory_budget.py)
        check_run_memory(cfg, model_shape(model), tokenizer, train_rows, test_rows, next(model.parameters()).device,
                         self.world, getattr(model.config, "block_size", None)
                         or getattr(model.config, "max_position_embeddings", None))
        if self.world.size > 1:
            dist.broadcast_parameters(model)   # every rank starts from rank 0's policy, bit for bit
        if hasattr(model, "lean_decode"):   # Hugging Face policies: which sampling path to use
            model.lean_decode = cfg.rollout.lean_decode
        model.cuda_graph = cfg.rollout.cuda_graph   # on CUDA: the slotted decode (rollout/slot_decode.py) or not
        if cfg.model.gradient_checkpointing:
            set_gradient_checkpointing(model, True)
        # progress inside a long step (phase, rows, tokens/s) on rank 0's console; only rank 0 writes files
        super().__init__(cfg, model, tokenizer, run_dir, console, writes=self.world.main,
                         talk=console is not None and self.world.main and getattr(console, "level", 0) >= 1)
        self.max_steps = cfg.train.max_steps
        self.logprob_chunk = cfg.optim.logprob_chunk   # None: chosen per batch by its logits' size
        self.test_rows = test_rows[:cfg.eval.num_problems]
        # reward hacking: held-out accuracy falling while the training reward does not (monitor/reward_hacking.py)
        self.watch, self.watch_seeded = Watch(len(self.test_rows)), False
        a, o = cfg.algorithm, cfg.optim
        self.wants_policy = any(wants_policy(f) for f in cfg.reward.functions)   # intrinsic rewards
        if a.adv_estimator == "remax" and self.wants_policy:
            raise ConfigError("algorithm.adv_estimator: remax scores a greedy completion per prompt, which intrinsic "
                              "rewards (policy-reading) do not support yet; use another estimator")
        # PPO's critic (adv_estimator=gae): a copy of the starting policy, taken before LoRA, plus a value head
        self.critic = CriticTrainer(cfg, model) if a.adv_estimator == "gae" else None
        self.std_ema: float | None = None   # RLPR's std filter: moving average of the batches' mean group std
        self.attach_lora()
        # Frozen reference for the KL term; not kept at all when beta == 0. With LoRA it is the policy
        # with its adapters off: no second copy.
        self.ref = frozen_reference(model) if a.beta > 0 else None
        # train.strategy=fsdp: policy and reference sharded over the ranks (sharding.py); the optimizer
        # is built on the shards
        self.sharded = cfg.train.strategy == "fsdp" and self.world.size > 1
        # a group's prompt once per log-prob pass: two forwards per backward, which DDP and FSDP do not
        # allow, and a KV cache, which HF turns off under gradient checkpointing
        self.share_group = (cfg.rollout.num_generations if cfg.optim.share_prompt and self.world.size == 1
                            and not cfg.model.gradient_checkpointing else 0)
        if self.sharded:
            sharding.shard(model)
            if self.ref is not None:
                sharding.shard(self.ref, frozen=True)
        # sharded: fsdp keeps the optimizer's state on the shards (no master copies)
        self.build_optimizer(o.lr, (o.beta1, o.beta2), o.weight_decay,
                             lambda s: lr_factor(s, o.warmup_steps, cfg.train.max_steps, o.lr_schedule),
                             master=not self.sharded)
        self.train_rows = train_rows
        self.sampler = RowStream(len(train_rows), cfg.train.seed, keyed=True)   # the prompts' order
        # kept in checkpoints for older runs; rollouts and eval samples are keyed (rollout/keys.py) instead
        self.gen = torch.Generator(device=self.device).manual_seed(cfg.train.seed)
        self.reward_names = reward_names(cfg.reward.functions)   # spec -> metric name, unique
        self.logged_metrics: dict[str, list[float]] = {}          # reward functions' log_metric values, this step
        self.epoch_at_step = 0.0
        # rollout.tools: calls inside rollouts and eval (rollout/tool_decode.py); None without tools
        self.tools = build_tool_use(cfg.rollout, tokenizer, cfg.model.name_or_path)
        check_signatures(cfg.reward.functions, list(train_rows[0]) if train_rows else [], rows=train_rows,
                         source=cfg.data.train_path or f"data.task={cfg.data.task}")
        # rollout.engine=vllm: a vLLM engine in this process, given the policy's weights before each rollout
        # (with rollout workers, the workers hold it: rollout/worker_process.py)
        self.vllm = self._vllm_engine(cfg) if cfg.rollout.engine == "vllm" and not cfg.train.worker_count else None
        if cfg.rollout.engine == "vllm" and cfg.train.worker_count:
            check_vllm_installed()   # here, in one line: a worker without vLLM would abort in its own process
        self.sync_time = 0.0   # seconds this step spent giving the vLLM engine the policy's weights
        # train.async_steps / rollout_workers: batches sampled ahead by worker processes (rollout/worker_pool.py),
        # started at the first step (after a resume has put back the weights and the batches in flight)
        t = cfg.train
        self.n_workers = t.worker_count
        self.ahead = RolloutsAhead(t.async_steps, self.n_workers, self.world, tokenizer.pad_id)
        self.worker_times: dict[str, float] = {}   # this step's: the wait, the worker's sampling and idle time
        if t.async_steps and a.rollout_correction == "none" and console is not None and self.world.main:
            console.warn(f"train.async_steps={t.async_steps} with algorithm.rollout_correction=none: batches sampled "
                         f"by a policy up to {t.async_steps} steps old are trained on as if on-policy; "
                         f"algorithm.rollout_correction=tis (or mis) corrects for it")

    @staticmethod
    def _vllm_options(cfg: Config) -> dict:
        """VLLMEngine's keyword arguments besides the model's config (here, or in a rollout worker)."""
        v, r, limit = cfg.vllm, cfg.rollout, cfg.data.max_prompt_length
        return dict(dtype=cfg.model.dtype,
                    max_model_len=v.max_model_len or (r.max_new_tokens + limit if limit else None),
                    gpu_memory_utilization=v.gpu_memory_utilization, kv_cache_gb=v.kv_cache_gb,
                    enforce_eager=v.enforce_eager, prefix_caching=v.prefix_caching, seed=cfg.train.seed,
                    trust_remote_code=cfg.model.trust_remote_code)

    def _vllm_engine(self, cfg: Config) -> VLLMEngine:
        return VLLMEngine(self.model.causal_lm().config, **self._vllm_options(cfg))

    def _sync_vllm(self) -> float:
        """The vLLM engine gets the policy's current weights (LoRA merged in), once per optimizer step.
        Returns the seconds it took."""
        if self.vllm.weights_version == self.step:
            return 0.0
        t0 = time.perf_counter()
        self.vllm.load_weights(self.model.merged_weights().items(), self.step)
        return time.perf_counter() - t0

    def close(self) -> None:
        """Shut the vLLM engine down (its threads, its process group, its memory) and the rollout workers."""
        if self.vllm is not None:
            self.vllm.close()
            self.vllm = None
        self.ahead.close()

    def _sample(self, prompt_ids: list[list[int]], **kw):
        """One batch of rollout completions from the built-in engine, or from vLLM (its weights synced first)."""
        if self.vllm is not None:
            self.sync_time += self._sync_vllm()
        return sample(self.model, prompt_ids, engine=self.vllm, tools=self.tools, **kw)

    def _check_world(self, cfg: Config) -> None:
        problem = dist.check_world(self.world, cfg.rollout.prompts_per_step)
        if problem:
            raise ConfigError(problem)
        if cfg.rollout.engine == "vllm" and not cfg.train.worker_count:   # vLLM here sets up a world of its own
            raise ConfigError("rollout.engine: vllm runs in one process for now; drop --nproc or use "
                              "rollout.engine=builtin")
        if cfg.algorithm.adv_estimator in TOKEN_ESTIMATORS:
            raise ConfigError(f"algorithm.adv_estimator: {cfg.algorithm.adv_estimator} (token-level, batch-whitened) "
                              f"runs in one process for now; drop --nproc or use a group estimator")
        if cfg.train.strategy == "fsdp" and any(wants_policy(f) for f in cfg.reward.functions):
            raise ConfigError("reward.functions: intrinsic rewards read the policy, which train.strategy=fsdp shards; "
                              "use train.strategy=ddp")

    # ------------------------------------------------------------ one step, as data
    def _draw(self, share: bool = True) -> tuple[list[int], torch.Tensor, float]:
        """The next prompts (row indices; with `share`, this rank's share: whole groups, in order), their
        draw numbers, and the epoch before them (the prompts' passes so far)."""
        s = self.sampler
        epoch = s.epoch + s.index / max(1, s.n)
        first = s.drawn
        idx = s.next(self.cfg.rollout.prompts_per_step)   # the same on every rank
        draws = torch.arange(first, first + len(idx))
        if share and self.world.size > 1:
            k = len(idx) // self.world.size
            idx = idx[self.world.rank * k:(self.world.rank + 1) * k]
            draws = draws[self.world.rank * k:(self.world.rank + 1) * k]
        return list(idx), draws, epoch

    def _sampling_calls(self, idx: list[int], draws: torch.Tensor) -> list[dict]:
        """The engine calls one batch needs (`rollout.engine.sample`'s arguments, the prompts under
        'prompts'): the rollout, and with ReMax each prompt's greedy completion (its baseline)."""
        r = self.cfg.rollout
        G = r.num_generations
        prompts = [self.tok.render_prompt(self.train_rows[i]["prompt"]) for i in idx]
        # each completion's randomness is keyed by (seed, prompt draw, sample): the same completions
        # however the step is split over ranks or workers, and after a resume
        keys = completion_keys(self.cfg.train.seed, draws.repeat_interleave(G), torch.arange(G).repeat(len(idx)))
        # the penalties shape the rollout's completions, ReMax's greedy baseline too (as verl's rollout config does)
        penalties = dict(repetition_penalty=r.repetition_penalty, presence_penalty=r.presence_penalty,
                         frequency_penalty=r.frequency_penalty, min_tokens=r.min_tokens)
        calls = [dict(prompts=prompts, num_generations=G, max_new_tokens=r.max_new_tokens,
                      temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
                      stop_ids=() if r.ignore_eos else self.tok.stop_ids, pad_id=self.tok.pad_id, keys=keys,
                      **penalties)]
        if self.cfg.algorithm.adv_estimator == "remax":
            calls.append(dict(prompts=prompts, num_generations=1, max_new_tokens=r.max_new_tokens, temperature=0.0,
                              stop_ids=self.tok.stop_ids, pad_id=self.tok.pad_id, **penalties))
        return calls

    def _diverged(self) -> TrainingError:
        return TrainingError(f"step {self.step + 1}: the policy's next-token probabilities are NaN/inf (the "
                             f"weights diverged); lower optim.lr, keep optim.max_grad_norm > 0, or resume "
                             f"from an earlier checkpoint")

    def rollout(self) -> RolloutBatch:
        """This step's batch: sampled now with the current policy, or taken from the rollout workers."""
        if self.n_workers:
            return self._worker_rollout()
        idx, draws, _ = self._draw()   # (collect() took the epoch before the step's first round)
        self.model.eval()
        self.progress.start_phase("rollout", len(idx) * self.cfg.rollout.num_generations)
        # counts the tokens as they are sampled, for the progress line
        count = self._count_tokens if self.progress.on and self.tools is None else None
        try:
            with sharding.full_weights(self.model):   # sharded: gathered once for the whole decode
                gens = [self._sample(c.pop("prompts"), on_tokens=count if i == 0 else None, **c)
                        for i, c in enumerate(self._sampling_calls(idx, draws))]
        except NonFiniteLogits:
            raise self._diverged() from None
        return self._as_batch(idx, gens, self.step)

    def _worker_rollout(self) -> RolloutBatch:
        """This step's batch from the rollout workers (train/rollouts_ahead.py), this rank's share of it."""
        self.progress.start_phase(f"waiting for batch {self.step + 1}")
        got = self.ahead.take(self.step, self.max_steps, self._start_workers, lambda: self._draw(share=False),
                              self._sampling_calls, self._diverged)
        idx, gens = got.rows, got.gens
        if self.world.size > 1:   # this rank's share: whole groups, in order (as the synchronous loop splits)
            n = len(idx) // self.world.size
            lo, hi = self.world.rank * n, (self.world.rank + 1) * n
            idx = idx[lo:hi]
            per_row = [self.cfg.rollout.num_generations, 1]   # the rollout's rows per prompt, ReMax's greedy
            gens = [g.rows(lo * r, hi * r) for g, r in zip(gens, per_row)]
        self.epoch_at_step, self.worker_times = got.epoch, got.times
        return self._as_batch(idx, [g.to(self.device) for g in gens], got.version)

    def _start_workers(self) -> WorkerPool:
        """The rollout workers, given the model as it is now (and, with rollout.engine=vllm, a vLLM engine to
        build on it). On GPUs each worker takes the next free GPU after the trainer ranks' own."""
        self.progress.start_phase("starting rollout workers")
        t = self.cfg.train
        threads = t.worker_threads or t.threads or 1
        cpu = self.device.type == "cpu"
        devices = ["cpu" if cpu else f"cuda:{self.world.local_size + i}" for i in range(self.n_workers)]
        pool = WorkerPool(self.n_workers, threads, devices, cuda_deterministic=t.cuda_deterministic,
                          stall_timeout=t.worker_stall_timeout)
        if self.console is not None and self.world.main:
            self.console.info(f"rollout workers: {self.n_workers} process{'es' if self.n_workers > 1 else ''} "
                              f"(pid {', '.join(str(p.pid) for p in pool.procs)}), {threads} torch thread"
                              f"{'s' if threads > 1 else ''} each, sampling {t.async_steps} step"
                              f"{'s' if t.async_steps != 1 else ''} ahead of the update (docs/async.md)")
        pool.ship(self.model, self.step, self._vllm_options(self.cfg) if self.cfg.rollout.engine == "vllm" else None)
        return pool

    def _as_batch(self, idx: list[int], gens: list, version: int) -> RolloutBatch:
        """The batch rewards and the update read: the completions decoded (tool calls and results inline,
        where the model saw them), the rows' columns, ReMax's greedy completions."""
        rows = [self.train_rows[i] for i in idx]
        gen = gens[0]
        G = self.cfg.rollout.num_generations
        greedy = gens[1].id_lists() if len(gens) > 1 else None
        completions = [self.tok.decode(ids) for ids in gen.id_lists()]
        keys = [k for k in rows[0] if k != "prompt"]
        return RolloutBatch(
            gen=gen, group_ids=torch.arange(len(rows)).repeat_interleave(G),
            prompts=[x["prompt"] for x in rows for _ in range(G)], completions=completions,
            columns={k: [x[k] for x in rows for _ in range(G)] for k in keys},
            greedy=None if greedy is None else [self.tok.decode(x) for x in greedy for _ in range(G)],
            greedy_ids=None if greedy is None else [x for x in greedy for _ in range(G)], weight_version=version)

    def _count_tokens(self, n: int) -> None:
        """generate()'s on_tokens: n more tokens sampled."""
        self.progress.add(tokens=n)

    def _reward_name(self, spec: str) -> str:
        """The metric name of a reward column: the configured functions' unique names, else e.g. 'overlong'."""
        return self.reward_names.get(spec) or reward_name(spec)

    def trainer_state(self) -> TrainerState:
        """What reward functions get as `trainer_state` (TRL passes transformers' TrainerState): the
        epoch is the train prompts' passes before this step, as transformers' state reads mid-step."""
        return TrainerState(global_step=self.step, max_steps=self.cfg.train.max_steps, epoch=self.epoch_at_step)

    def score(self, batch: RolloutBatch) -> dict[str, list[float]]:
        """Reward functions (weighted total), plus DAPO's overlong shaping when configured.
        Returns the scalars the functions logged with log_metric."""
        w, a = self.cfg.reward, self.cfg.algorithm
        log = RewardLog(len(batch))
        policy = PolicyView(self.model, self.tok, batch.gen) if self.wants_policy else None
        batch.rewards, batch.reward_columns = score(w.functions, w.weights, batch.prompts, batch.completions,
                                                    batch.columns, completion_ids=batch.completion_id_lists(),
                                                    trainer_state=self.trainer_state(), log=log, policy=policy)
        if batch.greedy is not None:   # remax: the greedy completions' rewards are the baselines
            batch.baselines, _ = score(w.functions, w.weights, batch.prompts, batch.greedy, batch.columns,
                                       completion_ids=batch.greedy_ids, trainer_state=self.trainer_state())
        batch.logged, batch.score_keys = log.columns, log.score_keys
        batch.scorable = ~torch.stack(list(batch.reward_columns.values())).isnan().all(0)
        if a.overlong_buffer:
            pen = overlong_penalty(batch.gen.completion_mask.sum(-1).cpu(), self.cfg.rollout.max_new_tokens,
                                   a.overlong_buffer, a.overlong_penalty)
            batch.reward_columns["overlong"] = pen
            batch.rewards = batch.rewards + pen
        return log.metrics

    def collect(self) -> tuple[RolloutBatch, dict]:
        """Sample and score one step's batch. With dynamic sampling (DAPO), groups whose rewards
        are all equal are dropped and more prompts sampled, up to algorithm.max_sampling_rounds
        rounds; the batch is then cut to rollout.prompts_per_step groups. With several ranks each rank
        keeps up to its share of the groups, and all ranks take the same number of rounds."""
        a = self.cfg.algorithm
        P = self.cfg.rollout.prompts_per_step // self.world.size   # this rank's groups
        stats = {"time/generate": 0.0, "time/reward": 0.0}
        self.logged_metrics = {}
        s = self.sampler
        self.epoch_at_step = s.epoch + s.index / max(1, s.n)
        kept: list[RolloutBatch] = []
        n_groups, first = 0, None
        for rnd in range(1, a.max_sampling_rounds + 1):
            t0 = time.perf_counter()
            batch = self.rollout()
            t1 = time.perf_counter()
            self.progress.start_phase("score", len(batch))
            for k, v in self.score(batch).items():
                self.logged_metrics.setdefault(k, []).extend(v)
            if self.n_workers:   # the workers sampled for time/generate; the trainer waited time/rollout_wait
                stats.update(self.worker_times)
            else:
                stats["time/generate"] += t1 - t0
            stats["time/reward"] += time.perf_counter() - t1
            first = first or batch
            if not a.dynamic_sampling:
                stats["frac_reward_zero_std"] = self._zero_std(batch)
                return self._std_filter(batch, stats), stats
            keep = self._informative(batch)
            kept.append(batch.select(keep))
            n_groups += len(torch.unique(batch.group_ids[keep]))
            done = n_groups >= P
            if self.world.size > 1:   # another round until every rank has its share
                done = dist.sum_floats(float(done))[0] == self.world.size
            if done:
                break
        stats["dynamic_sampling/rounds"] = rnd
        stats["dynamic_sampling/kept_groups"] = dist.sum_floats(float(min(n_groups, P)))[0] \
            if self.world.size > 1 else min(n_groups, P)
        stats["frac_reward_zero_std"] = self._zero_std(first)   # of the first round, before filtering
        if n_groups == 0:   # nothing informative within the cap: train on the last round (zero advantages)
            return self._std_filter(batch, stats), stats
        merged = cat_batches(kept, self.tok.pad_id)
        return self._std_filter(merged.select(merged.group_ids < P), stats), stats

    def _std_filter(self, batch: RolloutBatch, stats: dict) -> RolloutBatch:
        """RLPR's filter (algorithm.std_filter_ema > 0): drop the groups whose reward std is below the
        moving average of earlier batches' mean group std (the first batch sets it and keeps all);
        the average then takes this batch in. A batch that would lose every group keeps them all."""
        d = self.cfg.algorithm.std_filter_ema
        if not d:
            return batch
        _, inv = torch.unique(batch.group_ids, return_inverse=True)
        ok = self._scorable(batch)
        stds = torch.stack([batch.rewards[(inv == g) & ok].std(unbiased=False) if int(((inv == g) & ok).sum()) > 1
                            else torch.tensor(0.0) for g in range(int(inv.max()) + 1)])
        total, count = dist.sum_floats(float(stds.sum()), float(len(stds)))   # every rank: the same average
        threshold = self.std_ema
        keep = stds >= threshold if threshold is not None else torch.ones_like(stds, dtype=torch.bool)
        self.std_ema = total / count if threshold is None else d * threshold + (1 - d) * total / count
        stats["std_filter/threshold"] = threshold if threshold is not None else 0.0
        stats["std_filter/kept_groups"] = dist.sum_floats(float(keep.sum()))[0]
        return batch.select(keep[inv]) if keep.any() else batch

    @staticmethod
    def _scorable(batch: RolloutBatch) -> torch.Tensor:
        return batch.scorable if batch.scorable is not None else torch.ones(len(batch), dtype=torch.bool)

    def _informative(self, batch: RolloutBatch) -> torch.Tensor:
        """Rows of the groups whose scorable rewards are not all equal (DAPO's filter)."""
        ok = self._scorable(batch)
        varied = torch.zeros(len(batch), dtype=torch.bool)
        varied[ok] = dynamic_sampling_keep(batch.rewards[ok], batch.group_ids[ok])
        return torch.isin(batch.group_ids, batch.group_ids[varied])

    @staticmethod
    def _zero_std(batch: RolloutBatch) -> float:
        """Share of groups whose scorable rewards are all equal (or that have at most one)."""
        _, inv = torch.unique(batch.group_ids, return_inverse=True)
        ok = GRPOTrainer._scorable(batch)
        groups = [batch.rewards[(inv == g) & ok] for g in range(int(inv.max()) + 1)]
        return sum(float(len(r) < 2 or r.max() == r.min()) for r in groups) / len(groups)

    def advantages(self, batch: RolloutBatch, ref_lp: torch.Tensor | None) -> dict:
        """Advantages from the rewards (minus beta * KL when algorithm.kl_in_reward)."""
        a = self.cfg.algorithm
        if a.adv_estimator in TOKEN_ESTIMATORS:
            return self._token_advantages(batch, ref_lp)
        rewards, out = batch.rewards, {}
        if a.kl_in_reward:
            g = batch.gen
            kl = kl_penalty(g.sampler_logprobs, ref_lp, a.kl_estimator)
            rewards = apply_kl_in_reward(rewards, kl.cpu(), g.completion_mask.cpu(), a.beta)
            kl_sum, n_tok = dist.sum_floats(float((kl * g.completion_mask).sum()), float(g.completion_mask.sum()))
            out["kl"] = kl_sum / max(n_tok, 1.0)
        opts = dict(eps=a.adv_eps, unbiased_std=a.unbiased_std, scale_rewards=a.scale_rewards)
        ok, group_ids = self._scorable(batch), batch.group_ids
        if self.world.size > 1:   # every reward of the step: batch-wide statistics are over all ranks
            B = len(batch)   # ranks can hold different numbers of rows (dynamic sampling)
            start = int(dist.gather_rows(torch.tensor([B]))[:self.world.rank].sum())
            rewards, ok = dist.gather_rows(rewards), dist.gather_rows(ok)
            group_ids = dist.gather_rows(group_ids + start)   # a rank's group ids are < its B: distinct
        if bool(ok.all()):
            adv = compute_advantages(rewards, group_ids, a.adv_estimator, **opts)
        else:   # rows no reward function scored: out of the baselines, advantage 0 (as TRL does)
            adv = torch.zeros_like(rewards)
            adv[ok] = compute_advantages(rewards[ok], group_ids[ok], a.adv_estimator, **opts)
        batch.advantages = adv[start:start + B] if self.world.size > 1 else adv
        return out

    def _token_advantages(self, batch: RolloutBatch, ref_lp: torch.Tensor | None) -> dict:
        """gae / reinforce_plus_plus / remax: token rewards (the score at the last token, minus beta * KL
        per token with kl_in_reward), then the estimator; (B, C) advantages and returns on the batch.
        Rows no reward function scored get no advantage and no value target."""
        a, g = self.cfg.algorithm, batch.gen
        ok = self._scorable(batch).to(g.completion_mask.device)
        mask = g.completion_mask & ok[:, None]
        scores = torch.where(ok, batch.rewards.to(ok.device), torch.zeros_like(batch.rewards, device=ok.device))
        kl = kl_penalty(g.sampler_logprobs, ref_lp, a.kl_estimator) if a.kl_in_reward else None
        token_rewards = token_level_rewards(scores, mask, kl, a.beta)
        out = {}
        if kl is not None:
            out["kl"] = float((kl * mask).sum() / mask.sum().clamp(min=1))
        if a.adv_estimator == "gae":
            batch.values = self.critic.values(g, self._micro_batches(len(batch))[0])
            batch.advantages, batch.returns = compute_gae(token_rewards, batch.values, mask, a.gamma, a.lam)
        elif a.adv_estimator == "reinforce_plus_plus":
            batch.advantages, batch.returns = compute_reinforce_plus_plus(token_rewards, mask, a.gamma)
        else:
            batch.advantages, batch.returns = compute_remax(token_rewards, batch.baselines.to(mask.device), mask)
        return out

    def _micro_batches(self, n: int) -> tuple[list[slice], int]:
        """Row slices of at most optim.micro_batch_size rows, and how many stand-in passes to add.

        Sharded, every forward and backward is a collective, so every rank must run as many; a rank
        with fewer rows (dynamic sampling) adds stand-ins: its first row again, with no weight."""
        mb = self.cfg.optim.micro_batch_size or n
        out = [slice(i, min(n, i + mb)) for i in range(0, n, mb)]
        extra = int(dist.gather_rows(torch.tensor([len(out)])).max()) - len(out) if self.sharded else 0
        return out, extra

    def _logprobs(self, model, g, sl: slice, **kw):
        return completion_logprobs(model, g.prompt_ids[sl], g.prompt_mask[sl], g.completion_ids[sl],
                                   g.completion_mask[sl], self.cfg.rollout.temperature,
                                   chunk=self.logprob_chunk, context_mask=g.context_mask[sl], group=self.share_group,
                                   **kw)

    def ref_logprobs(self, batch: RolloutBatch) -> torch.Tensor | None:
        """Reference log-probs of the sampled tokens, one no-grad pass (None without a reference)."""
        if not self.cfg.algorithm.beta > 0:
            return None
        with reference(self.model, self.ref) as ref:   # under LoRA: the policy with its adapters off
            return self._frozen_logprobs(ref, batch.gen)

    def _frozen_logprobs(self, model, g) -> torch.Tensor:
        """Log-probs of the sampled tokens without autograd bookkeeping (inference mode is cheaper than
        no_grad, but FSDP's gathered weights must not become inference tensors: no_grad when sharded)."""
        with torch.no_grad() if self.sharded else torch.inference_mode():
            slices, extra = self._micro_batches(g.completion_ids.size(0))
            lp = torch.cat([self._logprobs(model, g, s) for s in slices])
            for _ in range(extra):
                self._logprobs(model, g, slice(0, 1))
        return lp.clone()   # a normal tensor again, usable inside the loss

    def update(self, batch: RolloutBatch, ref_lp: torch.Tensor | None = None) -> dict:
        """mu optimizer passes over the batch; returns loss/KL/clip/entropy metrics."""
        a, g = self.cfg.algorithm, batch.gen
        adv = batch.advantages.to(self.device)
        # completions cut at max_new_tokens can be left out of the loss (they never count as sequences)
        loss_mask = g.completion_mask & ~g.truncated[:, None] if a.mask_truncated_completions else g.completion_mask
        mask = loss_mask.float()
        # the global batch's counts: each rank's loss is its share of one loss over every rank's tokens
        n_tok, n_seq = dist.sum_floats(float(mask.sum()), float((mask.sum(-1) > 0).sum()))
        slices, extra = self._micro_batches(len(batch))
        agg = dict(global_tokens=n_tok, global_seqs=n_seq, max_new_tokens=self.cfg.rollout.max_new_tokens)

        # Old-policy log-probs in a no-grad pass. With mu == 1 the old policy is the current one,
        # so the ratio is exactly 1 and old log-probs are the detached logp.
        kl_in_loss = a.beta > 0 and not a.kl_in_reward
        old_lp = None
        if a.num_iterations > 1:
            self.model.eval()
            old_lp = self._frozen_logprobs(self.model, g)

        critic = {}
        if self.critic is not None:   # PPO: the critic learns the GAE returns (the rollout's values are the old ones)
            critic = self.critic.update(g, batch.values, batch.returns, g.completion_mask & self._scorable(batch)[
                :, None].to(self.device), slices, a.num_iterations, agg)
            if self.step < self.cfg.critic.warmup_updates:   # critic warmup: the policy waits
                return critic

        self.model.train()
        self.progress.start_phase("update", len(batch) * a.num_iterations)
        lr = self.opt.param_groups[0]["lr"]  # the rate this step's updates use (logged before the scheduler moves)
        sums = {"loss": 0.0, "kl": 0.0, "entropy": 0.0, "clip_ratio/low_sum": 0.0, "clip_ratio/high_sum": 0.0,
                "clip_ratio/region_sum": 0.0, "rollout/logprob_abs_diff_sum": 0.0, "rollout/masked_sum": 0.0,
                "rollout/ratio_sum": 0.0}
        ratio_max = 0.0
        grad_norms, applied = [], 0
        for it in range(a.num_iterations):
            self.opt.zero_grad(set_to_none=True)
            self.model.zero_grad(set_to_none=True)   # (the same tensors, unless master weights are in use)
            for s in slices:
                logp, ent = self._logprobs(self.model, g, s, with_entropy=True, entropy_grad=a.entropy_coef > 0)
                m = loss_mask[s]
                old = old_lp[s] if old_lp is not None else logp.detach()
                # sampler vs trainer probabilities of the same tokens: logged always, corrected on request
                w, m_pg, rc = rollout_correction(old, g.sampler_logprobs[s], m, mode=a.rollout_correction,
                                                 level=a.rollout_correction_level,
                                                 threshold=a.rollout_correction_threshold)
                if it == 0:
                    sums["rollout/logprob_abs_diff_sum"] += rc["rollout/logprob_abs_diff_sum"]
                    sums["rollout/masked_sum"] += rc.get("rollout/masked_sum", 0.0)
                    sums["rollout/ratio_sum"] += rc["rollout/ratio_sum"]
                    ratio_max = max(ratio_max, rc["rollout/ratio_max"])
                loss, cm = compute_policy_loss(logp, old, adv[s], m_pg, policy_loss=a.policy_loss,
                                               loss_agg_mode=a.loss_agg_mode, epsilon=a.epsilon,
                                               epsilon_high=a.epsilon_high, clip_ratio_c=a.clip_ratio_c,
                                               weights=w if a.rollout_correction == "tis" else None, **agg)
                if kl_in_loss:
                    kl = kl_penalty(logp, ref_lp[s], a.kl_estimator)
                    loss = loss + a.beta * aggregate(kl, m, a.loss_agg_mode, **agg)
                    sums["kl"] += float((kl.detach() * m).sum())
                if a.entropy_coef:
                    loss = loss - a.entropy_coef * aggregate(ent, m, a.loss_agg_mode, **agg)
                loss.backward()
                self.progress.add(rows=s.stop - s.start, tokens=int(m.sum()))
                sums["loss"] += float(loss.detach())
                sums["entropy"] += float((ent.detach() * m).sum())
                for k, v in cm.items():
                    sums[k] += v
            for _ in range(extra):   # stand-ins: a backward (FSDP's gradient reduction) that adds zero
                logp = self._logprobs(self.model, g, slice(0, 1))
                (logp.sum() * 0.0).backward()
            if not self.sharded:   # (fsdp sums each micro-batch's gradient into the shards as it goes)
                dist.sum_gradients(self.model.parameters())   # the full batch's gradient on every rank
            if self.master:
                self.master.grads_in()
            max_norm = self.cfg.optim.max_grad_norm or float("inf")
            clipped = self.master.master if self.master else self.model.parameters()
            norm = sharding.grad_norm(torch.nn.utils.clip_grad_norm_(clipped, max_norm))
            grad_norms.append(norm)
            # decided on the global loss and weights, so that every rank skips or applies the same steps
            if not self.apply_update(sums["loss"], norm):   # skipped or undone: no further passes
                break
            applied += 1
        if applied:   # a skipped step leaves the schedule where it was: the next step gets this step's lr
            self.sched.step()
        self.model.eval()
        sums = dict(zip(sums, dist.sum_floats(*sums.values())))   # over all ranks (as is, in one process)
        passes = a.num_iterations
        out = {"lr": lr, "loss": sums["loss"] / passes, "grad_norm": sum(grad_norms) / len(grad_norms),
               "entropy": sums["entropy"] / passes / max(n_tok, 1)}
        if kl_in_loss:
            out["kl"] = sums["kl"] / passes / max(n_tok, 1)
        for k in ("low", "high", "region"):
            out[f"clip_ratio/{k}_mean"] = sums[f"clip_ratio/{k}_sum"] / passes / max(n_tok, 1)
        out["rollout/logprob_abs_diff"] = sums["rollout/logprob_abs_diff_sum"] / max(n_tok, 1)
        out["rollout/ratio_mean"] = sums["rollout/ratio_sum"] / max(n_tok, 1)
        out["rollout/ratio_max"] = float(dist.gather_rows(torch.tensor([ratio_max])).max())
        if a.rollout_correction == "mis":
            out["rollout/masked_ratio"] = sums["rollout/masked_sum"] / max(n_tok, 1)
        return {**out, **critic}

    # ------------------------------------------------------------ the loop
    def evaluate(self) -> dict:
        """Held-out metrics. With several ranks each evaluates every N-th problem and the metrics are
        taken over all of them (every rank gets the same numbers)."""
        e, w = self.cfg.eval, self.world
        ids = list(range(w.rank, len(self.test_rows), w.size))   # every N-th problem (all of them in one process)
        engine = self.vllm if self.cfg.vllm.eval else None
        if engine is not None:
            self._sync_vllm()   # (not counted in a step's time/weight_sync)
        with sharding.full_weights(self.model):
            res = evaluate(self.model, self.tok, [self.test_rows[i] for i in ids], k=e.k, temperature=e.temperature,
                           max_new_tokens=self.cfg.rollout.max_new_tokens, batch_size=e.batch_size,
                           seed=self.cfg.train.seed, reward=e.reward, row_ids=ids,
                           tools=self.tools, engine=engine) if ids else {"samples": []}
        samples = res.pop("samples")
        if w.size == 1:
            return res
        recs = dist.unstride(dist.gather_objects(samples))   # every problem's record, in problem order
        k = len(recs[0].get("samples", [])) or 1
        out, _ = score_samples([r["greedy"] for r in recs], [s for r in recs for s in r.get("samples", [])],
                               [r["answer"] for r in recs], k, e.reward, self.test_rows[:len(recs)])
        if self.tools is not None:
            out["tool_calls_per_completion"] = sum(len(r["greedy_tool_calls"]) for r in recs) / len(recs)
        return out

    def train_step(self) -> dict:
        if not self.watch_seeded:   # a resumed run's watch continues from the rows it logged up to its checkpoint
            self.watch_seeded = True
            if self.step and self.writes:
                self.watch.seed(read_jsonl(self.run_dir / "metrics.jsonl"), self.step)
                if self.console is not None and self.watch.evals:   # the step lines show the latest accuracy
                    self.console.last_accuracy = self.watch.evals[-1][1]
        t0 = time.perf_counter()
        self.progress.start_step(f"step {self.step + 1}/{self.cfg.train.max_steps}")
        batch, stats = self.collect()
        t1 = time.perf_counter()
        self.progress.start_phase("reference log-probs", len(batch))
        ref_lp = self.ref_logprobs(batch)
        kl_metrics = self.advantages(batch, ref_lp)
        t2 = time.perf_counter()
        upd = self.update(batch, ref_lp)
        t3 = time.perf_counter()
        self.step += 1
        a = self.cfg.algorithm
        if a.ref_sync_steps and self.step % a.ref_sync_steps == 0:
            ref_sync(self.ref, self.model, a.ref_sync_alpha)

        # metrics are over the global batch: every rank's rows (gather_rows is the identity in one process)
        glob = dist.gather_rows
        r = glob(batch.rewards)[glob(self._scorable(batch))]
        lengths = glob(batch.gen.completion_mask.sum(-1).float().cpu())
        gen_tokens = float(lengths.sum())
        # every rank has the same number of groups in its first round
        zero_std = dist.sum_floats(stats["frac_reward_zero_std"])[0] / self.world.size
        metrics = {"step": self.step, "reward": float(r.mean()) if len(r) else float("nan"),
                   "reward_std": float(r.std()) if len(r) > 1 else 0.0, "frac_reward_zero_std": zero_std}
        for spec, col in batch.reward_columns.items():
            name = self._reward_name(spec)
            col = glob(col)
            valid = col[~torch.isnan(col)]
            metrics[f"rewards/{name}/mean"] = float(valid.mean()) if len(valid) else float("nan")
            metrics[f"rewards/{name}/std"] = float(valid.std()) if len(valid) > 1 else 0.0
        logged = {k: batch.logged[k] for k in batch.score_keys}
        logged_metrics = self.logged_metrics
        if self.world.size > 1:
            parts = dist.gather_objects((logged, logged_metrics))
            logged = {k: [v for p, _ in parts for v in p.get(k, [])] for k in dict.fromkeys(
                k for p, _ in parts for k in p)}
            logged_metrics = {k: [v for _, m in parts for v in m.get(k, [])] for k in dict.fromkeys(
                k for _, m in parts for k in m)}
        for key, values in logged.items():   # extra keys of dict returns (verl's reward_extra_info), means
            mean = number_mean(values)
            if mean is not None and key.rpartition("/")[2] not in ("mean", "std"):   # those name the reward's own
                metrics[f"rewards/{key}"] = mean
        metrics.update(upd)
        metrics.update(kl_metrics)
        metrics.update({k: v for k, v in stats.items() if k.startswith(("dynamic_sampling/", "std_filter/"))})
        metrics["completions/mean_length"] = float(lengths.mean())
        metrics["completions/clipped_ratio"] = float(glob(batch.gen.truncated.float().cpu()).mean())
        if self.tools is not None:
            metrics.update(tool_metrics(batch.gen.tool_calls, list(self.tools.runner.tools), glob))
        metrics["time/generate"] = stats["time/generate"]
        if self.n_workers:   # how far behind the policy that sampled this batch was, in optimizer steps
            metrics["async/weight_version"] = batch.weight_version
            metrics["async/staleness"] = self.step - 1 - batch.weight_version
            metrics["time/rollout_wait"] = stats["time/rollout_wait"]
            metrics["time/worker_idle"] = stats["time/worker_idle"]
            metrics["time/weight_sync"] = stats["time/weight_sync"]   # the broadcast of this step's version
            if "time/worker_start" in stats:   # the first step of this process (inside its time/step)
                metrics["time/worker_start"] = stats["time/worker_start"]
        if self.vllm is not None:   # (inside time/generate)
            metrics["time/weight_sync"], self.sync_time = self.sync_time, 0.0
        metrics["time/reward"] = stats["time/reward"]
        metrics["time/ref_and_advantages"] = t2 - t1
        metrics["time/update"] = t3 - t2
        metrics["time/step"] = t3 - t0
        metrics["perf/gen_tokens_per_sec"] = gen_tokens / max(stats["time/generate"], 1e-9)
        trained = gen_tokens * self.cfg.algorithm.num_iterations
        metrics["perf/train_tokens_per_sec"] = trained / max(t3 - t2, 1e-9)
        for k, v in logged_metrics.items():   # reward functions' log_metric scalars; built-in keys win
            if v:
                metrics.setdefault(k, sum(v) / len(v))
        self.last_batch = batch
        self.progress.end_step()
        self.watch.add_reward(self.step, metrics["reward"])
        return metrics

    def step_label(self, n: int) -> str:
        return f"step {n}"

    def run_eval(self, final: bool) -> dict:
        if final:
            self.progress.start_step("final eval")
            self.progress.start_phase("eval", len(self.test_rows))
        else:
            self.progress.start_phase("eval")
        res = self.evaluate()
        self.progress.end_step()
        return res

    def eval_row(self, res: dict) -> dict:
        """eval/* and the reward-hacking watch's watch/reward_hacking (0/1) and watch/greedy_accuracy_stderr."""
        row = {f"eval/{k}": v for k, v in res.items()}
        if "greedy_accuracy" in res:
            watched, verdict = self.watch.add_eval(self.step, res["greedy_accuracy"])
            row.update(watched)
            if self.console is not None and self.writes:
                self.console.evaluated(self.step, row, verdict)
        return row

    def fresh_run(self) -> None:
        if (self.run_dir / "samples.jsonl").exists():
            (self.run_dir / "samples.jsonl").unlink()   # a fresh run starts a fresh file

    def show_progress(self, m: dict, start: float, start_step: int, force: bool = False) -> None:
        pass   # GRPO's console line comes with the row (log_row), every train.log_every steps

    def log_row(self, m: dict, f, trackers, elapsed: float, start_step: int) -> None:
        """Rank 0: a step's row to metrics.jsonl and the trackers; its samples (every log.samples_every
        steps, and always the first and the last step's); its console line."""
        t = self.cfg.train
        super().log_row(m, f, trackers, elapsed, start_step)
        every = self.cfg.log.samples_every
        if every and (self.step % every == 0 or self.step in (1, t.max_steps)):
            self._write_samples()
        if self.console is not None and (self.step % t.log_every == 0 or self.step == t.max_steps):
            self.console.step(m, self.step, t.max_steps, elapsed, start_step=start_step)

    def _write_samples(self) -> None:
        """Append the last batch's first log.samples_per_step completions to samples.jsonl."""
        b = self.last_batch
        n = min(self.cfg.log.samples_per_step, len(b))
        names = {spec: self._reward_name(spec) for spec in b.reward_columns}
        records = []
        for i in range(n):
            rewards = {}
            for spec, col in b.reward_columns.items():
                v = float(col[i])
                rewards[names[spec]] = None if math.isnan(v) else v
            records.append({"step": self.step, "prompt": b.prompts[i], "completion": b.completions[i],
                            "reward": float(b.rewards[i]), "rewards": rewards,
                            "advantage": self._row_advantage(b, i)})
            if b.gen.tool_calls is not None:
                records[-1]["tool_calls"] = b.gen.tool_calls[i]
            if b.logged:   # what reward functions logged for this sample (log_extra, dict returns)
                records[-1]["logged"] = {k: v[i] for k, v in b.logged.items()}
        with open(self.run_dir / "samples.jsonl", "a") as f:
            for r in records:
                f.write(json.dumps(r, default=repr) + "\n")
        if self.console is not None:
            self.console.samples(self.step, records)

    @staticmethod
    def _row_advantage(b: RolloutBatch, i: int) -> float:
        """A row's advantage: the sequence's, or (token-level estimators) the mean over its tokens."""
        adv = b.advantages[i]
        if adv.dim() == 0:
            return float(adv)
        m = b.gen.completion_mask[i].to(adv.device)
        return float(adv[m].mean()) if m.any() else 0.0

    # ------------------------------------------------------------ checkpoints
    def extra_state(self) -> dict:
        state = {"sampler": self.sampler.state(), **({"std_ema": self.std_ema} if self.std_ema is not None else {})}
        if self.n_workers:   # the batches in flight are saved whole (in_flight.pt): a resume needs no old weights
            state["async"] = self.ahead.state(self._diverged)
        return state

    def restore_extra(self, state: dict, ckpt: Path) -> None:
        self.sampler.restore(state["sampler"])
        self.std_ema = state.get("std_ema")
        if self.critic is not None:
            self.critic.load(ckpt)
        self.ahead.restore(state.get("async"), ckpt, self.step)

    def rng_state(self) -> dict:
        return {"generator": self.gen.get_state()}

    def restore_rng(self, rng: dict) -> None:
        self.gen.set_state(rng["generator"])

    def checkpoint_extra(self):
        writers = [f for f in (self.critic.save if self.critic is not None else None,
                               self.ahead.save if self.n_workers else None) if f is not None]
        if not writers:
            return None
        return lambda path: [w(path) for w in writers]

    def full_states(self) -> dict | None:
        """fsdp: every rank sends its shards; rank 0 writes the full tensors."""
        if not self.sharded:
            return None
        return {"model": sharding.full_state_dict(self.model),
                "optimizer": sharding.full_optimizer_state(self.model, self.opt),
                "ref": sharding.full_state_dict(self.ref, tied=False) if self.ref is not None else None}

    def load_state(self, ckpt: str | Path, weights: bool) -> dict:
        if not self.sharded:
            return super().load_state(ckpt, weights)
        state = load_training_state(ckpt)   # full tensors from the files; each rank keeps its shard
        if weights:
            sharding.load_full_state_dict(self.model, load_model(ckpt)[0].state_dict())
        ref = read_ref_state(ckpt, self.ref) if self.ref is not None else None
        if ref is not None:
            sharding.load_full_state_dict(self.ref, ref)
        sharding.load_optimizer_state(self.model, self.opt, state["optimizer"])
        return state
