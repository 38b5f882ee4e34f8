"""Engines sharing one model cannot cross: each forward runs on the cache its engine's context
binds, so interleaved steps of two engines (one eager, one replaying captured PIECEWISE graphs),
both on cache slot 0, compute what each computes alone on a model of its own, bit for bit."""

import pytest
import torch

from swa_bench.engine.config import EngineConfig
from swa_bench.engine.engine import Engine
from swa_bench.engine.step_inputs import StepInputs
from swa_bench.model.args import PRESETS
from swa_bench.model.cache import KVCache
from swa_bench.model.model import build_model
from swa_bench.model.requests import RequestSpec

EAGER = EngineConfig.for_model(PRESETS["tiny"], policy="bounded")
PIECEWISE = EngineConfig.for_model(PRESETS["tiny"], graph_mode="piecewise", policy="bounded",
                                   trim_threshold=16, capture_sizes=(8, 16, 32, 64))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def steps(prompt_len: int, vocab: int, seed: int) -> list[tuple[list[RequestSpec], list]]:
    """A prefill that trims, then two decode steps reading what it left in the caches."""
    (seq,) = StepInputs.seeded([RequestSpec(prompt_len + 2)], vocab, seed).sequences
    return [
        ([RequestSpec(prompt_len)], [list(seq[:prompt_len])]),
        ([RequestSpec(prompt_len, decode=True)], [[seq[prompt_len]]]),
        ([RequestSpec(prompt_len + 1, decode=True)], [[seq[prompt_len + 1]]]),
    ]


def outputs(engine: Engine, step) -> list[torch.Tensor]:
    out = engine.step(*step)
    return [bits(out.logits), *(bits(s) for s in out.streams)]  # copies: graph outputs are views


def alone(args, config: EngineConfig, schedule) -> tuple[list[list[torch.Tensor]], Engine]:
    """The schedule on an engine of a model of its own: no other engine ever ran on it."""
    engine = Engine(build_model(args, seed=0)[0], config)
    return [outputs(engine, step) for step in schedule], engine


def test_two_engines_on_one_model_do_not_cross(tiny_args):
    model, _ = build_model(tiny_args, seed=0)
    first, second = Engine(model, EAGER), Engine(model, PIECEWISE)
    schedules = [steps(3 * tiny_args.window, tiny_args.vocab_size, seed=1),
                 steps(40, tiny_args.vocab_size, seed=2)]
    assert second.plan(schedules[1][0][0]).replays, "the graph engine's prefill replays"
    got: list[list[list[torch.Tensor]]] = [[], []]
    for n in range(3):  # first, second, first, second, ...: each step after the other's
        for i, engine in enumerate((first, second)):
            got[i].append(outputs(engine, schedules[i][n]))
    for i, (engine, config) in enumerate(((first, EAGER), (second, PIECEWISE))):
        want, fresh = alone(tiny_args, config, schedules[i])
        for n, (a, b) in enumerate(zip(got[i], want, strict=True)):
            for j, (x, y) in enumerate(zip(a, b, strict=True)):
                assert torch.equal(x, y), f"engine {i} step {n} output {j}"
        theirs = fresh.cache.tensors()
        for name, t in engine.cache.tensors().items():
            assert torch.equal(bits(t), bits(theirs[name])), f"engine {i} cache {name}"


def test_the_model_holds_no_cache(tiny_model):
    Engine(tiny_model).step([RequestSpec(12)], [list(range(12))])
    held = [f"{path}.{attr}" for path, module in tiny_model.named_modules()
            for attr, value in vars(module).items() if isinstance(value, KVCache)]
    assert held == []


def test_a_captured_graph_refuses_another_cache(tiny_args):
    model, _ = build_model(tiny_args, seed=0)
    engine = Engine(model, EngineConfig.for_model(tiny_args, graph_mode="piecewise",
                                                  capture_sizes=(8,)))
    requests, tokens = [RequestSpec(5)], [[1, 2, 3, 4, 5]]
    plan = engine.plan(requests)
    engine.capture()
    step = engine.graphs.load(engine.prepare(requests, tokens, pad_to=8), 8)
    other = KVCache(tiny_args, engine.device, model.embed.weight.dtype)
    with pytest.raises(RuntimeError, match="bound to"):
        engine.graphs.run(8, engine.forward_context(step, plan, other))
    engine.graphs.run(8, engine.forward_context(step, plan, engine.cache))
