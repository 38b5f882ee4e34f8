"""The regression gate: compare a current run against a baseline run, case by case.

Cases match on what they measure (swept params, graph mode, policy, trim threshold, tokens), not on
their index, so reordering a sweep or adding cases keeps the matches. Timing only regresses when the
slowdown is statistically significant (one-sided Mann-Whitney U, current > baseline), larger than
`max_slowdown`, and beyond the noise of the pair (``beyond_noise``): significance alone flags
microsecond noise on quiet machines, size alone flags noise on busy ones, and neither sees that two
runs of one commit on a shared machine move a case's medians by 10-15% with tight samples on both
sides (the A/A pair of default runs that failed the old gate). Deterministic figures (kept rows,
captured graphs, FLOPs) must match exactly.
The speedup is gated too, within each run (``compare_speedup``): on a CPU both paths are timed in
alternation (``time_interleaved``), so each iteration's reference/replay ratio cancels whatever
the machine did to both, between the runs as within them (on a GPU the paths are timed one after
the other and paired by sample index: a drift between the runs still cancels). A speedup that
fell by more than ``max_slowdown`` plus the ratio's own spread, significantly (Mann-Whitney U on
the per-iteration ratios), regresses even where a drift of both paths hides the replay path's
slowdown in the absolute times: the +20% slow-path control of ``.ci/run``, compared with a
baseline 10-25% slower on both paths (the first run after the test suite), passed the absolute
gate three times. A speedup that rose is not gated (replay getting faster is the intended
change; a slower reference is still gated by its absolute time).
A pair of cases that ran other kernels (backend, tile, launch mode: ``CaseResult.kernels``) did not
measure the same thing: it is "incomparable" and fails the gate, unless the comparison is asked for
as an A/B (``allow_config_change``), when it is compared and the difference is warned about.

Pure: the comparison is data (verdicts, p-values, changes, reasons), rendered by
``report.comparison`` and ``report.console`` and gated by the command in ``run.compare``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from scipy.stats import mannwhitneyu

from swa_bench.results import (
    TIMED_PATHS,
    CaseResult,
    CaseTiming,
    ResultsError,
    RunResults,
    TimingStats,
    timed_paths,
)

RowStatus = Literal["improved", "regressed", "unchanged", "new", "missing", "warning",
                    "incomparable"]
RunVerdict = Literal["regressed", "not comparable", "nothing compared", "ok"]
TimingVerdict = Literal["slower", "faster", "unchanged", "within noise", "too few samples",
                        "absent", "invalid"]
ENVIRONMENT_GATE_KEYS = ("gpu", "torch", "cuda")
CaseKey = tuple[str, int]  # what the case measures (case_key), and which repeat of it (1, 2...)
# A slowdown both timed paths of a GPU case share (the device's clocks, or code both paths run)
# regresses only beyond this. On a CPU it never does (``shared_limit``): back-to-back default
# runs of one commit on the 2-core VM moved a case's medians on both paths by +14% when quiet
# and by +94% when other jobs started (steal time counts as the thread's CPU time), with each
# run's own samples within 5% of their median.
DRIFT_LIMIT = 0.25


def shared_limit(baseline: RunResults, current: RunResults) -> float | None:
    """How far a slowdown both paths share may go before it regresses: ``DRIFT_LIMIT`` when both
    runs timed a GPU, None (never: reported as a warning) when either timed a CPU, where the
    load of the machine moves both paths alike and differs from one run to the next."""
    on_gpu = all(r.environment.get("gpu") is not None for r in (baseline, current))
    return DRIFT_LIMIT if on_gpu else None


@dataclass(frozen=True)
class TimingDelta:
    """One timed path of one matched case; `change` is current/baseline - 1 of the medians."""

    path: str
    baseline_ms: float | None
    current_ms: float | None
    change: float | None
    p_slower: float | None
    p_faster: float | None
    verdict: TimingVerdict
    # The change beyond the other timed path's (``beyond_noise``), and the spread it had to pass.
    excess: float | None = None
    spread: float | None = None

    def describe(self) -> str:
        if self.verdict == "absent":
            side = "current" if self.current_ms is None else "baseline"
            return f"{self.path} timing absent in {side}"
        if self.verdict == "invalid":
            return (f"{self.path} timing is not a finite number > 0 ms "
                    f"({self.baseline_ms} -> {self.current_ms} ms)")
        text = f"{self.path} {self.baseline_ms:.3f} -> {self.current_ms:.3f} ms"
        p = {"slower": self.p_slower, "faster": self.p_faster}.get(self.verdict)
        if self.verdict == "within noise" and self.change is not None:
            p = self.p_slower if self.change > 0 else self.p_faster
        if self.change is not None:
            text += f" ({100 * self.change:+.1f}%" + (f", p={p:.2g})" if p is not None else ")")
        if self.verdict == "within noise" and self.spread is not None:
            own = ("" if self.excess is None
                   else f"{100 * self.excess:+.1f}% beyond the other path, ")
            text += f" within the noise ({own}spread {100 * self.spread:.0f}%)"
        return text


@dataclass(frozen=True)
class SpeedupDelta:
    """The speedup of one matched case in both runs, from paired samples: the median over
    iterations of reference_i / replay_i (on a CPU the paths' samples of one iteration, taken
    back to back; on a GPU the i-th sample of each). ``spread`` is the larger IQR/median of
    those ratios in either run."""

    baseline: float
    current: float
    p_fell: float
    spread: float
    verdict: Literal["fell", "unchanged"]

    @property
    def change(self) -> float:
        """How much slower replay got relative to the reference (baseline/current - 1)."""
        return self.baseline / self.current - 1.0

    def describe(self) -> str:
        return (f"speedup {self.baseline:.3f}x -> {self.current:.3f}x within each run (replay "
                f"{100 * self.change:+.1f}% relative to the reference, p={self.p_fell:.2g}, "
                f"ratio spread {100 * self.spread:.0f}%)")


@dataclass(frozen=True)
class ComparisonRow:
    key: CaseKey
    label: str
    status: RowStatus
    reasons: tuple[str, ...]
    timings: tuple[TimingDelta, ...] = ()
    speedup: SpeedupDelta | None = None


@dataclass(frozen=True)
class Comparison:
    """Two runs compared: a row per case of either run; `timing_gated` is False when timing was
    reported but could not regress (environments differ, or the gate is off)."""

    rows: tuple[ComparisonRow, ...]
    warnings: tuple[str, ...]
    timing_gated: bool
    max_slowdown: float
    alpha: float

    @property
    def regressed(self) -> bool:
        return any(row.status == "regressed" for row in self.rows)

    @property
    def incomparable(self) -> int:
        """Cases in both runs that ran other kernels, not accepted as an A/B comparison."""
        return sum(row.status == "incomparable" for row in self.rows)

    @property
    def matched(self) -> int:
        """Cases found in both runs: what was actually compared."""
        return sum(row.status not in ("new", "missing", "incomparable") for row in self.rows)

    @property
    def failed(self) -> bool:
        """The gate fails on a regression, on cases that ran other kernels, and when nothing was
        compared at all."""
        return self.regressed or self.incomparable > 0 or self.matched == 0

    @property
    def verdict(self) -> RunVerdict:
        return ("regressed" if self.regressed else "not comparable" if self.incomparable
                else "nothing compared" if self.failed else "ok")

    def counts(self) -> dict[str, int]:
        tally = Counter(row.status for row in self.rows)
        return {status: tally.get(status, 0) for status in
                ("regressed", "incomparable", "improved", "warning", "unchanged", "new",
                 "missing")}


def case_key(case: CaseResult) -> str:
    return json.dumps({"params": case.params, "graph_mode": case.graph_mode,
                       "policy": case.policy, "trim_threshold": case.trim_threshold,
                       "tokens": case.tokens}, sort_keys=True, default=str)


def _keyed(results: RunResults) -> dict[CaseKey, CaseResult]:
    """Cases by key; a repeat (a sweep that measures the same thing twice) is told apart by its
    count, kept beside the key rather than in its text, where any param value could fake it."""
    keyed: dict[CaseKey, CaseResult] = {}
    seen: Counter[str] = Counter()
    for case in results.cases:
        key = case_key(case)
        seen[key] += 1
        keyed[key, seen[key]] = case
    return keyed


def kernel_differences(baseline: CaseResult, current: CaseResult) -> list[str]:
    """What differs between the kernels two cases ran (``backend torch -> triton``), their
    numerics first (``precision bf16 -> fp8``): a case in another precision is another
    computation; none when they agree or a side did not record them (an older results file)."""
    numerics = [f"{key} {getattr(baseline, key)} -> {getattr(current, key)}"
                for key in ("precision", "expert_precision")
                if getattr(baseline, key) != getattr(current, key)]
    if baseline.kernels is None or current.kernels is None:
        return numerics
    before, after = baseline.kernels.model_dump(), current.kernels.model_dump()
    return numerics + [f"{key} {before[key]} -> {after[key]}" for key in before
                       if before[key] != after[key]]


def environment_differences(baseline: RunResults, current: RunResults) -> list[str]:
    return [f"{key}: {baseline.environment.get(key)!r} -> {current.environment.get(key)!r}"
            for key in ENVIRONMENT_GATE_KEYS
            if baseline.environment.get(key) != current.environment.get(key)]


def _times(stats: TimingStats) -> list[tuple[str, float]]:
    """Every time of one timed path, by its field name in results.json."""
    return [("median_ms", stats.median_ms),
            *((f"samples_ms.{i}", x) for i, x in enumerate(stats.samples_ms))]


def _plausible(stats: TimingStats) -> bool:
    """No timer measures NaN, infinite or <= 0 ms: such a figure is reported, never compared."""
    return all(math.isfinite(x) and x > 0 for _, x in _times(stats))


def check_times(results: RunResults, file: Path) -> None:
    """Raise ResultsError at the first finite time <= 0 ms: bad input, as it would otherwise
    pass for an infinite speedup (NaN and infinity are kept: they regress in the comparison)."""
    for index, case, path, stats in timed_paths(results):
        for field, x in _times(stats):
            if math.isfinite(x) and x <= 0:
                raise ResultsError(file, f"cases.{index}.timing.{path}.{field}",
                                   f"must be > 0 ms, got {x:g} (case {case.label})")


def _p_value(current: list[float], baseline: list[float], alternative: str) -> float:
    p = float(mannwhitneyu(current, baseline, alternative=alternative).pvalue)
    return 1.0 if math.isnan(p) else p


def compare_timing(path: str, baseline: TimingStats | None, current: TimingStats | None, *,
                   max_slowdown: float, alpha: float, min_samples: int) -> TimingDelta | None:
    if baseline is None and current is None:
        return None
    if baseline is None or current is None:
        return TimingDelta(path, baseline and baseline.median_ms, current and current.median_ms,
                           None, None, None, "absent")
    if not (_plausible(baseline) and _plausible(current)):
        return TimingDelta(path, baseline.median_ms, current.median_ms, None, None, None,
                           "invalid")
    change = current.median_ms / baseline.median_ms - 1.0
    if min(len(baseline.samples_ms), len(current.samples_ms)) < min_samples:
        return TimingDelta(path, baseline.median_ms, current.median_ms, change, None, None,
                           "too few samples")
    p_slower = _p_value(current.samples_ms, baseline.samples_ms, "greater")
    p_faster = _p_value(current.samples_ms, baseline.samples_ms, "less")
    speedup = baseline.median_ms / current.median_ms - 1.0
    verdict: TimingVerdict = "unchanged"
    if p_slower < alpha and change > max_slowdown:
        verdict = "slower"
    elif p_faster < alpha and speedup > max_slowdown:
        verdict = "faster"
    return TimingDelta(path, baseline.median_ms, current.median_ms, change, p_slower, p_faster,
                       verdict)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])


def _iqr_over_median(values: list[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)

    def at(q: float) -> float:  # linear interpolation, as ``bench.timing.summarize``
        x = q * (n - 1)
        lo = int(x)
        return ordered[lo] + (ordered[min(lo + 1, n - 1)] - ordered[lo]) * (x - lo)

    return (at(0.75) - at(0.25)) / _median(ordered)


def _paired_speedups(timing: CaseTiming | None) -> list[float] | None:
    """reference_i / replay_i per sample index, or None when a path is missing, the sample
    counts differ or a sample is not a finite time > 0."""
    ref, rep = getattr(timing, "reference", None), getattr(timing, "replay", None)
    if ref is None or rep is None or len(ref.samples_ms) != len(rep.samples_ms):
        return None
    if not (_plausible(ref) and _plausible(rep)):
        return None
    return [a / b for a, b in zip(ref.samples_ms, rep.samples_ms, strict=True)]


def compare_speedup(baseline: CaseTiming | None, current: CaseTiming | None, *,
                    max_slowdown: float, alpha: float, min_samples: int
                    ) -> SpeedupDelta | None:
    """The speedup within each run compared between the runs; pure. It "fell" when the
    current per-iteration speedups are significantly lower (one-sided Mann-Whitney U, p <
    ``alpha``) and replay got slower relative to the reference by more than ``max_slowdown``
    plus the larger IQR/median of those speedups in either run. None without paired samples
    (at least ``min_samples`` on both sides)."""
    before, after = _paired_speedups(baseline), _paired_speedups(current)
    if before is None or after is None or min(len(before), len(after)) < min_samples:
        return None
    spread = max(_iqr_over_median(before), _iqr_over_median(after))
    p_fell = _p_value(after, before, "less")
    was, now = _median(before), _median(after)
    fell = p_fell < alpha and was / now - 1.0 > max_slowdown + spread
    return SpeedupDelta(was, now, p_fell, spread, "fell" if fell else "unchanged")


def beyond_noise(deltas: list[TimingDelta], baseline: CaseTiming | None,
                 current: CaseTiming | None, *, max_slowdown: float,
                 shared: float | None = DRIFT_LIMIT) -> list[TimingDelta]:
    """``deltas`` with each significant change ("slower", "faster") kept only where it is beyond
    the noise of the two runs, else "within noise"; pure.

    The spread of a path is the larger of the two runs' own IQR/median of its samples. A change
    stands when (a) it exceeds the other path's change in the same case by more than
    ``max_slowdown`` plus both paths' spreads: the two paths are timed in the same iterations
    (interleaved on a CPU), so whatever the machine did between the runs moves both alike and
    cancels here, while a change to one path's code does not; or (b) it exceeds ``shared`` (None:
    never) plus its spread, so a slowdown of code both paths share is still caught when large on
    a GPU. A path timed alone has only (b). So a case flagged unstable in either run (IQR > 10%)
    is a warning, not a regression, unless its change exceeds that spread as well.
    """
    spreads = {}
    for d in deltas:
        b, c = getattr(baseline, d.path, None), getattr(current, d.path, None)
        if b is not None and c is not None:
            spreads[d.path] = max(b.iqr_over_median, c.iqr_over_median)
    judged = []
    for d in deltas:
        if d.verdict not in ("slower", "faster") or d.change is None:
            judged.append(d)
            continue
        others = [o for o in deltas if o.path != d.path and o.change is not None
                  and o.verdict not in ("absent", "invalid")]
        grow = (lambda x: 1 + x) if d.verdict == "slower" else (lambda x: 1 / (1 + x))
        size = grow(d.change) - 1
        excess = grow(d.change) / grow(others[0].change) - 1 if others else None
        pair = spreads[d.path] + (spreads.get(others[0].path, 0.0) if others else 0.0)
        own = excess is not None and excess > max_slowdown + pair
        common = shared is not None and size > shared + spreads[d.path]
        if own or common:
            judged.append(dataclasses.replace(d, excess=excess, spread=pair if own
                                              else spreads[d.path]))
        else:
            judged.append(dataclasses.replace(d, verdict="within noise", excess=excess,
                                              spread=pair))
    return judged


def _exact_differences(name: str, baseline: dict[str, int], current: dict[str, int]
                       ) -> tuple[list[str], list[str]]:
    """(changed values, keys present on one side only): the first regress, the second warn, so
    a runner that starts recording a new figure does not fail every comparison."""
    changed = [f"{name}.{key} {baseline[key]} -> {current[key]}"
               for key in sorted(baseline.keys() & current.keys()) if baseline[key] != current[key]]
    one_sided = [f"{name}.{key} only in {'baseline' if key in baseline else 'current'}"
                 for key in sorted(baseline.keys() ^ current.keys())]
    return changed, one_sided


def _split(figures: dict[str, int], aside) -> tuple[dict[str, int], dict[str, int]]:
    """``figures`` as (those ``aside`` leaves, those it takes)."""
    return ({k: v for k, v in figures.items() if not aside(k)},
            {k: v for k, v in figures.items() if aside(k)})


def compare_case(key: CaseKey, baseline: CaseResult, current: CaseResult, *,
                 timing_gate: str | None, max_slowdown: float, alpha: float,
                 min_samples: int, allow_config_change: bool = False,
                 shared: float | None = DRIFT_LIMIT) -> ComparisonRow:
    """`timing_gate` is None when timing may regress, else why it may not (reported instead).
    Cases that ran other kernels are "incomparable", or with `allow_config_change` compared as
    an A/B: timing gated, the kernels' difference and changed deterministic figures warned
    about. Either way the kernels' difference is named."""
    regressions: list[str] = []
    improvements: list[str] = []
    warnings: list[str] = []
    kernels = kernel_differences(baseline, current)
    if kernels and allow_config_change:
        warnings.append("A/B: kernels differ (" + ", ".join(kernels) + ")")
    if baseline.replay_capture_sizes != current.replay_capture_sizes:
        warnings.append(f"replay graph sizes differ ({baseline.replay_capture_sizes or 'off'} -> "
                        f"{current.replay_capture_sizes or 'off'})")
    gates = [f"{name} {getattr(baseline, name)} -> {getattr(current, name)}"
             for name in ("kv_block_reuse", "lora", "prompt_embeds", "prefix_hits")
             if getattr(baseline, name) != getattr(current, name)]
    if gates:
        warnings.append("engine gates differ (" + "; ".join(gates) + ")")
    if baseline.batch_invariant != current.batch_invariant:  # verdicts of another strength
        mode = {False: "envelope", True: "batch-invariant"}
        warnings.append(f"checks mode differs (E1/E2 vs the full batch: "
                        f"{mode[baseline.batch_invariant]} -> {mode[current.batch_invariant]})")
    chunking = [None if run.tasks is None else run.tasks.chunk_size for run in (baseline, current)]
    if baseline.tasks is not None and current.tasks is not None and chunking[0] != chunking[1]:
        name = {None: "whole"}
        warnings.append("task prompts differ (" + " -> ".join(
            name.get(c, f"chunks of {c}") for c in chunking) + "): the tasks check judges "
            "another prefill")
    if None not in (baseline.replay_route, current.replay_route) and (
            baseline.replay_route != current.replay_route):
        warnings.append(f"route differs ({baseline.replay_route} -> {current.replay_route})")
    if (baseline.kernels is None) != (current.kernels is None):
        side = "baseline" if baseline.kernels is None else "current"
        warnings.append(f"kernels not recorded in {side} (an older results file): whether both "
                        "ran the same kernels is unknown")

    if current.status == "error" and baseline.status != "error":
        regressions.append(f"case now raises: {' '.join((current.error or '').split())}")
    elif baseline.status == "error" and current.status != "error":
        improvements.append("case no longer raises")
    elif current.status == "error":
        warnings.append("case still raises")

    baseline_checks = {check.id: check for check in baseline.checks}
    current_checks = {check.id: check for check in current.checks}
    for check_id, check in current_checks.items():
        before = baseline_checks.get(check_id)
        if before is None:
            continue
        if before.passed and not check.passed:
            regressions.append(f"{check_id} now fails" + (f": {check.message}" if check.message
                                                          else ""))
        elif not before.passed and check.passed:
            improvements.append(f"{check_id} now passes")
        elif not check.passed:
            warnings.append(f"{check_id} still fails")
    if current.status != "error":
        warnings += [f"{check_id} not run in current"
                     for check_id in baseline_checks.keys() - current_checks.keys()]

    for name in ("deterministic", "flops"):
        before, after = getattr(baseline, name), getattr(current, name)
        # Other kernels count other FLOPs (a kernel's formula is not the PyTorch path's ops): in
        # an A/B comparison a changed FLOP figure is reported, not a regression. Every other
        # deterministic figure (kept rows, graphs) does not depend on the kernels and still gates.
        def counts_flops(key: str, name: str = name) -> bool:
            return bool(kernels) and (name == "flops" or key.startswith("flops_"))

        (gated_before, flops_before), (gated_after, flops_after) = (
            _split(before, counts_flops), _split(after, counts_flops))
        changed, one_sided = _exact_differences(name, gated_before, gated_after)
        moved, moved_one_sided = _exact_differences(name, flops_before, flops_after)
        regressions += changed
        warnings += [f"{c} [other kernels]" for c in moved] + one_sided + moved_one_sided

    timings = [delta for path in TIMED_PATHS if (delta := compare_timing(
        path, getattr(baseline.timing, path, None), getattr(current.timing, path, None),
        max_slowdown=max_slowdown, alpha=alpha, min_samples=min_samples)) is not None]
    timings = beyond_noise(timings, baseline.timing, current.timing, max_slowdown=max_slowdown,
                           shared=shared)
    for delta in timings:
        if delta.verdict == "within noise" and delta.change is not None and delta.change > 0:
            warnings.append(f"{delta.describe()}: timing not gated")
        elif delta.verdict == "invalid":
            regressions.append(delta.describe())
        elif delta.verdict in ("absent", "too few samples"):
            warnings.append(f"{delta.describe()}: {delta.verdict}, timing not gated"
                            if delta.verdict == "too few samples" else delta.describe())
        elif delta.verdict in ("slower", "faster") and timing_gate is not None:
            warnings.append(f"{delta.describe()} [not gated: {timing_gate}]")
        elif delta.verdict == "slower":
            regressions.append(delta.describe())
        elif delta.verdict == "faster":
            improvements.append(delta.describe())
    speedup = compare_speedup(baseline.timing, current.timing, max_slowdown=max_slowdown,
                              alpha=alpha, min_samples=min_samples)
    if speedup is not None and speedup.verdict == "fell":
        if timing_gate is not None:
            warnings.append(f"{speedup.describe()} [not gated: {timing_gate}]")
        else:
            regressions.append(speedup.describe())

    status: RowStatus = ("regressed" if regressions else "warning" if warnings
                         else "improved" if improvements else "unchanged")
    reasons = regressions + warnings + improvements
    if kernels and not allow_config_change:
        status = "incomparable"
        reasons.insert(0, "kernels differ (" + ", ".join(kernels) + "): not the same measurement "
                       "(--allow-config-change compares them as an A/B)")
    return ComparisonRow(key, current.label, status, tuple(reasons), tuple(timings), speedup)


def compare_runs(baseline: RunResults, current: RunResults, *, max_slowdown: float = 0.05,
                 alpha: float = 0.01, min_samples: int = 5, gate_timing: bool = True,
                 allow_config_change: bool = False) -> Comparison:
    """Match cases and classify each; pure. Missing cases are reported but never regress."""
    env_diffs = environment_differences(baseline, current)
    run_warnings = []
    timing_gate = None
    if env_diffs:
        timing_gate = "environments differ"
        run_warnings.append("environments differ (" + "; ".join(env_diffs) + "): timing is "
                            "reported but not gated")
    elif not gate_timing:
        timing_gate = "timing gate off"
    if baseline.scenario_hash != current.scenario_hash:
        run_warnings.append("scenario files differ (hash); cases are matched by their params")

    baseline_cases, current_cases = _keyed(baseline), _keyed(current)
    rows = []
    for key, case in current_cases.items():
        before = baseline_cases.get(key)
        if before is None:
            rows.append(ComparisonRow(key, case.label, "new", ("not in baseline",)))
        else:
            rows.append(compare_case(key, before, case, timing_gate=timing_gate,
                                     max_slowdown=max_slowdown, alpha=alpha,
                                     min_samples=min_samples,
                                     allow_config_change=allow_config_change,
                                     shared=shared_limit(baseline, current)))
    for key, case in baseline_cases.items():
        if key not in current_cases:
            rows.append(ComparisonRow(key, case.label, "missing", ("in baseline only",)))
    missing = sum(row.status == "missing" for row in rows)
    if missing:
        run_warnings.append(f"{missing} baseline case{'s' if missing > 1 else ''} missing from "
                            "current")
    return Comparison(tuple(rows), tuple(run_warnings), timing_gate is None, max_slowdown, alpha)
