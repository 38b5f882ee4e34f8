"""The analytic byte model: weight bytes against a count of what one eager step's GEMMs read,
KV and activation bytes against hand counts, the storage formats against hand arithmetic, the
uniform-routing expectation against an enumeration."""

import itertools
import math
from fractions import Fraction

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from swa_bench.bench.byte_model import (
    StorageFormat,
    WeightFormats,
    expected_distinct_experts,
    layer_bytes,
    routed_expert_bytes,
    step_bytes,
)
from swa_bench.engine.config import EngineConfig
from swa_bench.engine.engine import Engine
from swa_bench.engine.step_inputs import StepInputs
from swa_bench.model.args import PRESETS, ModelArgs
from swa_bench.model.model import build_model
from swa_bench.model.requests import RequestSpec

aten = torch.ops.aten
GEMMS = {aten.linear.default, aten.mm.default, aten.addmm.default, aten.bmm.default, aten.bmm.out,
         aten.baddbmm.default}


class GemmWeightReads(TorchDispatchMode):
    """Bytes of parameters that GEMM ops read, each call counted: a parameter (or a view of
    one) passed to a GEMM is its whole storage read. A grouped GEMM's weight is a copy on CPU,
    so its reads are the groups its ``offs`` give rows to, per call; the experts each MoE's
    grouped GEMMs touched are recorded by layer (the hook names the layer)."""

    def __init__(self, model):
        super().__init__()
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.bytes = 0
        self.layer = None
        self.touched: dict[int, int] = {}
        self.grouped_calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in GEMMS:
            for t in tree_flatten(args)[0]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.params:
                    self.bytes += t.numel() * t.element_size()
        elif func is aten._grouped_mm.default:
            b, offs = args[1], kwargs.get("offs", args[2] if len(args) > 2 else None)
            ends = offs.tolist()
            rows = [e - s for s, e in zip([0, *ends[:-1]], ends, strict=True)]
            touched = sum(r > 0 for r in rows)
            self.bytes += touched * b[0].numel() * b.element_size()
            self.grouped_calls += 1
            if self.layer in self.touched:
                assert self.touched[self.layer] == touched  # w2 routes as w13 did
            self.touched[self.layer] = touched
        return func(*args, **kwargs)


def hook_layers(model, counter):
    def enter(layer):
        def hook(module, inputs):
            counter.layer = layer
        return hook
    return [block.moe.register_forward_pre_hook(enter(block.layer)) for block in model.layers]


REQUESTS = [
    RequestSpec(prompt_len=12, decode=True),
    RequestSpec(prompt_len=6 * 8),
    RequestSpec(prompt_len=8 + 1, prompt_logprobs=True),
    RequestSpec(prompt_len=5 * 8, cached_len=2 * 8 + 3),
]


@pytest.mark.parametrize("preset", ["tiny", "sparse-tiny"])
@pytest.mark.parametrize("policy", ["full", "bounded"])
def test_weight_bytes_equal_what_the_gemms_read(preset, policy):
    args = PRESETS[preset]
    model, _ = build_model(args, seed=0)
    load = StepInputs.seeded(REQUESTS, args.vocab_size, 5)
    engine = Engine(model, EngineConfig.for_model(model.args, policy=policy))
    load.fill_context(engine)
    plan = engine.plan(load.requests)
    assert plan.replays == (policy != "full") and plan.num_kept < plan.num_tokens or (
        policy == "full")
    counter = GemmWeightReads(model)
    handles = hook_layers(model, counter)
    try:
        with counter:
            engine.step(load.requests, load.step_tokens)
    finally:
        for h in handles:
            h.remove()
    assert counter.grouped_calls == 2 * args.n_layers  # every layer's w13 and w2, no drafts'
    parts = step_bytes(args, load.requests, plan.kept_lens, distinct_experts=counter.touched)
    assert parts["weights"] + parts["experts"] == counter.bytes


def test_the_uniform_expectation_is_the_enumerated_mean():
    e, k = 5, 2
    subsets = list(itertools.combinations(range(e), k))
    for n in (1, 2, 3):
        unions = [len(set().union(*pick)) for pick in itertools.product(subsets, repeat=n)]
        exact = Fraction(sum(unions), len(unions))
        assert expected_distinct_experts(e, k, n) == pytest.approx(float(exact), rel=1e-12)
    assert expected_distinct_experts(e, k, 0) == 0


def test_routed_bytes_measured_or_expected():
    args = PRESETS["tiny"]  # 4 experts top-2, w13 [64, 64] + w2 [64, 32] fp32
    per_expert = (64 * 64 + 64 * 32) * 4
    assert routed_expert_bytes(args, 7, WeightFormats.of_dtype(torch.float32), 3) == 3 * per_expert
    # 2 rows: 4 (1 - (1/2)^2) = 3 experts expected
    assert routed_expert_bytes(args, 2, WeightFormats.of_dtype(torch.float32)) == 3 * per_expert


# dim 8, 2 heads x 4, W = 2, sources 1 (ratio 2) and S = 2, 2 mHC streams, indexer 2 heads x 4
# (index sources 1 and 2), top-3: the model of test_flop_model.
SMALL = ModelArgs(
    vocab_size=10, dim=8, n_layers=4, n_heads=2, head_dim=4, rope_dim=2, q_lora_rank=6,
    o_groups=1, o_lora_rank=3, window=2, kv_sources=[1, 2], compress_ratio=2,
    n_routed_experts=4, n_activated_experts=2, n_shared_experts=1, moe_inter_dim=5, hc_mult=2,
    index_topk=3, index_n_heads=2, index_head_dim=4, index_sources=[1, 2], max_seq_len=64,
)
# A prompt of 5 (positions 0-4) and a decode at position 6.
TWO = [RequestSpec(prompt_len=5), RequestSpec(prompt_len=6, decode=True)]
KEY = 4 * 4  # a key of head_dim 4 (or an index key of 4) in fp32


def kv_and_activations(kept):
    got = layer_bytes(SMALL, TWO, kept)
    return {name: (got[str(layer)]["kv_read"], got[str(layer)]["kv_write"],
                   got[str(layer)]["activations"])
            for layer, name in enumerate(("window", "encoder", "S", "decoder"))}


def test_kv_and_activation_bytes_by_hand_on_the_whole_batch():
    # Window keys: the prompt's 5 rows read positions 0-4; the decode position 6 and 5 (W = 2).
    window = (5 + 2) * KEY
    # Ring writes: the last min(q, W) rows, 2 + 1.
    ring = 3 * KEY
    # Streams in and out of a layer, 6 rows: 2 streams x 8 fp32 + the pre-mix's 2 fp32 each.
    streams = 6 * (2 * 8 + 2) * 4
    got = kv_and_activations([5, 1])
    assert got["window"] == (window, ring, 2 * streams)
    # Encoder (ratio 2): the prompt sees 5 // 2 = 2 groups, the decode 7 // 2 = 3: top-3 picks
    # at most 2 and 3 of them; the indexer scores 2 and 3 index keys; the prompt completes
    # groups 0 and 1, the decode none (position 6 starts group 3).
    assert got["encoder"] == (window + (2 + 3) * KEY + (2 + 3) * KEY,
                              ring + 2 * KEY + 2 * KEY, 2 * streams)
    # S (ratio 1): selected min(5 x 3, 5) = 5 and min(1 x 3, 7) = 3 positions; the indexer 5
    # and 7 keys; 5 + 1 new positions into its KV and index keys; its input read again on every
    # row for the batch KV.
    assert got["S"] == (window + (5 + 3) * KEY + (5 + 7) * KEY,
                        ring + 6 * KEY + 6 * KEY, 3 * streams)
    # The decoder reads S's selection (5 and 3 positions), runs no indexer, writes its ring.
    assert got["decoder"] == (window + (5 + 3) * KEY, ring, 2 * streams)


def test_kv_and_activation_bytes_by_hand_on_kept_rows():
    # The prompt keeps its last 3 rows (positions 2-4), the decode its one row.
    got = kv_and_activations([3, 1])
    streams_all, streams_kept = 6 * (2 * 8 + 2) * 4, 4 * (2 * 8 + 2) * 4
    window_all, window_kept = (5 + 2) * KEY, (1 + 3 + 2) * KEY  # the prompt: positions 1-4
    assert got["window"] == (window_all, 3 * KEY, 2 * streams_all)  # before the cut: unchanged
    # S: attention on the kept rows (selected 5 and 3), its indexer and batch KV on every row.
    assert got["S"] == (window_kept + (5 + 3) * KEY + (5 + 7) * KEY,
                        3 * KEY + 6 * KEY + 6 * KEY, 2 * streams_kept + streams_all)
    assert got["decoder"] == (window_kept + (5 + 3) * KEY, 3 * KEY, 2 * streams_kept)


def test_dense_global_keys_once_per_chunk():
    dense = SMALL.replace(index_topk=None, index_sources=None)
    got = layer_bytes(dense, TWO, [5, 1])
    # S: the prompt's one chunk reads its 5 visible positions, the decode 7; no index keys.
    assert got["2"]["kv_read"] == (5 + 2) * KEY + (5 + 7) * KEY
    assert got["2"]["kv_write"] == 3 * KEY + 6 * KEY  # ring, S's global KV: no index keys


def test_release_formats_by_hand():
    f = WeightFormats.release()
    # fp8 dense [64, 96]: a byte a value, 2 x 3 blocks of 32 x 32 scaled; a partial block too.
    assert f.dense.matrix_bytes(64, 96) == 64 * 96 + 6
    assert f.dense.matrix_bytes(33, 33) == 33 * 33 + 4
    # fp4 experts [40, 96]: half a byte a value, a scale per 32 along K: 3 per row.
    assert f.experts.matrix_bytes(40, 96) == 40 * 96 // 2 + 40 * 3
    # fp8 window KV, 10 keys of 512: a scale per 32; fp4 compressed KV and index keys per 16.
    assert f.window_kv.matrix_bytes(10, 512) == 5120 + 10 * 16
    assert f.compressed_kv.matrix_bytes(10, 512) == 2560 + 10 * 32
    assert f.index_keys.matrix_bytes(10, 128) == 640 + 10 * 8
    assert f.activations.matrix_bytes(10, 512) == 10 * 512 * 2
    assert f.head.matrix_bytes(2, 3) == 24  # the head stays fp32


def test_default_formats_are_the_model_dtype():
    f = WeightFormats.of_dtype(torch.bfloat16)
    for name in ("dense", "experts", "window_kv", "compressed_kv", "index_keys", "activations"):
        assert getattr(f, name).matrix_bytes(3, 5) == 30, name
    assert f.head == StorageFormat(4)
    assert math.isclose(WeightFormats.release().experts.matrix_bytes(1, 32) / 32, 0.5 + 1 / 32)
