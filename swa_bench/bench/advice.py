"""Where to set the replay trim threshold, from measured reference-vs-replay timings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from swa_bench.results import CaseResult, ThresholdAdvice


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


def threshold_advice(cases: Sequence[CaseResult], window: int) -> list[ThresholdAdvice]:
    """Per graph mode, policy and batch shape (request kinds, lengths aside): the smallest token
    count from which replay beats the full path."""
    groups: dict[tuple[str, str, str], list[BreakEven]] = {}
    for case in cases:
        if case.timing is None or case.timing.reference is None or case.timing.replay is None:
            continue
        if case.policy == "full" or case.graph_mode == "full":
            continue  # FULL graphs keep the decoder on the whole batch: nothing to advise
        groups.setdefault((case.graph_mode, case.policy, case.batch_shape), []).append(BreakEven(
            case.tokens, case.timing.reference.median_ms, case.timing.replay.median_ms))
    advice = []
    for (mode, policy, shape), points in sorted(groups.items()):
        value = recommend_trim_threshold(points, window=window)
        tokens = sorted({p.tokens for p in points})
        note = f"{policy}; measured at {tokens} tokens"
        if value is None:
            note += "; replay never won"
        advice.append(ThresholdAdvice(graph_mode=mode, batch=shape,
                                      recommended_trim_threshold=value, note=note))
    return advice
