"""``swa-bench run`` and ``swa-bench check``: load and expand each scenario once, run every case
(``cases.CaseRunner``), save as we go.

Every input check of every scenario (``ready``: --select matches, the device exists) runs before
any folder is claimed, then every run folder is checked and locked before the first case
(``folder.claim_for``): bad input costs no run and deletes nothing. results.json is rewritten
atomically after every case, so an interrupted sweep keeps what finished and ``--resume`` runs
only the rest.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console

from swa_bench import tool_version
from swa_bench.bench.advice import threshold_advice
from swa_bench.bench.environment import capture_environment, scenario_hash
from swa_bench.report.console import print_checks, print_run_summary, report_checks
from swa_bench.results import ResultsError, RunResults, load_results, save_results
from swa_bench.run.cases import CaseRunner, kernel_record, resolve_device
from swa_bench.run.folder import claim_for
from swa_bench.run.progress import case_progress
from swa_bench.run.shards import clear_shards, run_sharded, shard_results, worker_count
from swa_bench.scenario import Case, Scenario, ScenarioError, load_cases


@dataclass(frozen=True)
class LoadedScenario:
    """A scenario file loaded and expanded once per command."""

    path: Path
    scenario: Scenario
    cases: list[Case]


def load(path: Path, max_cases: int | None = None) -> LoadedScenario:
    return LoadedScenario(path, *load_cases(path, max_cases=max_cases))


def _loaded(items: Sequence[Path | LoadedScenario], max_cases: int | None) -> list[LoadedScenario]:
    return [i if isinstance(i, LoadedScenario) else load(Path(i), max_cases) for i in items]


def ready(item: LoadedScenario, select: str | None) -> LoadedScenario:
    """The scenario with only its --select cases, once its device is known to exist: these
    refusals (``ScenarioError``) must come before any folder is claimed, for every scenario."""
    resolve_device(item.scenario)
    if select is None:
        return item
    cases = [c for c in item.cases if c.matches(select)]
    if not cases:
        raise ScenarioError(item.path, "--select", f"no case label or id contains {select!r}")
    return dataclasses.replace(item, cases=cases)


def run_scenarios(
    scenarios: Sequence[Path | LoadedScenario], *, out: Path | None = None, resume: bool = False,
    baseline: Path | None = None, console: Console | None = None, timing: bool = True,
    select: str | None = None, overwrite: bool = False, max_cases: int | None = None,
    gpus: int = 1,
) -> int:
    """Runs every scenario; exit code 0 when every check passes, 1 otherwise (2 is the CLI's)."""
    console = console or Console()
    loaded = [ready(item, select) for item in _loaded(scenarios, max_cases)]
    extra = ["-k", select] if select else []
    code = 0
    with claim_for([i.path for i in loaded], [i.scenario for i in loaded], out=out,
                   resume=resume, overwrite=overwrite, extra_args=extra) as run_dirs:
        for item, run_dir in zip(loaded, run_dirs, strict=True):
            results = run_one(item, run_dir, resume=resume, console=console, timing=timing,
                              gpus=gpus, max_cases=max_cases)
            if results.verdict() != "pass":
                code = 1
            if baseline is not None:
                from swa_bench.run.compare import compare_command

                if compare_command(baseline, run_dir, console=console,
                                   out=run_dir / "compare.md") != 0:  # the run's own folder
                    code = 1
    return code


def refuse_other_kernels(run_dir: Path, results: RunResults, cases: Sequence[Case],
                         runner: CaseRunner) -> None:
    """A resumed run must go on with the kernels its finished cases ran: one results.json holds
    one measurement (a changed ``SWA_BENCH_*`` default would mix two). Cases recorded before
    kernels were (``None``) are not judged."""
    by_id = {case.case_id: case for case in cases}
    for done in results.cases:
        case = by_id.get(done.case_id)
        if case is None or done.kernels is None:
            continue
        now = kernel_record(case, runner.device).model_dump()
        if done.kernels.model_dump() != now:
            before = done.kernels.model_dump()
            what = ", ".join(f"{k} {before[k]} -> {now[k]}" for k in now if before[k] != now[k])
            raise ResultsError(run_dir / "results.json", "kernels",
                               f"case {done.label} ran other kernels than this run would "
                               f"({what}); resume with the same kernel settings or start a new "
                               "run")


def run_one(
    item: LoadedScenario, run_dir: Path, *, resume: bool, console: Console,
    timing: bool = True, gpus: int = 1, max_cases: int | None = None,
) -> RunResults:
    """One scenario (its cases already ``ready``) into the claimed ``run_dir``; ``gpus`` > 1
    spreads its cases over that many worker processes (``shards``), merged into the one
    results.json."""
    path, scenario, cases = item.path, item.scenario, item.cases
    runner = CaseRunner(scenario)
    digest = scenario_hash(scenario.source_text)
    run_dir.mkdir(parents=True, exist_ok=True)
    results = None
    if resume and (run_dir / "results.json").exists():
        results = load_results(run_dir)
        if results.scenario_hash != digest:
            raise ResultsError(run_dir / "results.json", "scenario_hash",
                               f"the run was made from another version of {path}; start a new run")
    if results is None:
        results = new_results(path, scenario, capture_environment(scenario.timing.threads))
    folded = shard_results(run_dir, scenario.name, digest) if resume else []
    done = {c.case_id for c in results.cases + folded if c.status != "error"}
    results.cases = list({c.case_id: c for c in results.cases + folded
                          if c.case_id in done}.values())
    if folded:  # an interrupted sharded sweep's cases: into results.json before the shards go
        results.cases.sort(key=lambda c: c.index)
        save_results(run_dir, results)
        clear_shards(run_dir)
    refuse_other_kernels(run_dir, results, cases, runner)
    todo = [c for c in cases if c.case_id not in done]
    if done:
        console.print(f"resuming {run_dir}: {len(done)} case(s) done, {len(todo)} to run")
    with case_progress(console, scenario.name, len(done) + len(todo), len(done)) as progress:
        workers = worker_count(gpus, len(todo), torch.cuda.device_count())
        if workers > 1:
            progress.start(f"{workers} workers")
            results.cases += run_sharded(
                path, max_cases, todo, run_dir, gpus, timing=timing,
                identity=(scenario.name, digest),
                on_progress=lambda n: progress.advance_to(len(done) + n),
            )
            results.cases.sort(key=lambda c: c.index)
            save_results(run_dir, results)
            clear_shards(run_dir)
            todo = []
        for case in todo:
            progress.start(case.label())
            result = runner.run_case(case, timing=timing)
            results.cases.append(result)
            results.cases.sort(key=lambda c: c.index)
            save_results(run_dir, results)
            progress.finished(result)
    if runner.gemm_tflops:
        results.environment["gemm_tflops"] = runner.gemm_tflops
    if runner.copy_gbytes_per_s:
        results.environment["copy_gbytes_per_s"] = runner.copy_gbytes_per_s
    finish(results, scenario, run_dir, console)
    return results


def new_results(path: str | Path, scenario: Scenario, environment: dict) -> RunResults:
    """A run's results before its first case: the scenario (file, hash of its text, every field
    resolved), the machine, the tool's version, the start time. ``swa-bench run`` and the
    torchrun entry (``run.parallel``) both start here."""
    return RunResults(
        swa_bench_version=tool_version(), scenario_name=scenario.name, scenario_file=str(path),
        scenario_hash=scenario_hash(scenario.source_text),
        scenario=json.loads(scenario.model_dump_json()), environment=environment,
        started_at=_now(),
    )


def finish(results: RunResults, scenario: Scenario, run_dir: Path, console: Console) -> None:
    """A run's end, whoever ran its cases: the trim-threshold advice, the finish time,
    results.json and the reports written, the summary printed."""
    from swa_bench.report import append_step_summary, write_reports

    results.threshold_advice = threshold_advice(results.cases, scenario.model_args().window)
    results.finished_at = _now()
    save_results(run_dir, results)
    write_reports(run_dir)
    append_step_summary(run_dir)
    print_run_summary(console, results, run_dir)


def check_scenarios(
    scenarios: Sequence[Path | LoadedScenario], *, console: Console | None = None,
    max_cases: int | None = None, as_json: bool = False,
) -> int:
    """Runs only the checks: a progress bar, then a pass/fail table and a summary line per
    scenario (or, with ``as_json``, one JSON document on stdout). Exit 1 unless all pass."""
    console = console or Console()
    checked = []
    for item in _loaded(scenarios, max_cases):
        runner = CaseRunner(item.scenario)
        results = []
        with case_progress(console, item.scenario.name, len(item.cases)) as progress:
            for case in item.cases:
                progress.start(case.label())
                results.append(runner.run_case(case, timing=False))
                progress.finished(results[-1])
        if not as_json:
            print_checks(console, item.scenario.name, results)
        checked.append((item.scenario.name, str(item.path), results))
    return report_checks(checked, as_json=as_json)


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
