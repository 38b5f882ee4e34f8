"""The window-index kernel against an independent oracle: each query row's window keys found by
a loop over its request's host layout (which key positions are readable, and whether each comes
from this forward's KV or from the ring), on CPU through Triton's interpreter and on CUDA
compiled; and the model's ``window_index`` through it on the Triton backend only."""

from __future__ import annotations

import pytest
import torch

from swa_bench.kernels import window_index_rows
from swa_bench.model.args import PRESETS
from swa_bench.model.key_sources import window_index
from tests.kernels.conftest import TRITON, attention_problem, on_kernels

ARGS = PRESETS["tiny"].replace(max_requests=4, max_seq_len=64)  # W = 8
# A cold prefill, a continuation reading the ring across the window boundary, a one-row decode,
# a request at position 0; then padded rows of the dummy request (they read nothing).
REQUESTS = [(0, 13), (11, 9), (30, 1), (0, 1)]


def oracle(meta, ring_rows, window):
    out = torch.full((meta.num_rows, window), -1, dtype=torch.long)
    for lay in meta.layouts:
        for i in range(lay.q_len):
            p = lay.q_first_pos + i
            for j in range(window):
                k = p - j
                if k < max(lay.window_start, 0):
                    continue
                if k >= lay.kv_first_pos:
                    out[lay.q_start + i, j] = ring_rows + lay.kv_start + k - lay.kv_first_pos
                else:
                    out[lay.q_start + i, j] = lay.cache_index * window + k % window
    return out


def kernel_index(meta, ring_rows, window):
    return window_index_rows(TRITON, meta.positions, meta.row_request, meta.kv_first_pos,
                             meta.kv_row_start, meta.cache_index, meta.window_start, ring_rows,
                             window)


@pytest.mark.parametrize("pad", [0, 5])
def test_window_index_is_each_rows_readable_keys(interpreter, pad):
    problem = attention_problem(ARGS, REQUESTS, pad=pad)
    ring_rows = problem.cache.ring[0].shape[0]
    got = kernel_index(problem.meta, ring_rows, ARGS.window)
    assert torch.equal(got, oracle(problem.meta, ring_rows, ARGS.window))
    assert torch.equal(got, window_index(problem.meta, ring_rows, ARGS.window))  # torch path


def test_the_model_takes_the_kernel_on_the_triton_backend(interpreter, monkeypatch):
    calls = []
    import swa_bench.model.key_sources as attention_module

    monkeypatch.setattr(attention_module, "window_index_rows",
                        lambda *a: calls.append(1) or window_index_rows(*a))
    problem = attention_problem(ARGS, REQUESTS, pad=3)
    window_index(problem.meta, 40, ARGS.window)
    assert not calls
    problem = attention_problem(ARGS, REQUESTS, pad=3)  # a fresh metadata: nothing derived yet
    with on_kernels(TRITON):
        got = window_index(problem.meta, 40, ARGS.window)
    assert calls and torch.equal(got, oracle(problem.meta, 40, ARGS.window))


@pytest.mark.cuda
def test_window_index_on_cuda():
    args = PRESETS["small"].replace(max_requests=8)  # W = 32
    requests = [(0, 300), (45, 70), (1000, 1), (31, 2), (0, 1), (64, 33)]
    problem = attention_problem(args, requests, pad=7, device="cuda")
    ring_rows = problem.cache.ring[0].shape[0]
    got = kernel_index(problem.meta, ring_rows, args.window).cpu()
    assert torch.equal(got, oracle(problem.meta, ring_rows, args.window))
