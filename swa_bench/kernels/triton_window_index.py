"""The Triton kernel of ``window_index_rows``: a block of query rows' window key rows.

Imported lazily (``swa_bench.kernels.window_index``), as ``triton_mqa`` is.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def window_index_kernel(POS, REQ, KV_FIRST, KV_ROW_START, CACHE_INDEX, WINDOW_START, Out, rows,
                        ring_rows, WINDOW: tl.constexpr, BLOCK_W: tl.constexpr,
                        BLOCK_R: tl.constexpr):
    """``_window_index``'s arithmetic on int64, per (row, key) of the block."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < rows
    j = tl.arange(0, BLOCK_W)
    req = tl.load(REQ + r, mask=r_ok, other=0).to(tl.int64)
    pos = tl.load(POS + r, mask=r_ok, other=0).to(tl.int64)
    first = tl.load(KV_FIRST + req, mask=r_ok, other=0).to(tl.int64)[:, None]
    row_start = tl.load(KV_ROW_START + req, mask=r_ok, other=0).to(tl.int64)[:, None]
    slot = tl.load(CACHE_INDEX + req, mask=r_ok, other=0).to(tl.int64)[:, None]
    start = tl.load(WINDOW_START + req, mask=r_ok, other=0).to(tl.int64)[:, None]
    kpos = pos[:, None] - j[None, :]
    from_kv = ring_rows + row_start + (kpos - first)
    ring_pos = kpos % WINDOW
    ring_pos = tl.where(ring_pos < 0, ring_pos + WINDOW, ring_pos)  # floor modulo, as torch's
    from_ring = slot * WINDOW + ring_pos
    readable = (kpos >= start) & (kpos >= 0)
    index = tl.where(readable, tl.where(kpos >= first, from_kv, from_ring), -1)
    tl.store(Out + r.to(tl.int64)[:, None] * WINDOW + j[None, :], index,
             mask=r_ok[:, None] & (j < WINDOW)[None, :])
