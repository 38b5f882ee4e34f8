"""E1 per policy through the engine, on a batch every policy trims, and
D = 1: with one decoder layer bounded replay is exact (H = W), so it equals the full prefill."""

from __future__ import annotations

import pytest
import torch

from swa_bench.checks.approximation import approximation, check_first_decoder_kv
from swa_bench.checks.equivalence import check_e1
from swa_bench.checks.oracle import ORACLE_POLICIES, expect_for
from swa_bench.engine.config import EngineConfig
from swa_bench.engine.engine import Engine
from swa_bench.engine.step_inputs import StepInputs
from swa_bench.kernels import KernelSettings
from swa_bench.model.args import build_args
from swa_bench.model.model import build_model
from swa_bench.model.requests import RequestSpec as R

BATCH = [R(20, decode=True), R(30), R(40, cached_len=5, chunk_size=12), R(14, cached_len=4),
         R(13, prompt_logprobs=True)]


@pytest.fixture(scope="module")
def tiny():
    return build_model(build_args("tiny"), seed=0)[0]


@pytest.mark.parametrize("policy", [p for p in ORACLE_POLICIES if p != "full"])
def test_e1_per_policy(tiny, policy):
    inputs = StepInputs.seeded(BATCH, tiny.args.vocab_size, 1, cache_indices=[7, 2, 9, 0, 4])
    config = EngineConfig.for_model(tiny.args, policy=policy)
    expected = expect_for(Engine(tiny, config), inputs.requests)
    assert expected.replays and expected.trims, expected.reason
    result = check_e1(tiny, inputs, config, decode_steps=2)
    assert result.passed, result.message


def test_one_decoder_layer_bounded_is_exact():
    model = build_model(build_args("tiny", {"n_layers": 5}), seed=0)[0]  # S = 3, D = 1
    inputs = StepInputs.seeded([R(30), R(19)], model.args.vocab_size, 2)
    metrics = approximation(model, inputs, continuation_steps=model.args.window,
                            kernels=KernelSettings())
    assert metrics.logits_max_abs < 1e-4 and metrics.greedy_agreement == 1.0
    assert check_first_decoder_kv(model, inputs, kernels=KernelSettings()).passed
    assert torch.tensor(metrics.window_kv_rel_error).max() < 1e-5
