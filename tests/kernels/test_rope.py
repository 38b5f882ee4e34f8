"""The RoPE kernel against an independent oracle (each adjacent pair ``(2i, 2i + 1)`` turned in
float64 by the cos and sin of the model's fp32 tables at the row's position, forward and back),
on CPU through Triton's interpreter and on CUDA compiled; and the model's ``apply_rope`` through
it for inference only. The tables' own angles are the model's (fp32, tested against DeepSeek's
formula in tests/model/test_rope.py); at position 4096 an fp32 angle is 2e-4 off the exact one,
which is the table's, not the kernel's."""

from __future__ import annotations

import pytest
import torch

from swa_bench.kernels.rope import rope_
from swa_bench.model import rope as model_module
from swa_bench.model.rope import RopeSpec, apply_rope, rope_table
from tests.kernels.conftest import TRITON, on_kernels

# One rounding to the dtype apart: the interpreter rounds to bf16 by truncation (the GPU to
# nearest), and a fused multiply-add may differ from two roundings in fp32's last bit.
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2**-7}


def spec(rope_dim: int, max_len: int = 64) -> RopeSpec:
    """A compressed layer's setting: theta 160000 with YaRN over a 16-position context."""
    return RopeSpec(rope_dim, 160000.0, max_len, original_seq_len=16, factor=4.0)


def oracle(x: torch.Tensor, positions: torch.Tensor, rope_dim: int, max_len: int = 64,
           inverse: bool = False):
    """The rotation written out pair by pair, in float64, rounded to the dtype once."""
    d = x.shape[-1]
    cos, sin = (t.double() for t in rope_table(torch.device("cpu"), spec(rope_dim, max_len)))
    sign = -1.0 if inverse else 1.0
    out = x.double().clone()
    for t, p in enumerate(positions.tolist()):
        for i in range(rope_dim // 2):
            e, o = d - rope_dim + 2 * i, d - rope_dim + 2 * i + 1
            a, b = x[t, ..., e].double(), x[t, ..., o].double()
            out[t, ..., e] = a * cos[p, i] - b * sign * sin[p, i]
            out[t, ..., o] = a * sign * sin[p, i] + b * cos[p, i]
    return out.to(x.dtype)


def rotate(x, positions, rope_dim, max_len=64, inverse=False):
    cos, sin = rope_table(x.device, spec(rope_dim, max_len))
    return rope_(TRITON, x, positions.to(x.device), cos, sin, rope_dim, inverse=inverse)


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, rope_dim", [((9, 3, 20), 6), ((5, 16), 8), ((4, 64, 40), 16)])
def test_rotation_matches_the_pairwise_oracle(interpreter, dtype, shape, rope_dim, inverse):
    """Odd head counts and half widths (masked tiles), 2-D and 3-D rows, forward and back,
    features before the rotated ones left alone."""
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=gen).to(dtype)
    positions = torch.randint(0, 64, (shape[0],), generator=gen)
    want = oracle(x, positions, rope_dim, inverse=inverse)
    got = rotate(x.clone(), positions, rope_dim, inverse=inverse)
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
    path, forward and back. Without a forward context (the training forward's) it is the
    PyTorch path."""
    x = torch.randn(7, 3, 16, generator=torch.Generator().manual_seed(4))
    positions = torch.tensor([0, 1, 2, 9, 30, 31, 63])
    layer = spec(8)
    want = apply_rope(x, positions, layer)
    back = apply_rope(x, positions, layer, inverse=True)
    calls = []
    real = model_module.rope_
    monkeypatch.setattr(model_module, "rope_", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert not calls
    with on_kernels(TRITON):
        copy = apply_rope(x, positions, layer)
        torch.testing.assert_close(copy, want, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(apply_rope(x, positions, layer, inverse=True), back,
                                   rtol=2e-6, atol=2e-6)
        fresh = x.clone()
        assert apply_rope(fresh, positions, layer, inplace=True) is fresh
        assert torch.equal(fresh, copy) and len(calls) == 3
        calls.clear()
        leaf = x.clone().requires_grad_(True)
        apply_rope(leaf, positions, layer).sum().backward()
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
        torch_path = apply_rope(x, positions, spec(64, 4096))  # CPU: the PyTorch passes
    torch.testing.assert_close(got.float(), torch_path.float(), rtol=tol, atol=tol)
