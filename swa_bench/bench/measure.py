"""Measuring one case's two paths: time, peak memory and FLOPs of the reference and the replay step.

The FLOPs, kept rows and ideal speedup describe the path that ran: they come from the step plan
each engine made for the timed step (a step that did not trim counts as the whole batch; FULL's
eager fallback above the largest capture size counts as the trimmed step it was).
"""

from __future__ import annotations

from dataclasses import dataclass

from swa_bench.bench.flops import count_flops, measure_peak_memory
from swa_bench.bench.timing import RegionTimer, time_fn, time_interleaved
from swa_bench.engine.dispatch import StepPlan
from swa_bench.engine.engine import Engine
from swa_bench.engine.step_inputs import StepInputs
from swa_bench.results import CaseTiming


@dataclass(frozen=True)
class TimingSettings:
    warmup: int
    iters: int
    l2_flush: bool
    threads: int | None
    breakdown: bool


@dataclass
class PathMeasurement:
    """What one case measured; the figures derived from it (speedup, ideal) are the results'."""

    timing: CaseTiming
    peak_memory_bytes: dict[str, int]
    flops: dict[str, int]
    plans: dict[str, StepPlan]


class FlopCache:
    """FLOPs of a path, counted once per (model, inputs, plan, shape mode, kernels): eager steps
    of every graph mode that run the same plan do the same arithmetic; a FULL graph's static
    attention does more than PIECEWISE's varlen one at the same padded size, and other kernels
    count other FLOPs (a fused kernel's formula is not the PyTorch path's ops)."""

    def __init__(self) -> None:
        self.counts: dict[tuple, int] = {}

    def clear(self) -> None:
        self.counts.clear()

    def count(self, engine: Engine, inputs: StepInputs, plan: StepPlan) -> int:
        key = (id(engine.model), inputs, plan.shape_mode, plan.graph_size, plan.replays,
               plan.kept_lens, plan.replay_graph_size, engine.kernels)
        if key not in self.counts:
            self.counts[key] = count_flops(
                lambda: engine.eager_equivalent(
                    inputs.requests, inputs.step_tokens, inputs.cache_indices
                )
            )
        return self.counts[key]


def measure_paths(
    reference: Engine,
    replay: Engine,
    inputs: StepInputs,
    settings: TimingSettings,
    flop_cache: FlopCache,
) -> PathMeasurement:
    """Times both engines' step on ``inputs`` (the replay step's breakdown recorded in the same
    iterations), their peak memory and their FLOPs. On a GPU each path is timed in its own loop
    and its peak memory measured over that loop; on a CPU, where other jobs share the cores, the
    two paths alternate (``time_interleaved``) and peak memory is one more call of each."""
    device = reference.device
    for engine in (reference, replay):
        inputs.fill_context(engine)
        engine.capture()
        if engine.replay_graphs is not None:
            # Replay graphs are captured at a size's first use: one untimed step (it writes what
            # every timed repetition writes again), so no sample, nor a timed loop's peak memory,
            # holds a capture.
            engine.step(inputs.requests, inputs.step_tokens, inputs.cache_indices)
    engines = {"reference": reference, "replay": replay}
    timer = RegionTimer(device) if settings.breakdown else None
    plans: dict[str, StepPlan] = {}  # read from the timed steps' outputs, not planned again

    def timed_step(name: str, engine: Engine, timer: RegionTimer | None) -> None:
        out = engine.step(inputs.requests, inputs.step_tokens, inputs.cache_indices, timer=timer)
        plans[name] = out.plan

    steps = {
        name: (lambda n=name, e=engine, t=(timer if name == "replay" else None):
               timed_step(n, e, t))
        for name, engine in engines.items()
    }
    if device.type == "cuda":
        timings, peaks = {}, {}
        for name, step in steps.items():  # peak memory over the timed loop itself

            def timed(step=step, name=name):
                timings[name] = time_fn(
                    step, device=device, warmup=settings.warmup, iters=settings.iters,
                    l2_flush=settings.l2_flush, threads=settings.threads,
                )

            peaks[name] = measure_peak_memory(timed, device)
    else:
        timings = time_interleaved(steps, warmup=settings.warmup, iters=settings.iters,
                                   threads=settings.threads)
        peaks = {name: measure_peak_memory(step, device) for name, step in steps.items()}
    breakdown = timer.summary() if timer is not None else {}
    flops = {name: flop_cache.count(engine, inputs, plans[name])
             for name, engine in (("reference", reference), ("replay", replay))}
    return PathMeasurement(
        timing=CaseTiming(reference=timings["reference"], replay=timings["replay"],
                          breakdown_ms=breakdown),
        peak_memory_bytes=peaks,
        flops=flops,
        plans=plans,
    )

