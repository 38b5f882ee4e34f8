"""The Triton kernels of the routed experts' elementwise steps: the SwiGLU between the two
grouped GEMMs, and the combine that returns each (token, expert) output to its token.

The PyTorch path makes a pass per operation over ``[tokens x k, dim]`` tensors (at V4.1-Flash's
64K tokens, 4 GB each): ``silu``, the product, the routing-weight product, a zero fill, the
``index_copy`` back to token order, the fp32 sum over the k experts and the cast. Here the SwiGLU
reads ``h`` once and writes once; the combine reads each of a token's k rows once (through the
inverse of the sort) and writes the token's row once. Both round where the PyTorch path rounds
(to the model dtype after ``silu``, after each product) and sum in fp32 in expert-slot order.

Imported lazily (``swa_bench.kernels.moe``), as ``triton_mqa`` is.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def silu_mul_kernel(H, A, inter, stride_h, stride_a, BLOCK: tl.constexpr):
    """``a[r] = silu(h[r, :inter]) * h[r, inter:]`` (``silu`` rounded to the dtype first)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(H + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(H + row * stride_h + inter + cols, mask=mask, other=0.0)
    s = (g / (1.0 + tl.exp(-g))).to(u.dtype)
    tl.store(A + row * stride_a + cols, (s.to(tl.float32) * u.to(tl.float32)).to(u.dtype),
             mask=mask)


@triton.jit
def combine_kernel(Y, SLOT, W, Out, dim, stride_y, stride_w, stride_o,
                   K: tl.constexpr, BLOCK: tl.constexpr):
    """``out[t] = sum_j round(y[slot[t, j]] * round(w[t, j]))`` in fp32, rounded once: ``slot``
    maps a token's j-th expert to its row of the expert-sorted ``y``."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < dim
    acc = tl.zeros([BLOCK], tl.float32)
    for j in range(K):
        row = tl.load(SLOT + t * K + j).to(tl.int64)
        y = tl.load(Y + row * stride_y + cols, mask=mask, other=0.0)
        w = tl.load(W + t * stride_w + j).to(y.dtype).to(tl.float32)
        acc += (y.to(tl.float32) * w).to(y.dtype).to(tl.float32)
    tl.store(Out + t * stride_o + cols, acc.to(Out.dtype.element_ty), mask=mask)
