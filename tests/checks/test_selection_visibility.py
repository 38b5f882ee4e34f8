"""The visibility check: the oracle's causal rule against brute force, its verdicts on hand-made
selections, and a visibility off by one on every path (which E1-E5 pass) failing it."""

from __future__ import annotations

import pytest
import torch

from swa_bench.checks.oracle import visible_key_count
from swa_bench.checks.selection import candidate_visibility, check_visibility, selection_visibility
from swa_bench.engine.config import EngineConfig
from swa_bench.engine.step_inputs import StepInputs
from swa_bench.model.args import PRESETS
from swa_bench.model.model import build_model
from swa_bench.model.requests import RequestSpec
from swa_bench.model.sparse_attention import IndexQuery
from tests.faults.faults import visibility_off_by_one


@pytest.mark.parametrize("ratio", [1, 2, 3, 4])
def test_visible_key_count_is_the_groups_already_closed(ratio):
    """Key j pools positions j*r .. j*r + r - 1: visible at t iff all of them are <= t,
    enumerated position by position."""
    positions = torch.arange(41)
    want = [sum(1 for j in range(t + 1) if all(p <= t for p in range(j * ratio, (j + 1) * ratio)))
            for t in positions.tolist()]
    assert visible_key_count(positions, ratio).tolist() == want


def _query(top_k, within=None, block_size=1):
    return IndexQuery(q=torch.zeros(0), weights=torch.zeros(0), source=0, top_k=top_k,
                      within=within, block_size=block_size)


def _failed(diags):
    return sorted(d.tensor.split(":")[0] for d in diags if d is not None)


def test_selection_verdicts():
    """Rows at positions 0, 2, 5 (ratio 1: 1, 3, 6 visible keys), top-3."""
    positions = torch.tensor([0, 2, 5])
    counts = visible_key_count(positions, 1)
    good = torch.tensor([[0, -1, -1], [2, 0, 1], [5, 3, 1]])
    assert _failed(selection_visibility("", good, positions, counts, _query(3))) == []
    short = torch.tensor([[0, -1, -1], [1, 0, -1], [5, 3, 1]])  # row 1 leaves position 2 out
    assert _failed(selection_visibility("", short, positions, counts, _query(3))) == [
        "chosen_count"]
    future = torch.tensor([[1, -1, -1], [2, 0, 1], [5, 3, 1]])  # row 0 reads position 1
    assert _failed(selection_visibility("", future, positions, counts, _query(3))) == [
        "chose_invisible"]
    twice = torch.tensor([[0, -1, -1], [2, 2, 1], [5, 3, 1]])
    assert _failed(selection_visibility("", twice, positions, counts, _query(3))) == [
        "chose_repeated"]


def test_selection_within_candidate_blocks():
    """After S: only the candidate blocks' visible positions count (blocks of 2)."""
    positions = torch.tensor([5, 5])
    counts = visible_key_count(positions, 1)  # 6: blocks 0, 1, 2
    within = torch.tensor([[2, 0], [2, -1]])  # row 0: positions 0, 1, 4, 5; row 1: 4, 5
    good = torch.tensor([[5, 4, 0], [4, 5, -1]])
    assert _failed(selection_visibility("", good, positions, counts,
                                         _query(3, within, 2))) == []
    outside = torch.tensor([[5, 4, 2], [4, 5, -1]])  # position 2 lies in block 1
    assert _failed(selection_visibility("", outside, positions, counts,
                                         _query(3, within, 2))) == ["chose_invisible"]
    short = torch.tensor([[5, 4, 0], [4, -1, -1]])
    assert _failed(selection_visibility("", short, positions, counts,
                                         _query(3, within, 2))) == ["chosen_count"]


def test_candidate_verdicts():
    positions = torch.tensor([0, 4])  # 1 and 5 visible: blocks {0} and {0, 1, 2} of 2
    counts = visible_key_count(positions, 1)
    good = torch.tensor([[0, -1], [2, 1]])
    assert _failed(candidate_visibility("", good, positions, counts, 2)) == []
    assert _failed(candidate_visibility("", torch.tensor([[0, -1], [1, 0]]), positions,
                                         counts, 2)) == ["newest_block_missing"]
    assert _failed(candidate_visibility("", torch.tensor([[1, -1], [2, 1]]), positions,
                                         counts, 2)) == ["newest_block_missing",
                                                         "unreachable_block"]  # row 0: block 1
    assert _failed(candidate_visibility("", torch.tensor([[0, -1], [2, -1]]), positions,
                                         counts, 2)) == ["block_count"]


def _case(preset):
    args = PRESETS[preset]
    model, _ = build_model(args, seed=1)
    inputs = StepInputs.seeded(
        [RequestSpec(prompt_len=13), RequestSpec(prompt_len=20, cached_len=9),
         RequestSpec(prompt_len=11, decode=True)], args.vocab_size, seed=2, cache_indices=[1, 0, 2])
    return model, inputs


@pytest.mark.parametrize("preset,graph_mode", [("sparse-tiny", "full"), ("tiny", "eager")])
def test_visibility_off_by_one_fails_the_check(preset, graph_mode, monkeypatch):
    """Unfaulted every forward passes; with ``j < t // r`` on every path it fails, on the visible
    counts and (sparse) on the selections, at varlen and static shapes alike (the 25-token step
    fits the capture size 32, so the static forward runs in eager cases too)."""
    model, inputs = _case(preset)
    config = EngineConfig.for_model(model.args, graph_mode=graph_mode, capture_sizes=[32, 64])
    passed = check_visibility(model, inputs, config)
    assert passed.passed, passed.message
    visibility_off_by_one(monkeypatch)
    failed = check_visibility(model, inputs, config)
    assert not failed.passed
    names = {d.tensor.split(":")[0] for d in failed.diagnostics}
    assert "varlen and static forward" in failed.message
    for mode in ("varlen", "static"):
        assert f"{mode}.visible_keys.ratio1" in names
        if model.args.sparse:
            assert f"{mode}.layer{model.args.last_kv_source}.chosen_count" in names
            assert f"{mode}.visible_keys.ratio{model.args.compress_ratio}" in names
