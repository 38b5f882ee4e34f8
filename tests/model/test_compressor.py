"""The KV sources' compressors against a direct restatement of DeepSeek-V4.1 inference/model.py
``Compressor`` (and the index keys of ``Indexer.forward``), written here loop by loop in float64:
whatever the step structure (a prefill of a length no multiple of the ratio, chunks of odd
length, decode steps), the compressed cache holds each whole group's gated pool, normed and
RoPE'd at the group's first position, and the index keys come from the latent before RoPE."""

from __future__ import annotations

import math

import pytest
import torch

from swa_bench.engine.engine import Engine
from swa_bench.model.args import build_args
from swa_bench.model.model import build_model
from swa_bench.model.requests import RequestSpec

TOL = {"rtol": 1e-5, "atol": 1e-5}
PROMPT, CHUNKS, DECODE = 16, (7, 5, 4), 5  # prefill 7, chunks of 5 and 4, then 5 decode steps
TOTAL = PROMPT + DECODE


def reference_groups(x, compressor, ratio: int) -> torch.Tensor:
    """The reference's latent of every whole group of rows ``x [T, dim]``, in float64: at ratio
    r > 1, group j (positions j r .. j r + r - 1) pools each channel c as
    ``sum_i softmax_i(score[., c]) kv[., c]``; ratio 1 is the projection; then RMSNorm."""
    x = x.double()
    kv = x @ compressor.wkv.weight.double().t()
    pooled = []
    if ratio == 1:
        pooled = list(kv)
    else:
        score = x @ compressor.wgate.weight.double().t()
        for j in range(x.shape[0] // ratio):
            group = range(j * ratio, j * ratio + ratio)
            row = torch.zeros(kv.shape[1], dtype=torch.float64)
            for c in range(kv.shape[1]):
                top = max(float(score[i, c]) for i in group)
                e = {i: math.exp(float(score[i, c]) - top) for i in group}
                row[c] = sum(e[i] / sum(e.values()) * float(kv[i, c]) for i in group)
            pooled.append(row)
    out = []
    for row in pooled:
        rms = math.sqrt(float((row * row).mean()) + compressor.norm.eps)
        out.append(row / rms * compressor.norm.weight.double())
    return torch.stack(out)


def run_steps(model, tokens, chunked: bool, inputs: dict[int, list[torch.Tensor]] | None = None):
    """An engine fed ``tokens`` as one prefill of TOTAL rows, or chunked prefill + decode steps;
    ``inputs`` collects every KV source's compressor input rows, step after step."""
    hooks = []
    if inputs is not None:
        for layer in model.args.kv_sources:
            comp = model.layers[layer].attn.compressor
            hooks.append(comp.register_forward_hook(
                lambda mod, args, out, s=layer: inputs.setdefault(s, []).append(args[0].clone())))
    engine = Engine(model)
    try:
        if not chunked:
            engine.reference_step([RequestSpec(TOTAL)], [tokens], [0])
            return engine
        start = 0
        for n in CHUNKS:
            req = RequestSpec(PROMPT, cached_len=start, chunk_size=n)
            engine.reference_step([req], [tokens[start : start + n]], [0])
            start += n
        for pos in range(PROMPT, TOTAL):
            engine.reference_step([RequestSpec(pos, decode=True)], [[tokens[pos]]], [0])
        return engine
    finally:
        for h in hooks:
            h.remove()


@pytest.fixture(scope="module", params=[2, 3], ids=["ratio2", "ratio3"])
def case(request):
    """A sparse stack (compressed sources 2 and 4 at the ratio, S = 5 at ratio 1), fed chunked
    and whole, with the chunked run's compressor inputs."""
    args = build_args("sparse-tiny", {"compress_ratio": request.param, "max_seq_len": 64,
                                      "max_requests": 2})
    model, _ = build_model(args, seed=1)
    tokens = torch.randint(0, args.vocab_size, (TOTAL,),
                           generator=torch.Generator().manual_seed(4)).tolist()
    inputs: dict[int, list[torch.Tensor]] = {}
    with torch.inference_mode():
        chunked = run_steps(model, tokens, True, inputs)
        whole = run_steps(model, tokens, False)
    assert all(sum(t.shape[0] for t in rows) == TOTAL for rows in inputs.values())
    return model, chunked, whole, {s: torch.cat(rows) for s, rows in inputs.items()}


def test_compressed_kv_is_the_reference_pool_normed_and_roped_at_the_group_start(case):
    model, chunked, _, inputs = case
    for source in model.args.kv_sources:
        attn = model.layers[source].attn
        ratio = attn.compressor.ratio
        want = reference_groups(inputs[source], attn.compressor, ratio).float()
        n = TOTAL // ratio
        got = chunked.cache.compressed_rows(source, 0, n)
        nope = model.args.head_dim - model.args.rope_dim
        torch.testing.assert_close(got[:, :nope], want[:, :nope], **TOL)
        starts = torch.arange(n) * ratio
        torch.testing.assert_close(got, attn.rope(want, starts, model.args.rope_dim), **TOL)
        if ratio > 1:  # the group's first position, not its last
            later = attn.rope(want, starts + ratio - 1, model.args.rope_dim)
            assert not torch.allclose(got[1:], later[1:], **TOL)
        # no group past the last whole one is written
        assert not chunked.cache.compressed_rows(source, 0, n + 1)[n:].any()


def test_index_keys_come_from_the_latent_before_rope(case):
    model, chunked, _, inputs = case
    for source in model.args.kv_sources:
        attn = model.layers[source].attn
        ratio = attn.compressor.ratio
        latent = reference_groups(inputs[source], attn.compressor, ratio).float()
        n = latent.shape[0]
        want = attn.rope(attn.index_norm(attn.wk_index(latent)), torch.arange(n) * ratio,
                         attn.index_rope_dim)
        torch.testing.assert_close(chunked.cache.index_key_rows(source, 0, n), want, **TOL)


def test_chunks_and_decode_steps_leave_the_caches_of_one_prefill(case):
    """The incomplete group waits across steps: every cache after a prefill of 7 rows, chunks
    of 5 and 4 and 5 decode steps equals the one prefill's (the state's ring too)."""
    _, chunked, whole, _ = case
    theirs = whole.cache.tensors()
    for name, t in chunked.cache.tensors().items():
        torch.testing.assert_close(t, theirs[name], **TOL, msg=name)


def test_ratio_one_is_a_projection_apart_from_the_window_latent(case):
    model, chunked, _, inputs = case
    s = model.args.last_kv_source
    attn = model.layers[s].attn
    assert attn.compressor.ratio == 1 and not hasattr(attn.compressor, "wgate")
    x = inputs[s]
    positions = torch.arange(TOTAL)
    want = attn.rope(reference_groups(x, attn.compressor, 1).float(), positions,
                     model.args.rope_dim)
    got = chunked.cache.compressed_rows(s, 0, TOTAL)
    torch.testing.assert_close(got, want, **TOL)
    window = attn.rope(attn.kv_norm(attn.wkv(x)), positions, model.args.rope_dim)
    w = model.args.window
    ring = chunked.cache.ring_window(s, 0)
    last = positions[-w:]
    torch.testing.assert_close(ring[last % w], window[last], **TOL)  # the window's own latent
    assert not torch.allclose(got[last], window[last], atol=1e-2)
