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
