"""The Triton kernel of ``fp32_linear``: ``x @ w^T`` of bf16 operands with fp32 sums, as the fp32
GEMM of the promoted operands computes them.

Products of two bf16 values are exact in fp32; a tensor-core accumulator, though, truncates its
sums, so one carried over all of K drifts by an ulp an instruction (cuBLAS's bf16 GEMM with an
fp32 output: 3.5e-5 at K = 5120, 10x the fp32 GEMM's 3e-6 on an H200). Each ``BLOCK_K`` step here
sums in a fresh accumulator and the steps add in round-to-nearest fp32. Fixed tiles, no split-K:
a row's sums keep one order whatever the batch.

Imported lazily (``swa_bench.kernels.linear``), as ``triton_mqa`` is.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def fp32_sum_gemm_kernel(x, w, y, M, N, K, stride_x, stride_w, stride_y,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``y [M, N] = x [M, K] @ w [N, K]^T`` (bf16 in, fp32 out), one output tile a program."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = m < M, n < N
    xs = x + m.to(tl.int64)[:, None] * stride_x + k[None, :]
    ws = w + n.to(tl.int64)[:, None] * stride_w + k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + k) < K
        a = tl.load(xs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(ws + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        # add_rn: an opaque round-to-nearest add, which Triton cannot fold into the dot's
        # (truncating) accumulator as it folds a plain ``acc + dot``.
        acc = libdevice.add_rn(acc, tl.dot(a, tl.trans(b)))
    tl.store(y + m.to(tl.int64)[:, None] * stride_y + n[None, :], acc,
             mask=m_ok[:, None] & n_ok[None, :])
