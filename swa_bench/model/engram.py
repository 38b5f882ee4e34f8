"""Engram: an n-gram hash lookup written into the residual streams before a few layers' blocks.

After DeepSeek-V4.1 inference/engram.py (``EngramLayout``, ``NgramHashState``) and model.py
(``ParallelEngramEmbedding``, ``Engram``, the hook in ``Transformer.forward``):

* every row hashes the n-grams (sizes 2 .. ``engram_max_ngram_size``) ending at it, each in
  ``engram_n_heads`` ways (``ngram_hash``); look-back stops at the request's start (pad id);
* the ``(max_ngram - 1) * n_heads`` rows fetched go through ``wkv`` to one key per stream and one
  value; each stream gets ``h + gate * value``, gate the sigmoid of the signed square root of the
  normalised dot product of the stream with its key.

The n-grams of a row need the request's previous ``max_ngram - 1`` tokens, across chunks and
decode steps: the cache keeps every request's compressed ids by position (``engram_tokens``,
written through the rows' global slots: padded rows write nothing). Tables are in the model
dtype; under precision fp8 they hold the reference's fp8 values (``model.precision``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from swa_bench.model.forward_context import get_forward_context
from swa_bench.model.ngram_hash import EngramLayout, hash_layout, ngram_hash_ids
from swa_bench.model.precision import fp8_linear, linear_input

if TYPE_CHECKING:
    from swa_bench.model.args import ModelArgs
    from swa_bench.model.hyper_connection import Streams

ENGRAM_ROWS = 8192  # rows per chunk: the fp32 keys are hc_mult times a stream (5 GiB at 64K)
GATE_CLAMP = 1e-6  # the reference's ``clamp_value`` under the signed square root


def engram_layout(args: ModelArgs, device: torch.device) -> EngramLayout:
    return hash_layout(tuple(args.engram_layers), args.engram_max_ngram_size,
                       args.engram_n_heads, args.engram_vocab_size, args.engram_token_vocab,
                       args.engram_pad_id, torch.device(device))


def compress_ids(token_ids: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """The ids the hashes read. The reference maps through the tokenizer's normalising table;
    swa-bench has no tokenizer and folds ids onto the compressed vocabulary by ``%``."""
    return token_ids % args.engram_token_vocab


def step_hash_ids(input_ids: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """The step's table rows ``[rows, layers, cols]``: its compressed ids are written to the
    cache's token history first (global slots: padded rows write the trash row), then each row
    reads its look-backs from its request's history (static shapes: capturable)."""
    ctx = get_forward_context()
    meta, history = ctx.attn_metadata, ctx.cache.engram_tokens
    layout = engram_layout(args, input_ids.device)
    ids = compress_ids(input_ids, args)
    history.index_copy_(0, meta.global_slot, ids)
    base = meta.cache_index.index_select(0, meta.row_request) * args.max_seq_len
    cols = [ids]
    for shift in range(1, layout.max_ngram):
        back = meta.positions - shift
        past = history.index_select(0, base + back.clamp_min(0))
        cols.append(torch.where(back < 0, layout.pad_id, past))
    return ngram_hash_ids(torch.stack(cols, dim=-1), layout)


def engram_input(engram: Engram | None, streams: Streams, hashes: torch.Tensor | None
                 ) -> Streams:
    """A block's input streams: with its Engram's lookup added when it has one."""
    return streams if engram is None else engram(streams, hashes)


class Engram(nn.Module):
    """One layer's table and gate (reference ``Engram``; ``embed`` is its
    ``ParallelEngramEmbedding``, here unsharded in the model dtype)."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.args = args
        self.index = args.engram_layers.index(layer)
        self.hc, self.dim, self.eps = args.hc_mult, args.dim, args.norm_eps
        cols = (args.engram_max_ngram_size - 1) * args.engram_n_heads
        self.embed = nn.Embedding(args.engram_table_rows[self.index], args.engram_head_dim)
        self.wkv = nn.Linear(cols * args.engram_head_dim, args.dim * (args.hc_mult + 1),
                             bias=False)
        self.q_weight = nn.Parameter(torch.ones(args.hc_mult, args.dim))
        self.k_weight = nn.Parameter(torch.ones(args.hc_mult, args.dim))

    def forward(self, streams: Streams, hash_ids: torch.Tensor) -> Streams:
        """``streams`` with the lookup added; ``hash_ids [rows, layers, cols]`` (this layer's
        column of ``step_hash_ids``), by row chunks."""
        ids = hash_ids[:, self.index]
        rows = ids.shape[0]
        if rows <= ENGRAM_ROWS:
            return self.lookup(streams, ids)
        parts = [self.lookup(tuple(s[r : r + ENGRAM_ROWS] for s in streams),
                             ids[r : r + ENGRAM_ROWS]) for r in range(0, rows, ENGRAM_ROWS)]
        return tuple(torch.cat(chunk) for chunk in zip(*parts, strict=True))

    def lookup(self, streams: Streams, ids: torch.Tensor) -> Streams:
        kv = fp8_linear(self.args, self.wkv, linear_input(self.args, self.embed(ids).flatten(1)))
        value = kv[:, self.hc * self.dim :].float()
        weight = self.q_weight.float() * self.k_weight.float()  # only ever used as a product
        out = []
        for i, s in enumerate(streams):
            h = s.float()
            key = kv[:, i * self.dim : (i + 1) * self.dim].float()
            # normalised per (row, stream) over dim, not jointly over the streams
            rstd = (torch.rsqrt(h.square().mean(-1) + self.eps)
                    * torch.rsqrt(key.square().mean(-1) + self.eps))
            dot = (h * weight[i] * key).sum(-1) * rstd * self.dim**-0.5
            gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(GATE_CLAMP).sqrt(), dot))
            out.append((h + gate[:, None] * value).to(s.dtype))
        return tuple(out)
