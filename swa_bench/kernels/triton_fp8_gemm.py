"""The Triton kernel of ``fp8_gemm``: ``a @ b^T`` of e4m3 operands with a UE8M0 scale per 32
along K on both, fp32 sums, on fp8 tensor cores.

Each 32-wide K group is one fp8 MMA into a fresh accumulator (on Hopper one ``wgmma`` of k = 32:
its sum of 32 exact products is the only one the tensor core rounds), then multiplied by the two
operands' power-of-two scales (exact) and added to the fp32 accumulator in round-to-nearest: the
per-32 promotion the release's block scales ask for. DeepGEMM promotes every 128 (one scale per
128 there); 32-wide scales cost four times its promotions, the price of the release's format.

``GROUPED``: ``a``'s rows are sorted by group (``ENDS``: int32 cumulative row ends, non-decreasing)
and group ``g`` multiplies ``b[g]``. The row tiles are laid out on the device: the rows split into
``G + 1`` segments, the groups and the tail past ``ENDS[G - 1]`` (stored as zeros, so every output
row is written and a replayed graph's output is a function of its inputs), and segment ``s`` owns
``ceil(rows_s / BLOCK_M)`` consecutive tiles, found by a prefix sum over the segments. No host
reads ``ENDS`` (a captured graph replays each step's routing) and no tile mixes two groups. The
grid has ``ceil(M / BLOCK_M) + G`` row tiles, the bound of that layout (``G + 1`` segments cost at
most ``G`` partial tiles beyond ``ceil(M / BLOCK_M)``); the spare ones store nothing. ``ENDS`` is
clamped to ``[0, M]`` and a segment's row count at 0, so malformed ends cannot address outside
``A`` or ``C``. A row's sums follow K in one order, whatever its tile: batch-invariant.

``INTERPRET``: Triton's interpreter (CPU) has no libdevice; the codes widen to fp32 (exact) and
numpy's fp32 matmul and adds (round to nearest) stand in for the MMA and ``add_rn``. On the GPU
``add_rn`` compiles to ``add.rn.ftz.f32``: a sum below 2**-126 would flush to zero, which needs
scales far below any the release's activations (floor 1e-4) and weights produce.

Imported lazily (``swa_bench.kernels.fp8_gemm``), as ``triton_mqa`` is.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _ue8m0(e):
    """A UE8M0 scale's value from its byte: ``2 ** (e - 127)`` (``1 <= e <= 254``)."""
    return (e.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _bf16_rne(x):
    """Finite fp32 ``x`` rounded to bf16's 8 significant bits, to nearest even (still fp32:
    the cast that follows is exact), as the GPU's ``cvt.rn.bf16`` rounds."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def scaled_fp8_gemm_kernel(A, SA, B, SB, C, ENDS, M, N, K, stride_a, stride_sa, stride_bg,
                           stride_b, stride_sbg, stride_sb, stride_c, G: tl.constexpr,
                           G_PAD: tl.constexpr, GROUPED: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, GROUP_K: tl.constexpr,
                           INTERPRET: tl.constexpr):
    """``C[m, n] = sum_j (A[m, j] . B[g, n, j]) * 2**(SA[m, j] + SB[g, n, j] - 254)`` over the
    K groups ``j`` of ``GROUP_K``; ``A [M, K]`` and ``B [G, N, K]`` e4m3 codes, ``SA [M, K /
    GROUP_K]`` and ``SB [G, N, K / GROUP_K]`` UE8M0 bytes. One output tile a program; axis 0
    walks N, so consecutive programs share the A tile and one group's weights."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    if GROUPED:
        # Segment s < G: group s's rows; s == G: the tail past ENDS[G - 1]; s > G: padding.
        s = tl.arange(0, G_PAD)
        seg_end = tl.where(s < G, tl.load(ENDS + s, mask=s < G, other=0), M)
        seg_end = tl.where(s <= G, tl.minimum(tl.maximum(seg_end, 0), M), 0)
        seg_start = tl.load(ENDS + s - 1, mask=(s > 0) & (s <= G), other=0)
        seg_start = tl.minimum(tl.maximum(seg_start, 0), M)
        tiles = tl.cdiv(tl.maximum(seg_end - seg_start, 0), BLOCK_M)
        last = tl.cumsum(tiles, 0)
        seg = tl.sum((last <= pid_m).to(tl.int32), 0)  # the first segment ending past pid_m
        mine = s == seg
        row0 = (tl.sum(tl.where(mine, seg_start, 0), 0)
                + (pid_m - tl.sum(tl.where(mine, last - tiles, 0), 0)) * BLOCK_M)
        row_end = tl.sum(tl.where(mine, seg_end, 0), 0)  # 0 for a spare tile: nothing stored
        has_weight = seg < G  # the tail multiplies nothing: its rows store zeros
        group = tl.minimum(seg, G - 1).to(tl.int64)
    else:
        has_weight = True
        group = 0
        row0 = pid_m * BLOCK_M
        row_end = M
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < row_end, cols < N
    rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)
    kk = tl.arange(0, GROUP_K)
    a_ptr = A + rows64[:, None] * stride_a + kk[None, :]
    b_ptr = B + group * stride_bg + cols64[:, None] * stride_b + kk[None, :]
    sa_ptr = SA + rows64 * stride_sa
    sb_ptr = SB + group * stride_sbg + cols64 * stride_sb
    n_groups = tl.where((row0 < row_end) & has_weight, K // GROUP_K, 0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for j in range(0, n_groups):
        a = tl.load(a_ptr + j * GROUP_K, mask=row_ok[:, None], other=0.0)
        b = tl.load(b_ptr + j * GROUP_K, mask=col_ok[:, None], other=0.0)
        sa = _ue8m0(tl.load(sa_ptr + j, mask=row_ok, other=127))
        sb = _ue8m0(tl.load(sb_ptr + j, mask=col_ok, other=127))
        scale = sa[:, None] * sb[None, :]
        if INTERPRET:  # no libdevice there; numpy's fp32 adds round to nearest
            acc += tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)),
                          input_precision="ieee") * scale
        else:  # add_rn: a round-to-nearest add Triton cannot fold into the MMA's accumulator
            acc = libdevice.add_rn(acc, tl.dot(a, tl.trans(b)) * scale)
    if INTERPRET and C.dtype.element_ty == tl.bfloat16:
        acc = _bf16_rne(acc)  # the interpreter's cast to bf16 truncates; the GPU's rounds
    tl.store(C + rows64[:, None] * stride_c + cols64[None, :], acc.to(C.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])
