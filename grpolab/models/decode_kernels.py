"""Fused kernels for a decode step on CUDA (Triton), each with the torch computation it replaces.

A decode step of a small model is hundreds of kernels that each do microseconds of work; inside a CUDA
graph the launch is cheap but every kernel still costs its few microseconds, so the step's time is
their count. These fuse what torch runs as several kernels per layer:
- `rms_norm`: the RMSNorm (in float32 and cast back, then its weight, as Hugging Face's; or the built-in
  GPT's parameter-free one) of each row in one pass, one program per row;
- `rope_store`: the rotation of the new token's queries and keys at each row's position, the queries
  to a buffer, the keys and values straight into the slot cache at the row's length;
- `silu_mul`: silu(gate) * up of a gated MLP.
Every program reads one row alone, in an order fixed by the shapes of that row, so a row's result does
not depend on its batch. Off CUDA (or without Triton) the torch versions run; the tests hold the
kernels to them under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import rotate
from .decode_attention import kernel_available, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _rms_kernel(X, W, Y, C, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        c = tl.arange(0, BLOCK)
        ok = c < C
        x = tl.load(X + r * C + c, mask=ok, other=0.0).to(tl.float32)
        y = x * tl.rsqrt(tl.sum(x * x, axis=0) / C + eps)
        y = y.to(Y.dtype.element_ty)
        if HAS_W:   # the weight times the normed row in the model's dtype, as HF multiplies them
            y = (tl.load(W + c, mask=ok, other=0.0).to(tl.float32) * y.to(tl.float32)).to(Y.dtype.element_ty)
        tl.store(Y + r * C + c, y, mask=ok)

    @triton.jit
    def _rope_store_kernel(QKV, COS, SIN, LENS, QOUT, KC, VC, stride_cr, stride_ct, H: tl.constexpr,
                           KV: tl.constexpr, D: tl.constexpr):
        r = tl.program_id(0)
        h = tl.program_id(1)   # [0, H) query heads, [H, H + KV) key heads, [H + KV, H + 2KV) value heads
        d = tl.arange(0, D)
        row = QKV + r * (H + 2 * KV) * D + h * D
        pos = tl.load(LENS + r)
        x = tl.load(row + d)
        if h < H + KV:
            rolled = tl.load(row + (d + D // 2) % D).to(tl.float32)
            cos = tl.load(COS + pos * D + d).to(tl.float32)
            sin = tl.load(SIN + pos * D + d).to(tl.float32)
            # (x * cos) in the model's dtype, then + rolled * sin: torch.addcmul's rounding
            a = (x.to(tl.float32) * cos).to(x.dtype).to(tl.float32)
            x = (a + rolled * sin).to(x.dtype)
        at = r.to(tl.int64) * stride_cr + pos.to(tl.int64) * stride_ct
        if h < H:
            tl.store(QOUT + (r * H + h) * D + d, x)
        elif h < H + KV:
            tl.store(KC + at + (h - H) * D + d, x)
        else:
            tl.store(VC + at + (h - H - KV) * D + d, x)

    @triton.jit
    def _silu_mul_kernel(GU, Y, N, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = c < N
        g = tl.load(GU + r * 2 * N + c, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(GU + r * 2 * N + N + c, mask=ok, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32)   # F.silu, rounded as torch does
        tl.store(Y + r * N + c, (s * u).to(Y.dtype.element_ty), mask=ok)


def _use_kernel(x: torch.Tensor, force: bool) -> bool:
    return force or kernel_available(x.device)


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float | None, upcast: bool,
             force_kernel: bool = False) -> torch.Tensor:
    """Each row of x (N, C) RMS-normed: in float32 and cast back when `upcast` (HF), else in x's dtype (the
    GPT's); then times `w` if given. eps None: torch's default (the dtype's machine epsilon)."""
    if not _use_kernel(x, force_kernel):
        y = F.rms_norm(x.float() if upcast else x, (x.size(-1),), eps=eps).to(x.dtype)
        return y if w is None else w * y
    N, C = x.shape
    eps = torch.finfo(torch.float32 if upcast else x.dtype).eps if eps is None else eps
    y = torch.empty_like(x)
    _rms_kernel[(N,)](x, x if w is None else w, y, C, eps, HAS_W=w is not None, BLOCK=triton.next_power_of_2(C))
    return y


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lens: torch.Tensor, kc: torch.Tensor,
               vc: torch.Tensor, H: int, KV: int, force_kernel: bool = False) -> torch.Tensor:
    """qkv (b, (H + 2KV) * D) of one new token per row: queries and keys rotated at position lens[r]
    (cos, sin (positions, D)), keys and values written to kc, vc (rows, T, KV, D) at [r, lens[r]].
    Returns the queries (b, H, D)."""
    b = qkv.size(0)
    D = kc.size(-1)
    if not _use_kernel(qkv, force_kernel) or D & (D - 1):
        x = qkv.view(b, H + 2 * KV, D)
        c, s = cos[lens][:, None], sin[lens][:, None]
        q, k = rotate(x[:, :H], c, s), rotate(x[:, H:H + KV], c, s)
        at = torch.arange(b, device=qkv.device) * kc.size(1) + lens
        kc.view(-1, KV, D).index_copy_(0, at, k)
        vc.view(-1, KV, D).index_copy_(0, at, x[:, H + KV:])
        return q
    q = torch.empty(b, H, D, dtype=qkv.dtype, device=qkv.device)
    _rope_store_kernel[(b, H + 2 * KV)](qkv, cos, sin, lens, q, kc, vc, kc.stride(0), kc.stride(1), H=H, KV=KV,
                                        D=D)
    return q


def silu_mul(gu: torch.Tensor, force_kernel: bool = False) -> torch.Tensor:
    """silu(gate) * up for gu (N, 2I) = [gate | up]."""
    if not _use_kernel(gu, force_kernel):
        gate, up = gu.chunk(2, dim=-1)
        return F.silu(gate) * up
    N, I2 = gu.shape
    y = torch.empty(N, I2 // 2, dtype=gu.dtype, device=gu.device)
    BLOCK = 1024
    _silu_mul_kernel[(N, triton.cdiv(I2 // 2, BLOCK))](gu, y, I2 // 2, BLOCK=BLOCK)
    return y
