"""`sampling.sample_next`'s keyed draw without a top-k/top-p filter, for large vocabularies on CUDA.

On a GPU, `sample_next` over (128, 152k) float32 logits is a softmax, an exponential, a full-size reduction
and copies: about 0.25 ms of a 1.5B model's 3 ms decode step (bench/results/gpu_h200_run3_profile.jsonl).
Here two Triton kernels read the logits instead: one program per row computes the row's log-sum-exp
(an online max and sum in float32), then one per row and range of blocks the probability mass of each
block of `sampling.BLOCK` tokens; the rest is `sampling.invert_blocks`, as `draw` does it, over
(rows, blocks) and one block. Each program reads its own row in a fixed order, so a row's token does
not depend on its batch. The function is `sample_next`'s, the sums run in another order: tokens and
log-probs agree with it up to float32 rounding, not bit for bit (tests/test_slot_decode.py).
"""

from __future__ import annotations

import torch

from ..models.decode_attention import kernel_available, triton
from .sampling import BLOCK, invert_blocks

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _lse_kernel(X, OUT, V, stride, temperature, CHUNK: tl.constexpr):
        r = tl.program_id(0)
        c = tl.arange(0, CHUNK)
        m = tl.full((CHUNK,), float("-inf"), tl.float32)
        s = tl.zeros((CHUNK,), tl.float32)
        for start in range(0, V, CHUNK):
            x = tl.load(X + r.to(tl.int64) * stride + start + c, mask=start + c < V, other=float("-inf"))
            x = x.to(tl.float32) / temperature
            m_new = tl.maximum(m, x)
            live = m_new > float("-inf")
            s = tl.where(live, s * tl.exp(m - m_new) + tl.exp(x - m_new), 0.0)
            m = m_new
        top = tl.max(m, axis=0)
        total = tl.sum(tl.where(m > float("-inf"), s * tl.exp(m - top), 0.0), axis=0)
        tl.store(OUT + r, top + tl.log(total))

    @triton.jit
    def _block_mass_kernel(X, LSE, OUT, V, stride, n_blocks, temperature, PER: tl.constexpr, BLK: tl.constexpr):
        r = tl.program_id(0)
        b = tl.program_id(1) * PER + tl.arange(0, PER)
        c = b[:, None] * BLK + tl.arange(0, BLK)[None, :]
        x = tl.load(X + r.to(tl.int64) * stride + c, mask=c < V, other=float("-inf")).to(tl.float32) / temperature
        p = tl.exp(x - tl.load(LSE + r))
        tl.store(OUT + r * n_blocks + b, tl.sum(p, axis=1), mask=b < n_blocks)


def applies(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, keyed: bool) -> bool:
    """Whether `keyed_sample` replaces `sample_next` here: CUDA with Triton, a vocabulary past `draw`'s one
    level, sampling with keyed uniforms and no filter."""
    return (kernel_available(logits.device) and logits.size(-1) > 4 * BLOCK and keyed and temperature > 0
            and not top_k and top_p >= 1.0)


def keyed_sample(logits: torch.Tensor, temperature: float, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (B,), log-probs (B,)) of logits (B, V) at `temperature`, one keyed uniform per row (u (B, 1)
    float64): `sample_next(logits, temperature, 0, 1.0, None, u)`'s draw, by the Triton kernels (on a CPU
    only under TRITON_INTERPRET=1, as the tests run them)."""
    B, V = logits.shape
    logits = logits.contiguous()
    lse = torch.empty(B, dtype=torch.float32, device=logits.device)
    _lse_kernel[(B,)](logits, lse, V, logits.stride(0), float(temperature), CHUNK=2048)
    n_blocks = -(-V // BLOCK)
    mass = torch.empty(B, n_blocks, dtype=torch.float32, device=logits.device)
    PER = 16
    _block_mass_kernel[(B, triton.cdiv(n_blocks, PER))](logits, lse, mass, V, logits.stride(0), n_blocks,
                                                         float(temperature), PER=PER, BLK=BLOCK)

    def block_probs(idx: torch.Tensor) -> torch.Tensor:
        x = logits.gather(1, idx.clamp(max=V - 1)).float() / temperature
        return (x - lse[:, None]).exp().masked_fill_(idx >= V, 0.0)

    tok = invert_blocks(mass, block_probs, u.to(logits.device))
    lp = logits.gather(1, tok[:, None]).squeeze(1).float() / temperature - lse
    return tok, lp
