"""What each query row attends to: the one definition of its window keys, the global (or
compressed) keys it may read, and which of those it sees.

A row reads two key sources (K = V, the MQA latent):

* its **window**: positions ``t - W + 1 .. t`` at or above its request's window start, as rows of
  ``cat([ring, kv])`` (``window_index``): the ring holds earlier window KV (read before this call
  writes it), ``kv`` what this forward computed;
* its **global keys**: nothing, or a KV source's compressed KV (``model.compressor``: S's at
  ratio 1, a key per position; an encoder source's a key per group of ``r`` positions), written
  once by the source and read in place from the cache; key ``j`` is visible at position ``t``
  while ``j < visible_counts(t, seq_len, r)`` (``j <= t`` at ratio 1, ``j < (t + 1) // r``
  compressed, and inside the request's sequence, so a padded row sees none).

Every attention path (dense and sparse; varlen and static shapes; PyTorch and Triton) and the
indexer read these definitions, and the training forward its visibility (its window
is the dense ``[T, T]`` mask of the same positions), so one masking change lands here once and
E3's bitwise comparisons see the same keys on every path. The Triton kernels restate the rule in
their own arithmetic and are tested against these functions. What depends only on a step's metadata
(the window index, global row offsets, visible counts) is computed once per metadata
(``AttentionMetadata.derived_tensor``) and shared by the step's layers. The keys themselves are
cache contents, which each reading layer takes from the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swa_bench.kernels import window_index_rows
from swa_bench.model.batch import AttentionMetadata, RequestLayout
from swa_bench.model.cache import KVCache
from swa_bench.model.forward_context import active_kernels


@dataclass(frozen=True)
class GlobalKV:
    """What a layer reads besides its window: nothing, or a KV source's compressed KV."""

    source: int | None
    ratio: int = 1  # 1: a key per position (S and the decoder); > 1: per group (the encoder)


def visible_counts(positions: int | torch.Tensor, seq_len: int | torch.Tensor,
                   ratio: int) -> int | torch.Tensor:
    """How many global keys each query position sees: key ``j`` is visible at ``t`` iff
    ``j < visible_counts(t, ...)``. Causal, ``(t + 1) // r`` (``j <= t`` at full resolution; a
    compressed key once its whole group is), and inside the sequence, ``j * r < seq_len``.

    Host integers (the varlen walk's per-chunk key cut) or tensors (device metadata) alike."""
    causal = (positions + 1) // ratio
    seen = (seq_len + ratio - 1) // ratio
    return min(causal, seen) if isinstance(causal, int) else torch.clamp(causal, max=seen)


def visible_mask(counts: torch.Tensor, n: int) -> torch.Tensor:
    """``[rows, n]``: which of ``n`` global keys each row sees, from its ``visible_counts``."""
    return torch.arange(n, device=counts.device)[None, :] < counts[:, None]


def visible_global_keys(meta: AttentionMetadata, ratio: int) -> torch.Tensor:
    """Each query row's ``visible_counts`` (padded rows: none). Once per metadata and ratio."""
    return meta.derived_tensor(
        ("visible_global_keys", ratio),
        lambda: visible_counts(meta.positions, meta.seq_len[meta.row_request], ratio),
    )


def visible_positions(meta: AttentionMetadata, n: int, ratio: int) -> torch.Tensor:
    """``[rows, n]`` long: each row's visible global positions ``0 .. count - 1`` in order, -1
    after them; dense attention at static shapes gathers these as a sparse layer gathers its
    selection. Once per metadata."""

    def positions() -> torch.Tensor:
        visible = visible_mask(visible_global_keys(meta, ratio), n)
        return torch.where(visible, torch.arange(n, device=visible.device)[None, :], -1)

    return meta.derived_tensor(("visible_positions", n, ratio), positions)


def causal_key_total(first_pos: int, rows: int, ratio: int) -> int:
    """``sum((p + 1) // ratio for p in [first_pos, first_pos + rows))`` in closed form: the
    global keys a request's rows see (the FLOP counter's figure for the kernel)."""

    def upto(n: int) -> int:  # sum of (x // ratio) for x in [0, n]
        groups, rest = divmod(n + 1, ratio)
        return ratio * groups * (groups - 1) // 2 + groups * rest

    return upto(first_pos + rows) - upto(first_pos)


def layouts_causal_keys(layouts: tuple[RequestLayout, ...], ratio: int) -> int:
    """The global keys a step's rows visit, summed over its requests."""
    return sum(causal_key_total(lay.q_first_pos, lay.q_len, ratio) for lay in layouts)


def window_index(meta: AttentionMetadata, ring_rows: int, window: int) -> torch.Tensor:
    """Each query row's window keys as rows of ``cat([ring, kv])``: ``[rows, W]``, -1 masked.

    Positions at or after the request's first key row come from this forward's KV, earlier ones
    from the ring (read before this call writes it); nothing below the window start is read.
    Computed once per metadata (the step's layers share it).
    """
    return meta.derived_tensor(("window_index", ring_rows, window),
                               lambda: _window_index(meta, ring_rows, window))


def _window_index(meta: AttentionMetadata, ring_rows: int, window: int) -> torch.Tensor:
    kernels = active_kernels()
    if kernels.triton:
        return window_index_rows(kernels, meta.positions, meta.row_request, meta.kv_first_pos,
                                 meta.kv_row_start, meta.cache_index, meta.window_start,
                                 ring_rows, window)
    req = meta.row_request
    kpos = meta.positions[:, None] - torch.arange(window, device=meta.positions.device)[None, :]
    first = meta.kv_first_pos[req][:, None]
    from_kv = ring_rows + meta.kv_row_start[req][:, None] + (kpos - first)
    from_ring = meta.cache_index[req][:, None] * window + kpos.remainder(window)
    readable = (kpos >= meta.window_start[req][:, None]) & (kpos >= 0)
    return torch.where(readable, torch.where(kpos >= first, from_kv, from_ring), -1)


def slot_view(flat: torch.Tensor, max_requests: int) -> torch.Tensor:
    """A flat per-group cache (``cache.compressed[s]``, ``cache.index_keys[s]``) as
    ``[max_requests, groups, d]`` without its trash row: request slot ``c``'s groups."""
    return flat[:-1].view(max_requests, -1, flat.shape[-1])


def step_global_keys(
    meta: AttentionMetadata, cache: KVCache, global_kv: GlobalKV
) -> tuple[torch.Tensor, torch.Tensor]:
    """A source's compressed keys for the whole step as one flat ``[N, d]`` tensor, and each
    query row's first key in it: the cache in place (request slot ``c`` starts at
    ``c * groups``), the same rows at either shape mode, with no host reads."""
    per_slot = cache.groups(global_kv.source)
    base = meta.derived_tensor(("global_start", per_slot),
                               lambda: meta.cache_index[meta.row_request] * per_slot)
    return cache.compressed[global_kv.source][:-1], base
