"""Properties of kept rows, window starts and the halo size over random batch compositions,
against direct definitions written out per row."""

from hypothesis import given, settings
from hypothesis import strategies as st

from swa_bench.model.batch import batch_window_start
from swa_bench.model.requests import RequestSpec, query_starts
from swa_bench.replay.row_selection import (
    POLICIES,
    halo_size,
    kept_lens,
    kept_rows,
    kept_window_start,
    trims,
)


@st.composite
def requests(draw):
    kind = draw(st.sampled_from(["cold", "decode", "cached", "chunked", "logprobs"]))
    length = draw(st.integers(1, 300))
    if kind == "decode":
        return RequestSpec(prompt_len=length, decode=True)
    if kind == "cold":
        return RequestSpec(prompt_len=length)
    if kind == "logprobs":
        return RequestSpec(prompt_len=length, prompt_logprobs=True)
    cached = draw(st.integers(0, length - 1))
    chunk = draw(st.integers(1, 300)) if kind == "chunked" else None
    return RequestSpec(prompt_len=length, cached_len=cached, chunk_size=chunk)


batches = st.lists(requests(), min_size=1, max_size=8)
windows = st.integers(1, 64)


@settings(max_examples=200, deadline=None)
@given(batches, windows, st.integers(1, 6), st.sampled_from(POLICIES))
def test_kept_rows_are_each_requests_last_rows(batch, window, depth, policy):
    halo = halo_size(window, depth)
    lens = kept_lens(batch, policy, window, halo)
    rows = kept_rows(batch, lens)
    starts = query_starts(batch)
    expected = []
    for i, r in enumerate(batch):
        q = r.query_len
        if policy == "full" or r.decode or r.prompt_logprobs:
            keep = q
        elif policy == "final_window":
            # TensorRT-LLM: positions of the chunk inside [prompt_len - W, prompt_len)
            keep = sum(1 for p in range(r.cached_len, r.cached_len + q)
                       if p >= r.prompt_len - window)
        elif policy == "tail":
            keep = min(q, window + 5)
        else:
            keep = min(q, window if policy == "bounded" else halo)
        expected += list(range(starts[i + 1] - keep, starts[i + 1]))
    assert rows == expected
    assert rows == sorted(set(rows)), "kept rows are distinct and in batch order"
    assert trims(batch, lens) == (len(rows) < starts[-1])
    for i, r in enumerate(batch):
        if policy != "final_window" or r.seq_len == r.prompt_len or r.decode:
            assert lens[i] >= min(r.query_len, window), "the last min(q, W) rows are always kept"


@settings(max_examples=200, deadline=None)
@given(batches, windows)
def test_window_starts(batch, window):
    halo = halo_size(window, 3)
    for policy in POLICIES:
        for r, k in zip(batch, kept_lens(batch, policy, window, halo), strict=True):
            start = batch_window_start(r.context_len, window)
            assert start == (0 if r.context_len == 0 else max(0, r.context_len - window))
            kept = kept_window_start(start, r.seq_len, k, r.query_len)
            assert kept >= start
            if k < r.query_len:
                assert kept == r.seq_len - k, "a trimmed request reads only its kept rows"
            else:
                assert kept == start, "a request that keeps every row keeps its batch start"
            # every kept row's window below the kept start was never computed: it is masked
            first_kept = r.seq_len - k
            assert kept <= first_kept


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 256), st.integers(1, 40), st.integers(1, 512))
def test_halo_rounds_the_cone_up_to_align(window, depth, align):
    h = halo_size(window, depth, align)
    assert h % align == 0
    assert 0 <= h - halo_size(window, depth) < align


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 24), st.integers(1, 12))
def test_halo_is_the_dependency_cone_of_the_last_window(window, depth):
    """Walk the cone down the decoder: the last layer's ring (its last W slots) and the last
    token need that layer's inputs at the last W positions; a row's input to layer d needs layer
    d - 1's inputs at its own window. What the first decoder layer needs is the halo."""
    length = 10 * window * depth
    needed = set(range(length - window, length))
    for _ in range(depth - 1):
        needed = {q for p in needed for q in range(max(p - window + 1, 0), p + 1)}
    assert needed == set(range(length - halo_size(window, depth), length))


def test_v41_flash_halo_matches_the_spec():
    assert halo_size(128, 19) == 2414
    assert halo_size(128, 19, align=512) == 2560


def test_policies_on_a_chunked_prefill_and_a_decode():
    w, halo = 8, 30
    early = RequestSpec(prompt_len=100, cached_len=20, chunk_size=40)  # rows 20..59, not last
    last = RequestSpec(prompt_len=100, cached_len=60, chunk_size=40)  # rows 60..99, ends it
    decode = RequestSpec(prompt_len=50, decode=True)
    logprobs = RequestSpec(prompt_len=40, prompt_logprobs=True)
    batch = [early, last, decode, logprobs]
    assert kept_lens(batch, "bounded", w, halo) == [8, 8, 1, 40]
    assert kept_lens(batch, "halo", w, halo) == [30, 30, 1, 40]
    assert kept_lens(batch, "final_window", w, halo) == [0, 8, 1, 40]
    assert kept_lens(batch, "tail", w, halo) == [13, 13, 1, 40]
    assert kept_lens(batch, "full", w, halo) == [40, 40, 1, 40]


def test_a_request_keeping_no_row_sees_nothing_of_its_step():
    assert kept_window_start(12, seq_len=60, kept=0, query_len=40) == 60
