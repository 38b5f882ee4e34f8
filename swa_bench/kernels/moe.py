"""``silu_mul`` and ``moe_combine``: the routed experts' elementwise steps in one pass each
(Triton), for inference on the Triton backend.

``model.MoE`` keeps the PyTorch steps as the CPU path, for training (these have no backward) and
as the oracle. Each output row depends on its own input rows alone: batch-invariant.
"""

from __future__ import annotations

import torch

from swa_bench.kernels.config import attention_backend

BLOCK = 1024


def fused_moe(x: torch.Tensor) -> bool:
    """Whether the experts' elementwise steps on ``x`` run here: the Triton backend is chosen for
    its device and no gradient is wanted."""
    return attention_backend(x.device) == "triton" and not (
        torch.is_grad_enabled() and x.requires_grad)


def silu_mul(h: torch.Tensor) -> torch.Tensor:
    """``silu(g) * u`` of ``h = [g | u]`` ``[M, 2 I]`` as ``[M, I]``."""
    from swa_bench.kernels import triton_moe

    rows, inter = h.shape[0], h.shape[1] // 2
    h = h if h.stride(-1) == 1 else h.contiguous()
    a = h.new_empty(rows, inter)
    if rows:
        triton_moe.silu_mul_kernel[(rows, -(-inter // BLOCK))](
            h, a, inter, h.stride(0), a.stride(0), BLOCK=BLOCK, num_warps=4)
    return a


def moe_combine(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Token ``t``'s row: ``sum_j weights[t, j] * y[pos of (t, j)]`` where ``y`` holds the
    (token, expert) pairs in ``order`` (``y[i]`` is pair ``order[i]``, pair ``t k + j``), with
    the PyTorch path's roundings. Writes into ``out`` ``[T, dim]`` when given."""
    from swa_bench.kernels import triton_moe

    t, k = weights.shape
    slot = torch.empty_like(order)
    slot[order] = torch.arange(order.numel(), device=order.device)
    if out is None:
        out = y.new_empty(t, y.shape[1])
    if t:
        y = y if y.stride(-1) == 1 else y.contiguous()
        triton_moe.combine_kernel[(t, -(-y.shape[1] // BLOCK))](
            y, slot, weights, out, y.shape[1], y.stride(0), weights.stride(0), out.stride(0),
            K=k, BLOCK=BLOCK, num_warps=4)
    return out
