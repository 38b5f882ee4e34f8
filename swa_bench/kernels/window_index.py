"""``window_index_rows``: each query row's window keys as rows of ``cat([ring, kv])`` in one
launch (Triton), on the Triton backend.

``model.key_sources._window_index`` computes the same integers in about twenty tensor ops (a
gather per metadata field, the arithmetic, the masks): once per attention metadata, so once a
step, three times on a replay step (the step's, the replay batch's, S's keys), which on a small
step costs the host more than every layer's attention kernel. Integer results: equal either
way, so the choice changes no bits.
"""

from __future__ import annotations

import torch

from swa_bench.kernels.config import Kernels, next_pow2
from swa_bench.kernels.launch import launch

BLOCK_ROWS = 32


def window_index_rows(kernels: Kernels, positions: torch.Tensor, row_request: torch.Tensor,
                      kv_first_pos: torch.Tensor, kv_row_start: torch.Tensor,
                      cache_index: torch.Tensor, window_start: torch.Tensor, ring_rows: int,
                      window: int) -> torch.Tensor:
    """``[rows, window]`` int64: key ``j`` of row ``r`` is position ``p = positions[r] - j``,
    read from this forward's KV (row ``ring_rows + kv_row_start + p - kv_first_pos`` of its
    request) at or after the request's first key position, else from its ring slot
    (``cache_index * window + p mod window``); -1 below the request's window start or 0."""
    from swa_bench.kernels import triton_window_index

    rows = positions.shape[0]
    out = torch.empty(rows, window, dtype=torch.long, device=positions.device)
    if rows:
        launch(triton_window_index.window_index_kernel, (-(-rows // BLOCK_ROWS),),
            positions, row_request, kv_first_pos, kv_row_start, cache_index, window_start, out,
            rows, ring_rows, WINDOW=window, BLOCK_W=next_pow2(window), BLOCK_R=BLOCK_ROWS,
            direct=kernels.direct_launch, num_warps=4)
    return out
