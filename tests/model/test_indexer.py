"""The top-k indexer option: an oracle (top-k >= every position is dense attention), E4, and the
replay and graph equivalences with sparse global attention."""

import pytest
import torch

from swa_bench.checks.comparison import Tolerance
from swa_bench.checks.equivalence import check_e1, check_e2, check_e3, check_e4
from swa_bench.engine.config import EngineConfig
from swa_bench.engine.engine import Engine
from swa_bench.engine.step_inputs import StepInputs
from swa_bench.kernels import KernelSettings
from swa_bench.model.model import build_model
from swa_bench.model.requests import RequestSpec

TOL = Tolerance.for_dtype(torch.float32)


@pytest.fixture(scope="module")
def indexed(tiny_args):
    model, _ = build_model(tiny_args.replace(index_topk=5), seed=0)
    return model


def mixed(w: int) -> list[RequestSpec]:
    return [
        RequestSpec(prompt_len=12, decode=True),
        RequestSpec(prompt_len=6 * w),
        RequestSpec(prompt_len=w + 1),
        RequestSpec(prompt_len=5 * w, cached_len=2 * w + 3),
    ]


def test_top_k_over_every_position_is_dense_attention(tiny_args):
    """With top_k >= max_seq_len the indexer selects every visible position: the dense model with
    the same weights, up to rounding (the sparse path gathers keys in another order)."""
    dense, _ = build_model(tiny_args, seed=0)
    wide, _ = build_model(tiny_args.replace(index_topk=tiny_args.max_seq_len), seed=0)
    wide.load_state_dict(dense.state_dict(), strict=False)
    load = StepInputs.seeded(mixed(tiny_args.window), tiny_args.vocab_size, 2)
    outs = []
    for model in (dense, wide):
        engine = Engine(model)
        load.fill_context(engine)
        outs.append(engine.reference_step(load.requests, load.step_tokens).logits)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_the_indexer_narrows_attention(tiny_args, indexed):
    dense, _ = build_model(tiny_args, seed=0)
    indexed_same, _ = build_model(tiny_args.replace(index_topk=5), seed=0)
    indexed_same.load_state_dict(dense.state_dict(), strict=False)
    load = StepInputs.seeded([RequestSpec(prompt_len=40)], tiny_args.vocab_size, 3)
    a = Engine(dense).reference_step(load.requests, load.step_tokens).logits
    b = Engine(indexed_same).reference_step(load.requests, load.step_tokens).logits
    assert (a - b).abs().max() > 1e-3, "top-5 of 40 positions must change the result"


def test_e4_with_the_indexer(indexed):
    load = StepInputs.seeded([RequestSpec(prompt_len=30)], indexed.args.vocab_size, 4)
    result = check_e4(indexed, load, tol=TOL, kernels=KernelSettings())
    assert result.passed, result.message


def test_replay_equivalences_with_the_indexer(indexed):
    load = StepInputs.seeded(mixed(indexed.args.window), indexed.args.vocab_size, 5)
    e1 = check_e1(indexed, load, EngineConfig.for_model(indexed.args), decode_steps=4, tol=TOL)
    assert e1.passed, e1.message
    e2 = check_e2(indexed, load, EngineConfig.for_model(indexed.args, policy="halo"), tol=TOL)
    assert e2.passed, e2.message


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_graphs_are_bitwise_eager_with_the_indexer(indexed, mode):
    load = StepInputs.seeded(mixed(indexed.args.window), indexed.args.vocab_size, 6)
    config = EngineConfig.for_model(
        indexed.args, graph_mode=mode, trim_threshold=32, capture_sizes=(8, 16, 32, 64, 128)
    )
    result = check_e3(indexed, load, config)
    assert result.passed, result.message
