"""DSpark's draft rings against a restatement of DeepSeek-V4.1's ``Transformer.forward`` (aux
hidden states: the mean over streams of the target layers' input streams) and
``DSparkAttention.forward`` (the ring: ``kv_norm(wkv(main_norm(main_proj(main_hidden))))``
RoPE'd as a window-only layer, the last W positions), at prefill and at decode steps; and E1
holding the replay's draft rings and aux hidden states to the oracle and the bounded reference."""

from __future__ import annotations

import pytest
import torch

import swa_bench.model.dspark as dspark
from swa_bench.checks.equivalence import check_e1
from swa_bench.engine.config import EngineConfig
from swa_bench.engine.engine import Engine
from swa_bench.engine.step_inputs import StepInputs
from swa_bench.model.args import build_args
from swa_bench.model.forward_context import get_forward_context
from swa_bench.model.model import build_model
from swa_bench.model.requests import RequestSpec as R
from swa_bench.model.rope import RopeSpec, apply_rope

BATCH = [R(20, decode=True), R(30), R(40, cached_len=5, chunk_size=12), R(14, cached_len=4),
         R(13, prompt_logprobs=True)]


@pytest.fixture(scope="module")
def model():
    return build_model(build_args("sparse-tiny", {"max_seq_len": 64}), seed=0)[0]


def rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def target_inputs(model):
    """Forward pre-hooks recording each target block's input streams."""
    seen, hooks = {}, []
    for layer in model.args.dspark_target_layers:
        def hook(_mod, args, layer=layer):
            seen[layer] = args[0]
        hooks.append(model.layers[layer].register_forward_pre_hook(hook))
    return seen, hooks


def test_rings_are_seeded_from_the_target_layers_inputs_at_prefill_and_decode(model):
    args, w = model.args, model.args.window
    engine = Engine(model)
    seq = torch.randint(0, args.vocab_size, (21,), generator=torch.Generator().manual_seed(4))
    seen, hooks = target_inputs(model)
    try:
        steps = [([R(19)], [seq[:19].tolist()], list(range(19))),
                 ([R(19, decode=True)], [[int(seq[19])]], [19]),
                 ([R(20, decode=True)], [[int(seq[20])]], [20])]
        for requests, tokens, positions in steps:
            out = engine.reference_step(requests, tokens, [3])
            hidden = torch.cat([sum(seen[t]) / args.hc_mult for t in args.dspark_target_layers],
                               dim=-1)
            torch.testing.assert_close(out.aux_hidden, hidden, rtol=1e-6, atol=1e-6)
            first = model.dspark.mtp[0]
            main_x = rms(hidden @ first.main_proj.weight.T, first.main_norm.weight, args.norm_eps)
            pos = torch.tensor(positions)
            for j, block in enumerate(model.dspark.mtp):
                kv = rms(main_x @ block.attn.wkv.weight.T, block.attn.kv_norm.weight,
                         args.norm_eps)
                kv = apply_rope(kv, pos, RopeSpec(args.rope_dim, args.rope_theta, args.max_seq_len))
                ring = engine.cache.tensors()[f"draft_ring.{j}"][3 * w : 4 * w]
                last = positions[-w:]
                torch.testing.assert_close(ring[[p % w for p in last]], kv[-len(last):],
                                           rtol=1e-5, atol=1e-5)
    finally:
        for h in hooks:
            h.remove()
    # every slot of the request's ring is written (positions 13..20)
    assert not engine.cache.tensors()["draft_ring.0"][3 * w : 4 * w].eq(0).all(-1).any()


def test_the_cache_names_the_draft_rings_and_the_token_history(model):
    names = set(Engine(model).cache.tensors())
    assert {"draft_ring.0", "draft_ring.1", "engram_tokens"} <= names


@pytest.mark.parametrize("policy", ["bounded", "final_window"])
def test_e1_holds_the_draft_rings_and_aux_hidden_states(model, policy):
    inputs = StepInputs.seeded(BATCH, model.args.vocab_size, 1, cache_indices=[7, 2, 9, 0, 4])
    config = EngineConfig.for_model(model.args, policy=policy)
    result = check_e1(model, inputs, config, decode_steps=1)
    assert result.passed, result.message


def test_e1_fails_when_the_reference_seeds_draft_rings_from_trimmed_rows(model, monkeypatch):
    """A seeding that ignores the draft layers' metadata writes trimmed rows' keys in the
    bounded reference (final_window trims a whole early chunk): E1's cache comparison sees it."""

    def unmasked(self, main_hidden):
        ctx = get_forward_context()
        first = self.mtp[0]
        main_x = first.main_norm(first.main_proj(main_hidden))
        for j, block in enumerate(self.mtp):
            meta = ctx.attn_metadata
            ctx.cache.draft_ring[j].index_copy_(0, meta.ring_slot,
                                                block.attn.main_kv(main_x, meta.positions))

    monkeypatch.setattr(dspark.DSpark, "seed_rings", unmasked)
    inputs = StepInputs.seeded(BATCH, model.args.vocab_size, 1, cache_indices=[7, 2, 9, 0, 4])
    config = EngineConfig.for_model(model.args, policy="final_window")
    result = check_e1(model, inputs, config, decode_steps=1)
    assert not result.passed and "draft_ring" in result.message, result.message
