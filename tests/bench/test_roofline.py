import pytest
import torch

from swa_bench.bench.roofline import achieved_tflops, gemm_tflops


def test_achieved_rate_is_flops_over_time():
    assert achieved_tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert achieved_tflops(5e11, 250.0) == pytest.approx(2.0)


def test_cpu_gemm_rate_is_measured():
    rate = gemm_tflops(torch.device("cpu"), torch.float32, size=256, threads=1)
    assert 1e-4 < rate < 10, rate  # a CPU core: well above 0.1 GFLOP/s, far below 10 TFLOP/s


@pytest.mark.cuda
def test_h200_bf16_gemm_rate():
    rate = gemm_tflops(torch.device("cuda"), torch.bfloat16)
    assert rate > 100, rate
