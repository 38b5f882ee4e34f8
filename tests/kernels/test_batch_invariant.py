"""The CUDA batch-invariant mode's kernels (``invariant_gemm``, ``invariant_reduce``) and its
dispatch (``TritonBatchInvariantOps``): products and sums held to float64, a row's bits
independent of the batch around it, and every op the mode does not make invariant left to torch.

On CPU they run in Triton's interpreter (tests/conftest.py); the ``cuda`` tests take the shapes
where the H200's cuBLAS and torch reductions were measured not to be row-invariant (issue 29:
``scripts/invariant_gpu.py probe``) and check that the mode's rows are."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from swa_bench.engine.config import triton_interpreting
from swa_bench.kernels.batch_invariant import (
    TritonBatchInvariantOps,
    invariant_gemm,
    invariant_reduce,
)

INTERPRET = triton_interpreting()


def rand(*shape, dtype=torch.bfloat16, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(*shape, generator=gen, device=device).to(dtype)


def rounding(exact: torch.Tensor, dtype: torch.dtype, k: int) -> torch.Tensor:
    """Half an ulp of the output dtype, and an fp32 sum's error over ``k`` terms, elementwise."""
    ulp = torch.finfo(dtype).eps * exact.abs()
    return 0.5 * ulp + k * 1.2e-7 * exact.abs().clamp_min(1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_gemm_is_the_product_rounded_once(dtype):
    a, b = rand(70, 150, dtype=dtype), rand(150, 40, dtype=dtype, seed=1)
    exact = a.double() @ b.double()
    got = invariant_gemm(a, b, interpret=INTERPRET)
    assert got.dtype == dtype and got.shape == (70, 40)
    assert ((got.double() - exact).abs() <= rounding(exact, dtype, 150)).all()


def test_bias_alpha_beta_and_strided_batched_output():
    a, b = rand(3, 33, 20), rand(3, 20, 17, seed=1)
    bias = rand(17, seed=2)
    exact = 2.0 * (a.double() @ b.double()) + 0.5 * bias.double()
    got = invariant_gemm(a, b, bias, alpha=2.0, beta=0.5, interpret=INTERPRET)
    assert ((got.double() - exact).abs() <= rounding(exact, torch.bfloat16, 20)).all()
    out = torch.empty(33, 3, 17, dtype=torch.bfloat16).transpose(0, 1)  # bmm(out=) of a view
    invariant_gemm(a, b, out=out, interpret=INTERPRET)
    assert torch.equal(out, invariant_gemm(a, b, interpret=INTERPRET))


@pytest.mark.parametrize(("shape", "dims", "keepdim", "mean"),
                         [((9, 300), [-1], False, True), ((9, 4, 7), [1], True, False),
                          ((5, 3, 6), [0, 2], False, False), ((2, 2000), [1], False, False)])
def test_the_reduction_sums_in_fp32(shape, dims, keepdim, mean):
    x = rand(*shape)
    want = x.double().mean(dims, keepdim=keepdim) if mean else x.double().sum(dims,
                                                                               keepdim=keepdim)
    got = invariant_reduce(x, dims, keepdim, torch.float32, mean=mean, interpret=INTERPRET)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-5)


@pytest.fixture
def spied(monkeypatch):
    """The ops each call of the invariant kernels came from (a handler that silently fell back
    to torch would leave no entry: on CPU torch's bits can equal the kernel's)."""
    import swa_bench.kernels.batch_invariant as mode

    seen: list[str] = []
    for name in ("invariant_gemm", "invariant_reduce"):
        real = getattr(mode, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            seen.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(mode, name, spy)
    return seen


def test_the_mode_routes_gemms_and_reductions_and_leaves_the_rest(spied):
    x, w = rand(37, 48), rand(24, 48, seed=1)
    bias, ids = rand(24, seed=2), torch.arange(12).view(3, 4)
    expected = {
        "linear": lambda: F.linear(x, w),
        "linear with a bias (addmm)": lambda: F.linear(x, w, bias),
        "einsum (bmm)": lambda: torch.einsum("chd,nd->chn", x.view(37, 4, 12), w[:, :12]),
        "mm(out=)": lambda: torch.mm(x, w.t(), out=torch.empty(37, 24, dtype=x.dtype)),
        "bmm(out=) into a view": lambda: torch.bmm(
            x.view(37, 4, 12).transpose(0, 1), w[:, :12].t().expand(4, 12, 24),
            out=torch.empty(37, 4, 24, dtype=x.dtype).transpose(0, 1)),
        "mean": lambda: x.float().mean(-1),
        "sum over two dims, keepdim": lambda: x.view(37, 4, 12).sum([0, 2], keepdim=True),
    }
    left = {
        "whole-tensor sum": lambda: x.float().sum(),
        "integer sum": lambda: ids.sum(-1),
        "misshapen out": lambda: torch.mm(x, w.t(), out=torch.empty(0, dtype=x.dtype)),
    }
    with TritonBatchInvariantOps("cpu", interpret=INTERPRET):
        for name, op in expected.items():
            spied.clear()
            got = op()
            assert spied, f"{name} did not reach the invariant kernels"
            expected[name] = got
        for name, op in left.items():
            spied.clear()
            left[name] = op()
            assert not spied, f"{name} should be torch's"
    assert torch.equal(expected["linear"], invariant_gemm(x, w.t(), interpret=INTERPRET))
    exact = x.double() @ w.double().t() + bias.double()
    assert ((expected["linear with a bias (addmm)"].double() - exact).abs()
            <= rounding(exact, torch.bfloat16, 48)).all()
    assert torch.equal(expected["mm(out=)"], expected["linear"])
    assert torch.equal(expected["bmm(out=) into a view"].transpose(0, 1),
                       expected["einsum (bmm)"])
    assert torch.equal(left["whole-tensor sum"], x.float().sum())
    assert torch.equal(left["integer sum"], ids.sum(-1))
    assert left["misshapen out"].shape == (37, 24)  # torch resized it


def test_addmm_beta_and_alpha_as_torch_reads_them():
    a, b = rand(9, 16), rand(16, 5, seed=1)
    nan_bias = torch.full((9, 5), float("nan"), dtype=torch.bfloat16)
    bias = rand(9, 1, seed=2)  # broadcast along N
    with TritonBatchInvariantOps("cpu", interpret=INTERPRET):
        ignored = torch.addmm(nan_bias, a, b, beta=0)  # torch does not read a bias times 0
        scaled = torch.addmm(bias, a, b, beta=0.5, alpha=2.0)
    assert torch.isfinite(ignored).all()
    exact = 2.0 * (a.double() @ b.double()) + 0.5 * bias.double()
    assert ((scaled.double() - exact).abs() <= rounding(exact, torch.bfloat16, 16)).all()


@pytest.mark.parametrize(("shape", "dim", "error"), [((3, 4), 2, IndexError),
                                                     ((3, 4), [1, -1], RuntimeError)])
def test_a_bad_reduction_dim_gets_torchs_error(shape, dim, error):
    with TritonBatchInvariantOps("cpu", interpret=INTERPRET), pytest.raises(error):
        torch.ones(shape).sum(dim)


def test_a_scalars_reduction_is_torchs():
    with TritonBatchInvariantOps("cpu", interpret=INTERPRET):
        assert torch.tensor(1.5).sum(0).item() == 1.5


def test_a_rows_bits_do_not_depend_on_the_batch_in_the_mode():
    x, w = rand(130, 64), rand(40, 64, seed=1)
    with TritonBatchInvariantOps("cpu", interpret=INTERPRET):
        whole, part = F.linear(x, w), F.linear(x[-3:], w)
        sums, sums_part = x.sum(-1), x[-3:].sum(-1)
    assert torch.equal(part, whole[-3:]) and torch.equal(sums_part, sums[-3:])


# --- on the H200: the shapes measured not to be row-invariant without the mode -------------

@pytest.mark.cuda
@pytest.mark.parametrize(("k", "n"), [(5120, 1280), (8192, 5120), (5120, 32), (15360, 5120)])
def test_the_modes_gemm_rows_are_invariant_where_cublas_is_not(k, n):
    x, w = rand(16384, k, device="cuda"), rand(n, k, device="cuda", seed=1) / k**0.5
    with TritonBatchInvariantOps("cuda"):
        whole = F.linear(x, w)
        parts = {m: F.linear(x[-m:], w) for m in (1, 8, 128, 896)}
    for m, part in parts.items():
        assert torch.equal(part, whole[-m:]), f"last {m} rows differ"
    exact = x[:256].double() @ w.double().t()
    cublas = (F.linear(x[:256], w).double() - exact).abs().max().item()
    error = (whole[:256].double() - exact).abs().max().item()
    assert error <= 1.5 * cublas, f"{error:.3g} against cuBLAS's {cublas:.3g}"


@pytest.mark.cuda
def test_the_modes_row_sums_are_invariant_where_torchs_are_not():
    x = rand(8192, 5120, dtype=torch.float32, device="cuda")
    with TritonBatchInvariantOps("cuda"):
        whole = x.sum(-1)
        parts = {m: x[-m:].sum(-1) for m in (1, 8, 128)}
    for m, part in parts.items():
        assert torch.equal(part, whole[-m:]), f"last {m} rows differ"


@pytest.mark.cuda
def test_the_modes_kernels_replay_in_a_cuda_graph():
    x, w = rand(256, 512, device="cuda"), rand(384, 512, device="cuda", seed=1)
    with TritonBatchInvariantOps("cuda"):
        eager = F.linear(x, w), x.float().mean(-1)
        static = x.clone()
        F.linear(static, w)  # compiled before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = F.linear(static, w), static.float().mean(-1)
    static.copy_(x)
    graph.replay()
    assert torch.equal(outs[0], eager[0]) and torch.equal(outs[1], eager[1])


def test_the_mode_entered_twice_is_on_once():
    from torch.overrides import _get_current_function_mode_stack

    from swa_bench.kernels.batch_invariant import BatchInvariantOps, batch_invariant_ops

    with batch_invariant_ops("cpu"), batch_invariant_ops("cpu"):
        on = [m for m in _get_current_function_mode_stack() if isinstance(m, BatchInvariantOps)]
        assert len(on) == 1 and torch.get_num_threads() == 1
    assert not [m for m in _get_current_function_mode_stack() if isinstance(m, BatchInvariantOps)]


def test_a_batch_beyond_the_grids_limit_runs_in_parts(monkeypatch):
    import swa_bench.kernels.batch_invariant as mode

    a, b = rand(5, 9, 16), rand(5, 16, 7, seed=1)
    whole = invariant_gemm(a, b, interpret=INTERPRET)
    monkeypatch.setattr(mode, "MAX_GRID_Z", 2)
    assert torch.equal(invariant_gemm(a, b, interpret=INTERPRET), whole)
    exact = a.double() @ b.double()
    assert ((whole.double() - exact).abs() <= rounding(exact, torch.bfloat16, 16)).all()


def test_operands_whose_k_offsets_pass_32_bits_are_copied_k_contiguous(monkeypatch):
    """The kernel's K offsets are 32-bit: a row-major ``b [K, N]`` (K offsets up to K x N) is
    copied K-contiguous past the limit (lowered here to 64 elements), with the same bits."""
    import swa_bench.kernels.batch_invariant as mode

    a, b = rand(9, 40).t().contiguous().t(), rand(40, 12, seed=1)  # K-strided a, row-major b
    whole = invariant_gemm(a, b, interpret=INTERPRET)
    monkeypatch.setattr(mode, "INT32_OFFSETS", 64)
    assert torch.equal(invariant_gemm(a, b, interpret=INTERPRET), whole)
