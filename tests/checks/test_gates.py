"""The engines' replay gates (issue 30), one by one on the tiny model (W = 8, 4 decoder layers):
the rows the engine keeps equal a hand count for a small handmade step, the oracle (which restates
each gate on its own) agrees, E1 passes; a seeded wrong gate fails E1."""

from __future__ import annotations

import dataclasses

import pytest

import swa_bench.engine.config as config_mod
import swa_bench.engine.engine as engine_mod
import swa_bench.model.batch as batch_mod
import swa_bench.replay.row_selection as row_selection
from swa_bench.checks import oracle
from swa_bench.checks.equivalence import check_e1
from swa_bench.engine.config import EngineConfig
from swa_bench.engine.dispatch import plan_step
from swa_bench.engine.engine import Engine
from swa_bench.engine.step_inputs import StepInputs
from swa_bench.model.requests import RequestSpec as R
from swa_bench.model.requests import prefix_hit_request

pytestmark = pytest.mark.usefixtures("one_thread")
W = 8
CAPTURE = (8, 16, 32, 64)


def _e1(model, requests, config, seed=1):
    inputs = StepInputs.seeded(requests, model.args.vocab_size, seed)
    return check_e1(model, inputs, config, decode_steps=1)


def _kept(model, requests, config):
    """(the engine's kept rows, the oracle's) for ``requests`` under ``config``."""
    engine = Engine(model, config)
    plan = engine.plan(requests)
    inputs = StepInputs.seeded(requests, model.args.vocab_size, 1)
    step = engine.prepare(requests, inputs.step_tokens)
    rb = engine.forward_context(step, plan, engine.cache).replay_batch
    rows = tuple(rb.rows.tolist()) if rb is not None else tuple(range(plan.num_tokens))
    return plan, rows, oracle.expect_for(engine, requests)


# --- context logits (TensorRT-LLM requires_full_decoder_prefill) ----------------------------

CONTEXT_LOGITS = [R(30, context_logits=True), R(20)]


@pytest.mark.parametrize("policy", ["bounded", "final_window", "tail"])
def test_context_logits_request_keeps_every_row(tiny_model, policy):
    config = EngineConfig.for_model(tiny_model.args, policy=policy)
    plan, rows, expected = _kept(tiny_model, CONTEXT_LOGITS, config)
    other = {"bounded": 8, "final_window": 8, "tail": 13}[policy]  # 20 rows: W, end - W, W + 5
    assert plan.kept_lens == expected.kept_lens == (30, other)
    assert rows == expected.rows == (*range(30), *range(50 - other, 50))
    assert "1 context logits kept whole" in plan.reason
    assert plan.decoder_floors == (0, 12 if policy == "final_window" else 0)
    result = _e1(tiny_model, CONTEXT_LOGITS, config)
    assert result.passed, result.message


def test_context_logits_trimmed_fails_e1(tiny_model, monkeypatch):
    monkeypatch.setattr(row_selection, "keeps_every_row",
                        lambda r: r.decode or r.prompt_logprobs)
    config = EngineConfig.for_model(tiny_model.args, policy="bounded")
    assert not _e1(tiny_model, CONTEXT_LOGITS, config).passed


def test_context_logits_return_logits_at_every_row(tiny_model):
    engine = Engine(tiny_model, EngineConfig.for_model(tiny_model.args))
    inputs = StepInputs.seeded(CONTEXT_LOGITS, tiny_model.args.vocab_size, 1)
    out = engine.step(inputs.requests, inputs.step_tokens)
    assert out.logits.shape[0] == 30 + 1


# --- speculative verify rows (vLLM, TensorRT-LLM: every verify row kept) --------------------

SPEC = [R(24, decode=True, spec_decode_tokens=3), R(20), R(16, decode=True)]


def test_spec_verify_rows_kept(tiny_model):
    config = EngineConfig.for_model(tiny_model.args, policy="bounded")
    plan, rows, expected = _kept(tiny_model, SPEC, config)
    assert [r.query_len for r in SPEC] == [4, 20, 1]
    assert plan.kept_lens == expected.kept_lens == (4, 8, 1)
    assert rows == expected.rows == (0, 1, 2, 3, *range(16, 24), 24)
    assert "1 spec verify kept whole" in plan.reason
    result = _e1(tiny_model, SPEC, config)
    assert result.passed, result.message


def test_spec_verify_rows_not_kept_fails_e1(tiny_model, monkeypatch):
    """The wrong gate: a verify request kept like a plain decode, its last row only."""
    real = row_selection.kept_len

    def kept_len(request, policy, window, halo):
        return 1 if request.spec_decode_tokens else real(request, policy, window, halo)

    monkeypatch.setattr(row_selection, "kept_len", kept_len)
    config = EngineConfig.for_model(tiny_model.args, policy="bounded")
    assert not _e1(tiny_model, SPEC, config).passed


# --- prefix hits (vLLM: recompute [H - W, H); a hit of W or fewer not adopted) ---------------


def test_prefix_hit_request_by_hand():
    assert prefix_hit_request(30, 12, W) == R(30, cached_len=4, recomputed_rows=8)
    assert prefix_hit_request(30, 8, W) == R(30)  # W tokens: not adopted
    assert prefix_hit_request(30, 3, W, chunk_size=16) == R(30, chunk_size=16)
    hit = prefix_hit_request(30, 12, W)
    assert (hit.query_len, hit.filled_len, hit.seq_len) == (26, 12, 30)


HITS = [prefix_hit_request(30, 12, W), prefix_hit_request(20, 5, W), R(14, cached_len=4)]


def test_prefix_hit_recomputes_the_window_before_it(tiny_model):
    config = EngineConfig.for_model(tiny_model.args, policy="bounded")
    plan, rows, expected = _kept(tiny_model, HITS, config)
    assert [r.query_len for r in HITS] == [26, 20, 10]
    # the hit's batch start is its first recomputed row, 4 (not 4 - W): no window KV cached
    assert expected.batch_starts == (4, 0, 0)
    assert plan.kept_lens == expected.kept_lens == (8, 8, 8)
    assert rows == expected.rows == (*range(18, 26), *range(38, 46), *range(48, 56))
    assert "prefix hit recomputes [4, 12)" in plan.reason
    engine = Engine(tiny_model, config)
    step = engine.prepare(HITS, StepInputs.seeded(HITS, tiny_model.args.vocab_size, 1)
                          .step_tokens)
    trash = tiny_model.args.max_requests * tiny_model.args.max_seq_len
    writes = step.metadata.global_slot[:26] != trash
    assert writes.tolist() == [False] * 8 + [True] * 18  # the hit's global KV stays as cached
    assert int(step.metadata.window_start[0]) == 4
    result = _e1(tiny_model, HITS, config)
    assert result.passed, result.message


def test_prefix_hit_reading_below_the_recomputed_rows_fails_e1(tiny_model, monkeypatch):
    """The wrong gate: the recomputed rows read window KV from ``cached - W`` as after earlier
    chunks, ring slots a prefix hit never cached."""
    monkeypatch.setattr(batch_mod, "request_window_start",
                        lambda r, window: batch_mod.batch_window_start(r.context_len, window))
    config = EngineConfig.for_model(tiny_model.args, policy="bounded")
    assert not _e1(tiny_model, HITS[:1], config).passed


# --- KV block reuse (TensorRT-LLM: no replay) --------------------------------------------------

TRIMMED = [R(30), R(20), R(16, decode=True)]


@pytest.mark.parametrize("policy", ["final_window", "bounded"])
def test_block_reuse_turns_replay_off(tiny_model, policy):
    config = EngineConfig.for_model(tiny_model.args, policy=policy, kv_block_reuse=True)
    plan, rows, expected = _kept(tiny_model, TRIMMED, config)
    assert not plan.replays and not expected.replays
    assert plan.kept_lens == (30, 20, 1) and rows == tuple(range(51))
    assert plan.decoder_floors == (0, 0, 0)
    assert plan.reason.startswith("kv_block_reuse: replay off")
    result = _e1(tiny_model, TRIMMED, config)
    assert result.passed, result.message


def test_block_reuse_ignored_fails_e1(tiny_model, monkeypatch):
    def ignoring(requests, config, args, **kw):
        return plan_step(requests, dataclasses.replace(config, kv_block_reuse=False), args, **kw)

    monkeypatch.setattr(engine_mod, "plan_step", ignoring)
    config = EngineConfig.for_model(tiny_model.args, policy="final_window", kv_block_reuse=True)
    assert not _e1(tiny_model, TRIMMED, config).passed


# --- LoRA, prompt embeddings (vLLM: no replay graphs; ATOM's tail: text prefills only) --------


@pytest.mark.parametrize("gate", ["lora", "prompt_embeds"])
def test_no_replay_graphs_with_lora_or_prompt_embeds(tiny_model, gate):
    config = EngineConfig.for_model(tiny_model.args, graph_mode="piecewise",
                                    capture_sizes=CAPTURE, **{gate: True})
    assert config.replay_capture_sizes == ()
    with_graphs = EngineConfig.for_model(tiny_model.args, graph_mode="piecewise",
                                         capture_sizes=CAPTURE)
    assert with_graphs.replay_capture_sizes  # the gate, not the mode, takes them away
    plan, rows, expected = _kept(tiny_model, TRIMMED, config)
    assert plan.replays and plan.graph_size == 64
    assert plan.replay_graph_size is None and expected.replay_graph_size is None
    assert "replay batch eager: vLLM runs no replay graphs" in plan.reason
    assert rows == expected.rows == (*range(22, 30), *range(42, 50), 50)
    result = _e1(tiny_model, TRIMMED, config)
    assert result.passed, result.message


def test_replay_graphs_despite_lora_fail_e1(tiny_model, monkeypatch):
    monkeypatch.setattr(config_mod, "replay_graphs_gate", lambda lora, prompt_embeds: None)
    config = EngineConfig.for_model(tiny_model.args, graph_mode="piecewise",
                                    capture_sizes=CAPTURE, lora=True)
    assert not _e1(tiny_model, TRIMMED, config).passed


def test_tail_replays_no_prompt_embeddings(tiny_model):
    config = EngineConfig.for_model(tiny_model.args, policy="tail", prompt_embeds=True)
    plan, rows, expected = _kept(tiny_model, TRIMMED, config)
    assert not plan.replays and not expected.replays and rows == tuple(range(51))
    assert plan.reason.startswith("tail: prompt embeddings")
    assert _kept(tiny_model, TRIMMED, dataclasses.replace(config, prompt_embeds=False))[0].replays
    result = _e1(tiny_model, TRIMMED, config)
    assert result.passed, result.message


def test_refused_replay_graphs_with_lora(tiny_model):
    with pytest.raises(ValueError, match="no replay graphs with LoRA"):
        dataclasses.replace(EngineConfig.for_model(tiny_model.args, graph_mode="piecewise",
                                                   capture_sizes=CAPTURE), lora=True)


def test_visibility_check_skips_static_shapes_beyond_a_graphs_logits_rows(tiny_model):
    """31 logits rows: more than a graph of the tiny model returns (max_requests 16), so no
    FULL graph runs the step and the visibility check runs it at varlen shapes only."""
    from swa_bench.checks.selection import check_visibility

    inputs = StepInputs.seeded(CONTEXT_LOGITS, tiny_model.args.vocab_size, 1)
    config = EngineConfig.for_model(tiny_model.args, capture_sizes=CAPTURE)
    result = check_visibility(tiny_model, inputs, config)
    assert result.passed, result.message
