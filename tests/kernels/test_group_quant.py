"""The fused quantisation kernel against ``kernels.quant``'s PyTorch functions, bit for bit: random
rows over a wide range of magnitudes, every rounding tie of each grid, signed zeros, all-zero
groups, the floors and saturation; on CPU through Triton's interpreter and on CUDA compiled (in a
CUDA graph too). The PyTorch functions are held to a float64 restatement of the release's rules
in tests/kernels/test_quant.py: the oracle here is independent of the kernel's bit tricks."""

from __future__ import annotations

import pytest
import torch

from swa_bench.kernels import Kernels, quant
from swa_bench.kernels import group_quant as gq
from tests.kernels.conftest import TRITON

FORMATS = [("e4m3", quant.ACT_GROUP, quant.act_quant),
           ("e2m1", quant.FP4_GROUP, quant.fp4_act_quant),
           ("e2m1-e4m3-scale", quant.KV_FP4_GROUP, quant.fp4_act_quant_e4m3_scale)]


def bits(x: torch.Tensor) -> torch.Tensor:
    """The bit patterns (``-0.0`` is not ``0.0`` here)."""
    return x.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[x.dtype])


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    differ = bits(got) != bits(want)
    assert not differ.any(), (f"{int(differ.sum())} of {differ.numel()} differ, e.g. "
                              f"{got[differ][:4].tolist()} vs {want[differ][:4].tolist()}")


def wide_rows(shape, dtype, seed: int) -> torch.Tensor:
    """Normal draws times magnitudes from 1e-30 to 1e30, so groups span tiny and huge scales
    (and elements far below their group's amax, which round to zero)."""
    gen = torch.Generator().manual_seed(seed)
    mags = torch.logspace(-30, 30, shape[-1], dtype=torch.float64)
    mags = mags[torch.randperm(shape[-1], generator=gen)]
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * mags).to(dtype)


def edge_rows(group: int, amax: float, ties: list[float], dtype) -> torch.Tensor:
    """Groups whose largest element is ``amax`` (it sets a scale of 1, so the other elements are
    the values the grid rounds) holding ``ties`` with both signs, zeros and a negative zero; then
    an all-zero group, an all-negative-zero group, a group at the format's amax floor and one
    far above the largest value."""
    values = [amax, *ties, *(-t for t in ties), 0.0, -0.0]
    rows = []
    for start in range(0, len(values), group - 1):
        chunk = values[start : start + group - 1]
        rows.append([amax, *chunk, *([0.0] * (group - 1 - len(chunk)))])
    rows += [[0.0] * group, [-0.0] * group, [1e-30] * group, [3e30, *([-7.5] * (group - 1))]]
    return torch.tensor(rows, dtype=torch.float32).to(dtype)


# The midpoints of each grid at a scale of 1 (amax 448: e4m3's largest; amax 6: e2m1's), where
# round-to-nearest-even decides, and values next to them.
E4M3_TIES = [1.0625, 1.1875, 3.25, 3.75, 208.0, 240.0, 440.0, 0.0029296875, 0.0009765625,
             0.0146484375, 0.015625, 0.01513671875, 1e-6]
E2M1_TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.0001, 4.9999, 0.2500001, 1.9999, 6.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt, group, reference", FORMATS)
def test_random_rows_match_the_pytorch_functions(interpreter, fmt, group, reference, dtype):
    """2-D and 3-D, a group count that leaves the last program partly masked."""
    for shape in ((5, 4 * group), (3, 2, 7 * group)):
        x = wide_rows(shape, dtype, seed=group + len(shape))
        assert_same_bits(gq.group_quant(TRITON, x, fmt), reference(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt, group, reference", FORMATS)
def test_ties_zeros_floors_and_saturation_match(interpreter, fmt, group, reference, dtype):
    amax, ties = (448.0, E4M3_TIES) if fmt == "e4m3" else (6.0, E2M1_TIES)
    x = edge_rows(group, amax, ties, dtype)
    got = gq.group_quant(TRITON, x, fmt)
    assert_same_bits(got, reference(x))
    assert bits(got[-3]).ne(0).all() and got[-3].eq(0).all()  # -0.0 stays -0.0


def test_quantise_takes_the_kernel_only_where_it_applies(monkeypatch):
    calls = []
    real = gq.group_quant
    monkeypatch.setattr(gq, "group_quant", lambda *a: calls.append(a[2]) or real(*a))
    x = wide_rows((2, 64), torch.float32, seed=1)
    torch_kernels = Kernels("torch")
    assert sorted(gq.FORMATS) == sorted(fmt for fmt, _, _ in FORMATS)
    for fmt, _, reference in FORMATS:
        assert_same_bits(gq.quantise(torch_kernels, x, fmt), reference(x))  # PyTorch backend
        assert_same_bits(gq.quantise(TRITON, x.t().contiguous().t(), fmt), reference(x))  # strided
        with torch.enable_grad():  # a gradient wanted: the kernel has no backward
            wanted = x.clone().requires_grad_()
            assert torch.equal(gq.quantise(TRITON, wanted, fmt).detach(), reference(x))
    assert calls == []
    for fmt, _, reference in FORMATS:
        assert_same_bits(gq.quantise(TRITON, x, fmt), reference(x))
    assert calls == [fmt for fmt, _, _ in FORMATS]


def test_a_width_its_group_does_not_divide_is_refused():
    with pytest.raises(ValueError, match="not a multiple of the group 32"):
        gq.group_quant(TRITON, torch.ones(2, 48), "e4m3")
    with pytest.raises(ValueError, match="format must be one of"):
        gq.group_quant(TRITON, torch.ones(2, 32), "e5m2")


@pytest.mark.cuda
@pytest.mark.parametrize("fmt, group, reference", FORMATS)
def test_compiled_kernel_matches_and_replays_in_a_cuda_graph(fmt, group, reference):
    """A v41-flash-sized input (16K rows x 5120, bf16), and the kernel captured in a CUDA
    graph, replayed on new values in the same buffer."""
    kernels = Kernels("triton")
    x = wide_rows((16384, 5120), torch.bfloat16, seed=group).cuda()
    assert_same_bits(gq.group_quant(kernels, x, fmt), reference(x))
    edges = edge_rows(group, 448.0 if fmt == "e4m3" else 6.0,
                      E4M3_TIES if fmt == "e4m3" else E2M1_TIES, torch.float32).cuda()
    assert_same_bits(gq.group_quant(kernels, edges, fmt), reference(edges))
    static = x[:256].clone()
    gq.group_quant(kernels, static, fmt)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gq.group_quant(kernels, static, fmt)
    static.copy_(x[256:512])
    graph.replay()
    torch.cuda.synchronize()
    assert_same_bits(out, reference(x[256:512]))
