"""``fp8_gemm`` (issue 28) against an oracle computed here: the float64 product of the values the
release stores (``quant.act_quant`` of the input, ``quant.fp8_weight_quant`` /
``quant.fp4_weight_quant`` of the weight), never the operands' own ``values()``, so a fault in the
encoding (``weight_operand``, ``activation_operand``) is caught as surely as one in the kernel.

The error bound. Every product of an e4m3 code pair is exact in fp32 (4 x 4 significant bits) and
so is its power-of-two scale (no scale here leaves fp32's normal range), so the kernel sums ``K``
exact products in fp32, round to nearest, in some order: the MMA's sum of 32 (numpy's fp32 matmul
in the interpreter), then one add a K group. Any order of ``K`` fp32 round-to-nearest additions
errs by at most ``gamma(K - 1) = (K - 1) u / (1 - (K - 1) u)`` times ``sum |products|`` (Higham,
Accuracy and Stability, 4.2), ``u = 2**-24``; for ``K (K - 1) u <= 1`` (K <= 4096) that is at most
``K u``. So each output element must lie within ``K * 2**-24 * (|x| @ |w|^T)`` of float64; with a
bf16 output, the fp32 result rounded to nearest even. Hopper's fp8 MMA does not round its sum of
32 to nearest (DeepSeek-V3, 3.3.2: about 14 bits kept), so the CUDA tests use ``2**-13`` per unit
of ``sum |products|`` instead (unverified until an H200 runs them).

CPU tests run the kernel through Triton's interpreter at tiny shapes with a 16 x 32 tile, so M
and N cross tile edges; the compiled kernel is built for sm_90 here too (no launch), and
launched in the tests marked cuda.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from swa_bench.kernels import Kernels, quant
from swa_bench.kernels import fp8_gemm as F
from tests.kernels.conftest import TRITON
from tests.kernels.test_group_quant import E4M3_TIES, assert_same_bits, edge_rows, wide_rows

ROOT = Path(__file__).resolve().parents[2]
TILE = F.GemmTile(16, 32, 4, 1)  # small enough that the tiny shapes span several tiles
U = 2.0**-24


# --- the oracle: independent of swa_bench.kernels.fp8_gemm ---------------------------------------

def dequantised(op: F.Fp8Operand) -> torch.Tensor:
    """An operand's values in float64, from its bytes: ``code * 2 ** (byte - 127)``."""
    scale = torch.pow(2.0, op.scales.double() - 127).repeat_interleave(32, -1)
    return op.codes.double() * scale


def oracle(x: torch.Tensor, w: torch.Tensor, counts: list[int] | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 product of ``act_quant(x)`` and the stored ``w`` (``[N, K]``, or ``[G, N,
    K]`` with ``counts`` rows a group, the rows past their sum zero) and ``sum |products|``."""
    xq = quant.act_quant(x.float()).double()
    if counts is None:
        wd = w.double()
        return xq @ wd.T, xq.abs() @ wd.abs().T
    want = torch.zeros(xq.shape[0], w.shape[-2], dtype=torch.float64)
    size = torch.zeros_like(want)
    start = 0
    for g, count in enumerate(counts):
        rows, wd = slice(start, start + count), w[g].double()
        want[rows], size[rows] = xq[rows] @ wd.T, xq[rows].abs() @ wd.abs().T
        start += count
    return want, size


def assert_within_bound(y: torch.Tensor, want: torch.Tensor, size: torch.Tensor, k: int,
                        per_size: float | None = None) -> float:
    """Each element within ``per_size * size`` of float64 (``K u``: fp32 round-to-nearest sums
    of exact products), a bf16 output within half its own ulp more; returns the largest error
    as a fraction of its bound."""
    per_size = k * U if per_size is None else per_size
    bound = per_size * size
    if y.dtype == torch.bfloat16:
        bound = bound + want.abs() * 2.0**-8
    err = (y.double() - want).abs()
    over = err > bound
    assert not over.any(), (f"{int(over.sum())} of {over.numel()} outside the bound, e.g. "
                            f"{y.double()[over][:3].tolist()} vs {want[over][:3].tolist()}")
    return float((err / bound.clamp(min=1e-300)).max()) if err.numel() else 0.0


# --- operands -------------------------------------------------------------------------------------

def spread(rows: int, k: int, seed: int, lo: float = -3.0, hi: float = 3.0) -> torch.Tensor:
    """Normal draws times a magnitude ``10 ** uniform(lo, hi)`` per 32 along a row: every K
    group's scale differs, so a scale byte read from the wrong group shows."""
    gen = torch.Generator().manual_seed(seed)
    mags = 10 ** (lo + (hi - lo) * torch.rand(rows, k // 32, 1, generator=gen))
    return (torch.randn(rows, k // 32, 32, generator=gen) * mags).flatten(-2)


def fp8_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """A stored fp8 Linear weight (bf16): 32 x 32 blocks of spread magnitudes, one all zero."""
    w = spread(n, k, seed, -2.0, 1.0)
    w[:32, :32] = 0.0
    return quant.fp8_weight_quant(w).bfloat16()


def fp4_experts(groups: int, n: int, k: int, seed: int) -> torch.Tensor:
    """Stored routed experts (bf16, e2m1 per 32 along K), with an all-zero group and a group
    below the weights' amax floor (1e-4) in the first expert."""
    w = torch.stack([spread(n, k, seed + g, -2.0, 1.0) for g in range(groups)])
    w[0, 0, :32] = 0.0
    w[0, 1, 32:64] = 3e-6
    return torch.stack([quant.fp4_weight_quant(e) for e in w]).bfloat16()


def ends_of(counts: list[int]) -> torch.Tensor:
    return torch.tensor(counts).cumsum(0).to(torch.int32)


# --- dense and grouped against float64 ------------------------------------------------------------

@pytest.mark.parametrize("m, n, k", [(1, 1, 32), (5, 40, 64), (17, 33, 96), (33, 70, 32)])
def test_dense_is_within_fp32_sums_of_float64(interpreter, m, n, k):
    x, w = spread(m, k, seed=m), fp8_weight(n, k, seed=n)
    a, b = F.activation_operand(TRITON, x), F.weight_operand(w)
    want, size = oracle(x, w)
    y = F.fp8_gemm(TRITON, a, b, out_dtype=torch.float32, tile=TILE)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert_within_bound(y, want, size, k)
    y16 = F.fp8_gemm(TRITON, a, b, tile=TILE)  # bf16 out: the fp32 sums rounded to nearest even
    assert_same_bits(y16, y.bfloat16())


def test_dense_takes_leading_dims_and_the_default_tile(interpreter):
    x, w = spread(6, 64, seed=3).view(2, 3, 64), fp8_weight(20, 64, seed=4)
    y = F.fp8_gemm(TRITON, F.activation_operand(TRITON, x), F.weight_operand(w),
                   out_dtype=torch.float32)
    assert y.shape == (2, 3, 20)
    want, size = oracle(x.reshape(6, 64), w)
    assert_within_bound(y.reshape(6, 20), want, size, 64)


# Rows a group: an empty group first, between and last, one group over several row tiles, and
# rows past ends[-1] (the tail), which come back zero.
GROUPINGS = [([5, 0, 17, 3], 4), ([0, 16, 1, 0], 0), ([0, 0, 0, 0], 3), ([33, 2, 0, 1], 0)]


@pytest.mark.parametrize("counts, tail", GROUPINGS)
def test_grouped_is_within_fp32_sums_of_float64(interpreter, counts, tail):
    rows, k, n = sum(counts) + tail, 64, 40
    x, w = spread(rows, k, seed=rows), fp4_experts(len(counts), n, k, seed=7)
    a, b = F.activation_operand(TRITON, x), F.weight_operand(w)
    want, size = oracle(x, w, counts)
    y = F.fp8_gemm(TRITON, a, b, ends_of(counts), out_dtype=torch.float32, tile=TILE)
    assert y.shape == (rows, n)
    assert_within_bound(y, want, size, k)
    assert torch.equal(y[sum(counts):], torch.zeros(tail, n))


def test_fp8_weights_grouped_and_one_group_is_the_dense_product(interpreter):
    """Experts stored fp8 (32 x 32 blocks) go the same way; one group over every row is the
    dense GEMM, bit for bit (same tile, same K order)."""
    x, w = spread(20, 96, seed=11), torch.stack([fp8_weight(36, 96, seed=s) for s in (1, 2)])
    a, b = F.activation_operand(TRITON, x), F.weight_operand(w)
    want, size = oracle(x, w, [8, 12])
    y = F.fp8_gemm(TRITON, a, b, ends_of([8, 12]), out_dtype=torch.float32, tile=TILE)
    assert_within_bound(y, want, size, 96)
    one = F.Fp8Operand(b.codes[1:], b.scales[1:])
    dense = F.fp8_gemm(TRITON, a, F.Fp8Operand(b.codes[1], b.scales[1]), tile=TILE)
    assert_same_bits(F.fp8_gemm(TRITON, a, one, ends_of([20]), tile=TILE), dense)


def test_the_flop_counter_sees_the_custom_op(interpreter):
    """Under a dispatch mode the call goes through the custom op and its formula, 2 M N K (a
    grouped row multiplies one group's weight), with the direct call's bits."""
    x, w = spread(7, 64, seed=1), fp8_weight(24, 64, seed=2)
    a, b = F.activation_operand(TRITON, x), F.weight_operand(w)
    direct = F.fp8_gemm(TRITON, a, b, tile=TILE)
    experts = F.Fp8Operand(torch.stack([b.codes] * 2), torch.stack([b.scales] * 2))
    with FlopCounterMode(display=False) as count:
        assert_same_bits(F.fp8_gemm(TRITON, a, b, tile=TILE), direct)
        F.fp8_gemm(TRITON, a, experts, ends_of([3, 4]), tile=TILE)
    assert count.get_total_flops() == 2 * (2 * 7 * 64 * 24)


# --- batch invariance ----------------------------------------------------------------------------

def test_a_rows_result_does_not_depend_on_the_batch(interpreter):
    """Dense: rows alone, at other tile positions and in reverse give the same bits. Grouped:
    a group's rows give the same bits whatever the groups before them hold."""
    x, w = spread(37, 64, seed=5), fp8_weight(40, 64, seed=6)
    b = F.weight_operand(w)

    def dense(rows):
        return F.fp8_gemm(TRITON, F.activation_operand(TRITON, rows), b,
                          out_dtype=torch.float32, tile=TILE)

    full = dense(x)
    for part in (slice(5, 9), slice(36, 37), slice(0, 1)):
        assert_same_bits(dense(x[part]), full[part])
    assert_same_bits(dense(x.flip(0)), full.flip(0))

    experts = F.weight_operand(fp4_experts(3, 40, 64, seed=8))

    def grouped(counts, rows):
        return F.fp8_gemm(TRITON, F.activation_operand(TRITON, rows), experts, ends_of(counts),
                          out_dtype=torch.float32, tile=TILE)

    mine = x[:20]
    alone = grouped([0, 20, 0], mine)
    for before in (1, 7, 16):
        other = spread(before, 64, seed=before)
        got = grouped([before, 20, 3], torch.cat([other, mine, x[20:23]]))
        assert_same_bits(got[before : before + 20], alone)


# --- the operands ---------------------------------------------------------------------------------

def test_weight_operand_round_trips_stored_fp8_and_fp4_weights():
    """Exactly, each group with the smallest power of two that keeps it within 448 (an all-zero
    group's scale 1); bf16 and fp32 weights alike."""
    for w in (fp8_weight(40, 96, seed=1), fp8_weight(40, 96, seed=1).float(),
              fp4_experts(3, 40, 64, seed=2)):
        op = F.weight_operand(w)
        assert op.codes.dtype == F.E4M3 and op.scales.dtype == torch.uint8
        assert op.scales.shape == (*w.shape[:-1], w.shape[-1] // 32)
        assert torch.equal(dequantised(op), w.double())
        amax = w.double().unflatten(-1, (-1, 32)).abs().amax(-1)
        ratio = amax / torch.pow(2.0, op.scales.double() - 127)
        assert ((ratio > 224) & (ratio <= 448) | (amax == 0)).all()
        assert (op.scales[amax == 0] == 127).all()
    assert (F.weight_operand(fp4_experts(1, 2, 64, seed=3)).scales[0, 0, 0] == 127)


def test_weight_operand_refuses_a_weight_off_the_grid():
    w = fp8_weight(8, 64, seed=1).float()
    w[2, 5] = 1.0625 * 2.0**-3  # five significant bits: on no e4m3 grid
    with pytest.raises(ValueError, match="not on the fp8 grid"):
        F.weight_operand(w)
    with pytest.raises(ValueError, match="not on the fp8 grid"):
        F.weight_operand(torch.randn(4, 32, generator=torch.Generator().manual_seed(0)))
    with pytest.raises(ValueError, match="UE8M0's normal range"):
        F.weight_operand(torch.full((1, 32), 2.0**-140))  # its scale would be 2**-149
    with pytest.raises(ValueError, match="K = 48 is not a multiple of 32"):
        F.weight_operand(torch.zeros(4, 48))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_operand_is_act_quant_bit_for_bit(interpreter, dtype):
    """The PyTorch route and the Triton kernel's: ``codes * 2 ** (byte - 127)`` is ``act_quant``
    bit for bit (ties, signed zeros, floors, saturation) and the two routes' bytes agree."""
    x = torch.cat([wide_rows((5, 128), dtype, seed=2).reshape(-1, 32),
                   edge_rows(32, 448.0, E4M3_TIES, dtype)])  # one K group a row
    want = quant.act_quant(x)
    routes = [F.activation_operand(Kernels("torch"), x), F.activation_operand(TRITON, x)]
    for op in routes:
        assert op.codes.dtype == F.E4M3 and op.scales.shape == (x.shape[0], 1)
        assert_same_bits(dequantised(op).to(dtype), want)
    assert torch.equal(routes[0].codes.view(torch.uint8), routes[1].codes.view(torch.uint8))
    assert torch.equal(routes[0].scales, routes[1].scales)


def test_bad_inputs_are_refused():
    a = F.activation_operand(Kernels("torch"), torch.ones(3, 64))
    b = F.weight_operand(torch.ones(5, 64))
    experts = F.Fp8Operand(torch.stack([b.codes] * 2), torch.stack([b.scales] * 2))
    with pytest.raises(ValueError, match="K = 48 is not a multiple of 32"):
        F.activation_operand(TRITON, torch.ones(3, 48))
    odd = F.Fp8Operand(torch.zeros(3, 48, dtype=F.E4M3), torch.zeros(3, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="K = 48 is not a multiple of 32"):
        F.fp8_gemm(TRITON, odd, F.Fp8Operand(odd.codes[:2], odd.scales[:2]))
    with pytest.raises(ValueError, match=r"K differs \(64 vs 32\)"):
        F.fp8_gemm(TRITON, a, F.weight_operand(torch.ones(5, 32)))
    with pytest.raises(ValueError, match="grouped weight .* takes ends"):
        F.fp8_gemm(TRITON, a, experts)
    with pytest.raises(ValueError, match="grouped weight .* takes ends"):
        F.fp8_gemm(TRITON, a, b, ends_of([3]))
    with pytest.raises(ValueError, match="ends must be int32"):
        F.fp8_gemm(TRITON, a, experts, ends_of([1, 2]).long())
    with pytest.raises(ValueError, match=r"ends must be int32 \[G = 2\]"):
        F.fp8_gemm(TRITON, a, experts, ends_of([3]))
    with pytest.raises(ValueError, match="scales .* do not match"):
        F.fp8_gemm(TRITON, F.Fp8Operand(a.codes, a.scales[:, :1]), b)
    with pytest.raises(ValueError, match="e4m3 codes and uint8"):
        F.fp8_gemm(TRITON, F.Fp8Operand(a.codes.float(), a.scales), b)
    with pytest.raises(ValueError, match="out_dtype must be bf16 or fp32"):
        F.fp8_gemm(TRITON, a, b, out_dtype=torch.float16)


# --- seeded faults: the oracle comparison catches them -------------------------------------------

def test_an_off_by_one_scale_byte_is_caught(interpreter, monkeypatch):
    """One K group's weight scale one step too large (a byte off by one), from a patched
    ``_scale_bytes``: the weight encodes without complaint and the oracle catches the product."""
    x, w = spread(9, 64, seed=1), fp8_weight(20, 64, seed=2)
    want, size = oracle(x, w)
    real = F._scale_bytes

    def off_by_one(scale):
        out = real(scale)
        out[..., 1] += 1
        return out

    monkeypatch.setattr(F, "_scale_bytes", off_by_one)
    b = F.weight_operand(w)
    monkeypatch.undo()
    y = F.fp8_gemm(TRITON, F.activation_operand(TRITON, x), b, out_dtype=torch.float32,
                   tile=TILE)
    with pytest.raises(AssertionError, match="outside the bound"):
        assert_within_bound(y, want, size, 64)


def test_a_swapped_group_and_a_shifted_end_are_caught(interpreter, monkeypatch):
    """The kernel handed experts 0 and 2 swapped (a patched launch), or one row moved to the
    next group: each breaks the bound."""
    counts = [5, 0, 17, 3]
    x, w = spread(sum(counts), 64, seed=3), fp4_experts(4, 40, 64, seed=4)
    a, b = F.activation_operand(TRITON, x), F.weight_operand(w)
    want, size = oracle(x, w, counts)
    real = F.launch
    swap = [2, 1, 0, 3]

    def swapped(kernel, grid, a_codes, a_scales, b_codes, b_scales, *rest, **options):
        real(kernel, grid, a_codes, a_scales, b_codes[swap].contiguous(),
             b_scales[swap].contiguous(), *rest, **options)

    monkeypatch.setattr(F, "launch", swapped)
    y = F.fp8_gemm(TRITON, a, b, ends_of(counts), out_dtype=torch.float32, tile=TILE)
    monkeypatch.undo()
    with pytest.raises(AssertionError, match="outside the bound"):
        assert_within_bound(y, want, size, 64)
    shifted = ends_of([6, 0, 16, 3])
    y = F.fp8_gemm(TRITON, a, b, shifted, out_dtype=torch.float32, tile=TILE)
    with pytest.raises(AssertionError, match="outside the bound"):
        assert_within_bound(y, want, size, 64)


# --- compiled Triton, without a GPU: the kernels build for sm_90 ---------------------------------

COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from swa_bench.kernels import triton_fp8_gemm, triton_quant

def build(kernel, types, constants, **options):
    names = kernel.arg_names
    sig = {n: types.get(n, "i32") for n in names if n not in constants}
    sig.update({n: "constexpr" for n in constants})
    src = ASTSource(kernel, sig, {(names.index(n),): v for n, v in constants.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]

gemm = {"A": "*fp8e4nv", "SA": "*u8", "B": "*fp8e4nv", "SB": "*u8", "C": "*bf16"}
for grouped in (False, True):
    ptx = build(triton_fp8_gemm.scaled_fp8_gemm_kernel, {**gemm, "ENDS": "*i32"},
                dict(G=8 if grouped else 1, G_PAD=16 if grouped else 2, GROUPED=grouped,
                     BLOCK_M=128, BLOCK_N=128, GROUP_K=32, INTERPRET=False),
                num_warps=8, num_stages=4)
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx, grouped
ptx = build(triton_quant.e4m3_codes_kernel, {"X": "*bf16", "Q": "*fp8e4nv", "S": "*u8"},
            dict(GROUP=32, BLOCK_G=128), num_warps=4)
print("built")
"""


def test_the_kernels_compile_for_hopper():
    """What the interpreter never checks (compiled Triton's typing, its fp8 MMA on sm_90, the
    fp8 store of the codes kernel): both compile to PTX here, without a GPU; the GEMM's K group
    is one e4m3 wgmma of k = 32."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0 and "built" in done.stdout, done.stderr[-3000:]


# --- CUDA: compiled, at V4.1-Flash's shapes, and in a CUDA graph ---------------------------------

CUDA_PER_SIZE = 2.0**-13  # Hopper's fp8 MMA keeps about 14 bits of its sum of 32 (unverified)


def cuda_case(rows: int, k: int, n: int, counts: list[int] | None = None):
    x = spread(rows, k, seed=rows).cuda().bfloat16()
    w = fp8_weight(n, k, seed=n) if counts is None else fp4_experts(len(counts), n, k, seed=1)
    want, size = oracle(x.cpu(), w, counts)
    return x, w.cuda(), want.cuda(), size.cuda()


@pytest.mark.cuda
@pytest.mark.parametrize("rows, k, n", [(4096, 5120, 1280), (333, 2304, 5120)])
def test_compiled_dense_is_near_float64_and_batch_invariant(rows, k, n):
    kernels = Kernels("triton")
    x, w, want, size = cuda_case(rows, k, n)
    a, b = F.activation_operand(kernels, x), F.weight_operand(w)
    y = F.fp8_gemm(kernels, a, b, out_dtype=torch.float32)
    print(f"dense {rows}x{k}->{n}: {assert_within_bound(y, want, size, k, CUDA_PER_SIZE):.3g}"
          " of the bound")
    part = F.fp8_gemm(kernels, F.activation_operand(kernels, x[129:131]), b,
                      out_dtype=torch.float32)
    assert torch.equal(part, y[129:131])


@pytest.mark.cuda
def test_compiled_grouped_is_near_float64():
    kernels = Kernels("triton")
    counts = [700, 0, 129, 1, 2000, 0, 64, 300]
    x, w, want, size = cuda_case(sum(counts) + 50, 2048, 1536, counts)
    a, b = F.activation_operand(kernels, x), F.weight_operand(w)
    y = F.fp8_gemm(kernels, a, b, ends_of(counts).cuda(), out_dtype=torch.float32)
    print(f"grouped: {assert_within_bound(y, want, size, 2048, CUDA_PER_SIZE):.3g} of the bound")


@pytest.mark.cuda
def test_compiled_gemms_replay_in_a_cuda_graph():
    """Captured once (quantisation and both GEMMs), replayed on new rows and a new routing
    written in place: the same bits as eager calls on those inputs."""
    kernels = Kernels("triton")
    counts, k, n = [100, 0, 60, 96], 512, 384
    rows = sum(counts)
    x = spread(rows, k, seed=1).cuda().bfloat16()
    dense_b = F.weight_operand(fp8_weight(n, k, seed=2).cuda())
    experts = F.weight_operand(fp4_experts(4, n, k, seed=3).cuda())
    ends = ends_of(counts).cuda()

    def step():
        a = F.activation_operand(kernels, x)
        return F.fp8_gemm(kernels, a, dense_b), F.fp8_gemm(kernels, a, experts, ends)

    step()  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    x.copy_(spread(rows, k, seed=9).cuda().bfloat16())
    ends.copy_(ends_of([10, 150, 0, 40]).cuda())
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(outs, step(), strict=True):
        assert torch.equal(got, want)
