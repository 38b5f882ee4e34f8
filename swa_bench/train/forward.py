"""A differentiable full-sequence forward of the model's own modules, batched ``[B, T]``.

The inference forward works on packed rows with caches and per-request loops; training wants
whole sequences, gradients and few kernels. This forward calls the same blocks' projections,
norms, mHC and routing and computes, for every position of every sequence, exactly what a cold
full prefill computes (a test holds it to the engine's reference step):

* window: the layer's own K=V latent at positions ``t - W + 1 .. t``;
* global: the compressed KV of S (S and the decoder, ratio 1) or of the closest KV source (the
  encoder): its compressor's latent of each whole group (``Compressor.whole_groups``), RoPE'd at
  the group's first position, visible by ``key_sources``' rule (``j < (t + 1) // r``); index
  keys from the same latent before RoPE;
* sparse layers read only the positions their index source selects (``select_top_k``, the
  inference path's own selection), plus the window; one softmax with the per-head sink;
* RoPE by each layer's own table (``Attention.rope``), the output heads turned back at the
  query's position before the output projection, as the inference step does.
* two-level candidates: S publishes each row's candidate blocks (``candidate_blocks``) and the
  index sources after it select among those blocks' positions only (``candidate_mask``).

The indexer's top-k is not differentiable, so its weights get their own signal, as DeepSeek
trains it: at every index source, the KL from the layer's dense attention over the visible
global positions (head-averaged, detached) to the indexer's softmax over the same positions,
with the indexer's inputs detached (that loss trains the indexer alone).
Routed experts run on every row with the routing weights as a mask (the same function as the
grouped dispatch; CPU's ``torch._grouped_mm`` has no usable backward).
Engram adds its lookup before its layers' blocks, hashing each sequence's n-grams from position
0 (``engram.sequence_ngrams``: the same hash ids as the cache's token history gives a prefill).
The DSpark draft layers are not trained: their rings are inference state and nothing here reads
them, so their weights get no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from swa_bench.model.engram import compress_ids, engram_input, engram_layout
from swa_bench.model.key_sources import visible_counts, visible_mask
from swa_bench.model.model import Transformer
from swa_bench.model.moe import MoE, swiglu
from swa_bench.model.ngram_hash import ngram_hash_ids, sequence_ngrams
from swa_bench.model.sparse_attention import candidate_blocks, candidate_mask, select_top_k


@dataclass
class TrainOutput:
    logits: torch.Tensor  # [B, T, vocab] fp32
    index_kl: torch.Tensor  # mean KL over index sources (0 for a dense model)


def dense_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """``moe(x)`` with every routed expert run on every row, its SwiGLU weighted by the routing
    (zero for the experts a row did not choose) before ``w2``: the same function as the grouped
    dispatch, DeepSeek-V4.1 inference/model.py `MoE` (fp32 sum with the shared expert, one
    rounding)."""
    experts, weights = moe.route(x)
    gate = torch.zeros(x.shape[0], moe.n_experts, device=x.device, dtype=torch.float32)
    gate = gate.scatter(1, experts, weights)
    w = moe.experts
    h = torch.einsum("nd,eid->eni", x, w.w13)
    a = swiglu(h, moe.swiglu_limit, gate.t()[..., None])
    out = torch.einsum("eni,edi->end", a, w.w2).sum(dim=0, dtype=torch.float32)
    if moe.shared_w13 is not None:
        out = out + moe.shared_w2(swiglu(moe.shared_w13(x), moe.swiglu_limit))
    return out.to(x.dtype)


def window_mask(t: int, window: int, device: torch.device) -> torch.Tensor:
    """``[T, T]``: key position s is in query position t's window (``t - W < s <= t``)."""
    pos = torch.arange(t, device=device)
    d = pos[:, None] - pos[None, :]
    return (d >= 0) & (d < window)


def selection_mask(selection: torch.Tensor, n: int) -> torch.Tensor:
    """``[rows, n]`` booleans from ``[rows, top_k]`` selected positions (-1: none)."""
    mask = torch.zeros(selection.shape[0], n + 1, dtype=torch.bool, device=selection.device)
    mask.scatter_(1, torch.where(selection >= 0, selection, n), True)
    return mask[:, :n]


def train_forward(model: Transformer, tokens: torch.Tensor) -> TrainOutput:
    """Logits of every position of ``tokens [B, T]`` (cold prefill of each sequence)."""
    args = model.args
    b, t = tokens.shape
    dev = tokens.device
    positions = torch.arange(t, device=dev).repeat(b)
    x = model.embed(tokens).flatten(0, 1)
    streams = (x,) * args.hc_mult  # read-only: the first post makes new ones
    pre_mix = model.hc.identity_pre_mix(x)  # the delayed mHC pre-mix, as the engine carries it
    latents: dict[int, torch.Tensor] = {}
    index_keys: dict[int, torch.Tensor] = {}
    selections: dict[int, torch.Tensor] = {}
    candidates: torch.Tensor | None = None  # S's candidate blocks [B * T, width]
    win = window_mask(t, args.window, dev)
    kls = []
    hashes = None
    if args.engram_layers:
        layout = engram_layout(args, dev)
        ngrams = sequence_ngrams(compress_ids(tokens, args), layout.pad_id, layout.max_ngram)
        hashes = ngram_hash_ids(ngrams, layout)
    for block in model.layers:
        streams = engram_input(block.engram, streams, hashes)
        attn = block.attn
        attn_mix = block.hc_mixes("attn", streams)
        h = block.attn_input(streams, pre_mix)
        q_latent = attn.q_norm(attn.wq_a(h))
        q = attn.project_q(q_latent, positions).view(b, t, attn.n_heads, attn.head_dim)
        latent = attn.kv_norm(attn.wkv(h))
        kv = attn.rope(latent, positions).view(b, t, -1)
        if attn.compressor is not None:
            groups = attn.compressor.whole_groups(h.view(b, t, -1))
            n = groups.shape[1]
            starts = (torch.arange(n, device=dev) * attn.compressor.ratio).repeat(b)
            latents[attn.layer] = attn.rope(groups.flatten(0, 1), starts,
                                            args.rope_dim).view(b, n, -1)
            if attn.writes_index_keys:
                keys = attn.rope(attn.index_norm(attn.wk_index(groups.detach().flatten(0, 1))),
                                 starts, attn.index_rope_dim)
                index_keys[attn.layer] = keys.view(b, n, -1)
        scale = attn.head_dim ** -0.5
        scores = [torch.einsum("bthd,bsd->bhts", q, kv).float() * scale]
        scores[0] = scores[0].masked_fill(~win, float("-inf"))
        values = [kv]
        gkv = attn.global_kv
        if gkv.source is not None:
            glob = latents[gkv.source]
            n = glob.shape[1]
            visible = visible_mask(visible_counts(torch.arange(t, device=dev), t, gkv.ratio), n)
            dense = torch.einsum("bthd,bnd->bhtn", q, glob).float() * scale
            dense = dense.masked_fill(~visible, float("-inf"))
            allowed = visible[None].expand(b, t, n)
            if attn.runs_indexer:
                index = attn.index_query(q_latent.detach(), positions,
                                         attn.index_weights(h.detach()), candidates)
                ikeys = index_keys[index.source]
                iq = index.q.view(b, t, *index.q.shape[1:])
                s = torch.einsum("bthd,bnd->bthn", iq, ikeys).relu()
                iscore = (index.weights.view(b, t, -1, 1).to(s.dtype) * s).sum(2).float()
                with torch.no_grad():
                    rows_visible = visible.repeat(b, 1)
                    if index.within is not None:
                        rows_visible = rows_visible & candidate_mask(index.within, n,
                                                                     index.block_size)
                    sel = select_top_k(iscore.flatten(0, 1), rows_visible, index.top_k)
                    selections[attn.layer] = selection_mask(sel, n).view(b, t, n)
                    if index.publishes is not None:
                        counts = visible.sum(-1).repeat(b)
                        masked = iscore.flatten(0, 1).masked_fill(~rows_visible, float("-inf"))
                        candidates = candidate_blocks(masked, counts, index.publishes)
                kls.append(index_kl(iscore, dense.detach(), visible))
            if attn.index_source is not None:
                allowed = allowed & selections[attn.index_source]
            scores.append(dense.masked_fill(~allowed[:, None], float("-inf")))
            values.append(glob)
        sink = attn.sink.float().view(1, -1, 1, 1).expand(b, -1, t, 1)
        probs = torch.softmax(torch.cat([*scores, sink], dim=-1), dim=-1)
        o = torch.einsum("bhts,bsd->bthd", probs[..., :t].to(kv.dtype), kv)
        if len(values) > 1:
            o = o + torch.einsum("bhtn,bnd->bthd", probs[..., t:-1].to(kv.dtype), values[1])
        o = attn.rope(o.reshape(b * t, attn.n_heads, attn.head_dim), positions, inverse=True)
        o = attn.project_out(o)
        streams = block.hc.post(o, streams, attn_mix)
        ffn_mix = block.hc_mixes("ffn", streams)
        f = block.ffn_norm(block.hc.pre(streams, pre_mix if attn_mix is None else attn_mix.pre))
        streams = block.hc.post(dense_moe(block.moe, f), streams, ffn_mix)
        pre_mix = pre_mix if ffn_mix is None else ffn_mix.pre
    last = model.norm(model.hc.pre(streams, pre_mix))
    logits = F.linear(last.float(), model.head.weight.float()).view(b, t, -1)
    kl = torch.stack(kls).mean() if kls else logits.new_zeros(())
    return TrainOutput(logits, kl)


def index_kl(index_scores: torch.Tensor, dense: torch.Tensor, visible: torch.Tensor):
    """KL(dense attention over visible global positions || the indexer's softmax), averaged
    over the rows that see any position. ``index_scores [B, T, n]``, ``dense [B, H, T, n]``
    (``-inf`` where not visible). Masked, not indexed: no host sync, so a training step can be
    captured as a CUDA graph."""
    seen = visible.any(-1)
    dense = dense.masked_fill(~seen[:, None], 0.0)
    target = torch.softmax(dense, dim=-1).mean(1)
    log_pred = torch.log_softmax(index_scores.masked_fill(~visible, -1e9), -1)
    terms = torch.where(visible, target * (target.clamp_min(1e-12).log() - log_pred), 0.0)
    rows = seen.sum().clamp_min(1) * index_scores.shape[0]
    return terms.sum(-1).sum() / rows
