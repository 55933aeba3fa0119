"""The reference policy of a KL term or an implicit reward: a frozen copy of the starting policy, or,
under LoRA, the policy itself with its adapters off (the base weights are the starting policy: no
second copy in memory)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

from torch import nn

from .lora import adapters_off, has_lora


def frozen_reference(policy: nn.Module) -> nn.Module | None:
    """A frozen deep copy of `policy` (eval mode, no gradients); None under LoRA, where `reference`
    turns the adapters off instead."""
    return None if has_lora(policy) else copy.deepcopy(policy).eval().requires_grad_(False)


@contextlib.contextmanager
def reference(policy: nn.Module, ref: nn.Module | None) -> Iterator[nn.Module]:
    """Within: the module that computes the reference, `ref` when there is one, else `policy` with its
    LoRA adapters off."""
    if ref is not None:
        yield ref
    else:
        with adapters_off(policy):
            yield policy
