"""``fp32_linear``: the reference's fp32 products of model-dtype rows and weights (the MoE gate's
logits, the compressors' kv and gate scores) without their fp32 copies.

DeepSeek-V4.1's inference code promotes both operands and runs an fp32 GEMM (``F.linear(x.float(),
w.float())``). Where both are bf16 every product of two bf16 values is exact in fp32, so that GEMM
is a bf16 GEMM with fp32 sums: on the Triton backend (CUDA) ``triton_linear``'s tensor-core kernel
computes it with round-to-nearest fp32 sums between its K steps, some 10x faster on an H200 than
the fp32 GEMM (CUDA cores) and without the fp32 copies; the two differ only in the order of the
fp32 sums (tested against float64). The PyTorch path (CPU, training, the oracle) keeps the
promoted GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula

from swa_bench.kernels.config import Kernels, call_op
from swa_bench.kernels.launch import launch

BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 64


def _fp32_sum_gemm(x: torch.Tensor, weight: torch.Tensor, direct: bool) -> torch.Tensor:
    from swa_bench.kernels import triton_linear

    rows, k = x.shape
    n = weight.shape[0]
    y = torch.empty(rows, n, dtype=torch.float32, device=x.device)
    if rows:
        launch(triton_linear.fp32_sum_gemm_kernel, (-(-rows // BLOCK_M), -(-n // BLOCK_N)),
            x, weight, y, rows, n, k, x.stride(0), weight.stride(0), y.stride(0),
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, direct=direct, num_warps=8,
            num_stages=3)
    return y


fp32_sum_gemm_op = torch.library.custom_op("swa_bench::fp32_sum_gemm", _fp32_sum_gemm,
                                           mutates_args=())


@fp32_sum_gemm_op.register_fake
def _(x, weight, direct):
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)


@register_flop_formula(torch.ops.swa_bench.fp32_sum_gemm)
def _fp32_sum_gemm_flop_formula(x_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * x_shape[0] * x_shape[1] * weight_shape[0]


def fp32_linear(kernels: Kernels, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [..., K] @ weight [N, K]^T`` in fp32 sums, as fp32 ``[..., N]``."""
    if (kernels.inference(x, weight) and x.is_cuda and not kernels.interpret
            and x.dtype == weight.dtype == torch.bfloat16):
        flat = x.reshape(-1, x.shape[-1])
        flat = flat if flat.stride(-1) == 1 else flat.contiguous()
        w = weight if weight.stride(-1) == 1 else weight.contiguous()
        y = call_op(fp32_sum_gemm_op, _fp32_sum_gemm, flat, w, kernels.direct_launch)
        return y.view(*x.shape[:-1], weight.shape[0])  # N spelled out: 0 rows pass too
    return F.linear(x.float(), weight.float())
