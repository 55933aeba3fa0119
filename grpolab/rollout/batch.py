"""The rollout batch: everything one RL step knows about its samples, in one place."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .generation import LISTS, Generation, cat_generations


@dataclass
class RolloutBatch:
    """Rows are grouped: the G completions of prompt i share group_ids == i.

    Everything downstream reads token ids from here; nothing re-tokenizes decoded text.
    """
    gen: Generation                       # padded prompt/completion ids, masks, sampler log-probs, truncated
    group_ids: torch.Tensor               # (B,) long
    prompts: list                         # (B,) prompt per row: text or chat messages
    completions: list[str]                # (B,) decoded completion per row (special tokens dropped)
    columns: dict[str, list]              # dataset columns per row (e.g. 'answer'), passed to rewards
    rewards: torch.Tensor | None = None   # (B,) weighted total
    reward_columns: dict[str, torch.Tensor] = field(default_factory=dict)  # per function, NaN = not applicable
    advantages: torch.Tensor | None = None  # (B,)
    logged: dict[str, list] = field(default_factory=dict)  # (B,) per column that reward functions logged
    #                                       ('<reward>/<column>': log_extra columns and dict returns' extra keys)
    score_keys: list[str] = field(default_factory=list)    # the `logged` columns from dict returns (-> metrics)
    scorable: torch.Tensor | None = None  # (B,) bool: some reward function scored the row (not all None); TRL
    #                                       leaves the others out of the group baseline and gives them advantage 0
    greedy: list[str] | None = None       # (B,) remax: the greedy completion of the row's prompt ...
    greedy_ids: list[list[int]] | None = None  # ... its token ids ...
    baselines: torch.Tensor | None = None  # (B,) ... and its reward (the baseline)
    returns: torch.Tensor | None = None   # (B, C) token-level estimators: the returns (gae: the critic's targets)
    values: torch.Tensor | None = None    # (B, C) gae: the critic's values at rollout time
    weight_version: int = 0               # the policy that sampled it: the one after this many optimizer steps

    def completion_id_lists(self) -> list[list[int]]:
        """Each completion's token ids, stop token included, no padding (TRL's completion_ids); with
        tools, the tools' tokens too, in place."""
        return self.gen.id_lists()

    def __len__(self) -> int:
        return len(self.completions)

    @property
    def completion_mask(self) -> torch.Tensor:
        return self.gen.completion_mask

    def select(self, rows: torch.Tensor) -> "RolloutBatch":
        """The rows where `rows` (bool (B,)) is True, everything kept aligned."""
        idx = rows.nonzero().squeeze(-1)
        pick = lambda xs: [xs[i] for i in idx.tolist()]  # noqa: E731
        g = self.gen
        gen = Generation(**{k: t[idx.to(t.device)] for k, t in g.tensors().items()},
                         **{k: None if getattr(g, k) is None else pick(getattr(g, k)) for k in LISTS})
        return RolloutBatch(gen=gen, group_ids=self.group_ids[idx], prompts=pick(self.prompts),
                            completions=pick(self.completions), columns={k: pick(v) for k, v in self.columns.items()},
                            rewards=None if self.rewards is None else self.rewards[idx],
                            reward_columns={k: v[idx] for k, v in self.reward_columns.items()},
                            advantages=None if self.advantages is None else self.advantages[idx],
                            logged={k: pick(v) for k, v in self.logged.items()}, score_keys=list(self.score_keys),
                            scorable=None if self.scorable is None else self.scorable[idx],
                            greedy=None if self.greedy is None else pick(self.greedy),
                            greedy_ids=None if self.greedy_ids is None else pick(self.greedy_ids),
                            baselines=None if self.baselines is None else self.baselines[idx],
                            weight_version=self.weight_version)


def cat_batches(batches: list[RolloutBatch], pad_id: int) -> RolloutBatch:
    """One batch from several (e.g. dynamic-sampling rounds): their generations joined (cat_generations),
    group ids renumbered so groups stay distinct."""
    if len(batches) == 1:
        return batches[0]
    gen = cat_generations([b.gen for b in batches], pad_id)
    group_ids, offset = [], 0
    for b in batches:
        if len(b):
            _, inv = torch.unique(b.group_ids, return_inverse=True)
            group_ids.append(inv + offset)
            offset += int(inv.max()) + 1
    cat_opt = lambda xs: None if any(x is None for x in xs) else torch.cat(xs)  # noqa: E731
    logged_keys = list(dict.fromkeys(k for b in batches for k in b.logged))
    return RolloutBatch(
        gen=gen, group_ids=torch.cat(group_ids) if group_ids else torch.zeros(0, dtype=torch.long),
        prompts=[p for b in batches for p in b.prompts], completions=[c for b in batches for c in b.completions],
        columns={k: [v for b in batches for v in b.columns[k]] for k in batches[0].columns},
        rewards=cat_opt([b.rewards for b in batches]),
        reward_columns={k: torch.cat([b.reward_columns[k] for b in batches]) for k in batches[0].reward_columns},
        advantages=cat_opt([b.advantages for b in batches]),
        # a column one round logged and another did not is None for the other round's samples
        logged={k: [v for b in batches for v in b.logged.get(k, [None] * len(b))] for k in logged_keys},
        score_keys=list(dict.fromkeys(k for b in batches for k in b.score_keys)),
        scorable=cat_opt([b.scorable for b in batches]),
        greedy=None if any(b.greedy is None for b in batches) else [x for b in batches for x in b.greedy],
        greedy_ids=None if any(b.greedy_ids is None for b in batches) else [x for b in batches for x in b.greedy_ids],
        baselines=cat_opt([b.baselines for b in batches]), weight_version=batches[0].weight_version)
