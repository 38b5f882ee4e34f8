"""Sparse global attention as the real V4.1 runs it: an indexer picks each row's top-k global
positions and attention reads only those plus the row's window, gathered.

The indexer follows the public V4.1 modeling code (SGLang's torch path,
``sglang/srt/layers/attention/dsv4`` ``DeepseekV41Indexer``; vLLM's ``deepseek_v41`` indexer
parameters): only KV-source layers own index keys, ``k = rope(k_norm(wk(latent)))`` of the
source's pre-RoPE latent; an index source's queries are ``rope(wq_b(q_lora))`` in ``index_n_heads``
heads, its head weights ``weights_proj(x) * index_head_dim**-0.5 * index_n_heads**-0.5``, and a
position's score is ``sum_h w_h relu(q_h . k)``. The index source publishes its top-k and the
layers up to the next index source attend to the same selection. Compressed layers score the
pooled positions (here the pooled per-position keys; the real model derives them from its
compressor's pooled latent: same shapes and cost).

Cost: attention is O(T x (k + W)) in time and memory (rows are chunked so the gathered keys stay
a few hundred MiB); the indexer's scoring is O(T^2) as in the real model, chunked by rows and
causal per chunk (keys up to the chunk's last position), so its memory stays bounded too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swa_bench.kernels import index_scores_fused, mqa_attention
from swa_bench.model.attention import (
    GlobalKV,
    pooled,
    score_budget,
    softmax_with_sink,
    static_pooled,
    step_global_keys,
    window_index,
)
from swa_bench.model.batch import AttentionMetadata
from swa_bench.model.cache import KVCache
from swa_bench.model.forward_context import active_kernels


@dataclass(frozen=True)
class IndexQuery:
    """An index source's view of its query rows."""

    q: torch.Tensor  # [rows, index heads, index dim], RoPE applied
    weights: torch.Tensor  # [rows, index heads], scaled
    source: int  # the KV source whose index keys it scores
    top_k: int


def gather_budget(device: torch.device) -> int:
    """Bytes of gathered keys per row chunk: 512 MiB on a GPU, 64 MiB on CPU."""
    return 1 << 29 if device.type == "cuda" else 1 << 26


def gathered_attention(
    q: torch.Tensor,
    sources: list[tuple[torch.Tensor, torch.Tensor]],
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One softmax (a per-head sink in the denominator) over the keys each row gathers.

    ``q [T, H, D]``; each source is ``(kv [N, D], idx [T, K])``, ``idx`` long with -1 for a masked
    column. K = V (MQA latent). The signature is a kernel's: a Triton kernel can replace this on
    CUDA. Rows are chunked so the gathered keys stay within ``gather_budget``.
    """
    t, heads, d = q.shape
    width = sum(idx.shape[1] for _, idx in sources)
    per_row = width * d * q.element_size() + heads * width * 4
    chunk = max(1, min(t, gather_budget(q.device) // max(per_row, 1)))
    outs = []
    for r0 in range(0, t, chunk):
        qc = q[r0 : r0 + chunk]
        parts, values = [], []
        for kv, idx in sources:
            ic = idx[r0 : r0 + chunk]
            k = kv[ic.clamp(min=0)]
            s = torch.bmm(qc, k.transpose(1, 2)).float().mul_(scale)
            parts.append(s.masked_fill_((ic < 0)[:, None, :], float("-inf")))
            values.append(k)
        probs = softmax_with_sink(parts, sink)
        o = torch.bmm(probs[0].to(q.dtype), values[0])
        for p, v in zip(probs[1:], values[1:], strict=True):
            o = o + torch.bmm(p.to(q.dtype), v)
        outs.append(o)
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``sum_h weights[c, h] * relu(q[c, h] . keys[(c,) n])`` as fp32 ``[C, n]``; keys ``[n, d]``
    shared by the rows or ``[C, n, d]`` per row. In the model dtype up to the head reduction, as
    the public reference does."""
    pattern = "chd,nd->chn" if keys.dim() == 2 else "chd,cnd->chn"
    s = torch.einsum(pattern, q, keys).relu_()
    return torch.bmm(weights.to(s.dtype)[:, None, :], s).squeeze(1).float()


def ranking_keys(scores: torch.Tensor) -> torch.Tensor:
    """``int64 [C, n]`` keys whose descending order is a stable descending sort of the fp32
    ``scores``: the score's bits made order-preserving in the high word, ``n - 1 - j`` in the
    low word, so equal scores (ReLU makes many exactly 0; -0 counts as +0) rank by position
    and no two keys tie."""
    bits = (scores.float() + 0.0).view(torch.int32)
    ordered = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).long()
    n = scores.shape[1]
    return (ordered << 32) + (n - 1 - torch.arange(n, device=scores.device))


def select_top_k(scores: torch.Tensor, visible: torch.Tensor, top_k: int) -> torch.Tensor:
    """Each row's ``top_k`` visible positions (-1 pads a row with fewer): ``[C, top_k]`` long,
    best first.

    Ties (ReLU makes many scores exactly 0) break by position, so every path and every batch
    shape picks the same positions: ``topk`` on unique ``ranking_keys`` returns exactly what a
    stable descending sort's first ``top_k`` would, with a selection instead of a full sort.
    """
    scores = scores.float().masked_fill(~visible, float("-inf"))
    if scores.shape[1] < top_k:
        scores = torch.cat([scores, scores.new_full((scores.shape[0], top_k - scores.shape[1]),
                                                    float("-inf"))], dim=1)
    chosen = torch.topk(ranking_keys(scores), top_k, dim=-1, sorted=True).indices
    return torch.where(scores.gather(1, chosen) > float("-inf"), chosen, -1)


FUSED_SCORE_ELEMENTS = 8  # fp32-sized elements per score on the fused path (scores, top-k keys)


def index_chunk_rows(n_keys: int, index_heads: int, device: torch.device,
                     fused: bool = False) -> int:
    """Rows per indexer chunk, so that the scores stay within the budget: the PyTorch path's
    per-head ``[rows, heads, n_keys]``, or the fused kernel's ``[rows, n_keys]`` with the
    top-k's packed keys and masks beside them."""
    per_score = FUSED_SCORE_ELEMENTS if fused else index_heads
    return max(1, score_budget(torch.device(device)) // (per_score * max(n_keys, 1)))


def visible_positions(qpos: torch.Tensor, n: int, ratio: int) -> torch.Tensor:
    """``[C, n]``: global position j is visible at query position t (pooled: ``j < (t+1)//r``)."""
    j = torch.arange(n, device=qpos.device)
    if ratio == 1:
        return j[None, :] <= qpos[:, None]
    return j[None, :] < ((qpos + 1) // ratio)[:, None]


def select_varlen(
    meta: AttentionMetadata, cache: KVCache, index: IndexQuery, ratio: int
) -> torch.Tensor:
    """The index source's selection ``[rows, top_k]`` (request-relative positions), request by
    request with host integers, chunked by rows, keys cut at each chunk's last position. The
    scores come from the fused kernel where the forward context's ``Kernels`` are Triton's."""
    out = torch.full((meta.num_rows, index.top_k), -1, dtype=torch.long, device=index.q.device)
    fused = active_kernels().triton
    for lay in meta.layouts:
        if lay.q_len == 0:
            continue
        keys = pooled(cache.index_key_rows(index.source, lay.cache_index, lay.seq_len), ratio)
        chunk = index_chunk_rows(keys.shape[0], index.q.shape[1], index.q.device, fused)
        for c0 in range(0, lay.q_len, chunk):
            c1 = min(lay.q_len, c0 + chunk)
            rows = slice(lay.q_start + c0, lay.q_start + c1)
            first = lay.q_first_pos + c0
            qpos = torch.arange(first, lay.q_first_pos + c1, device=out.device)
            last = lay.q_first_pos + c1  # one past the chunk's last position
            n = min(keys.shape[0], last if ratio == 1 else last // ratio)
            if fused:
                scores = index_scores_fused(active_kernels(), index.q[rows],
                                            index.weights[rows], keys[:n], first, ratio)
            else:
                scores = index_scores(index.q[rows], index.weights[rows], keys[:n])
            out[rows] = select_top_k(scores, visible_positions(qpos, n, ratio), index.top_k)
    return out


def _all_rows(q, kv, meta, cache, layer, global_kv, sink, selection, static):
    """Every row of the step at once (one launch on Triton): its window and its selected global
    keys, gathered from the source's flat keys (``step_global_keys``)."""
    ring = cache.ring[layer]
    keys = torch.cat([ring, kv])
    win = window_index(meta, ring.shape[0], cache.args.window)
    glob, base = step_global_keys(meta, cache, global_kv, static)
    sources = [(keys, win), (glob, torch.where(selection >= 0, base[:, None] + selection, -1))]
    scale = q.shape[-1] ** -0.5
    if active_kernels().triton:
        out = mqa_attention(active_kernels(), q, sink, scale, sources)
    else:
        out = gathered_attention(q, sources, sink, scale)
    ring.index_copy_(0, meta.ring_slot, kv)
    return out


def sparse_varlen_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    meta: AttentionMetadata,
    cache: KVCache,
    layer: int,
    global_kv: GlobalKV,
    sink: torch.Tensor,
    selection: torch.Tensor,
) -> torch.Tensor:
    """The eager path: each row's window and its selected global positions, gathered (per
    request on the PyTorch path, one launch on Triton's)."""
    if active_kernels().triton:
        return _all_rows(q, kv, meta, cache, layer, global_kv, sink, selection, static=False)
    window = cache.args.window
    ring = cache.ring[layer]
    keys = torch.cat([ring, kv])
    win = window_index(meta, ring.shape[0], window)
    scale = q.shape[-1] ** -0.5
    out = torch.zeros_like(q)
    for lay in meta.layouts:
        if lay.q_len == 0:
            continue
        latent = cache.latent_rows(global_kv.source, lay.cache_index, lay.seq_len)
        glob = pooled(latent, global_kv.ratio)
        rows = slice(lay.q_start, lay.q_start + lay.q_len)
        sources = [(keys, win[rows])]
        if glob.shape[0] > 0:
            sources.append((glob, selection[rows]))
        out[rows] = gathered_attention(q[rows], sources, sink, scale)
    ring.index_copy_(0, meta.ring_slot, kv)
    return out


STATIC_ROW_CHUNK = 64


def select_static(
    meta: AttentionMetadata, cache: KVCache, index: IndexQuery, ratio: int
) -> torch.Tensor:
    """``select_varlen`` from device metadata alone (every request slot's whole cache)."""
    args = cache.args
    keys = static_pooled(cache.index_keys[index.source], args, ratio)
    req = meta.row_request
    visible = visible_positions(meta.positions, keys.shape[1], ratio)
    visible = visible & (torch.arange(keys.shape[1], device=keys.device)[None, :] * ratio
                         < meta.seq_len[req][:, None])
    outs = []
    for r0 in range(0, meta.num_rows, STATIC_ROW_CHUNK):
        rows = slice(r0, r0 + STATIC_ROW_CHUNK)
        per_row = keys[meta.cache_index[req[rows]]]
        scores = index_scores(index.q[rows], index.weights[rows], per_row)
        outs.append(select_top_k(scores, visible[rows], index.top_k))
    return torch.cat(outs)


def sparse_static_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    meta: AttentionMetadata,
    cache: KVCache,
    layer: int,
    global_kv: GlobalKV,
    sink: torch.Tensor,
    selection: torch.Tensor,
) -> torch.Tensor:
    """The capturable path: no host reads, static shapes; positions map to flat pooled rows."""
    return _all_rows(q, kv, meta, cache, layer, global_kv, sink, selection, static=True)
