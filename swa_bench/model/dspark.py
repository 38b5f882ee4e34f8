"""DSpark draft layers: what a step computes for DeepSeek-V4.1's speculative drafter.

After DeepSeek-V4.1 inference/model.py ``DSparkBlock``, ``DSparkAttention`` and the aux hidden
states of ``Transformer.forward``. The ``dspark_layers`` draft layers (the reference's
``n_mtp_layers``, layer ids ``n_layers ..``) sit after the backbone: window-only attention and a
MoE with their own expert counts. Their input is ``main_hidden``: for each target layer (decoder
layers), the mean over the streams of that layer's input streams, concatenated; the first draft
layer turns it into ``main_x = main_norm(main_proj(main_hidden))``, which every draft layer reads.

At prefill a draft layer only seeds its window ring with ``kv_norm(wkv(main_x))``, RoPE'd at
``rope_theta`` without YaRN (window-only layers rotate so); at a decode step the reference writes
the new position's ``main_kv`` into the ring first and then runs the draft block on the draft
tokens. swa-bench runs the ring seeding at every step (prefill chunks and decode steps) and does
NOT run the draft blocks, nor the draft heads (the speculative loop is out of scope; the heads
are not built): the draft blocks' weights exist so their memory and names are the model's.

Targets are decoder layers, so under replay ``main_hidden`` exists on the kept rows only: the
seeding runs inside the replay layers on the rows given (the replay batch keeps at least each
request's last W rows, all a ring holds) and ``main_hidden`` is a per-row output of the replay
route, scattered back to batch rows (zeros at trimmed rows), as vLLM scatters aux hidden states.
"""

from __future__ import annotations

import torch
from torch import nn

from swa_bench.model.args import ModelArgs
from swa_bench.model.forward_context import get_forward_context
from swa_bench.model.hyper_connection import Streams, add_mix_parameters
from swa_bench.model.moe import MoE, RoutedExperts
from swa_bench.model.norm import RMSNorm
from swa_bench.model.precision import fp8_linear, linear_input, window_kv
from swa_bench.model.rope import RopeSpec, apply_rope


def draft_args(args: ModelArgs) -> ModelArgs:
    """The draft layers' MoE sizes (reference ``get_moe_config`` past ``n_layers``)."""
    return args.replace(n_routed_experts=args.dspark_n_routed_experts,
                        n_activated_experts=args.dspark_n_activated_experts)


def aux_hidden(streams: Streams) -> torch.Tensor:
    """A target layer's part of ``main_hidden``: the mean of its input streams."""
    return torch.stack(streams, dim=1).mean(dim=1)


class DraftAttention(nn.Module):
    """A window-only draft attention layer (``DSparkAttention``): the projections of a window
    layer; only ``main_kv`` (the ring's keys) runs here."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(args.q_lora_rank, args.norm_eps)
        self.wq_b = nn.Linear(args.q_lora_rank, args.n_heads * args.head_dim, bias=False)
        self.wkv = nn.Linear(args.dim, args.head_dim, bias=False)
        self.kv_norm = RMSNorm(args.head_dim, args.norm_eps)
        group_in = args.n_heads // args.o_groups * args.head_dim
        self.wo_a = nn.Parameter(torch.empty(args.o_groups, group_in, args.o_lora_rank))
        self.wo_b = nn.Linear(args.o_groups * args.o_lora_rank, args.dim, bias=False)
        self.sink = nn.Parameter(torch.zeros(args.n_heads))

    def main_kv(self, main_x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        args = self.args
        kv = self.kv_norm(fp8_linear(args, self.wkv, linear_input(args, main_x)))
        kv = apply_rope(kv, positions, RopeSpec.for_layer(args, args.n_layers), inplace=True)
        return window_kv(args, kv)


class DSparkBlock(nn.Module):
    """One draft layer (``DSparkBlock``); the first also owns ``main_proj`` and ``main_norm``."""

    def __init__(self, args: ModelArgs, stage: int, experts: RoutedExperts | None) -> None:
        super().__init__()
        add_mix_parameters(self, args)  # weights of a draft block swa-bench does not run
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.attn = DraftAttention(args)
        self.moe = MoE(draft_args(args), experts)
        if stage == 0:
            self.main_proj = nn.Linear(args.dim * len(args.dspark_target_layers), args.dim,
                                       bias=False)
            self.main_norm = RMSNorm(args.dim, args.norm_eps)


class DSpark(nn.Module):
    """The draft layers (``mtp``) and their routed-expert storage (one set each, or shared as
    the backbone's are under ``expert_weight_pools``)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        pools = args.dspark_expert_pools
        shared = args.expert_weight_pools is not None
        self.expert_pools = nn.ModuleList(
            RoutedExperts(draft_args(args)) for _ in range(pools if shared else 0))
        self.mtp = nn.ModuleList(
            DSparkBlock(args, j, self.expert_pools[j % pools] if shared else None)
            for j in range(args.dspark_layers))

    def seed_rings(self, main_hidden: torch.Tensor) -> None:
        """Writes every draft layer's ring from ``main_hidden`` of the rows given, through the
        metadata of draft layer ``n_layers + j`` (the bounded reference masks its ring writes as
        it masks the decoder's; elsewhere the context's rows)."""
        ctx = get_forward_context()
        first = self.mtp[0]
        main_x = first.main_norm(fp8_linear(self.args, first.main_proj,
                                             linear_input(self.args, main_hidden)))
        for j, block in enumerate(self.mtp):
            meta = ctx.metadata_for(self.args.n_layers + j)
            kv = block.attn.main_kv(main_x, meta.positions)
            ctx.cache.draft_ring[j].index_copy_(0, meta.ring_slot, kv)
