"""The attention layer: low-rank query, one shared K=V latent (MQA) with partial RoPE, the
window and global key sources, the indexer's query side, and the grouped low-rank output. A KV
source also owns its compressor (``model.compressor``): its compressed KV and index keys."""

from __future__ import annotations

import torch
from torch import nn

from swa_bench.kernels import fused_latents, norm_latents
from swa_bench.model.args import ModelArgs
from swa_bench.model.attention import attend
from swa_bench.model.compressor import Compressor
from swa_bench.model.derived import derived_from_weights
from swa_bench.model.forward_context import active_kernels, get_forward_context
from swa_bench.model.graph_breaks import eager_break
from swa_bench.model.key_sources import GlobalKV
from swa_bench.model.norm import RMSNorm
from swa_bench.model.precision import (
    compressed_kv,
    fp8_linear,
    fp8_matmul,
    index_vectors,
    linear_input,
    window_kv,
)
from swa_bench.model.rope import RopeSpec, apply_rope, rope_table
from swa_bench.model.sparse_attention import CandidateBlocks, IndexQuery, Selection, select


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.args, self.layer = args, layer
        self.n_heads, self.head_dim = args.n_heads, args.head_dim
        # This layer's RoPE table, for everything it rotates (DeepSeek-V4.1 `Attention.__init__`).
        self.rope_spec = RopeSpec.for_layer(args, layer)
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
        # A KV source's compressed KV, apart from its window latent (DeepSeek-V4.1 inference/
        # model.py ``Attention.compressor``).
        self.compressor = Compressor(args, layer) if layer in args.kv_sources else None
        if source is None:
            self.global_kv = GlobalKV(None)
        elif layer >= args.last_kv_source:
            self.global_kv = GlobalKV(args.last_kv_source)
        else:
            self.global_kv = GlobalKV(source, args.compress_ratio)
        # Sparse attention: the index source whose selection this layer reads (None: dense).
        self.index_source = args.index_source_for(layer) if source is not None else None
        self.runs_indexer = self.index_source == layer
        # S's indexer runs on every row before the cut (``publish_selection``); its selection and
        # candidate blocks reach the replay rows as per-row inputs.
        self.indexes_before_cut = self.runs_indexer and layer == args.last_kv_source
        if self.runs_indexer:
            n_index, d_index = args.index_n_heads, args.index_head_dim
            self.wq_index = nn.Linear(args.q_lora_rank, n_index * d_index, bias=False)
            self.w_index = nn.Linear(args.dim, n_index, bias=False)
        self.writes_index_keys = args.sparse and self.compressor is not None
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
        self, q_latent: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor,
        within: torch.Tensor | None = None,
    ) -> IndexQuery:
        """The rows' index query; S's publishes its candidate blocks, a later index source's
        picks among ``within`` (S's candidate blocks of these rows) with candidates on."""
        n_index, d_index = self.args.index_n_heads, self.args.index_head_dim
        args = self.args
        q = fp8_linear(args, self.wq_index, linear_input(args, q_latent))
        q = q.view(q_latent.shape[0], n_index, d_index)
        q = index_vectors(args, self.rope(q, positions, self.index_rope_dim, inplace=True))
        source = args.kv_source_for(self.layer)
        if not args.candidates or self.layer < args.last_kv_source:
            return IndexQuery(q, weights, source, args.index_topk)
        if self.indexes_before_cut:
            rule = CandidateBlocks(args.candidate_topk_blocks, args.candidate_block_size,
                                   args.candidate_width())
            return IndexQuery(q, weights, source, args.index_topk, publishes=rule)
        if within is None:
            raise RuntimeError(f"layer {self.layer} selects among S's candidate blocks, but none "
                               "were published for these rows")
        return IndexQuery(q, weights, source, args.index_topk, within=within,
                          block_size=args.candidate_block_size)

    @property
    def index_rope_dim(self) -> int:
        return min(self.args.rope_dim, self.args.index_head_dim // 2 * 2)

    def project_latents(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The query latent and the shared K=V latent of every row (a KV source's compressor
        writes as in ``project_kv``). On the inference kernels: one GEMM over both projections'
        stacked weights and one launch for both norms and the RoPE, three launches where the
        steps take eight."""
        args = self.args
        kernels = active_kernels()
        x_in = linear_input(args, x)
        if not fused_latents(kernels, x, args.q_lora_rank, args.head_dim):
            return self.q_norm(fp8_linear(args, self.wq_a, x_in)), self.project_kv(x, x_in)
        positions = get_forward_context().attn_metadata.positions
        cos_table, sin_table = rope_table(x.device, self.rope_spec)
        q_latent, kv, _ = norm_latents(
            kernels, fp8_matmul(args, x_in, self.stacked_latent_weight, self,
                                "_stacked_latent_fp8", (self.wq_a.weight, self.wkv.weight)),
            args.q_lora_rank,
            (self.q_norm.weight, self.q_norm.eps), (self.kv_norm.weight, self.kv_norm.eps),
            positions, cos_table, sin_table, args.rope_dim)
        self.store_kv(x)
        return q_latent, window_kv(args, kv)

    def stacked_latent_weight(self) -> torch.Tensor:
        """``[wq_a; wkv]``, stacked once and again only when either weight changes (their
        version counters): an inference copy of ``(q_lora_rank + head_dim) x dim`` weights."""
        weights = (self.wq_a.weight, self.wkv.weight)
        return derived_from_weights(self, "_stacked_latent_weight", weights,
                                    lambda: torch.cat(weights))

    def project_kv(self, x: torch.Tensor, x_in: torch.Tensor | None = None) -> torch.Tensor:
        """The window K=V latent of every row by the PyTorch steps (layer S's part on every row,
        and the path where ``project_latents`` does not fuse), as stored (``window_kv``); a KV
        source's compressor writes from the same rows (``store_kv``). ``x_in``: ``x`` as the
        fp8 GEMM reads it, when the caller has it."""
        positions = get_forward_context().attn_metadata.positions
        x_in = linear_input(self.args, x) if x_in is None else x_in
        kv = self.rope(self.kv_norm(fp8_linear(self.args, self.wkv, x_in)), positions, inplace=True)
        self.store_kv(x)
        return window_kv(self.args, kv)

    def store_kv(self, x: torch.Tensor) -> None:
        """A KV source's compressor on the step's rows ``x``: each group completed here is
        written once to the source's compressed KV, RoPE'd at the group's first position, and
        with sparse attention to its index keys, ``index_norm(wk_index(latent))`` of the latent
        before RoPE, RoPE'd there too (DeepSeek-V4.1 inference/model.py ``_compress_kv``,
        ``Indexer.forward``). Rows completing no group write the trash row."""
        if self.compressor is None:
            return
        ctx = get_forward_context()
        groups = self.compressor(x, ctx.attn_metadata, ctx.cache)
        kv = self.rope(groups.latent, groups.start, self.args.rope_dim)
        ctx.cache.compressed[self.layer].index_copy_(0, groups.slot,
                                                     compressed_kv(self.args, kv))
        if self.writes_index_keys:
            keys = self.rope(self.index_norm(self.wk_index(groups.latent)), groups.start,
                             self.index_rope_dim, inplace=True)
            ctx.cache.index_keys[self.layer].index_copy_(0, groups.slot,
                                                         index_vectors(self.args, keys))

    def publish_selection(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """S's indexer on every row of the batch (its attention input ``x``): its top-k and, with
        two-level candidates, its candidate blocks, published in the current context."""
        q_latent = self.q_norm(fp8_linear(self.args, self.wq_a, linear_input(self.args, x)))
        return index_publication(q_latent,
                                 self.index_weights(x), self.layer, self)

    def project_q(self, q_latent: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q = fp8_linear(self.args, self.wq_b, linear_input(self.args, q_latent))
        q = q.view(-1, self.n_heads, self.head_dim)
        return self.rope(q, positions, inplace=True)

    def rope(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope_dim: int | None = None,
        *,
        inverse: bool = False,
        inplace: bool = False,
    ) -> torch.Tensor:
        """``x``'s last ``rope_dim`` (default ``args.rope_dim``; the indexer's may be narrower)
        features turned by this layer's table at ``positions``; ``inverse`` turns them back."""
        spec = self.rope_spec if rope_dim is None else self.rope_spec.with_dim(rope_dim)
        return apply_rope(x, positions, spec, inverse=inverse, inplace=inplace)

    def forward(self, x: torch.Tensor, kv: torch.Tensor | None = None) -> torch.Tensor:
        """``kv`` is given for the first replay layer: the batch KV it wrote for every row."""
        if kv is None:
            q_latent, kv = self.project_latents(x)
        else:
            q_latent = self.q_norm(fp8_linear(self.args, self.wq_a, linear_input(self.args, x)))
        weights = None if self.indexes_before_cut else self.index_weights(x)
        return self.project_out(attention_op(q_latent, kv, weights, self.layer, self))

    def project_out(self, o: torch.Tensor) -> torch.Tensor:
        """The heads ``[T, H, D]`` back to the model width: each group's low-rank projection as
        one batched GEMM over a strided view of the heads (no transposed copy of them, 1 GB a
        layer at 16K tokens) that writes token-major rows (no copy of its output either, where
        no gradient is wanted: ``out=`` has no backward), then ``wo_b``."""
        rows, groups = o.shape[0], self.args.o_groups
        grouped = o.reshape(rows, groups, self.wo_a.shape[1]).transpose(0, 1)
        if torch.is_grad_enabled() and (o.requires_grad or self.wo_a.requires_grad):
            return fp8_linear(self.args, self.wo_b, linear_input(
                self.args, torch.bmm(grouped, self.wo_a).transpose(0, 1).flatten(1)))
        low = o.new_empty(rows, groups, self.wo_a.shape[2])  # bmm writes it through a view
        torch.bmm(grouped, self.wo_a, out=low.transpose(0, 1))
        return fp8_linear(self.args, self.wo_b, linear_input(self.args, low.flatten(1)))


@eager_break("attention", writes_out=True)
def attention_op(
    q_latent: torch.Tensor,
    kv: torch.Tensor,
    index_weights: torch.Tensor | None,
    layer: int,
    attn: Attention,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention proper: an eager break in PIECEWISE graphs (shapes follow the step's metadata).

    It takes the low-rank query latent, not the heads: a captured graph keeps every break's
    inputs alive, and at 64K tokens 64 heads x 512 of query per layer would fill the GPU. An
    index source publishes its selection in the forward context for the layers after it.
    ``out`` (a graph replay's break buffer) receives the heads; None allocates them.
    """
    ctx = get_forward_context()
    meta = ctx.metadata_for(layer)
    q = attn.project_q(q_latent, meta.positions)
    if attn.runs_indexer and not attn.indexes_before_cut:
        run_indexer(q_latent, index_weights, layer, attn)
    selection = None if attn.index_source is None else ctx.index_selection[attn.index_source]
    o = attend(q, kv, meta, ctx.cache, layer, attn.global_kv, attn.sink, selection,
               ctx.shape_mode, out=out)
    # V is the rotated K=V latent, so the output's last rope_dim features carry the keys'
    # rotations; turned back at the query's position they are relative to it (DeepSeek-V4.1
    # `Attention.forward`, before wo_a). ``o`` is attend's own tensor (fresh, or the break's
    # buffer): rotated in place.
    return attn.rope(o, meta.positions, inverse=True, inplace=True)


def run_indexer(q_latent: torch.Tensor, index_weights: torch.Tensor, layer: int,
                attn: Attention) -> Selection:
    """An index source's selection of the context's rows (a given one where the caller fixed
    it), published in the context for the layers after it; S also publishes its candidates."""
    ctx = get_forward_context()
    meta = ctx.metadata_for(layer)
    index = attn.index_query(q_latent, meta.positions, index_weights, ctx.candidates)
    if ctx.index_queries is not None:
        ctx.index_queries[layer] = index
    selection, candidates = select(meta, ctx.cache, index, attn.global_kv.ratio, ctx.shape_mode)
    selection = ctx.given_selection.get(layer, selection)
    ctx.index_selection[layer] = selection
    if index.publishes is not None:
        ctx.candidates = candidates
    return selection, candidates


@eager_break("index_publication")
def index_publication(
    q_latent: torch.Tensor, index_weights: torch.Tensor, layer: int, attn: Attention
) -> tuple[torch.Tensor, ...]:
    """S's indexer on every row: an eager break in PIECEWISE graphs (its walk follows the
    step's metadata), re-run under each step's context. Returns the per-row publications the
    replay route hands to its rows: the selection, then the candidate blocks when on."""
    selection, candidates = run_indexer(q_latent, index_weights, layer, attn)
    return (selection,) if candidates is None else (selection, candidates)
