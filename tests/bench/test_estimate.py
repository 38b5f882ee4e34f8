"""The dry run's duration estimate: composed of the FLOP model and the step counts as documented,
growing with the work, and within its stated factor of 3 of the committed runs it names."""

import json
from datetime import datetime
from pathlib import Path

import pytest

from swa_bench.bench.estimate import (
    CHECK_STEPS,
    CPU_RATE,
    GPU_RATE,
    case_steps,
    estimate_case,
    format_duration,
)
from swa_bench.bench.flop_model import step_flops
from swa_bench.model.args import build_args
from swa_bench.model.requests import RequestSpec
from swa_bench.scenario import expand_cases, load_scenario

ROOT = Path(__file__).resolve().parents[2]


def _estimate(case, rate=CPU_RATE):
    sc = case.scenario
    checks = sum(getattr(sc.checks, name).enabled
                 for name in ("e1", "e2", "e3", "e4", "e5", "approximation", "tasks"))
    return estimate_case(case.model_args(), case.requests(), checks_enabled=checks,
                         timing_enabled=sc.timing.enabled, warmup=sc.timing.warmup,
                         iters=sc.timing.iters, rate=rate)


def test_a_case_is_its_step_times_its_steps_priced_by_the_flop_model():
    args = build_args("tiny")
    requests = [RequestSpec(prompt_len=40), RequestSpec(prompt_len=24, decode=True)]
    guess = estimate_case(args, requests, checks_enabled=3, timing_enabled=True, warmup=2,
                          iters=10, rate=CPU_RATE)
    flops = step_flops(args, requests, [r.query_len for r in requests])["total"]
    assert guess.step_flops == flops
    assert guess.step_s == pytest.approx(args.n_layers * CPU_RATE.layer_s
                                         + flops / CPU_RATE.flops_per_s)
    assert guess.steps == 2 * 12 + 3 * CHECK_STEPS
    assert guess.seconds == pytest.approx(guess.step_s * guess.steps)
    assert case_steps(checks_enabled=0, timing_enabled=False, warmup=2, iters=10) == 0
    assert case_steps(checks_enabled=1, timing_enabled=False, warmup=2, iters=10) == CHECK_STEPS


def test_more_tokens_more_time_and_a_gpu_is_faster():
    args = build_args("small")
    times = [estimate_case(args, [RequestSpec(prompt_len=n)], checks_enabled=4,
                           timing_enabled=True, warmup=2, iters=10, rate=CPU_RATE).seconds
             for n in (64, 256, 1024, 4000)]
    assert times == sorted(times) and times[-1] > 10 * times[0]
    gpu = estimate_case(args, [RequestSpec(prompt_len=4000)], checks_enabled=4,
                        timing_enabled=True, warmup=2, iters=10, rate=GPU_RATE).seconds
    assert gpu < times[-1] / 100


def test_the_committed_smoke_run_is_within_a_factor_of_three():
    """ci/smoke-baseline.json (the CPU constants' source) took finished_at - started_at; the
    estimate of the shipped smoke scenario's cases must land within 3x of it, and each case's
    step within 3x of its recorded reference median."""
    baseline = json.loads((ROOT / "ci" / "smoke-baseline.json").read_text())
    took = (datetime.fromisoformat(baseline["finished_at"])
            - datetime.fromisoformat(baseline["started_at"])).total_seconds()
    cases = expand_cases(load_scenario(ROOT / "scenarios" / "smoke.yaml"))
    guesses = {case.label(): _estimate(case) for case in cases}
    total = sum(g.seconds for g in guesses.values())
    assert took / 3 < total < 3 * took, (total, took)
    for case in baseline["cases"]:
        step_ms = 1e3 * guesses[case["label"]].step_s
        assert case["timing"]["reference"]["median_ms"] / 3 < step_ms < (
            3 * case["timing"]["reference"]["median_ms"])


@pytest.mark.parametrize(("seconds", "text"), [(0.42, "0.42 s"), (3.6, "3.6 s"), (47.2, "47 s"),
                                               (132, "2.2 min"), (5600, "1.6 h")])
def test_durations_read_as_estimates(seconds, text):
    assert format_duration(seconds) == text
