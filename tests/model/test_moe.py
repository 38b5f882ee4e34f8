"""The MoE against a loop-per-expert restatement of DeepSeek-V4.1 inference/model.py `Gate`,
`Expert` and `MoE`, on every PyTorch dispatch path (the grouped GEMM, its dense fallback, the
``MOE_ROWS`` chunks) and the training forward's ``dense_moe``; the properties the reference
states: the bias changes the choice, not the weights; ``route_scale``; the clamps bind on both
sides; one shared expert."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from swa_bench.model import moe as moe_module
from swa_bench.model.args import PRESETS
from swa_bench.model.model import build_model
from swa_bench.model.moe import MoE, route
from swa_bench.train.forward import dense_moe

ARGS = PRESETS["sparse-tiny"]


def reference_gate(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`Gate.forward` (sqrtsoftplus, gate_temp 1, norm_topk_prob): (weights, indices)."""
    scores = F.linear(x.float(), moe.gate.weight.float())
    scores = F.softplus(scores).sqrt()
    indices = (scores + moe.gate.bias.float()).topk(moe.top_k, dim=-1)[1]
    weights = scores.gather(1, indices)
    if moe.top_k > 1:
        weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
    weights *= moe.route_scale
    return weights, indices


def reference_expert(x, w1, w3, w2, limit, weights=None):
    """`Expert.forward`: fp32 SwiGLU with the clamps, the weight before ``w2``."""
    dtype = x.dtype
    gate = (x @ w1.T).float()
    up = (x @ w3.T).float()
    if limit > 0:
        up = torch.clamp(up, min=-limit, max=limit)
        gate = torch.clamp(gate, max=limit)
    h = F.silu(gate) * up
    if weights is not None:
        h = weights * h
    return h.to(dtype) @ w2.T


def reference_moe(moe: MoE, x: torch.Tensor, *, weight_after_w2: bool = False) -> torch.Tensor:
    """`MoE.forward`: expert by expert over the rows that chose it, an fp32 accumulator, the
    one shared expert added, one rounding. ``weight_after_w2``: the routing weight on the
    expert's output instead (the seeded fault the bf16 test must tell apart)."""
    weights, indices = reference_gate(moe, x)
    inter, limit = moe.inter, moe.swiglu_limit
    y = torch.zeros_like(x, dtype=torch.float32)
    w = moe.experts
    for i in range(moe.n_experts):
        idx, top = torch.where(indices == i)
        if idx.numel() == 0:
            continue
        w1, w3, w2 = w.w13[i, :inter], w.w13[i, inter:], w.w2[i]
        wt = weights[idx, top, None]
        if weight_after_w2:
            y[idx] += (wt * reference_expert(x[idx], w1, w3, w2, limit).float()).to(x.dtype)
        else:
            y[idx] += reference_expert(x[idx], w1, w3, w2, limit, wt)
    s13 = moe.shared_w13.weight
    y += reference_expert(x, s13[:inter], s13[inter:], moe.shared_w2.weight, limit)
    return y.type_as(x)


@pytest.fixture(scope="module")
def model():
    return build_model(ARGS, seed=0)[0]


def unit_rows(n: int, dim: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Rows of RMS 1, as the FFN's norm hands them to the MoE."""
    x = torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))
    return (x / x.square().mean(-1, keepdim=True).sqrt()).to(dtype)


def test_the_seeded_experts_cross_the_clamp_on_both_sides(model):
    """The preset's limit binds on the seeded weights (else the tests below would not see the
    clamp): up above and below, gate above, in the routed and the shared experts."""
    moe = model.layers[3].moe
    assert moe.swiglu_limit > 0
    x = unit_rows(64, ARGS.dim, 0)
    for h in (torch.einsum("nd,eid->eni", x, moe.experts.w13), moe.shared_w13(x)):
        gate, up = h.chunk(2, dim=-1)
        lim = moe.swiglu_limit
        assert (up > lim).any() and (up < -lim).any() and (gate > lim).any()


@pytest.mark.parametrize("path", ["grouped", "dense_fallback", "chunked"])
def test_moe_is_the_reference_moe(model, monkeypatch, path):
    moe = model.layers[3].moe
    x = unit_rows(37, ARGS.dim, 1)
    if path == "dense_fallback":
        monkeypatch.delattr(torch, "_grouped_mm", raising=False)
        monkeypatch.setattr(moe_module, "GROUPED_FALLBACK_ELEMENTS", 3 * 74 * 64)  # 3 experts
    if path == "chunked":
        monkeypatch.setattr(moe_module, "MOE_ROWS", 10)
    with torch.no_grad():
        got = moe(x)
        want = reference_moe(moe, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(moe, "swiglu_limit", 0.0)
    with torch.no_grad():
        assert (moe(x) - want).abs().max() > 1e-2  # the clamp changes the output


def test_the_training_forwards_dense_moe_is_the_reference_moe(model):
    moe = model.layers[4].moe
    x = unit_rows(29, ARGS.dim, 2)
    with torch.no_grad():
        torch.testing.assert_close(dense_moe(moe, x), reference_moe(moe, x), rtol=1e-5,
                                   atol=1e-6)


def test_bf16_rounds_as_the_reference_with_the_weight_before_w2(model):
    """In bf16 the routing weight's place shows: the model is the reference's rounding (a few
    bf16 steps of accumulation order at most), far closer than the weight applied after w2."""
    moe = build_model(ARGS, seed=0, dtype=torch.bfloat16)[0].layers[3].moe
    x = unit_rows(200, ARGS.dim, 3, torch.bfloat16)
    with torch.no_grad():
        got = moe(x).float()
        want = reference_moe(moe, x).float()
        after = reference_moe(moe, x, weight_after_w2=True).float()
    near = (got - want).abs().mean()
    assert near * 4 < (got - after).abs().mean()
    assert (got - want).abs().max() <= 2 ** -6 * want.abs().max()


def test_the_bias_changes_the_choice_and_not_the_weights(model):
    moe = model.layers[3].moe
    x = unit_rows(300, ARGS.dim, 4)
    logits = moe.gate.logits(x)
    k, scale = moe.top_k, moe.route_scale
    biased, biased_w = route(logits, moe.gate.bias, k, scale)
    plain, plain_w = route(logits, torch.zeros_like(moe.gate.bias), k, scale)
    changed = (biased.sort(-1).values != plain.sort(-1).values).any(-1)
    assert 0 < int(changed.sum()) < len(x)  # the seeded bias moves some choices, not all
    scores = F.softplus(logits.double()).sqrt()
    for weights, experts in ((biased_w, biased), (plain_w, plain)):
        chosen = scores.gather(1, experts)  # the unbiased scores of the chosen, whatever chose
        torch.testing.assert_close(weights.double(), chosen / chosen.sum(-1, keepdim=True) * scale)
    favoured = torch.zeros_like(moe.gate.bias)
    favoured[5] = 100.0  # a bias large enough to choose expert 5 for every row
    experts, weights = route(logits, favoured, k, scale)
    assert bool((experts[:, 0] == 5).all())
    want = scores[:, 5] / scores.gather(1, experts).sum(-1) * scale
    torch.testing.assert_close(weights[:, 0].double(), want)


def test_the_weights_sum_to_route_scale_and_a_single_expert_is_not_normalised(model):
    moe = model.layers[3].moe
    x = unit_rows(50, ARGS.dim, 5)
    logits = moe.gate.logits(x)
    _, weights = route(logits, moe.gate.bias, 2, 1.5)
    torch.testing.assert_close(weights.sum(-1), torch.full((50,), 1.5))
    experts, weights = route(logits, moe.gate.bias, 1, 1.5)
    want = F.softplus(logits).sqrt().gather(1, experts) * 1.5
    torch.testing.assert_close(weights, want)
    assert bool((weights != 1.5).all())


def test_the_released_values_and_one_shared_expert():
    for name in ("v41-flash", "v41-flash-shape"):
        args = PRESETS[name]
        assert (args.route_scale, args.swiglu_limit, args.n_shared_experts) == (1.5, 10.0, 1)
    with torch.device("meta"):
        moe = MoE(ARGS)
    assert moe.shared_w13.weight.shape == (2 * ARGS.moe_inter_dim, ARGS.dim)
    assert dict(moe.gate.named_parameters()).keys() == {"weight", "bias"}
    assert moe.gate.bias.shape == (ARGS.n_routed_experts,)
