"""Issue 30's acceptance test: TensorRT-LLM's final window (``plan_decoder_replay``) on a
300-token prompt in chunks of 240 and 60, W = 128. The chunks keep 68 and 60 rows, both read
decoder window KV from the floor 172, E1 passes on both, and the two chunks run back to back
leave the last token and the caches a one-step final-window reference computes; without the
floor (the old rule) E1 fails and the second chunk reads ring slots no chunk wrote."""

from __future__ import annotations

import pytest
import torch

import swa_bench.replay.row_selection as row_selection
from swa_bench.checks import oracle
from swa_bench.checks.comparison import envelope_ratio, envelope_tolerance
from swa_bench.checks.equivalence import check_e1
from swa_bench.engine.config import EngineConfig
from swa_bench.engine.engine import Engine
from swa_bench.engine.step_inputs import StepInputs
from swa_bench.model.args import build_args
from swa_bench.model.model import build_model
from swa_bench.model.requests import RequestSpec

W, PROMPT, CHUNK = 128, 300, 240
CHUNKS = [RequestSpec(PROMPT, cached_len=c, chunk_size=CHUNK) for c in (0, CHUNK)]


@pytest.fixture(scope="module")
def model():
    return build_model(build_args("tiny", {"window": W, "max_seq_len": 512}), seed=0)[0]


@pytest.fixture(scope="module")
def tokens(model):
    return StepInputs.seeded([RequestSpec(PROMPT)], model.args.vocab_size, 3).sequences[0]


def _inputs(chunk: RequestSpec, tokens) -> StepInputs:
    return StepInputs((chunk,), (tuple(tokens[: chunk.seq_len]),))


def _config(model) -> EngineConfig:
    return EngineConfig.for_model(model.args, policy="final_window")


def _no_floor(monkeypatch):
    """The old rule: the final window's rows kept, no floor (each chunk reads from its batch
    start ``cached - W``)."""
    monkeypatch.setattr(row_selection, "decoder_floor", lambda request, policy, window: 0)


def test_plan_keeps_68_then_60_rows_both_from_floor_172(model, tokens):
    assert [c.query_len for c in CHUNKS] == [240, 60]
    engine = Engine(model, _config(model))
    kept, floors, starts = [], [], []
    for chunk in CHUNKS:
        plan = engine.plan([chunk])
        assert plan.replays, plan.reason  # the second keeps every row, yet must read from 172
        step = engine.prepare([chunk], [list(tokens[chunk.cached_len: chunk.seq_len])], [0])
        rb = engine.forward_context(step, plan, engine.cache).replay_batch
        kept += plan.kept_lens
        floors += plan.decoder_floors
        starts.append(int(rb.forward_context.attn_metadata.window_start[0]))
        # layer S reads every row's window KV from the batch start: its outputs stay exact
        s_meta = rb.forward_context.layer_metadata[model.args.last_kv_source]
        assert int(s_meta.window_start[0]) == max(0, chunk.cached_len - W)
    assert kept == [68, 60] and floors == [172, 172] and starts == [172, 172]
    expected = [oracle.expect_for(engine, [c]) for c in CHUNKS]
    assert [e.kept_lens for e in expected] == [(68,), (60,)]
    assert [e.kept_starts for e in expected] == [(172,), (172,)]


@pytest.mark.parametrize("chunk", CHUNKS, ids=["240", "60"])
def test_e1_passes_on_each_chunk(model, tokens, chunk):
    result = check_e1(model, _inputs(chunk, tokens), _config(model), decode_steps=1)
    assert result.passed, result.message


def test_e1_fails_without_the_floor(model, tokens, monkeypatch):
    _no_floor(monkeypatch)
    result = check_e1(model, _inputs(CHUNKS[1], tokens), _config(model), decode_steps=1)
    assert not result.passed, result.message


def _chunked_run(model, tokens):
    """The two chunks as an engine runs them, on empty caches: (last logits, caches)."""
    engine = Engine(model, _config(model))
    with torch.inference_mode():
        for chunk in CHUNKS:
            out = engine.step([chunk], [list(tokens[chunk.cached_len: chunk.seq_len])], [0])
    return out.logits[-1], engine.cache.tensors()


def _final_window_reference(model, tokens):
    """TensorRT-LLM's rule computed independently in one step: the whole prompt on every row,
    decoder windows masked below end - W = 172 and decoder rings written only from the final
    window's rows (the oracle's bounded reference metadata of the unchunked prompt)."""
    prompt = RequestSpec(PROMPT)
    engine = Engine(model, EngineConfig.for_model(model.args, policy="full"))
    exp = oracle.expect_step([prompt], policy="final_window", graph_mode="eager", window=W,
                             decoder_layers=model.args.n_decoder_layers, max_logit_rows=8)
    assert exp.kept_starts == (172,) and exp.kept_lens == (128,)
    step = engine.prepare([prompt], [list(tokens)], [0])
    meta = oracle.bounded_reference_metadata(step, exp, model.args)
    with torch.inference_mode():
        out = engine.reference_step([prompt], [list(tokens)], [0], layer_metadata=meta)
    return out.logits[-1], engine.cache.tensors()


def _gaps(model, tokens):
    """Each tensor's distance to the reference in units of its rounding envelope (<= 1:
    within it)."""
    got_logits, got_cache = _chunked_run(model, tokens)
    want_logits, want_cache = _final_window_reference(model, tokens)
    pairs = [("logits", got_logits, want_logits)]
    pairs += [(name, got_cache[name], t) for name, t in want_cache.items()]
    dtype = want_logits.dtype
    return {name: envelope_ratio(a, b, envelope_tolerance(b, dtype)) for name, a, b in pairs}


def test_chunks_back_to_back_equal_the_final_window_reference(model, tokens):
    gaps = _gaps(model, tokens)
    assert max(gaps.values()) <= 1.0, {k: v for k, v in gaps.items() if v > 1.0}


def test_without_the_floor_the_last_chunk_reads_unwritten_ring_slots(model, tokens, monkeypatch):
    _no_floor(monkeypatch)
    gaps = _gaps(model, tokens)
    assert gaps["logits"] > 10.0, gaps
