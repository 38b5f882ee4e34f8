"""``norm_latents``: an attention block's query latent and K=V latent from one stacked
projection, both RMS-normed and the K=V latent rotated (RoPE), in one launch (Triton), for
inference on the Triton backend.

``model.Attention`` keeps the PyTorch steps (two projections, two norms, the RoPE on a copy) as
the CPU path, for training (this has no backward) and as the oracle. Each row's result depends
on that row alone: batch-invariant.
"""

from __future__ import annotations

import torch

from swa_bench.kernels.config import Kernels, next_pow2
from swa_bench.kernels.launch import launch

MAX_WIDTH = 4096  # features of a latent one program holds


def fused_latents(kernels: Kernels, x: torch.Tensor, q_dim: int, kv_dim: int) -> bool:
    """Whether the latents of ``x`` are formed here: the Triton backend is bound (``kernels``),
    no gradient is wanted, and one program holds each latent."""
    return x.dim() == 2 and max(q_dim, kv_dim) <= MAX_WIDTH and kernels.inference(x)


def norm_latents(kernels: Kernels, h: torch.Tensor, q_dim: int, q_norm: tuple[torch.Tensor, float],
                 kv_norm: tuple[torch.Tensor, float], positions: torch.Tensor,
                 cos_table: torch.Tensor, sin_table: torch.Tensor, rope_dim: int,
                 *, keep_latent: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """From ``h = [q | kv]`` ``[T, q_dim + kv_dim]``: ``rms_norm(q)``, ``rope(rms_norm(kv))``
    (adjacent pairs, the layer's ``[length, rope_dim // 2]`` tables) and, with ``keep_latent``,
    ``rms_norm(kv)`` before the rotation (a sparse KV source's index keys read it). Norms
    ``(weight, eps)`` in fp32, each result rounded to ``h``'s dtype where the PyTorch path
    rounds: the normed K=V latent is rounded before it is rotated."""
    from swa_bench.kernels import triton_latents

    rows, kv_dim = h.shape[0], h.shape[1] - q_dim
    q = h.new_empty(rows, q_dim)
    kv = h.new_empty(rows, kv_dim)
    latent = h.new_empty(rows, kv_dim) if keep_latent else None
    if rows:
        h = h if h.stride(-1) == 1 else h.contiguous()
        half = rope_dim // 2
        launch(triton_latents.latents_kernel, (rows,),
            h, q_norm[0], kv_norm[0], positions, cos_table, sin_table, q, kv,
            kv if latent is None else latent, h.stride(0), q.stride(0), kv.stride(0), q_dim,
            kv_dim, kv_dim - rope_dim, half, q_norm[1], kv_norm[1],
            BLOCK_Q=next_pow2(q_dim), BLOCK_KV=next_pow2(kv_dim),
            BLOCK_HALF=max(2, next_pow2(half)), ROPE=half > 0, LATENT=keep_latent,
            direct=kernels.direct_launch, num_warps=4)
    return q, kv, latent
