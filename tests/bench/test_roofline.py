import pytest
import torch

from swa_bench.bench.byte_model import LayerCost
from swa_bench.bench.roofline import (
    CPU_PROBE_MS,
    achieved_tflops,
    copy_bandwidth,
    cpu_probe_size,
    fp8_gemm_probe,
    fp8_gemm_tflops,
    gemm_tflops,
    mfu,
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


@pytest.mark.parametrize(("flops", "ms", "peak"), [(3 * 10**9, 7.0, 0.104), (1234567891, 0.37, 3.3),
                                                   (555 * 10**12, 1424.0, 794.1)])
def test_mfu_without_fp8_flops_is_achieved_over_the_dtype_rate_to_the_bit(flops, ms, peak):
    today = achieved_tflops(flops, ms) / peak
    assert mfu(0, flops, ms, peak, None) == today
    assert mfu(0, flops, ms, peak, 1500.0) == today  # an fp8 rate changes nothing without fp8


def test_mfu_is_the_time_at_both_peaks_over_the_measured_time():
    # 3 TFLOP at 2 TFLOP/s (fp8) is 1.5 s, 1 TFLOP at 1 TFLOP/s (dtype) 1 s: 2.5 s of 5 s.
    assert mfu(3 * 10**12, 10**12, 5000.0, 1.0, 2.0) == pytest.approx(0.5, rel=1e-15)
    # the same 4 TFLOP all at the dtype rate would be 4 s of 5 s
    assert mfu(0, 4 * 10**12, 5000.0, 1.0, None) == pytest.approx(0.8, rel=1e-15)
    with pytest.raises(ValueError, match="fp8 FLOPs without an fp8 GEMM rate"):
        mfu(1, 4 * 10**12, 5000.0, 1.0, None)


def test_a_cpu_has_no_fp8_gemm_rate():
    assert fp8_gemm_tflops(torch.device("cpu")) is None


@pytest.mark.parametrize("rowwise", [True, False])
def test_the_fp8_probe_multiplies_e4m3_operands_with_their_scales(rowwise):
    """The probe's call as torch's CPU ``_scaled_mm`` runs it (the GPU's takes the same
    arguments): B column-major, fp32 scales row-wise [M, 1] x [1, N] or 0-d, bf16 out; random
    e4m3 operands, not zeros. Within bf16's rounding of an exact fp32-representable product."""
    if not hasattr(torch, "_scaled_mm"):
        pytest.skip("this torch has no _scaled_mm")
    call, (a, b, scale_a, scale_b) = fp8_gemm_probe(64, torch.device("cpu"), rowwise)
    assert a.dtype == b.dtype == torch.float8_e4m3fn and a.shape == b.shape == (64, 64)
    assert (a.float() != 0).float().mean() > 0.9 and (b.float() != 0).float().mean() > 0.9
    assert scale_a.shape == ((64, 1) if rowwise else ()) and scale_a.dtype == torch.float32
    assert scale_b.shape == ((1, 64) if rowwise else ()) and scale_b.dtype == torch.float32
    try:
        out = call()
    except (RuntimeError, NotImplementedError) as err:  # a build without the CPU kernel
        pytest.skip(f"torch's CPU _scaled_mm does not run here: {err}")
    want = scale_a.double() * scale_b.double() * (a.double() @ b.double().T)
    assert out.dtype == torch.bfloat16 and out.shape == (64, 64)
    torch.testing.assert_close(out.double(), want, rtol=2**-8, atol=1e-6)


@pytest.mark.cuda
def test_h200_fp8_gemm_rate_exceeds_bf16s():
    """The H200's dense fp8 peak is twice its bf16's on the datasheet (1979 vs 989 TFLOP/s)."""
    fp8 = fp8_gemm_tflops(torch.device("cuda"))
    assert fp8 is not None and fp8 > 1.3 * gemm_tflops(torch.device("cuda"), torch.bfloat16), fp8
