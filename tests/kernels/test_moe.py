"""The routed experts' fused elementwise steps against independent oracles (a per-token loop
with the PyTorch path's roundings), on CPU through Triton's interpreter and on CUDA compiled;
and the model's MoE through them against its PyTorch path."""

from __future__ import annotations

import math

import pytest
import torch

from swa_bench.kernels import moe as moe_kernels
from swa_bench.kernels.moe import expert_gemm, moe_combine, moe_route, moe_sort, silu_mul
from swa_bench.model import moe as model_module
from swa_bench.model.args import PRESETS
from swa_bench.model.moe import MoE
from tests.kernels.conftest import TRITON, on_kernels


def routed_outputs(tokens, k, dim, experts, dtype, device="cpu", seed=0):
    """Expert-sorted outputs ``y`` of the (token, expert) pairs (weighted already: the
    reference's weight multiplies before ``w2``) and the sort ``order``, as ``MoE.routed``
    forms them."""
    g = torch.Generator(device=device).manual_seed(seed)
    pairs = torch.stack([torch.randperm(experts, generator=g, device=device)[:k]
                         for _ in range(tokens)]).flatten()
    order = torch.argsort(pairs, stable=True)
    y = torch.randn(tokens * k, dim, generator=g, device=device).to(dtype)
    return y, order


def oracle_combine(y, order, k, shared=None):
    """Per token: its k rows found by search in ``order``, summed in fp32 in slot order, plus
    the shared expert's row in fp32, rounded once (the reference's fp32 accumulator)."""
    t = y.shape[0] // k
    where = {int(pair): i for i, pair in enumerate(order.tolist())}
    out = torch.empty(t, y.shape[1], dtype=y.dtype)
    for tok in range(t):
        acc = torch.zeros(y.shape[1], dtype=torch.float32)
        for j in range(k):
            acc += y[where[tok * k + j]].float()
        if shared is not None:
            acc += shared[tok].float()
        out[tok] = acc.to(y.dtype)
    return out


# Two roundings of the dtype apart at most: the interpreter rounds to bf16 by truncation (the
# GPU to nearest), and the exponentials may differ in fp32's last bit, which a rounding to bf16
# can carry one bf16 step further.
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 2 ** -6}


def test_combine_is_the_per_token_sum(interpreter):
    y, order = routed_outputs(9, 3, 1100, 5, torch.float32)  # 1100: a masked tail
    assert torch.equal(moe_combine(TRITON, y, order, 3), oracle_combine(y, order, 3))
    into = torch.full((12, 1100), 7.0)
    moe_combine(TRITON, y, order, 3, out=into[2:11])
    assert torch.equal(into[2:11], oracle_combine(y, order, 3))
    assert bool((into[:2] == 7).all() and (into[11:] == 7).all())
    in_pair_order = torch.empty_like(y).index_copy_(0, order, y)
    assert torch.equal(moe_combine(TRITON, in_pair_order, None, 3), oracle_combine(y, order, 3))
    y, order = routed_outputs(9, 3, 1100, 5, torch.bfloat16)
    tol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(moe_combine(TRITON, y, order, 3).float(),
                               oracle_combine(y, order, 3).float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_adds_the_shared_expert_in_the_fp32_sum(interpreter, dtype):
    """The routed rows and the shared output in one fp32 sum, rounded once (not the routed sum
    rounded, then the shared added and rounded again)."""
    y, order = routed_outputs(9, 3, 1100, 5, dtype, seed=4)
    shared = torch.randn(9, 1100, generator=torch.Generator().manual_seed(5)).to(dtype)
    mine = moe_combine(TRITON, y, order, 3, shared=shared)
    want = oracle_combine(y, order, 3, shared)
    if dtype == torch.float32:
        assert torch.equal(mine, want)
        return
    # The interpreter rounds to bf16 by truncation, torch to nearest: one bf16 step apart.
    assert bool(((mine.float() - want.float()).abs() <= 2 ** -7 * want.float().abs()).all())
    twice = (oracle_combine(y, order, 3) + shared).float()
    assert bool((mine.float() != twice).any())  # the double rounding is another result


def oracle_route(logits, bias, k, route_scale):
    """DeepSeek-V4.1 `Gate` in float64, row by row: ``sqrt(log(1 + e^logit))``, the k highest
    of score + bias (ties by the lower expert index), their unbiased scores over the sum
    (+1e-20 for k > 1) times ``route_scale``."""
    chosen, weights = [], []
    for row in logits.double().tolist():
        scores = [math.sqrt(math.log1p(math.exp(v))) for v in row]
        biased = [s + float(b) for s, b in zip(scores, bias.double().tolist(), strict=True)]
        top = sorted(range(len(row)), key=lambda e, b=biased: (-b[e], e))[:k]
        values = [scores[e] for e in top]
        total = sum(values) + 1e-20 if k > 1 else 1.0
        chosen.append(top)
        weights.append([v / total * route_scale for v in values])
    return torch.tensor(chosen), torch.tensor(weights, dtype=torch.float64)


def route_bias(experts, seed, zero=False):
    g = torch.Generator().manual_seed(seed)
    return torch.zeros(experts) if zero else 0.1 * torch.randn(experts, generator=g)


@pytest.mark.parametrize(("rows", "experts", "k", "dtype", "zero_bias"),
                         [(37, 10, 3, torch.float32, False), (5, 384, 6, torch.bfloat16, True),
                          (5, 384, 6, torch.bfloat16, False), (17, 8, 2, torch.float32, False),
                          (17, 8, 1, torch.float32, False)])
def test_route_is_the_reference_gate(interpreter, rows, experts, k, dtype, zero_bias):
    """Rows past a block's end, expert counts off a power of two, tied bf16 logits (zero bias:
    the lower index first among equal scores), top-1 (not normalised): the k highest biased
    scores, highest first, and the weights to fp32 rounding."""
    logits = (2 * torch.randn(rows, experts, generator=torch.Generator().manual_seed(6))).to(dtype)
    logits[0, :3] = 30.0  # softplus past torch's threshold: the identity there
    bias = route_bias(experts, rows, zero_bias)
    chosen, weights = moe_route(TRITON, logits.float(), k, bias, 1.5)
    want_chosen, want_weights = oracle_route(logits, bias, k, 1.5)
    assert chosen.dtype == torch.long and weights.dtype == torch.float32
    assert torch.equal(chosen, want_chosen)
    torch.testing.assert_close(weights.double(), want_weights, rtol=1e-6, atol=1e-6)
    if not zero_bias:  # the bias moved some choice: the test sees it
        assert not torch.equal(chosen, oracle_route(logits, 0 * bias, k, 1.5)[0])


@pytest.mark.parametrize(("rows", "experts", "dim", "dtype"),
                         [(37, 10, 100, torch.float32), (5, 8, 256, torch.bfloat16)])
def test_route_with_the_gate_is_the_route_of_the_gates_fp32_logits(interpreter, rows, experts,
                                                                   dim, dtype):
    """The gate's product in the routing launch: the oracle's route of the logits computed in
    float64, not rounded to the dtype (the reference's fp32 gate; dims off the block)."""
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(rows, dim, generator=g).to(dtype)
    gate = (torch.randn(experts, dim, generator=g) * dim ** -0.5).to(dtype)
    bias = route_bias(experts, dim)
    chosen, weights = moe_route(TRITON, x, 3, bias, 1.5, gate)
    want_chosen, want_weights = oracle_route(x.double() @ gate.double().T, bias, 3, 1.5)
    assert torch.equal(chosen, want_chosen)
    torch.testing.assert_close(weights.double(), want_weights, rtol=1e-6, atol=1e-6)


def test_dense_expert_gemm_is_every_rows_swiglu(interpreter):
    """Without an order (the shared expert): one weight for every row in order, the clamps."""
    pairs, order, ends, x, w13, w2 = expert_problem(37, 1, 1, 96, 40, torch.float32)
    want_a, _ = oracle_experts(x, pairs, order, 1, w13, w2, LIMIT)
    a = expert_gemm(TRITON, x, w13, None, None, swiglu=True, limit=LIMIT)
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


def oracle_swiglu(h, limit, row_weights=None):
    """DeepSeek-V4.1 `Expert` between its GEMMs, element by element in float64: up clamped to
    [-limit, limit], gate from above, ``silu(gate) * up`` times the row's routing weight."""
    inter = h.shape[1] // 2
    out = torch.empty(h.shape[0], inter, dtype=torch.float64)
    for r, row in enumerate(h.double().tolist()):
        w = 1.0 if row_weights is None else float(row_weights[r])
        for i in range(inter):
            gate, up = row[i], row[inter + i]
            if limit > 0:
                up, gate = min(max(up, -limit), limit), min(gate, limit)
            out[r, i] = w * gate / (1.0 + math.exp(-gate)) * up
    return out


LIMIT = 1.0  # binds on unit-size inputs, on both sides


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("limit", [0.0, LIMIT])
def test_silu_mul_is_the_reference_swiglu(interpreter, dtype, limit):
    """Unweighted (the shared expert) and with each row's pair's routing weight."""
    h = (2 * torch.randn(7, 2 * 1100, generator=torch.Generator().manual_seed(1))).to(dtype)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(silu_mul(TRITON, h, limit).double(), oracle_swiglu(h, limit),
                               rtol=tol, atol=tol)
    weights = torch.rand(4, 2, generator=torch.Generator().manual_seed(2))
    order = torch.tensor([3, 0, 6, 1, 7, 2, 5])  # 7 of the 8 pairs, in expert order
    mine = silu_mul(TRITON, h, limit, weights, order).double()
    torch.testing.assert_close(mine, oracle_swiglu(h, limit, weights.flatten()[order]),
                               rtol=tol, atol=tol)


@pytest.mark.parametrize("path", ["expert_gemm", "grouped_mm", "gate_apart"])
def test_the_moe_takes_the_kernels_for_inference_only(interpreter, monkeypatch, path):
    """Forced to Triton, an inference MoE (chunked, the shared expert, the preset's clamp and
    route scale) gives the PyTorch path's output up to rounding and runs the kernels; with
    gradients it keeps the PyTorch path. ``expert_gemm``: the GEMMs with the SwiGLU epilogue
    (fp32 on CUDA; CPU); ``grouped_mm``: ``torch._grouped_mm`` with ``silu_mul`` between (bf16
    on CUDA, the timed path); ``gate_apart``: the gate's GEMM outside ``moe_route`` (V4.1's
    gate)."""
    args = PRESETS["sparse-tiny"]
    assert args.swiglu_limit > 0 and args.route_scale != 1
    moe = MoE(args)
    init_weights_of(moe)
    x = 2 * torch.randn(23, args.dim, generator=torch.Generator().manual_seed(2))
    monkeypatch.setattr(model_module, "MOE_ROWS", 10)  # three chunks written in place
    if path == "grouped_mm":
        monkeypatch.setattr(model_module, "native_grouped_mm", lambda x: True)
    if path == "gate_apart":
        monkeypatch.setattr(model_module, "gate_in_route", lambda *shape: False)
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
        moe.gate.bias.mul_(0.3)  # about 0.1


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


def oracle_experts(x, pairs, order, k, w13, w2, limit=0.0, weights=None):
    """Per sorted row, in float64: its token's input, its expert's gate/up GEMM rounded to the
    dtype (the GEMM's output), the clamped SwiGLU times the pair's routing weight (``weights
    [T, k]``, when given), then the down projection of that rounded to the dtype, written at
    the pair's index."""
    inter, dtype = w2.shape[2], x.dtype
    a = torch.empty(order.numel(), inter, dtype=torch.float64)
    y = torch.empty(order.numel(), w2.shape[1], dtype=torch.float64)
    for r, pair in enumerate(order.tolist()):
        e = int(pairs[pair])
        h = (x[pair // k].double() @ w13[e].double().T).to(dtype)
        w = None if weights is None else weights.flatten()[pair : pair + 1]
        a[r] = oracle_swiglu(h[None], limit, w)[0]
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
    weights = torch.rand(37, k, generator=torch.Generator().manual_seed(7))
    a = expert_gemm(TRITON, x, w13, ends, order, top_k=k, swiglu=True, limit=LIMIT,
                    weights=weights)
    y = expert_gemm(TRITON, a, w2, ends, order, scatter=True)
    want_a, want_y = oracle_experts(x, pairs, order, k, w13, w2, LIMIT, weights)
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
        weights = torch.rand(tokens, k, device="cuda")
        a = expert_gemm(TRITON, x, w13, ends, order, top_k=k, swiglu=True, limit=LIMIT,
                        weights=weights)
        y = expert_gemm(TRITON, a, w2, ends, order, scatter=True)
        want_a, want_y = oracle_experts(x.cpu(), pairs.cpu(), order.cpu(), k, w13.cpu(),
                                        w2.cpu(), LIMIT, weights.cpu())
        tol = {torch.float32: 2e-5, torch.bfloat16: 3e-2}[dtype]
        torch.testing.assert_close(a.cpu().double(), want_a, rtol=tol, atol=tol)
        torch.testing.assert_close(y.cpu().double(), want_y, rtol=tol, atol=tol)
        dense = expert_gemm(TRITON, x, w13[:1], None, None, swiglu=True, limit=LIMIT)
        want_dense, _ = oracle_experts(x.cpu(), torch.zeros(tokens, dtype=torch.long),
                                       torch.arange(tokens), 1, w13[:1].cpu(), w2[:1].cpu(),
                                       LIMIT)
        torch.testing.assert_close(dense.cpu().double(), want_dense, rtol=tol, atol=tol)
        gate = w2[:, :, 0].contiguous()  # [experts, dim]: a gate in the routing launch
        bias = route_bias(experts, tokens).cuda()
        chosen, _ = moe_route(TRITON, x, k, bias, 1.5, gate)
        logits = x.cpu().double() @ gate.cpu().double().T
        agree = (chosen.cpu() == oracle_route(logits, bias.cpu(), k, 1.5)[0]).all(1)
        assert agree.float().mean() > 0.99  # near-ties may pick the other expert


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moe_kernels_on_cuda(dtype):
    y, order = routed_outputs(300, 6, 5120, 384, dtype, device="cuda")
    shared = torch.randn(300, 5120, device="cuda").to(dtype)
    mine = moe_combine(TRITON, y, order, 6, shared=shared)
    want = oracle_combine(y.cpu(), order.cpu(), 6, shared.cpu())
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(mine.cpu().float(), want.float(), rtol=tol, atol=tol)
    # On bf16's grid with no bias: distinct logits lie far apart for fp32 scores, equal ones
    # tie exactly, so the expected experts are not a matter of the exponential's last bit.
    logits = torch.randn(5000, 384, device="cuda").to(torch.bfloat16).float()
    bias = torch.zeros(384, device="cuda")
    chosen, route_weights = moe_route(TRITON, logits, 6, bias, 1.5)
    want_chosen, want_weights = oracle_route(logits.cpu(), bias.cpu(), 6, 1.5)
    assert torch.equal(chosen.cpu(), want_chosen)
    torch.testing.assert_close(route_weights.cpu().double(), want_weights, rtol=1e-6, atol=1e-6)
    chosen = chosen[:600] % 97  # 3600 pairs: the one-program sort's largest size, ties
    order, ends = moe_sort(TRITON, chosen, 384)
    want_order, want_ends = oracle_sort(chosen.cpu(), 384)
    assert torch.equal(order.cpu(), want_order) and torch.equal(ends.cpu(), want_ends)
    h = (2 * torch.randn(33, 2 * 2304, device="cuda")).to(dtype)
    torch.testing.assert_close(silu_mul(TRITON, h, LIMIT).cpu().double(),
                               oracle_swiglu(h.cpu(), LIMIT), rtol=tol, atol=tol)
