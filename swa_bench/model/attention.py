"""Attention of a layer's query rows: one softmax, with a per-head sink, over the keys each row
reads (``key_sources``: its window and its visible or selected global keys).

``attend`` is the one entry. Dense layers read every visible global key, sparse ones the
positions their index source selected (``sparse_attention``). Two choices shape the call:

* **which kernel** (the forward context's ``Kernels``): where they are Triton's, one launch for
  the step's rows (``swa_bench.kernels.mqa_attention``): each row's window keys gathered, its
  global keys gathered or (dense) its causal prefix as a contiguous range, O(rows x visible
  keys), the same bits at either shape mode (FULL graph == eager). The PyTorch code is the CPU
  path and the oracle: ``gathered_attention``, the one reference softmax every PyTorch path
  calls.
* **how keys are gathered** (the forward context's ``shape_mode``): ``varlen`` walks the
  requests with host integers and chunks their rows, a dense request's global keys a causal
  prefix shared by the chunk's rows (the eager path and the eager break of PIECEWISE graphs;
  PyTorch's fused SDPA does not take head dim 512, so this is the chunked path SPEC section 5
  asks for); ``static`` reads only device metadata and gathers each row's keys at static shapes
  from every request slot, so a FULL graph can capture it (O(rows x max_seq_len) memory: FULL
  graphs are for small steps).

Every path reads the window ring before this call's writes and writes the ring afterwards: a
step's early rows need positions the step itself overwrites.
"""

from __future__ import annotations

import torch

from swa_bench.kernels import mqa_attention
from swa_bench.model.batch import AttentionMetadata
from swa_bench.model.cache import KVCache
from swa_bench.model.forward_context import ShapeMode, active_kernels
from swa_bench.model.key_sources import (
    GlobalKV,
    layouts_causal_keys,
    step_global_keys,
    visible_counts,
    visible_global_keys,
    visible_mask,
    visible_positions,
    window_index,
)


def score_budget(device: torch.device) -> int:
    """fp32 score elements per query chunk: 4 GiB on a GPU (few, large GEMMs), 512 MiB on CPU."""
    return 1 << 30 if device.type == "cuda" else 1 << 27


def gather_budget(device: torch.device) -> int:
    """Bytes of gathered keys per row chunk: 512 MiB on a GPU, 64 MiB on CPU."""
    return 1 << 29 if device.type == "cuda" else 1 << 26


def _shared_key_scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float):
    """Scores of rows ``q [C, H, D]`` against keys all rows share, ``k [n, D]``; mask ``[C, n]``."""
    c, h, d = q.shape
    s = (q.reshape(c * h, d) @ k.t()).view(c, h, -1).float().mul_(scale)
    return s.masked_fill_(~mask[:, None, :], float("-inf"))


SPARSE_ATTN_BLOCK = 64  # the reference kernel's block of key columns (``sparse_attn``'s ``block``)


def gathered_attention(
    q: torch.Tensor,
    sources: list[tuple[torch.Tensor, torch.Tensor]],
    sink: torch.Tensor,
    scale: float,
    *,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """One softmax (a per-head sink in the denominator) over the keys each row gathers, with the
    numerics of DeepSeek-V4.1's ``sparse_attn``: fp32 scores of the model-dtype operands, an
    online softmax over blocks of 64 key columns (the sources' columns in order: window, then
    global), each block's probabilities relative to the running max rounded to the model dtype
    before their product with the values, fp32 sums, the sink added to the denominator last, one
    rounding of the output (exact in fp32: the rounding steps are identities there).

    ``q [T, H, D]``; each source is ``(kv [N, D], idx [T, K])``, ``idx`` long with -1 for a masked
    column. K = V (MQA latent). ``shared`` is ``(kv [n, D], visible [T, n])``: keys every row of
    the call reads, masked per row, as one GEMM without a gather (the varlen walk's causal
    prefix); its columns come last. The signature is a kernel's: a Triton kernel replaces this on
    CUDA. Rows are chunked by ``chunk_rows``, by default so that the gathered keys stay within
    ``gather_budget``.
    """
    t, heads, d = q.shape
    chunk = chunk_rows
    if chunk is None:
        width = sum(idx.shape[1] for _, idx in sources)
        per_row = width * d * (q.element_size() + 4) + heads * width * 4
        chunk = max(1, min(t, gather_budget(q.device) // max(per_row, 1)))
    outs = []
    for r0 in range(0, t, chunk):
        qc = q[r0 : r0 + chunk].float()
        parts: list[tuple[torch.Tensor, torch.Tensor]] = []  # (scores [C, H, n], values)
        for kv, idx in sources:
            ic = idx[r0 : r0 + chunk]
            k = kv[ic.clamp(min=0)].float()  # [C, K, D]
            s = torch.bmm(qc, k.transpose(1, 2)).mul_(scale)
            parts.append((s.masked_fill_((ic < 0)[:, None, :], float("-inf")), k))
        if shared is not None:
            kv_s = shared[0].float()
            parts.append((_shared_key_scores(qc, kv_s, shared[1][r0 : r0 + chunk], scale), kv_s))
        outs.append(_online_softmax_pv(parts, sink, q.dtype))
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def _online_softmax_pv(parts: list[tuple[torch.Tensor, torch.Tensor]], sink: torch.Tensor,
                       dtype: torch.dtype) -> torch.Tensor:
    """``sparse_attn``'s loop over blocks of 64 columns of the concatenated parts (a block may
    span two parts): the running max from -1e30 (a row with no valid key yields zeros), the
    previous sums rescaled, ``p = exp(s - max)`` summed in fp32 and rounded to ``dtype`` for the
    product with the values; values are per row ``[C, n, D]`` or shared ``[n, D]``."""
    c, h = parts[0][0].shape[:2]
    d = parts[0][1].shape[-1]
    acc = parts[0][0].new_zeros(c, h, d)
    total = parts[0][0].new_zeros(c, h)
    run_max = parts[0][0].new_full((c, h), -1e30)
    spans = [(s, v, s.shape[-1]) for s, v in parts]
    width = sum(n for *_, n in spans)
    for b0 in range(0, width, SPARSE_ATTN_BLOCK):
        b1 = min(width, b0 + SPARSE_ATTN_BLOCK)
        pieces, start = [], 0
        for s, v, n in spans:  # the block's columns, part by part
            lo, hi = max(b0, start) - start, min(b1, start + n) - start
            if lo < hi:
                pieces.append((s[..., lo:hi], v[..., lo:hi, :]))
            start += n
        new_max = torch.maximum(run_max, torch.stack([s.amax(-1) for s, _ in pieces]).amax(0))
        rescale = torch.exp(run_max - new_max)
        acc.mul_(rescale[..., None])
        total.mul_(rescale)
        for s, v in pieces:
            p = torch.exp(s - new_max[..., None])
            total.add_(p.sum(-1))
            p = p.to(dtype).float()
            acc.add_(torch.bmm(p, v) if v.dim() == 3 else (p.reshape(c * h, -1) @ v).view(c, h, d))
        run_max = new_max
    total.add_(torch.exp(sink.float().view(1, -1) - run_max))
    return acc.div_(total[..., None]).to(dtype)


def attend(
    q: torch.Tensor,
    kv: torch.Tensor,
    meta: AttentionMetadata,
    cache: KVCache,
    layer: int,
    global_kv: GlobalKV,
    sink: torch.Tensor,
    selection: torch.Tensor | None,
    shape_mode: ShapeMode,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of query rows ``q [Tq, H, D]`` over key rows ``kv [Tkv, D]`` made this forward:
    each row's window, and every visible global key (``selection`` None, dense) or the global
    positions ``selection [Tq, top_k]`` names (request-relative, -1 for none: sparse). ``out``
    (shaped like ``q``) receives the result, written there by the kernel; the PyTorch paths
    copy theirs in."""
    ring = cache.ring[layer]
    keys = torch.cat([ring, kv])
    win = window_index(meta, ring.shape[0], cache.args.window)
    scale = q.shape[-1] ** -0.5
    static = shape_mode == "static"
    if active_kernels().triton:
        o = _kernel_attention(q, keys, win, meta, cache, global_kv, sink, selection, scale, out)
    else:
        if static:
            sources = [(keys, win)]
            if global_kv.source is not None:
                sources.append(_global_source(meta, cache, global_kv, selection))
            o = gathered_attention(q, sources, sink, scale)
        else:
            o = _varlen_attention(q, keys, win, meta, cache, global_kv, sink, selection, scale)
        o = o if out is None else out.copy_(o)
    ring.index_copy_(0, meta.ring_slot, kv)
    return o


def _global_source(meta, cache, global_kv, selection):
    """The global keys as a gathered source over ``step_global_keys``: the selected positions,
    or at static shapes (dense) every visible position of the row's request slot."""
    glob, base = step_global_keys(meta, cache, global_kv)
    if selection is None:
        per_slot = glob.shape[0] // cache.args.max_requests
        selection = visible_positions(meta, per_slot, global_kv.ratio)
    return glob, torch.where(selection >= 0, base[:, None] + selection, -1)


def _kernel_attention(q, keys, win, meta, cache, global_kv, sink, selection, scale, out):
    """Every row of the step in one launch: its window keys gathered, then its selected global
    keys gathered (sparse) or its causal prefix of the source's keys as a contiguous range
    (dense: no index list, no loop over requests)."""
    sources, causal = [(keys, win)], None
    if selection is not None:
        sources.append(_global_source(meta, cache, global_kv, selection))
    elif global_kv.source is not None:
        ratio = global_kv.ratio
        glob, start = step_global_keys(meta, cache, global_kv)
        causal = (glob, start, visible_global_keys(meta, ratio),
                  layouts_causal_keys(meta.layouts, ratio))
    return mqa_attention(active_kernels(), q, sink, scale, sources, causal, out=out)


WINDOW_GATHER_ROWS = 2048  # rows per chunk: their gathered window keys stay a few hundred MiB


def varlen_chunk_rows(
    q_len: int, n_glob: int, heads: int, window: int, device: torch.device
) -> int:
    """Query rows per chunk of a dense request's varlen walk: fp32 scores within
    ``score_budget``."""
    budget = score_budget(torch.device(device)) // (heads * (n_glob + window) + 1)
    return max(1, min(q_len, budget, WINDOW_GATHER_ROWS))


def _varlen_attention(q, keys, win, meta, cache, global_kv, sink, selection, scale):
    """Request by request with host integers. Dense: rows chunked, each chunk reading its
    request's global keys up to the ones its last row sees, as a shared causal prefix.
    Sparse: each request's rows gather their selected positions of its own global keys."""
    out = torch.zeros_like(q)
    ratio = global_kv.ratio
    for lay in meta.layouts:
        if lay.q_len == 0:
            continue
        glob = None
        if global_kv.source is not None:
            glob = cache.compressed_rows(global_kv.source, lay.cache_index, lay.seq_len // ratio)
        if selection is not None:
            rows = slice(lay.q_start, lay.q_start + lay.q_len)
            sources = [(keys, win[rows])]
            if glob.shape[0] > 0:
                sources.append((glob, selection[rows]))
            out[rows] = gathered_attention(q[rows], sources, sink, scale)
            continue
        n_glob = 0 if glob is None else glob.shape[0]
        chunk = varlen_chunk_rows(lay.q_len, n_glob, q.shape[1], cache.args.window, q.device)
        for c0 in range(0, lay.q_len, chunk):
            c1 = min(lay.q_len, c0 + chunk)
            rows = slice(lay.q_start + c0, lay.q_start + c1)
            shared = None
            if glob is not None:
                n = visible_counts(lay.q_first_pos + c1 - 1, lay.seq_len, ratio)
                if n > 0:
                    counts = visible_global_keys(meta, ratio)[rows]
                    shared = (glob[:n], visible_mask(counts, n))
            out[rows] = gathered_attention(q[rows], [(keys, win[rows])], sink, scale,
                                           shared=shared, chunk_rows=c1 - c0)
    return out
