"""E1, E2, E5 and the replay batch's gather/scatter on the mixed batch of issue 3 (tiny, fp32)."""

import dataclasses

import pytest
import torch

from swa_bench.checks.approximation import approximation
from swa_bench.checks.comparison import Tolerance, compare
from swa_bench.checks.equivalence import check_e1, check_e2, check_e4, check_e5
from swa_bench.checks.oracle import bounded_reference_metadata, expect_for
from swa_bench.engine.config import EngineConfig
from swa_bench.engine.engine import Engine, run_forward
from swa_bench.engine.step_inputs import StepInputs
from swa_bench.kernels import TORCH_KERNELS, KernelSettings
from swa_bench.model.forward_context import ForwardContext, get_forward_context
from swa_bench.model.requests import RequestSpec
from swa_bench.replay.replay_batch import ReplayBatch, build_replay_batch

TOL = Tolerance.for_dtype(torch.float32)


def forward(model, step, cache, replay_batch=None):
    """One eager forward of ``step`` on ``cache`` and the PyTorch kernels, on ``replay_batch``
    when given."""
    ctx = ForwardContext(
        attn_metadata=step.metadata,
        logits_indices=step.logits_indices,
        cache=cache,
        kernels=TORCH_KERNELS,
        replay_batch=replay_batch,
    )
    return run_forward(model, step, ctx)


def mixed_requests(w: int) -> list[RequestSpec]:
    """A decode row, a prefill trimmed to its last W, prefills of W - 1, W and W + 1, a chunked
    prefill with cached context, and a prefix-cache hit (replay_start = H - W)."""
    return [
        RequestSpec(prompt_len=12, decode=True),
        RequestSpec(prompt_len=7 * w),
        RequestSpec(prompt_len=w - 1),
        RequestSpec(prompt_len=w),
        RequestSpec(prompt_len=w + 1),
        RequestSpec(prompt_len=6 * w, cached_len=2 * w, chunk_size=3 * w),
        RequestSpec(prompt_len=5 * w, cached_len=2 * w + 3),
    ]


@pytest.fixture
def workload(tiny_args):
    return StepInputs.seeded(mixed_requests(tiny_args.window), tiny_args.vocab_size, seed=11)


def test_e1_replay_equals_bounded_reference(tiny_model, workload):
    w = tiny_model.args.window
    expected = expect_for(Engine(tiny_model), workload.requests)
    assert expected.replays and expected.trims, expected.reason
    result = check_e1(tiny_model, workload, EngineConfig.for_model(tiny_model.args),
                      decode_steps=2 * w, tol=TOL)
    assert result.passed, result.message


def test_e2_halo_equals_full_prefill_while_bounded_differs(tiny_model, workload):
    halo = EngineConfig.for_model(tiny_model.args, policy="halo")
    expected = expect_for(Engine(tiny_model, halo), workload.requests)
    assert expected.replays and expected.trims, expected.reason
    result = check_e2(tiny_model, workload, halo, tol=TOL)
    assert result.passed, result.message
    metrics = approximation(tiny_model, workload, continuation_steps=tiny_model.args.window,
                            kernels=KernelSettings())
    assert metrics.logits_max_abs > 1e-3, "bounded replay must visibly differ from full prefill"
    assert max(metrics.window_kv_rel_error) > 1e-3
    assert len(metrics.window_kv_rel_error) == tiny_model.args.n_decoder_layers


def test_e5_nothing_to_trim_is_bitwise_reference(tiny_model, workload):
    result = check_e5(tiny_model, workload, EngineConfig.for_model(tiny_model.args))
    assert result.passed, result.message


def test_short_prefills_take_the_whole_batch_route(tiny_model, tiny_args):
    w = tiny_args.window
    requests = [RequestSpec(prompt_len=w), RequestSpec(prompt_len=w - 1)]
    load = StepInputs.seeded(requests, tiny_args.vocab_size, seed=1)
    out = Engine(tiny_model).step(load.requests, load.step_tokens)
    ref = Engine(tiny_model).reference_step(load.requests, load.step_tokens)
    assert out.replay_batch is None
    assert compare("logits", out.logits, ref.logits, None) is None


def test_vllm_mixed_batch_gather_and_scatter(tiny_model, tiny_args, monkeypatch):
    """One decode row, a prefill trimmed to its last W, a prefill of W - 2 kept whole: the replay
    batch's inputs are the batch rows at the kept indices, trimmed rows' outputs are zero."""
    w = tiny_args.window
    requests = [
        RequestSpec(prompt_len=9, decode=True),
        RequestSpec(prompt_len=4 * w),
        RequestSpec(prompt_len=w - 2),
    ]
    load = StepInputs.seeded(requests, tiny_args.vocab_size, seed=5)
    engine = Engine(tiny_model)
    load.fill_context(engine)
    step = engine.prepare(load.requests, load.step_tokens)
    replay_batch = build_replay_batch(step, engine.policy_kept_lens(step.requests), tiny_args,
                                      engine.cache, TORCH_KERNELS)
    expected_rows = [0, *range(1 + 4 * w - w, 1 + 4 * w), *range(1 + 4 * w, 1 + 4 * w + w - 2)]
    assert replay_batch.rows.tolist() == expected_rows

    seen, captured = {}, {}
    real_run = ReplayBatch.run

    def run(self, run_layers, batch_kv, *inputs, out=None):
        captured["inputs"] = inputs

        def spy(kv, *gathered):
            seen["kv"], seen["inputs"] = kv, gathered
            seen["context"] = get_forward_context()
            seen["outputs"] = run_layers(kv, *gathered)
            return seen["outputs"]

        return real_run(self, spy, batch_kv, *inputs, out=out)

    monkeypatch.setattr(ReplayBatch, "run", run)
    _, streams, pre_mix, _ = forward(tiny_model, step, engine.cache, replay_batch)
    assert seen["context"] is replay_batch.forward_context, "kept rows run under their context"
    rows = replay_batch.rows
    # the per-row inputs: the streams entering S and S's attention pre-mix, fp32 [T, hc]
    assert captured["inputs"][-1].shape == (step.num_tokens, tiny_args.hc_mult)
    assert captured["inputs"][-1].dtype == torch.float32
    for batch_input, gathered in zip(captured["inputs"], seen["inputs"], strict=True):
        assert torch.equal(batch_input.index_select(0, rows), gathered)
    assert seen["kv"].shape[0] == step.num_tokens, "layer S reads every row's batch KV"
    trimmed = sorted(set(range(step.num_tokens)) - set(expected_rows))
    for stream, out in zip((*streams, pre_mix), seen["outputs"], strict=True):
        assert torch.equal(stream[trimmed], torch.zeros_like(stream[trimmed]))
        assert torch.equal(stream.index_select(0, rows), out)


def test_e1_fails_if_layer_s_used_kept_starts(tiny_model, workload):
    """The first replay layer reads the batch KV with batch starts: with kept starts E1 fails."""
    s = tiny_model.args.last_kv_source
    engine = Engine(tiny_model)
    workload.fill_context(engine)
    reference = Engine(tiny_model)
    reference.cache.copy_from(engine.cache)
    step = engine.prepare(workload.requests, workload.step_tokens)
    replay_batch = build_replay_batch(step, engine.policy_kept_lens(step.requests),
                                      tiny_model.args, engine.cache, TORCH_KERNELS)
    first = replay_batch.forward_context.layer_metadata[s]
    kept = replay_batch.forward_context.attn_metadata
    wrong = dataclasses.replace(
        first,
        window_start=kept.window_start,
        layouts=tuple(
            dataclasses.replace(lay, window_start=k.window_start)
            for lay, k in zip(first.layouts, kept.layouts, strict=True)
        ),
    )
    replay_batch.forward_context.layer_metadata[s] = wrong
    logits, *_ = forward(tiny_model, step, engine.cache, replay_batch)
    unpadded = reference.prepare(workload.requests, workload.step_tokens)
    bounded = bounded_reference_metadata(unpadded, expect_for(reference, workload.requests),
                                         tiny_model.args)
    ref = reference.reference_step(workload.requests, workload.step_tokens,
                                   layer_metadata=bounded)
    assert compare("logits", logits, ref.logits, TOL) is not None


def test_trimmed_rows_write_no_ring_slot(tiny_model, workload, tiny_args):
    """Under replay only kept rows write ring slots: rings hold the reference's values at the
    last W positions and trash stays the only target of everything else."""
    w = tiny_args.window
    engine = Engine(tiny_model)
    workload.fill_context(engine)
    step = engine.prepare(workload.requests, workload.step_tokens)
    replay_batch = build_replay_batch(step, engine.policy_kept_lens(step.requests), tiny_args,
                                      engine.cache, TORCH_KERNELS)
    trash = tiny_args.max_requests * w
    first = replay_batch.forward_context.layer_metadata[tiny_args.last_kv_source]
    kept = set(expect_for(engine, step.requests).rows)
    assert 0 < len(kept) < len(first.ring_slot), "the workload trims"
    for row, slot in enumerate(first.ring_slot.tolist()):
        if row not in kept:
            assert slot == trash, f"trimmed batch row {row} writes ring slot {slot}"
    decoder_meta = replay_batch.forward_context.attn_metadata
    assert decoder_meta.ring_slot.shape[0] == replay_batch.num_rows
    for lay in decoder_meta.layouts:
        slots = decoder_meta.ring_slot[lay.kv_start : lay.kv_start + lay.kv_len].tolist()
        written = [s for s in slots if s != trash]
        assert len(written) == min(lay.kv_len, w) == len(set(written))


def test_e1_holds_when_attention_runs_in_many_query_chunks(tiny_model, workload, monkeypatch):
    """Long prompts on a GPU run attention in query chunks; force tiny chunks here so the chunked
    path (and its ring reads at chunk edges) is what the checks compare. E1 and E2 hold the
    engine to an oracle that runs the same chunked attention, so E4's token-by-token decode (one
    query row: never chunked) is the oracle that can see a chunk-edge bug."""
    from swa_bench.model import attention

    monkeypatch.setattr(attention, "score_budget", lambda device: 512)
    args = tiny_model.args
    assert attention.varlen_chunk_rows(7 * args.window, 7 * args.window, args.n_heads,
                                       args.window, torch.device("cpu")) < args.window
    result = check_e1(tiny_model, workload, EngineConfig.for_model(tiny_model.args),
                      decode_steps=2, tol=TOL)
    assert result.passed, result.message
    e2 = check_e2(tiny_model, workload, EngineConfig.for_model(tiny_model.args, policy="halo"),
                  tol=TOL)
    assert e2.passed, e2.message
    e4 = check_e4(tiny_model, workload, tol=TOL, kernels=KernelSettings())
    assert e4.passed, e4.message


def test_a_request_keeping_no_row_writes_no_decoder_ring(tiny_model):
    """final_window: a chunk that does not end its prompt has q_len 0 on the replay batch; its
    decoder rings stay untouched while the layers up to S write theirs."""
    args = tiny_model.args
    requests = [RequestSpec(prompt_len=100, chunk_size=40), RequestSpec(prompt_len=30)]
    load = StepInputs.seeded(requests, args.vocab_size, 9)
    engine = Engine(tiny_model, EngineConfig.for_model(tiny_model.args, policy="final_window"))
    out = engine.step(load.requests, load.step_tokens)
    assert out.replay_batch.kept_lens == (0, args.window)
    assert [lay.q_len for lay in out.replay_batch.forward_context.attn_metadata.layouts] == [0, 8]
    for layer in range(args.n_layers):
        written = engine.cache.ring_window(layer, 0).abs().sum() > 0
        assert written == (layer <= args.last_kv_source), f"ring of layer {layer}"
