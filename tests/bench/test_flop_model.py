"""The analytic FLOP model: each formula against counts worked out by hand for a small model,
then whole steps against torch's counter."""

import re

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from swa_bench.bench.flop_model import (
    SCORES,
    QueryRows,
    attention_core_flops,
    attention_projection_flops,
    chunks,
    dspark_flops,
    engram_flops,
    head_flops,
    hyper_connection_flops,
    indexer_flops,
    kv_write_flops,
    layer_gemms,
    moe_flops,
    precision_split,
    step_flops,
)
from swa_bench.bench.flops import EXTRA_FLOP_FORMULAS, count_flops
from swa_bench.engine.config import EngineConfig
from swa_bench.engine.engine import Engine
from swa_bench.engine.step_inputs import StepInputs
from swa_bench.kernels import TORCH_KERNELS, Kernels, KernelSettings
from swa_bench.model.args import PRESETS, ModelArgs, build_args
from swa_bench.model.model import build_model
from swa_bench.model.precision import FP8_LINEARS, weight_format
from swa_bench.model.requests import RequestSpec

# dim 8, 2 heads x 4, q_lora 6, one output group of rank 3, W = 2, sources 1 (ratio 2) and S = 2,
# 4 experts top-2 of width 5 + 1 shared, 2 mHC streams, indexer 2 heads x 4, top-3.
SMALL = ModelArgs(
    vocab_size=10, dim=8, n_layers=4, n_heads=2, head_dim=4, rope_dim=2, q_lora_rank=6,
    o_groups=1, o_lora_rank=3, window=2, kv_sources=[1, 2], compress_ratio=2,
    n_routed_experts=4, n_activated_experts=2, n_shared_experts=1, moe_inter_dim=5, hc_mult=2,
    index_topk=3, index_n_heads=2, index_head_dim=4, index_sources=[1, 2], max_seq_len=64,
)
FIVE = QueryRows(first=0, q_len=5, seq_len=5)


def test_attention_projections():
    # wq_a 2*8*6 + wq_b 2*6*8 + wo_a 2*8*3 + wo_b 2*1*3*8 = 96 + 96 + 48 + 48 per row
    assert attention_projection_flops(SMALL, 3) == 3 * 288


def test_kv_write():
    # the window's wkv 2*8*4; a source's compressor wkv 2*8*4 (+ wgate 2*8*4 at ratio 2) and
    # its index keys' wk 2*4*4
    assert kv_write_flops(SMALL, 1, 3) == 3 * (64 + 64 + 64 + 32)
    assert kv_write_flops(SMALL, 2, 3) == 3 * (64 + 64 + 32)  # S: ratio 1, no gate
    assert kv_write_flops(SMALL, 3, 3) == 3 * 64  # not a source: the window's wkv only
    assert kv_write_flops(SMALL.replace(index_topk=None), 1, 3) == 3 * (64 + 64 + 64)


def test_hyper_connection():
    # hc_fn: (2 + 2) * 2 = 8 mixes of the 2 * 8 flattened streams
    assert hyper_connection_flops(SMALL, 3) == 3 * 2 * (2 * 8) * 8
    assert hyper_connection_flops(SMALL.replace(hc_mult=1), 3) == 0


def test_moe():
    # gate 2*8*4, then (2 routed + 1 shared) experts of 6*8*5
    assert moe_flops(SMALL, 3) == 3 * (64 + 3 * 240)


def test_head():
    assert head_flops(SMALL, 2) == 2 * 2 * 8 * 10


def test_engram_and_dspark():
    args = SMALL.replace(engram_layers=[0, 1], engram_max_ngram_size=3, engram_n_heads=2,
                         engram_head_dim=4, engram_vocab_size=7, dspark_layers=2,
                         dspark_target_layers=[3])
    # wkv: (2 sizes x 2 heads x 4) -> 8 x (2 streams + 1 value), per Engram layer
    assert engram_flops(args, 3) == 3 * 2 * (2 * 16 * 24)
    # main_proj (1 target x 8) -> 8, then each draft layer's wkv 8 -> 4
    assert dspark_flops(args, 3) == 3 * (2 * 8 * 8 + 2 * (2 * 8 * 4))
    assert engram_flops(SMALL, 3) == dspark_flops(SMALL, 3) == 0


def test_sparse_attention_reads_window_plus_top_k():
    per_key = 4 * 2 * 4
    assert attention_core_flops(SMALL, 0, FIVE) == 5 * per_key * 2  # window-only
    assert attention_core_flops(SMALL, 2, FIVE) == 5 * per_key * (2 + 3)  # S: W + top-3
    assert attention_core_flops(SMALL, 1, FIVE) == 5 * per_key * (2 + 3)  # compressed source


def test_dense_attention_reads_every_visible_position_of_its_chunk():
    dense = SMALL.replace(index_topk=None, index_sources=None)
    per_key = 4 * 2 * 4
    assert attention_core_flops(dense, 2, FIVE) == 5 * per_key * (2 + 5)
    assert attention_core_flops(dense, 1, FIVE) == 5 * per_key * (2 + 5 // 2)


def test_indexer_scores_every_head_against_the_chunks_keys():
    projections = 5 * (2 * 6 * 2 * 4 + 2 * 8 * 2)
    assert indexer_flops(SMALL, 2, FIVE) == projections + 5 * 2 * 5 * (2 * 4 + 2)
    assert indexer_flops(SMALL, 1, FIVE) == projections + 5 * 2 * (5 // 2) * (2 * 4 + 2)
    assert indexer_flops(SMALL, 3, FIVE) == 0  # reads layer 2's selection


def test_chunks_end_at_their_last_position():
    assert chunks(QueryRows(first=10, q_len=5, seq_len=15), 2) == [(2, 12), (2, 14), (1, 15)]


@pytest.mark.parametrize("preset", ["tiny", "sparse-tiny"])
@pytest.mark.parametrize("policy", ["full", "bounded", "final_window"])
def test_step_flops_equal_the_counter(preset, policy):
    args = PRESETS[preset]
    model, _ = build_model(args, seed=0)
    w = args.window
    requests = [
        RequestSpec(prompt_len=12, decode=True),
        RequestSpec(prompt_len=6 * w),
        RequestSpec(prompt_len=w + 1, prompt_logprobs=True),
        RequestSpec(prompt_len=5 * w, cached_len=2 * w + 3),
        RequestSpec(prompt_len=9 * w, chunk_size=3 * w),
    ]
    load = StepInputs.seeded(requests, args.vocab_size, 5)
    engine = Engine(model, EngineConfig.for_model(model.args, policy=policy))
    load.fill_context(engine)
    plan = engine.plan(load.requests)
    assert plan.replays == (policy != "full")
    counted = count_flops(lambda: engine.step(load.requests, load.step_tokens))
    assert step_flops(args, load.requests, plan.kept_lens)["total"] == counted


def _fp8_kernels(gemm: str) -> Kernels:
    return Kernels("triton", interpret=True, quantised_gemm=gemm)


ONE_DECODE = [RequestSpec(prompt_len=9, decode=True)]


@pytest.mark.parametrize("preset", ["tiny", "v41-mini"])
def test_every_weight_the_split_names_is_one_of_the_models(preset):
    """``layer_gemms`` names each GEMM by the parameter that multiplies it, as the model names
    it (layer and DSpark module indices aside), so ``weight_format`` reads its precision."""
    args = build_args(preset, {"precision": "fp8"})
    model, _ = build_model(args, seed=0)
    params = {re.sub(r"\.\d+\.", ".", name) for name, _ in model.named_parameters()}
    params |= {"experts.w13", "experts.w2"}  # the routed experts: expert_pools.<i>. / own_
    requests = [RequestSpec(prompt_len=3 * args.window), RequestSpec(prompt_len=9, decode=True)]
    gemms = layer_gemms(args, requests, [args.window, 1])
    names = {w for parts in gemms.values() for part in parts.values() for w in part} - {SCORES}
    assert names and all(any(p == w or p.endswith("." + w) for p in params) for w in names), (
        sorted(w for w in names if not any(p == w or p.endswith("." + w) for p in params)))
    assert {w for w in names if weight_format(w) == "fp8"} >= {
        "attn.wq_a.weight", "attn.wkv.weight", "attn.wq_b.weight", "attn.wo_b.weight",
        "moe.shared_w13.weight", "moe.shared_w2.weight"}
    if preset == "v41-mini":  # the indexer's wq_b, Engram's wkv, DSpark's projections
        assert {"attn.wq_index.weight", "engram.wkv.weight", "main_proj.weight"} <= names
        assert {w for w in gemms["dspark"]["dspark"]} == {"main_proj.weight", "attn.wkv.weight"}


def test_the_fp8_share_of_one_decode_by_hand():
    """Tiny at precision fp8 with the fp8 GEMM, one decode row, no replay: in each of its 8
    layers wq_a 64->32, wq_b 32->4x32, wkv 64->32, wo_b 2x32->64 and one shared expert (w13
    64->2x32, w2 32->64) on fp8 tensor cores; the routed experts, wo_a, the compressors, the
    gate, mHC and the head at the dtype rate."""
    args = build_args("tiny", {"precision": "fp8"})
    assert (args.dim, args.q_lora_rank, args.n_heads, args.head_dim, args.o_groups,
            args.o_lora_rank, args.moe_inter_dim, args.n_shared_experts, args.n_layers) == (
        64, 32, 4, 32, 2, 32, 32, 1, 8)
    per_layer = (2 * 64 * 32 + 2 * 32 * 128 + 2 * 64 * 32 + 2 * 64 * 64
                 + 2 * 64 * 64 + 2 * 32 * 64)
    split = precision_split(args, ONE_DECODE, [1], kernels=_fp8_kernels("fp8"))
    assert split.fp8 == 8 * per_layer
    assert split.fp8 + split.dtype == step_flops(args, ONE_DECODE, [1],
                                                 kernels=_fp8_kernels("fp8"))["total"]


@pytest.mark.parametrize(("precision", "kernels", "runs_fp8"), [
    ("bf16", TORCH_KERNELS, False), ("bf16", _fp8_kernels("fp8"), False),
    ("fp8", TORCH_KERNELS, False), ("fp8", _fp8_kernels("bf16"), False),
    ("fp8", _fp8_kernels("fp8"), True)])
@pytest.mark.parametrize("preset", ["tiny", "v41-mini"])
def test_the_fp8_share_is_zero_unless_fp8_linears_run_fp8_gemms(preset, precision, kernels,
                                                               runs_fp8):
    """Under bf16 everything runs at the dtype rate; under fp8 with the default quantised_gemm
    bf16 too (bf16 GEMMs of the stored values); with quantised_gemm fp8 exactly the fp8
    Linears' GEMMs move to the fp8 rate, the routed experts (fp4) and the rest stay."""
    args = build_args(preset, {"precision": precision, "expert_precision": "w4a8"}
                      if precision == "fp8" else {})
    requests = [RequestSpec(prompt_len=3 * args.window), RequestSpec(prompt_len=9, decode=True)]
    kept = [args.window, 1]
    split = precision_split(args, requests, kept, kernels=kernels)
    assert split.fp8 + split.dtype == step_flops(args, requests, kept, kernels=kernels)["total"]
    fp8_linears = sum(f for parts in layer_gemms(args, requests, kept, kernels=kernels).values()
                      for part in parts.values() for w, f in part.items()
                      if w.endswith(FP8_LINEARS))
    assert fp8_linears > 0
    assert split.fp8 == (fp8_linears if runs_fp8 else 0)


@pytest.mark.slow
def test_the_triton_backends_counts_are_the_models_and_its_fp8_share(interpreter):
    """One replay step of tiny at precision fp8 on the Triton backend with the fp8 GEMM
    (Triton's interpreter on CPU). Torch's counter sees each fused kernel through its custom
    op's formula: outside attention (whose fused kernel counts the keys it visits, not the
    PyTorch path's chunks) its count is the analytic model's, the experts' grouped GEMM
    (``expert_gemm``) and the gate inside the routing kernel included (plain launches the
    counter missed until 2026-12-04: a fifth of a tiny step, and fp32 runs on CUDA); and the
    FLOPs it sees in ``swa_bench::fp8_gemm`` are the split's fp8 share."""
    args = build_args("tiny", {"precision": "fp8"})
    model, _ = build_model(args, seed=0)
    w = args.window
    load = StepInputs.seeded([RequestSpec(prompt_len=8, decode=True),
                              RequestSpec(prompt_len=2 * w + 3)], args.vocab_size, 1)
    engine = Engine(model, EngineConfig.for_model(
        args, policy="bounded", kernels=KernelSettings("triton", quantised_gemm="fp8")))
    load.fill_context(engine)
    plan = engine.plan(load.requests)
    assert plan.replays
    with torch.no_grad(), FlopCounterMode(display=False,
                                          custom_mapping=EXTRA_FLOP_FORMULAS) as counter:
        engine.step(load.requests, load.step_tokens)
    counts = counter.get_flop_counts()["Global"]
    ops = torch.ops.swa_bench
    assert counts[ops.expert_gemm] > 0 and counts[ops.moe_route] > 0 and counts[ops.fp8_gemm] > 0
    model_flops = step_flops(args, load.requests, plan.kept_lens, kernels=engine.kernels)
    outside_attention = counter.get_total_flops() - counts[ops.mqa_attention]
    assert outside_attention == model_flops["total"] - model_flops["attention"]
    split = precision_split(args, load.requests, plan.kept_lens, kernels=engine.kernels)
    assert split.fp8 == counts[ops.fp8_gemm]
