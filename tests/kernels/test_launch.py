"""``launch`` against Triton's own call path, with a stand-in kernel that records what reaches
it: the first call of a specialisation goes through ``kernel[grid]`` (Triton binds, compiles and
launches), later ones straight to the compiled kernel's launcher with every argument in the
kernel's order; whatever Triton specialises on (a tensor's alignment or dtype, an integer's
divisibility by 16, a constexpr's value) starts a new entry."""

from __future__ import annotations

import pytest
import torch

from swa_bench.kernels import Kernels, KernelSettings
from swa_bench.kernels import launch as launch_module
from swa_bench.kernels.launch import launch, specialization
from tests.kernels.conftest import TRITON


class Compiled:
    function, packed_metadata = "fn", "meta"

    def __init__(self, runs):
        self.runs = runs

    def run(self, *args):
        self.runs.append(args)


class Kernel:
    """A JIT function's face: ``arg_names``, constexpr positions, ``kernel[grid](...)``."""

    arg_names = ["x", "n", "eps", "BLOCK", "FLAG"]
    constexprs = [3, 4]

    def __init__(self):
        self.slow, self.fast = [], []

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.slow.append((grid, args, kwargs))
            return Compiled(self.fast)

        return call


class Driver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 77


@pytest.fixture
def compiled_path(monkeypatch):
    monkeypatch.setattr(launch_module, "_driver", lambda: Driver())
    monkeypatch.setattr(launch_module, "launch_hooks", lambda: False)
    monkeypatch.setattr(launch_module, "_COMPILED", {})


def test_a_specialisation_is_bound_once_then_launched_directly(compiled_path):
    kernel = Kernel()
    x = torch.zeros(64)
    launch(kernel, (3,), x, 32, 1e-6, direct=True, BLOCK=128, FLAG=True, num_warps=4)
    assert len(kernel.slow) == 1 and not kernel.fast
    launch(kernel, (5, 2), x, 48, 2e-6, direct=True, BLOCK=128, FLAG=True, num_warps=4)
    assert len(kernel.slow) == 1
    assert kernel.fast == [(5, 2, 1, 77, "fn", "meta", None, None, None, x, 48, 2e-6, 128, True)]


@pytest.mark.parametrize("change", ["unaligned", "dtype", "odd int", "constexpr", "warps"])
def test_what_triton_specialises_on_starts_a_new_entry(compiled_path, change):
    kernel = Kernel()
    x = torch.zeros(64)
    call = dict(args=[x, 32, 1e-6], kwargs=dict(BLOCK=128, FLAG=True, num_warps=4))
    launch(kernel, (1,), *call["args"], direct=True, **call["kwargs"])
    if change == "unaligned":
        call["args"][0] = x[1:]
    elif change == "dtype":
        call["args"][0] = x.double()
    elif change == "odd int":
        call["args"][1] = 33
    elif change == "constexpr":
        call["kwargs"]["BLOCK"] = 256
    else:
        call["kwargs"]["num_warps"] = 8
    launch(kernel, (1,), *call["args"], direct=True, **call["kwargs"])
    assert len(kernel.slow) == 2 and not kernel.fast


def test_triton_s_path_on_request_and_with_hooks(compiled_path, monkeypatch):
    """The ``triton`` launch mode (or the interpreter: ``Kernels.direct_launch`` false) and a
    registered launch hook take Triton's path on every call; a bad mode is refused. Triton's
    hook chains count as hooks only when filled."""
    kernel = Kernel()
    x = torch.zeros(64)
    assert not Kernels("triton", launch="triton").direct_launch
    assert not Kernels("triton", interpret=True).direct_launch
    assert Kernels("triton").direct_launch
    for _ in range(2):
        launch(kernel, (1,), x, 32, 1e-6, direct=False, BLOCK=128, FLAG=True)
    assert len(kernel.slow) == 2 and not kernel.fast
    with pytest.raises(ValueError, match="SWA_BENCH_TRITON_LAUNCH"):
        KernelSettings.parse(launch="fast", names={"launch": "SWA_BENCH_TRITON_LAUNCH"})
    monkeypatch.setattr(launch_module, "launch_hooks", lambda: True)
    for _ in range(2):
        launch(kernel, (1,), x, 32, 1e-6, direct=True, BLOCK=128, FLAG=True)
    assert len(kernel.slow) == 4 and not kernel.fast
    monkeypatch.undo()
    from triton import knobs

    assert not launch_module.launch_hooks()  # empty chains
    knobs.runtime.launch_enter_hook.add(print)
    try:
        assert launch_module.launch_hooks()
    finally:
        knobs.runtime.launch_enter_hook.remove(print)


def test_a_positional_constexpr_keys_by_value_and_a_missing_keyword_is_never_cached(
        compiled_path):
    kernel = Kernel()
    x = torch.zeros(64)
    assert specialization(kernel, [x, 32, 1e-6, 128]) != specialization(kernel, [x, 32, 1e-6, 64])
    for _ in range(2):
        launch(kernel, (1,), x, 32, 1e-6, direct=True, BLOCK=128)  # FLAG left to its default
    assert len(kernel.slow) == 2 and not kernel.fast


@pytest.mark.cuda
def test_the_direct_launch_computes_what_tritons_path_computes():
    """On the GPU: the first call (Triton's path) and the direct launches agree, on an aligned
    and an unaligned input (a new entry), and the direct path was taken."""
    import torch.nn.functional as F

    from swa_bench.kernels import triton_moe
    from swa_bench.kernels.moe import silu_mul

    flat = torch.randn(9 * 600 + 1, device="cuda")
    for h in (flat[:-1].view(9, 600), flat[1:].view(9, 600)):  # 16-byte aligned, then not
        want = F.silu(h[:, :300]) * h[:, 300:]
        for _ in range(3):
            torch.testing.assert_close(silu_mul(TRITON, h), want, rtol=2e-6, atol=2e-6)
    entered = {key[2][0] for key in launch_module._COMPILED
               if key[0] is triton_moe.silu_mul_kernel}
    assert {(torch.float32, True), (torch.float32, False)} <= entered  # both alignments
