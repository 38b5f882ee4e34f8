"""Kernel settings as values: parsing, resolution for a device, what a case records, and the
decisions every call site reads from the resolved ``Kernels``."""

from __future__ import annotations

import pytest
import torch

from swa_bench.engine.config import kernel_settings_from_environment, triton_interpreting
from swa_bench.kernels import TORCH_KERNELS, Kernels, KernelSettings, TileConfig


def test_the_environment_is_parsed_once_into_settings_naming_each_variable():
    env = {"SWA_BENCH_KERNELS": " Triton ", "SWA_BENCH_MQA_TILE": "64,0,8,2",
           "SWA_BENCH_TRITON_LAUNCH": "triton", "UNRELATED": "x"}
    assert kernel_settings_from_environment(env) == KernelSettings(
        "triton", TileConfig(64, 0, 8, 2), "triton")
    assert kernel_settings_from_environment({}) == KernelSettings()
    assert kernel_settings_from_environment({"SWA_BENCH_KERNELS": "auto"}) == KernelSettings()
    for variable, value in (("SWA_BENCH_KERNELS", "cuda"), ("SWA_BENCH_MQA_TILE", "64,0,8"),
                            ("SWA_BENCH_TRITON_LAUNCH", "fast")):
        with pytest.raises(ValueError, match=f"^{variable}: .*{value!r}"):
            kernel_settings_from_environment({variable: value})
    assert triton_interpreting({"TRITON_INTERPRET": "1"})
    assert not triton_interpreting({"TRITON_INTERPRET": "0"}) and not triton_interpreting({})


def test_a_case_records_what_ran():
    """Triton's settings as resolved; the PyTorch path ran no Triton kernel, so two torch runs
    whose unused tile, launch mode or interpreter differ record the same."""
    tiled = Kernels("triton", TileConfig(16, 0, 4, 1), "triton", interpret=True)
    assert tiled.record() == {"backend": "triton", "tile": "16,0,4,1", "launch": "triton",
                              "interpret": True}
    assert Kernels("triton").record()["tile"] == "auto"
    unused = KernelSettings("torch", TileConfig(16, 0, 4, 1), "triton").resolve("cpu", True)
    assert unused.record() == TORCH_KERNELS.record() == {
        "backend": "torch", "tile": "-", "launch": "-", "interpret": False}


def test_the_decisions_the_call_sites_read():
    x = torch.zeros(2)
    leaf = torch.zeros(2, requires_grad=True)
    triton = Kernels("triton")
    assert triton.inference(x) and not TORCH_KERNELS.inference(x)
    assert triton.inference(x, leaf) is False
    with torch.no_grad():
        assert triton.inference(x, leaf)
    assert triton.precision(torch.float32) == "ieee" and triton.precision(torch.bfloat16) == "tf32"
    assert Kernels("triton", interpret=True).precision(torch.float32) == "interpret"
    with pytest.raises(ValueError, match="backend 'cuda'"):
        Kernels("cuda")
    with pytest.raises(ValueError, match="launch: must be one of direct, triton"):
        KernelSettings(launch="fast")
