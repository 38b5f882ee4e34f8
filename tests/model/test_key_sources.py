"""What each query row attends to, against oracles written from the rule's text: visibility by
brute force, and attention at both shape modes against a float64 per-row softmax over keys found
by a loop over the request's host layout (a compressed key per group, read where the cache holds
request slot ``c``'s group ``j``: row ``c * ceil(max_seq_len / r) + j``)."""

from __future__ import annotations

import pytest
import torch

from swa_bench.model.args import PRESETS
from swa_bench.model.attention import attend
from swa_bench.model.key_sources import GlobalKV, visible_counts, visible_global_keys
from tests.kernels.conftest import attention_problem

ARGS = PRESETS["tiny"].replace(max_requests=4, max_seq_len=64)  # W = 8
# A cold prefill, a continuation reading the ring, a one-row decode, a request at position 0.
REQUESTS = [(0, 13), (11, 9), (30, 1), (0, 1)]


def visible(j: int, t: int, seq_len: int, ratio: int) -> bool:
    """Key ``j`` at query position ``t``: its whole group is at or before ``t``, and it lies in
    the sequence."""
    return j * ratio + ratio - 1 <= t and j * ratio < seq_len


@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_visible_counts_follow_the_rule_on_host_integers_and_tensors(ratio):
    cases = [(t, s) for t in range(20) for s in (0, t + 1, t + 5)]
    want = [sum(visible(j, t, s, ratio) for j in range(40)) for t, s in cases]
    assert [visible_counts(t, s, ratio) for t, s in cases] == want
    t, s = (torch.tensor(c) for c in zip(*cases, strict=True))
    assert visible_counts(t, s, ratio).tolist() == want


def test_padded_rows_see_no_global_key():
    problem = attention_problem(ARGS, REQUESTS, pad=3)
    counts = visible_global_keys(problem.meta, 1)
    assert counts[-3:].tolist() == [0, 0, 0] and int(counts[:-3].min()) > 0


def compressed_oracle(problem, source: int, lay, ratio: int) -> torch.Tensor:
    groups = -(-ARGS.max_seq_len // ratio)
    start = lay.cache_index * groups
    rows = problem.cache.compressed[source][start : start + lay.seq_len // ratio].double()
    return rows if rows.shape[0] else rows.new_zeros(1, rows.shape[1])


def oracle(problem, global_kv: GlobalKV, selection) -> torch.Tensor:
    """Each row's softmax (with the sink) over the keys the SPEC says it reads, in float64."""
    w = ARGS.window
    out = torch.zeros_like(problem.q, dtype=torch.float64)
    for lay in problem.meta.layouts:
        glob = None
        if global_kv.source is not None:
            glob = compressed_oracle(problem, global_kv.source, lay, global_kv.ratio)
        for i in range(lay.q_len):
            t, row = lay.q_first_pos + i, lay.q_start + i
            keys = []
            for k in range(max(t - w + 1, lay.window_start, 0), t + 1):
                if k >= lay.kv_first_pos:
                    keys.append(problem.kv[lay.kv_start + k - lay.kv_first_pos].double())
                else:
                    keys.append(problem.cache.ring[0][lay.cache_index * w + k % w].double())
            if glob is not None:
                chosen = (range(glob.shape[0]) if selection is None
                          else [int(j) for j in selection[row] if j >= 0])
                keys += [glob[j] for j in chosen
                         if visible(j, t, lay.seq_len, global_kv.ratio)]
            k = torch.stack(keys)
            q = problem.q[row].double()
            logits = torch.cat([q @ k.t() * ARGS.head_dim ** -0.5,
                                problem.sink.double()[:, None]], dim=1)
            out[row] = torch.softmax(logits, dim=1)[:, :-1] @ k
    return out


def attend_at(problem, global_kv, selection, shape_mode):
    ring = problem.cache.ring[0].clone()
    try:
        return attend(problem.q, problem.kv, problem.meta, problem.cache, 0, global_kv,
                      problem.sink, selection, shape_mode)
    finally:
        problem.cache.ring[0].copy_(ring)


def selections(meta, ratio: int, top_k: int):
    """None (dense), and each row's random visible positions, -1 padded."""
    gen = torch.Generator().manual_seed(ratio)
    chosen = torch.full((meta.num_rows, top_k), -1, dtype=torch.long)
    for lay in meta.layouts:
        for r in range(lay.q_len):
            picked = torch.randperm((lay.q_first_pos + r + 1) // ratio, generator=gen)[:top_k]
            chosen[lay.q_start + r, : picked.numel()] = picked
    return [None, chosen]


@pytest.mark.parametrize("global_kv", [GlobalKV(None), GlobalKV(ARGS.last_kv_source),
                                       GlobalKV(ARGS.kv_sources[0], ARGS.compress_ratio)],
                         ids=["window", "full", "compressed"])
def test_both_shape_modes_compute_each_rows_attention(global_kv):
    """Varlen and static shapes gather the same keys: each equals the oracle, the sparse
    selection bit for bit alike; padded rows come out zero at either."""
    problem = attention_problem(ARGS, REQUESTS, pad=3)
    real = problem.meta.layouts[-1].q_start + problem.meta.layouts[-1].q_len
    choices = [None] if global_kv.source is None else selections(problem.meta, global_kv.ratio, 5)
    for selection in choices:
        varlen = attend_at(problem, global_kv, selection, "varlen")
        static = attend_at(problem, global_kv, selection, "static")
        want = oracle(problem, global_kv, selection).float()
        for got in (varlen, static):
            torch.testing.assert_close(got[:real], want[:real], rtol=1e-5, atol=1e-5)
            assert not got[real:].any()
        if selection is not None:
            assert torch.equal(varlen, static)


def test_attention_writes_the_ring_after_reading_it():
    problem = attention_problem(ARGS, REQUESTS)
    ring = problem.cache.ring[0].clone()
    attend(problem.q, problem.kv, problem.meta, problem.cache, 0, GlobalKV(None), problem.sink,
           None, "varlen")
    expected = ring.index_copy(0, problem.meta.ring_slot, problem.kv)
    assert torch.equal(problem.cache.ring[0][:-1], expected[:-1])  # the last row is trash
