"""Engram against a loop-by-loop restatement of DeepSeek-V4.1's engram.py / model.py ``Engram``:
the released table sizes from the released config, the hash ids of a known token sequence, the
same ids across chunked prefill and decode (the cache's token history), and the gated update."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from swa_bench.engine.engine import Engine
from swa_bench.model.args import PRESETS, build_args
from swa_bench.model.engram import step_hash_ids
from swa_bench.model.forward_context import ForwardContext, set_forward_context
from swa_bench.model.model import build_model
from swa_bench.model.requests import RequestSpec


def naive_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, math.isqrt(n) + 1))


def reference_primes(layers, max_ngram, n_heads, vocab):
    """engram.py ``EngramLayout.from_args``: per (layer, n-gram size), the next n_heads unused
    primes above vocab - 1."""
    seen, out = set(), []
    for _ in layers:
        per = []
        for _ in range(max_ngram - 1):
            cur, heads = vocab - 1, []
            for _ in range(n_heads):
                cur += 1
                while not naive_prime(cur) or cur in seen:
                    cur += 1
                seen.add(cur)
                heads.append(cur)
            per.append(heads)
        out.append(per)
    return out


def reference_hash_ids(tokens, args):
    """Every row's table rows ``[T, layers, cols]`` for one request's whole sequence, one
    position, layer, n-gram size and head at a time."""
    c = args.engram_token_vocab
    ids = [t % c for t in tokens]
    pad = args.engram_pad_id % c
    n_max = args.engram_max_ngram_size
    primes = reference_primes(args.engram_layers, n_max, args.engram_n_heads,
                              args.engram_vocab_size)
    bound = max(1, (np.iinfo(np.int64).max // c) // 2)
    out = []
    for t in range(len(ids)):
        row = []
        for li, layer in enumerate(args.engram_layers):
            mult = np.random.default_rng(10007 * layer).integers(0, bound, size=(n_max,),
                                                                 dtype=np.int64) * 2 + 1
            back = [ids[t - k] if t - k >= 0 else pad for k in range(n_max)]
            flat = [p for per in primes[li] for p in per]
            cols, col = [], 0
            for n in range(2, n_max + 1):
                h = 0
                for k in range(n):
                    h ^= int(back[k]) * int(mult[k])
                for p in primes[li][n - 2]:
                    cols.append(h % p + sum(flat[:col]))
                    col += 1
            row.append(cols)
        out.append(row)
    return torch.tensor(out, dtype=torch.long)


def test_the_released_tables_have_the_released_row_counts():
    # config.json of V4.1-Flash: engram_vocab_size 16000000, 8 heads, n-grams up to 4
    args = PRESETS["v41-flash"].replace(engram_vocab_size=16_000_000)
    assert args.engram_table_rows == [384006168, 384016682]


def test_the_one_gpu_preset_shrinks_rows_not_per_token_work():
    args = PRESETS["v41-flash"]
    assert args.engram_layers == [1, 14] and args.engram_compressed_vocab_size == 99092
    cols = (args.engram_max_ngram_size - 1) * args.engram_n_heads
    assert cols * args.engram_head_dim == 6144 and args.dim * (args.hc_mult + 1) == 25600
    rows = args.engram_table_rows
    assert all(2**20 <= r < 2**20 * 1.02 for r in rows), rows


def step_ids(engine, requests, tokens, indices):
    step = engine.prepare(requests, tokens, indices)
    ctx = ForwardContext(attn_metadata=step.metadata, logits_indices=step.logits_indices,
                         cache=engine.cache, kernels=engine.kernels)
    with torch.inference_mode(), set_forward_context(ctx):
        return step_hash_ids(step.input_ids, engine.args)[: step.num_tokens]


@pytest.mark.parametrize("preset", ["sparse-tiny", "v41-mini"])
def test_hash_ids_of_a_prefill_chunks_and_decode_are_the_reference_s(preset):
    args = build_args(preset, {"max_seq_len": 64})
    model, _ = build_model(args, seed=0)
    seq = [(7 * i * i + 3 * i + 1) % args.vocab_size for i in range(23)]
    want = reference_hash_ids(seq, args)
    one = Engine(model)
    # two requests in one step: rows of one never read the other's history
    other = [(5 * i + 2) % args.vocab_size for i in range(9)]
    got = step_ids(one, [RequestSpec(23), RequestSpec(9)], [seq, other], [3, 5])
    assert torch.equal(got[:23], want)
    assert torch.equal(got[23:], reference_hash_ids(other, args))
    chunked = Engine(model)
    parts = [step_ids(chunked, [RequestSpec(23, cached_len=a, chunk_size=b - a)], [seq[a:b]], [1])
             for a, b in ((0, 2), (2, 13))]
    # decode steps: one row each, its look-back from earlier steps only
    for pos in range(13, 23):
        parts.append(step_ids(chunked, [RequestSpec(pos, decode=True)], [[seq[pos]]], [1]))
    assert torch.equal(torch.cat(parts), want)


def test_padded_rows_write_no_history():
    args = build_args("sparse-tiny", {"max_seq_len": 64})
    engine = Engine(build_model(args, seed=0)[0])
    step = engine.prepare([RequestSpec(5)], [[9, 8, 7, 6, 5]], [2], pad_to=12)
    ctx = ForwardContext(attn_metadata=step.metadata, logits_indices=step.logits_indices,
                         cache=engine.cache, kernels=engine.kernels)
    with torch.inference_mode(), set_forward_context(ctx):
        step_hash_ids(step.input_ids, args)
    history = engine.cache.tensors()["engram_tokens"]
    want = torch.zeros_like(history)
    want[2 * args.max_seq_len : 2 * args.max_seq_len + 5] = torch.tensor([9, 8, 7, 6, 5])
    assert torch.equal(history, want)


def test_the_gate_is_the_reference_formula():
    args = build_args("sparse-tiny", {"max_seq_len": 64})
    model, _ = build_model(args, seed=1)
    engram = model.layers[3].engram
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        engram.q_weight.normal_(generator=g)
        engram.k_weight.normal_(generator=g)
    rows, cols = 5, engram.wkv.in_features // args.engram_head_dim
    streams = tuple(torch.randn(rows, args.dim, generator=g) for _ in range(args.hc_mult))
    hashes = torch.randint(0, engram.embed.num_embeddings, (rows, 2, cols), generator=g)
    with torch.no_grad():
        got = engram(streams, hashes)
        table, wkv = engram.embed.weight.double(), engram.wkv.weight.double()
        d, eps = args.dim, args.norm_eps
        for r in range(rows):
            kv = wkv @ table[hashes[r, engram.index]].flatten()
            value = kv[args.hc_mult * d :]
            for i in range(args.hc_mult):
                h, key = streams[i][r].double(), kv[i * d : (i + 1) * d]
                w = engram.q_weight[i].double() * engram.k_weight[i].double()
                norm = (1 / math.sqrt(float((h * h).mean()) + eps)
                        / math.sqrt(float((key * key).mean()) + eps))
                dot = float((h * w * key).sum()) * norm / math.sqrt(d)
                signed = math.copysign(math.sqrt(max(abs(dot), 1e-6)), dot)
                gate = 1 / (1 + math.exp(-signed))
                torch.testing.assert_close(got[i][r].double(), h + gate * value, rtol=1e-5,
                                           atol=1e-5)
