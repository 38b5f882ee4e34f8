"""Where to set the replay trim threshold, from measured reference-vs-replay timings."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from scipy.stats import mannwhitneyu

from swa_bench.results import CaseResult, ThresholdAdvice

ALPHA = 0.05  # one-sided: replay's samples lower than the reference's
MIN_SAMPLES = 5  # fewer samples than this on either path: the medians alone decide


@dataclass(frozen=True)
class BreakEven:
    """One measured step size: the full (reference) path's and the replay path's time."""

    tokens: int
    reference_ms: float
    replay_ms: float
    reference_samples: tuple[float, ...] = ()
    replay_samples: tuple[float, ...] = ()
    trims: bool = True  # the replay path ran a replay batch smaller than the step

    @property
    def replay_wins(self) -> bool:
        """Faster at the median and, given samples of both paths, beyond their noise (a
        one-sided Mann-Whitney test at ``ALPHA``): a threshold drawn from a win by noise is one
        that the next run takes back."""
        if not self.replay_ms < self.reference_ms:
            return False
        if min(len(self.reference_samples), len(self.replay_samples)) < MIN_SAMPLES:
            return True
        p = float(mannwhitneyu(self.replay_samples, self.reference_samples,
                               alternative="less").pvalue)
        return not math.isnan(p) and p < ALPHA


def recommend_trim_threshold(points: Sequence[BreakEven], *, window: int) -> int | None:
    """The smallest token count from which replay is faster at every larger measured count.

    A threshold must exceed the window (nothing trims at or below W), so the answer is at least
    ``window + 1``. None when there are no points or replay loses at the largest measured count.
    Several points at one token count must all favour replay for that count to count as a win.
    A point whose replay path trimmed nothing ran the reference's work twice: it says nothing
    about replay and is left out.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    wins: dict[int, bool] = {}
    for point in points:
        if not point.trims:
            continue
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
        reference, replay = case.timing.reference, case.timing.replay
        kept = case.deterministic.get("kept_rows", case.tokens)
        groups.setdefault((case.graph_mode, case.policy, case.batch_shape), []).append(BreakEven(
            case.tokens, reference.median_ms, replay.median_ms, tuple(reference.samples_ms),
            tuple(replay.samples_ms), trims=kept < case.tokens))
    advice = []
    for (mode, policy, shape), points in sorted(groups.items()):
        value = recommend_trim_threshold(points, window=window)
        tokens = sorted({p.tokens for p in points})
        note = f"{policy}; measured at {tokens} tokens"
        if not any(p.trims for p in points):
            note += "; no step trimmed a row (nothing to advise)"
        elif value is None:
            note += "; replay never won beyond the noise"
        advice.append(ThresholdAdvice(graph_mode=mode, batch=shape,
                                      recommended_trim_threshold=value, note=note))
    return advice
