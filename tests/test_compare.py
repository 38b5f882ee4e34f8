"""compare: cases match on what they measure, timing regresses only when significant and large,
checks and deterministic figures regress on any change, and nothing compared fails the gate."""

import math

import pytest

from swa_bench.compare import case_key, compare_runs
from swa_bench.report.comparison import comparison_json, verdict_line
from swa_bench.results import TaskResults
from tests.report.synthetic import clean_run, with_kernels


def statuses(comparison) -> set[str]:
    return {row.status for row in comparison.rows}


def test_identical_runs_pass():
    baseline = clean_run()
    comparison = compare_runs(baseline, baseline.model_copy(deep=True))
    assert statuses(comparison) == {"unchanged"}
    assert not comparison.regressed and comparison.timing_gated and not comparison.warnings


def test_independent_draws_of_the_same_timing_pass():
    comparison = compare_runs(clean_run(seed=0), clean_run(seed=1))
    assert not comparison.regressed
    assert statuses(comparison) <= {"unchanged"}


def test_twenty_percent_slowdown_of_one_path_regresses():
    comparison = compare_runs(clean_run(seed=0), clean_run(replay_scale=1.20, seed=1))
    assert comparison.regressed
    assert statuses(comparison) == {"regressed"}
    for row in comparison.rows:
        assert any(r.startswith("replay") and "+" in r and "p=" in r for r in row.reasons)
        verdicts = {t.path: t.verdict for t in row.timings}
        assert verdicts == {"reference": "unchanged", "replay": "slower"}


def test_a_shared_slowdown_on_a_cpu_is_a_warning_on_a_gpu_a_regression_when_large():
    """Both paths 40% slower alike: on a CPU the machine's load between two runs does that (the
    A/A pair of default runs moved one case by +14%, or +94% once other jobs started), so it is
    reported, not gated; on a GPU it regresses beyond DRIFT_LIMIT, and 10% does not."""
    from swa_bench.compare import DRIFT_LIMIT

    cpu = compare_runs(clean_run(seed=0), clean_run(scale=1.40, seed=1))
    assert not cpu.regressed and statuses(cpu) == {"warning"}
    assert {t.verdict for row in cpu.rows for t in row.timings} == {"within noise"}
    assert all("within the noise" in r and "timing not gated" in r
               for row in cpu.rows for r in row.reasons)

    def on_gpu(run):
        run.environment = {**run.environment, "gpu": "NVIDIA H200", "cuda": "12.8"}
        return run

    assert DRIFT_LIMIT < 0.40
    gpu = compare_runs(on_gpu(clean_run(seed=0)), on_gpu(clean_run(scale=1.40, seed=1)))
    assert statuses(gpu) == {"regressed"}
    small = compare_runs(on_gpu(clean_run(seed=0)), on_gpu(clean_run(scale=1.10, seed=1)))
    assert not small.regressed


def test_an_unstable_case_warns_unless_the_change_exceeds_its_spread():
    """Samples 25% wide (IQR/median about 0.34, flagged unstable): a 12% slowdown of one path is
    significant with 200 samples, yet inside the spread, so a warning; 2.5x is beyond it."""
    baseline = clean_run(noise=0.25, samples=200, seed=0)
    assert all(c.timing.replay.noisy for c in baseline.cases)
    inside = compare_runs(baseline, clean_run(noise=0.25, samples=200, replay_scale=1.12, seed=1))
    assert not inside.regressed
    assert any(t.verdict == "within noise" for row in inside.rows for t in row.timings)
    beyond = compare_runs(baseline, clean_run(noise=0.25, samples=200, replay_scale=2.5, seed=1))
    assert statuses(beyond) == {"regressed"}
    assert {t.verdict for row in beyond.rows for t in row.timings if t.path == "replay"} == {
        "slower"}


def test_a_drift_of_both_paths_with_tight_samples_does_not_regress():
    """The failing A/A pair of the issue, as data: one case's paths +8% and +14% between two
    runs of one commit, each run's samples within 3% of their median (not flagged unstable)."""
    baseline, current = clean_run(noise=0.01, seed=0), clean_run(noise=0.01, seed=1)
    case = current.cases[0]
    for path, factor in (("reference", 1.082), ("replay", 1.137)):
        stats = getattr(case.timing, path)
        scaled = [x * factor for x in stats.samples_ms]
        setattr(case.timing, path, stats.model_copy(update={
            "samples_ms": scaled, "median_ms": stats.median_ms * factor,
            "p10_ms": stats.p10_ms * factor, "p90_ms": stats.p90_ms * factor}))
    row = compare_runs(baseline, current).rows[0]
    assert all(t.p_slower < 0.01 and t.change > 0.05 for t in row.timings)
    assert row.status == "warning" and {t.verdict for t in row.timings} == {"within noise"}


def test_ten_percent_slowdown_with_three_samples_only_warns():
    comparison = compare_runs(clean_run(samples=3, seed=0),
                              clean_run(scale=1.10, samples=3, seed=1))
    assert not comparison.regressed
    assert statuses(comparison) == {"warning"}
    assert all("too few samples" in reason for row in comparison.rows for reason in row.reasons)


def test_significant_but_small_slowdown_is_not_a_regression():
    baseline = clean_run(noise=0.002, seed=0)
    current = clean_run(replay_scale=1.03, noise=0.002, seed=1)
    comparison = compare_runs(baseline, current)
    assert all(t.p_slower < 0.01 for row in comparison.rows for t in row.timings
               if t.path == "replay")
    assert not comparison.regressed
    stricter = compare_runs(baseline, current, max_slowdown=0.01)
    assert statuses(stricter) == {"regressed"}


def test_ten_percent_speedup_is_an_improvement():
    comparison = compare_runs(clean_run(seed=0), clean_run(replay_scale=1 / 1.20, seed=1))
    assert statuses(comparison) == {"improved"} and not comparison.regressed


def test_a_check_that_starts_failing_regresses():
    baseline = clean_run()
    current = baseline.model_copy(deep=True)
    case = current.cases[5]
    case.checks[0] = case.checks[0].model_copy(update={"passed": False, "message": "kept rows"})
    case.status = "failed"
    comparison = compare_runs(baseline, current)
    regressed = [row for row in comparison.rows if row.status == "regressed"]
    assert [row.label for row in regressed] == [case.label]
    assert regressed[0].reasons[0] == "E1 now fails: kept rows"
    back = compare_runs(current, baseline)
    assert not back.regressed
    assert [row.status for row in back.rows if row.label == case.label] == ["improved"]


def test_a_case_that_starts_raising_regresses():
    baseline = clean_run()
    current = baseline.model_copy(deep=True)
    current.cases[0] = current.cases[0].model_copy(
        update={"status": "error", "error": "RuntimeError: boom", "timing": None, "checks": []})
    row = compare_runs(baseline, current).rows[0]
    assert row.status == "regressed" and "case now raises: RuntimeError: boom" in row.reasons


def test_missing_case_is_reported_but_does_not_fail():
    baseline = clean_run()
    current = baseline.model_copy(deep=True)
    dropped = current.cases.pop(3)
    comparison = compare_runs(baseline, current)
    assert not comparison.regressed
    missing = [row for row in comparison.rows if row.status == "missing"]
    assert [row.label for row in missing] == [dropped.label]
    assert any("missing" in warning for warning in comparison.warnings)
    reverse = compare_runs(current, baseline)
    assert [row.label for row in reverse.rows if row.status == "new"] == [dropped.label]
    assert not reverse.regressed


def test_flop_or_deterministic_change_regresses():
    baseline = clean_run()
    current = baseline.model_copy(deep=True)
    current.cases[2].flops = {**current.cases[2].flops, "replay": current.cases[2].flops["replay"]
                              + 1}
    current.cases[4].deterministic = {**current.cases[4].deterministic, "kept_rows": 999}
    comparison = compare_runs(baseline, current, gate_timing=False)
    regressed = {row.label: row.reasons for row in comparison.rows if row.status == "regressed"}
    assert set(regressed) == {baseline.cases[2].label, baseline.cases[4].label}
    assert any(r.startswith("flops.replay ") for r in regressed[baseline.cases[2].label])
    assert any(r.startswith("deterministic.kept_rows ") and r.endswith("-> 999")
               for r in regressed[baseline.cases[4].label])



@pytest.mark.parametrize(("change", "reason"), [
    ({"backend": "torch"}, "backend triton -> torch"),
    ({"tile": "64,0,8,2"}, "tile auto -> 64,0,8,2"),
    ({"launch": "triton", "interpret": False}, "launch direct -> triton, interpret True -> False"),
])
def test_cases_that_ran_other_kernels_are_never_unchanged(change, reason):
    """Same figures, other kernels: every case is incomparable and named so, the verdict says it
    and the gate fails; asked for as an A/B, the cases are compared and the change warned about.
    Agreeing records, or a side that recorded none (an older file), compare as before."""
    baseline = with_kernels(clean_run())
    current = with_kernels(baseline, **change)
    comparison = compare_runs(baseline, current)
    assert statuses(comparison) == {"incomparable"} and comparison.failed
    assert all(row.reasons[0].startswith(f"kernels differ ({reason})") for row in comparison.rows)
    assert verdict_line(comparison).startswith(f"NOT COMPARABLE ({len(baseline.cases)} cases")
    assert comparison.matched == 0 and comparison.counts()["incomparable"] == len(baseline.cases)
    assert comparison_json(comparison, baseline="a", current="b")["verdict"] == "not comparable"
    ab = compare_runs(baseline, current, allow_config_change=True)
    assert statuses(ab) == {"warning"} and not ab.failed
    assert all(f"A/B: kernels differ ({reason})" in row.reasons for row in ab.rows)
    assert statuses(compare_runs(baseline, baseline.model_copy(deep=True))) == {"unchanged"}
    older = compare_runs(clean_run(), current)  # a baseline from before kernels were recorded
    assert statuses(older) == {"warning"} and not older.failed
    assert all("kernels not recorded in baseline (an older results file): whether both ran the "
               "same kernels is unknown" in row.reasons for row in older.rows)


def test_an_a_b_of_kernels_still_gates_every_figure_but_the_flops():
    """Other kernels count other FLOPs, so under --allow-config-change a FLOP change warns; a
    kept-row change does not depend on the kernels and still regresses."""
    baseline = with_kernels(clean_run())
    current = with_kernels(baseline, backend="torch")
    for case in current.cases:
        case.flops = {path: 2 * n for path, n in case.flops.items()}
    ab = compare_runs(baseline, current, allow_config_change=True)
    assert statuses(ab) == {"warning"} and not ab.failed
    assert all(any(r.startswith("flops.") and r.endswith("[other kernels]") for r in row.reasons)
               for row in ab.rows)
    current.cases[0].deterministic = {**current.cases[0].deterministic,
                                      "kept_rows": current.cases[0].deterministic["kept_rows"] + 1}
    ab = compare_runs(baseline, current, allow_config_change=True)
    assert ab.rows[0].status == "regressed" and ab.failed



def test_a_newly_recorded_figure_only_warns():
    baseline = clean_run()
    current = baseline.model_copy(deep=True)
    current.cases[0].deterministic = {**current.cases[0].deterministic, "breaks": 2}
    row = compare_runs(baseline, current).rows[0]
    assert row.status == "warning" and "deterministic.breaks only in current" in row.reasons


def test_a_baseline_from_before_the_roofline_compares_cleanly():
    """Results written before the roofline figures read them as None; compare neither raises
    nor regresses on them, either way round."""
    current = clean_run()
    baseline = current.model_copy(deep=True)
    for case in baseline.cases:
        case.reference_bytes = case.replay_bytes = None
        case.roofline_ideal_speedup = case.roofline_efficiency = None
        case.roofline_ms = {}
    for before, after in ((baseline, current), (current, baseline)):
        comparison = compare_runs(before, after)
        assert not comparison.regressed and statuses(comparison) == {"unchanged"}
        assert verdict_line(comparison) and comparison_json(comparison, baseline="a", current="b")


def test_replay_graphs_on_one_side_name_the_setting_and_the_route():
    baseline = clean_run()
    current = baseline.model_copy(deep=True)
    base_case, case = baseline.cases[0], current.cases[0]
    base_case.replay_route = "PIECEWISE graph of 64 >= trim_threshold 33"
    case.replay_capture_sizes = [32, 64]
    case.replay_route = base_case.replay_route + "; replay graph of 32 for 32 kept rows"
    row = compare_runs(baseline, current).rows[0]
    assert "replay graph sizes differ (off -> [32, 64])" in row.reasons
    assert any(r.startswith("route differs (PIECEWISE graph of 64") for r in row.reasons)
    assert not compare_runs(baseline, baseline.model_copy(deep=True)).rows[0].reasons


def test_different_environments_warn_and_do_not_gate_timing():
    baseline = clean_run(seed=0)
    current = clean_run(replay_scale=1.20, seed=1)
    current.environment = {**current.environment, "gpu": "NVIDIA H200", "cuda": "12.8"}
    comparison = compare_runs(baseline, current)
    assert not comparison.regressed and not comparison.timing_gated
    assert any("environments differ" in w and "gpu" in w for w in comparison.warnings)
    assert statuses(comparison) == {"warning"}
    assert all("not gated: environments differ" in r
               for row in comparison.rows for r in row.reasons)


def test_timing_gate_off_reports_but_never_regresses():
    comparison = compare_runs(clean_run(seed=0), clean_run(replay_scale=1.20, seed=1),
                              gate_timing=False)
    assert not comparison.regressed and statuses(comparison) == {"warning"}
    assert all(t.verdict == "slower" for row in comparison.rows for t in row.timings
               if t.path == "replay")


def test_cases_match_by_params_not_position():
    baseline = clean_run()
    current = baseline.model_copy(deep=True)
    current.cases.reverse()
    for index, case in enumerate(current.cases):
        case.index = index
    comparison = compare_runs(baseline, current)
    assert statuses(comparison) == {"unchanged"}
    assert len({case_key(c) for c in baseline.cases}) == len(baseline.cases)


def test_an_empty_current_run_fails_the_gate():
    baseline = clean_run()
    current = baseline.model_copy(deep=True)
    current.cases = []
    assert compare_runs(baseline, current).failed


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_non_finite_median_regresses(value):
    baseline = clean_run()
    current = baseline.model_copy(deep=True)
    stats = current.cases[0].timing.replay
    current.cases[0].timing.replay = stats.model_copy(update={"median_ms": value})
    comparison = compare_runs(baseline, current, gate_timing=False)
    row = next(r for r in comparison.rows if r.label == current.cases[0].label)
    assert row.status == "regressed" and "not a finite number" in row.reasons[0]
    assert comparison.failed


def paired_run(*, seed: int, drift: float = 1.0, replay_scale: float = 1.0,
               samples: int = 10, noise: float = 0.04, burst: float = 0.08):
    """A synthetic CPU run timed as ``time_interleaved`` times one: in iteration i both paths
    share a load factor (1 + |N(0, burst)|, a burst hitting both back-to-back calls) and each
    has its own N(0, noise); ``drift`` scales both paths of every case (the machine between two
    runs), ``replay_scale`` the replay path only (code). Stats from ``bench.timing.summarize``."""
    import random

    from swa_bench.bench.timing import summarize
    from swa_bench.results import CaseTiming

    results = clean_run(seed=seed)
    rng = random.Random(1000 + seed)
    for case in results.cases:
        ref_ms, rep_ms = case.timing.reference.median_ms, case.timing.replay.median_ms
        ref, rep = [], []
        for _ in range(samples):
            load = drift * (1 + abs(rng.gauss(0.0, burst)))
            ref.append(ref_ms * load * (1 + rng.gauss(0.0, noise)))
            rep.append(rep_ms * replay_scale * load * (1 + rng.gauss(0.0, noise)))
        case.timing = CaseTiming(reference=summarize(ref), replay=summarize(rep))
    return results


def test_a_shared_drift_of_both_paths_never_fails_the_speedup_gate():
    """An A/A pair whose second run is 15% slower (or faster) on both paths, 10 samples a path
    as the default scenario takes, over 10 pairs: the per-iteration speedups cancel the drift,
    so no case's speedup falls beyond its noise and no pair fails."""
    for seed in range(10):
        baseline = paired_run(seed=2 * seed)
        for drift in (1.15, 1 / 1.15):
            current = paired_run(seed=2 * seed + 1, drift=drift)
            comparison = compare_runs(baseline, current)
            assert not comparison.regressed, (seed, drift, [
                r.reasons for r in comparison.rows if r.status == "regressed"])
            assert all(r.speedup is not None and r.speedup.verdict == "unchanged"
                       for r in comparison.rows)


def test_a_twenty_percent_slower_replay_path_fails_under_any_shared_drift():
    """The slow-path control of .ci/run: replay +20% in every case, with the machine 15% slower
    or 25% faster between the runs. At 25% faster the replay path's absolute time does not
    move (1.2 / 1.25 = 0.96: the absolute gate passed such a pair three times); the speedup
    within each run fell by 20% and regresses every time."""
    from swa_bench.compare import compare_timing

    for seed in range(5):
        baseline = paired_run(seed=2 * seed)
        for drift in (1.15, 1.0, 1 / 1.25):
            current = paired_run(seed=2 * seed + 1, drift=drift, replay_scale=1.20)
            comparison = compare_runs(baseline, current)
            assert comparison.regressed, (seed, drift)
            fell = [r for r in comparison.rows if r.speedup.verdict == "fell"]
            assert len(fell) >= len(comparison.rows) // 2
            assert all(any(reason.startswith("speedup ") and "replay +" in reason
                           for reason in r.reasons) for r in fell)
        hidden = [compare_timing("replay", b.timing.replay, c.timing.replay, max_slowdown=0.05,
                                 alpha=0.01, min_samples=5).verdict
                  for b, c in zip(baseline.cases, paired_run(seed=1, drift=1 / 1.25,
                                                             replay_scale=1.20).cases,
                                  strict=True)]
        assert "slower" not in hidden  # the absolute gate alone misses it


def test_a_faster_replay_path_or_a_speedup_gate_that_is_off_never_fails():
    baseline = paired_run(seed=0)
    faster = compare_runs(baseline, paired_run(seed=1, replay_scale=1 / 1.25))
    assert not faster.regressed
    assert all(r.speedup.verdict == "unchanged" for r in faster.rows)
    slower = paired_run(seed=1, replay_scale=1.25)
    off = compare_runs(baseline, slower, gate_timing=False)
    assert not off.regressed
    assert any("speedup " in reason and "[not gated: timing gate off]" in reason
               for row in off.rows for reason in row.reasons)


def test_the_speedup_gate_needs_paired_samples():
    """A path with other sample counts than the other (not timed in lockstep) has no
    per-iteration speedup: the gate then rests on the absolute times alone."""
    from swa_bench.compare import compare_speedup

    baseline, current = paired_run(seed=0), paired_run(seed=1, replay_scale=1.3)
    timing = current.cases[0].timing
    stats = timing.replay
    cut = stats.model_copy(update={"samples_ms": stats.samples_ms[:-1]})
    assert compare_speedup(baseline.cases[0].timing, timing.model_copy(update={"replay": cut}),
                           max_slowdown=0.05, alpha=0.01, min_samples=5) is None
    assert compare_speedup(baseline.cases[0].timing, timing, max_slowdown=0.05, alpha=0.01,
                           min_samples=len(stats.samples_ms) + 1) is None
    assert compare_speedup(baseline.cases[0].timing, timing, max_slowdown=0.05, alpha=0.01,
                           min_samples=5).verdict == "fell"


def test_engine_gates_on_one_side_are_named():
    baseline = clean_run()
    current = baseline.model_copy(deep=True)
    current.cases[0].kv_block_reuse = True
    row = compare_runs(baseline, current).rows[0]
    assert "engine gates differ (kv_block_reuse False -> True)" in row.reasons


def test_checks_in_another_mode_are_named_not_gated():
    """E1/E2 judged bitwise in one run and within the envelope in the other: the same timing,
    verdicts of another strength, said beside the row."""
    baseline = clean_run()
    current = baseline.model_copy(deep=True)
    current.cases[0].batch_invariant = True
    comparison = compare_runs(baseline, current)
    row = comparison.rows[0]
    assert ("checks mode differs (E1/E2 vs the full batch: envelope -> batch-invariant)"
            in row.reasons) and not comparison.failed


def test_task_prompts_in_other_chunks_are_named():
    """approximation and approximation-chunks share their case ids: a pair of their runs
    matches whole prompts with chunked ones, and the row says so."""
    baseline = clean_run()
    baseline.cases[0].tasks = TaskResults(policy="bounded", model="v41-mini")
    current = baseline.model_copy(deep=True)
    assert not any("task prompts" in r for r in compare_runs(baseline, current).rows[0].reasons)
    current.cases[0].tasks.chunk_size = 64
    assert ("task prompts differ (whole -> chunks of 64): the tasks check judges another "
            "prefill") in compare_runs(baseline, current).rows[0].reasons


def test_cases_in_another_precision_are_incomparable():
    """The same figures in bf16 and in fp8 are two computations: named, and the gate fails."""
    baseline = with_kernels(clean_run())
    current = baseline.model_copy(deep=True)
    for case in current.cases:
        case.precision, case.expert_precision = "fp8", "w4a8"
    comparison = compare_runs(baseline, current)
    assert statuses(comparison) == {"incomparable"} and comparison.failed
    assert all(row.reasons[0].startswith("kernels differ (precision bf16 -> fp8, "
                                         "expert_precision None -> w4a8")
               for row in comparison.rows)
