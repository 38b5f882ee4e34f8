"""E4: the reference path against independent oracles (tiny preset, fp32)."""

import pytest
import torch

from swa_bench.engine.engine import Engine
from swa_bench.engine.step_inputs import StepInputs
from swa_bench.model.requests import RequestSpec

TOL = dict(rtol=1.3e-6 * 10, atol=1e-5)


def prefill_logits(model, length: int, seq) -> tuple[torch.Tensor, Engine]:
    engine = Engine(model)
    out = engine.reference_step(
        [RequestSpec(prompt_len=length, prompt_logprobs=True)], [seq[:length]], [0]
    )
    return out.logits, engine


def decode_one_by_one(model, length: int, seq) -> tuple[torch.Tensor, Engine]:
    engine = Engine(model)
    rows = []
    for pos in range(length):
        req = RequestSpec(prompt_len=pos, decode=True) if pos else RequestSpec(prompt_len=1)
        rows.append(engine.reference_step([req], [[seq[pos]]], [0]).logits)
    return torch.cat(rows), engine


@pytest.mark.parametrize("length", [5, 8, 21])
def test_prefill_equals_token_by_token_decode(tiny_model, length):
    seq = StepInputs.seeded([RequestSpec(prompt_len=length)], tiny_model.args.vocab_size, length)
    seq = list(seq.sequences[0])
    logits, prefill = prefill_logits(tiny_model, length, seq)
    oracle, decode = decode_one_by_one(tiny_model, length, seq)
    torch.testing.assert_close(logits, oracle, **TOL)
    for name, tensor in prefill.cache.tensors().items():
        torch.testing.assert_close(tensor, decode.cache.tensors()[name], **TOL, msg=name)


@pytest.mark.parametrize("chunk", [3, 8, 13])
def test_chunked_prefill_equals_one_prefill(tiny_model, chunk):
    length = 30
    seq = StepInputs.seeded([RequestSpec(prompt_len=length)], tiny_model.args.vocab_size, 7)
    seq = list(seq.sequences[0])
    whole, whole_engine = prefill_logits(tiny_model, length, seq)
    engine = Engine(tiny_model)
    rows = []
    for start in range(0, length, chunk):
        req = RequestSpec(
            prompt_len=length, cached_len=start, chunk_size=chunk, prompt_logprobs=True
        )
        rows.append(engine.reference_step([req], [seq[start : start + req.query_len]], [0]).logits)
    torch.testing.assert_close(torch.cat(rows), whole, **TOL)
    for name, tensor in whole_engine.cache.tensors().items():
        torch.testing.assert_close(engine.cache.tensors()[name], tensor, **TOL, msg=name)


def test_mixed_batch_equals_each_request_alone(tiny_model):
    requests = [
        RequestSpec(prompt_len=12, decode=True),
        RequestSpec(prompt_len=27),
        RequestSpec(prompt_len=7),
        RequestSpec(prompt_len=40, cached_len=16, chunk_size=10),
        RequestSpec(prompt_len=30, cached_len=20),
    ]
    load = StepInputs.seeded(requests, tiny_model.args.vocab_size, 3)
    batch = Engine(tiny_model)
    load.fill_context(batch)
    mixed = batch.reference_step(requests, load.step_tokens)
    for i, req in enumerate(requests):
        one = StepInputs((req,), (load.sequences[i],))
        alone = Engine(tiny_model)
        one.fill_context(alone)
        out = alone.reference_step([req], one.step_tokens, [0])
        torch.testing.assert_close(mixed.logits[i : i + 1], out.logits, **TOL)
        for layer in range(tiny_model.args.n_layers):
            torch.testing.assert_close(
                batch.cache.ring_window(layer, i), alone.cache.ring_window(layer, 0), **TOL
            )
