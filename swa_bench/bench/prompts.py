"""Timing a whole chunked prompt on both paths: every step, the first decode, TTFT.

A step of a chunked prompt cannot be timed in a loop of its own: it writes the ring slots the
next repetition would read, so a second run would start from a state no scheduler ever builds.
Instead the whole prompt is one repetition (decode rows' contexts refilled untimed, then every
chunk and the first decode in order, each timed as a region: CUDA events with one synchronize
at the end, or ``cpu_clock`` on a CPU) and repeated ``warmup + iters`` times; a step's samples
are its times over the timed repetitions. On a CPU the two paths alternate per repetition (A B,
then B A), as ``time_interleaved`` does for single steps. TTFT is per repetition the sum of its
steps' samples plus its first decode's, so the recorded figures add up exactly.

Peak memory is each path's over one untimed repetition's chunks and first decode (above the level
they start from; the decode rows' contexts are filled before it): the first warm-up, or with no
warm-up one more repetition after the timed ones, so no sample is changed by the measurement.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from swa_bench.bench.flops import measure_peak_memory
from swa_bench.bench.measure import TimingSettings
from swa_bench.bench.timing import RegionTimer, num_threads, summarize
from swa_bench.engine.chunked_prompt import ChunkedPrompt
from swa_bench.engine.dispatch import StepPlan
from swa_bench.engine.engine import Engine, StepOutput
from swa_bench.results import CaseTiming, PromptResult, PromptStep, TimingStats

PATHS = ("reference", "replay")


@dataclass
class PromptTiming:
    """Each path's samples per step (``steps[path][i]``), of the first decode and of TTFT, the
    replay path's plan of every step (from the timed steps, not planned again) and each path's
    peak memory over a whole prompt."""

    steps: dict[str, list[list[float]]]
    first_decode: dict[str, list[float]]
    ttft: dict[str, list[float]]
    plans: list[StepPlan]
    peak_memory_bytes: dict[str, int]


def _last_token(out: StepOutput) -> int:
    """The prompt's next token: the argmax of its last logits row (the prompt is request 0)."""
    rows = [j for j, (request, _) in enumerate(out.step.logit_rows()) if request == 0]
    return int(out.logits[rows[-1]].argmax())


def run_prompt(engine: Engine, prompt: ChunkedPrompt, timer: RegionTimer | None = None
               ) -> list[StepOutput]:
    """One repetition: the decode rows' contexts (untimed), each chunk as region ``step<i>``,
    then the first decode as region ``decode``. Returns every step's output, the decode last."""
    prompt.fill_context(engine)
    return prompt_steps(engine, prompt, timer)


def prompt_steps(engine: Engine, prompt: ChunkedPrompt, timer: RegionTimer | None = None
                 ) -> list[StepOutput]:
    """The prompt's chunks and its first decode on ``engine``'s caches as they are (after
    ``prompt.fill_context``)."""
    outs = []
    for i, inputs in enumerate(prompt.steps()):
        with _region(timer, f"step{i}"):
            outs.append(engine.step(inputs.requests, inputs.step_tokens, inputs.cache_indices))
    decode = prompt.first_decode(_last_token(outs[-1]))
    with _region(timer, "decode"):
        outs.append(engine.step(decode.requests, decode.step_tokens, decode.cache_indices))
    return outs


def _region(timer: RegionTimer | None, name: str):
    return timer.region(name) if timer is not None else contextlib.nullcontext()


def time_prompt(reference: Engine, replay: Engine, prompt: ChunkedPrompt,
                settings: TimingSettings) -> PromptTiming:
    """Both paths through ``prompt``, ``settings.warmup`` untimed repetitions then
    ``settings.iters`` timed ones (``l2_flush`` and ``breakdown`` do not apply: the steps run
    back to back, as a scheduler runs them)."""
    engines = {"reference": reference, "replay": replay}
    for engine in engines.values():
        engine.capture()
    timers = {name: RegionTimer(engine.device) for name, engine in engines.items()}
    plans: list[StepPlan] = []
    peaks: dict[str, int] = {}

    def keep_plans(name: str, outs: list[StepOutput]) -> None:
        if name == "replay" and not plans:
            plans.extend(out.plan for out in outs[:-1])

    def repetition(name: str, timer: RegionTimer | None) -> None:
        keep_plans(name, run_prompt(engines[name], prompt, timer))

    def measured(name: str) -> None:
        """An untimed repetition whose chunks and first decode are measured (the decode rows'
        contexts, filled first, are set-up: a prefill of their own, often the largest)."""
        engine = engines[name]
        prompt.fill_context(engine)
        peaks[name] = measure_peak_memory(
            lambda: keep_plans(name, prompt_steps(engine, prompt)), engine.device)

    with num_threads(settings.threads):
        for rep in range(settings.warmup + settings.iters):
            order = PATHS if rep % 2 == 0 else PATHS[::-1]
            for name in order:
                if rep == 0 and settings.warmup:
                    measured(name)
                else:
                    repetition(name, timers[name] if rep >= settings.warmup else None)
        if not settings.warmup:
            for name in PATHS:
                measured(name)
    steps, first, ttft = {}, {}, {}
    for name, timer in timers.items():
        samples = timer.samples()
        steps[name] = [samples[f"step{i}"] for i in range(prompt.num_chunks)]
        first[name] = samples["decode"]
        ttft[name] = [sum(column) + decode
                      for column, decode in zip(zip(*steps[name], strict=True), first[name],
                                                strict=True)]
    return PromptTiming(steps, first, ttft, plans, peaks)


def _pair(samples: dict[str, list[float]]) -> CaseTiming:
    return CaseTiming(reference=summarize(samples["reference"]),
                      replay=summarize(samples["replay"]))


def prompt_result(prompt: ChunkedPrompt, timing: PromptTiming | None) -> PromptResult:
    """The prompt's figures: per step (chunk, kept rows, route, both paths' times), the first
    decode, TTFT, tokens/s (the prompt's length over the median TTFT) and the TTFT speedup.
    Without ``timing``, the steps alone."""
    steps = []
    for i, inputs in enumerate(prompt.steps()):
        chunk = inputs.requests[0]
        step = PromptStep(index=i, cached_len=chunk.cached_len, query_len=chunk.query_len,
                          tokens=inputs.num_tokens)
        if timing is not None:
            plan = timing.plans[i]
            step.kept_rows, step.replay_route = plan.num_kept, plan.reason
            step.reference = summarize(timing.steps["reference"][i])
            step.replay = summarize(timing.steps["replay"][i])
        steps.append(step)
    result = PromptResult(length=prompt.length, chunk_size=prompt.chunk_size,
                          decodes_beside=prompt.decodes_beside, steps=steps)
    if timing is not None:
        result.peak_memory_bytes = dict(timing.peak_memory_bytes)
        result.first_decode, result.ttft = _pair(timing.first_decode), _pair(timing.ttft)
        medians: dict[str, TimingStats] = {"reference": result.ttft.reference,
                                           "replay": result.ttft.replay}
        result.tokens_per_s = {name: prompt.length / (stats.median_ms / 1e3)
                               for name, stats in medians.items()}
        result.speedup = medians["reference"].median_ms / medians["replay"].median_ms
    return result
