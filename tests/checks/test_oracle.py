"""The oracle restates SPEC sections 2 and 4; these pin its rules by example, check that it
agrees with the engine's plan wherever the engine accepts the policy, and that it stays
independent of the code it grades."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from swa_bench.checks import oracle
from swa_bench.model.requests import RequestSpec as R

W, D = 8, 4  # tiny: H = 8 + 3 * 7 = 29


def lens(requests, policy, align=1):
    return [oracle.kept_len(r, policy, W, D, align) for r in requests]


MIXED = [
    R(24, decode=True),  # decode row
    R(7),  # q < W
    R(40),  # q = 40 > H
    R(40, cached_len=16, chunk_size=12),  # a middle chunk
    R(40, cached_len=36),  # the last chunk, q = 4
    R(20, prompt_logprobs=True),  # logprobs: every row
]


@pytest.mark.parametrize("policy, expected", [
    ("full", [1, 7, 40, 12, 4, 20]),
    ("bounded", [1, 7, 8, 8, 4, 20]),
    ("halo", [1, 7, 29, 12, 4, 20]),
    ("final_window", [1, 7, 8, 0, 4, 20]),
    ("tail", [1, 7, 13, 12, 4, 20]),
])
def test_kept_lengths_per_policy(policy, expected):
    assert lens(MIXED, policy) == expected


def test_halo_rounding_and_v41_flash():
    assert oracle.halo_rows(128, 19) == 2414
    assert oracle.halo_rows(128, 19, 512) == 2560
    assert oracle.halo_rows(8, 1) == 8  # D = 1: the halo is the window
    assert lens([R(40)], "halo", align=4) == [32]


def test_window_starts():
    cold, hit, chunk = R(40), R(30, cached_len=12), R(40, cached_len=5, chunk_size=12)
    assert [oracle.batch_start(r, W) for r in (cold, hit, chunk)] == [0, 4, 0]
    assert oracle.kept_start(cold, 8, W) == 32
    assert oracle.kept_start(hit, 8, W) == 22
    assert oracle.kept_start(R(30, cached_len=24), 6, W) == 16  # keeps all: the batch start
    assert oracle.kept_start(chunk, 0, W) == 17  # keeps none: seq_len
    assert oracle.kept_start(R(14, cached_len=4), 8, W) == 6  # cached_len < W


def expect(requests, **kw):
    base = dict(policy="bounded", graph_mode="eager", window=W, decoder_layers=D,
                max_logit_rows=16, capture_sizes=(8, 16, 32, 64, 128))
    return oracle.expect_step(requests, **{**base, **kw})


def test_routes():
    trimmed, short = [R(40), R(7)], [R(7), R(5)]
    e = expect(trimmed)
    assert e.replays and e.rows == tuple(range(32, 40)) + tuple(range(40, 47))
    assert e.graph_size is None and e.trims
    assert not expect(short).replays  # nothing to trim
    assert not expect(trimmed, eager_trim_threshold=48).replays
    assert expect(trimmed, eager_trim_threshold=47).replays
    assert not expect(trimmed, policy="full").replays
    # PIECEWISE: decided by the padded size against trim_threshold, even with nothing to trim
    pw = dict(graph_mode="piecewise", trim_threshold=64)
    assert expect(trimmed, **pw).graph_size == 64 and expect(trimmed, **pw).replays
    assert not expect(trimmed, graph_mode="piecewise", trim_threshold=65).replays
    assert expect([R(7)] * 8, **pw).replays and not expect([R(7)] * 8, **pw).trims
    # FULL never trims and attends with the static kernel
    full = expect(trimmed, graph_mode="full")
    assert not full.replays and full.shape_mode == "static" and full.graph_size == 64
    # above the largest capture size, or more logits rows than a graph returns: eager
    assert expect([R(129)], **pw).graph_size is None
    assert expect([R(40, prompt_logprobs=True)], **pw).graph_size is None


@pytest.mark.parametrize("policy", oracle.ORACLE_POLICIES)
def test_agrees_with_the_engine_plan(policy):
    """Where the engine accepts a policy, its plan and the oracle agree on every route."""
    from swa_bench.engine.config import EngineConfig
    from swa_bench.engine.dispatch import plan_step
    from swa_bench.model.args import PRESETS

    args = PRESETS["tiny"]
    batches = [MIXED[:5], [R(40), R(7)], [R(7), R(5)], [R(60)], [R(24, decode=True)] * 3,
               [R(30, cached_len=24), R(14, cached_len=4)]]
    for mode in ("eager", "piecewise", "full"):
        for threshold in (None, 64):
            config = EngineConfig.for_model(args, policy=policy, graph_mode=mode,
                                            trim_threshold=threshold,
                                            capture_sizes=(8, 16, 32, 64, 128))
            for batch in batches:
                plan = plan_step(batch, config, args)
                exp = oracle.expect_step(
                    batch, policy=policy, graph_mode=mode, window=args.window,
                    decoder_layers=args.n_decoder_layers, max_logit_rows=args.max_requests,
                    capture_sizes=config.capture_sizes, trim_threshold=config.trim_threshold)
                assert (plan.graph_size, plan.replays) == (exp.graph_size, exp.replays)
                if plan.replays:
                    assert plan.kept_lens == exp.kept_lens


def test_oracle_is_independent_of_the_replay_code():
    import swa_bench.checks.oracle as module

    tree = ast.parse(Path(module.__file__).read_text())
    names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any(n.startswith(("swa_bench.replay", "swa_bench.engine.dispatch"))
                   for n in names), names


def test_halo_exact_rows_shrink_by_w_minus_1_per_decoder_layer():
    from swa_bench.model.args import PRESETS

    args = PRESETS["sparse-tiny"]  # S = 5, W = 8
    assert oracle.halo_exact_rows(5, [10, 3], args) == list(range(13))
    assert oracle.halo_exact_rows(6, [10, 3], args) == list(range(13))
    assert oracle.halo_exact_rows(7, [10, 3], args) == [7, 8, 9]
    assert oracle.halo_exact_rows(9, [30], args) == list(range(21, 30))


def model_state(model) -> dict[str, int]:
    """Every attribute of every module of ``model`` by identity (parameters, buffers and
    submodules included): what swapping a route or a cache into the model would change."""
    state = {}
    for path, module in model.named_modules():
        for attr, value in vars(module).items():
            state[f"{path}.{attr}"] = id(value)
            if isinstance(value, dict):
                state.update({f"{path}.{attr}[{k}]": id(v) for k, v in value.items()})
    return state


def test_the_oracle_runs_its_route_without_touching_the_model(tiny_model, monkeypatch):
    """The oracle's kept rows run through a route in its own forward context: while its forward
    runs the replay layers the model is the model it was before (nothing swapped in), and its
    output equals the engine's step bitwise."""
    import torch

    from swa_bench.engine.engine import Engine
    from swa_bench.engine.step_inputs import StepInputs
    from swa_bench.model.model import Transformer

    args = tiny_model.args
    load = StepInputs.seeded([R(3 * args.window), R(12, decode=True)], args.vocab_size, seed=4)
    engine = Engine(tiny_model)
    load.fill_context(engine)
    expected = oracle.expect_for(engine, load.requests)
    assert expected.replays, expected.reason
    before, seen = model_state(tiny_model), []
    real = Transformer.run_replay_layers

    def spy(self, kv_s, *inputs):
        seen.append(model_state(self))
        return real(self, kv_s, *inputs)

    twin = Engine(tiny_model)
    twin.cache.copy_from(engine.cache)
    monkeypatch.setattr(Transformer, "run_replay_layers", spy)
    out = oracle.oracle_forward(engine, load.requests, load.step_tokens, None, expected)
    assert seen == [before] and model_state(tiny_model) == before
    monkeypatch.undo()
    step = twin.step(load.requests, load.step_tokens)
    assert torch.equal(out.logits, step.logits)
