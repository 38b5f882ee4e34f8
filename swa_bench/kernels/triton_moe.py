"""The Triton kernels of the routed experts' elementwise steps: the SwiGLU between the two
grouped GEMMs, and the combine that returns each (token, expert) output to its token.

The PyTorch path makes a pass per operation over ``[tokens x k, dim]`` tensors (at V4.1-Flash's
64K tokens, 4 GB each): the casts, the clamps, ``silu``, the products, the routing-weight product,
a zero fill, the ``index_copy`` back to token order, the fp32 sum over the k experts and the cast.
Here the SwiGLU reads ``h`` once and writes once; the combine reads each of a token's k rows once
(through the inverse of the sort) and writes the token's row once. Both compute what the PyTorch
path computes (``model.moe.swiglu``: the clamped SwiGLU times the routing weight in fp32, rounded
once; the k rows and the shared expert summed in fp32, in expert-slot order, rounded once).

Imported lazily (``swa_bench.kernels.moe``), as ``triton_mqa`` is.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _swiglu(gate, up, limit, CLAMP: tl.constexpr):
    """``model.moe.swiglu`` on fp32 ``gate`` and ``up``: the clamps (``up`` to ``[-limit,
    limit]``, ``gate`` from above), then ``silu(gate) * up``, all in fp32."""
    if CLAMP:
        up = tl.minimum(tl.maximum(up, -limit), limit)
        gate = tl.minimum(gate, limit)
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def silu_mul_kernel(H, A, W, ORDER, inter, stride_h, stride_a, limit, CLAMP: tl.constexpr,
                    WEIGHTED: tl.constexpr, BLOCK: tl.constexpr):
    """``a[r] = swiglu(h[r, :inter], h[r, inter:])`` in fp32, times ``W[ORDER[r]]`` (the row's
    pair's routing weight, ``WEIGHTED``), rounded once to the dtype."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(H + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(H + row * stride_h + inter + cols, mask=mask, other=0.0).to(tl.float32)
    a = _swiglu(g, u, limit, CLAMP)
    if WEIGHTED:
        a = tl.load(W + tl.load(ORDER + row)) * a
    tl.store(A + row * stride_a + cols, a.to(A.dtype.element_ty), mask=mask)


@triton.jit
def combine_kernel(Y, SLOT, SHARED, Out, dim, stride_y, stride_s, stride_o, K: tl.constexpr,
                   SLOTTED: tl.constexpr, ADD: tl.constexpr, BLOCK: tl.constexpr):
    """``out[t] = sum_j y[slot[t, j]]`` in fp32 (the rows carry their routing weight already),
    in slot order: ``slot`` maps a token's j-th expert to its row of the expert-sorted ``y``
    (``SLOTTED``; else ``y`` is in pair order, row ``t K + j``). ``ADD``: plus ``shared[t]``
    (the shared expert) in the same fp32 sum; rounded once."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < dim
    acc = tl.zeros([BLOCK], tl.float32)
    for j in range(K):
        if SLOTTED:
            row = tl.load(SLOT + t * K + j).to(tl.int64)
        else:
            row = t * K + j
        acc += tl.load(Y + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        acc += tl.load(SHARED + t * stride_s + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + t * stride_o + cols, acc.to(Out.dtype.element_ty), mask=mask)


@triton.jit
def route_kernel(Logits, Gate, Bias, Experts, Weights, rows, stride_l, stride_g, route_scale,
                 E: tl.constexpr, E_PAD: tl.constexpr, TOP_K: tl.constexpr,
                 K_PAD: tl.constexpr, BLOCK_R: tl.constexpr, GATED: tl.constexpr,
                 DIM: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """``model.moe.route`` in one pass over the logits: ``scores = sqrt(softplus(logit))`` in
    fp32, each row's ``TOP_K`` experts by ``scores + bias``, highest first (the lowest index
    among equal ones), and the chosen unbiased scores over their sum (+1e-20 when ``TOP_K > 1``)
    times ``route_scale``. ``GATED``: ``Logits`` holds the token rows ``[T, DIM]`` and the
    logits are their product with ``Gate [E, DIM]`` in fp32 sums (not rounded: the reference's
    fp32 gate), the router in one launch."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < rows
    e = tl.arange(0, E_PAD)
    if GATED:
        k = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_R, E_PAD], tl.float32)
        for k0 in range(0, DIM, BLOCK_K):
            k_ok = (k0 + k) < DIM
            a = tl.load(Logits + r.to(tl.int64)[:, None] * stride_l + (k0 + k)[None, :],
                        mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(Gate + e[:, None] * stride_g + (k0 + k)[None, :],
                        mask=(e < E)[:, None] & k_ok[None, :], other=0.0)
            acc = _dot(a, w, acc, PRECISION)
        x = acc
    else:
        x = tl.load(Logits + r.to(tl.int64)[:, None] * stride_l + e[None, :],
                    mask=r_ok[:, None] & (e < E)[None, :], other=0.0).to(tl.float32)
    # softplus(x) = max(x, 0) + log1p(exp(-|x|)), log1p by the exact-where-u-rounds-to-1 form
    small = tl.exp(-tl.abs(x))
    u = 1.0 + small
    exact = u == 1.0
    log1p = tl.where(exact, small, tl.log(u) * (small / tl.where(exact, 1.0, u - 1.0)))
    raw = tl.sqrt(tl.maximum(x, 0.0) + log1p)
    bias = tl.load(Bias + e, mask=e < E, other=0.0).to(tl.float32)
    scores = tl.where((e < E)[None, :], raw + bias[None, :], float("-inf"))
    slot = tl.arange(0, K_PAD)
    chosen = tl.zeros([BLOCK_R, K_PAD], tl.int32)
    values = tl.zeros([BLOCK_R, K_PAD], tl.float32)
    total = tl.zeros([BLOCK_R], tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(scores, 1)
        pick = tl.min(tl.where(scores == best[:, None], e[None, :], E_PAD), 1)
        value = tl.sum(tl.where(e[None, :] == pick[:, None], raw, 0.0), 1)
        chosen = tl.where(slot[None, :] == j, pick[:, None], chosen)
        values = tl.where(slot[None, :] == j, value[:, None], values)
        total += value
        scores = tl.where(e[None, :] == pick[:, None], float("-inf"), scores)
    if TOP_K > 1:
        values = values / (total + 1e-20)[:, None]
    at = r.to(tl.int64)[:, None] * TOP_K + slot[None, :]
    mask = r_ok[:, None] & (slot < TOP_K)[None, :]
    tl.store(Experts + at, chosen.to(tl.int64), mask=mask)
    tl.store(Weights + at, values * route_scale, mask=mask)


@triton.jit
def sort_pairs_kernel(Pairs, Order, Ends, n, E: tl.constexpr, N_PAD: tl.constexpr,
                      BINS: tl.constexpr):
    """One program sorts every (token, expert) pair by expert: the keys ``expert * N_PAD +
    pair`` are unique, so one ascending sort is the stable order (equal experts keep pair
    order); each expert's row end is the running sum of the experts' histogram. Padding lanes
    carry expert ``E``: they sort last and fall in a bin past the stored ends."""
    i = tl.arange(0, N_PAD)
    ok = i < n
    e = tl.load(Pairs + i, mask=ok, other=E).to(tl.int32)
    keys = tl.sort(e * N_PAD + i)
    tl.store(Order + i, (keys % N_PAD).to(tl.int64), mask=ok)
    ends = tl.cumsum(tl.histogram(e, BINS), 0)
    b = tl.arange(0, BINS)
    tl.store(Ends + b, ends, mask=b < E)


@triton.jit
def grouped_mm_kernel(X, ORDER, W, ENDS, RW, Y, M, stride_x, stride_wg, stride_wn, stride_y,
                      limit, N: tl.constexpr, K: tl.constexpr, G: tl.constexpr,
                      G_PAD: tl.constexpr, TOP_K: tl.constexpr, SWIGLU: tl.constexpr,
                      CLAMP: tl.constexpr, WEIGHTED: tl.constexpr, SCATTER: tl.constexpr,
                      DENSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """Row ``r`` of the expert-sorted (token, expert) pairs times its expert's ``W[g].T``.

    The group of a row is the number of ``ENDS`` at or below it: a tile visits each group its
    rows span and keeps each row's own. Rows past ``ENDS[G - 1]`` come out zero. ``TOP_K > 0``
    reads row ``r``'s input at ``X[ORDER[r] // TOP_K]`` (the gather into expert order);
    ``SWIGLU``: ``W[g]`` holds gate then up (``2 N`` rows) and the output is ``silu_mul``'s (the
    GEMM outputs rounded to the dtype, the clamps at ``limit`` where ``CLAMP``, fp32 after),
    times ``RW[ORDER[r]]``, the pair's routing weight, where ``WEIGHTED``; ``SCATTER`` writes
    row ``r`` at ``ORDER[r]``. ``DENSE``: one weight (``G`` 1) for every row in order, a plain
    GEMM (the shared expert). A row's sum runs over ``K`` in ``BLOCK_K`` steps whichever rows
    share its tile: batch-invariant."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    offs_g = tl.arange(0, G_PAD)
    if DENSE:  # one group of every row, in order: no ORDER or ENDS
        pair = offs_m.to(tl.int64)
        ends = tl.where(offs_g == 0, M, 2147483647)
    else:
        pair = tl.load(ORDER + offs_m, mask=m_ok, other=0).to(tl.int64)
        ends = tl.load(ENDS + offs_g, mask=offs_g < G, other=2147483647)
    src = pair // TOP_K if TOP_K > 0 else offs_m.to(tl.int64)
    first = tl.program_id(0) * BLOCK_M
    last = tl.minimum(first + BLOCK_M, M) - 1
    g = tl.sum((ends <= first).to(tl.int32), 0)
    g_last = tl.minimum(tl.sum((ends <= last).to(tl.int32), 0), G - 1)
    out = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    while g <= g_last:
        start = tl.sum(tl.where(offs_g == g - 1, ends, 0), 0)
        end = tl.sum(tl.where(offs_g == g, ends, 0), 0)
        mine = m_ok & (offs_m >= start) & (offs_m < end)
        w_g = W + g.to(tl.int64) * stride_wg
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + offs_k) < K
            a = tl.load(X + src[:, None] * stride_x + (k0 + offs_k)[None, :],
                        mask=mine[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_g + offs_n[:, None] * stride_wn + (k0 + offs_k)[None, :],
                        mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc = _dot(a, b, acc, PRECISION)
            if SWIGLU:
                b = tl.load(w_g + (N + offs_n)[:, None] * stride_wn + (k0 + offs_k)[None, :],
                            mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                acc_up = _dot(a, b, acc_up, PRECISION)
        if SWIGLU:
            dtype = Y.dtype.element_ty
            acc = _swiglu(acc.to(dtype).to(tl.float32), acc_up.to(dtype).to(tl.float32), limit,
                          CLAMP)
        out = tl.where(mine[:, None], acc, out)
        g += 1
    if WEIGHTED:
        out = tl.load(RW + pair, mask=m_ok, other=0.0)[:, None] * out
    dst = pair if SCATTER else offs_m.to(tl.int64)
    tl.store(Y + dst[:, None] * stride_y + offs_n[None, :], out.to(Y.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr):
    """``acc + a @ b.T``; the interpreter's low-precision dot is wrong: exact fp32 there."""
    if PRECISION == "interpret":
        return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
