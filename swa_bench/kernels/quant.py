"""Quantise-dequantise of the release's numerics (DeepSeek-V4.1 as shipped), in plain torch.

Each function returns the values the quantised format stores, in the input's dtype, so a layer
that calls it computes what a kernel computes from fp8/fp4 operands and their scales (up to the
order of the fp32 sums: every stored value, and every product of two of them, is exact in bf16
and fp32 respectively, and the scales are powers of two). Everything is deterministic and local
to one row's group (activations) or one weight block: the oracle and the engine that call these
functions get the same bits, so E1 stays bitwise, and a row's values do not depend on the batch.

The rules are the release's kernels' (``inference/kernel.py`` of DeepSeek-V4.1-Flash at
dba1be0a, as its torch port ``kernel_cpu.py`` in tenstorrent/tt-metal restates them):

* UE8M0 scale (``fast_round_scale``): ``2 ** ceil(log2(amax * fp32(1 / fmax)))``, the ceiling read
  from the fp32 bits (exponent, plus one when the mantissa is not zero), so ``x / scale`` stays
  within the format's largest value;
* fp8 e4m3 (fn: no inf, max 448): round to nearest, ties to even, saturating (``satfinite``);
* fp4 e2m1 (grid 0, 0.5, 1, 1.5, 2, 3, 4, 6): round to nearest, ties to the even code, after
  clamping to +-6;
* ``act_quant``: per 32 consecutive elements of a row, e4m3, UE8M0, amax floored at 1e-4 (the
  activations of every fp8 and fp4 GEMM, and the window KV);
* ``fp4_act_quant``: per 32, e2m1, UE8M0, amax floored at ``6 * 2**-126`` (indexer q and keys);
* ``fp4_act_quant_e4m3_scale``: per 16, e2m1, scale ``e4m3(amax / 6)``, amax floored at
  ``6 * 2**-9`` (compressed KV);
* weights (the checkpoint's converter, not in the inference code; stated here):
  ``fp8_weight_quant`` e4m3 per 32 x 32 block and ``fp4_weight_quant`` e2m1 per 32 along K, each
  with the UE8M0 scale ``2 ** ceil(log2(max(amax, 1e-4) / fmax))``. Both are idempotent: weights
  already on their grid (a shipped checkpoint's, dequantised) come back unchanged.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0
ACT_AMAX_FLOOR = 1e-4
FP4_AMAX_FLOOR = 6 * 2.0**-126
KV_FP4_AMAX_FLOOR = 6 * 2.0**-9
ACT_GROUP = 32  # the reference's fp8_block_size: activations, and the weights' square blocks
FP4_GROUP = 32  # the reference's fp4_block_size
KV_FP4_GROUP = 16

_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_MANTISSA = (1 << 23) - 1


def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """``2 ** ceil(log2(x))`` of positive normal fp32 ``x``, exactly: from its bits, not from a
    rounded ``log2`` (which reads ``2**k * (1 + 2**-23)`` as ``2**k``)."""
    bits = x.float().contiguous().view(torch.int32)
    exp = ((bits >> 23) & 0xFF) + ((bits & _MANTISSA) != 0).to(torch.int32)
    return (exp << 23).view(torch.float32)


def ue8m0_scale(amax: torch.Tensor, fmax: float, floor: float) -> torch.Tensor:
    """``fast_round_scale``: the power of two that maps ``amax`` (floored) to at most ``fmax``,
    through the fp32 reciprocal the kernels multiply by."""
    inv = torch.tensor(1.0 / fmax, dtype=torch.float32, device=amax.device)
    return pow2_ceil(amax.float().clamp(min=floor) * inv)


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32) on the e4m3 grid, saturating at +-448."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32) on the e2m1 grid, saturating at +-6; ties go to the even code."""
    grid = torch.tensor(_E2M1_GRID, device=x.device)
    mids = (grid[1:] + grid[:-1]) / 2
    a = x.float().abs().clamp(max=E2M1_MAX).contiguous()  # bucketize copies a strided one
    idx = torch.bucketize(a, mids, right=True)  # a tie rounds up here ...
    tie = (idx > 0) & (a == mids[(idx - 1).clamp(min=0)])
    idx = torch.where(tie & (idx % 2 == 1), idx - 1, idx)  # ... and back down to an even code
    return torch.copysign(grid[idx], x.float())


def _grouped(x: torch.Tensor, group: int) -> torch.Tensor:
    if x.shape[-1] % group:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of the group {group}")
    return x.float().unflatten(-1, (-1, group))


def act_quant_parts(x: torch.Tensor, group: int = ACT_GROUP
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``act_quant``'s two parts, fp32: the e4m3 codes ``[..., n / group, group]`` and each
    group's UE8M0 scale ``[..., n / group, 1]`` (what ``fp8_gemm`` reads)."""
    g = _grouped(x, group)
    s = ue8m0_scale(g.abs().amax(-1, keepdim=True), E4M3_MAX, ACT_AMAX_FLOOR)
    return round_e4m3(g / s), s


def act_quant(x: torch.Tensor, group: int = ACT_GROUP) -> torch.Tensor:
    """Activations as the fp8 and fp4 GEMMs read them, and the window KV as stored: e4m3 per
    ``group`` elements of a row, UE8M0 (``act_quant(x, 32, "ue8m0")``)."""
    codes, s = act_quant_parts(x, group)
    return (codes * s).flatten(-2).to(x.dtype)


def fp4_act_quant(x: torch.Tensor, group: int = FP4_GROUP) -> torch.Tensor:
    """The indexer's queries and keys: e2m1 per ``group`` of a row, UE8M0
    (``fp4_act_quant(x, 32)``)."""
    g = _grouped(x, group)
    s = ue8m0_scale(g.abs().amax(-1, keepdim=True), E2M1_MAX, FP4_AMAX_FLOOR)
    return (round_e2m1(g / s) * s).flatten(-2).to(x.dtype)


def fp4_act_quant_e4m3_scale(x: torch.Tensor, group: int = KV_FP4_GROUP) -> torch.Tensor:
    """Compressed KV: e2m1 per ``group`` of a row with an e4m3 scale, ``amax / 6`` on the e4m3
    grid (``fp4_act_quant(x, 16, scale_dtype=float8_e4m3fn)``; an all-zero group stays zero)."""
    g = _grouped(x, group)
    amax = g.abs().amax(-1, keepdim=True).clamp(min=KV_FP4_AMAX_FLOOR)
    s = round_e4m3(amax / E2M1_MAX)
    return (round_e2m1(g / s) * s).flatten(-2).to(x.dtype)


def _weight_scale(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    return pow2_ceil(amax.float().clamp(min=ACT_AMAX_FLOOR) / fmax)


def fp8_weight_quant(w: torch.Tensor, block: int = ACT_GROUP) -> torch.Tensor:
    """A dense ``[out, in]`` weight as stored: e4m3 per ``block`` x ``block`` tile, UE8M0 scale
    (edge tiles are partial, as the checkpoint's ceil-divided scale grid)."""
    out_dim, in_dim = w.shape
    po, pi = -out_dim % block, -in_dim % block
    p = torch.nn.functional.pad(w.float(), (0, pi, 0, po))
    tiles = p.unflatten(0, (-1, block)).unflatten(2, (-1, block))  # [Bo, b, Bi, b]
    s = _weight_scale(tiles.abs().amax(dim=(1, 3), keepdim=True), E4M3_MAX)
    q = (round_e4m3(tiles / s) * s).flatten(2).flatten(0, 1)
    return q[:out_dim, :in_dim].to(w.dtype)


def fp4_weight_quant(w: torch.Tensor, group: int = FP4_GROUP) -> torch.Tensor:
    """Routed experts' weights (``[..., in]``: K last) as stored: e2m1 per ``group`` along K,
    UE8M0 scale."""
    g = _grouped(w, group)
    s = _weight_scale(g.abs().amax(-1, keepdim=True), E2M1_MAX)
    return (round_e2m1(g / s) * s).flatten(-2).to(w.dtype)
