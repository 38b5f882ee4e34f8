"""Where to set the replay trim threshold, from measured reference-vs-replay timings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BreakEven:
    """One measured step size: the full (reference) path's and the replay path's time."""

    tokens: int
    reference_ms: float
    replay_ms: float

    @property
    def replay_wins(self) -> bool:
        return self.replay_ms < self.reference_ms


def recommend_trim_threshold(points: Sequence[BreakEven], *, window: int) -> int | None:
    """The smallest token count from which replay is faster at every larger measured count.

    A threshold must exceed the window (nothing trims at or below W), so the answer is at least
    ``window + 1``. None when there are no points or replay loses at the largest measured count.
    Several points at one token count must all favour replay for that count to count as a win.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    wins: dict[int, bool] = {}
    for point in points:
        wins[point.tokens] = wins.get(point.tokens, True) and point.replay_wins
    threshold = None
    for tokens in sorted(wins, reverse=True):
        if not wins[tokens]:
            break
        threshold = tokens
    return None if threshold is None else max(threshold, window + 1)
