"""CaseRunner.mfu_basis (issue 28): each path's counted FLOPs split by the rate they run at, the
fp8 GEMM rate measured only when a path runs fp8 GEMMs, and on a CPU (no fp8 rate) every FLOP at
the dtype's, so each path's MFU is today's. Analytic only: no step runs here."""

from types import SimpleNamespace

import pytest
import torch

from swa_bench.bench.flop_model import precision_split
from swa_bench.bench.roofline import FP8, achieved_tflops, mfu
from swa_bench.kernels import TORCH_KERNELS, Kernels
from swa_bench.model.args import build_args
from swa_bench.model.requests import RequestSpec
from swa_bench.run import cases
from swa_bench.run.cases import CaseRunner

FP8_GEMM = Kernels("triton", interpret=True, quantised_gemm="fp8")
REQUESTS = [RequestSpec(prompt_len=24), RequestSpec(prompt_len=9, decode=True)]


def _basis(device: str, kernels: Kernels, precision: str):
    runner = object.__new__(CaseRunner)  # only what mfu_basis reads: the device and the rates
    runner.device, runner.gemm_tflops = torch.device(device), {}
    args = build_args("tiny", {"precision": precision})
    kept = {"reference": [24, 1], "replay": [args.window, 1]}
    plans = {name: SimpleNamespace(kept_lens=lens) for name, lens in kept.items()}
    engines = {name: SimpleNamespace(kernels=kernels) for name in kept}
    counted = {"reference": 9 * 10**7, "replay": 4 * 10**7}  # torch's counter's, say
    case = SimpleNamespace(scenario=SimpleNamespace(dtype="bfloat16"))
    model = SimpleNamespace(args=args)
    inputs = SimpleNamespace(requests=REQUESTS)
    basis = runner.mfu_basis(case, model, inputs, plans, counted, engines, peak=2.5)
    want = {name: precision_split(args, REQUESTS, kept[name], torch.device(device), kernels).fp8
            for name in kept}
    return runner, basis, counted, want


def test_on_a_cpu_every_flop_is_at_the_dtype_rate_and_no_fp8_rate_is_recorded():
    runner, basis, counted, fp8_gemm = _basis("cpu", FP8_GEMM, "fp8")
    assert all(fp8_gemm.values()) and basis.fp8_gemm_flops == fp8_gemm
    assert runner.gemm_tflops == {FP8: None} and basis.fp8_tflops is None
    assert basis.fp8_flops == {"reference": 0, "replay": 0} and basis.dtype_flops == counted
    assert "no fp8 GEMM rate" in basis.note
    for name, flops in counted.items():
        assert mfu(basis.fp8_flops[name], basis.dtype_flops[name], 3.0, basis.dtype_tflops,
                   basis.fp8_tflops) == achieved_tflops(flops, 3.0) / 2.5


@pytest.mark.parametrize(("kernels", "precision"), [(TORCH_KERNELS, "bf16"),
                                                    (FP8_GEMM, "bf16"),
                                                    (Kernels("triton", interpret=True), "fp8")])
def test_without_fp8_gemms_the_fp8_rate_is_not_measured(monkeypatch, kernels, precision):
    monkeypatch.setattr(cases, "fp8_gemm_tflops", lambda device: pytest.fail("measured"))
    runner, basis, counted, fp8_gemm = _basis("cpu", kernels, precision)
    assert runner.gemm_tflops == {} and basis.fp8_tflops is None
    assert basis.fp8_gemm_flops == fp8_gemm == {"reference": 0, "replay": 0}
    assert basis.dtype_flops == counted and basis.note.startswith("no fp8 GEMMs ran")


def test_with_an_fp8_rate_the_fp8_linears_flops_are_at_it(monkeypatch):
    """A device with an fp8 rate (stood in for): measured once, recorded beside the dtype's,
    the fp8 Linears' analytic FLOPs at it and the rest of the counted ones at the dtype's."""
    calls = []
    monkeypatch.setattr(cases, "fp8_gemm_tflops", lambda device: calls.append(device) or 5.0)
    runner, basis, counted, fp8_gemm = _basis("cpu", FP8_GEMM, "fp8")
    assert calls == [torch.device("cpu")] and runner.gemm_tflops == {FP8: 5.0}
    assert runner.device_fp8_tflops() == 5.0 and len(calls) == 1  # once per run
    assert basis.fp8_tflops == 5.0 and basis.dtype_tflops == 2.5
    assert basis.fp8_flops == fp8_gemm
    assert {n: basis.fp8_flops[n] + basis.dtype_flops[n] for n in counted} == counted
    # the replay path's MFU in 3 ms, by hand: its fp8 FLOPs at 5, the rest at 2.5 TFLOP/s
    fp8, rest = fp8_gemm["replay"], counted["replay"] - fp8_gemm["replay"]
    want = (fp8 / 5e12 + rest / 2.5e12) / 3e-3
    assert mfu(basis.fp8_flops["replay"], basis.dtype_flops["replay"], 3.0, 2.5,
               5.0) == pytest.approx(want, rel=1e-12)
    assert want < achieved_tflops(counted["replay"], 3.0) / 2.5  # the fp8 share takes less
