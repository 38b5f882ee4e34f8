"""A DeepSeek-V4.1-style layer stack in plain PyTorch, readable top to bottom.

    tokens -> embedding -> mHC streams
      -> window-only layers (window ring)
      -> encoder layers (window ring + compressed KV of the closest KV source)
      -> layer S: write batch KV (its latent for every row) | the rest of S
      -> decoder layers (window ring + S's global KV)          } the replay layers
      -> head on the logits rows

Every attention block attends to [its window KV] + [the global/compressed KV visible at the row],
one softmax with a per-head sink. K and V are one shared latent (MQA) with partial RoPE. A layer's
input is ``hc_mult`` residual streams (mHC), a tuple of tensors. Layers read per-step metadata,
the KV cache and the replay route from the forward context only, so the same code runs eagerly,
in graph segments and in the replay batch, and the model holds no per-engine state: many engines
(and the oracle) share one model, each forward on the cache its context names.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from swa_bench.kernels import (
    Kernels,
    expert_gemm,
    fused_hc,
    fused_latents,
    fused_moe,
    fused_rope,
    gate_in_route,
    hc_gains,
    hc_gated_pre,
    hc_post,
    hc_post_gated_pre,
    hc_pre,
    hc_pre_folds_norm,
    moe_combine,
    moe_route,
    moe_sort,
    norm_latents,
    rope_,
    silu_mul,
)
from swa_bench.model.args import ModelArgs
from swa_bench.model.attention import attend
from swa_bench.model.cache import KVCache
from swa_bench.model.forward_context import active_kernels, get_forward_context
from swa_bench.model.graph_breaks import eager_break
from swa_bench.model.key_sources import GlobalKV
from swa_bench.model.sparse_attention import IndexQuery, select

Streams = tuple[torch.Tensor, ...]
# Runs the rest of S and the decoder: (S's KV of every batch row, *per-row inputs) -> streams.
ReplayLayers = Callable[..., Streams]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 statistics, one fused kernel on CUDA (torch's composite of the same ops on CPU)."""
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is being captured: a cache filled now would hold a tensor
    of the graph's private pool, so derived tensors are then computed without being kept."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


_ROPE_TABLES: dict[tuple[torch.device, int, float, int], tuple[torch.Tensor, torch.Tensor]] = {}


def rope_table(
    device: torch.device, rope_dim: int, theta: float, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos, sin [length, rope_dim // 2]`` of every position, computed once per shape: a
    row's angles are read with one gather instead of recomputed by every layer."""
    key = (device, rope_dim, theta, length)
    table = _ROPE_TABLES.get(key)
    if table is None:
        half = rope_dim // 2
        freqs = theta ** (-torch.arange(half, device=device, dtype=torch.float32) / half)
        angles = torch.arange(length, device=device, dtype=torch.float32)[:, None] * freqs[None, :]
        table = angles.cos(), angles.sin()
        if not capturing(device):
            _ROPE_TABLES[key] = table
    return table


def apply_rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    rope_dim: int,
    theta: float,
    max_len: int,
    *,
    inplace: bool = False,
) -> torch.Tensor:
    """Rotates the last ``rope_dim`` features of ``x [T, ..., D]`` by each row's position
    (``< max_len``), in fp32. ``inplace`` writes into ``x`` (a fresh projection nobody else
    reads): no copy of the unrotated features. One Triton launch where ``fused_rope`` allows on
    the context's kernels."""
    if rope_dim == 0:
        return x
    half = rope_dim // 2
    cos_table, sin_table = rope_table(x.device, rope_dim, theta, max_len)
    kernels = active_kernels()
    if fused_rope(kernels, x):
        return rope_(kernels, x if inplace else x.clone(), positions, cos_table, sin_table,
                     rope_dim)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos = cos_table.index_select(0, positions).view(shape)
    sin = sin_table.index_select(0, positions).view(shape)
    out = x if inplace else x.clone()
    a, b = x[..., -rope_dim:-half], x[..., -half:]
    first = (a * cos).addcmul_(b, sin, value=-1)
    second = (a * sin).addcmul_(b, cos)
    out[..., -rope_dim:-half] = first
    out[..., -half:] = second
    return out


HC_ROWS = 8192


class HyperConnection(nn.Module):
    """mHC around one sublayer: mixes the streams into its input and writes its output back.

    ``pre`` takes a per-row weighted sum of the streams (dynamic weights from the normed streams);
    ``post`` mixes the streams with a doubly-stochastic matrix and adds the sublayer output with
    per-row, per-stream gains. ``hc_mult == 1`` is a plain pre-norm residual.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        hc, self.hc = args.hc_mult, args.hc_mult
        if hc > 1:
            self.norm = RMSNorm(hc * args.dim, args.norm_eps)
            self.dynamic = nn.Linear(hc * args.dim, 2 * hc, bias=False)
            self.static_pre = nn.Parameter(torch.zeros(hc))
            self.static_post = nn.Parameter(torch.zeros(hc))
            self.res_logits = nn.Parameter(torch.zeros(hc, hc))

    def gains(self, streams: Streams) -> torch.Tensor:
        """The dynamic gains ``[T, 2 hc]`` by row chunks: the normed concatenation is ``hc``
        times a stream's size (5 GiB per 64K rows at V4.1-Flash's width)."""
        rows = streams[0].shape[0]
        if rows <= HC_ROWS:
            return self.dynamic(self.norm(torch.cat(streams, dim=-1))).float()
        return torch.cat([
            self.dynamic(self.norm(torch.cat([s[r : r + HC_ROWS] for s in streams], dim=-1)))
            for r in range(0, rows, HC_ROWS)
        ]).float()

    def pre(self, streams: Streams, norm: RMSNorm | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sublayer's input, normed by ``norm`` when given, and the ``post`` gains."""
        if self.hc == 1:
            return (streams[0] if norm is None else norm(streams[0])), None
        kernels = active_kernels()
        if fused_hc(kernels, streams):
            statics = (self.static_pre, self.static_post)
            if hc_pre_folds_norm(streams[0].shape[1]):  # narrow rows: gates, sum, norm at once
                return hc_gated_pre(kernels, streams, self.norm.weight, self.dynamic.weight,
                                    self.norm.eps, statics,
                                    None if norm is None else (norm.weight, norm.eps))
            gates = hc_gains(kernels, streams, self.norm.weight, self.dynamic.weight,
                             self.norm.eps, statics)  # the gates in one kernel, the sum in another
            x = hc_pre(kernels, streams, gates[:, : self.hc])
            return (x if norm is None else norm(x)), gates[:, self.hc :]
        gains = self.gains(streams)
        pre = torch.sigmoid(gains[:, : self.hc] + self.static_pre)
        post = 2 * torch.sigmoid(gains[:, self.hc :] + self.static_post)
        x = weighted_sum(streams, [pre[:, j : j + 1] for j in range(self.hc)])
        return (x if norm is None else norm(x)), post

    def post_then_pre(self, streams: Streams, out: torch.Tensor, post: torch.Tensor | None,
                      nxt: HyperConnection, norm: RMSNorm
                      ) -> tuple[Streams, torch.Tensor, torch.Tensor | None]:
        """``post`` of this sublayer, then ``nxt.pre(new streams, norm)``: the new streams, the
        next sublayer's input and its post gains. One launch instead of three where the fused
        kernels take the streams and a program holds a row (``hc_pre_folds_norm``)."""
        kernels = active_kernels()
        if (self.hc > 1 and hc_pre_folds_norm(streams[0].shape[1])
                and fused_hc(kernels, streams, out)):
            return hc_post_gated_pre(
                kernels, streams, out, post, self.mixing(), nxt.norm.weight, nxt.dynamic.weight,
                nxt.norm.eps, (nxt.static_pre, nxt.static_post), (norm.weight, norm.eps))
        streams = self.post(streams, out, post)
        return (streams, *nxt.pre(streams, norm))

    def post(self, streams: Streams, out: torch.Tensor, post: torch.Tensor | None) -> Streams:
        if self.hc == 1:
            return (streams[0] + out,)
        mix = self.mixing()
        kernels = active_kernels()
        if fused_hc(kernels, streams, out):
            return hc_post(kernels, streams, out, post, mix)
        return tuple(
            weighted_sum((out, *streams), [post[:, i : i + 1], *mix[i]]) for i in range(self.hc)
        )

    def mixing(self) -> torch.Tensor:
        """``sinkhorn(res_logits)``, a function of the weights alone: computed once, again only
        when ``res_logits`` changes (its version counter), not by every forward. A forward that
        trains ``res_logits`` always computes it (it needs the gradient, and a captured training
        step must hold the computation, not a constant)."""
        logits = self.res_logits
        if logits.requires_grad and torch.is_grad_enabled():
            return sinkhorn(logits.float())
        return derived_from_weights(self, "_mixing", (logits,), lambda: sinkhorn(logits.float()))


def derived_from_weights(owner: nn.Module, name: str, weights: Sequence[torch.Tensor],
                         compute: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``compute()``, a function of ``weights`` alone, kept on ``owner`` as ``name`` and computed
    again only when a weight changes (its storage or version counter). Not kept while a CUDA
    stream captures: the tensor would live in the graph's private pool."""
    key = tuple((w.data_ptr(), w._version) for w in weights)
    cached = getattr(owner, name, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    value = compute()
    if not capturing(weights[0].device):
        setattr(owner, name, (key, value))
    return value


def weighted_sum(terms: Sequence[torch.Tensor], gains: Sequence[torch.Tensor]) -> torch.Tensor:
    """``sum_j gains[j] * terms[j]`` accumulated in fp32 (gains fp32, per row ``[T, 1]`` or 0-dim)
    and rounded once to the terms' dtype. Mixed-dtype kernels read the bf16 terms directly: no
    fp32 copy of a stream is ever materialised."""
    acc = terms[0] * gains[0]
    for term, gain in zip(terms[1:], gains[1:], strict=True):
        acc.addcmul_(term, gain)
    return acc.to(terms[0].dtype)


def sinkhorn(logits: torch.Tensor, iters: int = 8) -> torch.Tensor:
    """A doubly-stochastic matrix from logits: residual mixing keeps the streams' total mass."""
    m = logits.exp()
    for _ in range(iters):
        m = m / m.sum(dim=1, keepdim=True)
        m = m / m.sum(dim=0, keepdim=True)
    return m


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.args, self.layer = args, layer
        self.n_heads, self.head_dim = args.n_heads, args.head_dim
        self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(args.q_lora_rank, args.norm_eps)
        self.wq_b = nn.Linear(args.q_lora_rank, args.n_heads * args.head_dim, bias=False)
        self.wkv = nn.Linear(args.dim, args.head_dim, bias=False)
        self.kv_norm = RMSNorm(args.head_dim, args.norm_eps)
        group_in = args.n_heads // args.o_groups * args.head_dim
        self.wo_a = nn.Parameter(torch.empty(args.o_groups, group_in, args.o_lora_rank))
        self.wo_b = nn.Linear(args.o_groups * args.o_lora_rank, args.dim, bias=False)
        self.sink = nn.Parameter(torch.zeros(args.n_heads))
        source = args.kv_source_for(layer)
        self.writes_latent = layer in args.kv_sources
        if source is None:
            self.global_kv = GlobalKV(None)
        elif layer >= args.last_kv_source:
            self.global_kv = GlobalKV(args.last_kv_source)
        else:
            self.global_kv = GlobalKV(source, args.compress_ratio)
        # Sparse attention: the index source whose selection this layer reads (None: dense).
        self.index_source = args.index_source_for(layer) if source is not None else None
        self.runs_indexer = self.index_source == layer
        if self.runs_indexer:
            n_index, d_index = args.index_n_heads, args.index_head_dim
            self.wq_index = nn.Linear(args.q_lora_rank, n_index * d_index, bias=False)
            self.w_index = nn.Linear(args.dim, n_index, bias=False)
        self.writes_index_keys = args.sparse and self.writes_latent
        if self.writes_index_keys:
            self.wk_index = nn.Linear(args.head_dim, args.index_head_dim, bias=False)
            self.index_norm = RMSNorm(args.index_head_dim, args.norm_eps)

    def index_weights(self, x: torch.Tensor) -> torch.Tensor | None:
        """The indexer's per-head weights of an index source's rows (None elsewhere)."""
        if not self.runs_indexer:
            return None
        scale = (self.args.index_head_dim * self.args.index_n_heads) ** -0.5
        return self.w_index(x) * scale

    def index_query(
        self, q_latent: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor
    ) -> IndexQuery:
        n_index, d_index = self.args.index_n_heads, self.args.index_head_dim
        q = self.wq_index(q_latent).view(q_latent.shape[0], n_index, d_index)
        q = self.rope(q, positions, self.index_rope_dim, inplace=True)
        source = self.args.kv_source_for(self.layer)
        return IndexQuery(q, weights, source, self.args.index_topk)

    @property
    def index_rope_dim(self) -> int:
        return min(self.args.rope_dim, self.args.index_head_dim // 2 * 2)

    def project_latents(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The query latent and the shared K=V latent of every row (stored as ``project_kv``
        stores it). On the inference kernels: one GEMM over both projections' stacked weights
        and one launch for both norms and the RoPE, three launches where the steps take eight."""
        args = self.args
        kernels = active_kernels()
        if not fused_latents(kernels, x, args.q_lora_rank, args.head_dim):
            return self.q_norm(self.wq_a(x)), self.project_kv(x)
        positions = get_forward_context().attn_metadata.positions
        cos_table, sin_table = rope_table(x.device, args.rope_dim, args.rope_theta,
                                          args.max_seq_len)
        q_latent, kv, latent = norm_latents(
            kernels, F.linear(x, self.stacked_latent_weight()), args.q_lora_rank,
            (self.q_norm.weight, self.q_norm.eps), (self.kv_norm.weight, self.kv_norm.eps),
            positions, cos_table, sin_table, args.rope_dim, keep_latent=self.writes_index_keys)
        self.store_kv(kv, latent)
        return q_latent, kv

    def stacked_latent_weight(self) -> torch.Tensor:
        """``[wq_a; wkv]``, stacked once and again only when either weight changes (their
        version counters): an inference copy of ``(q_lora_rank + head_dim) x dim`` weights."""
        weights = (self.wq_a.weight, self.wkv.weight)
        return derived_from_weights(self, "_stacked_latent_weight", weights,
                                    lambda: torch.cat(weights))

    def project_kv(self, x: torch.Tensor) -> torch.Tensor:
        """The shared K=V latent of every row, by the PyTorch steps (layer S's part on every
        row, and the path where ``project_latents`` does not fuse), stored by ``store_kv``."""
        latent = self.kv_norm(self.wkv(x))
        positions = get_forward_context().attn_metadata.positions
        kv = self.rope(latent, positions, self.args.rope_dim)
        self.store_kv(kv, latent)
        return kv

    def store_kv(self, kv: torch.Tensor, latent: torch.Tensor | None) -> None:
        """A KV source writes ``kv`` to its latent cache and, with sparse attention, its index
        keys from ``latent`` (the normed latent before RoPE)."""
        ctx = get_forward_context()
        meta = ctx.attn_metadata
        if self.writes_latent:
            ctx.cache.latent[self.layer].index_copy_(0, meta.global_slot, kv)
        if self.writes_index_keys:
            keys = self.rope(self.index_norm(self.wk_index(latent)), meta.positions,
                             self.index_rope_dim, inplace=True)
            ctx.cache.index_keys[self.layer].index_copy_(0, meta.global_slot, keys)

    def project_q(self, q_latent: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q = self.wq_b(q_latent).view(-1, self.n_heads, self.head_dim)
        return self.rope(q, positions, self.args.rope_dim, inplace=True)

    def rope(
        self, x: torch.Tensor, positions: torch.Tensor, rope_dim: int, *, inplace: bool = False
    ) -> torch.Tensor:
        args = self.args
        return apply_rope(
            x, positions, rope_dim, args.rope_theta, args.max_seq_len, inplace=inplace
        )

    def forward(self, x: torch.Tensor, kv: torch.Tensor | None = None) -> torch.Tensor:
        """``kv`` is given for the first replay layer: the batch KV it wrote for every row."""
        if kv is None:
            q_latent, kv = self.project_latents(x)
        else:
            q_latent = self.q_norm(self.wq_a(x))
        return self.project_out(attention_op(q_latent, kv, self.index_weights(x), self.layer,
                                             self))

    def project_out(self, o: torch.Tensor) -> torch.Tensor:
        """The heads ``[T, H, D]`` back to the model width: each group's low-rank projection as
        one batched GEMM over a strided view of the heads (no transposed copy of them, 1 GB a
        layer at 16K tokens) that writes token-major rows (no copy of its output either, where
        no gradient is wanted: ``out=`` has no backward), then ``wo_b``."""
        rows, groups = o.shape[0], self.args.o_groups
        grouped = o.reshape(rows, groups, self.wo_a.shape[1]).transpose(0, 1)
        if torch.is_grad_enabled() and (o.requires_grad or self.wo_a.requires_grad):
            return self.wo_b(torch.bmm(grouped, self.wo_a).transpose(0, 1).flatten(1))
        low = o.new_empty(rows, groups, self.wo_a.shape[2])  # bmm writes it through a view
        torch.bmm(grouped, self.wo_a, out=low.transpose(0, 1))
        return self.wo_b(low.flatten(1))


@eager_break("attention")
def attention_op(
    q_latent: torch.Tensor,
    kv: torch.Tensor,
    index_weights: torch.Tensor | None,
    layer: int,
    attn: Attention,
) -> torch.Tensor:
    """Attention proper: an eager break in PIECEWISE graphs (shapes follow the step's metadata).

    It takes the low-rank query latent, not the heads: a captured graph keeps every break's
    inputs alive, and at 64K tokens 64 heads x 512 of query per layer would fill the GPU. An
    index source publishes its selection in the forward context for the layers after it.
    """
    ctx = get_forward_context()
    meta = ctx.metadata_for(layer)
    q = attn.project_q(q_latent, meta.positions)
    if attn.runs_indexer:
        index = attn.index_query(q_latent, meta.positions, index_weights)
        if ctx.index_queries is not None:
            ctx.index_queries[layer] = index
        given = ctx.given_selection.get(layer)
        if given is None:
            given = select(meta, ctx.cache, index, attn.global_kv.ratio, ctx.shape_mode)
        ctx.index_selection[layer] = given
    selection = None if attn.index_source is None else ctx.index_selection[attn.index_source]
    return attend(q, kv, meta, ctx.cache, layer, attn.global_kv, attn.sink, selection,
                  ctx.shape_mode)


def replay_layers(
    run_layers: ReplayLayers, batch_kv: torch.Tensor, *inputs: torch.Tensor
) -> Streams:
    """The one route to the rest of S and the decoder: the whole batch, or the context's replay
    route when the context's builder decided the step runs on kept rows. Captured inside a graph
    segment when the step has no replay batch; an eager break when it has one."""
    if get_forward_context().replay_batch is None:
        return run_layers(batch_kv, *inputs)
    return on_replay_batch(run_layers, batch_kv, *inputs)


@eager_break("replay_layers")
def on_replay_batch(
    run_layers: ReplayLayers, batch_kv: torch.Tensor, *inputs: torch.Tensor
) -> Streams:
    """The replay-batch route, read from the context at every call (a PIECEWISE graph replays the
    break under each step's context, so its kept rows are the step's, not the capture's)."""
    return get_forward_context().replay_batch.run(run_layers, batch_kv, *inputs)


GROUPED_FALLBACK_ELEMENTS = 1 << 28  # outputs of the fallback's dense GEMM per chunk of groups


def grouped_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` rows sorted by group, ``w [G, N, K]``, ``ends [G]`` int32 cumulative row ends:
    row block g times ``w[g].T``. ``torch._grouped_mm`` (CUDA bf16 on sm90, and CPU) where it
    exists (CPU's is fast only on a row-major ``[G, K, N]``: the small CPU weights are copied).

    Elsewhere (fp32/fp16 on CUDA: the check models; their inference on the Triton backend takes
    ``expert_gemm`` instead) one GEMM runs every row against a chunk of groups' weights at once
    and each row keeps its own group's columns: device-side groups, no host read of ``ends``, so
    a captured graph replays the routing of each step (a host loop would freeze the capture's
    partition), eager and graph runs compute it alike, and a small step launches a few kernels,
    not a few per group. G times the arithmetic: never the timed bf16 path. Rows past
    ``ends[-1]`` come out zero."""
    cpu = x.device.type == "cpu"
    if (cpu and hasattr(torch, "_grouped_mm")) or native_grouped_mm(x):
        b = w.transpose(-2, -1)
        return torch._grouped_mm(x, b.contiguous() if cpu else b, offs=ends)
    return grouped_mm_dense(x, w, ends)


def native_grouped_mm(x: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs ``x``'s GEMMs on CUDA (bf16, sm90); elsewhere the Triton
    backend's inference takes ``expert_gemm``, training and the PyTorch backend the fallback."""
    return hasattr(torch, "_grouped_mm") and x.device.type == "cuda" and x.dtype == torch.bfloat16


def grouped_mm_dense(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``grouped_mm`` by dense GEMMs over chunks of groups, each row keeping its group's part."""
    m, (g_total, n, k) = x.shape[0], w.shape
    row = torch.arange(m, device=x.device, dtype=ends.dtype)
    group = torch.searchsorted(ends, row, right=True)
    per_chunk = max(1, GROUPED_FALLBACK_ELEMENTS // max(1, m * n))
    out = None
    for g0 in range(0, g_total, per_chunk):
        g1 = min(g_total, g0 + per_chunk)
        y = (x @ w[g0:g1].reshape(-1, k).t()).view(m, g1 - g0, n)
        local = group - g0 if g0 else group
        if g1 - g0 == 1:
            mine = y[:, 0]
        else:
            pick = local.clamp(0, g1 - g0 - 1)
            mine = y.gather(1, pick.view(m, 1, 1).expand(m, 1, n)).squeeze(1)
        inside = (local < g1 - g0) if g0 == 0 else (group >= g0) & (group < g1)
        out = torch.where(inside[:, None], mine, 0.0 if out is None else out)
    return out


class RoutedExperts(nn.Module):
    """Routed expert weights: ``w13 [E, 2 * inter, dim]`` (gate, up), ``w2 [E, dim, inter]``."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        e, inter = args.n_routed_experts, args.moe_inter_dim
        self.w13 = nn.Parameter(torch.empty(e, 2 * inter, args.dim))
        self.w2 = nn.Parameter(torch.empty(e, args.dim, inter))


MOE_ROWS = 16384  # tokens routed per chunk: the sorted copies stay a few GiB at 64K tokens


class MoE(nn.Module):
    """Top-k routed experts plus shared experts, dispatched as serving engines do.

    Each token's (token, expert) pairs are sorted by expert (stable, so ties keep token order), the
    rows are gathered and run through a grouped GEMM whose group ends are computed on the device
    (``searchsorted``, no host sync: capturable at static shapes); outputs return to their pairs
    and are combined with the routing weights. Unselected experts do no work.
    """

    def __init__(self, args: ModelArgs, shared_experts: RoutedExperts | None = None) -> None:
        super().__init__()
        self.n_experts, self.top_k = args.n_routed_experts, args.n_activated_experts
        self.inter = args.moe_inter_dim
        self.gate = nn.Linear(args.dim, args.n_routed_experts, bias=False)
        # A pool shared with other layers stays unregistered (the model owns it).
        self.own_experts = RoutedExperts(args) if shared_experts is None else None
        self.shared_pool = (shared_experts,)
        shared = args.n_shared_experts * self.inter
        self.shared_w13 = nn.Linear(args.dim, 2 * shared, bias=False) if shared else None
        self.shared_w2 = nn.Linear(shared, args.dim, bias=False) if shared else None

    @property
    def experts(self) -> RoutedExperts:
        return self.own_experts if self.own_experts is not None else self.shared_pool[0]

    def route(self, x: torch.Tensor, fused: Kernels | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's top-k experts ``[T, k]`` and their normalised sigmoid weights (``fused``:
        in one kernel, ``moe_route``, with the gate's product where ``gate_in_route``)."""
        if fused is not None and gate_in_route(*self.gate.weight.shape):
            return moe_route(fused, x, self.top_k, self.gate.weight)
        logits = self.gate(x)
        if fused is not None:
            return moe_route(fused, logits, self.top_k)
        scores = torch.sigmoid(logits if logits.dtype == torch.float32 else logits.float())
        top = scores.topk(self.top_k, dim=-1)
        return top.indices, top.values / top.values.sum(dim=-1, keepdim=True)

    def routed(self, x: torch.Tensor, out: torch.Tensor | None = None,
               fused: Kernels | None = None, shared: torch.Tensor | None = None) -> torch.Tensor:
        """The routed experts' sum for each row of ``x``, plus ``shared`` (the shared experts'
        output of those rows) when given, written into ``out`` when given; ``fused``: the
        inference kernels these rows run on (``fused_moe``, decided once per forward), None: the
        PyTorch steps."""
        t, k = x.shape[0], self.top_k
        experts, weights = self.route(x, fused)
        if fused is not None:
            order, ends = moe_sort(fused, experts, self.n_experts)
        else:
            pairs = experts.flatten()
            order = torch.argsort(pairs, stable=True)
            bounds = torch.arange(1, self.n_experts + 1, device=x.device)
            ends = torch.searchsorted(pairs[order], bounds, out_int32=True)
        w = self.experts
        if fused is not None and not native_grouped_mm(x):  # gather, SwiGLU, scatter in GEMMs
            a = expert_gemm(fused, x, w.w13, ends, order, top_k=k, swiglu=True)
            return moe_combine(fused, expert_gemm(fused, a, w.w2, ends, order, scatter=True),
                               None, weights, out, shared)
        h = grouped_mm(x.index_select(0, order // k), w.w13, ends)
        if fused is not None:
            return moe_combine(fused, grouped_mm(silu_mul(fused, h), w.w2, ends), order,
                               weights, out, shared)
        g, u = h.chunk(2, dim=-1)
        y = grouped_mm(F.silu(g) * u, w.w2, ends)
        y = y.mul_(weights.flatten()[order].to(y.dtype)[:, None])
        y = torch.zeros_like(y).index_copy_(0, order, y)
        summed = y.view(t, k, y.shape[-1]).sum(dim=1, dtype=torch.float32).to(x.dtype)
        if shared is not None:
            summed = summed + shared
        return summed if out is None else out.copy_(summed)

    def shared_experts(self, x: torch.Tensor, fused: Kernels | None) -> torch.Tensor | None:
        if self.shared_w13 is None:
            return None
        if fused is not None and not native_grouped_mm(x):  # the GEMM and SwiGLU in one launch
            return self.shared_w2(expert_gemm(fused, x, self.shared_w13.weight[None], None, None,
                                              swiglu=True))
        h = self.shared_w13(x)
        if fused is not None:
            return self.shared_w2(silu_mul(fused, h))
        s1, s3 = h.chunk(2, dim=-1)
        return self.shared_w2(F.silu(s1) * s3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The shared experts run first: the routed experts' combine adds their output."""
        kernels = active_kernels()
        fused = kernels if fused_moe(kernels, x) else None
        shared = self.shared_experts(x, fused)
        if x.shape[0] <= MOE_ROWS:
            return self.routed(x, fused=fused, shared=shared)
        out = x.new_empty(x.shape)
        for r in range(0, x.shape[0], MOE_ROWS):
            self.routed(x[r : r + MOE_ROWS], out[r : r + MOE_ROWS], fused,
                        None if shared is None else shared[r : r + MOE_ROWS])
        return out


class Block(nn.Module):
    def __init__(
        self, args: ModelArgs, layer: int, experts: RoutedExperts | None = None
    ) -> None:
        super().__init__()
        self.layer = layer
        self.attn_hc, self.ffn_hc = HyperConnection(args), HyperConnection(args)
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.attn = Attention(args, layer)
        self.moe = MoE(args, experts)

    def forward(self, streams: Streams) -> Streams:
        x, post = self.attn_hc.pre(streams, self.attn_norm)
        return self.finish(streams, x, post)

    def write_batch_kv(self, streams: Streams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer S's part that runs on every row: its attention input and its KV for every row."""
        x, post = self.attn_hc.pre(streams, self.attn_norm)
        return x, post, self.attn.project_kv(x)

    def finish(
        self,
        streams: Streams,
        x: torch.Tensor,
        post: torch.Tensor | None,
        kv: torch.Tensor | None = None,
    ) -> Streams:
        streams, h, post = self.attn_hc.post_then_pre(streams, self.attn(x, kv), post,
                                                      self.ffn_hc, self.ffn_norm)
        return self.ffn_hc.post(streams, self.moe(h), post)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        pools = args.expert_weight_pools
        self.expert_pools = nn.ModuleList(RoutedExperts(args) for _ in range(pools or 0))
        self.layers = nn.ModuleList(
            Block(args, i, self.expert_pools[i % pools] if pools else None)
            for i in range(args.n_layers)
        )
        self.head_hc = nn.Parameter(torch.zeros(args.hc_mult))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.head = nn.Linear(args.dim, args.vocab_size, bias=False)

    @property
    def last_kv_source(self) -> Block:
        return self.layers[self.args.last_kv_source]

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, Streams]:
        """Logits at the context's logits rows, and the final streams of every row."""
        x = self.embed(input_ids)
        streams: Streams = (x,) * self.args.hc_mult  # read-only: the first post makes new ones
        for block in self.layers[: self.args.last_kv_source]:
            streams = block(streams)
        x_s, post_s, kv_s = self.last_kv_source.write_batch_kv(streams)
        streams = replay_layers(self.run_replay_layers, kv_s, *streams, x_s, post_s)
        return self.compute_logits(streams), streams

    def run_replay_layers(self, kv_s: torch.Tensor, *inputs: torch.Tensor) -> Streams:
        """The rest of S and the decoder on the rows given (the batch, or the replay batch).

        ``kv_s`` is S's KV of every batch row; the other inputs are per-row: the mHC streams,
        S's attention input and its post gains.
        """
        hc = self.args.hc_mult
        streams, x_s, post_s = tuple(inputs[:hc]), inputs[hc], inputs[hc + 1]
        streams = self.last_kv_source.finish(streams, x_s, post_s if hc > 1 else None, kv_s)
        for block in self.layers[self.args.last_kv_source + 1 :]:
            streams = block(streams)
        return streams

    def compute_logits(self, streams: Streams) -> torch.Tensor:
        rows = get_forward_context().logits_indices
        picked = torch.stack([s.index_select(0, rows) for s in streams], dim=1)
        weights = torch.softmax(self.head_hc.float(), dim=0)
        h = (picked.float() * weights[None, :, None]).sum(dim=1).to(picked.dtype)
        return self.head(self.norm(h)).float()


def init_weights(model: Transformer, seed: int) -> None:
    """Dummy weights from a seed, drawn where the model lives (a V4.1-shape model has billions),
    scaled so activations stay near unit size at any depth."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            p.normal_(generator=gen)
            if name.endswith(("sink", "res_logits", "static_pre", "static_post", "head_hc")):
                p.mul_(0.5)
            elif name != "embed.weight":
                fan_in = p.shape[-2] if name.endswith("wo_a") else p.shape[-1]
                p.mul_(1 / math.sqrt(fan_in))


def build_model(
    args: ModelArgs,
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[Transformer, KVCache]:
    """A model with seeded dummy weights, and an empty cache for it (the model holds none: the
    forward context of each forward names the cache it runs on)."""
    device = torch.device(device)
    with torch.device("meta"):
        model = Transformer(args)
    model = model.to(dtype).to_empty(device=device)  # allocated in dtype: no fp32 copy
    init_weights(model, seed)
    model.eval().requires_grad_(False)
    return model, KVCache(args, device, dtype)
