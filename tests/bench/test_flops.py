from types import SimpleNamespace

import pytest
import torch

from swa_bench.bench import measure
from swa_bench.bench.flops import count_flops, measure_peak_memory
from swa_bench.kernels import TORCH_KERNELS, Kernels

CPU = torch.device("cpu")
MIB = 1 << 20


@pytest.mark.parametrize(("m", "n", "k"), [(8, 16, 32), (3, 5, 7)])
def test_count_flops_matmul(m, n, k):
    a, b = torch.randn(m, k), torch.randn(k, n)
    assert count_flops(lambda: a @ b) == 2 * m * n * k


def test_count_flops_einsum_batched():
    q, kv = torch.randn(2, 4, 6, 8), torch.randn(2, 4, 10, 8)
    assert count_flops(lambda: torch.einsum("bhqd,bhkd->bhqk", q, kv)) == 2 * 2 * 4 * 6 * 10 * 8


def test_count_flops_elementwise_is_zero():
    x = torch.randn(64)
    assert count_flops(lambda: x + x) == 0


def test_peak_memory_counts_freed_temporary():
    def fn():
        tmp = torch.ones(MIB // 4)  # 1 MiB of fp32
        total = tmp.sum()
        del tmp
        return torch.zeros(MIB // 8) + total  # 0.5 MiB result

    peak = measure_peak_memory(fn, CPU)
    assert MIB <= peak < MIB + MIB // 2 + 4096


def test_peak_memory_two_live_temporaries_add_up():
    def fn():
        a = torch.ones(MIB // 4)
        b = torch.ones(MIB // 4)
        return a, b

    assert 2 * MIB <= measure_peak_memory(fn, CPU) < 2 * MIB + 4096


def test_peak_memory_does_not_double_count_views():
    def fn():
        x = torch.ones(MIB // 4)
        views = [x.view(-1, 4), x[::2], x.reshape(2, -1), x[1:]]
        x.add_(1)
        return views

    assert MIB <= measure_peak_memory(fn, CPU) < MIB + 4096


def test_peak_memory_ignores_preexisting_storage():
    x = torch.ones(MIB // 4)

    def fn():
        x.mul_(2)
        return x.view(4, -1)[1:]

    assert measure_peak_memory(fn, CPU) == 0


def test_peak_memory_sequential_frees_do_not_accumulate():
    def fn():
        for _ in range(5):
            t = torch.ones(MIB // 4)
            del t

    assert MIB <= measure_peak_memory(fn, CPU) < MIB + 4096


def test_peak_memory_rejects_unsupported_device():
    with pytest.raises(ValueError):
        measure_peak_memory(lambda: None, torch.device("meta"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_peak_memory_cuda():
    device = torch.device("cuda")
    keep = torch.ones(MIB, device=device)

    def fn():
        tmp = torch.ones(MIB // 4, device=device)
        del tmp

    assert MIB <= measure_peak_memory(fn, device) < 2 * MIB
    del keep


def test_the_flop_cache_keeps_other_kernels_apart(monkeypatch):
    """Other kernels count other FLOPs (a fused kernel's formula is not the PyTorch path's ops):
    a sweep over ``kernels.backend`` must count each setting, not reuse the first one's."""
    counted = []
    monkeypatch.setattr(measure, "count_flops", lambda run: counted.append(run) or len(counted))
    plan = SimpleNamespace(shape_mode="varlen", graph_size=None, replays=True, kept_lens=(4,),
                           replay_graph_size=None)
    model = object()

    def engine(kernels):
        return SimpleNamespace(model=model, kernels=kernels, eager_equivalent=lambda *a: None)

    inputs = ("the same inputs",)  # hashable, as the frozen StepInputs is
    cache = measure.FlopCache()
    torch_path = cache.count(engine(TORCH_KERNELS), inputs, plan)
    assert cache.count(engine(TORCH_KERNELS), inputs, plan) == torch_path == 1
    assert cache.count(engine(Kernels("triton", interpret=True)), inputs, plan) == 2
