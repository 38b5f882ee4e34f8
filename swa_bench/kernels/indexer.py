"""``index_scores_fused``: the indexer's scores of a run of consecutive query positions against
one source's keys, causal, without materialising the per-head scores (Triton).

``model.sparse_attention.index_scores`` stays the CPU path and the oracle. The two differ by
rounding: the PyTorch path rounds each head's ``q . k`` and the head sum to the model dtype, the
kernel keeps fp32 throughout. Every path of one run (reference, replay, graphs) takes the same
one, so their selections see the same scores for the same inputs.

A ``torch.library`` custom op with a FLOP formula: torch's counter sees the work the kernel does
(every row of a block against the keys up to the block's last visible one), as
``index_score_flops`` counts it; outside a dispatch mode the kernel is called directly
(``call_op``).
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula

from swa_bench.kernels.config import Kernels, call_op, next_pow2
from swa_bench.kernels.launch import launch

BLOCK_M = 64  # rows a program scores; fixed, so the work (and its FLOPs) never follow the batch
BLOCK_N = 128


def index_score_flops(rows: int, first_pos: int, n_keys: int, ratio: int, heads: int,
                      head_dim: int) -> int:
    """``q . k`` (2 d) and the weighted head sum (2) per head, for every row of each block of
    ``BLOCK_M`` against the keys up to the block's last row's visible one."""
    total = 0
    for r0 in range(0, rows, BLOCK_M):
        last = first_pos + min(rows, r0 + BLOCK_M) - 1
        total += (min(rows, r0 + BLOCK_M) - r0) * min(n_keys, (last + 1) // ratio)
    return total * heads * (2 * head_dim + 2)


def _index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                  first_pos: int, ratio: int, precision: str, direct: bool) -> torch.Tensor:
    from swa_bench.kernels import triton_indexer

    rows, heads, d = q.shape
    n = keys.shape[0]
    out = torch.empty(rows, n, dtype=torch.float32, device=q.device)
    if rows == 0 or n == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    grid = (-(-rows // BLOCK_M), -(-n // BLOCK_N))
    launch(triton_indexer.index_scores_kernel, grid,
        q, weights, keys, out, rows, n, first_pos,
        q.stride(0), q.stride(1), weights.stride(0), keys.stride(0), out.stride(0),
        RATIO=ratio, H=heads, D=d, BLOCK_D=max(16, next_pow2(d)),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, PRECISION=precision, direct=direct,
        num_warps=4, num_stages=2,
    )
    return out


index_scores_op = torch.library.custom_op("swa_bench::index_scores", _index_scores,
                                          mutates_args=())


@index_scores_op.register_fake
def _(q, weights, keys, first_pos, ratio, precision, direct):
    return q.new_empty(q.shape[0], keys.shape[0], dtype=torch.float32)


@register_flop_formula(torch.ops.swa_bench.index_scores)
def _index_scores_flop_formula(q_shape, weights_shape, keys_shape, first_pos, ratio, *args,
                               out_shape=None, **kwargs) -> int:
    rows, heads, d = q_shape
    return index_score_flops(rows, first_pos, keys_shape[0], ratio, heads, d)


def index_scores_fused(kernels: Kernels, q: torch.Tensor, weights: torch.Tensor,
                       keys: torch.Tensor, first_pos: int, ratio: int) -> torch.Tensor:
    """fp32 ``[rows, n]``: row ``i`` (at position ``first_pos + i``) against keys ``[n, d]``
    (one per group of ``ratio`` positions, as the source's compressor wrote them):
    ``sum_h weights[i, h] relu(q[i, h] . k_j)`` where it sees key ``j``
    (``j < (pos + 1) // ratio``), -inf where it does not."""
    return call_op(index_scores_op, _index_scores, q, weights, keys, int(first_pos), int(ratio),
                   kernels.precision(q.dtype), kernels.direct_launch)
