"""The kernel choice ``quantised_gemm: fp8`` (issue 28): precision fp8's fp8 Linears through
``kernels.fp8_gemm`` instead of bf16 GEMMs of the stored values. Made once (``KernelSettings``),
refused where it cannot run, recorded per case; on the tiny preset through Triton's interpreter
the model computes what the default computes up to the order of fp32 sums, and E1 stays bitwise.
"""

from __future__ import annotations

import pytest

from swa_bench.checks.equivalence import check_e1, prepared
from swa_bench.engine.config import EngineConfig, kernel_settings_from_environment
from swa_bench.engine.engine import Engine
from swa_bench.engine.step_inputs import StepInputs
from swa_bench.kernels import Kernels, KernelSettings
from swa_bench.model import precision
from swa_bench.model.args import build_args
from swa_bench.model.model import build_model
from swa_bench.model.requests import RequestSpec as R
from swa_bench.scenario.schema import KernelsSpec

BATCH = [R(8, decode=True), R(12)]
# The tiny preset's fp8 Linears as the fp8 GEMM runs them: layer 3 (its last KV source) computes
# wq_a and wkv apart, the others as one stacked GEMM kept on the attention module.
STACKED_LAYERS = (0, 1, 2, 4, 5, 6, 7)
# Measured on this preset (fp32 model, seed 0): the logits differ by at most 4.8e-7 (|logit| <=
# 3.3), from fp32 sums in another order, carried through eight layers and their quantised inputs.
LOGIT_TOLERANCE = 4e-6


def test_the_choice_is_made_once_refused_where_it_cannot_run_and_recorded():
    assert KernelSettings().quantised_gemm == "bf16"  # the default: no figure changes
    assert KernelSettings.parse(quantised_gemm="FP8").quantised_gemm == "fp8"
    assert kernel_settings_from_environment({"SWA_BENCH_QUANTISED_GEMM": "fp8"}
                                            ).quantised_gemm == "fp8"
    with pytest.raises(ValueError, match="SWA_BENCH_QUANTISED_GEMM: must be one of bf16, fp8"):
        kernel_settings_from_environment({"SWA_BENCH_QUANTISED_GEMM": "int8"})
    with pytest.raises(ValueError, match="quantised_gemm fp8 needs the triton backend"):
        KernelSettings("auto", quantised_gemm="fp8").resolve("cpu", interpret=False)
    with pytest.raises(ValueError, match="fp8 without the triton backend"):
        Kernels("torch", quantised_gemm="fp8")
    resolved = KernelSettings("triton", quantised_gemm="fp8").resolve("cpu", interpret=True)
    assert resolved == Kernels("triton", interpret=True, quantised_gemm="fp8")
    assert KernelsSpec(quantised_gemm="fp8").settings(KernelSettings()).quantised_gemm == "fp8"
    assert KernelsSpec().settings(KernelSettings(quantised_gemm="fp8")).quantised_gemm == "fp8"
    fp8_args, bf16_args = build_args("tiny", {"precision": "fp8"}), build_args("tiny")
    assert precision.quantised_gemm(fp8_args, resolved) == precision.FP8_GEMM
    assert precision.quantised_gemm(fp8_args, Kernels("triton")) == precision.QUANTISED_GEMM
    assert precision.quantised_gemm(bf16_args, resolved) == "-"


@pytest.fixture(scope="module")
def tiny_fp8(one_thread):
    args = build_args("tiny", {"precision": "fp8"})
    model = build_model(args, seed=0)[0]
    inputs = StepInputs.seeded(BATCH, args.vocab_size, 1, cache_indices=[1, 0])
    return model, inputs


def config(model, gemm: str) -> EngineConfig:
    return EngineConfig.for_model(model.args,
                                  kernels=KernelSettings("triton", quantised_gemm=gemm))


@pytest.mark.slow
def test_the_fp8_gemm_computes_the_stored_values_product(interpreter, tiny_fp8):
    """One step's logits, fp8 GEMM against bf16 GEMMs of the stored values on the same (Triton)
    kernels: within LOGIT_TOLERANCE, not bitwise (the fp8 path ran), and each fp8 Linear's
    weight encoded once, kept where the weight lives."""
    model, inputs = tiny_fp8
    logits = {}
    for gemm in ("bf16", "fp8"):
        engine = prepared(Engine(model, config(model, gemm)), inputs)
        logits[gemm] = engine.step(inputs.requests, inputs.step_tokens, inputs.indices).logits
    diff = (logits["fp8"].double() - logits["bf16"].double()).abs().max().item()
    assert 0 < diff <= LOGIT_TOLERANCE, diff
    encoded = {n for n, m in model.named_modules()
               if hasattr(m, "_fp8_weight") or hasattr(m, "_stacked_latent_fp8")}
    want = {f"layers.{i}.{part}" for i in range(model.args.n_layers)
            for part in ("attn.wq_b", "attn.wo_b", "moe.shared_w13", "moe.shared_w2")}
    want |= {f"layers.{i}.attn" for i in STACKED_LAYERS} | {"layers.3.attn.wq_a",
                                                           "layers.3.attn.wkv"}
    assert encoded == want
    cached = model.layers[0].attn.wq_b._fp8_weight[1]
    engine.step(inputs.requests, inputs.step_tokens, inputs.indices)
    assert model.layers[0].attn.wq_b._fp8_weight[1] is cached  # not encoded per call


@pytest.mark.slow
def test_e1_stays_bitwise_with_the_fp8_gemm(interpreter, tiny_fp8):
    model, inputs = tiny_fp8
    result = check_e1(model, inputs, config(model, "fp8"), decode_steps=1)
    assert result.passed and "bitwise" in result.message, result.message
