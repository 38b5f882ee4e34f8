"""The RoPE kernel against an independent oracle (each pair rotated in float64 by the cos and
sin of the model's fp32 tables at the row's position), on CPU through Triton's interpreter and on
CUDA compiled; and the model's ``apply_rope`` through it for inference only. The tables' own
angles are the model's (fp32, tested against the analytic angle in tests/model/test_hot_path.py);
at position 4096 an fp32 angle is 2e-4 off the exact one, which is the table's, not the kernel's."""

from __future__ import annotations

import pytest
import torch

from swa_bench.kernels.rope import rope_
from swa_bench.model import rope as model_module
from swa_bench.model.rope import apply_rope, rope_table
from tests.kernels.conftest import TRITON, on_kernels

# One rounding to the dtype apart: the interpreter rounds to bf16 by truncation (the GPU to
# nearest), and a fused multiply-add may differ from two roundings in fp32's last bit.
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2**-7}
THETA = 10000.0


def oracle(x: torch.Tensor, positions: torch.Tensor, rope_dim: int, max_len: int = 64):
    """The rotation written out pair by pair, in float64, rounded to the dtype once."""
    half, d = rope_dim // 2, x.shape[-1]
    cos, sin = (t.double() for t in rope_table(torch.device("cpu"), rope_dim, THETA, max_len))
    out = x.double().clone()
    for t, p in enumerate(positions.tolist()):
        for i in range(half):
            a, b = x[t, ..., d - rope_dim + i].double(), x[t, ..., d - half + i].double()
            out[t, ..., d - rope_dim + i] = a * cos[p, i] - b * sin[p, i]
            out[t, ..., d - half + i] = a * sin[p, i] + b * cos[p, i]
    return out.to(x.dtype)


def rotate(x, positions, rope_dim, max_len=64):
    cos, sin = rope_table(x.device, rope_dim, THETA, max_len)
    return rope_(TRITON, x, positions.to(x.device), cos, sin, rope_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, rope_dim", [((9, 3, 20), 6), ((5, 16), 8), ((4, 64, 40), 16)])
def test_rotation_matches_the_pairwise_oracle(interpreter, dtype, shape, rope_dim):
    """Odd head counts and half widths (masked tiles), 2-D and 3-D rows, features before the
    rotated ones left alone."""
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=gen).to(dtype)
    positions = torch.randint(0, 64, (shape[0],), generator=gen)
    want = oracle(x, positions, rope_dim)
    got = rotate(x.clone(), positions, rope_dim)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert torch.equal(got[..., : shape[-1] - rope_dim], x[..., : shape[-1] - rope_dim])


def test_rows_rotate_independently_in_place(interpreter):
    x = torch.randn(12, 4, 24, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(12) * 5
    whole = rotate(x.clone(), positions, 8)
    view = x.clone()
    part = rotate(view[4:9], positions[4:9], 8)
    assert part.data_ptr() == view[4:9].data_ptr()
    assert torch.equal(part, whole[4:9])
    assert torch.equal(rotate(x[:0].clone(), positions[:0], 8), x[:0])


def test_apply_rope_takes_the_kernel_for_inference_only(interpreter, monkeypatch):
    """On the Triton kernels: an inference ``apply_rope`` runs the kernel (in place or on a copy)
    and gives the PyTorch path's result up to rounding; with a gradient it keeps the PyTorch
    path. Without a forward context (the training forward's) it is the PyTorch path."""
    x = torch.randn(7, 3, 16, generator=torch.Generator().manual_seed(4))
    positions = torch.tensor([0, 1, 2, 9, 30, 31, 63])
    want = apply_rope(x, positions, 8, THETA, 64)
    calls = []
    real = model_module.rope_
    monkeypatch.setattr(model_module, "rope_", lambda *a: calls.append(1) or real(*a))
    assert not calls
    with on_kernels(TRITON):
        copy = apply_rope(x, positions, 8, THETA, 64)
        torch.testing.assert_close(copy, want, rtol=2e-6, atol=2e-6)
        fresh = x.clone()
        assert apply_rope(fresh, positions, 8, THETA, 64, inplace=True) is fresh
        assert torch.equal(fresh, copy) and len(calls) == 2
        calls.clear()
        leaf = x.clone().requires_grad_(True)
        apply_rope(leaf, positions, 8, THETA, 64).sum().backward()
    assert not calls and leaf.grad is not None


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_kernel_on_cuda(dtype):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(300, 64, 512, generator=gen).to(dtype)
    positions = torch.randint(0, 4096, (300,), generator=gen)
    want = oracle(x[:, :2], positions, 64, max_len=4096)  # two heads through the float64 loop
    got = rotate(x.cuda(), positions, 64, max_len=4096).cpu()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got[:, :2].float(), want.float(), rtol=tol, atol=tol)
    with torch.no_grad():
        torch_path = apply_rope(x, positions, 64, THETA, 4096)  # CPU: the PyTorch passes
    torch.testing.assert_close(got.float(), torch_path.float(), rtol=tol, atol=tol)
