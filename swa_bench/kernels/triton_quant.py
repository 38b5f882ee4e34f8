"""The Triton kernel of ``group_quant``: a tensor's groups quantised and dequantised in one pass.

``kernels.quant``'s functions take a dozen PyTorch passes over fp32 copies of their input (the
amax, the scale from its bits, the division, the rounding, the product, the cast back); under
``precision: fp8`` they ran on every fp8 GEMM's input, every routed row and every KV vector and
added half the bf16 step's time. Here each program reads ``BLOCK_G`` groups once and writes their
stored values once, computing every step as ``kernels.quant`` does, bit for bit:

* the scale's ceiling from the fp32 bits, its reciprocal from the bits too (a power of two's is
  exact), so ``x * (1 / s)`` is ``x / s`` exactly; an e4m3 scale (compressed KV) is not a power of
  two, so those two divisions are correctly rounded ones (``div_rn``);
* e4m3 rounding on the fp32 bits (3 mantissa bits, to nearest even, with e4m3's subnormal step
  2**-9 below 2**-6) and e2m1 rounding by intervals (steps of 0.5, 1 and 2), each to nearest even
  through the 2**23 trick on a non-negative value; the sign is put back from the bits, so
  ``-0.0`` stays ``-0.0`` as ``copysign`` keeps it.

No hardware conversion is used: the interpreter (CPU) and a GPU compute the same bits.
Imported lazily (``swa_bench.kernels.group_quant``), as ``triton_mqa`` is.
"""

from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

E4M3 = tl.constexpr(0)  # e4m3 per group, UE8M0 scale: act_quant
E2M1 = tl.constexpr(1)  # e2m1 per group, UE8M0 scale: fp4_act_quant
E2M1_E4M3_SCALE = tl.constexpr(2)  # e2m1 per group, e4m3 scale: fp4_act_quant_e4m3_scale

SIGN = tl.constexpr(-2147483648)  # 0x80000000 as an int32
ROUND_2_23 = tl.constexpr(8388608.0)
INV_448 = tl.constexpr(float(np.float32(1.0 / 448.0)))  # the fp32 reciprocals quant.py uses
INV_6 = tl.constexpr(float(np.float32(1.0 / 6.0)))


@triton.jit
def _rint(a):
    """``a`` (fp32, 0 <= a < 2**22) rounded to the nearest integer, ties to even."""
    return (a + ROUND_2_23) - ROUND_2_23


@triton.jit
def _pow2_ceil(x):
    """``2 ** ceil(log2(x))`` of positive normal fp32 ``x`` from its bits (``quant.pow2_ceil``)."""
    bits = x.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (exp << 23).to(tl.float32, bitcast=True)


@triton.jit
def _reciprocal_pow2(s):
    """``1 / s`` of a power of two ``s`` (normal, as is its reciprocal), exactly."""
    return ((254 << 23) - s.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_magnitude(a):
    """``a`` (fp32, 0 <= a <= 448) on the e4m3 grid: 3 mantissa bits, to nearest even; below
    2**-6 the subnormal step 2**-9."""
    bits = a.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    subnormal = _rint(a * 512.0) * 0.001953125
    return tl.where(a >= 0.015625, normal, subnormal)


@triton.jit
def _e2m1_magnitude(a):
    """``a`` (fp32, >= 0) on the e2m1 grid (0, 0.5, 1, 1.5, 2, 3, 4, 6), saturating at 6, ties to
    the even code: steps of 0.5 below 2, of 1 below 4, of 2 above."""
    a = tl.minimum(a, 6.0)
    low = _rint(a * 2.0) * 0.5
    mid = _rint(a)
    high = _rint(a * 0.5) * 2.0
    return tl.where(a < 2.0, low, tl.where(a < 4.0, mid, high))


@triton.jit
def _with_sign(magnitude, x):
    """``copysign(magnitude, x)`` on the bits."""
    sign = x.to(tl.int32, bitcast=True) & SIGN
    return (magnitude.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_groups(x):
    """``act_quant`` of fp32 groups ``x [G, GROUP]``: the e4m3 codes and each group's scale."""
    s = _pow2_ceil(tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4) * INV_448)
    v = tl.minimum(tl.maximum(x * _reciprocal_pow2(s)[:, None], -448.0), 448.0)
    return _with_sign(_e4m3_magnitude(tl.abs(v)), v), s


@triton.jit
def group_quant_kernel(X, Y, n_groups, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                       FORMAT: tl.constexpr):
    """``BLOCK_G`` consecutive groups of ``GROUP`` elements of the contiguous ``X``, their stored
    values written to ``Y`` in ``Y``'s dtype (exact: each is a format value times its scale)."""
    g = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
    offs = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = (g < n_groups)[:, None]
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    if FORMAT == E4M3:
        q, s = _e4m3_groups(x)
    elif FORMAT == E2M1:
        s = _pow2_ceil(tl.maximum(amax, 6.0 * 2.0**-126) * INV_6)
        v = x * _reciprocal_pow2(s)[:, None]
        q = _with_sign(_e2m1_magnitude(tl.abs(v)), v)
    else:
        s = _e4m3_magnitude(tl.minimum(tl.math.div_rn(tl.maximum(amax, 6.0 * 2.0**-9), 6.0), 448.0))
        v = tl.math.div_rn(x, s[:, None])
        q = _with_sign(_e2m1_magnitude(tl.abs(v)), v)
    tl.store(Y + offs, (q * s[:, None]).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def e4m3_codes_kernel(X, Q, S, n_groups, GROUP: tl.constexpr, BLOCK_G: tl.constexpr):
    """``E4M3``'s two parts for ``fp8_gemm``: each group's e4m3 codes to ``Q`` (fp8: each code
    is on the grid, so the conversion is exact) and its UE8M0 scale's byte to ``S``."""
    g = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
    offs = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = (g < n_groups)[:, None]
    q, s = _e4m3_groups(tl.load(X + offs, mask=mask, other=0.0).to(tl.float32))
    tl.store(Q + offs, q.to(Q.dtype.element_ty), mask=mask)
    exp = (s.to(tl.int32, bitcast=True) >> 23) & 0xFF
    tl.store(S + g, exp.to(tl.uint8), mask=g < n_groups)
