"""The step plan against SPEC sections 2 and 4 written out case by case: graph or eager, whole
batch or replay batch, which rows, over policy x graph mode x thresholds x step sizes."""

import itertools

import pytest

from swa_bench.engine.config import EngineConfig
from swa_bench.engine.dispatch import plan_step
from swa_bench.model.requests import RequestSpec

CAPTURE_SIZES = (8, 16, 32, 64)


def expected(requests, policy, mode, trim_threshold, eager_trim_threshold, args):
    """(graph size, replays, kept lens), from the SPEC's words rather than the engine's code."""
    w, d = args.window, args.n_decoder_layers
    halo = w + (d - 1) * (w - 1)
    tokens = sum(r.query_len for r in requests)
    size = None
    logits_rows = sum(r.query_len if r.prompt_logprobs else 1 for r in requests)
    if mode != "eager" and logits_rows <= args.max_requests:  # a graph returns that many rows
        size = next((s for s in CAPTURE_SIZES if s >= tokens), None)
    keep = []
    for r in requests:
        q = r.query_len
        if policy == "full" or r.decode or r.prompt_logprobs:
            keep.append(q)
        else:
            keep.append(min(q, w if policy == "bounded" else halo))
    if policy == "full":
        replays = False
    elif size is not None:
        replays = mode == "piecewise" and size >= trim_threshold
    else:
        replays = tokens >= eager_trim_threshold and sum(keep) < tokens
    return size, replays, tuple(keep) if replays else tuple(r.query_len for r in requests)


STEPS = {
    "decode only": [RequestSpec(prompt_len=9, decode=True), RequestSpec(prompt_len=3, decode=True)],
    "short prefills": [RequestSpec(prompt_len=8), RequestSpec(prompt_len=7)],
    "one long prefill": [RequestSpec(prompt_len=20), RequestSpec(prompt_len=9, decode=True)],
    "pads to the threshold": [RequestSpec(prompt_len=31), RequestSpec(prompt_len=5, decode=True)],
    "halo trims": [RequestSpec(prompt_len=50)],
    "prompt logprobs": [RequestSpec(prompt_len=20, prompt_logprobs=True)],
    "chunked with context": [RequestSpec(prompt_len=60, cached_len=10, chunk_size=24)],
    "above the largest graph": [RequestSpec(prompt_len=90), RequestSpec(prompt_len=3)],
}


@pytest.mark.parametrize("name", list(STEPS))
def test_plan_follows_the_spec(tiny_args, name):
    requests = STEPS[name]
    grid = itertools.product(
        ["bounded", "halo", "full"], ["eager", "piecewise", "full"], [9, 32, 64], [0, 40]
    )
    for policy, mode, threshold, eager_threshold in grid:
        config = EngineConfig.for_model(
            tiny_args, policy=policy, graph_mode=mode, trim_threshold=threshold,
            eager_trim_threshold=eager_threshold, capture_sizes=CAPTURE_SIZES,
        )
        plan = plan_step(requests, config, tiny_args)
        want = expected(requests, policy, mode, threshold, eager_threshold, tiny_args)
        got = (plan.graph_size, plan.replays, plan.kept_lens)
        assert got == want, f"{name}: {policy}/{mode}/t={threshold}/e={eager_threshold}: {plan}"
        assert plan.shape_mode == ("static" if mode == "full" and want[0] else "varlen"), plan
        assert plan.reason


def test_capture_plans_by_padded_size_alone(tiny_args):
    """A graph's route is fixed at capture by its size: the dummy batch of a size at or above
    trim_threshold replays (with nothing to keep), one below does not."""
    config = EngineConfig.for_model(tiny_args, graph_mode="piecewise", trim_threshold=32,
                                    capture_sizes=CAPTURE_SIZES)
    assert plan_step([], config, tiny_args, capture_size=32).replays
    assert not plan_step([], config, tiny_args, capture_size=16).replays
    full = EngineConfig.for_model(tiny_args, graph_mode="full", capture_sizes=CAPTURE_SIZES)
    assert not plan_step([], full, tiny_args, capture_size=64).replays


def test_piecewise_threshold_must_exceed_the_window(tiny_args):
    with pytest.raises(ValueError, match="trim_threshold: must exceed the model window"):
        EngineConfig.for_model(tiny_args, graph_mode="piecewise", trim_threshold=tiny_args.window)
