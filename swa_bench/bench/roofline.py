"""The device's measured matrix rate and copy bandwidth, what a timed path achieves against the
rate (MFU), and the roofline ideal both set.

A speedup is only as honest as both paths it divides: reporting each path's achieved TFLOP/s and
its share of the rate this device actually reaches on a large GEMM (measured once per run, in the
run's dtype, not a datasheet figure) shows when a path wastes time (an efficiency far above 100%
means the reference path is slower than its FLOPs explain). The FLOP ideal ignores bytes: a step
bound by reading weights (a few hundred kept rows through layers of 384 experts) cannot reach it.
The roofline ideal gives each layer the longer of its FLOPs at the GEMM rate and its bytes at the
copy bandwidth, both measured once per run.

Under precision fp8 with the kernel choice ``quantised_gemm: fp8`` part of a path's FLOPs run on
fp8 tensor cores (``flop_model.precision_split``), whose peak is about twice bf16's: its MFU is
then against both rates (``mfu``), the fp8 one measured as the dtype's is (``fp8_gemm_tflops``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from swa_bench.bench.byte_model import LayerCost
from swa_bench.bench.timing import time_fn

GEMM_SIZE = {"cuda": 8192, "cpu": 1024}  # the CPU's is the largest its probe may grow to
CPU_PROBE_MS = 5.0  # a CPU probe GEMM grows until one call takes this long
# 5x the H200's 50 MB L2 (4.05 TB/s there in bf16; a 1 GiB copy 4.2), 32 MiB on a CPU
COPY_BYTES = {"cuda": 1 << 28, "cpu": 1 << 25}


def gemm_tflops(
    device: torch.device, dtype: torch.dtype, *, size: int | None = None,
    threads: int | None = None,
) -> float:
    """TFLOP/s of a square ``size``-cubed matmul in ``dtype`` on ``device`` (median of 10 after 3
    warm-ups; random data: zeros run faster on a GPU). CPU runs use ``threads`` threads. Without
    ``size`` a GPU multiplies 8192-cubed; a CPU doubles a 128-cubed product until one call takes
    ``CPU_PROBE_MS`` (at most 1024): a CPU without bf16 instructions multiplies bf16 50x slower
    than fp32, and a fixed 1024-cubed probe took 40 s there."""
    device = torch.device(device)
    if size is None and device.type == "cpu":
        size = cpu_probe_size(dtype, threads)
    n = size or GEMM_SIZE.get(device.type, 1024)
    a, b = _operands(n, device, dtype)
    stats = time_fn(lambda: a @ b, device=device, warmup=3, iters=10, threads=threads)
    return 2 * n**3 / (stats.median_ms * 1e-3) / 1e12


def _operands(n: int, device: torch.device, dtype: torch.dtype):
    gen = torch.Generator(device=device).manual_seed(0)
    return (torch.randn(n, n, device=device, dtype=dtype, generator=gen),
            torch.randn(n, n, device=device, dtype=dtype, generator=gen))


def cpu_probe_size(dtype: torch.dtype, threads: int | None = None) -> int:
    """The smallest power of two from 128 whose square matmul takes ``CPU_PROBE_MS`` on this CPU
    (one call after one warm-up), capped at ``GEMM_SIZE["cpu"]``."""
    n = 128
    while n < GEMM_SIZE["cpu"]:
        a, b = _operands(n, torch.device("cpu"), dtype)
        if time_fn(lambda a=a, b=b: a @ b, device=torch.device("cpu"), warmup=1, iters=1,
                   threads=threads).median_ms >= CPU_PROBE_MS:
            break
        n *= 2
    return n


FP8 = "fp8"  # the fp8 GEMM rate's key beside the dtypes' (``environment.gemm_tflops``)
E4M3 = torch.float8_e4m3fn


def fp8_gemm_probe(n: int, device: torch.device, rowwise: bool = True):
    """A call of one ``n``-cubed fp8 GEMM on ``device``: ``torch._scaled_mm`` of e4m3 operands
    (random values cast from bf16, within e4m3's range: zeros run faster), ``b`` column-major as
    it requires (the transpose of a row-major ``[N, K]``), fp32 scales row-wise (``[M, 1]`` and
    ``[1, N]``, what a per-row quantised GEMM reads) or tensor-wise (0-d), bf16 out: the shape
    of the model's fp8 GEMMs, whose scales are finer (per 32 along K: ``kernels.fp8_gemm``).
    Returns the call and its operands ``(a, b, scale_a, scale_b)``: ``scale_a * scale_b * (a @
    b^T)`` is what it computes."""
    a, b = (t.to(E4M3) for t in _operands(n, device, torch.bfloat16))
    if rowwise:
        scale_a = torch.rand(n, 1, device=device, dtype=torch.float32) + 0.5
        scale_b = torch.rand(1, n, device=device, dtype=torch.float32) + 0.5
    else:
        scale_a = torch.tensor(0.75, device=device)
        scale_b = torch.tensor(1.25, device=device)
    call = lambda: torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scale_b,  # noqa: E731
                                    out_dtype=torch.bfloat16)
    return call, (a, b, scale_a, scale_b)


def fp8_gemm_tflops(device: torch.device, *, size: int | None = None) -> float | None:
    """TFLOP/s of a ``size``-cubed fp8 GEMM on ``device``'s fp8 tensor cores, measured as
    ``gemm_tflops`` measures the dtype's (8192-cubed by default, median of 10 after 3 warm-ups,
    random data), with row-wise scales (tensor-wise before Hopper, where ``_scaled_mm`` takes
    no other). None where there are no fp8 tensor cores: a CPU (its ``_scaled_mm``, where there
    is one, emulates), a GPU before Ada (compute capability 8.9); each path's MFU is then the
    dtype rate's alone."""
    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return None
    n = size or GEMM_SIZE["cuda"]
    call, _ = fp8_gemm_probe(n, device,
                             rowwise=torch.cuda.get_device_capability(device) >= (9, 0))
    stats = time_fn(call, device=device, warmup=3, iters=10)
    return 2 * n**3 / (stats.median_ms * 1e-3) / 1e12


def achieved_tflops(flops: int | float, median_ms: float) -> float:
    """The rate a path achieved: its FLOPs over its median time."""
    return flops / (median_ms * 1e-3) / 1e12


def mfu(fp8_flops: int | float, dtype_flops: int | float, median_ms: float,
        dtype_tflops: float, fp8_tflops: float | None) -> float:
    """A path's model FLOPs utilisation: the time its FLOPs would take at the measured peaks,
    ``fp8_flops`` at ``fp8_tflops`` and ``dtype_flops`` at ``dtype_tflops``, over its
    ``median_ms``. Without fp8 FLOPs it is ``achieved_tflops / dtype_tflops`` to the bit (the
    fp8 term adds an exact 0.0), the MFU of every path that runs no fp8 GEMM. ``fp8_flops`` with
    no ``fp8_tflops`` is refused: the caller decides what they are counted at."""
    if fp8_flops and fp8_tflops is None:
        raise ValueError("mfu: fp8 FLOPs without an fp8 GEMM rate")
    at_fp8 = achieved_tflops(fp8_flops, median_ms) / fp8_tflops if fp8_flops else 0.0
    return achieved_tflops(dtype_flops, median_ms) / dtype_tflops + at_fp8


def copy_bandwidth(
    device: torch.device, dtype: torch.dtype, *, nbytes: int | None = None,
    threads: int | None = None,
) -> float:
    """GB/s of a large device-to-device copy in ``dtype``: bytes read plus bytes written over its
    median time (10 after 3 warm-ups). CPU runs use ``threads`` threads."""
    device = torch.device(device)
    size = torch.empty((), dtype=dtype).element_size()
    n = (nbytes or COPY_BYTES.get(device.type, 1 << 25)) // size
    src = torch.ones(n, device=device, dtype=dtype)
    dst = torch.empty_like(src)
    stats = time_fn(lambda: dst.copy_(src), device=device, warmup=3, iters=10, threads=threads)
    return 2 * n * size / (stats.median_ms * 1e-3) / 1e9


def roofline_ms(costs: Mapping[str, LayerCost], tflops: float, gbytes_per_s: float) -> float:
    """The least time a step's entries take: each the longer of its FLOPs at ``tflops`` and its
    bytes at ``gbytes_per_s`` (an entry's compute and traffic overlap, entries do not)."""
    return sum(max(c.flops / (tflops * 1e12), c.bytes / (gbytes_per_s * 1e9))
               for c in costs.values()) * 1e3


def roofline_ideal_speedup(
    reference: Mapping[str, LayerCost], replay: Mapping[str, LayerCost], tflops: float,
    gbytes_per_s: float,
) -> float:
    """The speedup a replay step could reach if both paths ran at the roofline."""
    return (roofline_ms(reference, tflops, gbytes_per_s)
            / roofline_ms(replay, tflops, gbytes_per_s))
