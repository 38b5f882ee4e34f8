"""GPU kernels below the model: attention over a shared K=V latent that never materialises scores.

The model keeps its PyTorch implementations as the CPU path and as the oracle these kernels are
tested against; ``attention_backend`` decides, in one place, which one runs.
"""

from swa_bench.kernels.config import TileConfig, attention_backend, tile_config, triton_available
from swa_bench.kernels.mqa import mqa_attention, mqa_attention_flops

__all__ = ["TileConfig", "attention_backend", "mqa_attention", "mqa_attention_flops",
           "tile_config", "triton_available"]
