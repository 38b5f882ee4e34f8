"""The fused mHC sums against the model's PyTorch sums (``weighted_sum``, the oracle): on CPU
through Triton's interpreter, on CUDA compiled; and the model's choice of path."""

from __future__ import annotations

import pytest
import torch

from swa_bench.kernels import hc_gains, hc_gated_pre, hc_post, hc_post_gated_pre, hc_pre
from swa_bench.model.args import PRESETS
from swa_bench.model.hyper_connection import sinkhorn, weighted_sum
from swa_bench.model.model import build_model
from tests.kernels.conftest import TRITON, on_kernels


def problem(rows: int, dim: int, hc: int, dtype, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    streams = [torch.randn(rows, dim, generator=g, device=device).to(dtype) for _ in range(hc)]
    out = torch.randn(rows, dim, generator=g, device=device).to(dtype)
    gains = torch.rand(rows, 2 * hc, generator=g, device=device) * 2
    mix = sinkhorn(torch.randn(hc, hc, generator=g, device=device))
    return streams, out, gains[:, :hc], gains[:, hc:], mix


def oracle_pre(streams, pre):
    return weighted_sum(streams, [pre[:, j : j + 1] for j in range(len(streams))])


def oracle_post(streams, out, post, mix):
    return [weighted_sum((out, *streams), [post[:, i : i + 1], *mix[i]])
            for i in range(len(streams))]


def close(mine, theirs, dtype):
    """One rounding of the output apart at most: both sum in fp32, in the same order, but the
    compiler may fuse a multiply and an add the other path rounds between."""
    ulp = {torch.float32: 1e-6, torch.bfloat16: 2 ** -7}[dtype]
    torch.testing.assert_close(mine.float(), theirs.float(), rtol=ulp, atol=ulp)


@pytest.mark.parametrize("hc", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sums_match_the_torch_path(interpreter, hc, dtype):
    # 1100 columns: one full block and a masked tail; 5 rows.
    streams, out, pre, post, mix = problem(5, 1100, hc, dtype)
    close(hc_pre(TRITON, streams, pre), oracle_pre(streams, pre), dtype)
    for mine, theirs in zip(hc_post(TRITON, streams, out, post, mix),
                            oracle_post(streams, out, post, mix), strict=True):
        close(mine, theirs, dtype)


def test_a_rows_sum_does_not_depend_on_the_batch(interpreter):
    streams, out, pre, post, mix = problem(6, 300, 4, torch.float32)
    whole = hc_post(TRITON, streams, out, post, mix)
    part = hc_post(TRITON, [s[2:4] for s in streams], out[2:4], post[2:4], mix)
    for a, b in zip(whole, part, strict=True):
        assert torch.equal(a[2:4], b)
    assert torch.equal(hc_pre(TRITON, streams, pre)[2:4],
                       hc_pre(TRITON, [s[2:4] for s in streams], pre[2:4]))


def test_model_takes_the_fused_sums_only_without_gradients(interpreter, monkeypatch):
    """On the Triton kernels, an inference forward runs the kernels and gives the PyTorch
    path's logits up to rounding; a training forward keeps the PyTorch path."""
    import swa_bench.model.hyper_connection as model_module

    args = PRESETS["tiny"].replace(hc_mult=4, max_seq_len=32)
    model, _ = build_model(args, seed=0)
    tokens = torch.randint(0, args.vocab_size, (1, 12))
    from swa_bench.train.forward import train_forward

    with torch.no_grad():
        reference = train_forward(model, tokens).logits
    calls = []
    real = model_module.hc_post
    monkeypatch.setattr(model_module, "hc_post", lambda *a: calls.append(1) or real(*a))
    with on_kernels(TRITON):
        with torch.no_grad():
            fused = train_forward(model, tokens).logits
        assert len(calls) == 2 * args.n_layers
        torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-5)
        model.requires_grad_(True)
        calls.clear()
        train_forward(model, tokens).logits.sum().backward()
    assert not calls


def gains_problem(rows, dim, hc, dtype, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    streams = [torch.randn(rows, dim, generator=g, device=device).to(dtype) for _ in range(hc)]
    norm_w = (1 + 0.1 * torch.randn(hc * dim, generator=g, device=device)).to(dtype)
    dyn_w = (torch.randn(2 * hc, hc * dim, generator=g, device=device) / dim ** 0.5).to(dtype)
    return streams, norm_w, dyn_w


def oracle_gains(streams, norm_w, dyn_w, eps):
    """float64 statistics and sums; the normed row and the result rounded to the dtype where
    the model's norm and linear round their outputs."""
    x = torch.cat(streams, dim=-1).double()
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    normed = (x * rstd * norm_w.double()).to(streams[0].dtype).double()
    return (normed @ dyn_w.double().t()).to(streams[0].dtype).float()


def assert_gains_close(mine, want, dtype):
    # Sums of thousands of terms in another order; in bf16 the outputs round to 8 bits (and a
    # normed element can round the other way), so one bf16 step of the result.
    tol = 2e-5 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(mine, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("hc", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gains_match_the_norm_and_the_linear(interpreter, hc, dtype):
    streams, norm_w, dyn_w = gains_problem(5, 1100, hc, dtype)
    mine = hc_gains(TRITON, streams, norm_w, dyn_w, 1e-6)
    assert mine.dtype == torch.float32 and mine.shape == (5, 2 * hc)
    assert_gains_close(mine, oracle_gains(streams, norm_w, dyn_w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gates_are_the_sigmoids_of_the_gains(interpreter, dtype):
    """``pre = sigmoid(g + static_pre)``, ``post = 2 sigmoid(g + static_post)`` in float64 from
    the oracle's gains (rounded as the model rounds them)."""
    streams, norm_w, dyn_w = gains_problem(5, 1100, 4, dtype, seed=3)
    static = torch.randn(2, 4, generator=torch.Generator().manual_seed(4)).to(dtype)
    mine = hc_gains(TRITON, streams, norm_w, dyn_w, 1e-6, (static[0], static[1]))
    g = oracle_gains(streams, norm_w, dyn_w, 1e-6).double()
    want = torch.cat([torch.sigmoid(g[:, :4] + static[0].double()),
                      2 * torch.sigmoid(g[:, 4:] + static[1].double())], dim=1)
    assert_gains_close(mine, want.float(), dtype)


def test_the_model_takes_the_fused_gates(interpreter):
    from swa_bench.model.hyper_connection import HyperConnection

    args = PRESETS["tiny"].replace(hc_mult=4)
    hc = HyperConnection(args)
    streams, _, _ = gains_problem(6, args.dim, 4, torch.float32)
    with torch.no_grad():
        for p in hc.parameters():
            p.normal_()
        want_x, want_post = hc.pre(streams)
        with on_kernels(TRITON):
            mine_x, mine_post = hc.pre(streams)
    assert_gains_close(mine_post, want_post, torch.float32)
    # Four streams of O(1) weighted by gates that agree to 2e-5: 1e-4 on the sum.
    torch.testing.assert_close(mine_x, want_x, rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gains_on_cuda(dtype):
    streams, norm_w, dyn_w = gains_problem(37, 5120, 4, dtype, device="cuda")
    mine = hc_gains(TRITON, streams, norm_w, dyn_w, 1e-6).cpu()
    want = oracle_gains([s.cpu() for s in streams], norm_w.cpu(), dyn_w.cpu(), 1e-6)
    assert_gains_close(mine, want, dtype)
    part = hc_gains(TRITON, [s[5:9] for s in streams], norm_w, dyn_w, 1e-6).cpu()
    assert torch.equal(mine[5:9], part)
    static = torch.randn(2, 4, device="cuda").to(dtype)
    gates = hc_gains(TRITON, streams, norm_w, dyn_w, 1e-6, (static[0], static[1])).cpu().double()
    g, static = want.double(), static.cpu().double()
    assert_gains_close(gates[:, :4].float(), torch.sigmoid(g[:, :4] + static[0]).float(), dtype)
    assert_gains_close(gates[:, 4:].float(), (2 * torch.sigmoid(g[:, 4:] + static[1])).float(),
                       dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sums_on_cuda(dtype):
    streams, out, pre, post, mix = problem(37, 5120, 4, dtype, device="cuda")
    close(hc_pre(TRITON, streams, pre), oracle_pre(streams, pre), dtype)
    for mine, theirs in zip(hc_post(TRITON, streams, out, post, mix),
                            oracle_post(streams, out, post, mix), strict=True):
        close(mine, theirs, dtype)
    empty = [s[:0] for s in streams]
    assert hc_pre(TRITON, empty, pre[:0]).shape == (0, 5120)
    streams, _, pre, _, _ = problem(300, 1024, 4, dtype, device="cuda")  # the norm folded
    weight = torch.rand(1024, device="cuda").add(0.5).to(dtype)
    want = torch.nn.functional.rms_norm(oracle_pre(streams, pre), (1024,), weight, 1e-6)
    tol = {torch.float32: 2e-6, torch.bfloat16: 2 ** -6}[dtype]  # two roundings
    torch.testing.assert_close(hc_pre(TRITON, streams, pre, (weight, 1e-6)).float(), want.float(),
                               rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pre_folds_the_sublayers_norm(interpreter, dtype):
    """``hc_pre`` with the norm is the sum, rounded, then ``F.rms_norm`` (the model's RMSNorm):
    two roundings apart at most (the sum's and the norm's: the interpreter rounds to bf16 by
    truncation, torch to nearest); a row wider than one program is refused, not normed by
    halves."""
    streams, _, pre, _, _ = problem(13, 200, 4, dtype)
    weight = (torch.rand(200, generator=torch.Generator().manual_seed(3)) + 0.5).to(dtype)
    want = torch.nn.functional.rms_norm(oracle_pre(streams, pre), (200,), weight, 1e-6)
    tol = {torch.float32: 2e-6, torch.bfloat16: 2 ** -6}[dtype]
    torch.testing.assert_close(hc_pre(TRITON, streams, pre, (weight, 1e-6)).float(), want.float(),
                               rtol=tol, atol=tol)
    wide, _, pre_wide, _, _ = problem(2, 2048, 2, dtype)
    with pytest.raises(ValueError, match="at most"):
        hc_pre(TRITON, wide, pre_wide, (torch.ones(2048, dtype=dtype), 1e-6))


def oracle_gated_pre(streams, norm_w, dyn_w, static, norm):
    """The oracle's gains, their gates in float64, the pre sum and ``F.rms_norm`` of it."""
    hc = len(streams)
    g = oracle_gains(streams, norm_w, dyn_w, 1e-6).double()
    pre = torch.sigmoid(g[:, :hc] + static[0].double()).float()
    post = (2 * torch.sigmoid(g[:, hc:] + static[1].double())).float()
    x = oracle_pre(streams, pre)
    if norm is not None:
        x = torch.nn.functional.rms_norm(x, (x.shape[1],), norm[0], norm[1])
    return x, post


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "dim", "hc", "normed"),
                         [(21, 200, 4, True), (5, 1024, 2, True), (3, 96, 4, False)])
def test_gated_pre_is_the_gates_then_the_sum_then_the_norm(interpreter, dtype, rows, dim, hc,
                                                           normed):
    """One launch against the oracle's three steps: two row blocks (one partial), a row of
    four column steps, the norm left out; wider rows refused. (Batch invariance is the CUDA
    test's: the interpreter's matrix product, numpy's, is not batch-invariant.)"""
    streams, norm_w, dyn_w = gains_problem(rows, dim, hc, dtype, seed=dim)
    g = torch.Generator().manual_seed(1)
    static = torch.randn(2, hc, generator=g).to(dtype)
    norm = ((torch.rand(dim, generator=g) + 0.5).to(dtype), 1e-6) if normed else None
    x, post = hc_gated_pre(TRITON, streams, norm_w, dyn_w, 1e-6, (static[0], static[1]), norm)
    want_x, want_post = oracle_gated_pre(streams, norm_w, dyn_w, static, norm)
    assert_gains_close(post, want_post, dtype)
    # The gates agree to 2e-5 (fp32) or a bf16 step; their sum of four O(1) streams then
    # the norm's and the sum's roundings.
    tol = {torch.float32: 1e-4, torch.bfloat16: 2 ** -5}[dtype]
    torch.testing.assert_close(x.float(), want_x.float(), rtol=tol, atol=tol)
    wide, norm_w, dyn_w = gains_problem(2, 2048, 2, dtype)
    with pytest.raises(ValueError, match="at most"):
        hc_gated_pre(TRITON, wide, norm_w, dyn_w, 1e-6, (static[0, :2], static[1, :2]))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gated_pre_on_cuda(dtype):
    """The small preset's width and the widest rows it takes, against the oracle; the rows
    read back after the barrier are the block's own (a block of 16 rows, then a partial one)."""
    for rows, dim in ((104, 256), (37, 1024)):
        streams, norm_w, dyn_w = gains_problem(rows, dim, 4, dtype, device="cuda", seed=dim)
        static = torch.randn(2, 4, device="cuda").to(dtype)
        norm = (torch.rand(dim, device="cuda").add(0.5).to(dtype), 1e-6)
        x, post = hc_gated_pre(TRITON, streams, norm_w, dyn_w, 1e-6, (static[0], static[1]), norm)
        want_x, want_post = oracle_gated_pre([s.cpu() for s in streams], norm_w.cpu(),
                                             dyn_w.cpu(), static.cpu(),
                                             (norm[0].cpu(), 1e-6))
        assert_gains_close(post.cpu(), want_post, dtype)
        tol = {torch.float32: 1e-4, torch.bfloat16: 2 ** -5}[dtype]
        torch.testing.assert_close(x.cpu().float(), want_x.float(), rtol=tol, atol=tol)
        part_x, _ = hc_gated_pre(TRITON, [s[16:40] for s in streams], norm_w, dyn_w, 1e-6,
                                 (static[0], static[1]), norm)
        assert torch.equal(part_x, x[16:40])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "dim", "hc"), [(21, 200, 4), (5, 96, 2)])
def test_post_then_gated_pre_is_the_post_then_the_next_pre(interpreter, dtype, rows, dim, hc):
    """One launch against the oracle's post (``weighted_sum``) and then the next sublayer's
    gates, sum and norm on the oracle's new streams."""
    streams, out, _, post, mix = problem(rows, dim, hc, dtype, seed=dim)
    _, norm_w, dyn_w = gains_problem(rows, dim, hc, dtype, seed=hc)
    g = torch.Generator().manual_seed(2)
    static = torch.randn(2, hc, generator=g).to(dtype)
    norm = ((torch.rand(dim, generator=g) + 0.5).to(dtype), 1e-6)
    new, x, next_post = hc_post_gated_pre(TRITON, streams, out, post, mix, norm_w, dyn_w, 1e-6,
                                          (static[0], static[1]), norm)
    want_new = oracle_post(streams, out, post, mix)
    for mine, theirs in zip(new, want_new, strict=True):
        close(mine, theirs, dtype)
    want_x, want_post = oracle_gated_pre(want_new, norm_w, dyn_w, static, norm)
    # The oracle's gates come from its own new streams, a rounding off the kernel's in bf16
    # (the interpreter truncates): a bf16 gain can move one step (2^-7 of |g| <= 4), and the
    # post gate 2 sigmoid(g) by at most half of that.
    tol = {torch.float32: 1e-4, torch.bfloat16: 2 ** -5}[dtype]
    torch.testing.assert_close(next_post, want_post, rtol=tol, atol=tol)
    torch.testing.assert_close(x.float(), want_x.float(), rtol=tol, atol=tol)


def test_the_block_takes_the_post_then_pre_kernel_for_narrow_rows(interpreter, monkeypatch):
    """On the Triton kernels, a block of the small preset's width fuses its attention post into its
    feed-forward pre; V4.1's width (5120: over one program's row) keeps three launches."""
    from swa_bench.model import hyper_connection as model_module
    from swa_bench.model.hyper_connection import HyperConnection
    from swa_bench.model.norm import RMSNorm

    calls = []
    real = model_module.hc_post_gated_pre
    monkeypatch.setattr(model_module, "hc_post_gated_pre",
                        lambda *a: calls.append(1) or real(*a))
    for dim, fused in ((256, True), (2048, False)):
        args = PRESETS["small"].replace(dim=dim)
        done, nxt, norm = HyperConnection(args), HyperConnection(args), RMSNorm(dim, 1e-6)
        streams, out, _, post, _ = problem(3, dim, 4, torch.float32)
        with torch.no_grad(), on_kernels(TRITON):
            new, x, next_post = done.post_then_pre(tuple(streams), out, post, nxt, norm)
        assert len(new) == 4 and x.shape == (3, dim) and next_post.shape == (3, 4)
        assert bool(calls) == fused
        calls.clear()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_post_then_gated_pre_on_cuda(dtype):
    """The small preset's width against the oracle's post and then its gated pre on the
    oracle's new streams (the interpreter test's oracle and tolerances), on CPU copies."""
    streams, out, _, post, mix = problem(104, 256, 4, dtype, device="cuda")
    _, norm_w, dyn_w = gains_problem(104, 256, 4, dtype, device="cuda", seed=4)
    static = torch.randn(2, 4, device="cuda").to(dtype)
    norm = (torch.rand(256, device="cuda").add(0.5).to(dtype), 1e-6)
    new, x, next_post = hc_post_gated_pre(TRITON, streams, out, post, mix, norm_w, dyn_w, 1e-6,
                                          (static[0], static[1]), norm)
    cpu = [s.cpu() for s in streams]
    want_new = oracle_post(cpu, out.cpu(), post.cpu(), mix.cpu())
    for mine, theirs in zip(new, want_new, strict=True):
        close(mine.cpu(), theirs, dtype)
    want_x, want_post = oracle_gated_pre(want_new, norm_w.cpu(), dyn_w.cpu(), static.cpu(),
                                         (norm[0].cpu(), 1e-6))
    tol = {torch.float32: 1e-4, torch.bfloat16: 2 ** -5}[dtype]
    torch.testing.assert_close(next_post.cpu(), want_post, rtol=tol, atol=tol)
    torch.testing.assert_close(x.cpu().float(), want_x.float(), rtol=tol, atol=tol)
