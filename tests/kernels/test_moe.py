"""The routed experts' fused elementwise steps against independent oracles (a per-token loop
with the PyTorch path's roundings), on CPU through Triton's interpreter and on CUDA compiled;
and the model's MoE through them against its PyTorch path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from swa_bench.kernels import moe as moe_kernels
from swa_bench.kernels.moe import expert_gemm, moe_combine, moe_route, moe_sort, silu_mul
from swa_bench.model import moe as model_module
from swa_bench.model.args import PRESETS
from swa_bench.model.moe import MoE
from tests.kernels.conftest import TRITON, on_kernels


def routed_outputs(tokens, k, dim, experts, dtype, device="cpu", seed=0):
    """Expert-sorted outputs ``y`` of the (token, expert) pairs, the sort ``order`` and each
    token's routing weights, as ``MoE.routed`` forms them."""
    g = torch.Generator(device=device).manual_seed(seed)
    pairs = torch.stack([torch.randperm(experts, generator=g, device=device)[:k]
                         for _ in range(tokens)]).flatten()
    order = torch.argsort(pairs, stable=True)
    weights = torch.rand(tokens, k, generator=g, device=device)
    weights = weights / weights.sum(-1, keepdim=True)
    y = torch.randn(tokens * k, dim, generator=g, device=device).to(dtype)
    return y, order, weights


def oracle_combine(y, order, weights):
    """Per token: its k rows found by search in ``order``, each times its rounded weight and
    rounded to the dtype, summed in fp32 in slot order, rounded once."""
    t, k = weights.shape
    where = {int(pair): i for i, pair in enumerate(order.tolist())}
    out = torch.empty(t, y.shape[1], dtype=y.dtype)
    for tok in range(t):
        acc = torch.zeros(y.shape[1], dtype=torch.float32)
        for j in range(k):
            w = weights[tok, j].to(y.dtype).float()
            acc += (y[where[tok * k + j]].float() * w).to(y.dtype).float()
        out[tok] = acc.to(y.dtype)
    return out


# Two roundings of the dtype apart at most: the interpreter rounds to bf16 by truncation (the
# GPU to nearest), and the exponentials may differ in fp32's last bit, which a rounding to bf16
# can carry one bf16 step further.
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2 ** -6}


def test_combine_is_the_per_token_sum(interpreter):
    y, order, weights = routed_outputs(9, 3, 1100, 5, torch.float32)  # 1100: a masked tail
    assert torch.equal(moe_combine(TRITON, y, order, weights), oracle_combine(y, order, weights))
    into = torch.full((12, 1100), 7.0)
    moe_combine(TRITON, y, order, weights, out=into[2:11])
    assert torch.equal(into[2:11], oracle_combine(y, order, weights))
    assert bool((into[:2] == 7).all() and (into[11:] == 7).all())
    y, order, weights = routed_outputs(9, 3, 1100, 5, torch.bfloat16)
    tol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(moe_combine(TRITON, y, order, weights).float(),
                               oracle_combine(y, order, weights).float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_adds_the_shared_experts_as_the_torch_sum_does(interpreter, dtype):
    """The routed sum rounded to the dtype, plus the shared output, rounded again: the PyTorch
    path's ``routed + shared``."""
    y, order, weights = routed_outputs(9, 3, 1100, 5, dtype, seed=4)
    shared = torch.randn(9, 1100, generator=torch.Generator().manual_seed(5)).to(dtype)
    routed = moe_combine(TRITON, y, order, weights)  # itself checked against the oracle above
    mine = moe_combine(TRITON, y, order, weights, shared=shared)
    if dtype == torch.float32:
        assert torch.equal(mine, routed + shared)
        return
    # The interpreter rounds to bf16 by truncation, torch to nearest: one bf16 step apart.
    want = (routed + shared).float()
    assert bool(((mine.float() - want).abs() <= 2 ** -7 * want.abs()).all())


def oracle_route(logits, k):
    """``MoE.route``'s steps in float64, ties broken by the lower expert index: the sigmoid is
    strictly increasing, so the order of the logits (bf16 logits tie often) is the scores'."""
    chosen = torch.tensor([sorted(range(len(row)), key=lambda e, row=row: (-row[e], e))[:k]
                           for row in logits.double().tolist()])
    values = torch.sigmoid(logits.double()).gather(1, chosen)
    return chosen, values / values.sum(-1, keepdim=True)


@pytest.mark.parametrize(("rows", "experts", "k", "dtype"),
                         [(37, 10, 3, torch.float32), (5, 384, 6, torch.bfloat16),
                          (17, 8, 2, torch.float32)])
def test_route_is_the_sigmoid_top_k_normalised(interpreter, rows, experts, k, dtype):
    """Rows past a block's end, expert counts off a power of two, tied bf16 logits: the k
    highest scores, highest first, the lower index first among equal ones, and the weights to
    fp32 rounding."""
    logits = (2 * torch.randn(rows, experts, generator=torch.Generator().manual_seed(6))).to(dtype)
    chosen, weights = moe_route(TRITON, logits, k)
    want_chosen, want_weights = oracle_route(logits, k)
    assert chosen.dtype == torch.long and weights.dtype == torch.float32
    assert torch.equal(chosen, want_chosen)
    torch.testing.assert_close(weights.double(), want_weights, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("rows", "experts", "dim", "dtype"),
                         [(37, 10, 100, torch.float32), (5, 8, 256, torch.bfloat16)])
def test_route_with_the_gate_is_the_route_of_the_gates_logits(interpreter, rows, experts, dim,
                                                              dtype):
    """The gate's product in the routing launch: the oracle's route of the logits computed in
    float64 and rounded to the dtype as the gate's linear rounds them (dims off the block)."""
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(rows, dim, generator=g).to(dtype)
    gate = (torch.randn(experts, dim, generator=g) * dim ** -0.5).to(dtype)
    chosen, weights = moe_route(TRITON, x, 3, gate)
    want_chosen, want_weights = oracle_route((x.double() @ gate.double().T).to(dtype), 3)
    assert torch.equal(chosen, want_chosen)
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # a logit one bf16 step off
    torch.testing.assert_close(weights.double(), want_weights, rtol=tol, atol=tol)


def test_dense_expert_gemm_is_every_rows_swiglu(interpreter):
    """Without an order (the shared experts): one weight for every row in order."""
    pairs, order, ends, x, w13, w2 = expert_problem(37, 1, 1, 96, 40, torch.float32)
    want_a, _ = oracle_experts(x, pairs, order, 1, w13, w2)
    a = expert_gemm(TRITON, x, w13, None, None, swiglu=True)
    torch.testing.assert_close(a.double(), want_a, rtol=2e-6, atol=2e-6)
    with pytest.raises(ValueError, match="one weight"):
        expert_gemm(TRITON, x, torch.cat([w13, w13]), None, None, swiglu=True)


def oracle_sort(experts, n_experts):
    """Expert by expert, its pairs in pair order, and the running count of rows."""
    pairs = experts.flatten().tolist()
    order, ends = [], []
    for e in range(n_experts):
        order += [i for i, p in enumerate(pairs) if p == e]
        ends.append(len(order))
    return torch.tensor(order), torch.tensor(ends, dtype=torch.int32)


@pytest.mark.parametrize(("tokens", "k", "n_experts"),
                         [(37, 3, 10), (1, 1, 384), (52, 2, 8), (300, 6, 384)])
def test_sort_is_the_stable_order_by_expert(interpreter, tokens, k, n_experts, monkeypatch):
    """Many pairs per expert (ties keep pair order), experts no pair chose (empty groups), pair
    counts off a power of two; and past ``SORT_PAIRS``, torch's ops give the same integers."""
    g = torch.Generator().manual_seed(tokens)
    experts = torch.stack([torch.randperm(n_experts, generator=g)[:k] for _ in range(tokens)])
    experts = experts % max(k, n_experts // 3)  # a third of the experts at most: empty groups
    want_order, want_ends = oracle_sort(experts, n_experts)
    order, ends = moe_sort(TRITON, experts, n_experts)
    assert order.dtype == torch.long and ends.dtype == torch.int32
    assert torch.equal(order, want_order) and torch.equal(ends, want_ends)
    monkeypatch.setattr(moe_kernels, "SORT_PAIRS", experts.numel() - 1)
    order, ends = moe_sort(TRITON, experts, n_experts)
    assert torch.equal(order, want_order) and torch.equal(ends, want_ends)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_is_the_torch_swiglu(interpreter, dtype):
    h = torch.randn(7, 2 * 1100, generator=torch.Generator().manual_seed(1)).to(dtype)
    g, u = h.chunk(2, dim=-1)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(silu_mul(TRITON, h).float(), (F.silu(g) * u).float(), rtol=tol,
                               atol=tol)


def test_the_moe_takes_the_kernels_for_inference_only(interpreter, monkeypatch):
    """Forced to Triton, an inference MoE (chunked, shared experts) gives the PyTorch path's
    output up to rounding and runs the kernels; with gradients it keeps the PyTorch path."""
    args = PRESETS["sparse-tiny"]
    moe = MoE(args)
    init_weights_of(moe)
    x = torch.randn(23, args.dim, generator=torch.Generator().manual_seed(2))
    monkeypatch.setattr(model_module, "MOE_ROWS", 10)  # three chunks written in place
    with torch.no_grad():
        want = moe(x)
        calls = []
        real = model_module.moe_combine
        monkeypatch.setattr(model_module, "moe_combine",
                            lambda *a: calls.append(1) or real(*a))
        with on_kernels(TRITON):
            mine = moe(x)
    assert len(calls) == 3
    torch.testing.assert_close(mine, want, rtol=1e-5, atol=1e-5)
    calls.clear()
    moe.requires_grad_(True)
    with on_kernels(TRITON):
        moe(x.requires_grad_(True)).sum().backward()
    assert not calls


def init_weights_of(moe: MoE) -> None:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)


def expert_problem(tokens, k, experts, dim, inter, dtype, device="cpu", seed=0, *,
                   unrouted=()):
    """Routed pairs sorted by expert (stable), their group ends, and expert weights; experts in
    ``unrouted`` get no rows (an empty group)."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(experts) if e not in unrouted])
    pairs = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:k]]
                         for _ in range(tokens)]).flatten()
    order = torch.argsort(pairs, stable=True)
    ends = torch.searchsorted(pairs[order], torch.arange(1, experts + 1)).to(torch.int32)
    x = torch.randn(tokens, dim, generator=g)
    w13 = torch.randn(experts, 2 * inter, dim, generator=g) * dim ** -0.5
    w2 = torch.randn(experts, dim, inter, generator=g) * inter ** -0.5
    to = dict(device=device, dtype=dtype)
    return (pairs.to(device), order.to(device), ends.to(device), x.to(**to), w13.to(**to),
            w2.to(**to))


def oracle_experts(x, pairs, order, k, w13, w2):
    """Per sorted row, in float64: its token's input, its expert's SwiGLU (rounded where
    ``silu_mul`` rounds), then the down projection written at the pair's index."""
    inter, dtype = w2.shape[2], x.dtype
    a = torch.empty(order.numel(), inter, dtype=torch.float64)
    y = torch.empty(order.numel(), w2.shape[1], dtype=torch.float64)
    for r, pair in enumerate(order.tolist()):
        e = int(pairs[pair])
        h = (x[pair // k].double() @ w13[e].double().T).to(dtype).double()
        gate = F.silu(h[:inter]).to(dtype).double()
        a[r] = gate * h[inter:]
    for r, pair in enumerate(order.tolist()):
        y[pair] = a[r].to(dtype).double() @ w2[int(pairs[pair])].double().T
    return a, y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_gemm_is_the_per_pair_product(interpreter, dtype):
    """37 tokens x top-2 over 5 experts, one of them unrouted (an empty group inside a tile),
    K and N off the block sizes: the gathered SwiGLU GEMM and the scattered down projection."""
    k = 2
    pairs, order, ends, x, w13, w2 = expert_problem(37, k, 5, 96, 40, dtype, unrouted=(2,))
    assert int(ends[2] - ends[1]) == 0
    a = expert_gemm(TRITON, x, w13, ends, order, top_k=k, swiglu=True)
    y = expert_gemm(TRITON, a, w2, ends, order, scatter=True)
    want_a, want_y = oracle_experts(x, pairs, order, k, w13, w2)
    tol = {torch.float32: 2e-6, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(a.double(), want_a, rtol=tol, atol=tol)
    torch.testing.assert_close(y.double(), want_y, rtol=tol, atol=tol)


def test_expert_gemm_rows_past_the_last_group_are_zero_and_rows_are_batch_invariant(
        interpreter):
    """The padded rows of a captured step sort last, past ``ends[-1]``: they come out zero. A
    row's output is bitwise the same whichever other rows share the launch."""
    k = 2
    pairs, order, ends, x, w13, w2 = expert_problem(20, k, 4, 64, 32, torch.float32)
    routed = int(ends[-1])
    short_ends = ends.clone()
    short_ends[-1] = ends[-2]  # the last expert's rows now lie past every group
    a = expert_gemm(TRITON, x, w13, short_ends, order, top_k=k, swiglu=True)
    assert bool((a[int(ends[-2]):routed] == 0).all()) and bool(a[: int(ends[-2])].abs().sum() > 0)
    full = expert_gemm(TRITON, x, w13, ends, order, top_k=k, swiglu=True)
    x2 = x.clone()
    x2[1::2] = torch.randn(x2[1::2].shape, generator=torch.Generator().manual_seed(5))
    other = expert_gemm(TRITON, x2, w13, ends, order, top_k=k, swiglu=True)
    same = (order // k) % 2 == 0
    assert torch.equal(full[same], other[same]) and not torch.equal(full, other)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_expert_gemm_on_cuda(dtype):
    """The small preset's experts at a mixed step's size, and wider ones at a prefill's."""
    for tokens, experts, dim, inter in ((104, 8, 256, 128), (700, 16, 1024, 384)):
        k = 2
        pairs, order, ends, x, w13, w2 = expert_problem(tokens, k, experts, dim, inter, dtype,
                                                        "cuda")
        a = expert_gemm(TRITON, x, w13, ends, order, top_k=k, swiglu=True)
        y = expert_gemm(TRITON, a, w2, ends, order, scatter=True)
        want_a, want_y = oracle_experts(x.cpu(), pairs.cpu(), order.cpu(), k, w13.cpu(),
                                        w2.cpu())
        tol = {torch.float32: 2e-5, torch.bfloat16: 3e-2}[dtype]
        torch.testing.assert_close(a.cpu().double(), want_a, rtol=tol, atol=tol)
        torch.testing.assert_close(y.cpu().double(), want_y, rtol=tol, atol=tol)
        dense = expert_gemm(TRITON, x, w13[:1], None, None, swiglu=True)  # the shared experts' form
        want_dense, _ = oracle_experts(x.cpu(), torch.zeros(tokens, dtype=torch.long),
                                       torch.arange(tokens), 1, w13[:1].cpu(), w2[:1].cpu())
        torch.testing.assert_close(dense.cpu().double(), want_dense, rtol=tol, atol=tol)
        gate = w2[:, :, 0].contiguous()  # [experts, dim]: a gate in the routing launch
        chosen, _ = moe_route(TRITON, x, k, gate)
        logits = (x.cpu().double() @ gate.cpu().double().T).to(dtype)
        agree = (chosen.cpu() == oracle_route(logits, k)[0]).all(1).float().mean()
        assert agree > 0.99  # near-ties may pick the other expert at the logits' last bit


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moe_kernels_on_cuda(dtype):
    y, order, weights = routed_outputs(300, 6, 5120, 384, dtype, device="cuda")
    mine = moe_combine(TRITON, y, order, weights)
    want = oracle_combine(y.cpu(), order.cpu(), weights.cpu())
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(mine.cpu().float(), want.float(), rtol=tol, atol=tol)
    shared = torch.randn(300, 5120, device="cuda").to(dtype)
    assert torch.equal(moe_combine(TRITON, y, order, weights, shared=shared), mine + shared)
    # On bf16's grid in either dtype: distinct logits lie far apart for fp32 sigmoids, equal
    # ones tie exactly, so the expected experts are not a matter of the exponential's last bit.
    logits = torch.randn(5000, 384, device="cuda").to(torch.bfloat16).to(dtype)
    chosen, route_weights = moe_route(TRITON, logits, 6)
    want_chosen, want_weights = oracle_route(logits.cpu(), 6)
    assert torch.equal(chosen.cpu(), want_chosen)
    torch.testing.assert_close(route_weights.cpu().double(), want_weights, rtol=1e-6, atol=1e-6)
    chosen = chosen[:600] % 97  # 3600 pairs: the one-program sort's largest size, ties
    order, ends = moe_sort(TRITON, chosen, 384)
    want_order, want_ends = oracle_sort(chosen.cpu(), 384)
    assert torch.equal(order.cpu(), want_order) and torch.equal(ends.cpu(), want_ends)
    h = torch.randn(333, 2 * 2304, device="cuda").to(dtype)
    g, u = h.chunk(2, dim=-1)
    torch.testing.assert_close(silu_mul(TRITON, h).float(), (F.silu(g) * u).float(), rtol=tol,
                               atol=tol)
