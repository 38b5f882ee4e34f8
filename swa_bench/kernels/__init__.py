"""GPU kernels below the model: attention over a shared K=V latent that never materialises scores,
the indexer's scores without its per-head intermediate, the routed experts' grouped GEMM where
``torch._grouped_mm`` does not run, and mHC's Sinkhorn and stream sums, the MoE's routing, the
routed experts' elementwise steps, the attention latents' norms and RoPE, and the window keys' row
index in one pass each.

The model keeps its PyTorch implementations as the CPU path and as the oracle these kernels are
tested against; ``config.KernelSettings.resolve`` decides, once per engine, which one runs, and
every wrapper takes the resolved ``Kernels`` it runs under.
"""

from swa_bench.kernels.config import (
    TORCH_KERNELS,
    Kernels,
    KernelSettings,
    TileConfig,
    triton_available,
)
from swa_bench.kernels.hyper_connection import (
    fused_hc,
    hc_post,
    hc_pre,
    hc_project,
    hc_split_sinkhorn,
)
from swa_bench.kernels.indexer import index_score_flops, index_scores_fused
from swa_bench.kernels.latents import fused_latents, norm_latents
from swa_bench.kernels.linear import fp32_linear
from swa_bench.kernels.moe import (
    expert_gemm,
    fused_moe,
    gate_in_route,
    moe_combine,
    moe_route,
    moe_sort,
    silu_mul,
)
from swa_bench.kernels.mqa import mqa_attention, mqa_attention_flops
from swa_bench.kernels.rope import fused_rope, rope_
from swa_bench.kernels.window_index import window_index_rows

__all__ = ["TORCH_KERNELS", "KernelSettings", "Kernels", "TileConfig", "expert_gemm",
           "fp32_linear", "fused_hc", "fused_latents", "fused_moe", "fused_rope",
           "gate_in_route", "hc_post", "hc_pre", "hc_project",
           "hc_split_sinkhorn", "index_score_flops",
           "index_scores_fused", "moe_combine", "moe_route", "moe_sort", "mqa_attention",
           "mqa_attention_flops", "norm_latents", "rope_", "silu_mul",
           "triton_available", "window_index_rows"]
