"""The Triton kernel of ``norm_latents``: a row's two latents normed, and the K=V one rotated.

The PyTorch path launches a norm per latent, a copy of the K=V latent and the RoPE on it (with
the two projections, eight launches a layer, more host time than GPU time on a small step). Here
one program holds a row of both latents: fp32 statistics, the norm's weight, a rounding to the
dtype, then the rotation of the last ``2 half`` features (adjacent pairs, DeepSeek-V4.1's
layout) from the rounded values, in fp32, rounded once more, as ``model.apply_rope`` does.

Imported lazily (``swa_bench.kernels.latents``), as ``triton_mqa`` is.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _normed(H, W, row, first, cols, n, rstd):
    """Features ``first + cols`` of row ``row`` times the row's ``rstd`` and the weight, fp32."""
    mask = cols < n
    x = tl.load(H + row + first + cols, mask=mask, other=0.0).to(tl.float32)
    return x * rstd * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _rstd(H, row, first, n, eps, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    x = tl.load(H + row + first + cols, mask=cols < n, other=0.0).to(tl.float32)
    return 1.0 / tl.sqrt(tl.sum(x * x, 0) / n + eps)


@triton.jit
def latents_kernel(H, QW, KVW, POS, COS, SIN, Q, KV, LAT, stride_h, stride_q, stride_kv,
                   q_dim, kv_dim, rope_first, half, q_eps, kv_eps, BLOCK_Q: tl.constexpr,
                   BLOCK_KV: tl.constexpr, BLOCK_HALF: tl.constexpr, ROPE: tl.constexpr,
                   LATENT: tl.constexpr):
    """Row t: ``Q = norm(h[:q_dim])``; ``KV = rope(norm(h[q_dim:]))`` turning each pair of
    features ``rope_first + 2i`` (a) and ``rope_first + 2i + 1`` (b) at the row's position;
    ``LATENT``: ``LAT = norm(h[q_dim:])`` too."""
    t = tl.program_id(0).to(tl.int64)
    row = t * stride_h
    dtype = Q.dtype.element_ty
    cq = tl.arange(0, BLOCK_Q)
    rq = _rstd(H, row, 0, q_dim, q_eps, BLOCK_Q)
    tl.store(Q + t * stride_q + cq, _normed(H, QW, row, 0, cq, q_dim, rq).to(dtype),
             mask=cq < q_dim)
    ck = tl.arange(0, BLOCK_KV)
    rk = _rstd(H, row, q_dim, kv_dim, kv_eps, BLOCK_KV)
    latent = _normed(H, KVW, row, q_dim, ck, kv_dim, rk).to(dtype)
    if LATENT:
        tl.store(LAT + t * stride_kv + ck, latent, mask=ck < kv_dim)
    tl.store(KV + t * stride_kv + ck, latent, mask=ck < rope_first)
    if ROPE:
        j = tl.arange(0, BLOCK_HALF)
        jm = j < half
        a = _normed(H, KVW, row, q_dim, rope_first + 2 * j, kv_dim, rk)
        b = _normed(H, KVW, row, q_dim, rope_first + 2 * j + 1, kv_dim, rk)
        a = a.to(dtype).to(tl.float32)
        b = b.to(dtype).to(tl.float32)
        pos = tl.load(POS + t).to(tl.int64)
        cos = tl.load(COS + pos * half + j, mask=jm, other=0.0)
        sin = tl.load(SIN + pos * half + j, mask=jm, other=0.0)
        out = KV + t * stride_kv + rope_first + 2 * j
        tl.store(out, (a * cos - b * sin).to(dtype), mask=jm)
        tl.store(out + 1, (a * sin + b * cos).to(dtype), mask=jm)
