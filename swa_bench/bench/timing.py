"""Wall-clock measurement that keeps every raw sample.

GPU work is timed with CUDA events on the current stream and the host synchronizes once, after the
last iteration, so the timed loop never stalls the launch queue. CPU work is timed with
``time.perf_counter`` under a fixed thread count, restored afterwards: by default one thread (or
OMP_NUM_THREADS), because intra-op threads spin-wait for each other and a second job on a small
machine then turns a 10 ms step into 50-2500 ms. On one thread a sample is the thread's CPU time
(``time.thread_time``): all of the step's work runs on the calling thread, and time the thread
spends descheduled by other jobs is not the step's latency; with more threads, wall-clock time.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from swa_bench.results import TimingStats

NOISE_THRESHOLD = 0.10
L2_FALLBACK_BYTES = 64 * 1024 * 1024


def _percentile(ordered: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile of sorted data (numpy's default method)."""
    position = (len(ordered) - 1) * q / 100.0
    lower = int(position)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (position - lower)


def summarize(samples_ms: Sequence[float], noise_threshold: float = NOISE_THRESHOLD) -> TimingStats:
    """Median and p10/p90 of the samples; ``noisy`` when IQR/median exceeds ``noise_threshold``."""
    if len(samples_ms) == 0:
        raise ValueError("summarize: no timing samples")
    samples = [float(s) for s in samples_ms]
    ordered = sorted(samples)
    median = _percentile(ordered, 50)
    iqr = _percentile(ordered, 75) - _percentile(ordered, 25)
    if median > 0:
        spread = iqr / median
    else:
        spread = 0.0 if iqr == 0 else float("inf")
    return TimingStats(
        samples_ms=samples,
        median_ms=median,
        p10_ms=_percentile(ordered, 10),
        p90_ms=_percentile(ordered, 90),
        iqr_over_median=spread,
        noisy=spread > noise_threshold,
    )


def cpu_clock() -> Callable[[], float]:
    """The clock of CPU samples under the current torch thread count (see the module doc)."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def cpu_clock_name(threads: int) -> str:
    return "thread CPU time" if threads == 1 else "wall clock"


def default_threads(environ: dict[str, str] | None = None) -> int:
    """CPU threads when a scenario sets none: OMP_NUM_THREADS when it is a positive integer,
    else 1."""
    value = (os.environ if environ is None else environ).get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else 1


@contextmanager
def num_threads(threads: int | None) -> Iterator[None]:
    """Run the body under ``torch.set_num_threads(threads)`` (None: ``default_threads()``); the
    previous count is restored."""
    if threads is None:
        threads = default_threads()
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def l2_cache_bytes(device: torch.device) -> int:
    """The device's L2 size; the fallback where the property is missing (CPU, old drivers)."""
    if device.type == "cuda":
        size = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
        if size:
            return int(size)
    return L2_FALLBACK_BYTES


def _check_device(device: torch.device) -> None:
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"timing supports cpu and cuda devices, got {device.type!r}")


def time_fn(
    fn: Callable[[], object],
    *,
    device: torch.device,
    warmup: int,
    iters: int,
    l2_flush: bool = False,
    threads: int | None = None,
) -> TimingStats:
    """Call ``fn`` ``warmup`` times untimed, then ``iters`` times timed, one sample per call.

    With ``l2_flush`` a buffer of twice the L2 size is zeroed before every timed call, outside the
    timed region, so each call starts from a cold cache.
    """
    device = torch.device(device)
    _check_device(device)
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    flush = None
    if l2_flush:
        flush = torch.empty(2 * l2_cache_bytes(device), dtype=torch.int8, device=device)
    with num_threads(threads):
        for _ in range(warmup):
            fn()
        if device.type == "cuda":
            samples = _time_cuda(fn, device, iters, flush)
        else:
            samples = _time_cpu(fn, iters, flush)
    return summarize(samples)


def _time_cuda(
    fn: Callable[[], object], device: torch.device, iters: int, flush: torch.Tensor | None
) -> list[float]:
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for start, end in zip(starts, ends, strict=True):
            if flush is not None:
                flush.zero_()
            start.record(stream)
            fn()
            end.record(stream)
        torch.cuda.synchronize(device)
    return [start.elapsed_time(end) for start, end in zip(starts, ends, strict=True)]


def time_interleaved(
    fns: dict[str, Callable[[], object]],
    *,
    warmup: int,
    iters: int,
    threads: int | None = None,
) -> dict[str, TimingStats]:
    """CPU timing of several paths in alternation (A B, then B A, ...), one sample per call.

    On a shared CPU a burst of outside load then hits every path alike instead of whichever
    path was being timed at the moment, so the ratio of their medians stays steady.
    """
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    names = list(fns)
    samples: dict[str, list[float]] = {name: [] for name in names}
    with num_threads(threads):
        for _ in range(warmup):
            for name in names:
                fns[name]()
        clock = cpu_clock()
        for i in range(iters):
            for name in names if i % 2 == 0 else reversed(names):
                start = clock()
                fns[name]()
                samples[name].append((clock() - start) * 1e3)
    return {name: summarize(values) for name, values in samples.items()}


def _time_cpu(fn: Callable[[], object], iters: int, flush: torch.Tensor | None) -> list[float]:
    clock = cpu_clock()
    samples = []
    for _ in range(iters):
        if flush is not None:
            flush.zero_()
        start = clock()
        fn()
        samples.append((clock() - start) * 1e3)
    return samples


class RegionTimer:
    """Named regions inside one timed call (the replay step's breakdown: prepare, gather, layers,
    scatter).

    On CUDA it records events on the current stream and never synchronizes inside a region;
    `summary()` synchronizes once and returns {region: median ms}. On CPU, ``cpu_clock()``.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        _check_device(self.device)
        self._pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._samples: dict[str, list[float]] = {}

    @contextmanager
    def region(self, name: str) -> Iterator[None]:
        """Time the body under ``name``; a body that raises records nothing."""
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            yield
            end.record(stream)
            self._pending.append((name, start, end))
        else:
            clock = cpu_clock()
            start_s = clock()
            yield
            self._samples.setdefault(name, []).append((clock() - start_s) * 1e3)

    def _resolve(self) -> None:
        if not self._pending:
            return
        torch.cuda.synchronize(self.device)
        for name, start, end in self._pending:
            self._samples.setdefault(name, []).append(start.elapsed_time(end))
        self._pending.clear()

    def samples(self) -> dict[str, list[float]]:
        """Every recorded occurrence per region, in ms, in recording order."""
        self._resolve()
        return {name: list(values) for name, values in self._samples.items()}

    def summary(self) -> dict[str, float]:
        """Median over all recorded occurrences per region (ms)."""
        return {name: summarize(values).median_ms for name, values in self.samples().items()}
