"""Attention of one new token per row over a slotted KV cache, each row reading only its own length.

The cache is (rows, T, kv_heads, D), every row's tokens left-aligned from column 0, so a row's keys sit
in the same columns whatever else shares the batch. `decode_attention` on CUDA is a Triton kernel: one
program per (row, key/value head) walks that row's own keys in fixed blocks of `BLOCK`, for the query heads
of that group together (each key read once, the products on the tensor cores, float32 accumulators and
online softmax; a float32 model's products in full float32). The order of every sum is fixed by the row's
own length, so a row's output is the same bits in a batch of 1 or 500, next to short or long rows, in a
cache of any T (a cuBLAS or SDPA kernel picks its tiling, and so its rounding, from the whole batch's
shape). It reads no padding and launches once per layer, which a CUDA graph captures. Elsewhere (CPU, or
no Triton) the same function is computed with torch ops (`reference`), which the tests hold the kernel to.
"""

from __future__ import annotations

import torch

try:   # the GPU path only; CPU-only installs have no Triton
    import triton
    import triton.language as tl
except ImportError:   # pragma: no cover - depends on the install
    triton = None

BLOCK = 64   # keys per step of a row's walk


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v over each row's first `lens[r]` cached positions, in float32.
    q (b, H, D); k, v (b, T, KV, D) with H a multiple of KV (grouped-query heads); returns (b, H, D)."""
    b, H, D = q.shape
    T, KV = k.shape[1], k.shape[2]
    qf = q.float().view(b, KV, H // KV, D)
    s = torch.einsum("bgrd,btgd->bgrt", qf, k.float()) * scale
    real = torch.arange(T, device=q.device)[None, :] < lens[:, None]
    s = s.masked_fill(~real[:, None, None, :], float("-inf"))
    return torch.einsum("bgrt,btgd->bgrd", s.softmax(-1), v.float()).reshape(b, H, D).to(q.dtype)


if triton is not None:
    @triton.jit
    def _kernel(Q, K, V, Out, LENS, stride_kr, stride_kt, scale, GROUP: tl.constexpr, GP: tl.constexpr,
                KV: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        r = tl.program_id(0)
        g = tl.program_id(1)   # a key/value head: its GROUP query heads together, so its keys are read once
        H = GROUP * KV
        i = tl.arange(0, GP)
        d = tl.arange(0, DP)
        qm = (i < GROUP)[:, None] & (d < D)[None, :]
        at_q = (r * H + g * GROUP + i)[:, None] * D + d[None, :]
        q = tl.load(Q + at_q, mask=qm, other=0.0)                                   # (GP, DP)
        n_keys = tl.load(LENS + r)
        base = r.to(tl.int64) * stride_kr + g * D
        m = tl.full((GP,), float("-inf"), tl.float32)
        total = tl.zeros((GP,), tl.float32)
        acc = tl.zeros((GP, DP), tl.float32)
        for start in range(0, n_keys, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            ok = n < n_keys
            at = base + n[:, None].to(tl.int64) * stride_kt + d[None, :]
            km = ok[:, None] & (d < D)[None, :]
            k = tl.load(K + at, mask=km, other=0.0)                                 # (BLOCK_N, DP)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(ok[None, :], s * scale, float("-inf"))                    # (GP, BLOCK_N) float32
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            v = tl.load(V + at, mask=km, other=0.0)
            total = total * alpha + tl.sum(p, axis=1)
            if IEEE:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:   # the probabilities in the cache's dtype, as SDPA multiplies them with the values
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m = m_new
        tl.store(Out + at_q, (acc / total[:, None]).to(Out.dtype.element_ty), mask=qm)


def kernel_available(device: torch.device) -> bool:
    """Whether `decode_attention` runs the Triton kernel on `device`."""
    return triton is not None and device.type == "cuda"


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor, scale: float,
                     force_kernel: bool = False) -> torch.Tensor:
    """`reference`'s result, by the Triton kernel where it runs (`force_kernel`: also elsewhere, e.g. on
    CPU tensors under TRITON_INTERPRET=1, as the tests run it). Every row must have lens >= 1."""
    if not (force_kernel or kernel_available(q.device)):
        return reference(q, k, v, lens, scale)
    b, H, D = q.shape
    KV = k.size(2)
    q = q.contiguous()
    out = torch.empty_like(q)
    _kernel[(b, KV)](q, k, v, out, lens, k.stride(0), k.stride(1), scale, GROUP=H // KV,
                     GP=max(16, triton.next_power_of_2(H // KV)), KV=KV, D=D, DP=max(16, triton.next_power_of_2(D)),
                     BLOCK_N=BLOCK, IEEE=q.dtype == torch.float32)
    return out
