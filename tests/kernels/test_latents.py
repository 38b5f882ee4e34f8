"""The latents kernel (two RMS norms and the K=V latent's RoPE in one launch) against an
independent oracle: each row normed in float64 and rounded to the dtype, the rotation written out
adjacent pair by adjacent pair from the rounded latent (a compressed layer's table, YaRN on), on
CPU through Triton's interpreter and on CUDA compiled; and the model's attention through it for
inference only (each layer's own table), equal to its PyTorch steps up to rounding."""

from __future__ import annotations

import pytest
import torch

from swa_bench.engine.config import EngineConfig
from swa_bench.engine.engine import Engine
from swa_bench.engine.step_inputs import StepInputs
from swa_bench.kernels import TORCH_KERNELS
from swa_bench.kernels.latents import fused_latents, norm_latents
from swa_bench.model import latent_attention as model_module
from swa_bench.model.args import PRESETS
from swa_bench.model.model import build_model
from swa_bench.model.requests import RequestSpec
from swa_bench.model.rope import RopeSpec, rope_table
from tests.kernels.conftest import TRITON

# Two roundings to the dtype (the norm's, then the rotation's) and fp32's last bits of the
# statistics: the interpreter rounds to bf16 by truncation, the GPU to nearest.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2**-6}


def spec(rope_dim: int, max_len: int) -> RopeSpec:
    return RopeSpec(rope_dim, 160000.0, max_len, original_seq_len=16, factor=4.0)


def oracle(h, q_dim, q_w, kv_w, eps, positions, rope_dim, max_len):
    """Row by row in float64: both norms rounded to the dtype, then each rotated pair."""
    dtype, h64 = h.dtype, h.double()

    def norm(x, w):
        return (x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt() * w.double()).to(dtype)

    q, latent = norm(h64[:, :q_dim], q_w), norm(h64[:, q_dim:], kv_w)
    cos, sin = (t.double() for t in rope_table(torch.device("cpu"), spec(rope_dim, max_len)))
    kv, d = latent.double().clone(), latent.shape[1]
    for t, p in enumerate(positions.tolist()):
        for i in range(rope_dim // 2):
            e, o = d - rope_dim + 2 * i, d - rope_dim + 2 * i + 1
            a, b = latent[t, e].double(), latent[t, o].double()
            kv[t, e] = a * cos[p, i] - b * sin[p, i]
            kv[t, o] = a * sin[p, i] + b * cos[p, i]
    return q, kv.to(dtype), latent


def run(h, q_dim, q_w, kv_w, eps, positions, rope_dim, max_len, keep_latent=True):
    cos, sin = rope_table(h.device, spec(rope_dim, max_len))
    return norm_latents(TRITON, h, q_dim, (q_w, eps), (kv_w, eps), positions.to(h.device), cos, sin,
                        rope_dim, keep_latent=keep_latent)


def problem(rows, q_dim, kv_dim, dtype, max_len, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = (3 * torch.randn(rows, q_dim + kv_dim, generator=gen)).to(dtype)
    q_w = (1 + 0.5 * torch.randn(q_dim, generator=gen)).to(dtype)
    kv_w = (1 + 0.5 * torch.randn(kv_dim, generator=gen)).to(dtype)
    return h, q_w, kv_w, torch.randint(0, max_len, (rows,), generator=gen)


def check(got, want, dtype):
    tol = TOLERANCE[dtype]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.cpu().float(), w.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "q_dim", "kv_dim", "rope_dim"),
                         [(7, 40, 24, 8), (3, 128, 64, 16), (5, 24, 20, 6), (2, 16, 8, 0)])
def test_latents_match_the_rowwise_oracle(interpreter, dtype, rows, q_dim, kv_dim, rope_dim):
    """Widths off a power of two (masked tails), a half width off one, no RoPE at all; the
    features before the rotated ones are the normed latent's, and the latent is kept whole."""
    h, q_w, kv_w, positions = problem(rows, q_dim, kv_dim, dtype, 64, seed=q_dim)
    got = run(h, q_dim, q_w, kv_w, 1e-6, positions, rope_dim, 64)
    check(got, oracle(h, q_dim, q_w, kv_w, 1e-6, positions, rope_dim, 64), dtype)
    q, kv, latent = got
    assert torch.equal(kv[:, : kv_dim - rope_dim], latent[:, : kv_dim - rope_dim])
    assert run(h, q_dim, q_w, kv_w, 1e-6, positions, rope_dim, 64, keep_latent=False)[2] is None


def test_rows_are_batch_invariant(interpreter):
    h, q_w, kv_w, positions = problem(12, 40, 24, torch.float32, 64, seed=4)
    whole = run(h, 40, q_w, kv_w, 1e-6, positions, 8, 64)
    part = run(h[3:8], 40, q_w, kv_w, 1e-6, positions[3:8], 8, 64)
    for w, p in zip(whole, part, strict=True):
        assert torch.equal(w[3:8], p)


def mixed_step_logits(model, vocab_size, calls=None):
    """A mixed step's logits (the decodes' context filled first; ``calls`` cleared then)."""
    requests = [RequestSpec(prompt_len=20), RequestSpec(prompt_len=9, decode=True)] * 2
    inputs = StepInputs.seeded(requests, vocab_size, 0)
    engine = Engine(model, EngineConfig.for_model(model.args, policy="full"))
    inputs.fill_context(engine)
    if calls is not None:
        calls.clear()
    return engine.step(inputs.requests, inputs.step_tokens, inputs.cache_indices).logits


def test_the_model_takes_the_kernel_for_inference_only(interpreter, monkeypatch):
    """With the kernel taken (the other kernels left to the PyTorch path: the interpreter would
    take minutes), a step of the sparse model (index keys from the kept latent) runs it in every
    layer but S and gives the PyTorch steps' logits up to rounding; a changed weight is stacked
    again; the Triton backend takes it for inference only."""
    args = PRESETS["sparse-tiny"]
    model, _ = build_model(args, seed=0)
    want = mixed_step_logits(model, args.vocab_size)
    calls = []
    real = model_module.norm_latents
    monkeypatch.setattr(model_module, "norm_latents", lambda *a, **k: calls.append(1)
                        or real(*a, **k))
    monkeypatch.setattr(model_module, "fused_latents", lambda *a: True)
    got = mixed_step_logits(model, args.vocab_size, calls)
    assert len(calls) == args.n_layers - 1
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    attn = model.layers[0].attn
    before = attn.stacked_latent_weight()
    with torch.no_grad():
        attn.wkv.weight.mul_(2)
    assert torch.equal(attn.stacked_latent_weight()[args.q_lora_rank:], attn.wkv.weight)
    assert torch.equal(before[args.q_lora_rank:] * 2, attn.wkv.weight)
    x = torch.randn(5, args.dim)
    assert fused_latents(TRITON, x, args.q_lora_rank, args.head_dim)
    assert not fused_latents(TORCH_KERNELS, x, args.q_lora_rank, args.head_dim)
    with torch.enable_grad():
        assert not fused_latents(TRITON, x.requires_grad_(True), args.q_lora_rank, args.head_dim)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_latents_kernel_on_cuda(dtype):
    """V4.1's widths (q 1280, K=V 512, RoPE 64) at positions up to 4096."""
    h, q_w, kv_w, positions = problem(300, 1280, 512, dtype, 4096, seed=9)
    want = oracle(h, 1280, q_w, kv_w, 1e-6, positions, 64, 4096)
    got = run(h.cuda(), 1280, q_w.cuda(), kv_w.cuda(), 1e-6, positions, 64, 4096)
    check(got, want, dtype)
