import pytest
import torch

from swa_bench.bench.byte_model import LayerCost
from swa_bench.bench.roofline import (
    CPU_PROBE_MS,
    achieved_tflops,
    copy_bandwidth,
    cpu_probe_size,
    gemm_tflops,
    roofline_ideal_speedup,
    roofline_ms,
)


def test_achieved_rate_is_flops_over_time():
    assert achieved_tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert achieved_tflops(5e11, 250.0) == pytest.approx(2.0)


def test_cpu_gemm_rate_is_measured():
    rate = gemm_tflops(torch.device("cpu"), torch.float32, size=256, threads=1)
    assert 1e-4 < rate < 10, rate  # a CPU core: well above 0.1 GFLOP/s, far below 10 TFLOP/s


@pytest.mark.parametrize(("ms_at_128", "size"), [(0.01, 1024), (0.1, 512), (1.0, 256),
                                                  (CPU_PROBE_MS, 128), (50.0, 128)])
def test_the_cpu_probe_grows_until_a_call_takes_long_enough(monkeypatch, ms_at_128, size):
    """A call of n-cubed takes (n / 128)^3 times the 128-cubed one: the probe stops at the
    first size that takes CPU_PROBE_MS, or at 1024."""
    from swa_bench.bench import roofline
    from swa_bench.bench.timing import summarize

    def timed(fn, **kwargs):
        n = fn.__defaults__[0].shape[0]
        return summarize([ms_at_128 * (n / 128) ** 3])

    monkeypatch.setattr(roofline, "time_fn", timed)
    assert cpu_probe_size(torch.float32) == size


@pytest.mark.cuda
def test_h200_bf16_gemm_rate():
    rate = gemm_tflops(torch.device("cuda"), torch.bfloat16)
    assert rate > 100, rate


def test_roofline_takes_the_longer_side_of_each_layer_then_sums():
    # 2 TFLOP/s and 1000 GB/s. Reference: a 2 s of FLOPs vs 1 s of bytes, b 0.5 s vs 3 s: 5 s
    # (max of the sums would be 4 s). Replay: a 0.5 vs 1 s, b 0.1 vs 2 s: 3 s.
    reference = {"a": LayerCost(flops=4 * 10**12, bytes=10**12),
                 "b": LayerCost(flops=10**12, bytes=3 * 10**12)}
    replay = {"a": LayerCost(flops=10**12, bytes=10**12),
              "b": LayerCost(flops=2 * 10**11, bytes=2 * 10**12)}
    assert roofline_ms(reference, 2.0, 1000.0) == pytest.approx(5000.0)
    assert roofline_ms(replay, 2.0, 1000.0) == pytest.approx(3000.0)
    assert roofline_ideal_speedup(reference, replay, 2.0, 1000.0) == pytest.approx(5 / 3)
    # FLOP-bound everywhere at 1e6 GB/s: the FLOP ideal, 5e12 / 1.2e12
    assert roofline_ideal_speedup(reference, replay, 2.0, 1e6) == pytest.approx(5 / 1.2)


def test_cpu_copy_bandwidth_is_measured():
    rate = copy_bandwidth(torch.device("cpu"), torch.float32, nbytes=1 << 22, threads=1)
    assert 0.1 < rate < 10_000, rate  # GB/s: a core copies far above 100 MB/s, below 10 TB/s


@pytest.mark.cuda
def test_h200_copy_bandwidth():
    rate = copy_bandwidth(torch.device("cuda"), torch.bfloat16)
    assert 2000 < rate < 4900, rate  # the H200's HBM3e: 4.8 TB/s on the datasheet
