"""final_window as TensorRT-LLM's plan_decoder_replay computes it (issue 30): a chunk keeps its
intersection with the final prompt window [end - W, end); the floor is end - W for every chunk."""

import pytest

from swa_bench.checks import oracle
from swa_bench.engine.config import EngineConfig
from swa_bench.engine.dispatch import plan_step
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


@pytest.mark.parametrize("prompt,size,window", [
    (300, 240, 128), (300, 100, 128), (513, 64, 128), (90, 40, 128), (7, 1, 3), (40, 12, 8)])
def test_the_floor_is_end_minus_w_for_every_chunk_reaching_the_final_window(prompt, size, window):
    """TensorRT-LLM's floors: end - W for each chunk with a position in [end - W, end), whether
    it keeps all its rows or not; none for chunks before the window (they keep no row)."""
    chunks = _chunks(prompt, size)
    want = [max(0, prompt - window) if r.seq_len > prompt - window else 0 for r in chunks]
    assert rs.decoder_floors(chunks, "final_window", window) == want
    assert [oracle.decoder_floor(r, "final_window", window) for r in chunks] == want
    for policy in ("bounded", "halo", "tail", "full"):
        assert rs.decoder_floors(chunks, policy, window) == [0] * len(chunks)
    others = [RequestSpec(prompt_len=prompt, decode=True),
              RequestSpec(prompt_len=prompt, prompt_logprobs=True)]
    assert rs.decoder_floors(others, "final_window", window) == [0, 0]
    assert [oracle.decoder_floor(r, "final_window", window) for r in others] == [0, 0]


def test_a_chunk_keeping_every_row_reads_from_the_floor_on_the_replay_batch(tiny_args):
    """The 4 rows ending a 20-token prompt after 16 (W = 8) lose none, but the chunk before kept
    only 4 decoder rows (12..15): the whole batch would read decoder slots 8..11 from its batch
    start. The plan takes the replay batch (ahead of eager_trim_threshold); graphs that cannot
    replay apply no floor, nor do policies without one."""
    w = tiny_args.window
    last = RequestSpec(prompt_len=2 * w + 4, cached_len=2 * w, chunk_size=2 * w)
    floor = w + 4
    for eager_threshold in (0, 1000):
        config = EngineConfig.for_model(tiny_args, policy="final_window",
                                        eager_trim_threshold=eager_threshold)
        plan = plan_step([last], config, tiny_args)
        assert (plan.replays, plan.kept_lens, plan.decoder_floors) == (True, (4,), (floor,))
        exp = oracle.expect_step(
            [last], policy="final_window", graph_mode="eager", window=w,
            decoder_layers=tiny_args.n_decoder_layers, max_logit_rows=tiny_args.max_requests,
            eager_trim_threshold=eager_threshold)
        assert exp.replays and exp.kept_starts == (floor,) and exp.batch_starts == (w,)
    graph = EngineConfig.for_model(tiny_args, policy="final_window", graph_mode="piecewise",
                                   capture_sizes=(8, 16, 32), trim_threshold=16)
    plan = plan_step([last], graph, tiny_args)
    assert (plan.graph_size, plan.replays, plan.decoder_floors) == (8, False, (0,))
    bounded = EngineConfig.for_model(tiny_args, policy="bounded")
    plan = plan_step([last], bounded, tiny_args)
    assert (plan.replays, plan.decoder_floors) == (False, (0,))
