"""The model sharded over a tensor-parallel group, as serving engines split DeepSeek models.

Attention: the query heads, their sinks and output groups are split over the ranks (each rank owns
``n_heads / tp`` contiguous heads, so ``o_groups / tp`` whole output groups); the shared K=V
latent and the indexer are replicated, as DeepSeek's public inference code keeps ``wkv`` and its
``Indexer`` unsplit. The output projection's partial sums are all-reduced.

MoE: the gate is replicated (every rank routes every token alike). With ``ep == tp`` each rank
owns ``n_routed_experts / tp`` whole experts and runs only the (token, expert) pairs routed to
them; with ``ep == 1`` each rank owns a ``1 / tp`` slice of every expert's width. The shared
experts are width-sliced. Tokens are replicated within the group, so dispatch is local selection
and combine is one all-reduce of the partial outputs (an all-reduce is a reduce-scatter plus an
all-gather).

The collectives sit inside the forward, so graph captures hold them; the replay batch's gather
and scatter are rank-local (every rank of the group has the same rows).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from swa_bench.model.args import ModelArgs
from swa_bench.model.cache import KVCache
from swa_bench.model.latent_attention import Attention
from swa_bench.model.model import Transformer, build_model, materialize
from swa_bench.model.moe import Gate, MoE, RoutedExperts, combine_pairs, grouped_mm, swiglu
from swa_bench.model.precision import expert_input
from swa_bench.parallel.collectives import all_reduce_sum
from swa_bench.parallel.layout import ParallelLayout


class TensorParallelAttention(Attention):
    """This rank's heads of one attention block; its output summed over the group."""

    def __init__(self, args: ModelArgs, layer: int, group: dist.ProcessGroup) -> None:
        tp = group.size()
        super().__init__(
            args.replace(n_heads=args.n_heads // tp, o_groups=args.o_groups // tp), layer
        )
        self.group = group

    def forward(self, x: torch.Tensor, kv: torch.Tensor | None = None) -> torch.Tensor:
        return all_reduce_sum(super().forward(x, kv), self.group)


class ExpertParallelMoE(MoE):
    """This rank's routed experts (or expert slices) and shared-expert slice; the combined output
    summed over the group."""

    def __init__(
        self,
        args: ModelArgs,
        layout: ParallelLayout,
        rank: int,
        group: dist.ProcessGroup,
        experts: RoutedExperts | None = None,
    ) -> None:
        super().__init__(local_expert_args(args, layout), experts)
        self.n_experts, self.top_k = args.n_routed_experts, args.n_activated_experts
        self.gate = Gate(args)
        shared = args.n_shared_experts * args.moe_inter_dim // layout.tp
        self.shared_w13 = nn.Linear(args.dim, 2 * shared, bias=False) if shared else None
        self.shared_w2 = nn.Linear(shared, args.dim, bias=False) if shared else None
        self.n_local = args.n_routed_experts // layout.ep
        self.first_expert = (rank % layout.ep) * self.n_local if layout.ep > 1 else 0
        self.group = group

    def routed(self, x: torch.Tensor, out: torch.Tensor | None = None, fused: bool = False,
               shared: torch.Tensor | None = None,
               x_in: torch.Tensor | None = None) -> torch.Tensor:
        """``MoE.routed`` over this rank's experts: pairs routed elsewhere sort last, outside every
        group of the grouped GEMM, and contribute zero. Always the PyTorch steps (``fused`` is
        not taken: the fused combine has no mask for other ranks' pairs); ``x_in`` as there."""
        k = self.top_k
        experts, weights = self.route(x)
        local = experts.flatten() - self.first_expert
        mine = (local >= 0) & (local < self.n_local)
        pairs = torch.where(mine, local, self.n_local)
        order = torch.argsort(pairs, stable=True)
        bounds = torch.arange(1, self.n_local + 1, device=x.device)
        ends = torch.searchsorted(pairs[order], bounds).to(torch.int32)
        w = self.experts
        x_in = expert_input(self.args, x) if x_in is None else x_in
        h = grouped_mm(x_in.index_select(0, order // k), w.w13, ends)
        a = swiglu(h, self.swiglu_limit, weights.flatten()[order][:, None])
        y = grouped_mm(expert_input(self.args, a), w.w2, ends)
        y = torch.where(mine[order][:, None], y, 0)
        return combine_pairs(y, order, k, shared, out, x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(super().forward(x), self.group)


def local_expert_args(args: ModelArgs, layout: ParallelLayout) -> ModelArgs:
    """The routed-expert shapes one rank holds: ``E / ep`` experts, of width ``inter / tp`` when
    experts are width-sliced (ep == 1), of full width when split (ep == tp)."""
    e = args.n_routed_experts // layout.ep
    inter = args.moe_inter_dim // (layout.tp if layout.ep == 1 else 1)
    return args.replace(
        n_routed_experts=e,
        n_activated_experts=min(args.n_activated_experts, e),
        moe_inter_dim=inter,
    )


def build_sharded_model(
    args: ModelArgs,
    layout: ParallelLayout,
    rank: int,
    group: dist.ProcessGroup,
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[Transformer, KVCache]:
    """This rank's shard of the model ``build_model(args, seed=seed)`` builds, and an empty cache
    for it: the full model is drawn from the seed on every rank and sliced, so the group computes
    the one-rank model."""
    full, cache = build_model(args, seed=seed, device=device, dtype=dtype)
    tp_rank = rank % layout.tp
    with torch.device("meta"):
        model = Transformer(args)
        pools = nn.ModuleList(
            RoutedExperts(local_expert_args(args, layout)) for _ in range(len(model.expert_pools))
        )
        model.expert_pools = pools
        for i, block in enumerate(model.layers):
            block.attn = TensorParallelAttention(args, i, group)
            pool = pools[i % len(pools)] if len(pools) else None
            block.moe = ExpertParallelMoE(args, layout, tp_rank, group, pool)
    model = materialize(model, dtype, torch.device(device))
    shards = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in full.named_parameters():
            shards[name].copy_(shard_of(name, p, layout, tp_rank))
    del full
    model.eval().requires_grad_(False)
    return model, cache


def shard_of(name: str, full: torch.Tensor, layout: ParallelLayout, tp_rank: int) -> torch.Tensor:
    """Rank ``tp_rank``'s part of the full parameter ``name`` (the whole of a replicated one)."""
    tp = layout.tp

    def part(t: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
        size = t.shape[dim] // parts
        return t.narrow(dim, index * size, size)

    def halves(t: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
        """Gate and up projections stacked along ``dim``: the same slice of each."""
        return torch.cat([part(h, dim, parts, index) for h in t.chunk(2, dim=dim)], dim=dim)

    leaf = name.rsplit(".", 1)[-1]
    if name.startswith("dspark."):  # the draft layers' blocks run nowhere: kept whole
        return full
    if name.endswith(("attn.wq_b.weight", "attn.sink", "attn.wo_a")):
        return part(full, 0, tp, tp_rank)
    if name.endswith("attn.wo_b.weight"):
        return part(full, 1, tp, tp_rank)
    if name.endswith("moe.shared_w13.weight"):
        return halves(full, 0, tp, tp_rank)
    if name.endswith("moe.shared_w2.weight"):
        return part(full, 1, tp, tp_rank)
    if leaf in ("w13", "w2"):  # routed experts [E, out, in], a layer's own or a shared pool
        if layout.ep > 1:
            return part(full, 0, layout.ep, tp_rank % layout.ep)
        return halves(full, 1, tp, tp_rank) if leaf == "w13" else part(full, 2, tp, tp_rank)
    return full
