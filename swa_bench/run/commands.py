"""``swa-bench run`` and ``swa-bench check``: load and expand each scenario once, run every case
(``cases.CaseRunner``), save as we go.

results.json is rewritten atomically after every case, so an interrupted sweep keeps what finished
and ``--resume`` runs only the rest.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from swa_bench.bench.advice import threshold_advice
from swa_bench.bench.environment import capture_environment, scenario_hash
from swa_bench.results import ResultsError, RunResults, load_results, save_results
from swa_bench.run.cases import CaseRunner
from swa_bench.scenario import Case, Scenario, ScenarioError, expand_cases, load_scenario


def latency_table(results: RunResults) -> Table:
    table = Table(title=f"{results.scenario_name}: latency", title_justify="left")
    for col in ("tokens", "mode", "policy", "threshold", "reference ms", "replay ms", "speedup",
                "ideal", "efficiency", "checks"):
        left = col in ("mode", "policy", "checks")
        table.add_column(col, justify="left" if left else "right", no_wrap=True)
    for case in results.cases:
        t = case.timing
        ref = f"{t.reference.median_ms:.3f}" if t and t.reference else "-"
        rep = f"{t.replay.median_ms:.3f}" if t and t.replay else "-"
        if t and ((t.reference and t.reference.noisy) or (t.replay and t.replay.noisy)):
            rep += " ~"
        failed = case.failed_checks()
        if case.status == "error":
            verdict = f"[red]error: {(case.error or '').splitlines()[0][:60]}[/red]"
        elif failed:
            verdict = "[red]FAIL " + ",".join(c.id for c in failed) + "[/red]"
        else:
            verdict = f"[green]pass[/green] ({len(case.checks)})"
        table.add_row(
            str(case.tokens), case.graph_mode, case.policy, str(case.trim_threshold), ref, rep,
            _fmt(case.speedup, "x"), _fmt(case.ideal_speedup, "x"), _fmt(case.efficiency, "", 0.01),
            verdict,
        )
    return table


def _fmt(value: float | None, suffix: str, scale: float = 1.0) -> str:
    if value is None:
        return "-"
    return f"{value / scale:.0f}%" if scale != 1.0 else f"{value:.2f}{suffix}"


def run_dir_for(scenario: Scenario, out: Path | None, resume: bool, several: bool) -> Path:
    """``--out`` names the run folder (one per scenario under it when several); otherwise
    reports/<name>-<UTC time>, or with --resume the newest such folder."""
    if out is not None:
        return out / scenario.name if several else out
    root = Path("reports")
    if resume:
        previous = sorted(root.glob(f"{scenario.name}-*/results.json"))
        if previous:
            return previous[-1].parent
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return root / f"{scenario.name}-{stamp}"


@dataclass(frozen=True)
class LoadedScenario:
    """A scenario file loaded and expanded once per command."""

    path: Path
    scenario: Scenario
    cases: list[Case]


def load(path: Path) -> LoadedScenario:
    scenario = load_scenario(path)
    return LoadedScenario(path, scenario, expand_cases(scenario))


def _loaded(items: Sequence[Path | LoadedScenario]) -> list[LoadedScenario]:
    return [i if isinstance(i, LoadedScenario) else load(Path(i)) for i in items]


def run_scenarios(
    scenarios: Sequence[Path | LoadedScenario], *, out: Path | None = None, resume: bool = False,
    baseline: Path | None = None, console: Console | None = None, timing: bool = True,
    select: str | None = None,
) -> int:
    """Runs every scenario; exit code 0 when every check passes, 1 otherwise (2 is the CLI's)."""
    console = console or Console()
    loaded = _loaded(scenarios)
    code = 0
    for item in loaded:
        run_dir = run_dir_for(item.scenario, out, resume, len(loaded) > 1)
        results = run_one(item, run_dir, resume=resume, console=console, timing=timing,
                          select=select)
        if results.verdict() != "pass":
            code = 1
        if baseline is not None:
            from swa_bench.compare import compare_command

            if compare_command(baseline, run_dir, console=console) != 0:
                code = 1
    return code


def run_one(
    item: LoadedScenario, run_dir: Path, *, resume: bool, console: Console,
    timing: bool = True, select: str | None = None,
) -> RunResults:
    from swa_bench.report import write_reports

    path, scenario, cases = item.path, item.scenario, item.cases
    runner = CaseRunner(scenario)
    if select is not None:
        cases = [c for c in cases if select in c.label() or select in c.case_id]
        if not cases:
            raise ScenarioError(path, "--select", f"no case label or id contains {select!r}")
    digest = scenario_hash(scenario.source_text)
    run_dir.mkdir(parents=True, exist_ok=True)
    results = None
    if resume and (run_dir / "results.json").exists():
        results = load_results(run_dir)
        if results.scenario_hash != digest:
            raise ResultsError(run_dir / "results.json", "scenario_hash",
                               f"the run was made from another version of {path}; start a new run")
    if results is None:
        results = RunResults(
            scenario_name=scenario.name, scenario_file=str(path), scenario_hash=digest,
            scenario=json.loads(scenario.model_dump_json()),
            environment=capture_environment(scenario.timing.threads),
            started_at=_now(),
        )
    done = {c.case_id for c in results.cases if c.status != "error"}
    results.cases = [c for c in results.cases if c.case_id in done]
    todo = [c for c in cases if c.case_id not in done]
    if done:
        console.print(f"resuming {run_dir}: {len(done)} case(s) done, {len(todo)} to run")
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(scenario.name, total=len(todo))
        for case in todo:
            progress.update(task, description=f"{scenario.name}: {case.label()}")
            results.cases.append(runner.run_case(case, timing=timing))
            results.cases.sort(key=lambda c: c.index)
            save_results(run_dir, results)
            progress.advance(task)
    results.threshold_advice = threshold_advice(results.cases, scenario.model_args().window)
    results.finished_at = _now()
    save_results(run_dir, results)
    write_reports(run_dir)
    table = latency_table(results)
    if not console.is_terminal:
        console.width = max(console.width, 160)
    console.print(table)
    for advice in results.threshold_advice:
        value = advice.recommended_trim_threshold
        console.print(f"recommended trim_threshold for {advice.graph_mode} / {advice.batch}: "
                      f"{value if value is not None else 'none (replay never won)'}"
                      f"  [dim]({advice.note})[/dim]")
    counts = results.counts()
    console.print(f"{results.verdict().upper()}: {counts['checks_passed']}/{counts['checks']} "
                  f"checks passed, {counts['errors']} case error(s); results in {run_dir}")
    return results


def check_scenarios(
    scenarios: Sequence[Path | LoadedScenario], *, console: Console | None = None
) -> int:
    """Runs only the checks and prints a pass/fail table with diagnostics."""
    console = console or Console()
    code = 0
    for item in _loaded(scenarios):
        scenario = item.scenario
        runner = CaseRunner(scenario)
        table = Table(title=f"{scenario.name}: checks", title_justify="left")
        for col in ("case", "check", "mode", "result", "diagnostics"):
            table.add_column(col)
        for case in item.cases:
            result = runner.run_case(case, timing=False)
            if result.status == "error":
                code = 1
                table.add_row(case.label(), "-", "-", "[red]error[/red]", result.error or "")
            for check in result.checks:
                if not check.passed:
                    code = 1
                verdict = "[green]pass[/green]" if check.passed else "[red]FAIL[/red]"
                table.add_row(case.label(), check.id, check.mode, verdict, check.message)
        console.print(table)
    return code


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
