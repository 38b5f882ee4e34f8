"""Quantise-dequantise of the release's numerics (DeepSeek-V4.1 as shipped), in plain torch.

Each function returns the values the quantised format stores, converted back to the input's dtype,
so a layer that calls it computes what a kernel computes from fp8/fp4 operands and their scales
(up to accumulation order). Everything is deterministic and local to one row's group (activations)
or one weight block: the oracle and the engine that call these functions get the same bits, so E1
stays bitwise.

Formats (SPEC 1b, after DeepSeek's inference code ``act_quant`` / ``weight_dequant`` with
``scale_fmt="ue8m0"``):

* UE8M0 scale: a power of two, ``2 ** ceil(log2(amax / fmax))``, so ``x / scale`` never exceeds the
  format's largest finite value (amax clamped at ``1e-4`` as the reference does);
* fp8 e4m3 (fn: no inf, max 448): round to nearest, ties to even (torch's cast);
* fp4 e2m1 (grid 0, 0.5, 1, 1.5, 2, 3, 4, 6): round to nearest, ties to even mantissa;
* activations: per 32 consecutive elements of a row, e4m3 with a UE8M0 scale;
* dense weights: e4m3 per square block (``block`` x ``block``) with a UE8M0 scale;
* routed experts: e2m1 per 32 along K (the input dimension) with a UE8M0 scale;
* compressed KV: e2m1 in groups of 16 with an e4m3 scale (``amax / 6`` cast to e4m3).
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0
AMAX_FLOOR = 1e-4
ACT_GROUP = 32
FP4_GROUP = 32
KV_FP4_GROUP = 16

_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def ue8m0_scale(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    """The power-of-two scale that maps ``amax`` to at most ``fmax`` (fp32)."""
    s = amax.float().clamp(min=AMAX_FLOOR) / fmax
    return torch.exp2(torch.ceil(torch.log2(s)))


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32, already within +-448) on the e4m3 grid."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32) on the e2m1 grid, saturating at +-6; ties go to the even code."""
    grid = torch.tensor(_E2M1_GRID, device=x.device)
    mids = (grid[1:] + grid[:-1]) / 2
    a = x.float().abs().clamp(max=E2M1_MAX)
    idx = torch.bucketize(a, mids, right=True)  # a tie rounds up here ...
    tie = (idx > 0) & (a == mids[(idx - 1).clamp(min=0)])
    idx = torch.where(tie & (idx % 2 == 1), idx - 1, idx)  # ... and back down to an even code
    return torch.copysign(grid[idx], x.float())


def _grouped(x: torch.Tensor, group: int) -> torch.Tensor:
    if x.shape[-1] % group:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of the group {group}")
    return x.float().unflatten(-1, (-1, group))


def act_quant(x: torch.Tensor, group: int = ACT_GROUP) -> torch.Tensor:
    """Activations as the fp8 GEMM reads them: e4m3 per ``group`` elements of a row, UE8M0."""
    g = _grouped(x, group)
    s = ue8m0_scale(g.abs().amax(-1, keepdim=True), E4M3_MAX)
    return (round_e4m3(g / s) * s).flatten(-2).to(x.dtype)


def fp8_weight_quant(w: torch.Tensor, block: int) -> torch.Tensor:
    """A dense ``[out, in]`` weight as stored: e4m3 per ``block`` x ``block`` tile, UE8M0 scale
    (edge tiles are partial, as the checkpoint's ceil-divided scale grid)."""
    out_dim, in_dim = w.shape
    po, pi = -out_dim % block, -in_dim % block
    p = torch.nn.functional.pad(w.float(), (0, pi, 0, po))
    tiles = p.unflatten(0, (-1, block)).unflatten(2, (-1, block))  # [Bo, b, Bi, b]
    s = ue8m0_scale(tiles.abs().amax(dim=(1, 3), keepdim=True), E4M3_MAX)
    q = (round_e4m3(tiles / s) * s).flatten(2).flatten(0, 1)
    return q[:out_dim, :in_dim].to(w.dtype)


def fp4_quant(x: torch.Tensor, group: int = FP4_GROUP) -> torch.Tensor:
    """Routed experts' weights (``[..., in]``: K last): e2m1 per ``group`` along K, UE8M0."""
    g = _grouped(x, group)
    s = ue8m0_scale(g.abs().amax(-1, keepdim=True), E2M1_MAX)
    return (round_e2m1(g / s) * s).flatten(-2).to(x.dtype)


def fp4_quant_e4m3_scale(x: torch.Tensor, group: int = KV_FP4_GROUP) -> torch.Tensor:
    """Compressed KV: e2m1 per ``group`` of a row with an e4m3 scale (``amax / 6`` on the e4m3
    grid; an all-zero group stays zero)."""
    g = _grouped(x, group)
    s = round_e4m3(g.abs().amax(-1, keepdim=True) / E2M1_MAX)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    return (round_e2m1(g / safe) * s).flatten(-2).to(x.dtype)
