"""The mHC kernels against the model's PyTorch restatement (``split_sinkhorn``, ``weighted_sum``,
the oracle): on CPU through Triton's interpreter, on CUDA compiled; and the model's choice of
path."""

from __future__ import annotations

import pytest
import torch

from swa_bench.kernels import hc_post, hc_pre, hc_project, hc_split_sinkhorn
from swa_bench.model.args import PRESETS
from swa_bench.model.hyper_connection import project, split_sinkhorn, weighted_sum
from swa_bench.model.model import build_model
from tests.kernels.conftest import TRITON, on_kernels


def problem(rows: int, dim: int, hc: int, dtype, device="cpu", seed=0):
    """Streams, a sublayer output, per-row pre/post gains and a per-row comb (Sinkhorn of
    random logits)."""
    g = torch.Generator(device=device).manual_seed(seed)
    streams = [torch.randn(rows, dim, generator=g, device=device).to(dtype) for _ in range(hc)]
    out = torch.randn(rows, dim, generator=g, device=device).to(dtype)
    gains = torch.rand(rows, 2 * hc, generator=g, device=device) * 2
    mixes = torch.randn(rows, (2 + hc) * hc, generator=g, device=device)
    _, _, comb = split_sinkhorn(mixes, torch.ones(3, device=device),
                                torch.zeros((2 + hc) * hc, device=device), hc, 20, 1e-6)
    return streams, out, gains[:, :hc], gains[:, hc:], comb


def oracle_pre(streams, pre):
    return weighted_sum(streams, [pre[:, j : j + 1] for j in range(len(streams))])


def oracle_post(streams, out, post, comb):
    hc = len(streams)
    return [weighted_sum((out, *streams),
                         [post[:, i : i + 1], *(comb[:, j, i : i + 1] for j in range(hc))])
            for i in range(hc)]


def close(mine, theirs, dtype):
    """One rounding of the output apart at most: both sum in fp32, in the same order, but the
    compiler may fuse a multiply and an add the other path rounds between."""
    ulp = {torch.float32: 1e-6, torch.bfloat16: 2 ** -7}[dtype]
    torch.testing.assert_close(mine.float(), theirs.float(), rtol=ulp, atol=ulp)


@pytest.mark.parametrize("hc", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sums_match_the_torch_path(interpreter, hc, dtype):
    # 1100 columns: one full block and a masked tail; 5 rows.
    streams, out, pre, post, comb = problem(5, 1100, hc, dtype)
    close(hc_pre(TRITON, streams, pre), oracle_pre(streams, pre), dtype)
    for mine, theirs in zip(hc_post(TRITON, streams, out, post, comb),
                            oracle_post(streams, out, post, comb), strict=True):
        close(mine, theirs, dtype)


def test_post_reads_the_comb_by_source_then_destination(interpreter):
    """New stream ``i`` takes ``comb[j, i]`` of stream ``j`` (a column of the row's matrix): a
    permutation comb moves each stream where the reference's ``hc_post`` moves it."""
    streams, out, _, post, _ = problem(3, 40, 4, torch.float32)
    perm = [2, 0, 3, 1]  # stream j goes to new stream perm[j]
    comb = torch.zeros(3, 4, 4)
    for j, i in enumerate(perm):
        comb[:, j, i] = 1.0
    got = hc_post(TRITON, streams, out, torch.zeros_like(post), comb)
    for j, i in enumerate(perm):
        assert torch.equal(got[i], streams[j])


@pytest.mark.parametrize("hc", [1, 2, 3, 4])
def test_sinkhorn_matches_the_torch_path(interpreter, hc):
    """37 rows (a partial block), a padded lane for three streams; mixes large enough that the
    softmax saturates for some rows."""
    g = torch.Generator().manual_seed(hc)
    mixes = torch.randn(37, (2 + hc) * hc, generator=g) * 4
    scale, base = torch.rand(3, generator=g) + 0.5, torch.randn((2 + hc) * hc, generator=g)
    mine = hc_split_sinkhorn(TRITON, mixes, scale, base, hc, 20, 1e-6)
    want = split_sinkhorn(mixes, scale, base, hc, 20, 1e-6)
    for a, b in zip(mine, want, strict=True):
        assert a.dtype == torch.float32 and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)
    assert hc_split_sinkhorn(TRITON, mixes[:0], scale, base, hc, 20, 1e-6)[2].shape == (0, hc, hc)


def oracle_project(streams, fn, eps):
    """float64: the fp32 flattened streams' product with ``fn``, times their rsqrt statistic."""
    flat = torch.cat(streams, dim=-1).double()
    rsqrt = torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)
    return (flat @ fn.double().t()) * rsqrt


@pytest.mark.parametrize("hc", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_projection_matches_the_torch_path(interpreter, hc, dtype):
    """300 columns (two full steps and a masked tail), 37 rows (a partial block), and a zero
    (padded) row whose mixes are zero at the reference's ``norm_eps`` of 1e-20."""
    streams, _, _, _, _ = problem(37, 300, hc, dtype)
    streams = [s.clone() for s in streams]
    for s in streams:
        s[5] = 0
    fn = torch.randn((2 + hc) * hc, hc * 300, generator=torch.Generator().manual_seed(2))
    fn /= (hc * 300) ** 0.5
    mine = hc_project(TRITON, streams, fn, 1e-20)
    assert mine.dtype == torch.float32 and mine.shape == (37, (2 + hc) * hc)
    want = oracle_project(streams, fn, 1e-20)
    torch.testing.assert_close(mine.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(project(streams, fn, 1e-20).double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(mine[5], torch.zeros_like(mine[5]))


def test_a_rows_result_does_not_depend_on_the_batch(interpreter):
    streams, out, pre, post, comb = problem(40, 300, 4, torch.float32)
    bf16 = [s.bfloat16() for s in streams]
    fn = torch.randn(24, 4 * 300, generator=torch.Generator().manual_seed(3))
    assert torch.equal(hc_project(TRITON, bf16, fn, 1e-20)[33:35],
                       hc_project(TRITON, [s[33:35] for s in bf16], fn, 1e-20))
    whole = hc_post(TRITON, streams, out, post, comb)
    part = hc_post(TRITON, [s[2:4] for s in streams], out[2:4], post[2:4], comb[2:4])
    for a, b in zip(whole, part, strict=True):
        assert torch.equal(a[2:4], b)
    assert torch.equal(hc_pre(TRITON, streams, pre)[2:4],
                       hc_pre(TRITON, [s[2:4] for s in streams], pre[2:4]))
    fn = torch.randn(24, 4 * 300, generator=torch.Generator().manual_seed(3))
    assert torch.equal(hc_project(TRITON, streams, fn, 1e-20)[33:35],
                       hc_project(TRITON, [s[33:35] for s in streams], fn, 1e-20))
    mixes = torch.randn(40, 24, generator=torch.Generator().manual_seed(1))
    scale, base = torch.ones(3), torch.zeros(24)
    full = hc_split_sinkhorn(TRITON, mixes, scale, base, 4, 20, 1e-6)
    rows = hc_split_sinkhorn(TRITON, mixes[33:35], scale, base, 4, 20, 1e-6)
    for a, b in zip(full, rows, strict=True):
        assert torch.equal(a[33:35], b)


def test_model_takes_the_kernels_only_without_gradients(interpreter, monkeypatch):
    """On the Triton kernels, an inference forward runs the kernels and gives the PyTorch
    path's logits up to rounding; a training forward keeps the PyTorch path."""
    import swa_bench.model.hyper_connection as model_module

    args = PRESETS["tiny"].replace(hc_mult=4, max_seq_len=32)
    model, _ = build_model(args, seed=0)
    tokens = torch.randint(0, args.vocab_size, (1, 12))
    from swa_bench.train.forward import train_forward

    with torch.no_grad():
        reference = train_forward(model, tokens).logits
    calls = {"post": 0, "project": 0, "sinkhorn": 0}

    def counting(name, real):
        def call(*a):
            calls[name] += 1
            return real(*a)
        return call

    monkeypatch.setattr(model_module, "hc_post", counting("post", model_module.hc_post))
    monkeypatch.setattr(model_module, "hc_project", counting("project", model_module.hc_project))
    monkeypatch.setattr(model_module, "hc_split_sinkhorn",
                        counting("sinkhorn", model_module.hc_split_sinkhorn))
    with on_kernels(TRITON):
        with torch.no_grad():
            fused = train_forward(model, tokens).logits
        assert calls == dict.fromkeys(("post", "project", "sinkhorn"), 2 * args.n_layers)
        torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-5)
        model.requires_grad_(True)
        calls.update(post=0, project=0, sinkhorn=0)
        train_forward(model, tokens).logits.sum().backward()
    assert calls == {"post": 0, "project": 0, "sinkhorn": 0}


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernels_on_cuda(dtype):
    """V4.1-Flash's width against the PyTorch path on CPU copies (the interpreter test's
    tolerances; Sinkhorn's 20 rounds of fp32 divisions a few ulps apart)."""
    streams, out, pre, post, comb = problem(104, 4096, 4, dtype, device="cuda")
    cpu = [s.cpu() for s in streams]
    close(hc_pre(TRITON, streams, pre).cpu(), oracle_pre(cpu, pre.cpu()), dtype)
    for mine, theirs in zip(hc_post(TRITON, streams, out, post, comb),
                            oracle_post(cpu, out.cpu(), post.cpu(), comb.cpu()), strict=True):
        close(mine.cpu(), theirs, dtype)
    fn = torch.randn(24, 4 * 4096, device="cuda") / 128
    # The fp32 GEMM's error, whether its dot runs in fp32 or as three exact bf16 parts.
    torch.testing.assert_close(hc_project(TRITON, streams, fn, 1e-20).cpu().double(),
                               oracle_project(cpu, fn.cpu(), 1e-20), rtol=1e-5, atol=2e-5)
    mixes = torch.randn(1000, 24, device="cuda") * 4
    scale, base = torch.rand(3, device="cuda") + 0.5, torch.randn(24, device="cuda")
    mine = hc_split_sinkhorn(TRITON, mixes, scale, base, 4, 20, 1e-6)
    want = split_sinkhorn(mixes.cpu(), scale.cpu(), base.cpu(), 4, 20, 1e-6)
    for a, b in zip(mine, want, strict=True):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-5)


def test_the_projection_counts_the_gemm_it_replaces(interpreter):
    """torch's FLOP counter sees the kernel's custom op as the PyTorch path's GEMM."""
    from swa_bench.bench.flops import count_flops

    streams, _, _, _, _ = problem(7, 300, 4, torch.float32)
    fn = torch.randn(24, 4 * 300)
    assert count_flops(lambda: hc_project(TRITON, streams, fn, 1e-20)) == 2 * 7 * 1200 * 24
    assert count_flops(lambda: project(streams, fn, 1e-20)) == 2 * 7 * 1200 * 24
