"""Precision fp8: which values the model stores and reads quantised, against a map written here
from DeepSeek-V4.1's reference ``model.py`` (which ``Linear`` is fp8, what ``act_quant`` /
``fp4_act_quant`` touch), not from ``model.precision``'s own list; and that the checks hold.

The values themselves are held to the reference's code by the fp8 conformance fixture."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from swa_bench.checks.equivalence import check_e1, prepared
from swa_bench.engine.config import EngineConfig
from swa_bench.engine.engine import Engine
from swa_bench.engine.step_inputs import StepInputs
from swa_bench.kernels import quant
from swa_bench.model.args import build_args
from swa_bench.model.model import build_model
from swa_bench.model.requests import RequestSpec as R

# reference Linear -> its default dtype under ``dtype "fp8"``: fp8 unless the reference declares
# it (Compressor: fp32 / bf16; Indexer.weights_proj, Indexer.wk, wo_a: bf16; Gate, head: fp32).
# swa-bench module name (last two parts) -> whether its input is quantised per 32.
REFERENCE_LINEARS = {
    "attn.wq_a": True, "attn.wq_b": True, "attn.wkv": True, "attn.wo_b": True,
    "attn.wq_index": True,  # Indexer.wq_b (ColumnParallelLinear, default dtype)
    "attn.w_index": False,  # Indexer.weights_proj, dtype=torch.bfloat16
    "attn.wk_index": False,  # Indexer.wk, dtype=torch.bfloat16
    # Compressor.wkv: bf16 at ratio 1 (S's; a module call). Above ratio 1 it and wgate are fp32
    # products of the unquantised rows (``fp32_linear``, not a module call: no hook sees them).
    "compressor.wkv": False,
    "moe.shared_w13": True, "moe.shared_w2": True,  # shared_experts: Expert(dtype=None)
    "engram.wkv": True, "main_proj": True,
}
BATCH = [R(24, decode=True), R(40), R(50, cached_len=18, chunk_size=20)]


def on_act_grid(x: torch.Tensor) -> bool:
    return torch.equal(quant.act_quant(x), x)


@pytest.fixture(scope="module")
def mini():
    """v41-mini with seeded weights in both precisions (bf16 activations, as the release)."""
    return {p: build_model(build_args("v41-mini", {"precision": p}), seed=0,
                           dtype=torch.bfloat16)[0] for p in ("bf16", "fp8")}


def run_step(model, inputs: StepInputs, policy: str = "bounded") -> Engine:
    engine = prepared(Engine(model, EngineConfig.for_model(model.args, policy=policy)), inputs)
    engine.step(inputs.requests, inputs.step_tokens, inputs.indices)
    return engine


def inputs_for(model) -> StepInputs:
    return StepInputs.seeded(BATCH, model.args.vocab_size, 1, cache_indices=[3, 0, 5])


def test_fp8_linear_inputs_are_quantised_as_the_reference(mini):
    """Every Linear the step runs reads its input per 32 on the e4m3 grid exactly where the
    reference's ``linear()`` quantises (an fp8 weight), and as is elsewhere."""
    for precision, model in mini.items():
        seen: dict[str, list[bool]] = {}
        hooks = []
        for name, module in model.named_modules():
            key = next((k for k in REFERENCE_LINEARS if name.endswith(k)), None)
            if key is not None and isinstance(module, nn.Linear):
                hooks.append(module.register_forward_pre_hook(
                    lambda m, args, key=key, seen=seen: seen.setdefault(key, []).append(
                        on_act_grid(args[0]))))
        try:
            run_step(model, inputs_for(model))
        finally:
            for h in hooks:
                h.remove()
        assert set(seen) == set(REFERENCE_LINEARS), set(REFERENCE_LINEARS) - set(seen)
        for key, quantised in REFERENCE_LINEARS.items():
            want = quantised and precision == "fp8"
            assert all(seen[key]) if want else not any(seen[key]), (precision, key, seen[key])


def test_weights_stored_on_their_grids(mini):
    """fp8 Linears e4m3 per 32x32 block, routed experts e2m1 per 32 along K, Engram tables per
    32 of a row (one group at v41-mini's width 16); the rest as the reference keeps them."""
    fp8, bf16 = (dict(mini[p].named_parameters()) for p in ("fp8", "bf16"))
    checked = {"fp8": 0, "fp4": 0, "table": 0}
    for name, w in fp8.items():
        if any(name.endswith(k + ".weight") and q for k, q in REFERENCE_LINEARS.items()):
            fmt, fn = "fp8", quant.fp8_weight_quant
        elif name.endswith((".w13", ".w2")):
            fmt, fn = "fp4", quant.fp4_weight_quant
        elif name.endswith("engram.embed.weight"):
            fmt, fn = "table", lambda t: quant.act_quant(t, t.shape[-1])
        else:
            assert torch.equal(w, bf16[name]), f"{name} must stay as the reference keeps it"
            continue
        checked[fmt] += 1
        assert torch.equal(fn(w), w), name
        assert not torch.equal(fn(bf16[name]), bf16[name]), f"{name}: bf16 already on the grid"
    assert min(checked.values()) > 0, checked


def test_caches_hold_the_stored_formats(mini):
    """The window and draft rings fp8 per 32, the compressed KV fp4 per 16 with e4m3 scales,
    the index keys fp4 per 32: after a step every written row is on its grid."""
    model = mini["fp8"]
    cache = run_step(model, inputs_for(model)).cache
    formats = [("ring", cache.ring, quant.act_quant),
               ("draft_ring", cache.draft_ring, quant.act_quant),
               ("compressed", list(cache.compressed.values()), quant.fp4_act_quant_e4m3_scale),
               ("index_keys", list(cache.index_keys.values()), quant.fp4_act_quant)]
    for kind, tensors, fn in formats:
        assert tensors, kind
        for t in tensors:
            written = t[t.abs().sum(-1) > 0]
            assert written.shape[0] > 0, kind
            assert torch.equal(fn(written), written), kind


def test_w4a16_reads_the_experts_inputs_unquantised(mini):
    """w4a16 changes only the routed experts' inputs: its logits differ from w4a8's, and both
    from bf16's (the quantisation is there at all)."""
    inputs = inputs_for(mini["fp8"])
    w4a16 = build_model(build_args("v41-mini", {"precision": "fp8", "expert_precision": "w4a16"}),
                        seed=0, dtype=torch.bfloat16)[0]
    logits = {}
    for name, model in (("bf16", mini["bf16"]), ("w4a8", mini["fp8"]), ("w4a16", w4a16)):
        engine = prepared(Engine(model, EngineConfig.for_model(model.args, policy="full")),
                          inputs)
        logits[name] = engine.step(inputs.requests, inputs.step_tokens, inputs.indices).logits
    assert not torch.equal(logits["w4a8"], logits["w4a16"])
    assert not torch.equal(logits["bf16"], logits["w4a8"])


def test_e1_bitwise_in_fp8(mini):
    model = mini["fp8"]
    result = check_e1(model, inputs_for(model), EngineConfig.for_model(model.args),
                      decode_steps=1)
    assert result.passed and "bitwise" in result.message, result.message


def test_fp8_refuses_widths_its_groups_do_not_divide():
    with pytest.raises(ValueError, match="q_lora_rank: must be a multiple of 32 under precision"):
        build_args("tiny", {"precision": "fp8", "q_lora_rank": 48})
    with pytest.raises(ValueError, match="engram_head_dim"):
        build_args("sparse-tiny", {"precision": "fp8"})  # Engram's wkv input is 48 wide
    with pytest.raises(ValueError, match="precision: must be one of bf16, fp8"):
        build_args("tiny", {"precision": "int8"})
    build_args("sparse-tiny", {"q_lora_rank": 48})  # bf16 has no groups


@pytest.mark.cuda
def test_fp8_on_the_inference_kernels():
    """The fused GPU paths (stacked latents, the experts' gather-GEMM-scatter, the fused
    route) read the quantised inputs too: the caches hold the stored formats and E1 is
    bitwise on CUDA."""
    model = build_model(build_args("v41-mini", {"precision": "fp8"}), seed=0, device="cuda",
                        dtype=torch.bfloat16)[0]
    inputs = inputs_for(model)
    cache = run_step(model, inputs).cache
    for t in cache.ring:
        written = t[t.abs().sum(-1) > 0]
        assert written.shape[0] > 0 and torch.equal(quant.act_quant(written), written)
    for t in cache.compressed.values():
        written = t[t.abs().sum(-1) > 0]
        assert torch.equal(quant.fp4_act_quant_e4m3_scale(written), written)
    result = check_e1(model, inputs, EngineConfig.for_model(model.args), decode_steps=1)
    assert result.passed and "bitwise" in result.message, result.message
