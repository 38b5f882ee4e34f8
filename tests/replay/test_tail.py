"""``tail`` as ROCm ATOM computes it (``atom/models/deepseek_v41/bounded_replay.py``): each
chunk keeps its last min(q, W + 5) rows (the ring of W plus V4.1-Flash's five DSpark tokens), and
only eager, unpadded prefills replay: a graph step takes the whole batch."""

import pytest

from swa_bench.checks import oracle
from swa_bench.engine.config import EngineConfig
from swa_bench.engine.dispatch import plan_step
from swa_bench.model.requests import RequestSpec
from swa_bench.replay import row_selection as rs


@pytest.mark.parametrize("prompt,size,window", [(300, 240, 128), (300, 100, 128), (40, 12, 8)])
def test_every_chunk_keeps_its_last_w_plus_5_rows(prompt, size, window):
    chunks = [RequestSpec(prompt, cached_len=c, chunk_size=size) for c in range(0, prompt, size)]
    want = [min(r.query_len, window + 5) for r in chunks]
    assert rs.kept_lens(chunks, "tail", window, halo=0) == want
    assert [oracle.kept_len(r, "tail", window, 3) for r in chunks] == want
    assert rs.decoder_floors(chunks, "tail", window) == [0] * len(chunks)


def test_only_eager_steps_replay_under_tail(tiny_args):
    """A 50-token prefill (W = 8) loses rows under tail and bounded; in a PIECEWISE graph at
    or above trim_threshold bounded replays but tail does not (ATOM runs its replay eagerly,
    and only on unpadded steps); eager, tail replays its last 13 rows."""
    step = [RequestSpec(prompt_len=50)]
    sizes = dict(capture_sizes=(16, 32, 64), trim_threshold=16)
    for policy, mode, replays in [("tail", "eager", True), ("tail", "piecewise", False),
                                  ("tail", "full", False), ("bounded", "piecewise", True)]:
        config = EngineConfig.for_model(tiny_args, policy=policy, graph_mode=mode, **sizes)
        plan = plan_step(step, config, tiny_args)
        exp = oracle.expect_step(step, policy=policy, graph_mode=mode, window=tiny_args.window,
                                 decoder_layers=tiny_args.n_decoder_layers,
                                 max_logit_rows=tiny_args.max_requests, **sizes)
        assert (plan.replays, exp.replays) == (replays, replays), (policy, mode, plan.reason)
        if policy == "tail" and replays:
            assert plan.kept_lens == (tiny_args.window + 5,)
