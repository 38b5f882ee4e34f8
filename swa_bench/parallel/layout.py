"""The parallel layout of a run: data-parallel replicas (dp) of a tensor-parallel group (tp) whose
routed experts are split over ``ep`` of its ranks (1: every rank holds a slice of every expert).

Pure rules, checked when a scenario is validated, so a layout that cannot shard the model is a
one-line error before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from swa_bench.model.args import ModelArgs


@dataclass(frozen=True)
class ParallelLayout:
    dp: int = 1
    tp: int = 1
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    @property
    def parallel(self) -> bool:
        return self.world_size > 1


def layout_problems(layout: ParallelLayout, args: ModelArgs) -> list[tuple[str, str]]:
    """Every reason ``layout`` cannot shard ``args`` as (field, message); empty when it can."""
    out: list[tuple[str, str]] = []
    tp, ep = layout.tp, layout.ep
    for name in ("dp", "tp", "ep"):
        if getattr(layout, name) < 1:
            out.append((name, f"must be >= 1, got {getattr(layout, name)}"))
    if out:
        return out
    if args.n_heads % tp:
        out.append(("tp", f"{tp} does not divide the {args.n_heads} attention heads"))
    elif args.o_groups % tp:
        out.append(("tp", f"{tp} does not divide the {args.o_groups} output groups (o_groups)"))
    if ep not in (1, tp):
        out.append(
            ("ep", f"must be 1 (experts sliced by width) or tp={tp} (experts split), got {ep}")
        )
    elif args.n_routed_experts % ep:
        out.append(("ep", f"{ep} does not divide the {args.n_routed_experts} routed experts"))
    elif ep == 1 and args.moe_inter_dim % tp:
        out.append(
            (
                "tp",
                f"{tp} does not divide the expert width moe_inter_dim="
                f"{args.moe_inter_dim} (with ep: 1 each rank holds a slice of it)",
            )
        )
    if args.n_shared_experts and (args.n_shared_experts * args.moe_inter_dim) % tp:
        out.append(
            (
                "tp",
                f"{tp} does not divide the shared experts' width "
                f"{args.n_shared_experts * args.moe_inter_dim}",
            )
        )
    return out
