"""The sparse preset's parts against plain oracles: the indexer's top-k, gathered attention, routed
experts; then E1-E5 on the whole stack in every graph mode and under every policy."""

import pytest
import torch

from swa_bench.checks.comparison import Tolerance
from swa_bench.checks.equivalence import check_e1, check_e2, check_e3, check_e4, check_e5
from swa_bench.checks.oracle import expect_for
from swa_bench.engine.config import EngineConfig
from swa_bench.engine.engine import Engine
from swa_bench.engine.step_inputs import StepInputs
from swa_bench.kernels import KernelSettings
from swa_bench.model.args import PRESETS
from swa_bench.model.attention import gathered_attention
from swa_bench.model.model import build_model
from swa_bench.model.requests import RequestSpec
from swa_bench.model.sparse_attention import IndexQuery, select_varlen

TOL = Tolerance.for_dtype(torch.float32)
ARGS = PRESETS["sparse-tiny"]


@pytest.fixture(scope="module")
def sparse_model():
    model, _ = build_model(ARGS, seed=0)
    return model


def mixed(w: int) -> list[RequestSpec]:
    return [
        RequestSpec(prompt_len=12, decode=True),
        RequestSpec(prompt_len=6 * w),
        RequestSpec(prompt_len=w + 1),
        RequestSpec(prompt_len=5 * w, cached_len=2 * w + 3),
        RequestSpec(prompt_len=7 * w, chunk_size=3 * w),
    ]


def naive_top_k(q, weights, keys, positions, ratio, k):
    """Per row: score every visible key, order by (score descending, position ascending)."""
    out = []
    for t, pos in enumerate(positions):
        visible = pos + 1 if ratio == 1 else (pos + 1) // ratio
        scored = []
        for j in range(min(visible, keys.shape[0])):
            score = sum(float(weights[t, h]) * max(float(q[t, h] @ keys[j]), 0.0)
                        for h in range(q.shape[1]))
            scored.append((-score, j))
        chosen = [j for _, j in sorted(scored)[:k]]
        out.append(chosen + [-1] * (k - len(chosen)))
    return torch.tensor(out)


@pytest.mark.parametrize("source", [2, 5])  # a compressed encoder source, and S
def test_indexer_top_k_matches_a_per_row_oracle(sparse_model, source):
    requests = [RequestSpec(prompt_len=30), RequestSpec(prompt_len=29, cached_len=20)]
    load = StepInputs.seeded(requests, ARGS.vocab_size, 1)
    engine = Engine(sparse_model)
    load.fill_context(engine)
    engine.step(load.requests, load.step_tokens)  # fills every source's index keys
    step = engine.prepare(load.requests, load.step_tokens)
    meta = step.metadata
    ratio = ARGS.compress_ratio_for(source)
    gen = torch.Generator().manual_seed(source)
    q = torch.randn(meta.num_rows, ARGS.index_n_heads, ARGS.index_head_dim, generator=gen)
    weights = torch.randn(meta.num_rows, ARGS.index_n_heads, generator=gen)
    index = IndexQuery(q, weights, source, ARGS.index_topk)
    chosen, _ = select_varlen(meta, engine.cache, index, ratio)
    for lay in meta.layouts:
        keys = engine.cache.index_key_rows(source, lay.cache_index, lay.seq_len // ratio)
        rows = slice(lay.q_start, lay.q_start + lay.q_len)
        positions = range(lay.q_first_pos, lay.q_first_pos + lay.q_len)
        oracle = naive_top_k(q[rows], weights[rows], keys, positions, ratio, ARGS.index_topk)
        assert torch.equal(chosen[rows], oracle)


def test_gathered_attention_equals_dense_attention_restricted_to_the_chosen_keys():
    gen = torch.Generator().manual_seed(0)
    t, heads, d, n_win, n_glob = 7, 3, 16, 20, 30
    q = torch.randn(t, heads, d, generator=gen)
    win_kv, glob_kv = torch.randn(n_win, d, generator=gen), torch.randn(n_glob, d, generator=gen)
    win_idx = torch.stack([torch.randperm(n_win, generator=gen)[:4] for _ in range(t)])
    glob_idx = torch.stack([torch.randperm(n_glob, generator=gen)[:6] for _ in range(t)])
    win_idx[0, 1:] = -1
    glob_idx[2, :] = -1  # a row with no global key
    glob_idx[3, ::2] = -1
    sink = torch.randn(heads, generator=gen)
    scale = d**-0.5
    out = gathered_attention(q, [(win_kv, win_idx), (glob_kv, glob_idx)], sink, scale)

    keys = torch.cat([win_kv, glob_kv])
    mask = torch.zeros(t, n_win + n_glob, dtype=torch.bool)
    for row in range(t):
        for j in win_idx[row][win_idx[row] >= 0]:
            mask[row, j] = True
        for j in glob_idx[row][glob_idx[row] >= 0]:
            mask[row, n_win + j] = True
    scores = torch.einsum("thd,nd->thn", q, keys) * scale
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    with_sink = torch.cat([scores, sink.view(1, heads, 1).expand(t, heads, 1)], dim=-1)
    probs = torch.softmax(with_sink, dim=-1)[..., :-1]
    expected = torch.einsum("thn,nd->thd", probs, keys)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_layers_share_expert_storage_round_robin(sparse_model):
    pools = ARGS.expert_weight_pools
    ptr = [block.moe.experts.w13.data_ptr() for block in sparse_model.layers]
    assert len(set(ptr)) == pools
    assert all(ptr[i] == ptr[i % pools] for i in range(len(ptr)))
    owned = [n for n, _ in sparse_model.named_parameters()
             if "w13" in n and "shared" not in n and not n.startswith("dspark.")]
    assert len(owned) == pools


def test_e4_on_the_sparse_preset(sparse_model):
    load = StepInputs.seeded([RequestSpec(prompt_len=30)], ARGS.vocab_size, 4)
    result = check_e4(sparse_model, load, tol=TOL, kernels=KernelSettings())
    assert result.passed, result.message


@pytest.mark.parametrize("policy", ["bounded", "halo", "final_window", "tail"])
def test_e1_for_every_replaying_policy(sparse_model, policy):
    load = StepInputs.seeded(mixed(ARGS.window), ARGS.vocab_size, 5)
    config = EngineConfig.for_model(sparse_model.args, policy=policy)
    expected = expect_for(Engine(sparse_model, config), load.requests)
    assert expected.replays and expected.trims, "the mixed batch must trim under every policy"
    result = check_e1(sparse_model, load, config, decode_steps=3, tol=TOL)
    assert result.passed, result.message


def test_e2_on_the_sparse_preset(sparse_model):
    load = StepInputs.seeded(mixed(ARGS.window), ARGS.vocab_size, 6)
    halo = EngineConfig.for_model(sparse_model.args, policy="halo")
    result = check_e2(sparse_model, load, halo, tol=TOL)
    assert result.passed, result.message


@pytest.mark.parametrize(("mode", "policy"), [("piecewise", "bounded"), ("full", "final_window")])
def test_e3_graphs_are_bitwise_eager_on_the_sparse_preset(sparse_model, mode, policy):
    load = StepInputs.seeded(mixed(ARGS.window), ARGS.vocab_size, 7)
    config = EngineConfig.for_model(sparse_model.args, policy=policy, graph_mode=mode,
                                    trim_threshold=32, capture_sizes=(8, 16, 32, 64, 128))
    result = check_e3(sparse_model, load, config)
    assert result.passed, result.message


@pytest.mark.parametrize("mode", ["eager", "piecewise", "full"])
def test_e5_on_the_sparse_preset(sparse_model, mode):
    load = StepInputs.seeded(mixed(ARGS.window), ARGS.vocab_size, 8)
    config = EngineConfig.for_model(sparse_model.args, graph_mode=mode, trim_threshold=32,
                                    capture_sizes=(8, 16, 32, 64, 128))
    result = check_e5(sparse_model, load, config)
    assert result.passed, result.message


@pytest.mark.parametrize("n", [5, 40, 300])
def test_top_k_selection_is_a_stable_descending_sort(n):
    """The key-packed ``topk`` picks what a stable descending sort picks, in its order: ties
    (many exact zeros, -0 against +0, repeated values, +-inf) by position, masked columns
    never, -1 past the visible ones."""
    from swa_bench.model.sparse_attention import select_top_k

    gen = torch.Generator().manual_seed(n)
    scores = torch.randn(64, n, generator=gen).relu()  # about half exact zeros
    scores[:, ::7] = -0.0
    scores[:, 1::9] = scores[:, :1]  # repeats of a row's first score
    scores[3, :2] = float("inf")
    scores[5] = float("-inf")
    scores[6] = torch.randn(n, generator=gen) * 1e-38  # subnormals of both signs
    visible = torch.rand(64, n, generator=gen) > 0.2
    visible[7] = False
    for top_k in (1, 4, 32):
        masked = scores.masked_fill(~visible, float("-inf"))
        ranked = torch.sort(masked, dim=-1, descending=True, stable=True)
        k = min(top_k, n)
        want = torch.where(ranked.values[:, :k] > float("-inf"), ranked.indices[:, :k], -1)
        want = torch.cat([want, want.new_full((64, top_k - k), -1)], dim=1)
        assert torch.equal(select_top_k(scores, visible, top_k), want)
