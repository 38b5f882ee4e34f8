"""Two-level candidates against a direct restatement of DeepSeek-V4.1's inference/model.py
(``select_candidate_blocks`` and the masked top-k of ``Indexer.forward``), written loop by loop
here: a block scores its best visible position, the block of the row's newest visible position
is pinned, the best ``topk_blocks`` are kept and unreachable blocks dropped; an index source after
S takes its top-k among the kept blocks' positions only. Then the replay with candidates against
the oracle (E1 bitwise: every row, the kept rows' selections and candidate blocks)."""

import pytest
import torch

from swa_bench.checks.comparison import Tolerance
from swa_bench.checks.equivalence import check_e1
from swa_bench.checks.oracle import expect_for
from swa_bench.engine.config import EngineConfig
from swa_bench.engine.engine import Engine
from swa_bench.engine.step_inputs import StepInputs
from swa_bench.model.args import PRESETS
from swa_bench.model.model import build_model
from swa_bench.model.requests import RequestSpec
from swa_bench.model.sparse_attention import (
    CandidateBlocks,
    IndexQuery,
    candidate_blocks,
    select_rows,
)

ARGS = PRESETS["sparse-tiny"]
NEG = float("-inf")


def reference_blocks(scores: list[float], count: int, top_blocks: int, size: int) -> list[int]:
    """One row's kept blocks, best first: the reference's rule, ties (which it leaves
    unspecified) by block id. ``scores`` cover every position; ``count`` are visible."""
    n_blocks = -(-len(scores) // size)
    block_score = []
    for b in range(n_blocks):
        best = NEG
        for p in range(b * size, min((b + 1) * size, len(scores))):
            if p < count:
                best = max(best, scores[p])
        if count > 0 and b == (count - 1) // size:
            best = float("inf")
        block_score.append(best)
    order = sorted(range(n_blocks), key=lambda b: (-block_score[b], b))
    return [b for b in order[: min(top_blocks, n_blocks)] if block_score[b] > NEG]


def reference_top_k(scores: list[float], count: int, blocks: list[int] | None, size: int,
                    k: int) -> list[int]:
    """One row's top-k visible positions (best first, ties by position), among ``blocks``'
    positions when given (an index source after S)."""
    allowed = [p for p in range(count) if blocks is None or p // size in blocks]
    chosen = sorted(allowed, key=lambda p: (-scores[p], p))[:k]
    return chosen + [-1] * (k - len(chosen))


def as_rows(blocks: torch.Tensor) -> list[list[int]]:
    return [[b for b in row if b >= 0] for row in blocks.tolist()]


@pytest.mark.parametrize("n, size, top_blocks", [(30, 2, 4), (20, 3, 5), (9, 4, 8)])
def test_candidate_blocks_are_the_references(n, size, top_blocks):
    gen = torch.Generator().manual_seed(n)
    counts = torch.tensor([0, 1, size - 1, size, size + 1, n // 2, n - 1, n]).clamp(0, n)
    scores = torch.randn(len(counts), n, generator=gen)
    # the newest block's visible positions score lowest of all: it is kept only by the pin
    for r, c in enumerate(counts.tolist()):
        if c:
            newest = (c - 1) // size * size
            scores[r, newest:c] = -10.0 - torch.rand(c - newest, generator=gen)
    visible = torch.arange(n)[None, :] < counts[:, None]
    width = min(top_blocks, -(-n // size))
    got = candidate_blocks(scores.masked_fill(~visible, NEG), counts,
                           CandidateBlocks(top_blocks, size, width))
    assert got.dtype == torch.int32 and got.shape == (len(counts), width)
    want = [reference_blocks(scores[r].tolist(), int(c), top_blocks, size)
            for r, c in enumerate(counts)]
    assert as_rows(got) == want
    assert want[0] == [] and want[1] == [0]  # nothing visible: no block; one: the pinned one
    assert any(len(w) < width for w in want)  # fewer reachable blocks than kept: -1 tail


def test_tied_blocks_rank_by_block_id():
    scores = torch.zeros(2, 12)  # ReLU makes such ties real
    counts = torch.tensor([12, 7])
    got = candidate_blocks(scores, counts, CandidateBlocks(3, 2, 3))
    assert as_rows(got) == [[5, 0, 1], [3, 0, 1]]  # the pinned newest block, then by id


def test_an_index_source_after_s_picks_among_the_candidates():
    gen = torch.Generator().manual_seed(1)
    rows, n, size, k = 6, 24, 2, 5
    counts = torch.tensor([3, 8, 12, 17, 24, 24])
    s_scores, own = torch.randn(rows, n, generator=gen), torch.randn(rows, n, generator=gen)
    visible = torch.arange(n)[None, :] < counts[:, None]
    rule = CandidateBlocks(4, size, 4)
    within = candidate_blocks(s_scores.masked_fill(~visible, NEG), counts, rule)
    index = IndexQuery(torch.zeros(rows, 1, 1), torch.zeros(rows, 1), 0, k, within=within,
                       block_size=size)
    got, published = select_rows(own, visible, index, slice(0, rows), counts)
    assert published is None
    for r in range(rows):
        blocks = reference_blocks(s_scores[r].tolist(), int(counts[r]), 4, size)
        want = reference_top_k(own[r].tolist(), int(counts[r]), blocks, size, k)
        assert got[r].tolist() == want
        unrestricted = reference_top_k(own[r].tolist(), int(counts[r]), None, size, k)
        if counts[r] > 4 * size:
            assert want != unrestricted  # this draw binds: the restriction is active


def naive_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> list[float]:
    """``sum_h w_h relu(q_h . k_j)`` of one row, key by key."""
    return [sum(float(w[h]) * max(float(q[h] @ keys[j]), 0.0) for h in range(q.shape[0]))
            for j in range(keys.shape[0])]


@pytest.fixture(scope="module")
def model():
    return build_model(ARGS, seed=0)[0]


def test_the_model_publishes_at_s_and_restricts_the_later_source(model):
    s = ARGS.last_kv_source
    later = [i for i in ARGS.index_source_list() if i > s]
    assert later == [7] and ARGS.candidates
    requests = [RequestSpec(prompt_len=30), RequestSpec(prompt_len=29, cached_len=20)]
    load = StepInputs.seeded(requests, ARGS.vocab_size, 2)
    engine = Engine(model)
    load.fill_context(engine)
    out = engine.reference_step(load.requests, load.step_tokens, record_index_queries=True)
    ctx, meta = out.context, out.step.metadata
    size, top_blocks = ARGS.candidate_block_size, ARGS.candidate_topk_blocks
    bound = 0
    for lay in meta.layouts:
        keys = engine.cache.index_key_rows(s, lay.cache_index, lay.seq_len)  # layer 7 reads S's
        for i in range(lay.q_len):
            row, pos = lay.q_start + i, lay.q_first_pos + i
            count = pos + 1
            qs, q7 = ctx.index_queries[s], ctx.index_queries[later[0]]
            s_scores = naive_scores(qs.q[row], qs.weights[row], keys)
            blocks = reference_blocks(s_scores, count, top_blocks, size)
            assert [b for b in ctx.candidates[row].tolist() if b >= 0] == blocks
            assert ctx.index_selection[s][row].tolist() == reference_top_k(
                s_scores, count, None, size, ARGS.index_topk)
            own = naive_scores(q7.q[row], q7.weights[row], keys)
            want = reference_top_k(own, count, blocks, size, ARGS.index_topk)
            assert ctx.index_selection[later[0]][row].tolist() == want
            bound += want != reference_top_k(own, count, None, size, ARGS.index_topk)
    assert bound > 0, "the candidates never changed a later selection: the test proves nothing"


@pytest.mark.parametrize("policy", ["bounded", "halo"])
def test_replay_with_candidates_is_the_oracle_bitwise(model, policy):
    requests = [RequestSpec(prompt_len=40), RequestSpec(prompt_len=12, decode=True),
                RequestSpec(prompt_len=30, cached_len=10)]
    load = StepInputs.seeded(requests, ARGS.vocab_size, 1)
    config = EngineConfig.for_model(ARGS, policy=policy)
    assert expect_for(Engine(model, config), load.requests).trims
    result = check_e1(model, load, config, decode_steps=2, tol=Tolerance.for_dtype(torch.float32))
    assert result.passed, result.message
