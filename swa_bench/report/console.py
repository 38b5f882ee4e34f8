"""Console (rich) output: the latency table, the check table, compare's table and the summary
lines (progress is ``run.progress``). Everything fits 80 columns, so a table stays a table in a
CI log or a pipe: long text (diagnostics, reasons) goes in lines under the table, not in a
column. Text from results (labels, error messages) is escaped, so ``[enforce fail at ...]`` is
printed, not eaten as markup.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape as _markup_escape
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from swa_bench.compare import Comparison, ComparisonRow
from swa_bench.report import tables
from swa_bench.report.comparison import sorted_rows, verdict_line
from swa_bench.results import (
    CaseResult,
    RunResults,
    TimingStats,
    overall_verdict,
    tally,
)

_SHORT = {"graph_mode": "mode", "trim_threshold": "threshold", "prompt_len": "prompt",
          "approximation": "approx", "visibility": "visible"}
_VERDICT_STYLE = {"pass": "bold green", "fail": "bold red", "error": "bold red",
                  "unverified": "bold yellow"}
_OUTCOME = {"pass": "[green]pass[/]", "fail": "[bold red]FAIL[/]", "error": "[bold red]ERROR[/]",
            "info": "[dim]info[/]"}
UNSTABLE_ADVICE = ("raise timing.iters, stop other jobs on this machine, and compare these figures "
                   "with care")
THREADS_ADVICE = "run with OMP_NUM_THREADS=1 (or timing.threads: 1), "


def escape(text: str) -> str:
    """Rich markup escaped and control characters written out (``tables.printable``)."""
    return _markup_escape(tables.printable(text))


def print_table(console: Console, table: Any) -> None:
    """``console.print(table)``, but off a terminal (a log, a pipe) without the spaces rich pads
    each line to the table's width with: 35 of 43 piped lines ended in them."""
    if console.is_terminal:
        console.print(table)
        return
    with console.capture() as captured:
        console.print(table)
    text = "\n".join(line.rstrip() for line in captured.get().splitlines())
    console.file.write(text + "\n")


def say(console: Console, markup: str, *, wrap: bool = True) -> None:
    """One message (a warning, advice, a reason) wrapped to the console's width between words,
    continuation lines indented two spaces: never inside a word (a path or label longer than
    the width stays whole, on a line of its own) and no trailing spaces, where rich's own
    wrapping cuts words (``/tmp/a…`` folded mid-path) and leaves a space at each break. A
    verdict line (``wrap=False``) stays one line, whatever its length: logs are grepped for it."""
    text = Text.from_markup(markup)
    if not wrap:
        console.print(text, highlight=False, soft_wrap=True)
        return
    lines: list[tuple[int, int]] = []
    for word in re.finditer(r"\S+", text.plain):
        if not lines:  # the first line keeps the message's own leading spaces
            lines.append((0, word.end()))
        elif word.end() - lines[-1][0] + (2 if len(lines) > 1 else 0) <= console.width:
            lines[-1] = (lines[-1][0], word.end())
        else:
            lines.append((word.start(), word.end()))
    for number, (start, end) in enumerate(lines or [(0, 0)]):
        line = text[start:end]
        console.print(Text("  ") + line if number else line, highlight=False, no_wrap=True,
                      overflow="ignore", crop=False)


def _table(title: str) -> Table:
    return Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1),
                 pad_edge=False, collapse_padding=True)


def swept_columns(cases: Sequence[CaseResult]) -> list[tuple[str, Callable[[CaseResult], str]]]:
    """(header, cell) per swept parameter, so the rows of a sweep are told apart; tokens always
    (a workload change shows there)."""
    paths: list[str] = []
    for case in cases:
        paths += [p for p in case.params if p not in paths and not p.startswith("workload")]
    leaves = [p.rsplit(".", 1)[-1] for p in paths]
    columns = []
    for path, leaf in zip(paths, leaves, strict=True):
        name = leaf if leaves.count(leaf) == 1 else path
        columns.append((_SHORT.get(name, name),
                        lambda c, p=path: _value(c.params.get(p, tables.MISSING))))
    columns.append(("tokens", lambda c: str(c.tokens)))
    return columns


def _case_columns(cases: Sequence[CaseResult], compact: bool
                  ) -> list[tuple[str, Callable[[CaseResult], str]]]:
    """The swept columns, or with ``compact`` one "#" column of case numbers whose labels
    ``print_fitted`` lists under the table: so a wide sweep's figures are never cut."""
    if compact:
        return [("#", lambda c: str(c.index))]
    return swept_columns(cases)


def print_fitted(console: Console, build: Callable[[bool], Table],
                 cases: Sequence[CaseResult]) -> None:
    """``build(False)`` when it fits the console's width, else ``build(True)`` and a legend
    line per case (its number and label): rich would otherwise cut cells to ``piecewi…``."""
    table = build(False)
    wide = console.options.update_width(10_000)  # the table's own width, not the console's
    if Measurement.get(console, wide, table).maximum <= console.width:
        print_table(console, table)
        return
    print_table(console, build(True))
    for case in cases:
        say(console, f"  #{case.index}: {escape(case.label)}")


def _value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _constants(cases: Sequence[CaseResult]) -> str:
    """The mode and policy when they are not swept (they are then the same for every row)."""
    parts = []
    for attr in ("graph_mode", "policy"):
        values = {getattr(c, attr) for c in cases}
        if len(values) == 1 and not any(attr in c.params for c in cases):
            parts.append(values.pop())
    return f" ({', '.join(parts)})" if parts else ""


def _ms(value: float, digits: int = 4) -> str:
    return f"{value:.{digits}g}" if abs(value) < 10 ** digits else f"{value:.0f}"


def timing_cell(stats: TimingStats | None, samples: int | None, mfu: float | None = None) -> str:
    """Median, and under it p10–p90 (and n when it differs from the table's), then the path's
    MFU when the run measured the device's GEMM rate (a third line: the table stays 80 wide)."""
    if stats is None:
        return tables.MISSING
    head = _ms(stats.median_ms) + (" ~" if stats.noisy else "")
    spread = f"{_ms(stats.p10_ms, 3)}–{_ms(stats.p90_ms, 3)}"
    if len(stats.samples_ms) != samples:
        spread += f" n={len(stats.samples_ms)}"
    rate = "" if mfu is None else f"\n[dim]MFU {tables.fmt_share(mfu)}[/]"
    return f"{head}\n[dim]{spread}[/]{rate}"


def ideal_cell(case: CaseResult) -> str:
    """The FLOP ideal, and under it the roofline ideal when the run measured one."""
    flop = tables.fmt_ratio(case.ideal_speedup)
    if case.roofline_ideal_speedup is None:
        return flop
    return f"{flop}\n[dim]{tables.fmt_ratio(case.roofline_ideal_speedup)}[/]"


def _percent(value: float | None) -> str:
    return tables.MISSING if value is None else f"{100 * value:.0f}%"


def efficiency_cells(case: CaseResult) -> str:
    """The speedup's share of the FLOP ideal, and under it of the roofline ideal (n/a where
    nothing was trimmed): line for line beside ``ideal_cell``."""
    if tables.trimmed_nothing(case):
        return tables.NOT_APPLICABLE if case.roofline_ideal_speedup is None else (
            f"{tables.NOT_APPLICABLE}\n[dim]{tables.NOT_APPLICABLE}[/]")
    flop = _percent(case.efficiency)
    if case.roofline_ideal_speedup is None:
        return flop
    return f"{flop}\n[dim]{_percent(case.roofline_efficiency)}[/]"


def _stats(cases: Sequence[CaseResult]) -> list[TimingStats]:
    return [s for c in cases if c.timing for s in (c.timing.reference, c.timing.replay) if s]


def _case_verdict(case: CaseResult) -> str:
    if case.status == "error":
        return "[bold red]ERROR[/]"  # the message goes under the table
    failed = case.failed_checks()
    if failed:
        return "[bold red]FAIL[/] " + escape(" ".join(c.id for c in failed))
    return f"[green]{escape(tables.checks_cell(case))}[/]"


def latency_table(results: RunResults, compact: bool = False) -> Table:
    """One row per case: swept values, median and p10–p90 of each path, speedup, FLOP ideal."""
    cases = results.cases
    stats = _stats(cases)
    counts = {len(s.samples_ms) for s in stats}
    samples = counts.pop() if len(counts) == 1 else None
    table = _table(f"{escape(results.scenario_name)}: latency{escape(_constants(cases))}")
    columns = _case_columns(cases, compact)
    for header, _ in columns:
        table.add_column(escape(header), justify="right" if header == "tokens" else "left",
                         no_wrap=True)
    table.add_column("ref ms", justify="right", no_wrap=True)
    table.add_column("replay ms", justify="right", no_wrap=True)
    table.add_column("speedup", justify="right", no_wrap=True)
    table.add_column("ideal", justify="right", no_wrap=True)
    table.add_column("eff", justify="right", no_wrap=True)
    table.add_column("checks")
    for case in cases:
        t = case.timing
        table.add_row(*[escape(cell(case)) for _, cell in columns],
                      timing_cell(t.reference if t else None, samples, case.mfu.get("reference")),
                      timing_cell(t.replay if t else None, samples, case.mfu.get("replay")),
                      tables.speedup_cell(case), ideal_cell(case), efficiency_cells(case),
                      _case_verdict(case))
    if stats:
        n = f"n={samples} samples" if samples is not None else "n samples as shown"
        mfu = f"; {tables.mfu_caption(cases)[:-1]}" if any(c.mfu for c in cases) else ""
        roof = (", under it the roofline ideal (per layer the longer of its FLOPs at the GEMM "
                "rate and its bytes at the copy bandwidth)"
                if any(c.roofline_ideal_speedup is not None for c in cases) else "")
        table.caption = (f"ms: median, under it p10–p90 ({n}); ~ unstable (IQR > 10% of the "
                         f"median); ideal: FLOPs ratio{roof}; eff: the speedup's share of each "
                         f"ideal; checks: passed/judged, +Ni info results{mfu}")
        table.caption_justify = "left"
    return table


def unstable_warning(results: RunResults) -> str | None:
    stats = _stats(results.cases)
    noisy = [s for s in stats if s.noisy]
    if not noisy:
        return None
    worst = max(s.iqr_over_median for s in noisy)
    threads = results.environment.get("threads")
    on_gpu = results.environment.get("gpu") is not None
    advice = (THREADS_ADVICE if isinstance(threads, int) and threads > 1 and not on_gpu
              else "") + UNSTABLE_ADVICE
    return (f"{len(noisy)} of {len(stats)} timings are unstable (IQR up to {100 * worst:.0f}% of "
            f"the median): {advice}")


def task_table(results: RunResults) -> Table | None:
    """Task accuracy per prompting and policy: pooled recall and copy accuracy, answers that
    differ from the full prefill's, held-out loss at the longest prompt and its change against
    the full prefill prefilled alike (whole prompts, or the same chunks: ``tables.prompting``)."""
    cases = tables.task_cases(results)
    if not cases:
        return None
    table = _table("Task accuracy (trained model)")
    longest = max((h.prompt_len for c in cases for h in c.tasks.held_out), default=None)
    loss_header = "loss" if longest is None else f"loss@{longest}"
    for header in ("policy", "prompts", "recall", "copy", "differ", loss_header, "vs full"):
        table.add_column(header, justify="left" if header in ("policy", "prompts") else "right")
    full = {(c.tasks.chunk_size, h.prompt_len): h.loss for c in cases if c.policy == "full"
            for h in c.tasks.held_out}
    for case in cases:
        cells, chunk = case.tasks.cells, case.tasks.chunk_size
        row = [case.policy, tables.prompting(chunk)]
        for task in ("recall", "copy"):
            mine = [c for c in cells if c.task == task]
            n = sum(c.prompts for c in mine)
            row.append(f"{sum(c.accuracy * c.prompts for c in mine) / n:.1%}" if n else "–")
        total = sum(c.prompts for c in cells)
        row.append(f"{sum(round((1 - c.agreement) * c.prompts) for c in cells)}/{total}")
        loss = [h.loss for h in case.tasks.held_out if h.prompt_len == longest]
        row.append(f"{loss[0]:.4f}" if loss else "–")
        reference = full.get((chunk, longest))
        row.append(f"{loss[0] - reference:+.2g}" if loss and reference is not None else "–")
        table.add_row(*(escape(c) for c in row))
    return table


def ttft_tables(results: RunResults) -> list[Table]:
    """Prompt cases: TTFT per prompt and policy (median ms of each path, speedup, tokens/s),
    then the approximation after each prompt's last chunk; none without prompt cases."""
    rows = tables.ttft_rows(results)
    if not rows:
        return []
    ttft = _table(f"{escape(results.scenario_name)}: time to first token")
    for header in ("policy", "prompt", "chunks", "TTFT ref", "replay", "speedup",
                   "tok/s ref/rep"):
        ttft.add_column(header, justify="left" if header in ("policy", "prompt") else "right",
                        no_wrap=True)
    approx = _table(f"{escape(results.scenario_name)}: after the last chunk vs full prefill")
    for header in ("policy", "prompt", "logits max abs", "KL", "top-1", "greedy"):
        approx.add_column(header, justify="left" if header in ("policy", "prompt") else "right",
                          no_wrap=True)
    modes = len({r.graph_mode for r in rows}) > 1  # then a policy alone names no row
    for r in rows:
        ref, rep = (r.ttft.reference, r.ttft.replay) if r.ttft else (None, None)
        policy = f"{r.graph_mode}/{r.policy}" if modes else r.policy
        ttft.add_row(escape(policy), escape(r.prompt), r.steps, _median_cell(ref),
                     _median_cell(rep), r.speedup, r.tokens_per_s.replace(" / ", "/"))
        approx.add_row(escape(policy), escape(r.prompt), r.logits_max_abs, r.kl, r.top1,
                       r.greedy)
    ttft.caption = ("TTFT ms: median over repetitions of the whole prompt of its chunk steps "
                    "plus the first decode (~ unstable); prompt: length/chunk (+Nd: N decode "
                    "rows beside each chunk); tok/s: length / TTFT; every step's figures are "
                    "in results.json and report.md")
    ttft.caption_justify = "left"
    return [ttft] + ([approx] if any(r.logits_max_abs != tables.MISSING for r in rows) else [])


def _median_cell(stats: TimingStats | None) -> str:
    return tables.MISSING if stats is None else _ms(stats.median_ms) + (" ~" if stats.noisy
                                                                        else "")


def headline_table(results: RunResults) -> Table | None:
    """What a reader wants first: per graph mode and policy the speedup (median, range over its
    cases), its efficiency against the FLOP ideal, and the verdict."""
    rows = tables.headline_rows(results)
    if not any(r.speedup != tables.MISSING for r in rows):
        return None
    table = _table(f"{escape(results.scenario_name)}: headline")
    for header in ("mode", "policy", "cases", "speedup", "range", "of ideal", "verdict"):
        table.add_column(header, justify="left" if header in ("mode", "policy", "verdict")
                         else "right", no_wrap=True)
    for r in rows:
        table.add_row(escape(r.graph_mode), escape(r.policy), str(r.cases), r.speedup,
                      r.speedup_range, r.efficiency, _OUTCOME.get(r.verdict, r.verdict))
    table.caption = ("speedup: median over the cases that trimmed rows (n/a: none did); of "
                     "ideal: median speedup over the FLOP ratio")
    table.caption_justify = "left"
    return table


def print_run_summary(console: Console, results: RunResults, run_dir: Path) -> None:
    """The headline, the latency table, timing warnings, trim-threshold advice and the verdict
    of one run."""
    headline = headline_table(results)
    if headline is not None:
        print_table(console, headline)
    if any(not c.prompts for c in results.cases):
        print_fitted(console, lambda compact: latency_table(results, compact), results.cases)
    for table in ttft_tables(results):
        print_table(console, table)
    tasks = task_table(results)
    if tasks is not None:
        print_table(console, tasks)
    warning = unstable_warning(results)
    for line in ([warning] if warning else []) + tables.implausible(results):
        say(console, f"[yellow]warning:[/] {escape(line)}")
    for advice in results.threshold_advice:
        say(console, f"recommended trim_threshold for {escape(advice.graph_mode)} / "
                      f"{escape(advice.batch)}: {tables.advice_value(advice)} "
                      f"[dim]({escape(advice.note)})[/]")
    print_failures(console, results.cases)
    verdict = results.verdict()
    say(console, f"[{_VERDICT_STYLE[verdict]}]{escape(tables.verdict_line(results))}[/]; "
                  f"results in {escape(str(run_dir))}", wrap=False)


def print_failures(console: Console, cases: Sequence[CaseResult]) -> None:
    """What went wrong, one line per failed check or raised case, under the table."""
    for case in cases:
        for check in case.failed_checks():
            say(console, f"[red]FAIL[/] {escape(case.label)} {escape(check.id)}: "
                          f"{escape(tables.one_line(tables.describe_check(check)))}")
        if case.status == "error":
            say(console, f"[red]ERROR[/] {escape(case.label)}: "
                          f"{escape(tables.one_line(case.error))}")


# --- swa-bench check ---------------------------------------------------------------------------


def check_table(name: str, cases: Sequence[CaseResult], compact: bool = False) -> Table:
    """One row per case, one column per check: pass / FAIL / info."""
    ids: list[str] = []
    for case in cases:
        ids += [c.id for c in case.checks if c.id not in ids]
    table = _table(f"{escape(name)}: checks{escape(_constants(cases))}")
    columns = _case_columns(cases, compact)
    for header, _ in columns:
        table.add_column(escape(header), justify="right" if header == "tokens" else "left")
    for check_id in ids:
        table.add_column(escape(_SHORT.get(check_id, check_id)))
    for case in cases:
        by_id = {c.id: c for c in case.checks}
        cells = [_OUTCOME[tables.check_outcome(by_id[i])] if i in by_id else tables.MISSING
                 for i in ids]
        if case.status == "error":
            cells = [_OUTCOME["error"]] * max(len(ids), 1)
            if not ids:
                table.add_column("result")
                ids.append("result")
        table.add_row(*[escape(cell(case)) for _, cell in columns], *cells)
    return table


def check_summary_line(cases: Sequence[CaseResult]) -> str:
    counts = tally(cases)
    verdict = overall_verdict(cases)
    head = "UNVERIFIED (no pass/fail check ran)" if verdict == "unverified" else verdict.upper()
    return (f"{head}: {tables.checks_summary(counts)}; {counts['cases']} cases, "
            f"{counts['failed']} failed, {counts['errors']} raised")


CHECK_MODES = {
    False: "checks mode: default (E1/E2 vs the full batch within the rounding envelope)",
    True: "checks mode: batch-invariant (E1/E2 vs the full batch, and E4, bitwise)",
}


def check_modes(cases: Sequence[CaseResult]) -> list[str]:
    """The lines naming the modes ``cases``' checks ran in (the default when there are none)."""
    return [CHECK_MODES[mode] for mode in sorted({c.batch_invariant for c in cases} or {False})]


def print_checks(console: Console, name: str, cases: Sequence[CaseResult]) -> None:
    print_fitted(console, lambda compact: check_table(name, cases, compact), cases)
    print_failures(console, cases)
    for line in check_modes(cases):
        say(console, line, wrap=False)
    verdict = overall_verdict(cases)
    say(console, f"[{_VERDICT_STYLE[verdict]}]{escape(check_summary_line(cases))}[/]",
        wrap=False)


def checks_json(checked: Sequence[tuple[str, str, Sequence[CaseResult]]]) -> dict[str, Any]:
    """``swa-bench check --json``: per scenario (name, file) its verdict, tallies and cases,
    each case with the mode its checks ran in."""
    scenarios = []
    for name, file, cases in checked:
        scenarios.append({
            "name": name, "file": file, "verdict": overall_verdict(cases),
            "counts": tally(cases),
            "cases": [{"case_id": c.case_id, "label": c.label, "params": c.params,
                       "status": c.status, "error": c.error,
                       "batch_invariant": c.batch_invariant,
                       "checks": [{"id": k.id, "name": k.name, "mode": k.mode,
                                   "outcome": tables.check_outcome(k), "message": k.message}
                                  for k in c.checks]} for c in cases]})
    verdicts = {s["verdict"] for s in scenarios}
    overall = next((v for v in ("error", "fail", "unverified") if v in verdicts), "pass")
    return {"verdict": overall, "scenarios": scenarios}


def report_checks(checked: Sequence[tuple[str, str, Sequence[CaseResult]]], *,
                  as_json: bool) -> int:
    """Prints the JSON document when asked; the exit code: 0 only when every scenario passed."""
    document = checks_json(checked)
    if as_json:
        print(json.dumps(document, indent=2, default=str))
    return 0 if document["verdict"] == "pass" else 1


# --- swa-bench compare -------------------------------------------------------------------------

_COMPARE_STYLE = {"regressed": "bold red", "incomparable": "bold magenta", "warning": "yellow",
                  "missing": "yellow", "improved": "green", "new": "cyan", "unchanged": "dim"}


def _delta_cell(row: ComparisonRow, path: str) -> str:
    delta = next((t for t in row.timings if t.path == path), None)
    if delta is None or delta.baseline_ms is None or delta.current_ms is None:
        return tables.MISSING
    change = "" if delta.change is None else f" {100 * delta.change:+.1f}%"
    return f"{_ms(delta.current_ms)}{change}"


def comparison_table(comparison: Comparison) -> Table:
    """Status and current median (change vs baseline) per case; reasons go under the table."""
    table = _table("swa-bench compare")
    table.add_column("case")
    table.add_column("status", no_wrap=True)
    table.add_column("reference ms", justify="right", no_wrap=True)
    table.add_column("replay ms", justify="right", no_wrap=True)
    for row in sorted_rows(comparison):
        table.add_row(escape(row.label), f"[{_COMPARE_STYLE[row.status]}]{row.status}[/]",
                      _delta_cell(row, "reference"), _delta_cell(row, "replay"))
    return table


def print_comparison(console: Console, comparison: Comparison) -> None:
    for warning in comparison.warnings:
        say(console, f"[yellow]warning:[/] {escape(warning)}")
    print_table(console, comparison_table(comparison))
    for row in sorted_rows(comparison):
        if row.status in ("unchanged", "new", "missing") or not row.reasons:
            continue
        style = _COMPARE_STYLE[row.status]
        say(console, f"[{style}]{row.status}[/] {escape(row.label)}: "
                      f"{escape('; '.join(row.reasons))}")
    style = "bold red" if comparison.failed else "bold green"
    say(console, f"[{style}]{escape(verdict_line(comparison))}[/]", wrap=False)
