"""``fp32_linear``: the reference's fp32 product of bf16 operands, on the GPU as tensor-core sums
with round-to-nearest steps, held to float64 within the promoted fp32 GEMM's own error."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from swa_bench.kernels import TORCH_KERNELS, Kernels, fp32_linear


def operands(rows: int, k: int, n: int, device: str):
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(rows, k, device=device, generator=g).bfloat16()
    w = (torch.randn(n, k, device=device, generator=g) / k**0.5).bfloat16()
    return x, w


def test_the_torch_path_is_the_promoted_gemm():
    x, w = operands(5, 64, 7, "cpu")
    assert torch.equal(fp32_linear(TORCH_KERNELS, x, w), F.linear(x.float(), w.float()))


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(1000, 5120, 384), (37, 4096, 512), (130, 200, 70)])
def test_the_tensor_core_product_is_as_exact_as_the_fp32_gemm(shape):
    """Within 4x the fp32 GEMM's own error against float64, measured on the same operands (1-2x
    on the H200; cuBLAS's bf16 GEMM with fp32 output, one truncating accumulator over all of K,
    is 10-30x), and each row's sums independent of the rows around it."""
    x, w = operands(*shape, "cuda")
    want = x.double() @ w.double().t()
    mine = fp32_linear(Kernels("triton"), x, w)
    assert mine.dtype == torch.float32 and mine.shape == (shape[0], shape[2])
    fp32_error = (F.linear(x.float(), w.float()).double() - want).abs().max().item()
    error = (mine.double() - want).abs().max().item()
    assert error <= 4 * fp32_error, f"{error:.3g} against the fp32 GEMM's {fp32_error:.3g}"
    part = fp32_linear(Kernels("triton"), x[33:35], w)
    assert torch.equal(part, mine[33:35]), f"{(part - mine[33:35]).abs().max().item():.3g}"
