"""Attention metadata: the vectorised builder against a loop over requests written from the
layout's definition, on random packings (gaps, empty requests, padding, writes off)."""

import random

import pytest
import torch

from swa_bench.model.args import PRESETS
from swa_bench.model.batch import NO_WINDOW, RequestLayout, make_metadata

ARGS = PRESETS["tiny"]


def naive(layouts, num_q_rows, num_kv_rows, slots, writes):
    w, m = ARGS.window, ARGS.max_seq_len
    out = {
        "positions": [0] * num_q_rows,
        "row_request": [slots - 1] * num_q_rows,
        "ring_slot": [ARGS.max_requests * w] * num_kv_rows,
        "global_slot": [ARGS.max_requests * m] * num_kv_rows,
        "window_start": [0] * (slots - 1) + [NO_WINDOW],
        "kv_first_pos": [0] * slots,
        "kv_row_start": [0] * slots,
        "seq_len": [0] * slots,
        "cache_index": [0] * slots,
    }
    for i, lay in enumerate(layouts):
        for j in range(lay.q_len):
            out["positions"][lay.q_start + j] = lay.q_first_pos + j
            out["row_request"][lay.q_start + j] = i
        for j in range(lay.kv_len if writes else 0):
            pos = lay.kv_first_pos + j
            out["global_slot"][lay.kv_start + j] = lay.cache_index * m + pos
            if pos >= lay.seq_len - w:
                out["ring_slot"][lay.kv_start + j] = lay.cache_index * w + pos % w
        for name, value in (
            ("window_start", lay.window_start),
            ("kv_first_pos", lay.kv_first_pos),
            ("kv_row_start", lay.kv_start),
            ("seq_len", lay.seq_len),
            ("cache_index", lay.cache_index),
        ):
            out[name][i] = value
    return out


def random_layouts(rng: random.Random):
    layouts, q_row, kv_row = [], 0, 0
    for ci in rng.sample(range(ARGS.max_requests), rng.randint(0, 5)):
        q_len, context = rng.choice([0, 1, 3, 20]), rng.randint(0, 40)
        kv_len = q_len + rng.choice([0, 0, 5])
        q_row += rng.choice([0, 0, 2])  # a gap: rows no request owns
        layouts.append(
            RequestLayout(
                cache_index=ci,
                q_start=q_row,
                q_len=q_len,
                q_first_pos=context + kv_len - q_len,
                kv_start=kv_row,
                kv_len=kv_len,
                kv_first_pos=context,
                window_start=max(0, context - 8),
                seq_len=context + kv_len,
            )
        )
        q_row, kv_row = q_row + q_len, kv_row + kv_len
    return layouts, q_row, kv_row


@pytest.mark.parametrize("seed", range(12))
def test_metadata_matches_a_loop_over_requests(seed):
    rng = random.Random(seed)
    layouts, q_rows, kv_rows = random_layouts(rng)
    pad = rng.choice([0, 3])
    slots = rng.choice([None, ARGS.max_requests + 1])
    writes = seed % 4 != 3
    meta = make_metadata(
        layouts,
        num_q_rows=q_rows + pad,
        num_kv_rows=kv_rows + pad,
        args=ARGS,
        device=torch.device("cpu"),
        num_request_slots=slots,
        writes=writes,
    )
    expected = naive(layouts, q_rows + pad, kv_rows + pad, slots or len(layouts) + 1, writes)
    got = {name: t.tolist() for name, t in meta.tensors().items()}
    assert got == expected
    assert meta.layouts == tuple(layouts)


def test_copy_into_a_static_metadata_of_the_same_shape_copies_every_tensor():
    rng = random.Random(7)
    layouts, q_rows, kv_rows = random_layouts(rng)
    rows = max(q_rows, kv_rows) + 4
    build = lambda lays, writes: make_metadata(  # noqa: E731
        lays,
        num_q_rows=rows,
        num_kv_rows=rows,
        args=ARGS,
        device=torch.device("cpu"),
        num_request_slots=ARGS.max_requests + 1,
        writes=writes,
    )
    static = build([], False)
    step = build(layouts, True)
    loaded = step.copy_into(static)
    for name, t in step.tensors().items():
        assert torch.equal(getattr(loaded, name), t), name
        assert getattr(loaded, name).data_ptr() == getattr(static, name).data_ptr(), name


def test_derived_tensors_are_kept_per_step_and_never_for_static_metadata():
    """A step's layers share one window index; a graph's static metadata (``derived`` None, its
    buffers overwritten by every step) recomputes it, and each step loaded into it starts
    empty: a value derived from one step's buffers is never read by another step."""
    rng = random.Random(3)
    layouts, q_rows, kv_rows = random_layouts(rng)
    rows = max(q_rows, kv_rows) + 2
    build = lambda lays: make_metadata(  # noqa: E731
        lays, num_q_rows=rows, num_kv_rows=rows, args=ARGS, device=torch.device("cpu"),
        num_request_slots=ARGS.max_requests + 1)
    computed = []

    def compute(meta):
        computed.append(1)
        return meta.positions.clone()

    step = build(layouts)
    first = step.derived_tensor(("k",), lambda: compute(step))
    assert step.derived_tensor(("k",), lambda: compute(step)) is first and len(computed) == 1
    static = build([])
    static.derived = None
    static.derived_tensor(("k",), lambda: compute(static))
    static.derived_tensor(("k",), lambda: compute(static))
    assert len(computed) == 3
    loaded = step.copy_into(static)
    assert loaded.derived == {}
    assert torch.equal(loaded.derived_tensor(("k",), lambda: compute(loaded)), step.positions)
