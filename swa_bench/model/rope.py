"""Rotary position embedding as DeepSeek-V4.1 inference/model.py defines it
(`precompute_freqs_cis`, `apply_rotary_emb`, `Attention.__init__`).

The last ``rope_dim`` features of a row are taken as ``rope_dim // 2`` complex numbers of
ADJACENT pairs ``(2i, 2i + 1)``, pair i turned by ``position * base ** (-2i / rope_dim)``. Each
layer owns one table (``RopeSpec``): window-only layers at ``rope_theta`` without YaRN; every
layer with global or compressed KV at ``compress_rope_theta``, with YaRN while
``original_seq_len > 0``. Everything a layer rotates (its query, its K=V latent, the indexer's
query and keys, its compressed latent) reads that layer's table, and its attention output is
turned back (``inverse``) at the query's position before ``wo_a``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from swa_bench.kernels import fused_rope, rope_
from swa_bench.model.args import ModelArgs
from swa_bench.model.derived import capturing
from swa_bench.model.forward_context import active_kernels


@dataclass(frozen=True)
class RopeSpec:
    """One layer's rotation: ``dim`` rotated features, a table of ``length`` positions at
    ``theta``; YaRN (``factor``, the ``beta_fast .. beta_slow`` ramp) while
    ``original_seq_len > 0``."""

    dim: int
    theta: float
    length: int
    original_seq_len: int = 0
    factor: float = 1.0
    beta_fast: int = 32
    beta_slow: int = 1

    @classmethod
    def for_layer(cls, args: ModelArgs, layer: int) -> RopeSpec:
        """The reference's per-layer choice: a window-only layer (compress ratio 0 there; draft
        layers past the backbone among them) rotates at ``rope_theta`` without YaRN, a layer with
        global or compressed KV (ratio 2 or 1) at ``compress_rope_theta`` with YaRN."""
        if layer >= args.n_layers or args.compress_ratio_for(layer) is None:
            return cls(args.rope_dim, args.rope_theta, args.max_seq_len)
        return cls(args.rope_dim, args.compress_rope_theta, args.max_seq_len,
                   args.original_seq_len, args.rope_factor, args.beta_fast, args.beta_slow)

    def with_dim(self, dim: int) -> RopeSpec:
        """The same table's settings over ``dim`` features (an indexer narrower than RoPE)."""
        return self if dim == self.dim else dataclasses.replace(self, dim=dim)

    def frequencies(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """fp32 ``[dim // 2]`` angle per position of each pair: ``theta ** (-2i / dim)``, YaRN's
        blend with ``freq / factor`` where a wavelength exceeds the training context (pair
        ``i >= high`` divided, ``i <= low`` kept, a linear ramp in between)."""
        dim, base = self.dim, self.theta
        pairs = torch.arange(0, dim, 2, device=device, dtype=torch.float32)
        freqs = 1.0 / (base ** (pairs / dim))
        if self.original_seq_len > 0:
            def pair_turning(rotations: float) -> float:
                # the pair whose wavelength turns `rotations` times over the training context
                return (dim * math.log(self.original_seq_len / (rotations * 2 * math.pi))
                        / (2 * math.log(base)))

            low = max(math.floor(pair_turning(self.beta_fast)), 0)
            high = min(math.ceil(pair_turning(self.beta_slow)), dim - 1)
            ramp = (pairs / 2 - low) / max(high - low, 1e-3)
            smooth = 1 - ramp.clamp(0, 1)  # 1 keeps a pair's frequency, 0 divides it
            freqs = freqs / self.factor * (1 - smooth) + freqs * smooth
        return freqs


_ROPE_TABLES: dict[tuple[torch.device, RopeSpec], tuple[torch.Tensor, torch.Tensor]] = {}


def rope_table(device: torch.device, spec: RopeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos, sin [length, dim // 2]`` of every position, computed once per layer setting
    and device (on the device: no host copy, so also while a CUDA stream captures): a row's
    angles are one gather, not recomputed by every layer."""
    key = (torch.device(device), spec)
    table = _ROPE_TABLES.get(key)
    if table is None:
        positions = torch.arange(spec.length, device=device, dtype=torch.float32)
        angles = torch.outer(positions, spec.frequencies(device))
        table = angles.cos(), angles.sin()
        if not capturing(key[0]):
            _ROPE_TABLES[key] = table
    return table


def apply_rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    spec: RopeSpec,
    *,
    inverse: bool = False,
    inplace: bool = False,
) -> torch.Tensor:
    """Turns each adjacent pair ``(2i, 2i + 1)`` of the last ``spec.dim`` features of
    ``x [T, ..., D]`` by its row's position (``< spec.length``), in fp32, rounded once to the
    dtype; ``inverse`` turns it back (the conjugate). ``inplace`` writes into ``x`` (a fresh
    tensor nobody else reads): no copy of the other features. One Triton launch where
    ``fused_rope`` allows on the context's kernels."""
    rope_dim = spec.dim
    if rope_dim == 0:
        return x
    cos_table, sin_table = rope_table(x.device, spec)
    kernels = active_kernels()
    if fused_rope(kernels, x):
        return rope_(kernels, x if inplace else x.clone(), positions, cos_table, sin_table,
                     rope_dim, inverse=inverse)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rope_dim // 2,)
    cos = cos_table.index_select(0, positions).view(shape)
    sin = sin_table.index_select(0, positions).view(shape)
    if inverse:
        sin = -sin
    out = x if inplace else x.clone()
    pairs = x[..., -rope_dim:].unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    even = (a * cos).addcmul_(b, sin, value=-1)
    odd = (a * sin).addcmul_(b, cos)
    turned = out[..., -rope_dim:].unflatten(-1, (-1, 2))
    turned[..., 0] = even
    turned[..., 1] = odd
    return out
