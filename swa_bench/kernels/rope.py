"""``rope_``: RoPE in place in one launch (Triton), for inference on the Triton backend.

``model.apply_rope`` keeps the PyTorch passes as the CPU path, for training (this has no backward)
and as the oracle. The layout is DeepSeek-V4.1's (inference/model.py `apply_rotary_emb`): adjacent
feature pairs ``(2i, 2i + 1)`` of the last ``rope_dim`` features. Each row's result depends on
that row alone: batch-invariant.
"""

from __future__ import annotations

import torch

from swa_bench.kernels.config import Kernels, next_pow2
from swa_bench.kernels.launch import launch


def fused_rope(kernels: Kernels, x: torch.Tensor) -> bool:
    """Whether ``x``'s rotation runs here: the Triton backend is bound (``kernels``), no
    gradient is wanted, and its features are contiguous (``[T, D]`` or ``[T, H, D]``)."""
    return x.dim() in (2, 3) and x.stride(-1) == 1 and kernels.inference(x)


def rope_(kernels: Kernels, x: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor,
          sin_table: torch.Tensor, rope_dim: int, *, inverse: bool = False) -> torch.Tensor:
    """Turns each adjacent pair of the last ``rope_dim`` features of ``x`` in place by its row's
    position, with the layer's ``[length, rope_dim // 2]`` fp32 tables (``inverse``: back, the
    conjugate rotation); returns ``x``."""
    from swa_bench.kernels import triton_rope

    rows = x.shape[0]
    if rows == 0 or rope_dim == 0:
        return x
    heads = x.shape[1] if x.dim() == 3 else 1
    stride_h = x.stride(1) if x.dim() == 3 else 0
    half = rope_dim // 2
    launch(triton_rope.rope_kernel, (rows,),
        x, positions, cos_table, sin_table, x.stride(0), stride_h, heads,
        x.shape[-1] - rope_dim, half, BLOCK_H=next_pow2(heads), BLOCK_HALF=next_pow2(half),
        INVERSE=inverse, direct=kernels.direct_launch, num_warps=4)
    return x
