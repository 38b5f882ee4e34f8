"""Rotary position embedding on the last ``rope_dim`` features of a row."""

from __future__ import annotations

import torch

from swa_bench.kernels import fused_rope, rope_
from swa_bench.model.derived import capturing
from swa_bench.model.forward_context import active_kernels

_ROPE_TABLES: dict[tuple[torch.device, int, float, int], tuple[torch.Tensor, torch.Tensor]] = {}


def rope_table(
    device: torch.device, rope_dim: int, theta: float, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos, sin [length, rope_dim // 2]`` of every position, computed once per shape: a
    row's angles are read with one gather instead of recomputed by every layer."""
    key = (device, rope_dim, theta, length)
    table = _ROPE_TABLES.get(key)
    if table is None:
        half = rope_dim // 2
        freqs = theta ** (-torch.arange(half, device=device, dtype=torch.float32) / half)
        angles = torch.arange(length, device=device, dtype=torch.float32)[:, None] * freqs[None, :]
        table = angles.cos(), angles.sin()
        if not capturing(device):
            _ROPE_TABLES[key] = table
    return table


def apply_rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    rope_dim: int,
    theta: float,
    max_len: int,
    *,
    inplace: bool = False,
) -> torch.Tensor:
    """Rotates the last ``rope_dim`` features of ``x [T, ..., D]`` by each row's position
    (``< max_len``), in fp32. ``inplace`` writes into ``x`` (a fresh projection nobody else
    reads): no copy of the unrotated features. One Triton launch where ``fused_rope`` allows on
    the context's kernels."""
    if rope_dim == 0:
        return x
    half = rope_dim // 2
    cos_table, sin_table = rope_table(x.device, rope_dim, theta, max_len)
    kernels = active_kernels()
    if fused_rope(kernels, x):
        return rope_(kernels, x if inplace else x.clone(), positions, cos_table, sin_table,
                     rope_dim)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos = cos_table.index_select(0, positions).view(shape)
    sin = sin_table.index_select(0, positions).view(shape)
    out = x if inplace else x.clone()
    a, b = x[..., -rope_dim:-half], x[..., -half:]
    first = (a * cos).addcmul_(b, sin, value=-1)
    second = (a * sin).addcmul_(b, cos)
    out[..., -rope_dim:-half] = first
    out[..., -half:] = second
    return out
