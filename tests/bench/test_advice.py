import pytest
from hypothesis import given
from hypothesis import strategies as st

from swa_bench.bench.advice import BreakEven, recommend_trim_threshold

token_counts = st.lists(st.integers(1, 100_000), min_size=1, max_size=20, unique=True).map(sorted)
windows = st.integers(1, 4096)
times = st.floats(0.01, 1000.0)


def _point(tokens: int, wins: bool, reference_ms: float, gap: float) -> BreakEven:
    replay_ms = reference_ms - gap if wins else reference_ms + gap
    return BreakEven(tokens=tokens, reference_ms=reference_ms, replay_ms=replay_ms)


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
    assert recommend_trim_threshold(points, window=window) == max(first_win, window + 1)


@given(measured(any_outcomes), windows)
def test_never_at_or_below_window(data, window):
    _, _, points = data
    threshold = recommend_trim_threshold(points, window=window)
    assert threshold is None or threshold > window


@given(measured(any_outcomes), windows)
def test_crossing_back_picks_point_after_last_loss(data, window):
    counts, outcomes, points = data
    threshold = recommend_trim_threshold(points, window=window)
    if not outcomes[-1]:
        assert threshold is None
        return
    last_loss = max((i for i, w in enumerate(outcomes) if not w), default=-1)
    assert threshold == max(counts[last_loss + 1], window + 1)
    assert all(p.replay_ms < p.reference_ms for p in points if p.tokens >= counts[last_loss + 1])


@given(measured(lambda n: st.just([False] * n)), windows)
def test_never_wins_gives_none(data, window):
    assert recommend_trim_threshold(data[2], window=window) is None


def test_no_points_gives_none():
    assert recommend_trim_threshold([], window=128) is None


def test_crossing_back_example():
    points = [_point(256, True, 2.0, 0.5), _point(512, False, 2.0, 0.5),
              _point(768, True, 2.0, 0.5), _point(2048, True, 2.0, 0.5)]
    assert recommend_trim_threshold(points, window=128) == 768


def test_tie_is_not_a_win():
    points = [BreakEven(512, 1.0, 1.0), BreakEven(1024, 2.0, 1.0)]
    assert recommend_trim_threshold(points, window=128) == 1024


def test_repeated_count_needs_every_measurement_to_win():
    points = [BreakEven(512, 2.0, 1.0), BreakEven(512, 1.0, 1.5), BreakEven(1024, 2.0, 1.0)]
    assert recommend_trim_threshold(points, window=128) == 1024


def test_rejects_nonpositive_window():
    with pytest.raises(ValueError):
        recommend_trim_threshold([BreakEven(512, 2.0, 1.0)], window=0)


def _noisy(tokens: int, reference: list[float], replay: list[float], trims: bool = True):
    return BreakEven(tokens, sorted(reference)[len(reference) // 2],
                     sorted(replay)[len(replay) // 2], tuple(reference), tuple(replay), trims)


def test_a_win_inside_the_noise_is_no_win():
    """Last session's H200 run printed a threshold from 17.0 vs 17.1 ms medians whose samples
    overlapped: the same samples, interleaved, give no win now."""
    reference = [15.4, 16.2, 17.1, 17.9, 19.8, 16.8, 17.3, 18.0, 15.9, 17.2]
    replay = [15.2, 16.0, 17.0, 17.8, 19.5, 16.9, 17.1, 18.1, 15.8, 17.0]
    point = _noisy(512, reference, replay)
    assert point.replay_ms < point.reference_ms and not point.replay_wins
    assert recommend_trim_threshold([point], window=32) is None
    separated = _noisy(512, reference, [r - 3.0 for r in replay])
    assert separated.replay_wins
    assert recommend_trim_threshold([separated], window=32) == 512


def test_a_point_that_trimmed_nothing_is_left_out():
    """A step no request lost rows in ran the reference path twice: its win is no evidence."""
    won_untrimmed = BreakEven(8, 2.0, 1.0, trims=False)
    lost = BreakEven(64, 1.0, 2.0)
    assert recommend_trim_threshold([won_untrimmed], window=4) is None
    assert recommend_trim_threshold([won_untrimmed, lost], window=4) is None
    assert recommend_trim_threshold([won_untrimmed, BreakEven(64, 2.0, 1.0)], window=4) == 64


def test_advice_per_mode_and_policy_from_a_run():
    """From cases: replay 25% faster above 64 tokens (2% noise, 10 samples) gives 256 in every
    group; a group whose replay steps kept every row gets no threshold and says why."""
    from swa_bench.bench.advice import threshold_advice
    from tests.report.synthetic import synthetic_run

    cases = [c for c in synthetic_run(error=False, failing=False).cases]
    advice = threshold_advice(cases, window=8)
    assert {(a.graph_mode, a.recommended_trim_threshold) for a in advice} == {
        ("eager", 256), ("piecewise", 256)}
    for case in cases:
        case.deterministic["kept_rows"] = case.tokens
    for a in threshold_advice(cases, window=8):
        assert a.recommended_trim_threshold is None and "no step trimmed" in a.note
