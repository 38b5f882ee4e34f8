"""The release's quantise-dequantise against a float64 restatement of each format: the finite
grids enumerated from their bit fields, nearest value with ties to the even code, power-of-two
scales from ``math``."""

import math

import numpy as np
import pytest
import torch

from swa_bench.kernels import quant


def e4m3_grid() -> list[tuple[float, int]]:
    """Every finite non-negative e4m3fn value with its 7-bit code (bias 7; 0x7f is NaN)."""
    vals = []
    for code in range(0x7F):
        e, m = code >> 3, code & 7
        v = m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        vals.append((v, code))
    return vals


def e2m1_grid() -> list[tuple[float, int]]:
    vals = []
    for code in range(8):
        e, m = code >> 1, code & 1
        vals.append((m / 2 if e == 0 else (1 + m / 2) * 2.0 ** (e - 1), code))
    return vals


def nearest(x: float, grid: list[tuple[float, int]]) -> float:
    a = min(abs(x), grid[-1][0])
    best = min(grid, key=lambda vc: (abs(vc[0] - a), vc[1] & 1))
    return math.copysign(best[0], x)


def ceil_pow2(p: float) -> float:
    """2 ** ceil(log2(p)), exactly (``frexp``: p = m * 2**e, 0.5 <= m < 1)."""
    m, e = math.frexp(p)
    return 2.0 ** (e - 1 if m == 0.5 else e)


def pow2_scale(amax: float, fmax: float, floor: float = 1e-4) -> float:
    """The kernels' UE8M0 scale: amax (floored, fp32) times the fp32 reciprocal, in fp32."""
    p = np.float32(max(np.float32(amax), np.float32(floor))) * np.float32(1.0 / fmax)
    return ceil_pow2(float(np.float32(p)))


def weight_scale(amax: float, fmax: float) -> float:
    """The converter's: amax (floored at 1e-4) over the largest value, in fp32."""
    return ceil_pow2(float(np.float32(np.float32(max(amax, 1e-4)) / np.float32(fmax))))


def restate_groups(row: list[float], group: int, grid, fmax: float, scale=None) -> list[float]:
    out = []
    for g0 in range(0, len(row), group):
        g = row[g0:g0 + group]
        s = pow2_scale(max(abs(v) for v in g), fmax) if scale is None else scale(g)
        out += [nearest(v / s, grid) * s for v in g]
    return out


def sample(shape, seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-6, 7, shape, generator=gen))
    return x


def test_e4m3_grid_matches_torch():
    pts = torch.tensor([v for v, _ in e4m3_grid()])
    assert torch.equal(quant.round_e4m3(pts), pts)
    assert pts.max().item() == quant.E4M3_MAX


def test_e2m1_rounding_ties_to_even():
    grid = e2m1_grid()
    xs = [k / 8 for k in range(-60, 61)]  # every midpoint and beyond the largest value
    got = quant.round_e2m1(torch.tensor(xs)).tolist()
    assert got == [nearest(x, grid) for x in xs]
    assert quant.round_e2m1(torch.tensor([0.25, 0.75, 2.5, 5.0])).tolist() == [0.0, 1.0, 2.0, 4.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_act_quant_per_32_ue8m0(dtype):
    x = sample((3, 64)).to(dtype)
    got = quant.act_quant(x)
    assert got.dtype == dtype
    grid = e4m3_grid()
    for r in range(3):
        want = restate_groups(x[r].double().tolist(), 32, grid, 448.0)
        assert got[r].double().tolist() == torch.tensor(want).to(dtype).double().tolist()


def test_act_quant_is_row_local():
    x = sample((4, 64), seed=1)
    whole = quant.act_quant(x)
    assert torch.equal(whole[2:], quant.act_quant(x[2:]))
    y = x.clone()
    y[0, :32] *= 1000  # another group's scale changes nothing outside it
    assert torch.equal(quant.act_quant(y)[:, 32:], whole[:, 32:])


def test_fp8_weight_block_scales():
    w, block = sample((40, 24), seed=2), 16  # partial edge tiles on both axes
    got = quant.fp8_weight_quant(w, block)
    grid, wd = e4m3_grid(), w.double()
    for bo in range(0, 40, block):
        for bi in range(0, 24, block):
            tile = wd[bo:bo + block, bi:bi + block]
            s = weight_scale(tile.abs().max().item(), 448.0)
            want = torch.tensor([[nearest(v / s, grid) * s for v in row] for row in tile.tolist()])
            assert torch.equal(got[bo:bo + block, bi:bi + block].double(), want)


def test_fp4_experts_per_32_along_k():
    w = sample((2, 3, 64), seed=3)  # [experts, out, in]
    got = quant.fp4_weight_quant(w)
    grid = e2m1_grid()
    for e in range(2):
        for o in range(3):
            want = restate_groups(w[e, o].double().tolist(), 32, grid, 6.0,
                                  scale=lambda g: weight_scale(max(map(abs, g)), 6.0))
            assert got[e, o].double().tolist() == want


def test_fp4_kv_e4m3_scales_per_16():
    x = sample((3, 48), seed=4)
    x[1, :16] = 0
    got = quant.fp4_act_quant_e4m3_scale(x)
    e4, e2 = e4m3_grid(), e2m1_grid()

    def scale(g):  # amax floored at 6 * 2**-9: the smallest e4m3 subnormal, never 0
        return nearest(float(np.float32(max(max(abs(v) for v in g), 6 * 2.0**-9) / 6.0)), e4)

    for r in range(3):
        want = restate_groups(x[r].double().tolist(), 16, e2, 6.0, scale=scale)
        assert got[r].double().tolist() == want
    assert torch.equal(got[1, :16], torch.zeros(16))


def test_group_mismatch_is_refused():
    with pytest.raises(ValueError, match="multiple of the group"):
        quant.act_quant(torch.ones(2, 40))


def test_fp4_indexer_e8m0_per_32():
    x = sample((3, 64), seed=5)
    x[2, 32:] = 0  # an all-zero group: floored amax, zero values
    got = quant.fp4_act_quant(x)
    grid = e2m1_grid()
    for r in range(3):
        want = restate_groups(x[r].double().tolist(), 32, grid, 6.0,
                              scale=lambda g: pow2_scale(max(map(abs, g)), 6.0, 6 * 2.0**-126))
        assert got[r].double().tolist() == want
    assert torch.equal(got[2, 32:], torch.zeros(32))


def test_scale_ceiling_is_exact_just_above_a_power_of_two():
    """A rounded ``log2`` reads 2**10 * (1 + 2**-23) as 10: the kernels' bit rule says 11."""
    x = torch.tensor([2.0**10, 2.0**10 * (1 + 2.0**-23), 3.0, 0.75])
    assert quant.pow2_ceil(x).tolist() == [2.0**10, 2.0**11, 4.0, 1.0]


@pytest.mark.parametrize("fn", [quant.fp8_weight_quant, quant.fp4_weight_quant])
def test_weight_quant_is_idempotent(fn):
    """A checkpoint's weights, dequantised, are already on the grid: quantising them again at
    build changes no value."""
    w = sample((64, 96), seed=6).to(torch.bfloat16)
    once = fn(w)
    assert torch.equal(fn(once), once)
