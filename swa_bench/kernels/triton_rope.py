"""The Triton kernel of ``rope_``: a row's RoPE rotation in one pass.

The PyTorch path gathers the row's cos and sin, multiplies and accumulates in four fp32 passes and
copies both halves back: about eight launches per projection, which at the small presets' sizes
cost the host more than the GPU. Here one program rotates one row (every head) in place, in fp32,
rounding once to the tensor's dtype as the PyTorch path does.

Imported lazily (``swa_bench.kernels.rope``), as ``triton_mqa`` is.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rope_kernel(X, POS, COS, SIN, stride_t, stride_h, heads, first, half,
                BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Features ``[first, first + half)`` (a) and ``[first + half, first + 2 half)`` (b) of
    every head of row t become ``a cos - b sin`` and ``a sin + b cos`` at the row's position."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    jm = j < half
    mask = (h[:, None] < heads) & jm[None, :]
    pos = tl.load(POS + t).to(tl.int64)
    cos = tl.load(COS + pos * half + j, mask=jm, other=0.0)[None, :]
    sin = tl.load(SIN + pos * half + j, mask=jm, other=0.0)[None, :]
    at = X + t * stride_t + h[:, None] * stride_h + first + j[None, :]
    a = tl.load(at, mask=mask, other=0.0)
    b = tl.load(at + half, mask=mask, other=0.0)
    af, bf = a.to(tl.float32), b.to(tl.float32)
    tl.store(at, (af * cos - bf * sin).to(a.dtype), mask=mask)
    tl.store(at + half, (af * sin + bf * cos).to(a.dtype), mask=mask)
