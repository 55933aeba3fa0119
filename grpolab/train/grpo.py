"""The GRPO loop on the trainer shell (train/base.py). One step, top to bottom in `train_step`:

    rollout source (rollout/sources.py)  -> G completions per prompt, sampler log-probs     collect.py
    reward functions                     -> weighted total per completion                  scoring.py
    reference log-probs (plan.reference) -> KL in the reward or the loss (plan.kl)          logprob_passes.py
    advantage estimator (plan.estimator) -> per-completion or per-token advantages          batch_advantages.py
    critic (plan.critic)                 -> PPO's value update
    policy update                        -> mu passes of clipped-ratio loss, one optimizer step each
    metrics.jsonl, samples.jsonl, periodic eval and checkpoint                              step_metrics.py

What varies by config is resolved once into the plan (train/plan.py); the stages are functions over the
rollout batch; this class builds them and orders them.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from .. import distributed as dist
from .. import sharding
from ..algorithms.ref_sync import ref_sync
from ..config import Config
from ..models import set_gradient_checkpointing
from ..models.checkpoint import load_model, load_training_state, read_ref_state
from ..models.lora import has_lora
from ..models.reference import frozen_reference, reference
from ..monitor.report.read import read_jsonl
from ..monitor.reward_hacking import Watch
from ..rewards import reward_name, reward_names, wants_policy
from ..rewards.combine import TrainerState, check_signatures
from ..rewards.intrinsic import PolicyView
from ..rewards.runtime import RewardRuntime
from ..rollout.batch import RolloutBatch
from ..rollout.env_decode import build_env_use
from ..rollout.prompt_feed import PromptFeed
from ..rollout.sources import make_source
from ..rollout.tool_decode import build_tool_use
from . import policy_update, scoring
from .base import Trainer
from .batch_advantages import advantages, scorable
from .collect import collect
from .critic import CriticTrainer
from .eval_rewards import eval_functions
from .evaluate import evaluate_ranks
from .logprob_passes import LogProbPasses
from .memory_budget import check_run_memory, model_shape
from .plan import build_plan, check_plan
from .samples_log import append_samples, sample_records
from .schedule import lr_factor
from .step_metrics import step_metrics


class GRPOTrainer(Trainer):
    """The RL step on the trainer shell; checkpoints add the prompts' position, the std filter's average,
    the critic and the rollout source's state (async: the batches in flight)."""

    job = "grpo"
    collective = True   # with several ranks every skip and stop is decided over all of them
    bad_data = "check the reward functions"

    def __init__(self, cfg: Config, model, tokenizer, train_rows: list[dict], test_rows: list[dict],
                 run_dir: str | Path, console=None) -> None:
        self.world = dist.world_from_env()
        self.plan = build_plan(cfg, self.world.size, lora=has_lora(model) or cfg.model.lora_rank > 0)
        check_plan(cfg, self.plan, self.world)
        # before any batch is allocated: a rollout or eval batch larger than the memory is one line, not the
        # kernel's OOM killer (train/memory_budget.py)
        check_run_memory(cfg, model_shape(model), tokenizer, train_rows, test_rows, next(model.parameters()).device,
                         self.world, getattr(model.config, "block_size", None)
                         or getattr(model.config, "max_position_embeddings", None))
        self._prepare_policy(cfg, model)
        # progress inside a long step (phase, rows, tokens/s) on rank 0's console; only rank 0 writes files
        super().__init__(cfg, model, tokenizer, run_dir, console, writes=self.world.main,
                         talk=console is not None and self.world.main and getattr(console, "level", 0) >= 1)
        self.max_steps = cfg.train.max_steps
        self.test_rows = test_rows[:cfg.eval.num_problems]
        # the reward functions the eval scores its greedy completions with (eval/rewards/<name>/mean), and a line
        # for each that cannot score the eval rows
        self.eval_functions, self.eval_said = eval_functions(cfg.reward.functions, self.test_rows)
        if console is not None:
            console.start_run()   # no eval numbers of an earlier run on this console's step lines
        # reward hacking: held-out accuracy falling while the training reward does not (monitor/reward_hacking.py)
        self.watch, self.watch_seeded = Watch(len(self.test_rows)), False
        self.wants_policy = any(wants_policy(f) for f in cfg.reward.functions)   # intrinsic rewards (policy-reading)
        # PPO's critic: a copy of the starting policy, taken before LoRA, plus a value head
        self.critic = CriticTrainer(cfg, model) if self.plan.critic else None
        self.std_ema: float | None = None   # RLPR's std filter: moving average of the batches' mean group std
        self.attach_lora()
        # with LoRA the reference is the policy with its adapters off: no second copy
        self.ref = frozen_reference(model) if self.plan.reference == "frozen" else None
        self._build_optimizer()
        self.train_rows = train_rows
        self.gen = torch.Generator(device=self.device).manual_seed(cfg.train.seed)   # kept in checkpoints (older runs)
        self.reward_names = reward_names(cfg.reward.functions)   # spec -> metric name, unique
        self.logged_metrics: dict[str, list[float]] = {}          # reward functions' log_metric values, this step
        self.epoch_at_step = 0.0
        # rollout.tools: calls inside rollouts and eval (rollout/tool_decode.py); None without tools
        # reward.timeout and reward.code_exec's sandbox, for the reward calls and the python tool
        self.runtime = RewardRuntime.from_config(cfg.reward)
        # or env.name: each rollout row an episode in the environment (rollout/env_decode.py); the two never mix
        self.tools = (build_tool_use(cfg.rollout, tokenizer, cfg.model.name_or_path, self.runtime)
                      or build_env_use(cfg, tokenizer, cfg.model.name_or_path))
        check_signatures(cfg.reward.functions, list(train_rows[0]) if train_rows else [], rows=train_rows,
                         source=cfg.data.train_path or f"data.task={cfg.data.task}")
        self.feed = PromptFeed(train_rows, tokenizer, cfg.rollout, cfg.train.seed, self.plan.estimator.greedy)
        self.sampler = self.feed.stream   # the prompts' order
        self.source = make_source(cfg, model, self.feed, self.world, self.progress, tools=self.tools, console=console,
                                  full_weights=sharding.full_weights)
        a, o = cfg.algorithm, cfg.optim
        self.rewards = scoring.Rewards(cfg.reward.functions, cfg.reward.weights, a.overlong_buffer, a.overlong_penalty,
                                       cfg.rollout.max_new_tokens, self.runtime)
        self.lp = LogProbPasses(cfg.rollout.temperature, o.logprob_chunk, o.micro_batch_size, self.plan.share_group,
                                self.plan.sharded)

    def _prepare_policy(self, cfg: Config, model) -> None:
        """Every rank starts from rank 0's policy, bit for bit; the sampling paths and gradient checkpointing."""
        if self.world.size > 1:
            dist.broadcast_parameters(model)
        if hasattr(model, "lean_decode"):   # Hugging Face policies: which sampling path to use
            model.lean_decode = cfg.rollout.lean_decode
        model.cuda_graph = cfg.rollout.cuda_graph   # on CUDA: the slotted decode (rollout/slot_decode.py) or not
        if cfg.model.gradient_checkpointing:
            set_gradient_checkpointing(model, True)

    def _build_optimizer(self) -> None:
        """fsdp over several ranks: policy and reference sharded (sharding.py), the optimizer built on the
        shards and its state kept there (no master copies)."""
        o, sharded = self.cfg.optim, self.plan.sharded
        if sharded:
            sharding.shard(self.model)
            if self.ref is not None:
                sharding.shard(self.ref, frozen=True)
        self.build_optimizer(o.lr, (o.beta1, o.beta2), o.weight_decay,
                             lambda s: lr_factor(s, o.warmup_steps, self.cfg.train.max_steps, o.lr_schedule),
                             master=not sharded)

    @property
    def sharded(self) -> bool:
        return self.plan.sharded

    def close(self) -> None:
        """The rollout source's engines and processes go."""
        self.source.close()

    # ------------------------------------------------------------ the stages, on this run's settings
    def rollout(self) -> RolloutBatch:
        """One batch from the rollout source, with the current policy published to it."""
        self.source.publish(self.model, self.step)
        return self.source.take(self.step).batch

    def trainer_state(self, epoch: float | None = None) -> TrainerState:
        """What reward functions get as `trainer_state` (TRL passes transformers' TrainerState): the
        epoch is the train prompts' passes before this step, as transformers' state reads mid-step."""
        return TrainerState(global_step=self.step, max_steps=self.max_steps,
                            epoch=self.epoch_at_step if epoch is None else epoch)

    def score(self, batch: RolloutBatch, epoch: float | None = None) -> dict[str, list[float]]:
        policy = PolicyView(self.model, self.tok, batch.gen) if self.wants_policy else None
        return scoring.score(batch, self.rewards, self.trainer_state(epoch), policy)

    def collect(self) -> tuple[RolloutBatch, dict]:
        """This step's scored batch (train/collect.py) and its stats."""
        self.source.publish(self.model, self.step)
        got = collect(self.source, self.step, self.score, self.cfg.algorithm,
                      self.cfg.rollout.prompts_per_step // self.world.size, self.world, self.tok.pad_id,
                      self.progress, self.std_ema)
        self.epoch_at_step, self.logged_metrics, self.std_ema = got.epoch, got.logged, got.std_ema
        return got.batch, got.stats

    def ref_logprobs(self, batch: RolloutBatch) -> torch.Tensor | None:
        """Reference log-probs of the sampled tokens, one no-grad pass (None without a reference)."""
        if self.plan.reference == "none":
            return None
        with reference(self.model, self.ref) as ref:   # under LoRA: the policy with its adapters off
            return self.lp.frozen(ref, batch.gen)

    def advantages(self, batch: RolloutBatch, ref_lp: torch.Tensor | None) -> dict:
        values = None if self.critic is None else (
            lambda b: self.critic.values(b.gen, self.lp.micro_batches(len(b))[0]))
        return advantages(batch, self.plan, self.cfg.algorithm, ref_lp, self.world, values)

    def update(self, batch: RolloutBatch, ref_lp: torch.Tensor | None = None) -> dict:
        """PPO's critic first (it learns the GAE returns; during critic.warmup_updates the policy waits), then
        the policy's mu passes."""
        critic = {}
        if self.critic is not None:
            g, ok = batch.gen, scorable(batch)[:, None].to(self.device)
            a = self.cfg.algorithm
            critic = self.critic.update(g, batch.values, batch.returns, g.completion_mask & ok,
                                        self.lp.micro_batches(len(batch))[0], a.num_iterations,
                                        policy_update.aggregation(batch, a, self.cfg.rollout.max_new_tokens))
            if self.step < self.cfg.critic.warmup_updates:
                return critic
        upd = policy_update.update(self.model, batch, self.plan, self.cfg.algorithm, self.lp, self,
                                   self.cfg.optim.max_grad_norm, ref_lp, self.progress, self.cfg.rollout.max_new_tokens)
        return {**upd, **critic}

    # ------------------------------------------------------------ the loop
    def evaluate(self) -> dict:
        """Held-out metrics, every rank's share of the problems taken together (train/evaluate.py)."""
        engine = self.source.engine_for_eval(self.model, self.step)
        with sharding.full_weights(self.model):
            return evaluate_ranks(self.model, self.tok, self.test_rows, self.cfg, self.world, self.tools, engine,
                                  self.runtime, self.eval_functions, self.trainer_state())

    def train_step(self) -> dict:
        self._seed_watch()
        t0 = time.perf_counter()
        self.progress.start_step(f"step {self.step + 1}/{self.max_steps}")
        batch, stats = self.collect()
        t1 = time.perf_counter()
        self.progress.start_phase("reference log-probs", len(batch))
        ref_lp = self.ref_logprobs(batch)
        kl = self.advantages(batch, ref_lp)
        t2 = time.perf_counter()
        upd = self.update(batch, ref_lp)
        t3 = time.perf_counter()
        self.step += 1
        a = self.cfg.algorithm
        if a.ref_sync_steps and self.step % a.ref_sync_steps == 0:
            ref_sync(self.ref, self.model, a.ref_sync_alpha)
        metrics = step_metrics(self.step, batch, stats, upd, kl, self.logged_metrics, self.world, self._reward_name,
                               self.tools, a.num_iterations, (t0, t1, t2, t3))
        self.last_batch = batch
        self.progress.end_step()
        self.watch.add_reward(self.step, metrics["reward"])
        return metrics

    def _seed_watch(self) -> None:
        """A resumed run's watch continues from the rows it logged up to its checkpoint."""
        if self.watch_seeded:
            return
        self.watch_seeded = True
        if self.step and self.writes:
            self.watch.seed(read_jsonl(self.run_dir / "metrics.jsonl"), self.step)
            if self.console is not None and self.watch.evals:   # the step lines show the latest accuracy
                self.console.last_accuracy = self.watch.evals[-1][1]

    def _reward_name(self, spec: str) -> str:
        """The metric name of a reward column: the configured functions' unique names, else e.g. 'overlong'."""
        return self.reward_names.get(spec) or reward_name(spec)

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
        self._seed_watch()   # a resumed run's final eval, with no step run since the checkpoint, is watched too
        if "greedy_accuracy" in res:
            watched, verdict = self.watch.add_eval(self.step, res["greedy_accuracy"])
            row.update(watched)
            if self.console is not None and self.writes:
                self.console.evaluated(self.step, row, verdict)
        return row

    def fresh_run(self) -> None:
        (self.run_dir / "samples.jsonl").unlink(missing_ok=True)   # a fresh run starts a fresh file

    def show_progress(self, m: dict, start: float, start_step: int, force: bool = False) -> None:
        pass   # GRPO's console line comes with the row (log_row), every train.log_every steps

    def log_row(self, m: dict, f, trackers, elapsed: float, start_step: int) -> None:
        """Rank 0: a step's row to metrics.jsonl and the trackers; its samples (every log.samples_every
        steps, and always the first and the last step's); its console line."""
        t = self.cfg.train
        super().log_row(m, f, trackers, elapsed, start_step)
        every = self.cfg.log.samples_every
        if every and (self.step % every == 0 or self.step in (1, t.max_steps)):
            records = sample_records(self.last_batch, self.step, self.cfg.log.samples_per_step, self._reward_name)
            append_samples(self.run_dir / "samples.jsonl", records)
            self.step_logs["samples.jsonl"] = records   # the step's checkpoint keeps them (run_logs.py)
            if self.console is not None:
                self.console.samples(self.step, records)
        if self.console is not None and (self.step % t.log_every == 0 or self.step == t.max_steps):
            self.console.step(m, self.step, t.max_steps, elapsed, start_step=start_step)

    # ------------------------------------------------------------ checkpoints
    def extra_state(self) -> dict:
        # (async: the batches in flight are saved whole, in_flight.pt: a resume needs no old weights)
        return {"sampler": self.feed.state(), **({"std_ema": self.std_ema} if self.std_ema is not None else {}),
                **self.source.state()}

    def restore_extra(self, state: dict, ckpt: Path) -> None:
        self.feed.restore(state["sampler"])
        self.std_ema = state.get("std_ema")
        if self.critic is not None:
            self.critic.load(ckpt)
        self.source.restore(state, ckpt, self.step)

    def rng_state(self) -> dict:
        return {"generator": self.gen.get_state()}

    def restore_rng(self, rng: dict) -> None:
        self.gen.set_state(rng["generator"])

    def checkpoint_extra(self):
        writers = [f for f in (self.critic.save if self.critic is not None else None,
                               self.source.save if self.source.saves_files else None) if f is not None]
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
