"""The ``swa-bench`` command line.

Commands that act on results (run, check, report, compare) import their implementation lazily, so
``validate`` needs nothing beyond the scenario package. Bad input is one line on stderr and exit
code 2 (``FILE: path.to.field: message``), never a traceback, reported before any work starts.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from typer.core import TyperGroup

from swa_bench.scenario import (
    Case,
    Scenario,
    ScenarioError,
    default_scenario_path,
    expand_cases,
    load_scenario,
)

try:  # typer >= 0.25 vendors click; before, it uses the click package
    from typer._click import exceptions as click_exceptions
except ImportError:
    from click import exceptions as click_exceptions

TOUR = """\
Benchmark and verify decoder-side SWA bounded replay, the prefill optimisation of
DeepSeek-V4.1-style models: after the last KV-source layer, decoder layers run only on each
request's kept rows.

A short tour:

* `swa-bench validate scenarios/*.yaml`: check scenario files, count their sweep cases.
* `swa-bench run --dry-run`: list the cases of the smoke scenario; runs nothing.
* `swa-bench run scenarios/threshold-sweep.yaml --out reports/ts`: time and verify each case.
* `swa-bench check scenarios/smoke.yaml`: only the equivalence checks E1-E5.
* `swa-bench report reports/ts`: Markdown, HTML and JUnit reports of a run.
* `swa-bench compare reports/base reports/ts`: gate a run against a baseline.

Bad input exits 2 with one line: `FILE: path.to.field: message`.
"""


# click >= 8.2 raises this for a bare `swa-bench`; it must still print the help.
_NoArgsIsHelp = getattr(click_exceptions, "NoArgsIsHelpError", ())


class _OneLineErrors(TyperGroup):
    """Usage errors (unknown flag, bad flag value) as one stderr line with exit 2, like scenario
    errors, instead of a multi-line panel: CI logs and wrappers grep for that one line."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except _NoArgsIsHelp:
            return super().main(*args, standalone_mode=True, **kwargs)
        except click_exceptions.UsageError as err:
            where = err.ctx.command_path if err.ctx is not None else "swa-bench"
            _say_error(f"{where}: {err.format_message()} (see --help)")
            sys.exit(err.exit_code)
        except click_exceptions.ClickException as err:
            _say_error(f"swa-bench: {err.format_message()}")
            sys.exit(err.exit_code)
        except KeyboardInterrupt:
            _say_error("swa-bench: interrupted (finished cases are kept; --resume continues)")
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(
    cls=_OneLineErrors,
    name="swa-bench",
    help=TOUR,
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="markdown",
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

ScenarioFiles = Annotated[
    list[Path], typer.Argument(help="Scenario YAML files.", show_default=False)
]


def _user_errors() -> tuple[type[Exception], ...]:
    """Exceptions that mean bad input: ScenarioError, and ResultsError for run directories."""
    from swa_bench.results import ResultsError

    return (ScenarioError, ResultsError)


def _say_error(line: str) -> None:
    typer.echo(" ".join(line.split()), err=True)


def _load(path: Path) -> tuple[Scenario, list[Case]]:
    scenario = load_scenario(path)
    return scenario, expand_cases(scenario)


def _load_all(paths: list[Path]) -> list[tuple[Path, Scenario, list[Case]]]:
    """Every file is loaded (and every error printed) before anything runs; exit 2 on any."""
    loaded, failed = [], False
    for path in paths:
        try:
            loaded.append((path, *_load(path)))
        except ScenarioError as err:
            _say_error(str(err))
            failed = True
    if failed:
        raise typer.Exit(2)
    return loaded


def _require(path: Path | None, what: str) -> None:
    """Exit 2 with one line unless ``path`` (when given) exists."""
    if path is not None and not path.exists():
        _say_error(f"{path}: no such {what}")
        raise typer.Exit(2)


@app.command()
def validate(files: ScenarioFiles) -> None:
    """Validate scenario files and expand their sweeps; runs nothing.

    Prints `ok  FILE  (N cases)` per good file and one error line per bad one (exit 2).
    """
    failed = False
    for file in files:
        try:
            count = len(_load(file)[1])
        except ScenarioError as err:
            _say_error(str(err))
            failed = True
            continue
        except Exception as err:  # a bug tripped by odd input still gets one line, not a traceback
            _say_error(f"{file}: cannot validate ({type(err).__name__}: {err})")
            failed = True
            continue
        typer.echo(f"ok  {file}  ({count} case{'' if count == 1 else 's'})")
    if failed:
        raise typer.Exit(2)


def cases_table(path: Path, scenario: Scenario, cases: list[Case]) -> Table:
    """The dry-run view of one scenario: a row per case with its swept values and its size."""
    swept = list(cases[0].params) if cases else []
    table = Table(title=f"{scenario.name} ({path}): {len(cases)} case{'s' * (len(cases) != 1)}",
                  title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("case", no_wrap=True, min_width=10)
    table.add_column("label", no_wrap=True)
    leaves = [p.rsplit(".", 1)[-1] for p in swept]
    for param, leaf in zip(swept, leaves, strict=True):
        table.add_column(leaf if leaves.count(leaf) == 1 else param, no_wrap=True)
    table.add_column("tokens", justify="right")
    table.add_column("requests", justify="right")
    for case in cases:
        values = [str(case.params[p]) for p in swept]
        table.add_row(str(case.index), case.case_id, case.label(), *values,
                      str(case.num_tokens()), str(len(case.requests())))
    return table


@app.command()
def run(
    scenarios: Annotated[
        list[Path] | None,
        typer.Argument(help="Scenario YAML files (default: scenarios/smoke.yaml).",
                       show_default=False),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the expanded cases and run nothing.")
    ] = False,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="The run folder (default: reports/<scenario>-<UTC time>).",
                     show_default=False),
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Keep cases already finished in --out; run the rest.")
    ] = False,
    select: Annotated[
        str | None,
        typer.Option("--select", "-k", help="Run only the cases whose label or id contains this.",
                     show_default=False),
    ] = None,
    baseline: Annotated[
        Path | None,
        typer.Option("--baseline", help="An earlier run (directory or results.json) to gate "
                                        "against; regressions exit 1.", show_default=False),
    ] = None,
) -> None:
    """Run scenarios: checks, timing and FLOPs of every case, saved under --out.

    With no scenario file, runs the smoke scenario. Every file is validated before anything runs.
    """
    paths = scenarios or [default_scenario_path()]
    loaded = _load_all(paths)
    if dry_run:
        console = Console()
        for path, scenario, cases in loaded:
            table = cases_table(path, scenario, cases)
            if not console.is_terminal:  # a log or a pipe: never wrap the case ids
                wide = console.options.update_width(10_000)
                console.width = max(console.width, Measurement.get(console, wide, table).maximum)
            console.print(table)
        return
    _require(baseline, "baseline")
    if out is not None and out.exists() and not out.is_dir():
        _say_error(f"{out}: --out exists and is not a directory")
        raise typer.Exit(2)
    from swa_bench.run.commands import LoadedScenario, run_scenarios

    try:
        code = run_scenarios([LoadedScenario(*item) for item in loaded], out=out, resume=resume,
                             baseline=baseline, select=select,
                             console=Console())
    except _user_errors() as err:
        _say_error(str(err))
        raise typer.Exit(2) from None
    raise typer.Exit(code)


@app.command()
def check(files: ScenarioFiles) -> None:
    """Run only the equivalence checks of each case (E1-E5, approximation bounds); no timing.

    Exit 1 when a check fails.
    """
    loaded = _load_all(files)
    from swa_bench.run.commands import LoadedScenario, check_scenarios

    try:
        code = check_scenarios([LoadedScenario(*item) for item in loaded], console=Console())
    except _user_errors() as err:
        _say_error(str(err))
        raise typer.Exit(2) from None
    raise typer.Exit(code)


@app.command()
def report(
    run_dir: Annotated[
        Path, typer.Argument(help="A run directory, or its results.json.", show_default=False)
    ],
) -> None:
    """Write report.md, report.html and junit.xml of a finished run; print their paths."""
    _require(run_dir, "run directory")
    from swa_bench.report import write_reports

    try:
        written = write_reports(run_dir)
    except _user_errors() as err:
        _say_error(str(err))
        raise typer.Exit(2) from None
    for path in written:
        typer.echo(str(path))


@app.command()
def compare(
    baseline: Annotated[
        Path, typer.Argument(help="Baseline run directory or results.json.", show_default=False)
    ],
    current: Annotated[
        Path, typer.Argument(help="Current run directory or results.json.", show_default=False)
    ],
    max_slowdown: Annotated[
        float, typer.Option("--max-slowdown", min=0.0,
                            help="Largest tolerated median slowdown (0.05 = 5%).")
    ] = 0.05,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Markdown table file (default: CURRENT/compare.md).",
                     show_default=False),
    ] = None,
    no_timing: Annotated[
        bool, typer.Option("--no-timing", help="Report timing changes but never fail on them "
                                               "(noisy shared runners).")
    ] = False,
) -> None:
    """Compare a run with a baseline; exit 1 on a regression.

    A regression is a check that now fails, a changed deterministic figure (FLOPs, kept rows), or
    a median slowdown beyond --max-slowdown. Missing and new cases are reported, not failed.
    """
    from swa_bench.compare import compare_command

    try:
        code = compare_command(baseline, current, max_slowdown=max_slowdown, out=out,
                               gate_timing=not no_timing, console=Console())
    except _user_errors() as err:
        _say_error(str(err))
        raise typer.Exit(2) from None
    raise typer.Exit(code)
