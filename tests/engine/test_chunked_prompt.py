"""A chunked prompt's steps: where each chunk starts and ends, what the caches already hold, the
decode rows beside it, and the first decode, against arithmetic on the prompt's length."""

import pytest

from swa_bench.engine.chunked_prompt import ChunkedPrompt


@pytest.mark.parametrize(("length", "chunk", "starts"), [
    (100, 48, [0, 48, 96]),
    (96, 48, [0, 48]),
    (5, 8, [0]),
    (3, 1, [0, 1, 2]),
])
def test_chunks_tile_the_prompt_once_in_order(length, chunk, starts):
    prompt = ChunkedPrompt.build(length, chunk, vocab=64, seed=0)
    steps = prompt.steps()
    assert prompt.num_chunks == len(starts) == len(steps)
    for step, start in zip(steps, starts, strict=True):
        (r,) = step.requests
        assert (r.prompt_len, r.cached_len, r.context_len) == (length, start, start)
        assert r.query_len == min(chunk, length - start)
    # every position exactly once, in order: the steps' tokens are the prompt
    assert [t for s in steps for t in s.step_tokens[0]] == list(prompt.tokens)
    assert len(prompt.tokens) == length


def test_decode_rows_beside_advance_one_token_a_step_then_the_first_decode():
    prompt = ChunkedPrompt.build(100, 48, vocab=64, seed=1, decodes_beside=2, decode_context=30,
                                 cache_indices=[5, 2, 9])
    for i, step in enumerate(prompt.steps()):
        assert [r.decode for r in step.requests] == [False, True, True]
        assert [r.prompt_len for r in step.requests[1:]] == [30 + i, 30 + i]
        assert step.indices == [5, 2, 9]
        assert step.num_tokens == min(48, 100 - 48 * i) + 2
        # teacher-forced: decode row j reads its own sequence's token at its position
        assert step.step_tokens[1] == [prompt.sources.sequences[1][30 + i]]
    first = prompt.first_decode(token=17)
    assert [(r.prompt_len, r.decode) for r in first.requests] == [(100, True), (33, True),
                                                                  (33, True)]
    assert first.step_tokens[0] == [17]
    assert first.step_tokens[1] == [prompt.sources.sequences[1][33]]


def test_a_chunk_past_the_prompt_is_refused():
    prompt = ChunkedPrompt.build(10, 4, vocab=64, seed=0)
    with pytest.raises(IndexError):
        prompt.step(3)
    with pytest.raises(ValueError):
        ChunkedPrompt.build(10, 0, vocab=64, seed=0)
