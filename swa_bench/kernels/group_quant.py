"""``group_quant``: the release's activation and KV quantisation (``kernels.quant``'s
``act_quant``, ``fp4_act_quant`` and ``fp4_act_quant_e4m3_scale``) in one Triton launch.

The same bits as the PyTorch functions, which stay the CPU path and the oracle
(tests/kernels/test_group_quant.py holds them equal, edge cases included): a group's stored values
depend on that group alone, so a row's do not depend on the batch.
"""

from __future__ import annotations

import torch

from swa_bench.kernels import quant
from swa_bench.kernels.config import Kernels
from swa_bench.kernels.launch import launch

FORMATS = ("e4m3", "e2m1", "e2m1-e4m3-scale")
BLOCK_ELEMENTS = 4096  # elements a program holds: 128 groups of 32


def fused_group_quant(kernels: Kernels, x: torch.Tensor) -> bool:
    """Whether ``x``'s quantisation runs here: the Triton backend bound and no gradient
    wanted (``Kernels.inference``), a floating-point tensor the kernel can read flat."""
    return x.is_floating_point() and x.is_contiguous() and kernels.inference(x)


def group_quant(kernels: Kernels, x: torch.Tensor, fmt: str, group: int) -> torch.Tensor:
    """``x``'s stored values in its dtype: each ``group`` consecutive elements of a row in
    ``fmt`` ("e4m3" and "e2m1" with UE8M0 scales, "e2m1-e4m3-scale" with an e4m3 one)."""
    from swa_bench.kernels import triton_quant

    if fmt not in FORMATS:
        raise ValueError(f"group_quant: format must be one of {FORMATS}, got {fmt!r}")
    if x.shape[-1] % group:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of the group {group}")
    code = {"e4m3": triton_quant.E4M3, "e2m1": triton_quant.E2M1,
            "e2m1-e4m3-scale": triton_quant.E2M1_E4M3_SCALE}[fmt]
    y = torch.empty_like(x)
    n_groups = x.numel() // group
    if n_groups == 0:
        return y
    block_g = max(1, BLOCK_ELEMENTS // group)
    launch(triton_quant.group_quant_kernel, (-(-n_groups // block_g),),
           x, y, n_groups, GROUP=group, BLOCK_G=block_g, FORMAT=code.value,
           direct=kernels.direct_launch, num_warps=4)
    return y


def act_quant(kernels: Kernels, x: torch.Tensor) -> torch.Tensor:
    """``quant.act_quant(x)``, fused where ``fused_group_quant`` allows."""
    if fused_group_quant(kernels, x):
        return group_quant(kernels, x, "e4m3", quant.ACT_GROUP)
    return quant.act_quant(x)


def fp4_act_quant(kernels: Kernels, x: torch.Tensor) -> torch.Tensor:
    """``quant.fp4_act_quant(x)``, fused where ``fused_group_quant`` allows."""
    if fused_group_quant(kernels, x):
        return group_quant(kernels, x, "e2m1", quant.FP4_GROUP)
    return quant.fp4_act_quant(x)


def fp4_act_quant_e4m3_scale(kernels: Kernels, x: torch.Tensor) -> torch.Tensor:
    """``quant.fp4_act_quant_e4m3_scale(x)``, fused where ``fused_group_quant`` allows."""
    if fused_group_quant(kernels, x):
        return group_quant(kernels, x, "e2m1-e4m3-scale", quant.KV_FP4_GROUP)
    return quant.fp4_act_quant_e4m3_scale(x)
