"""E1/E2's judgement of top-k selections: a near-tie is told apart from a wrong selection, and the
truth re-run on the replay's selection really attends to it."""

from __future__ import annotations

import math

import torch

from swa_bench.checks import oracle
from swa_bench.checks.comparison import Tolerance
from swa_bench.checks.equivalence import check_e1, check_e2, twin_of
from swa_bench.checks.selection import compare_selections, near_tie_ratio
from swa_bench.engine.config import EngineConfig
from swa_bench.engine.engine import Engine
from swa_bench.engine.step_inputs import StepInputs
from swa_bench.model.args import PRESETS
from swa_bench.model.model import build_model
from swa_bench.model.requests import RequestSpec

TOL = Tolerance(rtol=0.0, atol=0.1)
# top-3: {0, 1, 2}, k-th score 3.0
SCORES = torch.tensor([5.0, 4.0, 3.0, 2.95, 1.0, 0.0], dtype=torch.float64)


def test_near_tie_ratio():
    assert near_tie_ratio(SCORES, {0, 1, 2}, {0, 1, 2}, 3, TOL) == 0.0
    assert math.isclose(near_tie_ratio(SCORES, {0, 1, 3}, {0, 1, 2}, 3, TOL), 0.5)
    assert near_tie_ratio(SCORES, {0, 1, 5}, {0, 1, 2}, 3, TOL) == 30.0  # 3.0 below the cut
    assert math.isclose(near_tie_ratio(SCORES, {0, 2, 3}, {0, 1, 2}, 3, TOL), 10.0)  # 4 > 3+.1
    assert near_tie_ratio(SCORES, {0, 1}, {0, 1, 2}, 3, TOL) == math.inf  # a lost position
    assert near_tie_ratio(SCORES, {0, 1, 9}, {0, 1, 2}, 3, TOL) == math.inf  # not visible


def _sparse_step():
    args = PRESETS["sparse-tiny"]
    model, _ = build_model(args, seed=3)
    inputs = StepInputs.seeded([RequestSpec(prompt_len=40), RequestSpec(prompt_len=23)],
                               args.vocab_size, seed=5, cache_indices=[2, 0])
    eng = Engine(model, EngineConfig.for_model(model.args, policy="bounded"))
    inputs.fill_context(eng)
    pristine = twin_of(eng)
    reqs, toks, idx = inputs.requests, inputs.step_tokens, inputs.cache_indices
    exp = oracle.expect_for(eng, reqs)
    ora = oracle.oracle_forward(twin_of(eng), reqs, toks, idx, exp)
    bounded = oracle.bounded_reference_metadata(pristine.prepare(reqs, toks, idx), exp, args)
    truth = twin_of(pristine)
    ref = truth.reference_step(reqs, toks, idx, layer_metadata=bounded, record_index_queries=True)
    return model, inputs, pristine, ora, ref, truth, bounded


def _ranked(ref, truth, layer, row):
    """The truth's positions of ``row`` at ``layer`` by score, highest first (after S: the
    truth's candidate positions first, the rest at -inf)."""
    from swa_bench.model.sparse_attention import candidate_mask, index_scores

    q = ref.context.index_queries[layer]
    meta = ref.step.metadata
    pos, lay = int(meta.positions[row]), meta.layouts[int(meta.row_request[row])]
    keys = truth.cache.index_key_rows(q.source, lay.cache_index, pos + 1)
    scores = index_scores(q.q[row : row + 1], q.weights[row : row + 1], keys)[0]
    if q.within is not None:
        allowed = candidate_mask(q.within[row : row + 1], scores.shape[0], q.block_size)[0]
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.sort(scores, descending=True, stable=True).indices.tolist()


def test_selections_agree_on_cpu_and_a_wrong_one_fails():
    model, _, _, ora, ref, truth, _ = _sparse_step()
    layers = sorted(ora.kept_context.index_selection)
    assert layers == [5, 7]  # S and the decoder's index source run on the kept rows
    same = compare_selections(ora, ref, truth.cache, torch.float32)
    assert same.rows_compared == 2 * len(ora.expected.rows)
    assert same.rows_differing == 0 and not same.diagnostics and not same.given

    j = len(ora.expected.rows) - 1  # the last kept row: 22 visible positions, top 6
    row, k = ora.expected.rows[j], model.args.index_topk
    ranked = _ranked(ref, truth, 7, row)
    wrong = ora.kept_context.index_selection[7].clone()
    wrong[j] = torch.tensor(ranked[:k - 1] + [ranked[-1]])  # the lowest score instead of k-th
    ora.kept_context.index_selection[7] = wrong
    bad = compare_selections(ora, ref, truth.cache, torch.float32)
    assert bad.rows_differing == 1 and bad.diagnostics
    assert bad.diagnostics[0].tensor.startswith("selection.layer7")
    assert bad.given  # the truth is still re-run on the replay's selection


def test_near_tie_passes_and_the_truth_reruns_on_the_given_selection():
    model, inputs, pristine, ora, ref, truth, bounded = _sparse_step()
    j = len(ora.expected.rows) - 1
    row, k = ora.expected.rows[j], model.args.index_topk
    ranked = _ranked(ref, truth, 7, row)
    swapped = ranked[:k - 1] + [ranked[k]]  # the (k+1)-th for the k-th: a near-tie
    tied = ora.kept_context.index_selection[7].clone()
    tied[j] = torch.tensor(swapped)
    ora.kept_context.index_selection[7] = tied
    loose = Tolerance(rtol=0.0, atol=1e9)
    chosen = compare_selections(ora, ref, truth.cache, torch.float32, tol=loose)
    assert chosen.rows_differing == 1 and not chosen.diagnostics
    assert 0.0 < chosen.worst_ratio <= 1.0
    rerun = twin_of(pristine).reference_step(
        inputs.requests, inputs.step_tokens, inputs.cache_indices, layer_metadata=bounded,
        given_selection=chosen.given)
    assert sorted(rerun.context.index_selection[7][row].tolist()) == sorted(swapped)
    assert not torch.equal(rerun.streams[0][row], ref.streams[0][row])  # it attended to it
    others = [r for r in range(ref.step.num_tokens) if r != row]
    # The earlier rows never read that row, but its new routing after layer 7 changes the experts'
    # group sizes, and a grouped GEMM may round a row differently in a group of another size:
    # equal up to fp32 rounding, not bit for bit.
    torch.testing.assert_close(rerun.streams[0][others[:row]], ref.streams[0][others[:row]],
                               rtol=1e-5, atol=1e-5)


def test_a_later_source_choosing_outside_the_candidates_fails_however_close():
    """After S only S's candidate blocks are eligible: a position outside them fails even at a
    score the allowance would call a near-tie."""
    model, _, _, ora, ref, truth, _ = _sparse_step()
    j = len(ora.expected.rows) - 1
    row, k = ora.expected.rows[j], model.args.index_topk
    eligible = set(_ranked(ref, truth, 7, row)[:k])
    query = ref.context.index_queries[7]
    blocks = {b for b in query.within[row].tolist() if b >= 0}
    outside = next(p for p in range(int(ref.step.metadata.positions[row]) + 1)
                   if p // query.block_size not in blocks)
    picked = ora.kept_context.index_selection[7].clone()
    picked[j] = torch.tensor(sorted(eligible)[: k - 1] + [outside])
    ora.kept_context.index_selection[7] = picked
    loose = Tolerance(rtol=0.0, atol=1e9)
    chosen = compare_selections(ora, ref, truth.cache, torch.float32, tol=loose)
    assert chosen.rows_differing == 1 and chosen.worst_ratio == math.inf and chosen.diagnostics


def test_e1_and_e2_report_the_selections_on_a_sparse_model():
    model, inputs, *_ = _sparse_step()
    config = EngineConfig.for_model(model.args, policy="bounded")
    e1 = check_e1(model, inputs, config, decode_steps=2)
    e2 = check_e2(model, inputs, config)
    assert e1.passed and "top-k selections equal" in e1.message
    assert e2.passed and "top-k selections equal" in e2.message
