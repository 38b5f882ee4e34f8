"""The Triton kernel of ``index_scores``: the indexer's ``sum_h w_h relu(q_h . k)`` in one pass.

The PyTorch path materialises every head's scores ``[rows, heads, keys]`` in the model dtype and
reads them back twice (ReLU, then the weighted head sum): at 64K tokens that is about 0.3 TB of
traffic per index source. Here one program owns a block of rows and a block of keys: it loads the
keys once, and for each head in order takes the ``q_h . k`` tile from a tensor-core dot (fp32
accumulate), applies ReLU and adds ``w_h`` times it into an fp32 tile, which it stores once. Key
blocks no row of the block can see are never computed (they are stored as -inf).

Each score depends on its own row's query and weights and on its key alone, summed over heads in
a fixed order: the kernel is batch-invariant. Imported lazily (``swa_bench.kernels.indexer``).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def index_scores_kernel(
    Q, W, K, Out,
    rows, n_keys, first_pos,
    stride_qr, stride_qh, stride_wr, stride_k, stride_or,
    RATIO: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok, c_ok = r < rows, c < n_keys
    pos = first_pos + r
    limit = tl.where(r_ok, (pos + 1) // RATIO, 0)  # row r sees keys j < limit (a key per group)
    out = Out + r.to(tl.int64)[:, None] * stride_or + c[None, :]
    store = r_ok[:, None] & c_ok[None, :]
    if tl.program_id(1) * BLOCK_N >= tl.max(limit, 0):
        tl.store(out, tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32), mask=store)
        return
    d = tl.arange(0, BLOCK_D)
    k = tl.load(K + c.to(tl.int64)[:, None] * stride_k + d[None, :],
                mask=c_ok[:, None] & (d[None, :] < D), other=0.0)
    if PRECISION == "interpret":  # the interpreter's bf16 dot is wrong: exact fp32 instead
        k = k.to(tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    q_rows = Q + r.to(tl.int64)[:, None] * stride_qr + d[None, :]
    q_mask = r_ok[:, None] & (d[None, :] < D)
    for h in range(H):
        q = tl.load(q_rows + h * stride_qh, mask=q_mask, other=0.0)
        if PRECISION == "interpret":
            s = tl.dot(q.to(tl.float32), tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        w = tl.load(W + r * stride_wr + h, mask=r_ok, other=0.0).to(tl.float32)
        acc += tl.maximum(s, 0.0) * w[:, None]
    acc = tl.where(c[None, :] < limit[:, None], acc, float("-inf"))
    tl.store(out, acc, mask=store)
