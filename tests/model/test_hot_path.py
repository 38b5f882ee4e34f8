"""The hot path's rewritten pieces against direct restatements: RoPE, the mHC weighted sums, the
cached sinkhorn mix (refreshed when the weights change)."""

import math

import torch

from swa_bench.model.args import PRESETS
from swa_bench.model.model import HyperConnection, apply_rope, sinkhorn, weighted_sum


def test_rope_rotates_each_pair_by_position_times_frequency():
    torch.manual_seed(0)
    x = torch.randn(5, 3, 16, dtype=torch.float64).float()
    positions = torch.tensor([0, 1, 7, 30, 63])
    rope_dim, theta, half = 8, 10000.0, 4
    out = apply_rope(x, positions, rope_dim, theta, 64)
    expected = x.double().clone()
    for t, p in enumerate(positions.tolist()):
        for i in range(half):
            angle = p * theta ** (-i / half)
            a, b = x[t, :, 8 + i].double(), x[t, :, 12 + i].double()
            expected[t, :, 8 + i] = a * math.cos(angle) - b * math.sin(angle)
            expected[t, :, 12 + i] = a * math.sin(angle) + b * math.cos(angle)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[..., :8], x[..., :8])
    fresh = x.clone()
    assert apply_rope(fresh, positions, rope_dim, theta, 64, inplace=True) is fresh
    assert torch.equal(fresh, out)


def test_weighted_sum_accumulates_in_fp32_and_rounds_once():
    torch.manual_seed(1)
    terms = [torch.randn(6, 32).bfloat16() for _ in range(4)]
    gains = [torch.rand(6, 1), torch.tensor(0.3), torch.rand(6, 1), torch.tensor(-1.7)]
    got = weighted_sum(terms, gains)
    assert got.dtype == torch.bfloat16
    exact = sum(g.double() * t.double() for g, t in zip(gains, terms, strict=True))
    assert torch.equal(got, exact.to(torch.bfloat16)) or (
        (got.double() - exact).abs().max() <= 2**-8 * exact.abs().max()
    )


def test_sinkhorn_mix_follows_the_weights():
    hc = HyperConnection(PRESETS["tiny"])
    with torch.no_grad():
        hc.res_logits.normal_()
    with torch.no_grad():  # inference: engine steps run without gradients
        first = hc.mixing()
        assert torch.equal(first, sinkhorn(hc.res_logits.float()))
        assert hc.mixing() is first  # computed once
        hc.res_logits.mul_(2)
        assert torch.equal(hc.mixing(), sinkhorn(hc.res_logits.float()))
        assert not torch.equal(hc.mixing(), first)
    trained = hc.mixing()  # a training forward computes it, with its gradient
    assert trained.requires_grad and trained is not hc.mixing()
