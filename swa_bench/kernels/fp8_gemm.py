"""``fp8_gemm``: the release's fp8 GEMMs on fp8 tensor cores, dense (``fp8_gemm`` of
DeepSeek-V4.1's inference code) and grouped by expert (``fp4_gemm``'s experts, re-encoded).

Operands are ``Fp8Operand``\\ s: e4m3 codes and one UE8M0 scale byte per 32 along K.
* Activations: ``activation_operand``, ``act_quant``'s bits (one Triton launch; the PyTorch
  function elsewhere), so ``codes * scale`` is exactly what ``linear_input`` returns.
* Weights: ``weight_operand`` re-encodes the stored values (``quant.fp8_weight_quant``'s 32 x 32
  blocks, ``quant.fp4_weight_quant``'s e2m1 per 32) per row and 32 along K, each group with the
  smallest power of two that keeps it within 448. That is exact: a stored value is a code times
  its block's scale, the new scale is at most that one, and a code times a power of two >= 1
  stays on the e4m3 grid below 448 (an e2m1 group's smallest non-zero value is >= 1/12 of its
  largest, so it stays normal). An all-zero group gets the scale 1. ``weight_operand`` checks
  every value comes back and every scale is a normal UE8M0 value (byte 1 to 254).

So the fp8 GEMM multiplies the same values as the bf16 GEMM of the stored values that
``precision.QUANTISED_GEMM`` names; only the order and width of the fp32 sums differ (the MMA's
sum of each 32 products, then round-to-nearest fp32 adds: ``triton_fp8_gemm``). Fixed tiles per
weight shape, no split-K: a row's result does not depend on the batch. Held to a float64
oracle of the stored values within fp32 round-to-nearest sums (tests/kernels/test_fp8_gemm.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.flop_counter import register_flop_formula

from swa_bench.kernels import quant
from swa_bench.kernels.config import Kernels, call_op, next_pow2
from swa_bench.kernels.launch import launch

GROUP_K = quant.ACT_GROUP  # one UE8M0 scale per 32 along K, both operands
E4M3 = torch.float8_e4m3fn
UE8M0_BIAS = 127


@dataclass(frozen=True)
class GemmTile:
    """One launch configuration of the fp8 GEMM (a property of the weight's shape, never of
    the batch: ``tile_for``)."""

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 4

    def label(self) -> str:
        return f"{self.block_m}x{self.block_n},{self.num_warps},{self.num_stages}"


DEFAULT_TILE = GemmTile()


def tile_for(n: int, k: int) -> GemmTile:
    """The tile of a ``[N, K]`` weight's GEMMs."""
    return DEFAULT_TILE


@dataclass(frozen=True)
class Fp8Operand:
    """An fp8 GEMM operand: e4m3 ``codes [..., K]`` and UE8M0 ``scales [..., K / 32]`` (the
    bytes: value ``2 ** (byte - 127)``)."""

    codes: torch.Tensor
    scales: torch.Tensor

    def values(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``codes * scale``, exact in fp32 (and in bf16)."""
        scale = torch.ldexp(torch.ones(self.scales.shape, device=self.scales.device),
                            self.scales.to(torch.int32) - UE8M0_BIAS)
        grouped = self.codes.float().unflatten(-1, (-1, GROUP_K)) * scale[..., None]
        return grouped.flatten(-2).to(dtype)


def _scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    """A positive normal power of two's UE8M0 byte (its fp32 exponent field)."""
    return ((scale.float().contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


def weight_operand(w: torch.Tensor) -> Fp8Operand:
    """A stored weight ``[..., N, K]`` (its values on the release's fp8 or fp4 grid) as e4m3
    codes with a UE8M0 scale per row and 32 along K, exactly (see the module's docstring): each
    group's scale is ``2 ** ceil(log2(amax / 448))`` (an all-zero group's is 1). A value that
    does not come back, or a scale outside UE8M0's normal range, is refused: the weight was not
    on a grid. Encoded once per weight, where it lives, not per call."""
    if w.shape[-1] % GROUP_K:
        raise ValueError(f"weight_operand: K = {w.shape[-1]} is not a multiple of {GROUP_K}")
    if w.dim() > 2:  # a set of experts: one at a time (V4.1-Flash's are 27 GB in bf16)
        parts = [weight_operand(e) for e in w]
        return Fp8Operand(torch.stack([p.codes for p in parts]),
                          torch.stack([p.scales for p in parts]))
    g = w.detach().double().unflatten(-1, (-1, GROUP_K))
    amax = g.abs().amax(-1, keepdim=True)
    mantissa, exponent = torch.frexp(amax / quant.E4M3_MAX)  # x = m 2^e, 0.5 <= m < 1
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)  # ceil(log2 x)
    exponent = torch.where(amax > 0, exponent, torch.zeros_like(exponent))  # a zero group: 1
    if not ((exponent >= 1 - UE8M0_BIAS) & (exponent <= UE8M0_BIAS)).all():
        raise ValueError("weight_operand: a group's scale is outside UE8M0's normal range")
    scale = torch.ldexp(torch.ones_like(amax), exponent)
    codes = (g / scale).float()
    if not torch.equal(codes.to(E4M3).double() * scale, g):
        raise ValueError("weight_operand: a value is not on the fp8 grid of its group")
    return Fp8Operand(codes.flatten(-2).to(E4M3).contiguous(),
                      _scale_bytes(scale.squeeze(-1)).contiguous())


def activation_operand(kernels: Kernels, x: torch.Tensor) -> Fp8Operand:
    """``x [M, K]`` as the fp8 GEMM reads it: ``act_quant``'s codes and scale bytes (one
    Triton launch on the Triton backend, the PyTorch function elsewhere)."""
    if x.shape[-1] % GROUP_K:
        raise ValueError(f"activation_operand: K = {x.shape[-1]} is not a multiple of "
                         f"{GROUP_K}")
    if not (kernels.inference(x) and x.is_contiguous()):
        codes, scale = quant.act_quant_parts(x)
        return Fp8Operand(codes.flatten(-2).to(E4M3), _scale_bytes(scale.squeeze(-1)))
    from swa_bench.kernels import triton_quant

    codes = torch.empty(x.shape, dtype=E4M3, device=x.device)
    n_groups = x.numel() // GROUP_K
    scales = torch.empty(*x.shape[:-1], x.shape[-1] // GROUP_K, dtype=torch.uint8,
                         device=x.device)
    if n_groups:
        block_g = 128
        launch(triton_quant.e4m3_codes_kernel, (-(-n_groups // block_g),),
               x, codes, scales, n_groups, GROUP=GROUP_K, BLOCK_G=block_g,
               direct=kernels.direct_launch, num_warps=4)
    return Fp8Operand(codes, scales)


def _fp8_gemm(a_codes: torch.Tensor, a_scales: torch.Tensor, b_codes: torch.Tensor,
              b_scales: torch.Tensor, ends: torch.Tensor | None, out_dtype: torch.dtype,
              interpret: bool, direct: bool, block_m: int, block_n: int, num_warps: int,
              num_stages: int) -> torch.Tensor:
    from swa_bench.kernels import triton_fp8_gemm

    rows, k = a_codes.shape
    groups = b_codes.shape[0] if b_codes.dim() == 3 else 1
    n = b_codes.shape[-2]
    y = torch.empty(rows, n, dtype=out_dtype, device=a_codes.device)
    grouped = ends is not None
    row_tiles = -(-rows // block_m) + (groups if grouped else 0)
    if rows and n:
        launch(triton_fp8_gemm.scaled_fp8_gemm_kernel, (-(-n // block_n), row_tiles),
               a_codes, a_scales, b_codes, b_scales, y, ends if grouped else a_scales,
               rows, n, k, a_codes.stride(0), a_scales.stride(0),
               b_codes.stride(0) if grouped else 0, b_codes.stride(-2),
               b_scales.stride(0) if grouped else 0, b_scales.stride(-2), y.stride(0),
               G=groups, G_PAD=max(2, next_pow2(groups + 1)), GROUPED=grouped, BLOCK_M=block_m,
               BLOCK_N=block_n, GROUP_K=GROUP_K, INTERPRET=interpret, direct=direct,
               num_warps=num_warps, num_stages=num_stages)
    return y


fp8_gemm_op = torch.library.custom_op("swa_bench::fp8_gemm", _fp8_gemm, mutates_args=())


@fp8_gemm_op.register_fake
def _(a_codes, a_scales, b_codes, b_scales, ends, out_dtype, *args):
    n = b_codes.shape[-2]
    return a_codes.new_empty(a_codes.shape[0], n, dtype=out_dtype)


@register_flop_formula(torch.ops.swa_bench.fp8_gemm)
def _fp8_gemm_flop_formula(a_shape, a_scales_shape, b_shape, *args, out_shape=None,
                           **kwargs) -> int:
    return 2 * a_shape[0] * a_shape[1] * b_shape[-2]


def _check(a: Fp8Operand, b: Fp8Operand, ends: torch.Tensor | None,
           out_dtype: torch.dtype) -> None:
    """Refuse, in one line each, operands the kernel would misread: it assumes e4m3 codes and
    UE8M0 bytes with unit stride along K, one byte per 32 codes, and (grouped) one int32
    cumulative row end per group."""
    grouped = b.codes.dim() == 3
    if grouped != (ends is not None):
        raise ValueError("fp8_gemm: a grouped weight [G, N, K] takes ends, a dense one none")
    if b.codes.dim() not in (2, 3) or (grouped and a.codes.dim() != 2):
        raise ValueError(f"fp8_gemm: weight codes must be [N, K] or [G, N, K] (then a [M, K]), "
                         f"got {tuple(b.codes.shape)} and {tuple(a.codes.shape)}")
    k = b.codes.shape[-1]
    if a.codes.shape[-1] != k:
        raise ValueError(f"fp8_gemm: K differs ({a.codes.shape[-1]} vs {k})")
    if k % GROUP_K:
        raise ValueError(f"fp8_gemm: K = {k} is not a multiple of {GROUP_K}")
    for name, op in (("a", a), ("b", b)):
        if op.codes.dtype != E4M3 or op.scales.dtype != torch.uint8:
            raise ValueError(f"fp8_gemm: {name} must be e4m3 codes and uint8 UE8M0 bytes, got "
                             f"{op.codes.dtype} and {op.scales.dtype}")
        if op.scales.shape != (*op.codes.shape[:-1], k // GROUP_K):
            raise ValueError(f"fp8_gemm: {name}'s scales {tuple(op.scales.shape)} do not match "
                             f"its codes {tuple(op.codes.shape)} (one per {GROUP_K} along K)")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"fp8_gemm: out_dtype must be bf16 or fp32, got {out_dtype}")
    if grouped and (ends.dtype != torch.int32 or ends.shape != (b.codes.shape[0],)):
        raise ValueError(f"fp8_gemm: ends must be int32 [G = {b.codes.shape[0]}], got "
                         f"{ends.dtype} {tuple(ends.shape)}")


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def fp8_gemm(kernels: Kernels, a: Fp8Operand, b: Fp8Operand, ends: torch.Tensor | None = None,
             out_dtype: torch.dtype = torch.bfloat16, tile: GemmTile | None = None
             ) -> torch.Tensor:
    """``a [..., K] @ b^T`` in fp32 sums, as ``out_dtype [..., N]``: ``b [N, K]``; or ``b [G,
    N, K]`` with ``a [M, K]`` and ``ends [G]`` (int32 cumulative row ends, non-decreasing: the
    rows of ``a`` sorted by group): the rows of group ``g`` times ``b[g]``, and the rows past
    ``ends[-1]`` zeros. The Triton kernel (compiled on CUDA, interpreted on CPU); no host read
    of ``ends``, so a captured graph replays each step's routing."""
    _check(a, b, ends, out_dtype)
    n, k = b.codes.shape[-2:]
    lead = a.codes.shape[:-1]
    a_codes = _unit_stride(a.codes.reshape(-1, k))
    a_scales = _unit_stride(a.scales.reshape(-1, k // GROUP_K))
    tile = tile or tile_for(n, k)
    ends = None if ends is None else _unit_stride(ends)
    y = call_op(fp8_gemm_op, _fp8_gemm, a_codes, a_scales, _unit_stride(b.codes),
                _unit_stride(b.scales), ends, out_dtype, kernels.interpret,
                kernels.direct_launch, tile.block_m, tile.block_n, tile.num_warps,
                tile.num_stages)
    return y.view(*lead, n)
