"""The Triton kernels of the batch-invariant mode on CUDA: a GEMM and a row reduction whose
result for a row is computed in one fixed order whatever the batch around it.

cuBLAS picks its kernel, and split-K, by the problem's shape, so a row's sums change with the
row count (measured on the H200: ``a[-M:] @ b.T`` differs from the last M rows of the
16384-row product at K=5120 -> N=1280 for M = 1, 8, 128); torch's CUDA reductions split a row
across threads or blocks by the number of rows. Here every output tile is one program, its K loop
runs in order with a fresh fp32 accumulator per product and no split, and the tile shape is a
constant of the dtype: a row's bits are a function of the row alone. Thinking Machines'
``batch_invariant_ops`` (a persistent matmul of one configuration) is the prior art.

Imported lazily (``swa_bench.kernels.batch_invariant``), as ``triton_mqa`` is.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M", "N", "K"])
def invariant_gemm_kernel(
    a, b, c, bias,
    M, N, K,
    stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn,
    stride_cb, stride_cm, stride_cn, stride_biasb, stride_biasm, stride_biasn,
    alpha, beta,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
):
    """``c[g] = alpha * a[g] @ b[g] + beta * bias[g]`` for batch entry ``g = program_id(2)``,
    one ``BLOCK_M x BLOCK_N`` tile a program; fp32 sums, rounded once to ``c``'s dtype. M, N and
    K are not specialised on (a value of 1 or a multiple of 16 would compile another kernel)."""
    g = tl.program_id(2).to(tl.int64)
    m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = m < M, n < N
    a_tile = a + g * stride_ab + m[:, None] * stride_am + k[None, :] * stride_ak
    b_tile = b + g * stride_bb + k[:, None] * stride_bk + n[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + k) < K
        x = tl.load(a_tile + k0 * stride_ak, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        y = tl.load(b_tile + k0 * stride_bk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if PRECISION == "interpret":  # the interpreter's bf16 dot is wrong: exact fp32 instead
            acc += tl.dot(x.to(tl.float32), y.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, y, input_precision=PRECISION)
    out = acc * alpha
    if HAS_BIAS:
        add = tl.load(bias + g * stride_biasb + m[:, None] * stride_biasm
                      + n[None, :] * stride_biasn, mask=m_ok[:, None] & n_ok[None, :], other=0.0)
        out += beta * add.to(tl.float32)
    tl.store(c + g * stride_cb + m[:, None] * stride_cm + n[None, :] * stride_cn,
             out.to(c.dtype.element_ty, fp_downcast_rounding="rtne"),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["R", "C"])
def invariant_row_sum_kernel(x, out, R, C, stride_r, divisor,
                             BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """``out[r] = sum(x[r, :C]) / divisor`` in fp32: ``BLOCK_C`` partial sums a row, accumulated
    over the columns in order, then summed in one fixed tree; ``BLOCK_R`` rows a program."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    r_ok = rows < R
    acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    for c0 in range(0, C, BLOCK_C):
        c_ok = (c0 + cols) < C
        acc += tl.load(x + rows[:, None] * stride_r + (c0 + cols)[None, :],
                       mask=r_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
    total = tl.sum(acc, 1) / divisor
    tl.store(out + rows, total.to(out.dtype.element_ty), mask=r_ok)
