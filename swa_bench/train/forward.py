"""A differentiable full-sequence forward of the model's own modules, batched ``[B, T]``.

The inference forward works on packed rows with caches and per-request loops; training wants
whole sequences, gradients and few kernels. This forward calls the same blocks' projections,
norms, mHC and routing and computes, for every position of every sequence, exactly what a cold
full prefill computes (a test holds it to the engine's reference step):

* window: the layer's own K=V latent at positions ``t - W + 1 .. t``;
* global: S's latent (S and the decoder) or the closest KV source's latent pooled by the
  compress ratio (the encoder), through ``key_sources``' own ``pool`` and visibility rule
  (pooled position ``j`` visible while ``j < (t + 1) // r``);
* sparse layers read only the positions their index source selects (``select_top_k``, the
  inference path's own selection), plus the window; one softmax with the per-head sink.

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
from swa_bench.model.key_sources import pool, visible_counts, visible_mask
from swa_bench.model.model import Transformer
from swa_bench.model.moe import MoE
from swa_bench.model.ngram_hash import ngram_hash_ids, sequence_ngrams
from swa_bench.model.rope import apply_rope
from swa_bench.model.sparse_attention import select_top_k


@dataclass
class TrainOutput:
    logits: torch.Tensor  # [B, T, vocab] fp32
    index_kl: torch.Tensor  # mean KL over index sources (0 for a dense model)


def dense_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """``moe(x)`` with every routed expert run on every row and weighted by the routing."""
    experts, weights = moe.route(x)
    gate = torch.zeros(x.shape[0], moe.n_experts, device=x.device, dtype=torch.float32)
    gate = gate.scatter(1, experts, weights)
    w = moe.experts
    h = torch.einsum("nd,eid->eni", x, w.w13)
    g, u = h.chunk(2, dim=-1)
    y = torch.einsum("eni,edi->end", F.silu(g) * u, w.w2)
    out = torch.einsum("end,ne->nd", y.float(), gate).to(x.dtype)
    if moe.shared_w13 is not None:
        s1, s3 = moe.shared_w13(x).chunk(2, dim=-1)
        out = out + moe.shared_w2(F.silu(s1) * s3)
    return out


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
    streams = tuple(x.clone() for _ in range(args.hc_mult))
    latents: dict[int, torch.Tensor] = {}
    index_keys: dict[int, torch.Tensor] = {}
    selections: dict[int, torch.Tensor] = {}
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
        h, post = block.attn_hc.pre(streams, block.attn_norm)
        q_latent = attn.q_norm(attn.wq_a(h))
        q = attn.project_q(q_latent, positions).view(b, t, attn.n_heads, attn.head_dim)
        latent = attn.kv_norm(attn.wkv(h))
        kv = apply_rope(latent, positions, args.rope_dim, args.rope_theta,
                        args.max_seq_len).view(b, t, -1)
        if attn.writes_latent:
            latents[attn.layer] = kv
        if attn.writes_index_keys:
            keys = apply_rope(attn.index_norm(attn.wk_index(latent.detach())), positions,
                              attn.index_rope_dim, args.rope_theta, args.max_seq_len)
            index_keys[attn.layer] = keys.view(b, t, -1)
        scale = attn.head_dim ** -0.5
        scores = [torch.einsum("bthd,bsd->bhts", q, kv).float() * scale]
        scores[0] = scores[0].masked_fill(~win, float("-inf"))
        values = [kv]
        gkv = attn.global_kv
        if gkv.source is not None:
            glob = pool(latents[gkv.source], gkv.ratio)
            n = glob.shape[1]
            visible = visible_mask(visible_counts(torch.arange(t, device=dev), t, gkv.ratio), n)
            dense = torch.einsum("bthd,bnd->bhtn", q, glob).float() * scale
            dense = dense.masked_fill(~visible, float("-inf"))
            allowed = visible[None].expand(b, t, n)
            if attn.runs_indexer:
                index = attn.index_query(q_latent.detach(), positions,
                                         attn.index_weights(h.detach()))
                ikeys = pool(index_keys[index.source], gkv.ratio)
                iq = index.q.view(b, t, *index.q.shape[1:])
                s = torch.einsum("bthd,bnd->bthn", iq, ikeys).relu()
                iscore = (index.weights.view(b, t, -1, 1).to(s.dtype) * s).sum(2).float()
                with torch.no_grad():
                    sel = select_top_k(iscore.flatten(0, 1), visible.repeat(b, 1), index.top_k)
                    selections[attn.layer] = selection_mask(sel, n).view(b, t, n)
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
        o = attn.project_out(o.reshape(b * t, attn.n_heads, attn.head_dim))
        streams = block.attn_hc.post(streams, o, post)
        f, post = block.ffn_hc.pre(streams, block.ffn_norm)
        streams = block.ffn_hc.post(streams, dense_moe(block.moe, f), post)
    picked = torch.stack(streams, dim=1)
    weights = torch.softmax(model.head_hc.float(), dim=0)
    last = (picked.float() * weights[None, :, None]).sum(dim=1).to(picked.dtype)
    logits = model.head(model.norm(last)).float().view(b, t, -1)
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
