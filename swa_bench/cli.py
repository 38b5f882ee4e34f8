"""The ``swa-bench`` command line.

This module parses arguments and maps errors to exit codes, once (``_OneLineErrors``); the
command bodies live under ``swa_bench.run`` (and ``report``, ``compare``), imported lazily, so
``validate`` needs nothing beyond the scenario package. Bad input is one line on stderr and exit
code 2 (``FILE: path.to.field: message``), never a traceback, reported before any work starts.
"""

from __future__ import annotations

import difflib
import errno
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table
from typer.core import TyperGroup

from swa_bench.scenario import (
    MAX_CASES,
    MAX_CASES_LIMIT,
    Case,
    Scenario,
    ScenarioError,
    default_scenario_path,
    load_cases,
    resolve_scenario_path,
    shipped_scenarios,
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

* `swa-bench list`: the shipped scenarios and model presets.
* `swa-bench validate scenarios/*.yaml`: check scenario files, count their sweep cases.
* `swa-bench run --dry-run`: list the cases of the smoke scenario; runs nothing.
* `swa-bench run threshold-sweep --out reports/ts`: time and verify each case.
* `swa-bench check smoke`: only the equivalence checks E1-E5.
* `swa-bench report reports/ts`: Markdown, HTML and JUnit reports of a run.
* `swa-bench compare reports/base reports/ts`: gate a run against a baseline.

A scenario is a YAML file or the name of a shipped one. Bad input exits 2 with one line:
`FILE: path.to.field: message`, before any work.
"""



# click >= 8.2 raises this for a bare `swa-bench`; it must still print the help.
_NoArgsIsHelp = getattr(click_exceptions, "NoArgsIsHelpError", ())


class _OneLineErrors(TyperGroup):
    """Every error a user can cause as one stderr line and its exit code, in one place: usage
    errors (unknown flag, bad flag value) and bad input from a command body (``_user_errors``)
    exit 2, an interrupted run 130. CI logs and wrappers grep for that one line."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except _NoArgsIsHelp as err:  # typer's rich help has printed itself; plain click's not
            text = err.format_message()
            if text.strip():
                typer.echo(text)
            sys.exit(0)
        except click_exceptions.UsageError as err:
            where = err.ctx.command_path if err.ctx is not None else "swa-bench"
            _say_error(f"{where}: {err.format_message()} (see --help)")
            sys.exit(err.exit_code)
        except click_exceptions.ClickException as err:
            _say_error(f"swa-bench: {err.format_message()}")
            sys.exit(err.exit_code)
        except _user_errors() as err:
            _say_error(str(err))
            sys.exit(getattr(err, "code", 2))
        except _interrupted() as err:
            _say_error(str(err))
            sys.exit(130)
        except (typer.Abort, KeyboardInterrupt):  # Ctrl-C outside a run: nothing to keep
            _say_error("swa-bench: interrupted")
            sys.exit(130)
        except BrokenPipeError:  # `swa-bench ... | head`: the reader left; say nothing more
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(1)
        except OSError as err:
            if err.errno != errno.ENAMETOOLONG:  # a path no file system holds: bad input
                raise
            _say_error(f"{err.filename}: cannot use it ({err.strerror})")
            sys.exit(2)
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

def _version(value: bool) -> None:
    if value:
        from swa_bench import tool_version

        typer.echo(f"swa-bench {tool_version()}")
        raise typer.Exit(0)


@app.callback()
def main(
    show_version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True,
                           help="Print the version and exit.")
    ] = False,
) -> None:
    pass


ScenarioFiles = Annotated[
    list[Path], typer.Argument(help="Scenario YAML files or shipped scenario names.",
                               show_default=False)
]
MaxCases = Annotated[
    int, typer.Option("--max-cases", min=1, max=MAX_CASES_LIMIT,
                      help="Refuse sweeps that expand to more cases.")
]


def _user_errors() -> tuple[type[Exception], ...]:
    """Exceptions that mean bad input (exit 2, or a ``CommandError``'s code): ScenarioError,
    ResultsError for run directories, RunFolderError for output folders, CommandError for what
    a command body refuses. Imported only when an error is being mapped."""
    from swa_bench.results import ResultsError
    from swa_bench.run.errors import CommandError
    from swa_bench.run.folder import RunFolderError

    return (ScenarioError, ResultsError, RunFolderError, CommandError)


def _interrupted() -> type[Exception]:
    from swa_bench.run.folder import Interrupted

    return Interrupted


def _say_error(line: str) -> None:
    typer.echo(" ".join(line.split()), err=True)


def _load(path: Path, max_cases: int = MAX_CASES) -> tuple[Scenario, list[Case]]:
    return load_cases(path, max_cases=max_cases)


def _unknown_name(path: Path) -> str | None:
    """The error line for a bare name that is neither a file nor a shipped scenario, naming the
    closest shipped ones (``smok``: smoke); None for anything else."""
    if path.suffix or len(path.parts) != 1 or path.exists():
        return None
    shipped = list(shipped_scenarios())
    close = difflib.get_close_matches(path.name, shipped, n=3, cutoff=0.5)
    hint = (f"did you mean {' or '.join(close)}?" if close
            else f"shipped: {', '.join(shipped)} (swa-bench list)")
    return f"{path}: no such file or shipped scenario; {hint}"


def _load_all(paths: list[Path], max_cases: int = MAX_CASES
              ) -> list[tuple[Path, Scenario, list[Case]]]:
    """Every file is loaded (and every error printed) before anything runs; exit 2 on any."""
    loaded, failed = [], False
    for path in paths:
        if (unknown := _unknown_name(path)) is not None:
            _say_error(unknown)
            failed = True
            continue
        try:
            loaded.append((path, *_load(path, max_cases)))
        except ScenarioError as err:
            _say_error(str(err))
            failed = True
        except Exception as err:  # a bug tripped by odd input still gets one line
            _say_error(f"{path}: cannot load ({type(err).__name__}: {err})")
            failed = True
    if failed:
        raise typer.Exit(2)
    return loaded


def _check_environment() -> None:
    """Exit 2 with one line on a malformed ``SWA_BENCH_*`` kernel setting (the default of a
    scenario's ``kernels:`` section), before anything runs (it would otherwise fail every
    case)."""
    from swa_bench.engine.config import kernel_settings_from_environment

    try:
        kernel_settings_from_environment()
    except ValueError as err:
        _say_error(f"environment: {err}")
        raise typer.Exit(2) from None


def _require(path: Path | None, what: str) -> None:
    """Exit 2 with one line unless ``path`` (when given) exists."""
    if path is not None and not path.exists():
        _say_error(f"{path}: no such {what}")
        raise typer.Exit(2)


def _resolve(paths: list[Path]) -> list[Path]:
    return [resolve_scenario_path(p) for p in paths]


def _plain_console(stderr: bool = False) -> Console:
    """A console that keeps 80 columns when piped and never highlights numbers in user text."""
    return Console(stderr=stderr, highlight=False)


@app.command("list")
def list_command() -> None:
    """List the shipped scenarios (run them by name: `swa-bench run smoke`) and model presets.

    Exit codes: 0.
    """
    from swa_bench.model.args import PRESETS
    from swa_bench.report.console import print_table

    console = _plain_console()
    table = Table(title="scenarios", title_justify="left", box=None, padding=(0, 2, 0, 0))
    for column in ("name", "cases", "description"):
        table.add_column(column, overflow="fold")
    for name, path in shipped_scenarios().items():
        try:
            scenario, cases = _load(path)
            table.add_row(name, str(len(cases)), escape(scenario.description.strip()))
        except ScenarioError as err:
            table.add_row(name, "-", escape(str(err)))
    print_table(console, table)
    presets = Table(title="model presets", title_justify="left", box=None, padding=(0, 2, 0, 0))
    for column in ("preset", "layers", "dim", "window", "experts"):
        presets.add_column(column)
    for name, args in PRESETS.items():
        presets.add_row(name, str(args.n_layers), str(args.dim), str(args.window),
                        str(args.n_routed_experts))
    print_table(console, presets)


@app.command()
def validate(
    files: ScenarioFiles,
    max_cases: MaxCases = MAX_CASES,
) -> None:
    """Validate scenario files and expand their sweeps; runs nothing.

    Prints `ok  FILE  (N cases)` per good file and one error line per bad one.

    Exit codes: 0 all valid; 2 a file is invalid (one line per file on stderr).
    """
    failed = False
    for file in _resolve(files):
        if (unknown := _unknown_name(file)) is not None:
            _say_error(unknown)
            failed = True
            continue
        try:
            count = len(_load(file, max_cases)[1])
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


def _device_rate(scenario: Scenario) -> Any:
    """The estimate's constants for the device the scenario would run on (``auto``: the GPU when
    one is visible, as ``run`` resolves it)."""
    import torch

    from swa_bench.bench.estimate import CPU_RATE, GPU_RATE

    on_gpu = scenario.device == "cuda" or (scenario.device == "auto"
                                           and torch.cuda.is_available())
    return GPU_RATE if on_gpu else CPU_RATE


def _estimate(case: Case, rate: Any) -> Any:
    """``bench.estimate.estimate_case`` for one case: its enabled checks and timing settings."""
    from swa_bench.bench.estimate import CHECK_NAMES, estimate_case

    sc = case.scenario
    checks = sum(getattr(sc.checks, name).enabled for name in CHECK_NAMES)
    return estimate_case(case.model_args(), case.requests(), checks_enabled=checks,
                         timing_enabled=sc.timing.enabled, warmup=sc.timing.warmup,
                         iters=sc.timing.iters, rate=rate)


def cases_table(path: Path, scenario: Scenario, cases: list[Case]) -> Table:
    """The dry-run view of one scenario: a row per case with its swept values, its size and its
    estimated duration (``bench.estimate``), whose basis the caption names."""
    from swa_bench.bench.estimate import CHECK_STEPS, format_duration

    rate = _device_rate(scenario)
    estimates = [_estimate(case, rate) for case in cases]
    total = format_duration(sum(e.seconds for e in estimates))
    swept = list(cases[0].params) if cases else []
    table = Table(title=f"{scenario.name} ({path}): {len(cases)} case{'s' * (len(cases) != 1)}, "
                        f"about {total}", title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("case", no_wrap=True, min_width=10)
    table.add_column("label", no_wrap=True)
    leaves = [p.rsplit(".", 1)[-1] for p in swept]
    for param, leaf in zip(swept, leaves, strict=True):
        table.add_column(leaf if leaves.count(leaf) == 1 else param, no_wrap=True)
    table.add_column("tokens", justify="right")
    table.add_column("requests", justify="right")
    table.add_column("est.", justify="right", no_wrap=True)
    for case, guess in zip(cases, estimates, strict=True):
        values = [str(case.params[p]) for p in swept]
        table.add_row(str(case.index), case.case_id, case.label(), *values,
                      str(case.num_tokens()), str(case.num_requests()),
                      format_duration(guess.seconds))
    table.caption = (f"est.: estimated duration, {rate.basis}: the full step's FLOPs (FLOP model) "
                     f"at that rate plus the layers' overhead, times 2 x (warmup + iters) timed "
                     f"steps and {CHECK_STEPS} per enabled check; imports not counted; a factor "
                     f"of 3 either way")
    table.caption_justify = "left"
    return table


@app.command()
def run(
    scenarios: Annotated[
        list[Path] | None,
        typer.Argument(help="Scenario YAML files or shipped names (default: smoke).",
                       show_default=False),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the expanded cases and run nothing.")
    ] = False,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="The run folder (default: reports/NAME-UTCTIME; with "
                                   "several scenarios, one folder per name under --out).",
                     show_default=False),
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Keep cases already finished in --out; run the rest.")
    ] = False,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace an earlier run in --out (its results "
                                               "are deleted).")
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
    max_cases: MaxCases = MAX_CASES,
    gpus: Annotated[
        int, typer.Option("--gpus", min=1,
                          help="Spread each scenario's cases over N worker processes, one per "
                               "visible GPU (on a CPU machine N processes share the cores); one "
                               "results.json, --resume keeps every finished case.")
    ] = 1,
) -> None:
    """Run scenarios: checks, timing and FLOPs of every case, saved under --out.

    With no scenario, runs the shipped smoke scenario. Every file, --out and --baseline are
    checked before anything runs; a folder holding another run is refused (--resume,
    --overwrite or another --out). Ctrl-C keeps the finished cases and prints the command that
    resumes. CPU timing uses one thread unless OMP_NUM_THREADS or timing.threads says otherwise.

    Exit codes: 0 every check passed; 1 a check failed, a case raised, no pass/fail check ran,
    or --baseline regressed; 2 bad input or an unusable folder (one line on stderr); 130
    interrupted.
    """
    paths = _resolve(scenarios) if scenarios else [default_scenario_path()]
    loaded = _load_all(paths, max_cases)
    _check_environment()
    if resume and overwrite:  # refused with --dry-run too: it must say what the run would do
        _say_error("swa-bench run: --resume and --overwrite contradict each other; pick one")
        raise typer.Exit(2)
    if dry_run:
        from swa_bench.report.console import print_table

        console = Console()
        for path, scenario, cases in loaded:
            table = cases_table(path, scenario, cases)
            if not console.is_terminal:  # a log or a pipe: never wrap the case ids
                wide = console.options.update_width(10_000)
                console.width = max(console.width, Measurement.get(console, wide, table).maximum)
            print_table(console, table)
        return
    for path, scenario, _ in loaded:
        layout = scenario.parallel.layout()
        if layout.parallel:
            _say_error(f"{path}: parallel: dp x tp = {layout.world_size} processes; run it with "
                       f"python -m swa_bench.run.parallel {path} (it starts the "
                       f"{layout.world_size} ranks under torchrun's launcher)")
            raise typer.Exit(2)
    from swa_bench.results import load_results
    from swa_bench.run.folder import check_target

    if baseline is not None:
        load_results(baseline)  # a corrupt baseline is bad input now, not a regression later
    if out is not None:
        check_target(out)
    from swa_bench.run.commands import LoadedScenario, run_scenarios

    try:
        with _default_threads():
            code = run_scenarios([LoadedScenario(*item) for item in loaded], out=out,
                                 resume=resume, overwrite=overwrite, baseline=baseline,
                                 select=select, max_cases=max_cases, gpus=gpus,
                                 console=Console())
    except OSError as err:  # a full disk: results.json still holds the last finished case
        where = f"{err.filename}: " if err.filename else ""
        _say_error(f"swa-bench run: {where}cannot write: {err.strerror or err}")
        raise typer.Exit(2) from None
    raise typer.Exit(code)


def _default_threads() -> Any:
    """One CPU thread for the whole command unless OMP_NUM_THREADS says otherwise: checks and
    timing stay steady when other jobs share the machine. Restored afterwards."""
    from swa_bench.bench.timing import num_threads

    return num_threads(None)


@app.command()
def check(
    files: ScenarioFiles,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the results as JSON on stdout (progress on "
                                          "stderr).")
    ] = False,
    max_cases: MaxCases = MAX_CASES,
) -> None:
    """Run only the equivalence checks of each case (E1-E5, approximation bounds); no timing.

    Prints a progress bar, a table with one column per check (pass, FAIL, or info: measured, not
    judged), the failures with their worst tensor, and a summary line.

    Exit codes: 0 every check passed; 1 a check failed, a case raised, or no pass/fail check
    ran; 2 bad input (one line on stderr).
    """
    loaded = _load_all(_resolve(files), max_cases)
    _check_environment()
    from swa_bench.run.commands import LoadedScenario, check_scenarios

    with _default_threads():
        code = check_scenarios([LoadedScenario(*item) for item in loaded],
                               console=Console(stderr=as_json), as_json=as_json)
    raise typer.Exit(code)


@app.command()
def report(
    run_dir: Annotated[
        Path, typer.Argument(help="A run directory, or its results.json.", show_default=False)
    ],
) -> None:
    """Write report.md, report.html and junit.xml of a finished run; print their paths.

    Exit codes: 0 written; 2 no readable results, or the folder cannot be written.
    """
    _require(run_dir, "run directory")
    from swa_bench.report import write_reports

    for path in write_reports(run_dir):
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
        typer.Option("--out", help="Markdown table file (default: CURRENT/compare.md, "
                                   "written there only when the gate passes).",
                     show_default=False),
    ] = None,
    no_timing: Annotated[
        bool, typer.Option("--no-timing", help="Report timing changes but never fail on them "
                                               "(noisy shared runners).")
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the comparison as JSON on stdout.")
    ] = False,
    allow_config_change: Annotated[
        bool, typer.Option("--allow-config-change",
                           help="Compare cases that ran other kernels as an A/B (warned about) "
                                "instead of failing on them.")
    ] = False,
) -> None:
    """Compare a run with a baseline; exit 1 on a regression.

    A regression is a check that now fails, a changed deterministic figure (FLOPs, kept rows), a
    significant median slowdown beyond --max-slowdown and beyond the noise of the two runs
    (their own spreads; on a CPU a slowdown both timed paths share only warns), or a timing
    that is not a finite number. Missing and
    new cases are reported; two runs with no case in common fail (nothing was compared). Cases
    that ran other kernels (backend, tile, launch mode) are not comparable and fail, unless
    --allow-config-change accepts them as an A/B comparison. With GITHUB_STEP_SUMMARY set, the
    markdown table is appended there.

    Exit codes: 0 no regression; 1 a regression, cases that ran other kernels, or nothing
    compared; 2 bad input (one line on stderr).
    """
    from swa_bench.run.compare import compare_command

    raise typer.Exit(compare_command(baseline, current, max_slowdown=max_slowdown, out=out,
                                     gate_timing=not no_timing, console=_plain_console(),
                                     as_json=as_json,
                                     allow_config_change=allow_config_change))


@app.command()
def export(
    run_dir: Annotated[
        Path, typer.Argument(help="A run directory, or its results.json.", show_default=False)
    ],
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Write the JSON here instead of stdout.", show_default=False),
    ] = None,
) -> None:
    """Export the medians as github-action-benchmark's `customSmallerIsBetter` JSON.

    One entry per case and timed path, in ms, with p10–p90 as the range. Feed the file to
    `benchmark-action/github-action-benchmark` with `tool: customSmallerIsBetter`. A median that
    is not a finite number is left out, with a warning on stderr. --out may not name a run's
    results or reports.

    Exit codes: 0 written; 2 no readable results, or --out cannot be written.
    """
    from swa_bench.run.export import export_command

    text = export_command(run_dir, out, warn=_say_error)
    if text is not None:
        typer.echo(text, nl=False)


@app.command()
def kernels(
    tokens: Annotated[
        list[int] | None,
        typer.Option("--tokens", "-t", min=1, help="Rows of the prefill (repeat for several; "
                     "default 16384 on a GPU, 48 on a CPU).", show_default=False),
    ] = None,
    preset: Annotated[
        str | None,
        typer.Option("--preset", help="Model preset whose H, D, W, top-k set the shapes "
                     "(default v41-flash on a GPU, tiny on a CPU).", show_default=False),
    ] = None,
    problem: Annotated[
        list[str] | None,
        typer.Option("--problem", "-p", help="window, compressed, dense or sparse (repeat; "
                     "default all).", show_default=False),
    ] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="bfloat16 or float32.")] = "bfloat16",
    sweep: Annotated[
        bool, typer.Option("--sweep", help="Time the Triton kernel under each candidate tile.")
    ] = False,
    iters: Annotated[int, typer.Option("--iters", min=1, help="Timed calls per figure.")] = 5,
    as_json: Annotated[bool, typer.Option("--json", help="Print the figures as JSON.")] = False,
) -> None:
    """Benchmark the attention kernels against their PyTorch paths: ms, TFLOP/s, GB/s, % of
    roofline (the measured GEMM rate and copy bandwidth of this device).

    The Triton kernels run on CUDA (or on CPU with TRITON_INTERPRET=1, slowly); elsewhere only
    the PyTorch path is timed. Exit codes: 0 done; 2 bad option.
    """
    from swa_bench.run.kernels import KernelRun

    planned = KernelRun.from_options(tokens, preset, problem, dtype)
    _check_environment()
    planned.run(sweep=sweep, iters=iters, as_json=as_json, console=_plain_console(stderr=as_json))
