"""The Triton kernel of ``rope_``: a row's RoPE rotation in one pass.

The PyTorch path gathers the row's cos and sin, multiplies and accumulates in four fp32 passes and
copies both parts back: about eight launches per projection, which at the small presets' sizes
cost the host more than the GPU. Here one program rotates one row (every head) in place, in fp32,
rounding once to the tensor's dtype as the PyTorch path does.

Imported lazily (``swa_bench.kernels.rope``), as ``triton_mqa`` is.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rope_kernel(X, POS, COS, SIN, stride_t, stride_h, heads, first, half,
                BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, INVERSE: tl.constexpr):
    """Features ``first + 2i`` (a) and ``first + 2i + 1`` (b), ``i < half``, of every head of row
    t become ``a cos - b sin`` and ``a sin + b cos`` at the row's position (DeepSeek-V4.1's
    complex product ``(a + ib) e^{i angle}``); ``INVERSE``: the conjugate, ``sin`` negated.
    Each head's rotated features are read and written as one contiguous run (split into their
    pairs in registers), not as two strided halves."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    f = tl.arange(0, 2 * BLOCK_HALF)
    jm = j < half
    mask = (h[:, None] < heads) & (f < 2 * half)[None, :]
    pos = tl.load(POS + t).to(tl.int64)
    cos = tl.load(COS + pos * half + j, mask=jm, other=0.0)[None, :]
    sin = tl.load(SIN + pos * half + j, mask=jm, other=0.0)[None, :]
    if INVERSE:
        sin = -sin
    at = X + t * stride_t + h[:, None] * stride_h + first + f[None, :]
    x = tl.load(at, mask=mask, other=0.0)
    a, b = tl.split(tl.reshape(x.to(tl.float32), (BLOCK_H, BLOCK_HALF, 2)))
    turned = tl.join(a * cos - b * sin, a * sin + b * cos)
    tl.store(at, tl.reshape(turned, (BLOCK_H, 2 * BLOCK_HALF)).to(x.dtype), mask=mask)
