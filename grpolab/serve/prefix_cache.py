"""Prefix caching: the keys and values of prompts already prefilled, kept in blocks of `BLOCK` tokens so
that a new prompt starting with the same tokens (a shared system prompt, a repeated question, a chat's
earlier turns) prefills only the rest.

A block is found by its tokens and its parent block (the chain from the prompt's start), compared exactly,
so a hit is the same tokens at the same positions. What is reused is bit for bit what a cold prefill
computes (models/lean_prefill.py: a prompt's keys and values depend on its own tokens only; tested), so
prefix caching changes speed, not results. Least recently used blocks go first once the cache holds
`max_bytes`; a prompt's last token is always prefilled (its logits are the first token's).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

BLOCK = 16   # tokens per cached block (vLLM's default block size)
DEFAULT_GIB = 1.0   # memory for cached blocks by default (`grpolab serve --prefix-cache-gib`; 0: off)


class PrefixCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.blocks: OrderedDict[tuple[int, tuple[int, ...]], tuple[int, torch.Tensor]] = OrderedDict()
        self._ids = 0
        self.hits = self.queries = 0   # prompt tokens served from the cache / asked for (metrics)

    def lookup(self, prompt: list[int]) -> torch.Tensor | None:
        """The cached keys and values (layers, 2 KV, p, D) of the longest cached run of whole blocks at the
        start of `prompt` (p a multiple of BLOCK, p < len(prompt)), or None."""
        parent, parts = 0, []
        self.queries += len(prompt)
        for start in range(0, len(prompt) - BLOCK, BLOCK):
            key = (parent, tuple(prompt[start:start + BLOCK]))
            found = self.blocks.get(key)
            if found is None:
                break
            self.blocks.move_to_end(key)
            parent, kv = found
            parts.append(kv)
        if not parts:
            return None
        self.hits += len(parts) * BLOCK
        return torch.cat(parts, dim=2)

    def store(self, prompt: list[int], kv: torch.Tensor) -> None:
        """Keep the whole blocks of `prompt` whose keys and values `kv` (layers, 2 KV, len(prompt), D) holds."""
        parent = 0
        for start in range(0, len(prompt) - BLOCK + 1, BLOCK):
            key = (parent, tuple(prompt[start:start + BLOCK]))
            found = self.blocks.get(key)
            if found is None:
                block = kv[:, :, start:start + BLOCK].clone()
                size = block.numel() * block.element_size()
                if size > self.max_bytes:
                    return
                while self.bytes + size > self.max_bytes:
                    _, (_, old) = self.blocks.popitem(last=False)
                    self.bytes -= old.numel() * old.element_size()
                self._ids += 1
                found = (self._ids, block)
                self.blocks[key] = found
                self.bytes += size
            else:
                self.blocks.move_to_end(key)
            parent = found[0]
