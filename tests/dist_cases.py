"""One optimizer step on fixed rollouts, for every policy loss x aggregation mode x KL x micro-batch
size, in one process or split over the ranks of a torchrun launch (tests/test_distributed.py).

    python tests/dist_cases.py make DIR          # the rollouts, rewards, policy and reference weights
    torchrun --nproc_per_node 2 tests/dist_cases.py run DIR OUT.pt   # rank 0 writes the updated weights
"""

import itertools
import os
import sys
from pathlib import Path

import torch

from grpolab import distributed as dist
from grpolab.algorithms.aggregate import AGG_MODES
from grpolab.algorithms.losses import POLICY_LOSSES
from grpolab.config import load_config
from grpolab.models import GPT, GPTConfig, CharTokenizer
from grpolab.rollout.batch import RolloutBatch
from grpolab.rollout.engine import Generation, generate
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
         "unscorable": []}
ROWS = [{"prompt": f"Tom has {i} apples and gets {i + 2} more. How many apples?", "answer": str(2 * i + 2)}
        for i in range(P)]


def _model(seed: int) -> GPT:
    torch.manual_seed(seed)
    tok = CharTokenizer()
    return GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_embd=32, block_size=96))


def make(out: Path) -> None:
    """Fixed rollouts from a random tiny policy, rewards drawn at random (so every advantage is
    non-zero), and a different reference (so the KL term has a gradient)."""
    tok, policy = CharTokenizer(), _model(0)
    g = torch.Generator().manual_seed(0)
    gen = generate(policy, [tok.render_prompt(r["prompt"]) for r in ROWS], num_generations=G, max_new_tokens=10,
                   temperature=1.0, stop_ids=tok.stop_ids, pad_id=tok.pad_id, generator=g)
    rewards = torch.rand(P * G, generator=g)
    torch.save({"gen": gen.__dict__, "rewards": rewards, "policy": policy.state_dict(),
                "ref": _model(1).state_dict()}, out / "rollouts.pt")


def _case_config(i: int, loss: str, agg: str, beta: float, mb: int, extra: str, out: Path):
    est, scale = ESTIMATORS[i % len(ESTIMATORS)]
    return load_config(None, [f"algorithm.policy_loss={loss}", f"algorithm.loss_agg_mode={agg}",
                              f"algorithm.beta={beta}", f"optim.micro_batch_size={mb}",
                              f"algorithm.adv_estimator={est}", f"algorithm.scale_rewards={scale}",
                              f"rollout.prompts_per_step={P}", f"rollout.num_generations={G}",
                              "rollout.max_new_tokens=10", "optim.lr=1e-2", "reward.functions=[length]",
                              f"train.output_dir={out}", *EXTRA[extra]])


def run(data: Path, out: Path | None) -> dict:
    """Updated weights per case; this process's share of the rows when launched with several ranks."""
    world = dist.init("cpu")
    saved = torch.load(data / "rollouts.pt", weights_only=False)
    gen = Generation(**saved["gen"])
    rows = slice(world.rank * len(saved["rewards"]) // world.size,
                 (world.rank + 1) * len(saved["rewards"]) // world.size)
    local = Generation(*(t[rows] for t in (gen.prompt_ids, gen.prompt_mask, gen.completion_ids,
                                           gen.completion_mask, gen.sampler_logprobs, gen.truncated)))
    n = local.completion_ids.size(0)
    results = {}
    for i, (loss, agg, beta, mb, extra) in enumerate(CASES):
        model = _model(0)
        model.load_state_dict(saved["policy"])
        tr = GRPOTrainer(_case_config(i, loss, agg, beta, mb, extra, data), model, CharTokenizer(), ROWS, ROWS[:1],
                         data)
        if tr.ref is not None:
            tr.ref.load_state_dict(saved["ref"])
        batch = RolloutBatch(gen=local, group_ids=torch.arange(n // G).repeat_interleave(G), prompts=[""] * n,
                             completions=[""] * n, columns={}, rewards=saved["rewards"][rows].clone(),
                             scorable=(torch.arange(len(saved["rewards"]))[rows] % 5 != 1) if extra == "unscorable"
                             else torch.ones(n, dtype=torch.bool))
        ref_lp = tr.ref_logprobs(batch)
        adv_metrics = tr.advantages(batch, ref_lp)
        metrics = tr.update(batch, ref_lp)
        # after update() each .grad holds the (clipped) gradient the optimizer step used
        results[(loss, agg, beta, mb, extra)] = {"params": {k: v.clone() for k, v in model.state_dict().items()},
                                          "grads": {k: p.grad.clone() for k, p in model.named_parameters()
                                                    if p.grad is not None},
                                          "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
                                          "kl": metrics.get("kl"), "kl_in_reward": adv_metrics.get("kl"),
                                          "advantages": batch.advantages.clone()}   # this rank's rows
    if out is not None and world.main:
        torch.save(results, out)
    dist.barrier()    # no rank leaves while another still works
    dist.shutdown()
    return results


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(Path(sys.argv[2]))
    else:
        run(Path(sys.argv[2]), Path(sys.argv[3]))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)   # as grpolab's ranks do: skip C++ teardown that can abort at interpreter exit
