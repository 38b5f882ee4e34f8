"""The Triton kernels of the mHC sums: every stream read once, every output written once.

The PyTorch path (``model.weighted_sum``) makes one pass per term and output: a ``post`` over four
streams reads 20 row-blocks and writes 16 in mixed-dtype kernels that do not vectorise (a quarter
of a V4.1-Flash prefill on an H200). Here one program owns a block of one row's columns: it loads
the sublayer output and the streams once, accumulates each output in fp32 in the PyTorch path's
order (first term times its gain, then each further term's product added), and rounds once.

Imported lazily (``swa_bench.kernels.hyper_connection``), as ``triton_mqa`` is.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load(ptr, row, stride, cols, mask):
    return tl.load(ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def hc_pre_kernel(s0, s1, s2, s3, gains, y, norm_w, stride_s, stride_g, stride_y, D, eps,
                  HC: tl.constexpr, BLOCK_D: tl.constexpr, NORM: tl.constexpr):
    """``y[r] = sum_j gains[r, j] * s_j[r]`` (``gains`` fp32 ``[T, >= HC]``). ``NORM`` (one
    program holds the whole row): ``y`` rounded, then RMS-normed with ``norm_w`` in fp32 and
    rounded again, as the sublayer's ``RMSNorm`` after the sum."""
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
    if NORM:
        x = acc.to(y.dtype.element_ty).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
        acc = x * rstd * tl.load(norm_w + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y + row * stride_y + cols, acc.to(y.dtype.element_ty), mask=mask)


@triton.jit
def _post_one(o, x0, x1, x2, x3, gain, mix, i: tl.constexpr, HC: tl.constexpr):
    """Output ``i`` of ``hc_post``: ``gain * o + sum_j mix[i, j] * x_j`` in this order (``gain``:
    a row's scalar, or a block's ``[rows, 1]``)."""
    acc = o * gain
    acc += x0 * tl.load(mix + i * HC)
    if HC > 1:
        acc += x1 * tl.load(mix + i * HC + 1)
    if HC > 2:
        acc += x2 * tl.load(mix + i * HC + 2)
    if HC > 3:
        acc += x3 * tl.load(mix + i * HC + 3)
    return acc


@triton.jit
def hc_post_kernel(out, s0, s1, s2, s3, post, mix, y0, y1, y2, y3,
                   stride_o, stride_s, stride_p, stride_y, D,
                   HC: tl.constexpr, BLOCK_D: tl.constexpr):
    """``y_i[r] = post[r, i] * out[r] + sum_j mix[i, j] * s_j[r]`` for each of the ``HC``
    outputs (``post`` fp32 ``[T, >= HC]``, ``mix`` fp32 ``[HC, HC]`` contiguous)."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    o = _load(out, row, stride_o, cols, mask)
    x0 = _load(s0, row, stride_s, cols, mask)
    x1 = _load(s1, row, stride_s, cols, mask) if HC > 1 else x0
    x2 = _load(s2, row, stride_s, cols, mask) if HC > 2 else x0
    x3 = _load(s3, row, stride_s, cols, mask) if HC > 3 else x0
    p = post + row * stride_p
    at = row * stride_y + cols
    dtype = y0.dtype.element_ty
    tl.store(y0 + at, _post_one(o, x0, x1, x2, x3, tl.load(p), mix, 0, HC).to(dtype), mask=mask)
    if HC > 1:
        tl.store(y1 + at, _post_one(o, x0, x1, x2, x3, tl.load(p + 1), mix, 1, HC).to(dtype),
                 mask=mask)
    if HC > 2:
        tl.store(y2 + at, _post_one(o, x0, x1, x2, x3, tl.load(p + 2), mix, 2, HC).to(dtype),
                 mask=mask)
    if HC > 3:
        tl.store(y3 + at, _post_one(o, x0, x1, x2, x3, tl.load(p + 3), mix, 3, HC).to(dtype),
                 mask=mask)


@triton.jit
def hc_gains_kernel(s0, s1, s2, s3, norm_w, dyn_w, static_pre, static_post, out, y, y_norm_w,
                    sub_out, post, mix, n0, n1, n2, n3, rows, stride_s, stride_w, stride_out,
                    stride_y, stride_o, stride_p, stride_n, eps, y_eps, D: tl.constexpr,
                    HC: tl.constexpr, OUT: tl.constexpr, OUT_PAD: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
                    GATES: tl.constexpr, PRE: tl.constexpr, NORM: tl.constexpr,
                    POST: tl.constexpr, PRECISION: tl.constexpr):
    """``out[r] = dynamic(rms_norm(cat(s_j[r])))`` for a block of ``BLOCK_R`` rows: the norm's
    statistics in fp32 over the ``HC`` streams (one pass), then the normed rows, rounded to the
    streams' dtype as the norm's output is, against the ``OUT`` rows of ``dyn_w [OUT, HC * D]``
    (a matrix product, fp32 sums, rounded to the dtype as the linear's output is). ``GATES``:
    then the mHC gates, ``sigmoid(g + static_pre)`` for the first ``HC`` outputs and ``2
    sigmoid(g + static_post)`` for the rest, in fp32.

    A block of rows shares each load of ``norm_w`` and ``dyn_w`` (a program per row read them
    once a row: at V4.1-Flash's width 360 KB, the kernel ran at a fifth of the streams' byte
    roofline). A row's sums run over the columns in ``BLOCK_D`` steps whichever rows share its
    block: batch-invariant.

    ``PRE`` (with ``GATES``): then ``hc_pre``'s sum with the pre gates, into ``y``, and with
    ``NORM`` the sublayer's RMSNorm (``y_norm_w``, ``y_eps``) of the rounded sum: the block
    writes its rounded sums, and after a barrier reads them back (through L2: this program's
    own writes) to scale them. One launch a sublayer instead of two.

    ``POST``: first the previous sublayer's ``hc_post``: the streams ``s_j`` are the old ones,
    ``n_j[r] = post[r, j] * sub_out[r] + sum_i mix[j, i] * s_i[r]`` (``hc_post_kernel``'s sums,
    rounded as it rounds) are written in ``BLOCK_P`` column steps (five tiles live at once: at
    ``BLOCK_D`` they spilled, 240 us a call at 104 rows on the H200), and after a barrier
    everything above reads ``n_j``: three launches between two sublayers become one."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < rows
    base = r.to(tl.int64) * stride_s
    offs = tl.arange(0, BLOCK_D)
    sq = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    if POST:
        base_o = r.to(tl.int64) * stride_o
        base_n = r.to(tl.int64) * stride_n
        p_row = post + r.to(tl.int64) * stride_p
        p0 = tl.load(p_row, mask=r_ok, other=0.0)
        p1 = p0
        p2 = p0
        p3 = p0
        if HC > 1:
            p1 = tl.load(p_row + 1, mask=r_ok, other=0.0)
        if HC > 2:
            p2 = tl.load(p_row + 2, mask=r_ok, other=0.0)
        if HC > 3:
            p3 = tl.load(p_row + 3, mask=r_ok, other=0.0)
        offs_p = tl.arange(0, BLOCK_P)  # narrower steps: five tiles live at once
        sq_p = tl.zeros([BLOCK_R, BLOCK_P], tl.float32)
        for q0 in range(0, D, BLOCK_P):
            post_mask = r_ok[:, None] & (q0 + offs_p < D)[None, :]
            sq_p = _post_tiles(sub_out, s0, s1, s2, s3, n0, n1, n2, n3, base, base_o, base_n,
                               q0 + offs_p, post_mask, p0, p1, p2, p3, mix, sq_p, HC)
        tl.debug_barrier()
        s0 = n0
        s1 = n1
        s2 = n2
        s3 = n3
        base = base_n
        squares = tl.sum(sq_p, 1)
    else:
        for c0 in range(0, D, BLOCK_D):
            mask = r_ok[:, None] & (c0 + offs < D)[None, :]
            x = _tile(s0, base, c0 + offs, mask)
            sq += x * x
            if HC > 1:
                x = _tile(s1, base, c0 + offs, mask)
                sq += x * x
            if HC > 2:
                x = _tile(s2, base, c0 + offs, mask)
                sq += x * x
            if HC > 3:
                x = _tile(s3, base, c0 + offs, mask)
                sq += x * x
        squares = tl.sum(sq, 1)
    rstd = 1.0 / tl.sqrt(squares / (HC * D) + eps)
    o = tl.arange(0, OUT_PAD)
    acc = tl.zeros([BLOCK_R, OUT_PAD], tl.float32)
    for c0 in range(0, D, BLOCK_D):
        acc = _gains_block(s0, 0, base, r_ok, c0 + offs, D, rstd, norm_w, dyn_w, stride_w, o,
                           OUT, acc, PRECISION)
        if HC > 1:
            acc = _gains_block(s1, 1, base, r_ok, c0 + offs, D, rstd, norm_w, dyn_w, stride_w,
                               o, OUT, acc, PRECISION)
        if HC > 2:
            acc = _gains_block(s2, 2, base, r_ok, c0 + offs, D, rstd, norm_w, dyn_w, stride_w,
                               o, OUT, acc, PRECISION)
        if HC > 3:
            acc = _gains_block(s3, 3, base, r_ok, c0 + offs, D, rstd, norm_w, dyn_w, stride_w,
                               o, OUT, acc, PRECISION)
    dtype = s0.dtype.element_ty
    gains = acc.to(dtype).to(tl.float32)
    if GATES:
        is_pre = o < HC
        bias = tl.where(is_pre, tl.load(static_pre + o, mask=is_pre, other=0.0).to(tl.float32),
                        tl.load(static_post + (o - HC), mask=(o >= HC) & (o < OUT),
                                other=0.0).to(tl.float32))
        gate = 1.0 / (1.0 + tl.exp(-(gains + bias[None, :])))
        gains = tl.where(is_pre[None, :], gate, 2.0 * gate)
    tl.store(out + r.to(tl.int64)[:, None] * stride_out + o[None, :], gains,
             mask=r_ok[:, None] & (o < OUT)[None, :])
    if PRE:  # loop variables named apart from the gains loops': Triton carries a name's type
        at = r.to(tl.int64)[:, None] * stride_y
        g0 = _column(gains, o, 0)
        g1 = _column(gains, o, 1)
        g2 = _column(gains, o, 2)
        g3 = _column(gains, o, 3)
        ssq = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        for p0 in range(0, D, BLOCK_D):
            pre_mask = r_ok[:, None] & (p0 + offs < D)[None, :]
            total = _tile(s0, base, p0 + offs, pre_mask) * g0[:, None]
            if HC > 1:
                total += _tile(s1, base, p0 + offs, pre_mask) * g1[:, None]
            if HC > 2:
                total += _tile(s2, base, p0 + offs, pre_mask) * g2[:, None]
            if HC > 3:
                total += _tile(s3, base, p0 + offs, pre_mask) * g3[:, None]
            summed = total.to(dtype)
            tl.store(y + at + (p0 + offs)[None, :], summed, mask=pre_mask)
            if NORM:
                summed_f = summed.to(tl.float32)
                ssq += summed_f * summed_f
        if NORM:
            tl.debug_barrier()
            y_rstd = 1.0 / tl.sqrt(tl.sum(ssq, 1) / D + y_eps)
            for n0 in range(0, D, BLOCK_D):
                n_ok = n0 + offs < D
                norm_mask = r_ok[:, None] & n_ok[None, :]
                back = tl.load(y + at + (n0 + offs)[None, :], mask=norm_mask, other=0.0,
                               cache_modifier=".cg").to(tl.float32)
                y_w = tl.load(y_norm_w + n0 + offs, mask=n_ok, other=0.0).to(tl.float32)
                tl.store(y + at + (n0 + offs)[None, :],
                         (back * y_rstd[:, None] * y_w[None, :]).to(dtype), mask=norm_mask)


@triton.jit
def _post_tiles(sub_out, s0, s1, s2, s3, n0, n1, n2, n3, base, base_o, base_n, cols, mask,
                p0, p1, p2, p3, mix, sq, HC: tl.constexpr):
    """A column step of ``hc_post`` for a block of rows: the new streams' tiles written, and
    their squares (rounded values) added to ``sq`` stream by stream, as the gains' statistics
    add them."""
    o = _tile(sub_out, base_o, cols, mask)
    x0 = _tile(s0, base, cols, mask)
    x1 = _tile(s1, base, cols, mask) if HC > 1 else x0
    x2 = _tile(s2, base, cols, mask) if HC > 2 else x0
    x3 = _tile(s3, base, cols, mask) if HC > 3 else x0
    at = base_n[:, None] + cols[None, :]
    sq = _post_stream(o, x0, x1, x2, x3, p0, mix, n0, at, mask, sq, 0, HC)
    if HC > 1:
        sq = _post_stream(o, x0, x1, x2, x3, p1, mix, n1, at, mask, sq, 1, HC)
    if HC > 2:
        sq = _post_stream(o, x0, x1, x2, x3, p2, mix, n2, at, mask, sq, 2, HC)
    if HC > 3:
        sq = _post_stream(o, x0, x1, x2, x3, p3, mix, n3, at, mask, sq, 3, HC)
    return sq


@triton.jit
def _post_stream(o, x0, x1, x2, x3, p, mix, n, at, mask, sq, i: tl.constexpr, HC: tl.constexpr):
    """New stream ``i``'s tile rounded and written to ``n``; its squares added to ``sq``."""
    v = _post_one(o, x0, x1, x2, x3, p[:, None], mix, i, HC).to(n.dtype.element_ty)
    tl.store(n + at, v, mask=mask)
    vf = v.to(tl.float32)
    return sq + vf * vf


@triton.jit
def _column(t, o, j: tl.constexpr):
    return tl.sum(tl.where(o[None, :] == j, t, 0.0), 1)


@triton.jit
def _tile(s, base, cols, mask):
    return tl.load(s + base[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _gains_block(s, j: tl.constexpr, base, r_ok, cols, D, rstd, norm_w, dyn_w, stride_w, o,
                 OUT: tl.constexpr, acc, PRECISION: tl.constexpr):
    col_ok = cols < D
    dtype = s.dtype.element_ty
    x = _tile(s, base, cols, r_ok[:, None] & col_ok[None, :])
    at = j * D + cols
    scale = tl.load(norm_w + at, mask=col_ok, other=0.0).to(tl.float32)
    normed = (x * rstd[:, None] * scale[None, :]).to(dtype)
    w = tl.load(dyn_w + o[:, None] * stride_w + at[None, :],
                mask=(o[:, None] < OUT) & col_ok[None, :], other=0.0)
    if PRECISION == "interpret":  # the interpreter's bf16 dot is wrong: exact fp32 instead
        return tl.dot(normed.to(tl.float32), tl.trans(w.to(tl.float32)), acc,
                      input_precision="ieee")
    return tl.dot(normed, tl.trans(w), acc, input_precision=PRECISION)
