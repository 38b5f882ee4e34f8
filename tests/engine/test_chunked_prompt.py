"""A chunked prompt's steps: where each chunk starts and ends, what the caches already hold, the
decode rows beside it, and the first decode, against arithmetic on the prompt's length; and
prompts side by side in chunks (``prefill_in_chunks``) under the same rule."""

import pytest

from swa_bench.engine.chunked_prompt import (
    ChunkedPrompt,
    chunk_request,
    num_chunks,
    prefill_in_chunks,
)
from swa_bench.model.requests import RequestSpec


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


class _Recorder:
    """An engine stand-in that records each step it is given (the scheduling is what is under
    test here; the numerics of chunked steps are tests/checks/test_tasks.py's)."""

    def __init__(self):
        self.steps = []

    def step(self, requests, tokens, cache_indices=None):
        self.steps.append((list(requests), [list(t) for t in tokens], cache_indices))
        return len(self.steps)


@pytest.mark.parametrize(("length", "chunk", "starts"), [
    (100, 48, [0, 48, 96]), (96, 48, [0, 48]), (5, 8, [0]), (7, None, [0]), (3, 1, [0, 1, 2]),
])
def test_prompts_side_by_side_run_chunk_i_of_each_in_step_i(length, chunk, starts):
    prompts = [[(7 * j + p) % 251 for p in range(length)] for j in range(3)]
    engine = _Recorder()
    last = prefill_in_chunks(engine, prompts, chunk, cache_indices=[4, 0, 9])
    assert last == len(starts) == len(engine.steps), "the last step's output comes back"
    for (requests, tokens, indices), start in zip(engine.steps, starts, strict=True):
        assert indices == [4, 0, 9]
        end = length if chunk is None else min(start + chunk, length)
        assert [(r.prompt_len, r.cached_len, r.seq_len, r.decode) for r in requests] == [
            (length, start, end, False)] * 3
        assert tokens == [p[start:end] for p in prompts]
    # every prompt's positions once, in order
    for j, prompt in enumerate(prompts):
        assert [t for _, tokens, _ in engine.steps for t in tokens[j]] == prompt
    if chunk is None:  # one cold step: the very request an unchunked prefill runs
        assert engine.steps[0][0] == [RequestSpec(length)] * 3


def test_the_chunk_rule_is_the_one_chunked_prompts_use():
    prompt = ChunkedPrompt.build(100, 48, vocab=64, seed=0, decodes_beside=1)
    assert [s.requests[0] for s in prompt.steps()] == [chunk_request(100, 48, i)
                                                       for i in range(3)]
    assert num_chunks(100, 48) == prompt.num_chunks == 3 and num_chunks(100, None) == 1
    with pytest.raises(IndexError):
        chunk_request(100, None, 1)


def test_prompts_of_different_lengths_are_refused_side_by_side():
    with pytest.raises(ValueError, match="share a length"):
        prefill_in_chunks(_Recorder(), [[1, 2, 3], [1, 2]], 2)
    with pytest.raises(ValueError, match="share a length"):
        prefill_in_chunks(_Recorder(), [], 2)
