"""One optimizer step on fixed rollouts, for every policy loss x aggregation mode x KL x micro-batch
size, in one process or split over the ranks of a torchrun launch (tests/test_distributed.py).

    python tests/dist_cases.py make DIR [hf]     # the rollouts, rewards, policy and reference weights
    torchrun --nproc_per_node 2 tests/dist_cases.py run DIR OUT.pt [fsdp]   # rank 0 writes the updated weights

With `hf`, the policy is a tiny Hugging Face Llama (tied embeddings) saved in DIR/llama and only
HF_CASES run; with `fsdp`, the ranks shard the policy (train.strategy=fsdp; the built-in GPT too, also
on HF_CASES only) and rank 0 also writes the last case's checkpoint to DIR/checkpoints.
"""

import itertools
import os
import sys
from pathlib import Path

import torch

from grpolab import distributed as dist
from grpolab import sharding
from grpolab.algorithms.aggregate import AGG_MODES
from grpolab.algorithms.losses import POLICY_LOSSES
from grpolab.config.load import load_config
from grpolab.models import GPT, CharTokenizer, GPTConfig
from grpolab.rollout.batch import RolloutBatch
from grpolab.rollout.engine import generate
from grpolab.rollout.generation import Generation
from grpolab.train.grpo import GRPOTrainer

P, G = 4, 4        # prompts per step and group size: 2 groups per rank with 2 ranks
ESTIMATORS = [("grpo", "group"), ("grpo", "batch"), ("reinforce_baseline", "group")]
CASES = [(loss, agg, beta, mb, "") for loss, agg, beta, mb in
         itertools.product(sorted(POLICY_LOSSES), AGG_MODES, (0.0, 0.05), (0, 1))] + [
    ("clip", "token-mean", 0.05, 0, "mu2"),                 # two optimizer passes over the batch
    ("clip", "seq-mean-token-mean", 0.05, 1, "kl_in_reward"),
    ("gspo", "token-mean", 0.0, 0, "unscorable"),           # some rows no reward function scored
]
EXTRA = {"": [], "mu2": ["algorithm.num_iterations=2"], "kl_in_reward": ["algorithm.kl_in_reward=true"],
         "unscorable": [], "uneven": []}
# FSDP on the Llama: each loss once, both micro-batch sizes, KL, two optimizer passes, uneven rows
HF_CASES = [("clip", "token-mean", 0.05, 1, ""), ("gspo", "seq-mean-token-mean", 0.0, 0, ""),
            ("cispo", "seq-mean-token-sum-norm", 0.05, 0, ""), ("clip", "token-mean", 0.05, 0, "mu2"),
            # 12 micro-batches on rank 0, 4 on rank 1: rank 1 runs 8 empty ones for the collectives
            ("clip", "seq-mean-token-mean", 0.05, 1, "uneven")]
ROWS = [{"prompt": f"Tom has {i} apples and gets {i + 2} more. How many apples?", "answer": str(2 * i + 2)}
        for i in range(P)]


def _model(seed: int) -> GPT:
    torch.manual_seed(seed)
    tok = CharTokenizer()
    return GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_embd=32, block_size=96))


def _llama(data: Path, seed: int):
    from grpolab.models.hf import load_hf
    policy, tok = load_hf(str(data / "llama"))
    if seed:   # the reference: other random weights
        torch.manual_seed(seed)
        for p in policy.parameters():
            torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else None
    return policy, tok


def make(out: Path, hf: bool = False) -> None:
    """Fixed rollouts from a random tiny policy, rewards drawn at random (so every advantage is
    non-zero), and a different reference (so the KL term has a gradient)."""
    if hf:
        from grpolab.models.tiny_hf import save_tiny_model
        save_tiny_model(out / "llama", vocab_size=300, hidden=32, layers=2, heads=2, intermediate=64)
        policy, tok = _llama(out, 0)
        ref = _llama(out, 1)[0].state_dict()
    else:
        tok, policy = CharTokenizer(), _model(0)
        ref = _model(1).state_dict()
    g = torch.Generator().manual_seed(0)
    gen = generate(policy, [tok.render_prompt(r["prompt"]) for r in ROWS], num_generations=G, max_new_tokens=10,
                   temperature=1.0, stop_ids=tok.stop_ids, pad_id=tok.pad_id, generator=g)
    rewards = torch.rand(P * G, generator=g)
    torch.save({"gen": gen.__dict__, "rewards": rewards, "policy": policy.state_dict(), "ref": ref},
               out / "rollouts.pt")


def _case_config(i: int, loss: str, agg: str, beta: float, mb: int, extra: str, out: Path, strategy: str = "ddp"):
    est, scale = ESTIMATORS[i % len(ESTIMATORS)]
    return load_config(None, [f"algorithm.policy_loss={loss}", f"algorithm.loss_agg_mode={agg}",
                              f"algorithm.beta={beta}", f"optim.micro_batch_size={mb}",
                              f"algorithm.adv_estimator={est}", f"algorithm.scale_rewards={scale}",
                              f"rollout.prompts_per_step={P}", f"rollout.num_generations={G}",
                              "rollout.max_new_tokens=10", "optim.lr=1e-2", "reward.functions=[length]",
                              f"train.output_dir={out}", f"train.strategy={strategy}", *EXTRA[extra]])


def run(data: Path, out: Path | None, strategy: str = "ddp", cases: list | None = None) -> dict:
    """Updated weights per case; this process's share of the rows when launched with several ranks.
    `cases`: default HF_CASES for the Llama or with fsdp, else CASES."""
    world = dist.init("cpu")
    hf = (data / "llama").is_dir()
    cases = cases if cases is not None else HF_CASES if hf or strategy == "fsdp" else CASES
    saved = torch.load(data / "rollouts.pt", weights_only=False)
    gen = Generation(**saved["gen"])
    N = len(saved["rewards"])
    results = {}
    for i, (loss, agg, beta, mb, extra) in enumerate(cases):
        # this rank's rows: an even split, or (uneven) 3 groups on rank 0 and 1 on rank 1
        cuts = [0, 3 * G, N] if extra == "uneven" and world.size == 2 else \
            [r * N // world.size for r in range(world.size + 1)]
        rows = slice(cuts[world.rank], cuts[world.rank + 1])
        local = Generation(*(t[rows] for t in (gen.prompt_ids, gen.prompt_mask, gen.completion_ids,
                                               gen.completion_mask, gen.sampler_logprobs, gen.truncated)))
        n = local.completion_ids.size(0)
        model, tok = _llama(data, 0) if hf else (_model(0), CharTokenizer())
        model.load_state_dict(saved["policy"])
        tr = GRPOTrainer(_case_config(i, loss, agg, beta, mb, extra, data, strategy), model, tok, ROWS, ROWS[:1],
                         data)
        if tr.ref is not None:
            if tr.sharded:
                sharding.load_full_state_dict(tr.ref, saved["ref"])
            else:
                tr.ref.load_state_dict(saved["ref"])
        batch = RolloutBatch(gen=local, group_ids=torch.arange(n // G).repeat_interleave(G), prompts=[""] * n,
                             completions=[""] * n, columns={}, rewards=saved["rewards"][rows].clone(),
                             scorable=(torch.arange(N)[rows] % 5 != 1) if extra == "unscorable"
                             else torch.ones(n, dtype=torch.bool))
        ref_lp = tr.ref_logprobs(batch)
        adv_metrics = tr.advantages(batch, ref_lp)
        metrics = tr.update(batch, ref_lp)
        # after update() each .grad holds the (clipped) gradient the optimizer step used
        full = sharding.full_state_dict(model) if tr.sharded else model.state_dict()
        results[(loss, agg, beta, mb, extra)] = {"params": {k: v.clone() for k, v in full.items()},
                                          "grads": {k: _full(p.grad) for k, p in model.named_parameters()
                                                    if p.grad is not None},
                                          "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
                                          "kl": metrics.get("kl"), "kl_in_reward": adv_metrics.get("kl"),
                                          "advantages": batch.advantages.clone()}   # this rank's rows
    if strategy == "fsdp":
        tr.save()   # the last case's policy, gathered: an ordinary Hugging Face checkpoint
    if out is not None and world.main:
        torch.save(results, out)
    dist.barrier()    # no rank leaves while another still works
    dist.shutdown()
    return results


def _full(t: torch.Tensor) -> torch.Tensor:
    """A gradient as one full tensor (a sharded one is gathered: every rank must call this)."""
    from torch.distributed.tensor import DTensor
    return t.full_tensor() if isinstance(t, DTensor) else t.clone()


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(Path(sys.argv[2]), hf=sys.argv[3:] == ["hf"])
    else:
        run(Path(sys.argv[2]), Path(sys.argv[3]), *sys.argv[4:])
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)   # as grpolab's ranks do: skip C++ teardown that can abort at interpreter exit
