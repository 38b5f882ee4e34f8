"""The report's tables as formatted cells, shared by the markdown and the HTML report so both say
the same thing. Cells are plain text; escaping is the renderer's job."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from swa_bench.results import (
    CaseResult,
    CaseTiming,
    CheckResult,
    Diagnostic,
    RunResults,
    ThresholdAdvice,
    TimingStats,
)

MISSING = "–"
ENVIRONMENT_KEYS = ("torch", "cuda", "gpu", "driver", "python", "platform", "git_sha", "git_dirty",
                    "source_sha256", "hostname", "threads")


def fmt_number(value: float | None, digits: int = 3) -> str:
    """Significant-digit formatting that stays readable from 1e-9 to 1e6 (and says inf/nan)."""
    if value is None:
        return MISSING
    if math.isnan(value) or math.isinf(value):
        return str(value)
    if value == 0:
        return "0"
    if 1e-3 <= abs(value) < 1e5:
        return f"{value:.{digits}g}" if abs(value) < 1 else f"{value:.{digits}f}".rstrip(
            "0").rstrip(".")
    return f"{value:.{digits - 1}e}"


def fmt_ms(stats: TimingStats | None) -> str:
    if stats is None:
        return MISSING
    text = f"{stats.median_ms:.3f}"
    return f"{text} (noisy)" if stats.noisy else text


def fmt_ratio(value: float | None) -> str:
    return MISSING if value is None else f"{value:.2f}x"


def fmt_share(value: float | None) -> str:
    return MISSING if value is None else f"{100 * value:.1f}%"


def fmt_mib(nbytes: int | None) -> str:
    """Bytes in MiB: whole MiB from 100 up (a GPU's figures), three digits below (a CPU
    preset's)."""
    if nbytes is None:
        return MISSING
    mib = nbytes / 2**20
    return f"{mib:.0f}" if abs(mib) >= 100 else fmt_number(mib)


def fmt_mib_pair(peaks: dict[str, int]) -> str:
    """Both paths' peak memory, ``"reference / replay"`` in MiB (missing where either is)."""
    pair = [peaks.get(name) for name in ("reference", "replay")]
    if None in pair:
        return MISSING
    return " / ".join(fmt_mib(b) for b in pair)


NOT_APPLICABLE = "n/a"
MAX_EFFICIENCY = 1.05  # speedup over the FLOP ideal beyond which a figure is not believed


def trimmed_nothing(case: CaseResult) -> bool:
    """The timed replay step kept every row (FULL graphs, a step at or below W): both paths ran
    the same work, so a "speedup" there is noise, not replay's effect."""
    kept = case.deterministic.get("kept_rows")
    return kept is not None and kept >= case.tokens


def speedup_cell(case: CaseResult) -> str:
    return NOT_APPLICABLE if trimmed_nothing(case) else fmt_ratio(case.speedup)


def efficiency_cell(case: CaseResult) -> str:
    return NOT_APPLICABLE if trimmed_nothing(case) else fmt_share(case.efficiency)


def roofline_efficiency_cell(case: CaseResult) -> str:
    """The speedup over the roofline ideal (n/a where nothing was trimmed, – before it)."""
    return NOT_APPLICABLE if trimmed_nothing(case) else fmt_share(case.roofline_efficiency)


def implausible(results: RunResults) -> list[str]:
    """Figures no correct measurement gives, one line each, for every output to flag: a speedup
    beyond ``MAX_EFFICIENCY`` of the FLOP ideal (replay cannot beat doing less work by more than
    that work: the reference wastes time, or the timing is off), and a speedup measured where
    nothing was trimmed (shown as n/a)."""
    lines = []
    for case in results.cases:
        if case.speedup is None:
            continue
        if trimmed_nothing(case):
            lines.append(f"{case.label}: trimmed nothing, so its {case.speedup:.2f}x is noise "
                         f"(speedup n/a)")
        elif case.efficiency is not None and case.efficiency > MAX_EFFICIENCY:
            lines.append(f"{case.label}: speedup {case.speedup:.2f}x is "
                         f"{100 * case.efficiency:.0f}% of the FLOP ideal "
                         f"{fmt_ratio(case.ideal_speedup)} (above {100 * MAX_EFFICIENCY:.0f}%: "
                         f"the reference path wastes time or the timing is off)")
    return lines


def describe_diagnostic(diag: Diagnostic) -> str:
    where = ",".join(str(i) for i in diag.worst_index)
    return (f"{diag.tensor}: {diag.mismatched}/{diag.total} mismatched ({100 * diag.share:.2g}%), "
            f"max abs {fmt_number(diag.max_abs)}, max rel {fmt_number(diag.max_rel)} at [{where}]")


def describe_check(check: CheckResult) -> str:
    """The message and the worst tensor: what a reader needs to start debugging a failure."""
    worst = check.worst_diagnostic()
    parts = [check.message] if check.message else []
    if worst is not None and (not check.passed or worst.mismatched or worst.max_abs):
        parts.append(describe_diagnostic(worst))
    return "; ".join(parts)


# Control characters (C0 but newline and tab, DEL, C1) and the bidi overrides: from a tampered
# results file they would drive the terminal (ESC sequences set the title, clear the screen) or
# reorder what a reader sees, in the console, report.md and report.html alike.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """``text`` with every control character written as its escape (``\\x1b``), newlines and
    tabs kept: what a results file holds is shown, never obeyed."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def one_line(text: str | None) -> str:
    return " ".join(printable(text or "").split())


@dataclass(frozen=True)
class CheckRow:
    case: str
    check: str
    mode: str
    outcome: str  # "pass" | "fail" | "error" | "info"
    detail: str


@dataclass(frozen=True)
class LatencyRow:
    case: str
    tokens: int
    graph_mode: str
    policy: str
    trim_threshold: int
    reference_ms: str
    replay_ms: str
    speedup: str
    ideal: str
    efficiency: str
    checks: str
    outcome: str
    rates: str = MISSING  # "reference / replay TFLOP/s (MFU)"
    roofline_ideal: str = MISSING  # the roofline ideal; MISSING in results written before it
    roofline_efficiency: str = MISSING


@dataclass(frozen=True)
class ApproximationRow:
    case: str
    logits_max_abs: str
    kl: str
    top1: str
    greedy: str
    worst_layer_error: str


def check_rows(results: RunResults) -> list[CheckRow]:
    """Every check of every case, failures (and raised cases) first, then in run order."""
    rows = []
    for case in results.cases:
        for check in case.checks:
            rows.append(CheckRow(case=case.label, check=f"{check.id} {check.name}", mode=check.mode,
                                 outcome=check_outcome(check),
                                 detail=one_line(describe_check(check))))
        if case.status == "error":
            rows.append(CheckRow(case=case.label, check="(case raised)", mode=MISSING,
                                 outcome="error", detail=one_line(case.error)))
    return sorted(rows, key=lambda row: row.outcome not in ("fail", "error"))


def check_outcome(check: CheckResult) -> str:
    """pass / fail, or info for a figure that is measured but not judged."""
    if check.mode == "info":
        return "info"
    return "pass" if check.passed else "fail"


def failure_rows(results: RunResults) -> list[CheckRow]:
    return [row for row in check_rows(results) if row.outcome in ("fail", "error")]


def checks_cell(case: CaseResult) -> str:
    if case.status == "error":
        return "error"
    failed = case.failed_checks()
    info = sum(c.mode == "info" for c in case.checks)
    judged = len(case.checks) - info
    cell = f"{judged - len(failed)}/{judged}" + (f" +{info}i" if info else "")
    return f"{cell} (failed: {' '.join(c.id for c in failed)})" if failed else cell


@dataclass(frozen=True)
class HeadlineRow:
    """One graph mode and policy: what replay bought over its cases, and whether they passed."""

    graph_mode: str
    policy: str
    cases: int
    speedup: str  # median over the cases that trimmed rows; n/a where none did
    speedup_range: str
    efficiency: str  # median speedup over the FLOP ideal
    verdict: str  # pass, fail or error: the worst outcome of its cases


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])


def headline_rows(results: RunResults) -> list[HeadlineRow]:
    """Per graph mode and policy, in first-seen order: the speedup's median and range over the
    cases that trimmed rows, the median efficiency against the FLOP ideal, and the verdict."""
    groups: dict[tuple[str, str], list[CaseResult]] = {}
    for case in results.cases:
        groups.setdefault((case.graph_mode, case.policy), []).append(case)
    rows = []
    for (mode, policy), cases in groups.items():
        timed = [c for c in cases if c.speedup is not None and not trimmed_nothing(c)]
        speedups = [c.speedup for c in timed]
        efficiencies = [c.efficiency for c in timed if c.efficiency is not None]
        untrimmed = any(c.speedup is not None for c in cases) and not timed
        outcomes = {c.outcome() for c in cases}
        verdict = next(v for v in ("error", "fail", "pass") if v in outcomes or v == "pass")
        rows.append(HeadlineRow(
            graph_mode=mode, policy=policy, cases=len(cases),
            speedup=NOT_APPLICABLE if untrimmed else (
                fmt_ratio(_median(speedups)) if speedups else MISSING),
            speedup_range=(f"{min(speedups):.2f}–{max(speedups):.2f}x" if speedups
                           else MISSING),
            efficiency=fmt_share(_median(efficiencies)) if efficiencies else (
                NOT_APPLICABLE if untrimmed else MISSING),
            verdict=verdict))
    return rows


def latency_rows(results: RunResults) -> list[LatencyRow]:
    """Ordered by (graph mode, policy, tokens): how a reader scans for the break-even point."""
    cases = sorted(results.cases, key=lambda c: (c.graph_mode, c.policy, c.tokens, c.index))
    rows = []
    for case in cases:
        timing = case.timing
        rows.append(LatencyRow(
            case=case.label, tokens=case.tokens, graph_mode=case.graph_mode, policy=case.policy,
            trim_threshold=case.trim_threshold,
            reference_ms=fmt_ms(timing.reference if timing else None),
            replay_ms=fmt_ms(timing.replay if timing else None),
            speedup=speedup_cell(case), ideal=fmt_ratio(case.ideal_speedup),
            efficiency=efficiency_cell(case), checks=checks_cell(case),
            outcome=case.outcome(), rates=rates_cell(case),
            roofline_ideal=fmt_ratio(case.roofline_ideal_speedup),
            roofline_efficiency=roofline_efficiency_cell(case)))
    return rows


@dataclass(frozen=True)
class GraphRow:
    """A graph-mode case's captures and what they cost: the replay engine's model graphs and
    replay graphs (sizes, capture seconds, device memory held), and each path's peak
    allocation over its timed loop."""

    case: str
    graph_mode: str
    model_graphs: str
    model_graphs_mib: str
    replay_graphs: str
    replay_graphs_mib: str
    peak_mib: str


def graph_rows(results: RunResults) -> list[GraphRow]:
    """One row per case run in graphs (eager cases have nothing to show)."""
    rows = []
    for case in results.cases:
        if case.graph_mode == "eager" or case.capture_seconds is None:
            continue
        captured = case.deterministic.get("graphs_captured", 0)
        padded = case.deterministic.get("padded_tokens")
        model = (f"{captured} captured in {case.capture_seconds:.1f} s"
                 + (f", step in {padded}" if padded else ", step eager"))
        if not case.replay_capture_sizes:
            replay = "off"
        elif not case.replay_graph_sizes:
            replay = "none reached"
        else:
            replay = (f"{', '.join(map(str, case.replay_graph_sizes))} captured in "
                      f"{case.replay_capture_seconds or 0:.1f} s")
            rows_in = case.deterministic.get("replay_graph_rows")
            replay += f", step in {rows_in}" if rows_in else ", step eager"
        rows.append(GraphRow(
            case=case.label, graph_mode=case.graph_mode, model_graphs=model,
            model_graphs_mib=fmt_mib(case.graph_pool_bytes), replay_graphs=replay,
            replay_graphs_mib=(fmt_mib(case.replay_graph_pool_bytes)
                               if case.replay_capture_sizes else NOT_APPLICABLE),
            peak_mib=fmt_mib_pair(case.peak_memory_bytes)))
    return rows


def rates_cell(case: CaseResult) -> str:
    """Each path's achieved TFLOP/s and its share of the device's measured GEMM rate."""
    if not case.achieved_tflops:
        return MISSING
    parts = []
    for name in ("reference", "replay"):
        rate, mfu = case.achieved_tflops.get(name), case.mfu.get(name)
        if rate is None:
            return MISSING
        parts.append(f"{rate:.3g}" + ("" if mfu is None else f" ({mfu:.0%})"))
    return " / ".join(parts)


def mfu_peaks(cases: Sequence[CaseResult]) -> str:
    """The measured peaks the cases' MFU is against (their ``mfu_basis``), for the caption
    that explains MFU: ``bfloat16 794 TFLOP/s`` and, where fp8 GEMMs were counted at their own
    rate, ``fp8 1480 TFLOP/s for the fp8 Linears' GEMMs``; where they ran on a device without
    an fp8 rate, that they were counted at the dtype's. Empty for results written before."""
    rates: dict[str, float] = {}
    unrated = False
    for case in cases:
        basis = case.mfu_basis
        if basis is None:
            continue
        rates.setdefault(basis.dtype, basis.dtype_tflops)
        if basis.fp8_tflops is not None:
            rates.setdefault("fp8", basis.fp8_tflops)
        unrated |= basis.fp8_tflops is None and any(basis.fp8_gemm_flops.values())
    parts = [f"{name} {fmt_number(rate)} TFLOP/s"
             + (" for the fp8 Linears' GEMMs under quantised_gemm fp8" if name == "fp8" else "")
             for name, rate in rates.items()]
    if unrated:
        parts.append("fp8 GEMMs without an fp8 rate on this device counted at the dtype's")
    return "; ".join(parts)


def mfu_caption(cases: Sequence[CaseResult]) -> str:
    """What MFU is and the peaks it is against, one sentence for the reports' captions."""
    peaks = mfu_peaks(cases)
    if not peaks:  # results written before the basis was recorded
        return ("MFU: achieved TFLOP/s over the device's measured GEMM rate (environment: "
                "gemm_tflops).")
    return ("MFU: the share of a path's time its FLOPs take at the device's measured GEMM "
            f"peaks ({peaks}; each case's mfu_basis); without fp8 GEMMs, achieved TFLOP/s "
            "over the dtype's rate.")


def approximation_rows(results: RunResults) -> list[ApproximationRow]:
    rows = []
    for case in results.cases:
        approx = case.approximation
        if approx is None:
            continue
        errors = approx.window_kv_rel_error
        worst = (f"{fmt_number(max(errors))} (layer {errors.index(max(errors))})" if errors
                 else MISSING)
        rows.append(ApproximationRow(
            case=case.label, logits_max_abs=fmt_number(approx.logits_max_abs),
            kl=fmt_number(approx.kl), top1=fmt_share(approx.top1_agreement),
            greedy=f"{fmt_share(approx.greedy_agreement)} over {approx.continuation_steps} steps",
            worst_layer_error=worst))
    return rows


@dataclass(frozen=True)
class TtftRow:
    """One prompt of a prompt case: how long its chunks and first decode took on each path, and
    what replay did to its answer after the last chunk."""

    case: str
    graph_mode: str
    policy: str
    prompt: str  # "length/chunk_size" (+ decodes beside)
    steps: str
    reference_ms: str
    replay_ms: str
    speedup: str
    tokens_per_s: str  # reference / replay
    peak_mib: str  # reference / replay, over a whole prompt
    logits_max_abs: str
    kl: str
    top1: str
    greedy: str
    outcome: str
    ttft: CaseTiming | None = None  # the raw figures, for renderers that format their own


def ttft_rows(results: RunResults) -> list[TtftRow]:
    """Every prompt of every prompt case, ordered by (prompt, chunk, graph mode, case order):
    the policies of one prompt side by side."""
    found = [(case, prompt) for case in results.cases for prompt in case.prompts]
    found.sort(key=lambda cp: (cp[1].length, cp[1].chunk_size, cp[0].graph_mode, cp[0].index))
    rows = []
    for case, p in found:
        ttft, approx = p.ttft, p.approximation
        rates = [p.tokens_per_s.get(name) for name in ("reference", "replay")]
        beside = f" +{p.decodes_beside}d" if p.decodes_beside else ""
        rows.append(TtftRow(
            case=case.label, graph_mode=case.graph_mode, policy=case.policy,
            prompt=f"{p.length}/{p.chunk_size}{beside}",
            steps=str(len(p.steps)),
            reference_ms=fmt_ms(ttft.reference if ttft else None),
            replay_ms=fmt_ms(ttft.replay if ttft else None), speedup=fmt_ratio(p.speedup),
            tokens_per_s=(" / ".join(f"{r:.4g}" for r in rates) if None not in rates
                          else MISSING),
            peak_mib=fmt_mib_pair(p.peak_memory_bytes),
            logits_max_abs=fmt_number(approx.logits_max_abs if approx else None),
            kl=fmt_number(approx.kl if approx else None),
            top1=fmt_share(approx.top1_agreement if approx else None),
            greedy=(f"{fmt_share(approx.greedy_agreement)} over {approx.continuation_steps}"
                    if approx else MISSING),
            outcome=case.outcome(), ttft=ttft))
    return rows


def prompt_step_rows(results: RunResults) -> list[tuple[str, ...]]:
    """Every step of every prompt: (case, prompt, step, chunk positions, rows, kept rows,
    reference ms, replay ms, route)."""
    rows = []
    for case in results.cases:
        for p in case.prompts:
            for s in p.steps:
                rows.append((case.label, f"{p.length}/{p.chunk_size}", str(s.index),
                             f"[{s.cached_len}, {s.cached_len + s.query_len})", str(s.tokens),
                             MISSING if s.kept_rows is None else str(s.kept_rows),
                             fmt_ms(s.reference), fmt_ms(s.replay), one_line(s.replay_route)))
            if p.first_decode is not None:
                rows.append((case.label, f"{p.length}/{p.chunk_size}", "first decode", "",
                             str(1 + p.decodes_beside), "", fmt_ms(p.first_decode.reference),
                             fmt_ms(p.first_decode.replay), ""))
    return rows


def advice_value(advice: ThresholdAdvice) -> str:
    """The threshold; "none" (never trim: replay loses at the largest length); or "not enough
    evidence", which is no advice at all."""
    if advice.recommended_trim_threshold is not None:
        return str(advice.recommended_trim_threshold)
    return "none" if advice.decided else "not enough evidence"


def advice_rows(results: RunResults) -> list[tuple[str, str, str, str]]:
    return [(a.graph_mode, a.batch, advice_value(a), one_line(a.note))
            for a in results.threshold_advice]


def _environment_value(value: Any) -> str:
    """A recorded value as a reader writes it: ``float32 0.512`` for ``{'float32': 0.512}``."""
    if value is None:
        return MISSING
    if isinstance(value, dict):
        return ", ".join(f"{k} {fmt_number(v) if isinstance(v, float) or v is None else v}"
                         for k, v in value.items()) or MISSING
    return one_line(str(value))


def environment_rows(results: RunResults) -> list[tuple[str, str]]:
    """The documented keys first, in a fixed order, then anything else the runner recorded."""
    env: dict[str, Any] = results.environment
    keys = [k for k in ENVIRONMENT_KEYS if k in env] + sorted(k for k in env
                                                               if k not in ENVIRONMENT_KEYS)
    rows = [(key, _environment_value(env[key])) for key in keys]
    rows += [("swa-bench", results.swa_bench_version or MISSING),
             ("scenario", results.scenario_name),
             ("scenario file", results.scenario_file or MISSING),
             ("scenario hash", results.scenario_hash),
             ("started", results.started_at), ("finished", results.finished_at or MISSING)]
    return rows


def checks_summary(counts: dict[str, int]) -> str:
    judged = counts["checks"] - counts["checks_info"]
    text = f"{counts['checks_passed']} of {judged} checks passed"
    if counts["checks_info"]:
        text += f" ({counts['checks_info']} info results, measured but not judged)"
    return text


def verdict_line(results: RunResults) -> str:
    counts = results.counts()
    verdict = results.verdict()
    head = ("UNVERIFIED (no pass/fail check ran)" if verdict == "unverified"
            else verdict.upper())
    return (f"{head}: {counts['passed']} of {counts['cases']} cases passed "
            f"({counts['failed']} failed, {counts['errors']} raised); {checks_summary(counts)}")


POLICY_ORDER = ("full", "halo", "bounded", "final_window", "tail")


def prompting(chunk_size: int | None) -> str:
    """How a case's task prompts were prefilled (``checks.tasks.chunk_size``), in the tables'
    words: ``whole`` (one prefill step) or ``chunks of N``."""
    return "whole" if chunk_size is None else f"chunks of {chunk_size}"


def prompts_phrase(chunk_size: int | None) -> str:
    """``prompting`` in a sentence: ``whole prompts``, ``prompts in chunks of N``."""
    return "whole prompts" if chunk_size is None else f"prompts in chunks of {chunk_size}"


def task_cases(results: RunResults) -> list[CaseResult]:
    """One case per prompting and policy with task results (the first of each): whole prompts
    first, then by chunk size; full first within each. Figures of whole and chunked prompts are
    never merged: each is graded against the full prefill prefilled alike."""
    seen: dict[tuple[int | None, str], CaseResult] = {}
    for case in results.cases:
        key = (case.tasks.chunk_size, case.policy) if case.tasks is not None else None
        if key is not None and key not in seen:
            seen[key] = case
    order = {p: i for i, p in enumerate(POLICY_ORDER)}
    return sorted(seen.values(), key=lambda c: (c.tasks.chunk_size is not None,
                                                c.tasks.chunk_size or 0,
                                                order.get(c.policy, len(order))))


def _policies(cases: list[CaseResult]) -> list[str]:
    """The policies of ``cases`` in their order, each once (a column per policy)."""
    return list(dict.fromkeys(c.policy for c in cases))


def task_rows(results: RunResults) -> tuple[list[str], list[tuple[str, ...]]]:
    """(policies, rows): per prompting (``prompting``), task, prompt length and distance, each
    policy's accuracy and, where not full, its agreement with the full prefill's answers (the
    full prefill prefilled alike)."""
    cases = task_cases(results)
    keys: list[tuple[int | None, str, int, int]] = []
    cells: dict[tuple[int | None, str, int, int, str], str] = {}
    for case in cases:
        for c in case.tasks.cells:
            key = (case.tasks.chunk_size, c.task, c.prompt_len, c.distance)
            if key not in keys:
                keys.append(key)
            agree = "" if case.policy == "full" else f" ({c.agreement:.0%} agree)"
            cells[(*key, case.policy)] = f"{c.accuracy:.0%}{agree}"
    keys.sort(key=lambda k: (k[0] is not None, k[0] or 0, *k[1:]))
    policies = _policies(cases)
    rows = [(prompting(chunk), task, str(length), str(distance),
             *(cells.get((chunk, task, length, distance, p), MISSING) for p in policies))
            for chunk, task, length, distance in keys]
    return policies, rows


def held_out_rows(results: RunResults) -> tuple[list[str], list[tuple[str, ...]]]:
    """(policies, rows): per prompting and prompt length, each policy's teacher-forced
    held-out loss."""
    cases = task_cases(results)
    keys = sorted({(c.tasks.chunk_size, h.prompt_len) for c in cases for h in c.tasks.held_out},
                  key=lambda k: (k[0] is not None, k[0] or 0, k[1]))
    loss = {(c.tasks.chunk_size, h.prompt_len, c.policy): h.loss
            for c in cases for h in c.tasks.held_out}
    policies = _policies(cases)
    rows = [(prompting(chunk), str(length),
             *(fmt_number(loss.get((chunk, length, p)), 4) for p in policies))
            for chunk, length in keys]
    return policies, rows


def _pooled(case: CaseResult, task: str | None = None) -> tuple[float, int, int]:
    """(accuracy, prompts whose answer differs from the full prefill's, prompts)."""
    cells = [c for c in case.tasks.cells if task is None or c.task == task]
    total = sum(c.prompts for c in cells)
    right = sum(c.accuracy * c.prompts for c in cells)
    differ = sum(round((1 - c.agreement) * c.prompts) for c in cells)
    return (right / total if total else math.nan), differ, total


def task_note(results: RunResults) -> list[str]:
    """What each policy changed against the full prefill prefilled alike (whole prompts, or the
    same chunks), in numbers: one line per prompting and policy."""
    cases = task_cases(results)
    lines = []
    for case in cases:
        chunk = case.tasks.chunk_size
        full = next((c for c in cases if c.policy == "full" and c.tasks.chunk_size == chunk),
                    None)
        if case.policy == "full" or full is None:
            continue
        acc_f = {t: _pooled(full, t)[0] for t in ("recall", "copy")}
        loss_f = {h.prompt_len: h.loss for h in full.tasks.held_out}
        _, differ, total = _pooled(case)
        acc = {t: _pooled(case, t)[0] for t in ("recall", "copy")}
        losses = [(h.prompt_len, h.loss, loss_f.get(h.prompt_len)) for h in case.tasks.held_out]
        worst = max((x for x in losses if x[2] is not None), key=lambda x: abs(x[1] - x[2]),
                    default=None)
        loss = ("" if worst is None else
                f"; held-out loss after a {worst[0]}-token prompt {worst[1]:.5f} nats/byte, "
                f"{worst[1] - worst[2]:+.2g} vs full (the largest change over the prompt "
                "lengths)")
        lines.append(
            f"{case.policy}, {prompts_phrase(chunk)}: {differ}/{total} answers differ from "
            f"the full prefill's; recall {acc['recall']:.1%} (full {acc_f['recall']:.1%}), copy "
            f"{acc['copy']:.1%} (full {acc_f['copy']:.1%}){loss}")
    return lines
