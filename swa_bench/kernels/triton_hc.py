"""The Triton kernels of mHC (DeepSeek-V4.1 inference/model.py `Block.hc_pre`, `Block.hc_post`;
kernel_cpu.py `hc_split_sinkhorn`).

``hc_split_sinkhorn_kernel``: a block of rows' coefficients from their mixes, the 20 Sinkhorn
rounds of each row's ``hc x hc`` matrix in registers (the PyTorch path launches some 80 small
kernels a sublayer for them). ``hc_pre_kernel`` / ``hc_post_kernel``: the stream sums, every
stream read once and every output written once, accumulated in fp32 in the PyTorch path's order
(first term times its gain, then each further product added) and rounded once.

Imported lazily (``swa_bench.kernels.hyper_connection``), as ``triton_mqa`` is.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _load(ptr, row, stride, cols, mask):
    return tl.load(ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def hc_split_sinkhorn_kernel(mixes, scale, base, pre, post, comb, rows, stride_m, eps,
                             HC: tl.constexpr, HC_PAD: tl.constexpr, ITERS: tl.constexpr,
                             BLOCK_R: tl.constexpr):
    """``mixes [T, (2 + HC) HC]`` fp32 -> ``pre``, ``post [T, HC]`` and ``comb [T, HC, HC]``
    (contiguous fp32): ``pre = sigmoid(m * scale0 + base) + eps``, ``post = 2 sigmoid(m * scale1
    + base)``, ``comb`` a softmax over its last axis plus ``eps``, normalised over its first axis,
    then ``ITERS - 1`` rounds of last-axis then first-axis normalisation, ``eps`` added to every
    sum. Padded lanes (``HC_PAD > HC``) hold zeros and add nothing to a sum."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < rows
    at = r.to(tl.int64) * stride_m
    out_at = r.to(tl.int64) * HC
    h = tl.arange(0, HC_PAD)
    h_ok = h < HC
    m2 = r_ok[:, None] & h_ok[None, :]
    x = tl.load(mixes + at[:, None] + h[None, :], mask=m2, other=0.0)
    bias = tl.load(base + h, mask=h_ok, other=0.0)
    tl.store(pre + out_at[:, None] + h[None, :],
             _sigmoid(x * tl.load(scale) + bias[None, :]) + eps, mask=m2)
    x = tl.load(mixes + at[:, None] + HC + h[None, :], mask=m2, other=0.0)
    bias = tl.load(base + HC + h, mask=h_ok, other=0.0)
    tl.store(post + out_at[:, None] + h[None, :],
             2.0 * _sigmoid(x * tl.load(scale + 1) + bias[None, :]), mask=m2)
    j = h[None, :, None]  # the first axis: a residual stream
    i = h[None, None, :]  # the last axis: a new stream
    cell_ok = (j < HC) & (i < HC)
    m3 = r_ok[:, None, None] & cell_ok
    cell = j * HC + i
    logits = (tl.load(mixes + at[:, None, None] + 2 * HC + cell, mask=m3, other=0.0)
              * tl.load(scale + 2) + tl.load(base + 2 * HC + cell, mask=cell_ok, other=0.0))
    logits = tl.where(cell_ok, logits, -1e30)  # finite: a padded axis holds no NaN
    e = tl.where(cell_ok, tl.exp(logits - tl.max(logits, 2)[:, :, None]), 0.0)
    den = tl.sum(e, 2)[:, :, None]
    c = tl.where(cell_ok, e / tl.where(den > 0, den, 1.0) + eps, 0.0)
    c = c / (tl.sum(c, 1)[:, None, :] + eps)
    for _ in range(ITERS - 1):
        c = c / (tl.sum(c, 2)[:, :, None] + eps)
        c = c / (tl.sum(c, 1)[:, None, :] + eps)
    tl.store(comb + out_at[:, None, None] * HC + cell, c, mask=m3)


@triton.jit
def hc_pre_kernel(s0, s1, s2, s3, gains, y, stride_s, stride_g, stride_y, D,
                  HC: tl.constexpr, BLOCK_D: tl.constexpr):
    """``y[r] = sum_j gains[r, j] * s_j[r]`` (``gains`` fp32 ``[T, >= HC]``)."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    g = gains + row * stride_g
    acc = _load(s0, row, stride_s, cols, mask) * tl.load(g)
    if HC > 1:
        acc += _load(s1, row, stride_s, cols, mask) * tl.load(g + 1)
    if HC > 2:
        acc += _load(s2, row, stride_s, cols, mask) * tl.load(g + 2)
    if HC > 3:
        acc += _load(s3, row, stride_s, cols, mask) * tl.load(g + 3)
    tl.store(y + row * stride_y + cols, acc.to(y.dtype.element_ty), mask=mask)


@triton.jit
def _post_one(o, x0, x1, x2, x3, gain, c, i: tl.constexpr, HC: tl.constexpr):
    """New stream ``i``: ``gain * o + sum_j c[j, i] * x_j`` in this order (``c``: the row's
    ``comb``, ``[HC, HC]`` contiguous)."""
    acc = o * gain
    acc += x0 * tl.load(c + i)
    if HC > 1:
        acc += x1 * tl.load(c + HC + i)
    if HC > 2:
        acc += x2 * tl.load(c + 2 * HC + i)
    if HC > 3:
        acc += x3 * tl.load(c + 3 * HC + i)
    return acc


@triton.jit
def hc_post_kernel(out, s0, s1, s2, s3, post, comb, y0, y1, y2, y3,
                   stride_o, stride_s, stride_p, stride_y, D,
                   HC: tl.constexpr, BLOCK_D: tl.constexpr):
    """``y_i[r] = post[r, i] * out[r] + sum_j comb[r, j, i] * s_j[r]`` for each of the ``HC``
    outputs (``post`` fp32 ``[T, >= HC]``, ``comb`` fp32 ``[T, HC, HC]`` contiguous)."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    o = _load(out, row, stride_o, cols, mask)
    x0 = _load(s0, row, stride_s, cols, mask)
    x1 = _load(s1, row, stride_s, cols, mask) if HC > 1 else x0
    x2 = _load(s2, row, stride_s, cols, mask) if HC > 2 else x0
    x3 = _load(s3, row, stride_s, cols, mask) if HC > 3 else x0
    p = post + row * stride_p
    c = comb + row.to(tl.int64) * HC * HC
    at = row * stride_y + cols
    dtype = y0.dtype.element_ty
    tl.store(y0 + at, _post_one(o, x0, x1, x2, x3, tl.load(p), c, 0, HC).to(dtype), mask=mask)
    if HC > 1:
        tl.store(y1 + at, _post_one(o, x0, x1, x2, x3, tl.load(p + 1), c, 1, HC).to(dtype),
                 mask=mask)
    if HC > 2:
        tl.store(y2 + at, _post_one(o, x0, x1, x2, x3, tl.load(p + 2), c, 2, HC).to(dtype),
                 mask=mask)
    if HC > 3:
        tl.store(y3 + at, _post_one(o, x0, x1, x2, x3, tl.load(p + 3), c, 3, HC).to(dtype),
                 mask=mask)


@triton.jit
def _bf16_dot(x, part, acc, INTERPRET: tl.constexpr):
    """``acc + x @ part^T`` of bf16 tiles, fp32 sums. The interpreter's bf16 dot is wrong and
    its fp32 dot (numpy's matmul) sums a row in an order that depends on the row's place in the
    tile: the same exact products summed per row there, whatever the other rows."""
    if INTERPRET:
        products = x.to(tl.float32)[:, None, :] * part.to(tl.float32)[None, :, :]
        return acc + tl.sum(products, 2)
    return tl.dot(x, tl.trans(part), acc)


@triton.jit
def _split_dot(x, w, acc, SPLIT: tl.constexpr, INTERPRET: tl.constexpr):
    """``acc + x @ w^T`` for ``x`` (the streams' dtype) and fp32 ``w``, as the fp32 GEMM of the
    exact fp32 values. ``SPLIT`` (bf16 ``x``): ``w`` as the sum of three bf16 parts (``hi =
    bf16(w)``, ``mid = bf16(w - hi)``, ``lo = bf16(w - hi - mid)``: 24 mantissa bits, ``w``
    itself for every normal fp32 value), each a tensor-core dot whose products of bf16 values
    are exact in fp32 and whose sums run in fp32, smallest part first; else one full-precision
    fp32 dot (fp32 streams, whose values bf16 parts would not hold)."""
    if SPLIT:
        hi = w.to(tl.bfloat16)
        rest = w - hi.to(tl.float32)
        mid = rest.to(tl.bfloat16)
        lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
        step = _bf16_dot(x, lo, tl.zeros_like(acc), INTERPRET)
        step = _bf16_dot(x, mid, step, INTERPRET)
        # A tensor-core accumulator truncates its sums: one summed over the whole row would
        # drift by an ulp an instruction (2e-4 at V4.1-Flash's 20480 columns, 8x the fp32
        # GEMM's error). It sums one column step; the steps add in round-to-nearest fp32
        # (``add_rn``: opaque, so Triton cannot fold it into the dot's accumulator).
        step = _bf16_dot(x, hi, step, INTERPRET)
        return acc + step if INTERPRET else libdevice.add_rn(acc, step)
    return tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")


@triton.jit
def _project_stream(s, j: tl.constexpr, base, r_ok, cols, D, fn, stride_f, o, OUT: tl.constexpr,
                    acc, sq, SPLIT: tl.constexpr, INTERPRET: tl.constexpr):
    """One stream's column step of the projection: its tile's fp32 squares into ``sq`` and its
    product with ``fn``'s columns ``j * D + cols`` into ``acc``."""
    col_ok = cols < D
    x = tl.load(s + base[:, None] + cols[None, :], mask=r_ok[:, None] & col_ok[None, :],
                other=0.0)
    w = tl.load(fn + o[:, None] * stride_f + (j * D + cols)[None, :],
                mask=(o[:, None] < OUT) & col_ok[None, :], other=0.0)
    xf = x.to(tl.float32)
    return _split_dot(x, w, acc, SPLIT, INTERPRET), sq + xf * xf


@triton.jit
def hc_project_kernel(s0, s1, s2, s3, fn, mixes, rows, stride_s, stride_f, stride_m, eps,
                      D: tl.constexpr, HC: tl.constexpr, OUT: tl.constexpr,
                      OUT_PAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                      SPLIT: tl.constexpr, INTERPRET: tl.constexpr):
    """``mixes[r] = (flat[r] @ fn^T) * rsqrt(mean(flat[r]^2) + eps)`` for a block of rows,
    ``flat[r]`` the fp32 concatenation of the ``HC`` streams' rows (never materialised): one
    read of the streams gives the squares and the product (fp32 sums, the reference's fp32
    GEMM: ``_split_dot``); the block shares each load of ``fn [OUT, HC * D]`` fp32. A row's
    sums run over the columns in ``BLOCK_D`` steps whichever rows share its block:
    batch-invariant."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < rows
    base = r.to(tl.int64) * stride_s
    offs = tl.arange(0, BLOCK_D)
    o = tl.arange(0, OUT_PAD)
    acc = tl.zeros([BLOCK_R, OUT_PAD], tl.float32)
    sq = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for c0 in range(0, D, BLOCK_D):
        acc, sq = _project_stream(s0, 0, base, r_ok, c0 + offs, D, fn, stride_f, o, OUT, acc, sq,
                                  SPLIT, INTERPRET)
        if HC > 1:
            acc, sq = _project_stream(s1, 1, base, r_ok, c0 + offs, D, fn, stride_f, o, OUT,
                                      acc, sq, SPLIT, INTERPRET)
        if HC > 2:
            acc, sq = _project_stream(s2, 2, base, r_ok, c0 + offs, D, fn, stride_f, o, OUT,
                                      acc, sq, SPLIT, INTERPRET)
        if HC > 3:
            acc, sq = _project_stream(s3, 3, base, r_ok, c0 + offs, D, fn, stride_f, o, OUT,
                                      acc, sq, SPLIT, INTERPRET)
    rsqrt = 1.0 / tl.sqrt(tl.sum(sq, 1) / (HC * D) + eps)
    tl.store(mixes + r.to(tl.int64)[:, None] * stride_m + o[None, :], acc * rsqrt[:, None],
             mask=r_ok[:, None] & (o < OUT)[None, :])
