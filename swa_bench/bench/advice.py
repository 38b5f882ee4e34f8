"""Where to set the replay trim threshold, from measured reference-vs-replay timings.

Advice is only worth printing if the next run would print it too: three default runs once
recommended 119, none and 119 for one mode and policy. So a length counts as a win (or a loss)
only when a bootstrap over each path's own samples agrees in ``CONFIDENCE`` of its resamples,
and a threshold is only drawn from at least ``MIN_LENGTHS`` lengths at which replay trimmed
rows: fewer is "not enough lengths to advise" (one length places no crossover: a run at 16384
tokens alone once printed "recommended trim_threshold 16384"), a length inside the noise "not
enough evidence", each said as such. Pure and deterministic: the
bootstrap is seeded, so one run's samples always give one answer.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from swa_bench.results import CaseResult, ThresholdAdvice

CONFIDENCE = 0.95  # share of bootstrap resamples that must agree on a length's winner
RESAMPLES = 400
MIN_SAMPLES = 5  # fewer samples than this on either path: the length is undecided
MIN_LENGTHS = 2  # trimming lengths a threshold is drawn from (one length places no crossover)
NOT_ENOUGH = "not enough evidence"  # a length inside the noise
NOT_ENOUGH_LENGTHS = "not enough lengths to advise"  # fewer than MIN_LENGTHS trimming lengths

Outcome = Literal["win", "loss", "undecided"]


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])


@dataclass(frozen=True)
class BreakEven:
    """One measured step size: the full (reference) path's and the replay path's samples."""

    tokens: int
    reference_samples: tuple[float, ...]
    replay_samples: tuple[float, ...]
    trims: bool = True  # the replay path ran a replay batch smaller than the step

    def win_share(self, seed: int = 0) -> float:
        """The share of bootstrap resamples (each path's samples drawn with replacement) in
        which replay's median is below the reference's."""
        rng = random.Random(seed)
        ref, rep = self.reference_samples, self.replay_samples
        wins = sum(_median(rng.choices(rep, k=len(rep))) < _median(rng.choices(ref, k=len(ref)))
                   for _ in range(RESAMPLES))
        return wins / RESAMPLES

    def outcome(self, seed: int = 0) -> Outcome:
        """win or loss when at least ``CONFIDENCE`` of the resamples say so, else undecided."""
        if min(len(self.reference_samples), len(self.replay_samples)) < MIN_SAMPLES:
            return "undecided"
        share = self.win_share(seed)
        return "win" if share >= CONFIDENCE else "loss" if share <= 1 - CONFIDENCE else "undecided"


@dataclass(frozen=True)
class Recommendation:
    """A threshold (None: replay does not win at the largest length, so never trim), or no
    advice at all (``decided`` False) with the reason."""

    threshold: int | None
    decided: bool
    reason: str = ""


def recommend_trim_threshold(points: Sequence[BreakEven], *, window: int) -> Recommendation:
    """The smallest length from which replay wins at every larger measured length.

    A threshold must exceed the window (nothing trims at or below W), so it is at least
    ``window + 1``. Several points at one length must all win for the length to win, and a loss
    at any of them makes it a loss. A point whose replay path trimmed nothing ran the
    reference's work twice: it says nothing about replay and is left out. Walking down from the
    largest length, the first loss places the threshold above it (a loss at the largest: None,
    never trim); an undecided length before any loss means the crossover is unknown: no advice.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    outcomes: dict[int, list[Outcome]] = {}
    for index, point in enumerate(points):
        if point.trims:
            outcomes.setdefault(point.tokens, []).append(point.outcome(seed=index))
    if len(outcomes) < MIN_LENGTHS:
        what = "no length" if not outcomes else f"only {next(iter(outcomes))} tokens"
        return Recommendation(None, False, f"{NOT_ENOUGH_LENGTHS}: {what} with trimmed rows "
                                           f"measured (at least {MIN_LENGTHS} lengths needed)")
    threshold = None
    for tokens in sorted(outcomes, reverse=True):
        seen = outcomes[tokens]
        if "loss" in seen:
            break
        if "undecided" in seen:
            return Recommendation(None, False, f"{NOT_ENOUGH}: at {tokens} tokens replay and "
                                               f"the reference are within the noise")
        threshold = tokens
    return Recommendation(None if threshold is None else max(threshold, window + 1), True)


def threshold_advice(cases: Sequence[CaseResult], window: int) -> list[ThresholdAdvice]:
    """Per graph mode, policy and batch shape (request kinds, lengths aside): the smallest token
    count from which replay beats the full path, or why there is no advice."""
    groups: dict[tuple[str, str, str], list[BreakEven]] = {}
    for case in cases:
        if case.timing is None or case.timing.reference is None or case.timing.replay is None:
            continue
        if case.policy == "full" or case.graph_mode == "full":
            continue  # FULL graphs keep the decoder on the whole batch: nothing to advise
        reference, replay = case.timing.reference, case.timing.replay
        kept = case.deterministic.get("kept_rows", case.tokens)
        groups.setdefault((case.graph_mode, case.policy, case.batch_shape), []).append(BreakEven(
            case.tokens, tuple(reference.samples_ms), tuple(replay.samples_ms),
            trims=kept < case.tokens))
    advice = []
    for (mode, policy, shape), points in sorted(groups.items()):
        tokens = sorted({p.tokens for p in points})
        note = f"{policy}; measured at {tokens} tokens"
        if not any(p.trims for p in points):
            recommendation = Recommendation(None, False, "no step trimmed a row (nothing to "
                                                         "advise)")
        else:
            recommendation = recommend_trim_threshold(points, window=window)
        if recommendation.reason:
            note += f"; {recommendation.reason}"
        elif recommendation.threshold is None:
            note += "; replay loses at the largest length: never trim"
        advice.append(ThresholdAdvice(graph_mode=mode, batch=shape,
                                      recommended_trim_threshold=recommendation.threshold,
                                      note=note, decided=recommendation.decided))
    return advice
