"""Attention kernels: one softmax over a row's window KV and the global (or compressed) KV it sees.

Two implementations compute the same function:

* ``varlen_attention`` loops over requests with host integers and chunks queries, slicing keys
  causally; it is the eager path (and the eager break of PIECEWISE graphs). PyTorch's fused SDPA
  does not take head dim 512, so this is the chunked path SPEC section 5 asks for.
* ``static_attention`` reads only device metadata and gathers each row's keys at static shapes, so a
  FULL graph can capture it. It costs O(rows x max_seq_len) memory: FULL graphs are for small steps.

On CUDA both run one Triton kernel instead (``swa_bench.kernels.mqa_attention``, where the
forward context's ``Kernels`` are Triton's), one launch for the step's rows: each row's window
keys gathered, then its
causal global prefix as a contiguous range, so the cost is O(rows x visible keys) in either path
and a row's result is the same bits in both (FULL graph == eager). The PyTorch code stays the CPU
path and the oracle.

Both read the window ring before this call's writes and write the ring afterwards: a step's early
rows need positions the step itself overwrites.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swa_bench.kernels import mqa_attention, window_index_rows
from swa_bench.model.args import ModelArgs
from swa_bench.model.batch import AttentionMetadata, RequestLayout
from swa_bench.model.cache import KVCache
from swa_bench.model.forward_context import active_kernels


def score_budget(device: torch.device) -> int:
    """fp32 score elements per query chunk: 4 GiB on a GPU (few, large GEMMs), 512 MiB on CPU."""
    return 1 << 30 if device.type == "cuda" else 1 << 27


@dataclass(frozen=True)
class GlobalKV:
    """What a layer reads besides its window: nothing, S's latent, or a source's pooled latent."""

    source: int | None
    ratio: int = 1  # 1: full resolution (S and the decoder); > 1: compressed (the encoder)


def softmax_with_sink(parts: list[torch.Tensor], sink: torch.Tensor) -> list[torch.Tensor]:
    """Normalises fp32 score blocks ``[..., H, n_i]`` together with a per-head sink logit.

    In place, without concatenating the blocks: at long context the scores are the largest
    tensors of the forward and every extra pass over them costs memory bandwidth.
    """
    sink_logit = sink.float().view(*([1] * (parts[0].dim() - 2)), -1)
    lse = torch.stack([*(torch.logsumexp(p, dim=-1) for p in parts),
                       sink_logit.expand(parts[0].shape[:-1])]).logsumexp(dim=0)
    return [p.sub_(lse[..., None]).exp_() for p in parts]


def _shared_key_scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float):
    """Scores of rows ``q [C, H, D]`` against keys all rows share, ``k [n, D]``; mask ``[C, n]``."""
    c, h, d = q.shape
    s = (q.reshape(c * h, d) @ k.t()).view(c, h, -1).float().mul_(scale)
    return s.masked_fill_(~mask[:, None, :], float("-inf"))


def _shared_key_values(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    c, h, n = p.shape
    return (p.reshape(c * h, n).to(v.dtype) @ v).view(c, h, -1)


def pooled(rows: torch.Tensor, ratio: int) -> torch.Tensor:
    """Mean-pooled ``[n // ratio, d]`` (compressed KV); ``ratio`` 1 is the rows themselves."""
    if ratio == 1:
        return rows
    n = rows.shape[0] // ratio
    return rows[: n * ratio].view(n, ratio, rows.shape[-1]).mean(dim=1)


def window_index(meta: AttentionMetadata, ring_rows: int, window: int) -> torch.Tensor:
    """Each query row's window keys as rows of ``cat([ring, kv])``: ``[rows, W]``, -1 masked.

    Positions at or after the request's first key row come from this forward's KV, earlier ones
    from the ring (read before this call writes it); nothing below the window start is read.
    Computed once per metadata (the step's layers share it).
    """
    return meta.derived_tensor(("window_index", ring_rows, window),
                               lambda: _window_index(meta, ring_rows, window))


def _window_index(meta: AttentionMetadata, ring_rows: int, window: int) -> torch.Tensor:
    if active_kernels().triton:
        return window_index_rows(active_kernels(), meta.positions, meta.row_request,
                                 meta.kv_first_pos, meta.kv_row_start, meta.cache_index,
                                 meta.window_start, ring_rows, window)
    req = meta.row_request
    kpos = meta.positions[:, None] - torch.arange(window, device=meta.positions.device)[None, :]
    first = meta.kv_first_pos[req][:, None]
    from_kv = ring_rows + meta.kv_row_start[req][:, None] + (kpos - first)
    from_ring = meta.cache_index[req][:, None] * window + kpos.remainder(window)
    readable = (kpos >= meta.window_start[req][:, None]) & (kpos >= 0)
    return torch.where(readable, torch.where(kpos >= first, from_kv, from_ring), -1)


def static_pooled(flat: torch.Tensor, args: ModelArgs, ratio: int) -> torch.Tensor:
    """Every request slot's pooled rows ``[max_requests, n, d]`` from a flat cache."""
    slots, max_seq = args.max_requests, args.max_seq_len
    rows = flat[: slots * max_seq].view(slots, max_seq, -1)
    if ratio == 1:
        return rows
    n = max_seq // ratio
    return rows[:, : n * ratio].reshape(slots, n, ratio, -1).mean(dim=2)


def causal_count(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """Global keys visible at each position: ``p + 1`` at full resolution, ``(p + 1) // r``
    pooled (a pooled key is visible once its whole group is)."""
    return torch.div(positions + 1, ratio, rounding_mode="floor")


def causal_key_total(first_pos: int, rows: int, ratio: int) -> int:
    """``sum(causal_count(p, ratio) for p in [first_pos, first_pos + rows))`` in closed form."""

    def upto(n: int) -> int:  # sum of (x // ratio) for x in [0, n]
        groups, rest = divmod(n + 1, ratio)
        return ratio * groups * (groups - 1) // 2 + groups * rest

    return upto(first_pos + rows) - upto(first_pos)


def layouts_causal_keys(layouts: tuple[RequestLayout, ...], ratio: int) -> int:
    """The global keys a step's rows visit: the FLOP counter's figure for the kernel."""
    return sum(causal_key_total(lay.q_first_pos, lay.q_len, ratio) for lay in layouts)


def step_global_keys(
    meta: AttentionMetadata, cache: KVCache, global_kv: GlobalKV, static: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """A source's global keys as one flat ``[N, d]`` tensor, and each query row's first key in it.

    Full resolution reads the cache in place (request slot ``c`` starts at ``c * max_seq_len``).
    Pooled keys are computed: over every request slot for a captured graph (``static``, no host
    reads), over the step's own requests up to its longest sequence eagerly. A pooled key is
    the same reduction of the same rows either way, so eager and FULL see equal bits."""
    args = cache.args
    ratio, latent = global_kv.ratio, cache.latent[global_kv.source]
    if static or ratio == 1:
        keys = static_pooled(latent, args, ratio)
        per_slot = keys.shape[1]
        base = meta.derived_tensor(("global_start", per_slot, "slot"),
                                   lambda: meta.cache_index[meta.row_request] * per_slot)
        return keys.reshape(-1, keys.shape[-1]), base
    requests = len(meta.layouts)
    n = max((lay.seq_len for lay in meta.layouts), default=0) // ratio
    slots = latent[: args.max_requests * args.max_seq_len].view(args.max_requests,
                                                                 args.max_seq_len, -1)
    rows = slots[meta.cache_index[:requests], : n * ratio]
    keys = rows.view(requests, n, ratio, latent.shape[-1]).mean(dim=2)
    base = meta.derived_tensor(("global_start", n, "request"), lambda: meta.row_request * n)
    return keys.reshape(-1, keys.shape[-1]), base


def visible_global_keys(meta: AttentionMetadata, ratio: int) -> torch.Tensor:
    """Each query row's count of visible global keys: its causal count, at most the keys its
    request's sequence holds (padded rows: none). Once per metadata and ratio."""

    def count() -> torch.Tensor:
        seen = torch.div(meta.seq_len[meta.row_request] + ratio - 1, ratio, rounding_mode="floor")
        return torch.minimum(causal_count(meta.positions, ratio), seen)

    return meta.derived_tensor(("visible_global_keys", ratio), count)


def _kernel_attention(q, kv, meta, cache, layer, global_kv, sink, static) -> torch.Tensor:
    """Every row of the step in one launch: its window keys gathered, then its causal prefix
    of the source's keys as a contiguous range (no loop over requests)."""
    args = cache.args
    ring = cache.ring[layer]
    keys = torch.cat([ring, kv])
    win = window_index(meta, ring.shape[0], args.window)
    causal = None
    if global_kv.source is not None:
        ratio = global_kv.ratio
        glob, start = step_global_keys(meta, cache, global_kv, static)
        causal = (glob, start, visible_global_keys(meta, ratio),
                  layouts_causal_keys(meta.layouts, ratio))
    out = mqa_attention(active_kernels(), q, sink, q.shape[-1] ** -0.5, [(keys, win)], causal)
    ring.index_copy_(0, meta.ring_slot, kv)
    return out


WINDOW_GATHER_ROWS = 2048  # rows per chunk: their gathered window keys stay a few hundred MiB


def varlen_chunk_rows(
    q_len: int, n_glob: int, heads: int, window: int, device: torch.device
) -> int:
    """Query rows per chunk of ``varlen_attention``: fp32 scores within ``score_budget``."""
    budget = score_budget(torch.device(device)) // (heads * (n_glob + window) + 1)
    return max(1, min(q_len, budget, WINDOW_GATHER_ROWS))


def varlen_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    meta: AttentionMetadata,
    cache: KVCache,
    layer: int,
    global_kv: GlobalKV,
    sink: torch.Tensor,
) -> torch.Tensor:
    """Attention of query rows ``q [Tq, H, D]`` over key rows ``kv [Tkv, D]`` made this forward."""
    if active_kernels().triton:
        return _kernel_attention(q, kv, meta, cache, layer, global_kv, sink, static=False)
    window = cache.args.window
    scale = q.shape[-1] ** -0.5
    out = torch.zeros_like(q)
    ring = cache.ring[layer]
    offs = torch.arange(window, device=q.device)
    heads = q.shape[1]
    for lay in meta.layouts:
        if lay.q_len == 0:
            continue
        glob = None
        if global_kv.source is not None:
            full = cache.latent_rows(global_kv.source, lay.cache_index, lay.seq_len)
            if global_kv.ratio > 1:
                n = lay.seq_len // global_kv.ratio
                full = full[: n * global_kv.ratio].view(n, global_kv.ratio, full.shape[-1])
                full = full.mean(dim=1)
            glob = full
        n_glob = 0 if glob is None else glob.shape[0]
        chunk = varlen_chunk_rows(lay.q_len, n_glob, heads, window, q.device)
        reads_ring = lay.kv_first_pos > max(lay.window_start, 0)
        for c0 in range(0, lay.q_len, chunk):
            c1 = min(lay.q_len, c0 + chunk)
            p0, p1 = lay.q_first_pos + c0, lay.q_first_pos + c1  # query positions [p0, p1)
            qc = q[lay.q_start + c0 : lay.q_start + c1]
            qpos = torch.arange(p0, p1, device=q.device)
            kpos = qpos[:, None] - offs[None, :]
            valid = kpos >= max(lay.window_start, 0)
            from_kv = kpos >= lay.kv_first_pos
            kv_row = lay.kv_start + (kpos - lay.kv_first_pos)
            rows = torch.where(valid & from_kv, kv_row, 0)
            k_win = kv[rows]
            if reads_ring and p0 - window + 1 < lay.kv_first_pos:
                slots = lay.cache_index * window + kpos.remainder(window)
                from_ring = (valid & ~from_kv)[..., None]
                k_win = torch.where(from_ring, ring[torch.where(valid, slots, 0)], k_win)
            s = torch.bmm(qc, k_win.transpose(1, 2)).float().mul_(scale)
            parts, values = [s.masked_fill_(~valid[:, None, :], float("-inf"))], [k_win]

            if glob is not None:
                if global_kv.ratio > 1:
                    n = min(p1 // global_kv.ratio, n_glob)
                    gpos = torch.arange(n, device=q.device)
                    g_mask = gpos[None, :] < ((qpos + 1) // global_kv.ratio)[:, None]
                else:
                    n = p1
                    gpos = torch.arange(n, device=q.device)
                    g_mask = gpos[None, :] <= qpos[:, None]
                if n > 0:
                    parts.append(_shared_key_scores(qc, glob[:n], g_mask, scale))
                    values.append(glob[:n])

            probs = softmax_with_sink(parts, sink)
            o = torch.bmm(probs[0].to(k_win.dtype), k_win)
            if len(values) > 1:
                o = o + _shared_key_values(probs[1], values[1])
            out[lay.q_start + c0 : lay.q_start + c1] = o
    ring.index_copy_(0, meta.ring_slot, kv)
    return out


STATIC_ROW_CHUNK = 64


def static_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    meta: AttentionMetadata,
    cache: KVCache,
    layer: int,
    global_kv: GlobalKV,
    sink: torch.Tensor,
) -> torch.Tensor:
    """The same function from device metadata alone: no host reads, static shapes (capturable)."""
    if active_kernels().triton:
        return _kernel_attention(q, kv, meta, cache, layer, global_kv, sink, static=True)
    args = cache.args
    window, max_seq = args.window, args.max_seq_len
    scale = q.shape[-1] ** -0.5
    ring = cache.ring[layer]
    keys_src = torch.cat([ring, kv])
    req = meta.row_request
    pos = meta.positions
    offs = torch.arange(window, device=q.device)
    kpos = pos[:, None] - offs[None, :]
    from_kv = kpos >= meta.kv_first_pos[req][:, None]
    kv_idx = (
        ring.shape[0] + meta.kv_row_start[req][:, None] + (kpos - meta.kv_first_pos[req][:, None])
    )
    ring_idx = meta.cache_index[req][:, None] * window + kpos.remainder(window)
    win_mask = (kpos >= meta.window_start[req][:, None]) & (kpos >= 0)
    win_idx = torch.where(win_mask, torch.where(from_kv, kv_idx, ring_idx), 0)

    glob = None
    if global_kv.source is not None:
        latent = cache.latent[global_kv.source][: args.max_requests * max_seq]
        glob = latent.view(args.max_requests, max_seq, -1)
        if global_kv.ratio > 1:
            n = max_seq // global_kv.ratio
            glob = glob[:, : n * global_kv.ratio].reshape(args.max_requests, n, global_kv.ratio, -1)
            glob = glob.mean(dim=2)
        gpos = torch.arange(glob.shape[1], device=q.device)
        if global_kv.ratio > 1:
            g_mask = gpos[None, :] < ((pos + 1) // global_kv.ratio)[:, None]
        else:
            g_mask = gpos[None, :] <= pos[:, None]
        g_mask = g_mask & (gpos[None, :] * global_kv.ratio < meta.seq_len[req][:, None])

    outs = []
    for r0 in range(0, q.shape[0], STATIC_ROW_CHUNK):
        rows = slice(r0, r0 + STATIC_ROW_CHUNK)
        qc = q[rows]
        k_win = keys_src[win_idx[rows]]
        parts = [torch.bmm(qc, k_win.transpose(1, 2)).float() * scale]
        parts[0] = parts[0].masked_fill(~win_mask[rows][:, None, :], float("-inf"))
        values = [k_win]
        if glob is not None:
            k_glob = glob[meta.cache_index[req[rows]]]
            visible = g_mask[rows]
            s = torch.bmm(qc, k_glob.transpose(1, 2)).float() * scale
            parts.append(s.masked_fill(~visible[:, None, :], float("-inf")))
            values.append(k_glob)
        probs = softmax_with_sink(parts, sink)
        outs.append(sum(torch.bmm(p.to(v.dtype), v) for p, v in zip(probs, values, strict=True)))
    ring.index_copy_(0, meta.ring_slot, kv)
    return torch.cat(outs)
