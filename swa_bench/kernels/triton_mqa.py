"""The Triton kernel of ``mqa_attention``: one program per (query row, slice of the output dim).

FlashMLA's layout for a shared K=V latent: the row's heads are the M dimension of every tile, so a
key block is loaded once for all heads. An online softmax in fp32 starts from the sink logit
(running max = sink, running sum = 1), which puts the sink in the denominator exactly and makes an
all-masked row come out as zeros. Keys are visited in a fixed order per row (source A's columns,
then B's, then C's range, in blocks of ``BLOCK_N``), so a row's result does not depend on which
other rows share the launch: the kernel is batch-invariant.

Imported lazily (``swa_bench.kernels.mqa``): ``TRITON_INTERPRET`` is read when ``triton.jit``
decorates, so tests can switch the interpreter on before the first use.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _online_block(q, k, v, valid, m_i, l_i, acc, scale_log2, PRECISION: tl.constexpr):
    p_dtype = v.dtype
    if PRECISION == "interpret":  # the interpreter's bf16 dot is wrong: exact fp32 instead
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * scale_log2
    else:
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if PRECISION == "interpret":
        pv = tl.dot(p.to(p_dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(p_dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _key_block(q, kv, rows, valid, offs_d, offs_v, m_i, l_i, acc, scale_log2, D: tl.constexpr,
               SAME_DV: tl.constexpr, PRECISION: tl.constexpr):
    """One block of keys at element offsets ``rows`` (``valid`` ones only) into the softmax."""
    k = tl.load(kv + rows[:, None] + offs_d[None, :],
                mask=valid[:, None] & (offs_d[None, :] < D), other=0.0)
    if SAME_DV:
        v = k
    else:
        v = tl.load(kv + rows[:, None] + offs_v[None, :],
                    mask=valid[:, None] & (offs_v[None, :] < D), other=0.0)
    return _online_block(q, k, v, valid, m_i, l_i, acc, scale_log2, PRECISION)


@triton.jit
def _gathered_source(q, kv, idx_row, WIDTH: tl.constexpr, stride_kv, offs_d, offs_v, m_i, l_i,
                     acc, scale_log2, D: tl.constexpr, BLOCK_N: tl.constexpr, SAME_DV: tl.constexpr,
                     PRECISION: tl.constexpr):
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(0, WIDTH, BLOCK_N):
        cols = n0 + offs_n
        idx = tl.load(idx_row + cols, mask=cols < WIDTH, other=-1)
        valid = idx >= 0
        rows = tl.where(valid, idx, 0).to(tl.int64) * stride_kv
        m_i, l_i, acc = _key_block(q, kv, rows, valid, offs_d, offs_v, m_i, l_i, acc, scale_log2,
                                   D, SAME_DV, PRECISION)
    return m_i, l_i, acc


@triton.jit
def _range_block(q, kv, start, n0, count, stride_kv, offs_d, offs_v, m_i, l_i, acc, scale_log2,
                 D: tl.constexpr, BLOCK_N: tl.constexpr, SAME_DV: tl.constexpr,
                 PRECISION: tl.constexpr):
    cols = n0 + tl.arange(0, BLOCK_N)
    valid = cols < count
    return _key_block(q, kv, (start + cols) * stride_kv, valid, offs_d, offs_v, m_i, l_i, acc,
                      scale_log2, D, SAME_DV, PRECISION)


@triton.jit
def mqa_attention_kernel(
    Q, Out, Sink,
    KVA, IDXA, KVB, IDXB, KVC, CSTART, CLEN,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kva, stride_ia, stride_kvb, stride_ib, stride_kvc,
    scale_log2,
    WIDTH_A: tl.constexpr, WIDTH_B: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_B: tl.constexpr, HAS_C: tl.constexpr, PRECISION: tl.constexpr,
):
    t = (tl.num_programs(0) - 1 - tl.program_id(0)).to(tl.int64)  # heaviest causal rows first
    dv = tl.program_id(1)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_v = dv * BLOCK_DV + tl.arange(0, BLOCK_DV)
    SAME_DV: tl.constexpr = BLOCK_DV == BLOCK_D
    h_ok = offs_h < H
    q = tl.load(Q + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=h_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    if PRECISION == "interpret":
        q = q.to(tl.float32)
    m_i = tl.load(Sink + offs_h, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    l_i = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)

    m_i, l_i, acc = _gathered_source(q, KVA, IDXA + t * stride_ia, WIDTH_A, stride_kva, offs_d,
                                     offs_v, m_i, l_i, acc, scale_log2, D, BLOCK_N, SAME_DV,
                                     PRECISION)
    if HAS_B:
        m_i, l_i, acc = _gathered_source(q, KVB, IDXB + t * stride_ib, WIDTH_B, stride_kvb,
                                         offs_d, offs_v, m_i, l_i, acc, scale_log2, D, BLOCK_N,
                                         SAME_DV, PRECISION)
    if HAS_C:
        start = tl.load(CSTART + t).to(tl.int64)
        count = tl.load(CLEN + t)
        if PRECISION == "interpret":  # the interpreter cannot range() over a loaded bound
            n0 = 0
            while n0 < count:
                m_i, l_i, acc = _range_block(q, KVC, start, n0, count, stride_kvc, offs_d, offs_v,
                                             m_i, l_i, acc, scale_log2, D, BLOCK_N, SAME_DV,
                                             PRECISION)
                n0 += BLOCK_N
        else:  # a for loop, so that Triton software-pipelines the key loads (num_stages)
            for n0 in range(0, count, BLOCK_N):
                m_i, l_i, acc = _range_block(q, KVC, start, n0, count, stride_kvc, offs_d, offs_v,
                                             m_i, l_i, acc, scale_log2, D, BLOCK_N, SAME_DV,
                                             PRECISION)

    out = acc / l_i[:, None]
    tl.store(Out + t * stride_ot + offs_h[:, None] * stride_oh + offs_v[None, :],
             out.to(Out.dtype.element_ty), mask=h_ok[:, None] & (offs_v[None, :] < D))
