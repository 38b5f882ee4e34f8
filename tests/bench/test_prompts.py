"""Timing a whole chunked prompt: TTFT is the sum of the recorded steps plus the first decode,
sample by sample; the timed runs carry their caches from chunk to chunk (the last chunk's answer
is a one-shot prefill's); kept rows per step are the policy's."""

import pytest
import torch

from swa_bench.bench.measure import TimingSettings
from swa_bench.bench.prompts import prompt_result, run_prompt, time_prompt
from swa_bench.engine.chunked_prompt import ChunkedPrompt
from swa_bench.engine.config import EngineConfig
from swa_bench.engine.engine import Engine
from swa_bench.model.requests import RequestSpec

SETTINGS = TimingSettings(warmup=0, iters=2, l2_flush=False, threads=1, breakdown=False)



pytestmark = pytest.mark.usefixtures("one_thread")

@pytest.fixture(scope="module")
def timed(tiny_model):
    args = tiny_model.args
    prompt = ChunkedPrompt.build(60, 24, vocab=args.vocab_size, seed=3, decodes_beside=1,
                                 decode_context=20)
    reference = Engine(tiny_model, EngineConfig.for_model(args, policy="full"))
    replay = Engine(tiny_model, EngineConfig.for_model(args, policy="bounded"))
    timing = time_prompt(reference, replay, prompt, SETTINGS)
    return prompt, timing, prompt_result(prompt, timing)


def test_ttft_is_the_recorded_steps_plus_the_first_decode(timed):
    prompt, _, result = timed
    assert [s.cached_len for s in result.steps] == [0, 24, 48]
    assert [s.query_len for s in result.steps] == [24, 24, 12]
    for path in ("reference", "replay"):
        ttft = getattr(result.ttft, path).samples_ms
        first = getattr(result.first_decode, path).samples_ms
        assert len(ttft) == len(first) == SETTINGS.iters
        for r in range(SETTINGS.iters):
            steps = [getattr(s, path).samples_ms[r] for s in result.steps]
            assert all(ms > 0 for ms in steps)
            assert ttft[r] == pytest.approx(sum(steps) + first[r], rel=1e-12)
        median = getattr(result.ttft, path).median_ms
        assert result.tokens_per_s[path] == pytest.approx(prompt.length / (median / 1e3))
    assert result.speedup == pytest.approx(result.ttft.reference.median_ms
                                           / result.ttft.replay.median_ms)


def test_each_paths_peak_memory_is_over_its_chunks_and_first_decode(timed, tiny_model):
    """Recorded for both paths: over the chunks and the first decode, not the decode rows'
    context prefill before them (as large as the whole prompt's reference: the two paths'
    figures were equal when it was counted), at least a single chunk step's own peak, and the
    bounded replay's below the reference's (its decoder layers run on W + 1 rows of 25); a
    warm-up run measures the same when there is one."""
    from swa_bench.bench.flops import measure_peak_memory

    prompt, timing, result = timed
    peaks = result.peak_memory_bytes
    assert set(peaks) == {"reference", "replay"} and peaks == timing.peak_memory_bytes
    args = tiny_model.args
    engine = Engine(tiny_model, EngineConfig.for_model(args, policy="full"))
    prompt.fill_context(engine)
    first = prompt.step(0)
    one_step = measure_peak_memory(
        lambda: engine.step(first.requests, first.step_tokens, first.cache_indices), "cpu")
    assert peaks["reference"] >= one_step > 0
    assert 0 < peaks["replay"] < peaks["reference"]
    reference = Engine(tiny_model, EngineConfig.for_model(args, policy="full"))
    replay = Engine(tiny_model, EngineConfig.for_model(args, policy="bounded"))
    warmed = time_prompt(reference, replay, prompt, TimingSettings(
        warmup=1, iters=1, l2_flush=False, threads=1, breakdown=False))
    assert warmed.peak_memory_bytes == timing.peak_memory_bytes  # the same allocations


def test_the_context_prefill_is_not_counted(tiny_model):
    """A long decode context beside a short prompt: the context's prefill is the largest
    allocation of a repetition, and the peaks still tell the two paths apart."""
    args = tiny_model.args
    prompt = ChunkedPrompt.build(60, 24, vocab=args.vocab_size, seed=3, decodes_beside=1,
                                 decode_context=120)
    reference = Engine(tiny_model, EngineConfig.for_model(args, policy="full"))
    replay = Engine(tiny_model, EngineConfig.for_model(args, policy="bounded"))
    peaks = time_prompt(reference, replay, prompt, SETTINGS).peak_memory_bytes
    assert 0 < peaks["replay"] < peaks["reference"]


def test_kept_rows_per_step_are_the_policys(timed, tiny_args):
    _, _, result = timed
    w = tiny_args.window
    # bounded keeps each chunk's last W rows; the decode row beside it is always kept
    assert [s.kept_rows for s in result.steps] == [w + 1, w + 1, w + 1]
    assert [s.tokens for s in result.steps] == [25, 25, 13]


def test_timed_chunks_carry_their_caches(tiny_model):
    """The full path through 3 chunks ends where one prefill of the prompt does (within fp32
    rounding): each chunk read what the one before it wrote."""
    args = tiny_model.args
    prompt = ChunkedPrompt.build(60, 24, vocab=args.vocab_size, seed=3)
    engine = Engine(tiny_model, EngineConfig.for_model(args, policy="full"))
    outs = run_prompt(engine, prompt)
    whole = Engine(tiny_model, EngineConfig.for_model(args, policy="full"))
    ref = whole.reference_step([RequestSpec(prompt_len=60)], [list(prompt.tokens)], [0])
    torch.testing.assert_close(outs[-2].logits[-1], ref.logits[-1], rtol=1e-4, atol=1e-4)
    wrong = Engine(tiny_model, EngineConfig.for_model(args, policy="full"))  # no earlier chunks
    last = prompt.step(2)
    alone = wrong.step(last.requests, last.step_tokens, last.cache_indices)
    assert not torch.allclose(alone.logits[-1], ref.logits[-1], rtol=1e-4, atol=1e-4)
