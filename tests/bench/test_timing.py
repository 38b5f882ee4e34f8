import time

import numpy as np
import pytest
import torch

from swa_bench.bench.timing import (
    RegionTimer,
    default_threads,
    num_threads,
    summarize,
    time_fn,
)
from swa_bench.model.forward_context import region

CPU = torch.device("cpu")


def test_summarize_matches_numpy_percentiles():
    data = [5.0, 1.0, 4.0, 2.0, 3.0, 10.0, 7.5, 6.25, 8.0, 9.0, 0.5]
    stats = summarize(data)
    assert stats.median_ms == pytest.approx(np.percentile(data, 50))
    assert stats.p10_ms == pytest.approx(np.percentile(data, 10))
    assert stats.p90_ms == pytest.approx(np.percentile(data, 90))
    iqr = np.percentile(data, 75) - np.percentile(data, 25)
    assert stats.iqr_over_median == pytest.approx(iqr / np.median(data))
    assert stats.samples_ms == data


def test_summarize_single_sample():
    stats = summarize([3.0])
    assert (stats.median_ms, stats.p10_ms, stats.p90_ms) == (3.0, 3.0, 3.0)
    assert stats.iqr_over_median == 0.0 and not stats.noisy


@pytest.mark.parametrize(("spread", "noisy"), [(0.09, False), (0.11, True)])
def test_noisy_flag_around_ten_percent(spread, noisy):
    # Quartiles of [1-s/2, 1-s/2, 1, 1+s/2, 1+s/2] are 1-s/2 and 1+s/2: IQR/median == s.
    half = spread / 2
    stats = summarize([1 - half, 1 - half, 1.0, 1 + half, 1 + half])
    assert stats.iqr_over_median == pytest.approx(spread)
    assert stats.noisy is noisy


def test_noise_threshold_is_configurable():
    data = [0.9, 0.9, 1.0, 1.1, 1.1]
    assert summarize(data, noise_threshold=0.1).noisy
    assert not summarize(data, noise_threshold=0.3).noisy


def test_summarize_rejects_empty():
    with pytest.raises(ValueError):
        summarize([])


def test_time_fn_cpu_counts_warmup_and_iters():
    calls = []
    stats = time_fn(lambda: calls.append(1), device=CPU, warmup=3, iters=7)
    assert len(calls) == 10
    assert len(stats.samples_ms) == 7
    assert all(s >= 0 for s in stats.samples_ms)


def test_time_fn_cpu_sets_and_restores_threads():
    before = torch.get_num_threads()
    target = 1 if before != 1 else 2
    seen = []
    time_fn(lambda: seen.append(torch.get_num_threads()), device=CPU, warmup=1, iters=2,
            threads=target)
    assert seen == [target] * 3
    assert torch.get_num_threads() == before


def test_time_fn_restores_threads_when_fn_raises():
    before = torch.get_num_threads()

    def boom():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        time_fn(boom, device=CPU, warmup=0, iters=1, threads=1 if before != 1 else 2)
    assert torch.get_num_threads() == before


def test_time_fn_measures_sleep_in_wall_clock_with_several_threads():
    stats = time_fn(lambda: time.sleep(0.002), device=CPU, warmup=1, iters=5, threads=2)
    assert 1.0 < stats.median_ms < 200.0
    assert min(stats.samples_ms) > 1.0


def test_time_fn_cpu_l2_flush_runs():
    stats = time_fn(lambda: None, device=CPU, warmup=0, iters=2, l2_flush=True)
    assert len(stats.samples_ms) == 2


@pytest.mark.parametrize("kwargs", [{"warmup": -1, "iters": 1}, {"warmup": 0, "iters": 0}])
def test_time_fn_rejects_bad_counts(kwargs):
    with pytest.raises(ValueError):
        time_fn(lambda: None, device=CPU, **kwargs)


def test_time_fn_rejects_unsupported_device():
    with pytest.raises(ValueError):
        time_fn(lambda: None, device=torch.device("meta"), warmup=0, iters=1)


def test_region_timer_sequential_and_nested():
    timer = RegionTimer(CPU)
    with num_threads(2):  # wall clock: the regions sleep (one thread would take CPU time)
        for _ in range(3):
            with timer.region("layers"):
                with timer.region("gather"):
                    time.sleep(0.001)
                time.sleep(0.001)
            with timer.region("scatter"):
                pass
    samples = timer.samples()
    assert set(samples) == {"layers", "gather", "scatter"}
    assert [len(v) for v in samples.values()] == [3, 3, 3]
    pairs = zip(samples["layers"], samples["gather"], strict=True)
    assert all(outer > inner for outer, inner in pairs)
    summary = timer.summary()
    assert set(summary) == {"layers", "gather", "scatter"}
    assert summary["layers"] > summary["gather"] > summary["scatter"]
    assert summary["layers"] >= 2.0


def test_region_timer_skips_a_region_that_raises():
    timer = RegionTimer(CPU)
    with pytest.raises(KeyError):
        with timer.region("prepare"):
            raise KeyError("x")
    assert timer.summary() == {}


def test_region_none_is_a_noop():
    ran = []
    with region(None, "prepare"):
        ran.append(True)
    assert ran == [True]


def test_region_helper_records_into_timer():
    timer = RegionTimer(CPU)
    with region(timer, "prepare"):
        pass
    assert list(timer.samples()) == ["prepare"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_time_fn_cuda_events():
    device = torch.device("cuda")
    a = torch.randn(1024, 1024, device=device)
    stats = time_fn(lambda: a @ a, device=device, warmup=2, iters=5, l2_flush=True)
    assert len(stats.samples_ms) == 5
    assert all(s > 0 for s in stats.samples_ms)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_region_timer_cuda():
    device = torch.device("cuda")
    a = torch.randn(1024, 1024, device=device)
    timer = RegionTimer(device)
    for _ in range(2):
        with timer.region("layers"):
            with timer.region("gather"):
                a @ a
            a @ a
    summary = timer.summary()
    assert summary["layers"] > summary["gather"] > 0


@pytest.mark.parametrize(("value", "expected"), [(None, 1), ("", 1), ("4", 4), ("0", 1),
                                                 ("two", 1), (" 2 ", 2)])
def test_default_threads_honours_omp_num_threads(value, expected):
    environ = {} if value is None else {"OMP_NUM_THREADS": value}
    assert default_threads(environ) == expected


def test_time_fn_without_threads_takes_the_default(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    seen = []
    time_fn(lambda: seen.append(torch.get_num_threads()), device=CPU, warmup=0, iters=2)
    assert seen == [1, 1]


def test_one_thread_samples_cpu_time_not_time_spent_descheduled():
    """A sleeping step (the thread descheduled, as under another job) costs no CPU time."""
    with num_threads(1):
        stats = time_fn(lambda: time.sleep(0.02), device=CPU, warmup=0, iters=3)
    assert stats.median_ms < 5
    with num_threads(2):
        assert time_fn(lambda: time.sleep(0.02), device=CPU, warmup=0, iters=3,
                       threads=2).median_ms >= 19
