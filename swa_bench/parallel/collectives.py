"""Process groups and the collectives the sharded model runs inside its forward.

The forward's all-reduce is the functional collective (``_c10d_functional.all_reduce_`` and its
``wait_tensor``): it dispatches as ops, so a CUDA graph captures it with NCCL and the CPU stand-in
records and replays it with gloo, like every other op of a captured segment.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from swa_bench.parallel.layout import ParallelLayout


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sums ``x`` over ``group`` in place; returns ``x``."""
    torch.ops._c10d_functional.all_reduce_(x, "sum", group.group_name)
    return torch.ops._c10d_functional.wait_tensor(x)


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's place in the layout: the TP group it shards the model over, the DP group whose
    routes it agrees with. Ranks ``[d * tp, (d + 1) * tp)`` form DP replica d's TP group."""

    layout: ParallelLayout
    rank: int
    tp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None

    @property
    def tp_rank(self) -> int:
        return self.rank % self.layout.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.layout.tp


def make_groups(layout: ParallelLayout) -> ParallelGroups:
    """Every rank creates every group (torch.distributed's rule); each keeps its own."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != layout.world_size:
        raise ValueError(
            f"the layout dp={layout.dp} x tp={layout.tp} needs {layout.world_size} "
            f"processes, got {world}"
        )
    tp_group = dp_group = None
    if layout.tp > 1:
        for d in range(layout.dp):
            ranks = list(range(d * layout.tp, (d + 1) * layout.tp))
            group = dist.new_group(ranks)
            if rank in ranks:
                tp_group = group
    if layout.dp > 1:
        for t in range(layout.tp):
            ranks = list(range(t, world, layout.tp))
            group = dist.new_group(ranks)
            if rank in ranks:
                dp_group = group
    return ParallelGroups(layout, rank, tp_group, dp_group)


def init_from_env() -> torch.device:
    """Joins the job torchrun started (NCCL on GPUs, gloo on CPU); this rank's device."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(minutes=10))
        return device
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    return torch.device("cpu")
