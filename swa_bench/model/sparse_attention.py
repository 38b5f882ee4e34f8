"""The sparse layers' selection as the real V4.1 makes it: an indexer picks each row's top-k
global positions, and attention (``attention.attend``) reads only those plus the row's window.

The indexer follows the public V4.1 modeling code (SGLang's torch path,
``sglang/srt/layers/attention/dsv4`` ``DeepseekV41Indexer``; vLLM's ``deepseek_v41`` indexer
parameters; DeepSeek-V4.1 inference/model.py ``Indexer``): only KV-source layers own index
keys, ``k = rope(k_norm(wk(latent)))`` of the source's compressor latent before RoPE, one per
group, RoPE'd at the group's first position (``model.compressor``); an index source's queries
are ``rope(wq_b(q_lora))`` in ``index_n_heads`` heads, its head weights
``weights_proj(x) * index_head_dim**-0.5 * index_n_heads**-0.5``, and a position's score is
``sum_h w_h relu(q_h . k)``. The index source publishes its top-k and the layers up to the next
index source attend to the same selection. Compressed layers score their source's per-group keys
as the cache holds them, visible by ``key_sources``' rule.

Two-level candidates (DeepSeek-V4.1 inference/model.py ``Indexer.forward`` and
``select_candidate_blocks``): the candidate source S also publishes each row's candidate blocks,
its ``top_blocks`` best blocks of ``block_size`` positions (a block scores its best visible
position, the block of the row's newest visible position is pinned, unreachable blocks are
dropped), as a compact ``[rows, width]`` int32 list of block ids (-1 unused). The index sources
after S score with their own query but pick their top-k among those blocks' positions only.

Cost: the indexer's scoring is O(T^2) as in the real model, chunked by rows and causal per chunk
(keys up to the chunk's last position), so its memory stays bounded; attention over the
selection is O(T x (k + W)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swa_bench.kernels import index_scores_fused
from swa_bench.model.attention import score_budget
from swa_bench.model.batch import AttentionMetadata
from swa_bench.model.cache import KVCache
from swa_bench.model.forward_context import ShapeMode, active_kernels
from swa_bench.model.key_sources import (
    slot_view,
    visible_counts,
    visible_global_keys,
    visible_mask,
)

# Rows per indexer chunk at static shapes: each row scores every request slot's keys.
STATIC_ROW_CHUNK = 64


@dataclass(frozen=True)
class CandidateBlocks:
    """Level one of the two-level top-k: ``top_blocks`` blocks of ``block_size`` positions,
    listed in ``width`` columns (``ModelArgs.candidate_width``)."""

    top_blocks: int
    block_size: int
    width: int


@dataclass(frozen=True)
class IndexQuery:
    """An index source's view of its query rows."""

    q: torch.Tensor  # [rows, index heads, index dim], RoPE applied
    weights: torch.Tensor  # [rows, index heads], scaled
    source: int  # the KV source whose index keys it scores
    top_k: int
    # The candidate source: the blocks it publishes beside its top-k (None elsewhere).
    publishes: CandidateBlocks | None = None
    # An index source after it: the rows' candidate block ids [rows, width] (-1 unused) and
    # their block size; its top-k is taken among those blocks' positions only.
    within: torch.Tensor | None = None
    block_size: int = 1


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


def candidate_blocks(scores: torch.Tensor, counts: torch.Tensor,
                     rule: CandidateBlocks) -> torch.Tensor:
    """Each row's candidate blocks ``[C, rule.width]`` int32, best first, -1 unused: blocks
    scored by their best position of ``scores`` (fp32 ``[C, n]``, -inf where not visible), the
    block of the row's newest visible position (``counts - 1``) pinned at +inf, the top
    ``top_blocks`` by ``ranking_keys`` (ties by block id, as the positions' top-k), -inf blocks
    dropped."""
    rows, n = scores.shape
    size = rule.block_size
    n_blocks = -(-n // size)
    padded = scores.new_full((rows, max(n_blocks, rule.width) * size), float("-inf"))
    padded[:, :n] = scores
    blocks = padded.view(rows, max(n_blocks, rule.width), size).amax(-1)  # 0 rows too
    newest = torch.div(counts - 1, size, rounding_mode="floor")
    ids = torch.arange(blocks.shape[1], device=scores.device)
    blocks = blocks.masked_fill(ids[None, :] == newest[:, None], float("inf"))
    chosen = torch.topk(ranking_keys(blocks), rule.width, dim=-1, sorted=True).indices
    return torch.where(blocks.gather(1, chosen) > float("-inf"), chosen, -1).int()


def candidate_mask(within: torch.Tensor, n: int, block_size: int) -> torch.Tensor:
    """``[C, n]``: which of ``n`` positions lie in the rows' candidate blocks ``within``."""
    n_blocks = -(-n // block_size)
    ids = within.long()
    ids = torch.where((ids >= 0) & (ids < n_blocks), ids, n_blocks)
    keep = torch.zeros(within.shape[0], n_blocks + 1, dtype=torch.bool, device=within.device)
    keep.scatter_(1, ids, True)
    return keep[:, :n_blocks].repeat_interleave(block_size, dim=1)[:, :n]


def select_rows(scores: torch.Tensor, visible: torch.Tensor, index: IndexQuery, rows: slice,
                counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's top-k ``[C, top_k]`` and, at the candidate source, its candidate blocks:
    ``rows`` of the index query, their ``visible`` keys and visible ``counts``."""
    if index.within is not None:
        visible = visible & candidate_mask(index.within[rows], visible.shape[1],
                                           index.block_size)
    chosen = select_top_k(scores, visible, index.top_k)
    if index.publishes is None:
        return chosen, None
    masked = scores.float().masked_fill(~visible, float("-inf"))
    return chosen, candidate_blocks(masked, counts, index.publishes)


FUSED_SCORE_ELEMENTS = 8  # fp32-sized elements per score on the fused path (scores, top-k keys)


def index_chunk_rows(n_keys: int, index_heads: int, device: torch.device,
                     fused: bool = False) -> int:
    """Rows per indexer chunk, so that the scores stay within the budget: the PyTorch path's
    per-head ``[rows, heads, n_keys]``, or the fused kernel's ``[rows, n_keys]`` with the
    top-k's packed keys and masks beside them."""
    per_score = FUSED_SCORE_ELEMENTS if fused else index_heads
    return max(1, score_budget(torch.device(device)) // (per_score * max(n_keys, 1)))


Selection = tuple[torch.Tensor, torch.Tensor | None]


def select(
    meta: AttentionMetadata, cache: KVCache, index: IndexQuery, ratio: int, shape_mode: ShapeMode
) -> Selection:
    """The index source's selection ``[rows, top_k]`` (request-relative positions, -1 for none)
    and, at the candidate source, its candidate blocks ``[rows, width]`` (None elsewhere),
    gathered as the forward context's ``shape_mode`` says."""
    walk = select_static if shape_mode == "static" else select_varlen
    return walk(meta, cache, index, ratio)


def _candidate_out(meta: AttentionMetadata, index: IndexQuery) -> torch.Tensor | None:
    if index.publishes is None:
        return None
    return torch.full((meta.num_rows, index.publishes.width), -1, dtype=torch.int32,
                      device=index.q.device)


def select_varlen(
    meta: AttentionMetadata, cache: KVCache, index: IndexQuery, ratio: int
) -> Selection:
    """``select`` request by request with host integers, chunked by rows, keys cut at the ones
    each chunk's last row sees. The scores come from the fused kernel where the forward
    context's ``Kernels`` are Triton's."""
    out = torch.full((meta.num_rows, index.top_k), -1, dtype=torch.long, device=index.q.device)
    blocks = _candidate_out(meta, index)
    kernels = active_kernels()
    fused = kernels.triton
    counts = visible_global_keys(meta, ratio)
    for lay in meta.layouts:
        if lay.q_len == 0:
            continue
        keys = cache.index_key_rows(index.source, lay.cache_index, lay.seq_len // ratio)
        chunk = index_chunk_rows(keys.shape[0], index.q.shape[1], index.q.device, fused)
        for c0 in range(0, lay.q_len, chunk):
            c1 = min(lay.q_len, c0 + chunk)
            rows = slice(lay.q_start + c0, lay.q_start + c1)
            first = lay.q_first_pos + c0
            n = visible_counts(lay.q_first_pos + c1 - 1, lay.seq_len, ratio)
            if fused:
                scores = index_scores_fused(kernels, index.q[rows], index.weights[rows],
                                            keys[:n], first, ratio)
            else:
                scores = index_scores(index.q[rows], index.weights[rows], keys[:n])
            out[rows], chunk_blocks = select_rows(scores, visible_mask(counts[rows], n), index,
                                                  rows, counts[rows])
            if blocks is not None:
                blocks[rows] = chunk_blocks
    return out, blocks


def select_static(
    meta: AttentionMetadata, cache: KVCache, index: IndexQuery, ratio: int
) -> Selection:
    """``select`` from device metadata alone (every request slot's whole cache)."""
    keys = slot_view(cache.index_keys[index.source], cache.args.max_requests)
    req = meta.row_request
    counts = visible_global_keys(meta, ratio)
    visible = visible_mask(counts, keys.shape[1])
    outs, blocks = [], []
    for r0 in range(0, meta.num_rows, STATIC_ROW_CHUNK):
        rows = slice(r0, r0 + STATIC_ROW_CHUNK)
        per_row = keys[meta.cache_index[req[rows]]]
        scores = index_scores(index.q[rows], index.weights[rows], per_row)
        chosen, chunk_blocks = select_rows(scores, visible[rows], index, rows, counts[rows])
        outs.append(chosen)
        blocks.append(chunk_blocks)
    if index.publishes is None:
        return torch.cat(outs), None
    return torch.cat(outs), torch.cat(blocks)
