"""final_window as TensorRT-LLM's plan_decoder_replay computes it (issue 30): a chunk keeps its
intersection with the final prompt window [end - W, end); the floor is end - W for every chunk."""

import pytest

from swa_bench.checks import oracle
from swa_bench.model.requests import RequestSpec
from swa_bench.replay import row_selection as rs


def _chunks(prompt: int, size: int) -> list[RequestSpec]:
    return [RequestSpec(prompt_len=prompt, cached_len=c, chunk_size=size)
            for c in range(0, prompt, size)]


def test_300_token_prompt_in_chunks_of_240_and_60():
    chunks = _chunks(300, 240)
    assert [r.query_len for r in chunks] == [240, 60]
    assert rs.kept_lens(chunks, "final_window", 128, halo=0) == [68, 60]
    assert [rs.final_window_floor(r, 128) for r in chunks] == [172, 172]
    # the first chunk's kept rows start exactly at the floor
    assert chunks[0].seq_len - 68 == 172


@pytest.mark.parametrize("prompt,size,window", [
    (300, 240, 128), (300, 100, 128), (513, 64, 128), (90, 40, 128), (1000, 128, 128), (7, 1, 3)])
def test_kept_rows_are_the_overlap_with_the_final_window(prompt, size, window):
    """Against a direct restatement: count the chunk's positions p with end - W <= p < end."""
    chunks = _chunks(prompt, size)
    got = rs.kept_lens(chunks, "final_window", window, halo=0)
    want = [sum(1 for p in range(r.cached_len, r.seq_len) if p >= prompt - window) for r in chunks]
    assert got == want
    assert [oracle.kept_len(r, "final_window", window, 3) for r in chunks] == want
    assert sum(got) == min(prompt, window)  # the whole final window is kept, once
    floors = [rs.final_window_floor(r, window) for r in chunks]
    assert floors == [oracle.final_window_floor(r, window) for r in chunks]


def test_old_rule_loses_rows_of_the_final_window():
    """The old rule (only the chunk ending the prompt keeps min(q, W)) kept 0 + 60 of the 128."""
    old = [min(r.query_len, 128) if r.seq_len >= r.prompt_len else 0 for r in _chunks(300, 240)]
    assert old == [0, 60] and sum(old) < 128
