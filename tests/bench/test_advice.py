"""bench/advice: a threshold only from at least two trimming lengths and only where a bootstrap
over each path's samples decides every length from the largest down to the crossover; else
"not enough evidence". The default scenario, measured twice, gives one answer or says so."""

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swa_bench.bench.advice import MIN_SAMPLES, NOT_ENOUGH, BreakEven, recommend_trim_threshold

token_counts = st.lists(st.integers(1, 100_000), min_size=2, max_size=20, unique=True).map(sorted)
windows = st.integers(1, 4096)
times = st.floats(0.01, 1000.0)


def _point(tokens: int, wins: bool, reference_ms: float, gap: float) -> BreakEven:
    """Samples at a fixed time each (no noise: every resample agrees)."""
    replay_ms = reference_ms - gap if wins else reference_ms + gap
    return BreakEven(tokens, (reference_ms,) * MIN_SAMPLES, (replay_ms,) * MIN_SAMPLES)


def _fixed(tokens: int, reference_ms: float, replay_ms: float) -> BreakEven:
    return BreakEven(tokens, (reference_ms,) * MIN_SAMPLES, (replay_ms,) * MIN_SAMPLES)


@st.composite
def measured(draw, pattern):
    counts = draw(token_counts)
    outcomes = draw(pattern(len(counts)))
    refs = draw(st.lists(times, min_size=len(counts), max_size=len(counts)))
    points = [_point(t, w, r + 1.0, 0.5) for t, w, r in zip(counts, outcomes, refs, strict=True)]
    return counts, outcomes, draw(st.permutations(points))


def wins_from_some_point(n):
    return st.integers(0, n - 1).map(lambda k: [i >= k for i in range(n)])


def any_outcomes(n):
    return st.lists(st.booleans(), min_size=n, max_size=n)


@given(measured(wins_from_some_point), windows)
def test_wins_from_some_point_onwards_gives_that_point(data, window):
    counts, outcomes, points = data
    first_win = counts[outcomes.index(True)]
    advice = recommend_trim_threshold(points, window=window)
    assert advice.decided and advice.threshold == max(first_win, window + 1)


@given(measured(any_outcomes), windows)
def test_crossing_back_picks_point_after_last_loss(data, window):
    counts, outcomes, points = data
    advice = recommend_trim_threshold(points, window=window)
    assert advice.decided
    if not outcomes[-1]:
        assert advice.threshold is None
        return
    last_loss = max((i for i, w in enumerate(outcomes) if not w), default=-1)
    assert advice.threshold == max(counts[last_loss + 1], window + 1) > window


@given(measured(lambda n: st.just([False] * n)), windows)
def test_never_wins_gives_never_trim(data, window):
    advice = recommend_trim_threshold(data[2], window=window)
    assert advice.decided and advice.threshold is None


def test_fewer_than_two_lengths_is_not_enough_lengths_to_advise():
    """The H200's one-length scenario printed "recommended trim_threshold 16384 (measured at
    [16384] tokens)": one length places no crossover, however clear its win; a second length
    that trimmed nothing is no second length."""
    for points in ([], [_fixed(16384, 2.0, 1.0)], [_fixed(16384, 2.0, 1.0)] * 2,
                   [_fixed(16384, 2.0, 1.0), BreakEven(64, (2.0,) * 5, (1.0,) * 5, trims=False)]):
        advice = recommend_trim_threshold(points, window=128)
        assert not advice.decided and advice.threshold is None
        assert advice.reason.startswith("not enough lengths to advise"), advice.reason
    two = recommend_trim_threshold([_fixed(8192, 2.0, 1.0), _fixed(16384, 2.0, 1.0)], window=128)
    assert two.decided and two.threshold == 8192


def test_one_measured_length_in_a_run_says_not_enough_lengths():
    """threshold_advice on a run whose only trimming length is 16384 gives no threshold and says
    "not enough lengths to advise" (the noisy case keeps "not enough evidence")."""
    from swa_bench.bench.advice import threshold_advice
    from tests.report.synthetic import synthetic_run

    cases = [c for c in synthetic_run(error=False, failing=False).cases]
    one = [c for c in cases if c.tokens == max(c.tokens for c in cases)]
    advice = threshold_advice(one, window=8)
    assert advice and all(a.recommended_trim_threshold is None and not a.decided
                          and "not enough lengths to advise" in a.note for a in advice)
    assert not any(NOT_ENOUGH in a.note for a in advice)


def test_crossing_back_example():
    points = [_point(256, True, 2.0, 0.5), _point(512, False, 2.0, 0.5),
              _point(768, True, 2.0, 0.5), _point(2048, True, 2.0, 0.5)]
    assert recommend_trim_threshold(points, window=128).threshold == 768


def test_tie_is_not_a_win():
    points = [_fixed(512, 1.0, 1.0), _fixed(1024, 2.0, 1.0)]
    assert recommend_trim_threshold(points, window=128).threshold == 1024


def test_repeated_count_needs_every_measurement_to_win():
    points = [_fixed(512, 2.0, 1.0), _fixed(512, 1.0, 1.5), _fixed(1024, 2.0, 1.0)]
    assert recommend_trim_threshold(points, window=128).threshold == 1024


def test_rejects_nonpositive_window():
    with pytest.raises(ValueError):
        recommend_trim_threshold([_fixed(512, 2.0, 1.0)], window=0)


def _noisy(tokens: int, reference: list[float], replay: list[float], trims: bool = True):
    return BreakEven(tokens, tuple(reference), tuple(replay), trims)


def test_a_win_inside_the_noise_is_no_advice():
    """Last session's H200 run printed a threshold from 17.0 vs 17.1 ms medians whose samples
    overlapped: at the largest length that is undecided, so there is no advice at all; the
    same samples 3 ms apart decide it."""
    reference = [15.4, 16.2, 17.1, 17.9, 19.8, 16.8, 17.3, 18.0, 15.9, 17.2]
    replay = [15.2, 16.0, 17.0, 17.8, 19.5, 16.9, 17.1, 18.1, 15.8, 17.0]
    below = _fixed(256, 1.0, 2.0)
    point = _noisy(512, reference, replay)
    assert point.outcome() == "undecided"
    advice = recommend_trim_threshold([below, point], window=32)
    assert not advice.decided and "at 512 tokens" in advice.reason
    separated = _noisy(512, reference, [r - 3.0 for r in replay])
    assert separated.outcome() == "win"
    assert recommend_trim_threshold([below, separated], window=32).threshold == 512
    assert _noisy(512, reference, [r + 3.0 for r in replay]).outcome() == "loss"


def test_too_few_samples_decide_nothing():
    few = BreakEven(512, (2.0,) * (MIN_SAMPLES - 1), (1.0,) * (MIN_SAMPLES - 1))
    assert few.outcome() == "undecided"
    assert not recommend_trim_threshold([_fixed(256, 2.0, 1.0), few], window=32).decided


def test_the_bootstrap_is_seeded():
    point = _noisy(512, [15.4, 16.2, 17.1, 17.9, 19.8, 16.8], [15.2, 16.0, 17.0, 17.8, 19.5, 16])
    assert point.win_share() == point.win_share()
    assert 0.0 < point.win_share() < 1.0


def test_a_point_that_trimmed_nothing_is_left_out():
    """A step no request lost rows in ran the reference path twice: its win is no evidence."""
    won_untrimmed = BreakEven(8, (2.0,) * 5, (1.0,) * 5, trims=False)
    lost, won = _fixed(64, 1.0, 2.0), _fixed(64, 2.0, 1.0)
    assert not recommend_trim_threshold([won_untrimmed, won], window=4).decided
    assert recommend_trim_threshold([won_untrimmed, lost, _fixed(128, 1.0, 2.0)],
                                    window=4).threshold is None
    assert recommend_trim_threshold([won_untrimmed, won, _fixed(128, 2.0, 1.0)],
                                    window=4).threshold == 64


def test_advice_per_mode_and_policy_from_a_run():
    """From cases: replay 25% faster above 64 tokens (2% noise, 10 samples) gives 256 in every
    group; a group whose replay steps kept every row gets no threshold and says why."""
    from swa_bench.bench.advice import threshold_advice
    from tests.report.synthetic import synthetic_run

    cases = [c for c in synthetic_run(error=False, failing=False).cases]
    advice = threshold_advice(cases, window=8)
    assert {(a.graph_mode, a.recommended_trim_threshold, a.decided) for a in advice} == {
        ("eager", 256, True), ("piecewise", 256, True)}
    for case in cases:
        case.deterministic["kept_rows"] = case.tokens
    for a in threshold_advice(cases, window=8):
        assert a.recommended_trim_threshold is None and "no step trimmed" in a.note
        assert not a.decided


def test_ci_fails_when_two_runs_of_one_scenario_advise_different_thresholds(tmp_path):
    """`.ci/same_advice.py` (run on the timing gate's A/A pair): a decided advice that flips
    between the runs fails it; the same advice, or one run without enough evidence, passes."""
    import importlib.util

    from swa_bench.results import RunResults, save_results
    from swa_bench.results.schema import ThresholdAdvice

    spec = importlib.util.spec_from_file_location(
        "same_advice", Path(__file__).resolve().parents[2] / ".ci" / "same_advice.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    def run(name, *advised):
        folder = tmp_path / name
        folder.mkdir()
        save_results(folder, RunResults(
            scenario_name="smoke", scenario_file=None, scenario_hash="x", scenario={},
            environment={}, started_at="now",
            threshold_advice=[ThresholdAdvice(graph_mode=mode, batch="mixed",
                                              recommended_trim_threshold=threshold,
                                              decided=decided)
                              for mode, threshold, decided in advised]))
        return str(folder)

    first = run("a", ("eager", 119, True), ("piecewise", 64, True))
    assert script.main(first, run("b", ("eager", 119, True), ("piecewise", None, False))) == 0
    assert script.main(first, run("c", ("eager", None, True), ("piecewise", 64, True))) == 1
    assert script.main(first, run("d", ("eager", 119, True))) == 0  # a subset of the groups
    assert script.main(first, run("e", ("full", None, True))) == 1  # none in common
