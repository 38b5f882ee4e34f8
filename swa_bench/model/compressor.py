"""The learned compressor every KV source owns: its compressed KV (the global keys later layers
read) and the pre-RoPE latent its index keys come from.

DeepSeek-V4.1 inference/model.py ``Compressor`` (with ``Attention._compress_kv``):

* ratio ``r > 1`` (the encoder's sources): ``wkv`` and ``wgate`` project every row in fp32; each
  whole group of ``r`` consecutive positions (group ``j`` = positions ``j r .. j r + r - 1``, no
  overlap) pools to ``sum_i softmax_i(score)[c] * kv_i[c]`` (a softmax per channel over the
  group), cast to the model dtype and normed (``norm``); the layer RoPEs it at ``j r``, the
  group's first position;
* ratio 1 (S): ``norm(wkv(x))`` per row, a projection apart from the attention's window latent.

A group completes at the row of its last position; a trailing partial group waits in the cache's
``group_state`` (the reference's ``kv_state``/``score_state``): a ring of ``r`` fp32
``(kv, score)`` slots per request (slot = position mod r) holding its last ``r`` positions,
written and read like the window ring (``key_sources.window_index``): a group's positions this
step computed come from its rows, earlier ones from the ring (read before this step writes it).
So a prefill, chunks of any length and decode steps pool each group from the same rows, once,
and write it once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from swa_bench.kernels import fp32_linear
from swa_bench.model.args import ModelArgs
from swa_bench.model.batch import AttentionMetadata
from swa_bench.model.cache import KVCache
from swa_bench.model.forward_context import active_kernels
from swa_bench.model.norm import RMSNorm


def pool_groups(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """``[..., r, d]`` rows of a group to ``[..., d]``: each channel's softmax over the group's
    scores weighs its kv (fp32 in, fp32 out)."""
    return (kv * score.softmax(dim=-2)).sum(dim=-2)


@dataclass(frozen=True)
class Groups:
    """What a step's rows give a KV source's compressed cache: per row, the normed latent of the
    group it completes (pre-RoPE), that group's first position and the compressed row it goes to
    (the trash row where the row completes no group, or must not write)."""

    latent: torch.Tensor  # [rows, head_dim], model dtype
    start: torch.Tensor  # [rows] long: the group's first position (the RoPE position)
    slot: torch.Tensor  # [rows] long: flat row of the compressed cache (trash: none)


class Compressor(nn.Module):
    """A KV source's compressor (``Attention.compressor``; DeepSeek-V4.1 inference/model.py
    ``Compressor``): ``wkv``, ``wgate`` above ratio 1, ``norm``. It holds no state: the
    incomplete groups live in the cache the forward context names."""

    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.source, self.ratio = layer, args.compress_ratio_for(layer)
        self.wkv = nn.Linear(args.dim, args.head_dim, bias=False)
        if self.ratio > 1:
            self.wgate = nn.Linear(args.dim, args.head_dim, bias=False)
        self.norm = RMSNorm(args.head_dim, args.norm_eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's kv and gate score, fp32 above ratio 1 (the pooling runs in fp32, as the
        reference promotes these weights); ratio 1: the kv in the model dtype, no gate."""
        if self.ratio == 1:
            return self.wkv(x), None
        kernels = active_kernels()
        return (fp32_linear(kernels, x, self.wkv.weight),
                fp32_linear(kernels, x, self.wgate.weight))

    def whole_groups(self, x: torch.Tensor) -> torch.Tensor:
        """The normed latent (pre-RoPE) of every whole group of cold sequences ``x [B, T, dim]``:
        ``[B, T // r, head_dim]`` (the training forward's full prefill)."""
        kv, score = self.project(x)
        if self.ratio == 1:
            return self.norm(kv)
        n = x.shape[1] // self.ratio
        kv, score = (t[:, : n * self.ratio].unflatten(1, (n, self.ratio)) for t in (kv, score))
        return self.norm(pool_groups(kv, score).to(x.dtype))

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, cache: KVCache) -> Groups:
        """The groups this step's rows ``x`` (the key rows: a KV source runs on the batch, whose
        query rows are its key rows) complete, pooled from this step's rows and the request's
        ring of the earlier ones; each request's last ``r`` rows are then written to the ring."""
        args, r = cache.args, self.ratio
        positions = meta.positions
        slot = group_slot(meta, args.max_seq_len, args.max_requests, r)
        start = torch.div(positions, r, rounding_mode="floor") * r
        kv, score = self.project(x)
        if r == 1:
            return Groups(self.norm(kv), start, slot)
        state = cache.group_state[self.source]
        rows = torch.stack([kv, score], dim=1)  # [rows, 2, d]
        group = torch.cat([state, rows])[group_index(meta, state.shape[0], r)]
        pooled = pool_groups(group[:, :, 0], group[:, :, 1])
        state.index_copy_(0, state_slot(meta, args.max_seq_len, args.max_requests, r), rows)
        return Groups(self.norm(pooled.to(x.dtype)), start, slot)


def _row_requests(meta: AttentionMetadata) -> torch.Tensor:
    if meta.global_slot.shape[0] != meta.num_rows:
        raise ValueError("a KV source's compressor runs on rows that are their own key rows")
    return meta.row_request


def group_slot(meta: AttentionMetadata, max_seq_len: int, max_requests: int,
               ratio: int) -> torch.Tensor:
    """``[rows]``: the flat compressed-cache row each key row writes, ``c * ceil(L / r) + j`` for
    the row of group ``j``'s last position in request slot ``c``; the trash row for the others
    and for rows that write nothing (their ``global_slot`` is the trash). Once per metadata."""

    def compute() -> torch.Tensor:
        req = _row_requests(meta)
        groups = -(-max_seq_len // ratio)
        pos = meta.positions
        completes = (meta.global_slot != max_requests * max_seq_len) & ((pos + 1) % ratio == 0)
        at = meta.cache_index[req] * groups + torch.div(pos, ratio, rounding_mode="floor")
        return torch.where(completes, at, max_requests * groups)

    return meta.derived_tensor(("group_slot", ratio), compute)


def state_slot(meta: AttentionMetadata, max_seq_len: int, max_requests: int,
               ratio: int) -> torch.Tensor:
    """``[rows]``: the ring slot ``c * r + pos mod r`` of each of its request's last ``r`` rows
    (as the window ring takes the last W), the trash slot for every other row and for rows that
    write nothing. One writer per slot, and the ring then holds the last ``r`` positions
    whatever the chunking, so a chunked prefill leaves the caches a whole one does. Once per
    metadata."""

    def compute() -> torch.Tensor:
        req = _row_requests(meta)
        pos, seq = meta.positions, meta.seq_len[req]
        writes = (meta.global_slot != max_requests * max_seq_len) & (pos >= seq - ratio)
        at = meta.cache_index[req] * ratio + pos.remainder(ratio)
        return torch.where(writes, at, max_requests * ratio)

    return meta.derived_tensor(("state_slot", ratio), compute)


def group_index(meta: AttentionMetadata, state_rows: int, ratio: int) -> torch.Tensor:
    """``[rows, r]``: the positions ``pos - r + 1 .. pos`` of each row as rows of
    ``cat([state, this step's rows])``, oldest first: at or after the request's first key row
    from this step's rows, earlier ones from the request's ring. Only a row ending a group reads
    its result, and every position of that group is then in one or the other."""

    def compute() -> torch.Tensor:
        req = _row_requests(meta)
        kpos = meta.positions[:, None] - (ratio - 1) + torch.arange(ratio,
                                                                    device=meta.positions.device)
        first = meta.kv_first_pos[req][:, None]
        from_rows = state_rows + meta.kv_row_start[req][:, None] + (kpos - first)
        from_state = meta.cache_index[req][:, None] * ratio + kpos.remainder(ratio)
        return torch.where(kpos >= first, from_rows, from_state)

    return meta.derived_tensor(("group_index", state_rows, ratio), compute)
