"""The device's measured matrix rate, and what a timed path achieves against it (MFU).

A speedup is only as honest as both paths it divides: reporting each path's achieved TFLOP/s and
its share of the rate this device actually reaches on a large GEMM (measured once per run, in the
run's dtype, not a datasheet figure) shows when a path wastes time (an efficiency far above 100%
means the reference path is slower than its FLOPs explain).
"""

from __future__ import annotations

import torch

from swa_bench.bench.timing import time_fn

GEMM_SIZE = {"cuda": 8192, "cpu": 1024}


def gemm_tflops(
    device: torch.device, dtype: torch.dtype, *, size: int | None = None,
    threads: int | None = None,
) -> float:
    """TFLOP/s of a square ``size``-cubed matmul in ``dtype`` on ``device`` (median of 10 after 3
    warm-ups; random data: zeros run faster on a GPU). CPU runs use ``threads`` threads."""
    device = torch.device(device)
    n = size or GEMM_SIZE.get(device.type, 1024)
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    stats = time_fn(lambda: a @ b, device=device, warmup=3, iters=10, threads=threads)
    return 2 * n**3 / (stats.median_ms * 1e-3) / 1e12


def achieved_tflops(flops: int | float, median_ms: float) -> float:
    """The rate a path achieved: its FLOPs over its median time."""
    return flops / (median_ms * 1e-3) / 1e12
