"""The fused indexer scores against an independent float64 oracle and the model's PyTorch path
(``index_scores``), on CPU through Triton's interpreter and on CUDA compiled; its FLOP formula
against a count of the (row, key) pairs it computes; and the model's selection through it."""

from __future__ import annotations

import pytest
import torch

from swa_bench.bench.flops import count_flops
from swa_bench.kernels.indexer import BLOCK_M, index_score_flops, index_scores_fused
from swa_bench.model.key_sources import visible_counts, visible_mask
from swa_bench.model.sparse_attention import index_scores
from tests.kernels.conftest import TRITON


def problem(rows, n, heads, d, dtype, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(rows, heads, d, generator=g, device=device).to(dtype)
    weights = torch.randn(rows, heads, generator=g, device=device).to(dtype)
    keys = torch.randn(n, d, generator=g, device=device).to(dtype)
    return q, weights, keys


def oracle(q, weights, keys, first_pos, ratio):
    """float64 ``sum_h w relu(q . k)`` where the row sees the key, -inf elsewhere."""
    s = torch.einsum("chd,nd->chn", q.double(), keys.double()).relu()
    s = (weights.double()[:, :, None] * s).sum(1)
    positions = torch.arange(first_pos, first_pos + q.shape[0])
    counts = visible_counts(positions, first_pos + q.shape[0], ratio)
    return s.masked_fill(~visible_mask(counts, keys.shape[0]), float("-inf"))


def assert_scores_close(mine, want, rtol, atol):
    assert mine.dtype == torch.float32 and mine.shape == want.shape
    hidden = torch.isinf(want)
    assert torch.equal(torch.isinf(mine), hidden) and bool((mine[hidden] < 0).all())
    torch.testing.assert_close(mine[~hidden].double(), want[~hidden], rtol=rtol, atol=atol)


# 70 rows: a full and a partial row block; 150 or 300 keys: partial key blocks, and blocks no row
# of a block sees (skipped, stored as -inf); head dims 32 and 24 (a masked tail of the dot).
CASES = [(70, 150, 3, 32, 0, 1), (70, 150, 3, 24, 100, 1), (70, 300, 2, 32, 530, 2),
         (5, 40, 4, 32, 0, 2)]


@pytest.mark.parametrize(("rows", "n", "heads", "d", "first", "ratio"), CASES)
def test_fp32_scores_are_the_exact_sum(interpreter, rows, n, heads, d, first, ratio):
    q, w, k = problem(rows, n, heads, d, torch.float32)
    mine = index_scores_fused(TRITON, q, w, k, first, ratio)
    assert_scores_close(mine, oracle(q, w, k, first, ratio), rtol=1e-5, atol=1e-5)


def test_bf16_scores_are_at_least_as_close_as_the_torch_path(interpreter):
    """The kernel sums in fp32 what the PyTorch path rounds to bf16 per head: against the exact
    sum of the same bf16 inputs it is within fp32 rounding, and never further than the PyTorch
    path, whose error sets the tolerance the checks allow."""
    q, w, k = problem(70, 150, 4, 32, torch.bfloat16)
    want = oracle(q, w, k, 0, 1)
    mine = index_scores_fused(TRITON, q, w, k, 0, 1)
    assert_scores_close(mine, want, rtol=1e-5, atol=1e-4)
    theirs = index_scores(q, w, k).masked_fill(torch.isinf(want), float("-inf"))
    seen = ~torch.isinf(want)
    assert (mine[seen].double() - want[seen]).abs().max() <= (
        theirs[seen].double() - want[seen]).abs().max()


@pytest.mark.parametrize(("rows", "n", "first", "ratio"), [(70, 150, 0, 1), (200, 90, 17, 2),
                                                           (1, 5, 3, 1), (64, 10, 300, 2)])
def test_the_flop_formula_counts_the_pairs_the_kernel_computes(rows, n, first, ratio):
    """Every row of a ``BLOCK_M`` block against the keys up to the block's last row's visible
    one, 2 d + 2 FLOPs per head; torch's counter sees the same through the op's formula."""
    heads, d = 3, 8
    pairs = 0
    for r0 in range(0, rows, BLOCK_M):
        block = range(r0, min(rows, r0 + BLOCK_M))
        reach = max(min(n, (first + r + 1) // ratio) for r in block)
        pairs += len(block) * reach
    assert index_score_flops(rows, first, n, ratio, heads, d) == pairs * heads * (2 * d + 2)
    q, w, k = (t.to("meta") for t in problem(rows, n, heads, d, torch.float32))
    assert count_flops(lambda: index_scores_fused(TRITON, q, w, k, first, ratio)) == (
        pairs * heads * (2 * d + 2))


def test_the_sparse_model_selects_the_same_positions_through_the_kernel(interpreter,
                                                                       monkeypatch):
    """A sparse full-batch step's selections with the fused scores (the selection reads the
    Triton backend, every other part runs PyTorch's: the interpreter would take a minute over
    the whole model) equal the PyTorch path's: fp32 random weights leave no near-ties here."""
    from swa_bench.engine.config import EngineConfig
    from swa_bench.engine.engine import Engine
    from swa_bench.engine.step_inputs import StepInputs
    from swa_bench.kernels import KernelSettings
    from swa_bench.model import sparse_attention
    from swa_bench.model.args import PRESETS
    from swa_bench.model.model import build_model
    from swa_bench.model.requests import RequestSpec

    args = PRESETS["sparse-tiny"]
    model, _ = build_model(args, seed=0)
    w = args.window
    load = StepInputs.seeded([RequestSpec(prompt_len=3 * w),
                              RequestSpec(prompt_len=2 * w, cached_len=w + 3)], args.vocab_size, 1)
    calls = []
    monkeypatch.setattr(sparse_attention, "index_scores_fused",
                        lambda *a: calls.append(a[1].shape) or index_scores_fused(*a))
    selections = {}
    for backend in ("torch", "triton"):
        if backend == "triton":
            monkeypatch.setattr(sparse_attention, "active_kernels", lambda: TRITON)
        engine = Engine(model, EngineConfig.for_model(model.args, kernels=KernelSettings("torch")))
        load.fill_context(engine)
        out = engine.reference_step(load.requests, load.step_tokens)
        selections[backend] = out.context.index_selection
    assert calls, "the Triton backend did not score through the kernel"
    mine, theirs = selections["triton"], selections["torch"]
    assert mine.keys() == theirs.keys() and mine
    for layer in mine:
        assert torch.equal(mine[layer], theirs[layer]), layer


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "n", "heads", "d", "first", "ratio"),
                         [*CASES, (1000, 4100, 32, 128, 8000, 2), (777, 3000, 32, 128, 2222, 1)])
def test_scores_on_cuda(dtype, rows, n, heads, d, first, ratio):
    """Against the float64 oracle, and batch-invariant: a row's scores are bitwise the same in
    any launch (the interpreter's numpy dots do not promise that; the GPU's MMA does)."""
    q, w, k = problem(rows, n, heads, d, dtype, device="cuda")
    mine = index_scores_fused(TRITON, q, w, k, first, ratio).cpu()
    rtol, atol = (1e-5, 1e-4 * d ** 0.5) if dtype == torch.float32 else (1e-4, 1e-3 * d ** 0.5)
    assert_scores_close(mine, oracle(q.cpu(), w.cpu(), k.cpu(), first, ratio), rtol, atol)
    whole = index_scores_fused(TRITON, q, w, k, first, ratio)
    for a, b in ((3, 9), (BLOCK_M, rows), (rows - 1, rows)):
        part = index_scores_fused(TRITON, q[a:b], w[a:b], k, first + a, ratio)
        assert torch.equal(whole[a:b], part)
