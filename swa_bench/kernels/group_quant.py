"""``group_quant``: the release's activation and KV quantisation (``kernels.quant``'s
``act_quant``, ``fp4_act_quant`` and ``fp4_act_quant_e4m3_scale``) in one Triton launch.

The same bits as the PyTorch functions, which stay the CPU path and the oracle
(tests/kernels/test_group_quant.py holds them equal, edge cases included): a group's stored values
depend on that group alone, so a row's do not depend on the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from swa_bench.kernels import quant
from swa_bench.kernels.config import Kernels
from swa_bench.kernels.launch import launch


@dataclass(frozen=True)
class GroupFormat:
    """One of the release's group formats: the kernel's format code (``triton_quant``), the
    group size, and the PyTorch function that defines its bits."""

    code: str
    group: int
    reference: Callable[[torch.Tensor], torch.Tensor]


FORMATS = {
    "e4m3": GroupFormat("E4M3", quant.ACT_GROUP, quant.act_quant),
    "e2m1": GroupFormat("E2M1", quant.FP4_GROUP, quant.fp4_act_quant),
    "e2m1-e4m3-scale": GroupFormat("E2M1_E4M3_SCALE", quant.KV_FP4_GROUP,
                                   quant.fp4_act_quant_e4m3_scale),
}
BLOCK_ELEMENTS = 4096  # elements a program holds: 128 groups of 32


def fused_group_quant(kernels: Kernels, x: torch.Tensor) -> bool:
    """Whether ``x``'s quantisation runs here: the Triton backend bound and no gradient
    wanted (``Kernels.inference``), a floating-point tensor the kernel can read flat."""
    return x.is_floating_point() and x.is_contiguous() and kernels.inference(x)


def group_quant(kernels: Kernels, x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``x``'s stored values in its dtype, in one launch: each group of consecutive elements of
    a row in ``fmt`` ("e4m3" and "e2m1" with UE8M0 scales, "e2m1-e4m3-scale" with an e4m3 one)."""
    from swa_bench.kernels import triton_quant

    if fmt not in FORMATS:
        raise ValueError(f"group_quant: format must be one of {list(FORMATS)}, got {fmt!r}")
    spec = FORMATS[fmt]
    if x.shape[-1] % spec.group:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of the group "
                         f"{spec.group}")
    y = torch.empty_like(x)
    n_groups = x.numel() // spec.group
    if n_groups == 0:
        return y
    block_g = max(1, BLOCK_ELEMENTS // spec.group)
    launch(triton_quant.group_quant_kernel, (-(-n_groups // block_g),),
           x, y, n_groups, GROUP=spec.group, BLOCK_G=block_g,
           FORMAT=getattr(triton_quant, spec.code).value,
           direct=kernels.direct_launch, num_warps=4)
    return y


def quantise(kernels: Kernels, x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``FORMATS[fmt].reference(x)``'s bits: the fused kernel where ``fused_group_quant``
    allows, else the PyTorch function itself."""
    if fused_group_quant(kernels, x):
        return group_quant(kernels, x, fmt)
    return FORMATS[fmt].reference(x)
