"""The CLI: one-line errors with exit 2 for bad input, dry runs, and hand-off to the runners.

Bad input runs in this process (``tests.invoke``, the app's own error mapping and exit codes);
a few cases per property go through ``python -m swa_bench`` in a subprocess, for what only the
real interpreter shows: its stderr, argv and exit status, and stdout at the file descriptor."""

from __future__ import annotations

import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from swa_bench.cli import app
from swa_bench.replay.row_selection import halo_size
from swa_bench.scenario import expand_cases, load_scenario
from tests import invoke

REPO = Path(__file__).resolve().parents[1]
MALFORMED = REPO / "tests" / "scenario" / "malformed"
SHIPPED = sorted((REPO / "scenarios").glob("*.yaml"))

try:  # click < 8.2 mixes stderr into stdout unless told not to
    runner = CliRunner(mix_stderr=False)
except TypeError:
    runner = CliRunner()

# (file in the malformed corpus, the field its error must name; None for file-level errors)
CORPUS = [
    ("unknown_key.yaml", "timing.iterations"),
    ("wrong_type.yaml", "seed"),
    ("negative_length.yaml", "workload.requests.1.prompt_len"),
    ("window_zero.yaml", "model.overrides.window"),
    ("trim_threshold_le_window.yaml", "trim_threshold"),
    ("sweep_missing_field.yaml", "sweep.grid.timing.repeats"),
    ("sweep_bad_value.yaml", "sweep.grid.trim_threshold"),
    ("zip_length_mismatch.yaml", "sweep.zip[0].model.overrides.window"),
    ("bitwise_tolerance.yaml", "checks.e3.rtol"),
    ("too_long.yaml", "workload.generators.0.prompt_len"),
    ("layout_heads.yaml", "parallel.tp"),
    ("weights_missing.yaml", "model.weights"),
    ("weights_wrong_model.yaml", "model.weights"),
    ("invalid_yaml.yaml", None),
    ("empty.yaml", None),
    ("does_not_exist.yaml", None),
]


def swa_bench(*args: str) -> subprocess.CompletedProcess:
    """``python -m swa_bench ARGS`` in a fresh interpreter."""
    return subprocess.run([sys.executable, "-m", "swa_bench", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_corpus_covers_every_file():
    assert {name for name, _ in CORPUS if (MALFORMED / name).exists()} == {
        p.name for p in MALFORMED.glob("*.yaml")}


COMMANDS = [("validate",), ("run", "--dry-run")]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(("name", "field"), CORPUS)
def test_malformed_scenario_is_one_stderr_line_and_exit_2(command, name, field):
    path = f"tests/scenario/malformed/{name}"
    result = invoke.swa_bench(*command, path, cwd=REPO)
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"{path}: ")
    if field is not None:
        assert lines[0].startswith(f"{path}: {field}: ")
    assert "Traceback" not in result.stderr + result.stdout
    assert result.stdout == ""


@pytest.mark.parametrize("command", COMMANDS)
def test_malformed_scenarios_through_the_real_interpreter(command):
    """Three of the corpus in one ``python -m swa_bench``: each file's one line, in order, on the
    process's stderr, exit status 2, nothing on stdout."""
    names = ["wrong_type.yaml", "invalid_yaml.yaml", "does_not_exist.yaml"]
    paths = [f"tests/scenario/malformed/{name}" for name in names]
    result = swa_bench(*command, *paths)
    assert result.returncode == 2 and result.stdout == ""
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 3 and lines[0].startswith(f"{paths[0]}: seed: "), result.stderr
    assert all(line.startswith(f"{path}: ") for line, path in zip(lines, paths, strict=True))


def test_usage_errors_are_one_line_too():
    for args in (["run", "--bogus"], ["validate"],
                 ["compare", "a", "b", "--max-slowdown", "lots"]):
        result = invoke.swa_bench(*args)
        assert result.returncode == 2
        assert len(result.stderr.splitlines()) == 1, result.stderr
        assert result.stderr.startswith(f"swa-bench {args[0]}: ")
    real = swa_bench("run", "--bogus")  # argv through the real entry point
    assert real.returncode == 2 and real.stderr.startswith("swa-bench run: No such option")
    assert len(real.stderr.splitlines()) == 1, real.stderr


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_scenarios_validate_and_dry_run(path):
    cases = expand_cases(load_scenario(path))
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 0, result.output
    plural = "" if len(cases) == 1 else "s"
    assert result.stdout == f"ok  {path}  ({len(cases)} case{plural})\n"
    result = runner.invoke(app, ["run", "--dry-run", str(path)])
    assert result.exit_code == 0, result.output
    for case in cases:
        assert case.case_id in result.stdout
        assert case.label() in result.stdout


def test_shipped_scenarios_are_what_their_names_promise():
    by_name = {p.stem: load_scenario(p) for p in SHIPPED}
    assert {"smoke", "threshold-sweep", "batch-sweep", "approximation",
            "v41-flash-shape"} <= set(by_name)
    smoke = expand_cases(by_name["smoke"])
    assert {(c.scenario.graph_mode, c.scenario.policy) for c in smoke} == {
        (g, p) for g in ("eager", "piecewise") for p in ("bounded", "halo")} | {("full", "bounded")}
    for mode in ("eager", "piecewise"):  # the charts draw a line per mode and policy
        for policy in ("bounded", "halo"):
            assert len({c.num_tokens() for c in smoke if (c.scenario.graph_mode,
                                                          c.scenario.policy) == (mode, policy)}) > 1
    args = smoke[0].model_args()
    window = args.window
    lengths = {r.query_len for r in smoke[0].requests() if not r.decode}
    assert {window - 1, window, window + 1} <= lengths
    assert max(lengths) > halo_size(window, args.n_decoder_layers), "halo must trim too"
    assert any(r.decode for r in smoke[0].requests())
    assert any(r.cached_len and r.chunk_size for r in smoke[0].requests())
    assert by_name["smoke"].device == "auto" and by_name["smoke"].checks.approximation.enabled
    v41 = expand_cases(by_name["v41-flash-shape"])
    assert {c.num_tokens() for c in v41} == {16384, 65536}
    assert all(c.trim_threshold() == 768 and c.scenario.dtype == "bfloat16" for c in v41)
    assert not v41[0].scenario.checks.e2.enabled and not v41[0].scenario.checks.e4.enabled
    # approximation-chunks is approximation with every prompt in chunks of 4 W: the same model,
    # policies, task prompts and continuation, so the figures compare prompt for prompt
    whole, chunked = by_name["approximation"], by_name["approximation-chunks"]
    mini_window = whole.model_args().window
    assert chunked.model == whole.model and chunked.sweep == whole.sweep
    assert chunked.checks.tasks.model_dump() == {**whole.checks.tasks.model_dump(),
                                                 "chunk_size": 4 * mini_window}
    assert whole.checks.tasks.chunk_size is None
    (prompt,) = chunked.workload.prompts
    assert (prompt.length, prompt.chunk_size) == (whole.requests()[0].prompt_len,
                                                  4 * mini_window)
    assert chunked.checks.approximation == whole.checks.approximation
    threshold = expand_cases(by_name["threshold-sweep"])
    assert len(threshold) == 14 and threshold[0].trim_threshold() == 33
    assert max(c.num_tokens() for c in threshold) == 4000
    assert threshold[0].engine_config().capture_sizes[-1] == 4096


def test_validate_reports_every_file_then_exits_2():
    good, bad = str(SHIPPED[0]), str(MALFORMED / "wrong_type.yaml")
    result = runner.invoke(app, ["validate", bad, good])
    assert result.exit_code == 2
    assert result.stdout.startswith(f"ok  {good}")
    assert result.stderr.startswith(f"{bad}: seed: ")


def test_run_refuses_a_parallel_layout_with_the_torchrun_command():
    path = str(REPO / "scenarios" / "parallel-dp2.yaml")
    result = runner.invoke(app, ["run", path])
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        f"{path}: parallel: dp x tp = 2 processes; run it with python -m swa_bench.run.parallel "
        f"{path} (it starts the 2 ranks under torchrun's launcher)")


def test_run_without_scenario_dry_runs_the_smoke_scenario():
    result = runner.invoke(app, ["run", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "smoke" in result.stdout and "9 cases, about " in result.stdout


def test_dry_run_estimates_each_case_and_names_the_basis():
    """Each row ends in its estimated duration (``bench.estimate``: the same figure printed) and
    the caption says where the rate came from; the title gives the scenario's total."""
    from swa_bench.bench.estimate import CPU_RATE, format_duration
    from swa_bench.cli import _estimate

    path = REPO / "scenarios" / "threshold-sweep.yaml"
    cases = expand_cases(load_scenario(path))
    result = runner.invoke(app, ["run", "--dry-run", str(path)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    assert "CPU constants from ci/smoke-baseline.json" in text and "FLOP model" in text
    guesses = [_estimate(case, CPU_RATE) for case in cases]
    total = format_duration(sum(g.seconds for g in guesses))
    assert f"14 cases, about {total}" in text
    rows = [line for line in result.stdout.splitlines() if any(c.case_id in line for c in cases)]
    for case, guess, row in zip(cases, guesses, rows, strict=True):
        assert case.case_id in row and row.rstrip(" │").endswith(format_duration(guess.seconds))


@dataclass
class LoadedScenario:
    path: object
    scenario: object
    cases: list


@pytest.fixture
def fake_runner(monkeypatch):
    calls: list[tuple[str, tuple, dict]] = []
    module = types.ModuleType("swa_bench.run.commands")

    def run_scenarios(loaded, **kwargs):
        calls.append(("run", tuple(item.path for item in loaded), kwargs))
        return 1

    def check_scenarios(loaded, **kwargs):
        calls.append(("check", tuple(item.path for item in loaded), kwargs))
        return 0

    module.run_scenarios, module.check_scenarios = run_scenarios, check_scenarios
    module.LoadedScenario = LoadedScenario
    monkeypatch.setitem(sys.modules, "swa_bench.run.commands", module)
    return calls


def test_run_hands_validated_paths_to_the_runner(fake_runner, tmp_path):
    smoke = SHIPPED[[p.stem for p in SHIPPED].index("smoke")]
    result = runner.invoke(app, ["run", str(smoke), "--out", str(tmp_path / "o"), "--resume"])
    assert result.exit_code == 1
    ((kind, paths, kwargs),) = fake_runner
    assert (kind, paths) == ("run", (smoke,))
    assert kwargs["out"] == tmp_path / "o" and kwargs["resume"] is True
    assert kwargs["baseline"] is None and kwargs["console"] is not None


def test_run_and_check_refuse_bad_input_before_running(fake_runner, tmp_path):
    bad = str(MALFORMED / "window_zero.yaml")
    assert runner.invoke(app, ["run", bad, str(SHIPPED[0])]).exit_code == 2
    assert runner.invoke(app, ["check", bad]).exit_code == 2
    missing = runner.invoke(app, ["run", str(SHIPPED[0]), "--baseline", str(tmp_path / "x")])
    assert missing.exit_code == 2 and "no such file" in missing.stderr
    a_file = tmp_path / "f"
    a_file.write_text("keep me")
    clobber = runner.invoke(app, ["run", str(SHIPPED[0]), "--out", str(a_file)])
    assert clobber.exit_code == 2 and a_file.read_text() == "keep me"
    assert fake_runner == []


def test_check_hands_off_and_returns_its_code(fake_runner):
    result = runner.invoke(app, ["check", str(SHIPPED[0])])
    assert result.exit_code == 0
    assert fake_runner[0][:2] == ("check", (SHIPPED[0],))


def test_report_prints_written_paths(monkeypatch, tmp_path):
    module = types.ModuleType("swa_bench.report")
    module.write_reports = lambda run_dir: [run_dir / "report.md", run_dir / "junit.xml"]
    monkeypatch.setitem(sys.modules, "swa_bench.report", module)
    result = runner.invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 0
    assert result.stdout.splitlines() == [str(tmp_path / "report.md"), str(tmp_path / "junit.xml")]
    missing = runner.invoke(app, ["report", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and missing.stderr.count("\n") == 1


def test_compare_passes_its_options_through(monkeypatch, tmp_path):
    seen = {}
    module = types.ModuleType("swa_bench.run.compare")

    def compare_command(baseline, current, **kwargs):
        seen.update(kwargs, baseline=baseline, current=current)
        return 1

    module.compare_command = compare_command
    monkeypatch.setitem(sys.modules, "swa_bench.run.compare", module)
    result = runner.invoke(app, ["compare", "a", "b", "--max-slowdown", "0.1", "--no-timing",
                                 "--out", str(tmp_path / "c.md")])
    assert result.exit_code == 1
    assert (seen["baseline"], seen["current"]) == (Path("a"), Path("b"))
    assert seen["max_slowdown"] == 0.1 and seen["gate_timing"] is False
    assert seen["out"] == tmp_path / "c.md"


def test_help_gives_a_tour_and_documents_every_option():
    top = runner.invoke(app, ["--help"])
    assert top.exit_code == 0
    for command in ("validate", "run", "check", "report", "compare"):
        assert f"swa-bench {command}" in top.stdout
    options = {"run": ["--dry-run", "--out", "--resume", "--baseline"],
               "compare": ["--max-slowdown", "--out", "--no-timing"],
               "validate": [], "check": [], "report": []}
    for command, flags in options.items():
        text = runner.invoke(app, [command, "--help"], terminal_width=200).stdout
        for flag in flags:
            (line,) = [ln for ln in text.splitlines()
                       if ln.strip(" │").startswith(f"{flag} ") and "<" in ln]
            described = line.split(flag, 1)[1].strip(" │").split()
            assert len(described) > 2, f"{command} {flag} has no help text: {line!r}"


def test_user_errors_from_the_hand_off_are_one_line(monkeypatch, tmp_path):
    from swa_bench.scenario import ScenarioError

    def broken(run_dir):
        raise ScenarioError(run_dir / "results.json", "cases.0.status", "not a status")

    module = types.ModuleType("swa_bench.report")
    module.write_reports = broken
    monkeypatch.setitem(sys.modules, "swa_bench.report", module)
    result = runner.invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 2
    assert result.stderr == f"{tmp_path / 'results.json'}: cases.0.status: not a status\n"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without GPU")
def test_cuda_scenario_without_gpu_is_bad_input(tmp_path):
    out = tmp_path / "run"
    proc = invoke.swa_bench("run", "scenarios/v41-flash-shape-16k.yaml", "--out", str(out),
                            cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "scenarios/v41-flash-shape-16k.yaml: device: cuda requested but no GPU is visible"
    )
    assert not out.exists(), "nothing is written for bad input"


# --- a CLI that fits the ecosystem -----------------------------------------------------------


def test_version_list_and_bare_help():
    from importlib.metadata import version

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout.strip() == f"swa-bench {version('swa-bench')}"
    listed = runner.invoke(app, ["list"], terminal_width=200)
    assert listed.exit_code == 0
    for path in SHIPPED:
        assert path.stem in listed.stdout
    assert "tiny" in listed.stdout and "v41-flash-shape" in listed.stdout
    bare = swa_bench()
    assert bare.returncode == 0
    assert bare.stdout.count("Usage:") == 1, "the help is printed once"


def test_version_answers_without_torch_in_under_a_third_of_a_second():
    """`swa-bench --version` took 1.7 s: the CLI imports torch. Measured as the child's CPU
    time (wall time on the shared 2-core machine is mostly waiting for a core)."""
    import resource

    from swa_bench import tool_version

    probe = ("import sys; sys.argv = ['swa-bench', '--version']; "
             "from swa_bench.__main__ import main; main(); print('torch' in sys.modules)")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True, cwd=Path(__file__).parents[1])
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert proc.stdout.splitlines() == [f"swa-bench {tool_version()}", "False"]
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu < 0.3, f"--version took {cpu:.2f} s of CPU"


def test_the_licence_is_mit_in_the_file_and_the_package_metadata():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    root = Path(__file__).parents[1]
    assert (root / "LICENSE").read_text().startswith("MIT License\n")
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert project["license"] == {"text": "MIT"}
    assert "License :: OSI Approved :: MIT License" in project["classifiers"]
    assert project["scripts"]["swa-bench"] == "swa_bench.__main__:main"


def test_every_command_lists_its_exit_codes():
    for command in ("validate", "run", "check", "report", "compare", "export", "list"):
        text = " ".join(runner.invoke(app, [command, "--help"], terminal_width=200).stdout.split())
        assert "Exit codes: 0" in text, command
    run_help = runner.invoke(app, ["run", "--help"], terminal_width=200).stdout
    assert "reports/NAME-UTCTIME" in run_help and "reports/-" not in run_help


def test_shipped_scenarios_resolve_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no scenarios/ folder here: the package's copies are used
    result = runner.invoke(app, ["validate", "smoke", "threshold-sweep"])
    assert result.exit_code == 0, result.output
    assert "smoke.yaml" in result.stdout and "threshold-sweep.yaml" in result.stdout
    dry = runner.invoke(app, ["run", "--dry-run", "smoke"])
    assert dry.exit_code == 0 and "9 cases" in dry.stdout
    unknown = runner.invoke(app, ["validate", "no-such-scenario"])
    assert unknown.exit_code == 2 and "no-such-scenario: no such file" in unknown.stderr
    assert "shipped: smoke" in unknown.stderr or "smoke" in unknown.stderr


@pytest.mark.parametrize("command", [["run"], ["run", "--dry-run"], ["check"], ["validate"]])
def test_an_unknown_scenario_name_suggests_the_closest_shipped_ones(tmp_path, monkeypatch,
                                                                     command):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, [*command, "smok"])
    assert result.exit_code == 2
    assert result.stderr.strip() == ("smok: no such file or shipped scenario; did you mean "
                                     "smoke?")
    assert not list(tmp_path.iterdir()), "nothing is written for bad input"


def test_scenarios_ship_inside_the_package():
    import swa_bench

    packaged = Path(swa_bench.__file__).parent / "scenarios"
    assert sorted(p.name for p in packaged.glob("*.yaml")) == [p.name for p in SHIPPED]


TINY_CHECK = """\
name: tiny-check
device: cpu
workload: {requests: [{prompt_len: 12}, {prompt_len: 9, decode: true}]}
checks: {e2: {enabled: false}, e3: {enabled: false}, e4: {enabled: false},
         e5: {enabled: false}, approximation: {enabled: true}}
timing: {enabled: false}
"""


def test_check_json_on_stdout_with_progress_elsewhere(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY_CHECK)
    proc = swa_bench("check", "--json", str(path))
    assert proc.returncode == 0, proc.stderr
    document = __import__("json").loads(proc.stdout)
    (scenario,) = document["scenarios"]
    assert document["verdict"] == "pass" and scenario["name"] == "tiny-check"
    outcomes = [c["outcome"] for c in scenario["cases"][0]["checks"]]
    # visibility, E1, layer S+1's exact KV, the approximation
    assert outcomes == ["pass", "pass", "pass", "info"]
    assert scenario["counts"]["checks_passed"] == 3 and scenario["counts"]["checks_info"] == 1
    table = invoke.swa_bench("check", str(path))
    assert table.returncode == 0
    last = table.stdout.strip().splitlines()[-1]
    assert last.startswith("PASS: 3 of 3 checks passed (1 info results")


def test_run_appends_its_report_to_the_step_summary_and_exports(tmp_path, monkeypatch):
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY_CHECK.replace("timing: {enabled: false}",
                                       "timing: {enabled: true, warmup: 0, iters: 3}"))
    summary = tmp_path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    result = runner.invoke(app, ["run", str(path), "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    assert summary.read_text().startswith("# swa-bench: tiny-check")
    exported = runner.invoke(app, ["export", str(tmp_path / "run")])
    entries = __import__("json").loads(exported.stdout)
    assert [e["name"].rsplit("/", 1)[-1] for e in entries] == ["reference", "replay"]
    assert runner.invoke(app, ["export", str(tmp_path / "nothing")]).exit_code == 2


def test_an_interrupt_outside_a_run_is_one_line_and_130(monkeypatch):
    """typer.Abort (Ctrl-C at a prompt) and KeyboardInterrupt, through the real entry point."""
    import swa_bench.cli as cli

    for error in (typer.Abort, KeyboardInterrupt):
        def interrupted(*args, error=error, **kwargs):
            raise error()

        monkeypatch.setattr(cli, "shipped_scenarios", interrupted)
        with pytest.raises(SystemExit) as exit_info:
            app(["list"], prog_name="swa-bench")
        assert exit_info.value.code == 130


def test_a_closed_stdout_pipe_ends_quietly():
    """`swa-bench compare ... | head -1`: the reader left early; exit 1, no traceback."""
    script = ("import swa_bench.cli as cli\n"
              "def closed(*args, **kwargs):\n"
              "    raise BrokenPipeError(32, 'Broken pipe')\n"
              "cli.shipped_scenarios = closed\n"
              "cli.app(['list'], prog_name='swa-bench')\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1 and proc.stderr == "", proc.stderr


AT_80 = """\
name: tiny-at-80-columns
device: cpu
workload: {requests: [{prompt_len: 30}, {prompt_len: 9, decode: true}]}
sweep:
  grid:
    graph_mode: [eager, piecewise]
    policy: [bounded, halo]
capture_sizes: [32, 64]
checks: {e2: {enabled: false}, e3: {enabled: false}, e4: {enabled: false},
         e5: {enabled: false}}
timing: {enabled: true, warmup: 0, iters: 2, breakdown: false}
"""


def test_piped_output_at_80_columns_keeps_figures_and_words_whole(tmp_path):
    """`run` and `check` piped at COLUMNS=80: no line ends in a space, nothing is cut to '…',
    every line but the one-line verdicts and a progress line per case fits 80 columns (the
    advice and warnings wrap between words), and each case's speedup in the table is the one
    in results.json, in full."""
    from swa_bench.report import tables
    from swa_bench.results import load_results

    path = tmp_path / "at80.yaml"
    path.write_text(AT_80)
    piped = {"COLUMNS": "80"}  # CliRunner's output is not a terminal: what a pipe gets
    run = runner.invoke(app, ["run", str(path), "--out", str(tmp_path / "out")], env=piped)
    check = runner.invoke(app, ["check", str(path)], env=piped)
    assert run.exit_code == 0 and check.exit_code == 0, run.output + check.output
    assert "recommended trim_threshold" in run.stdout
    for output in (run.output, check.output):
        lines = output.splitlines()
        assert lines and "…" not in output
        assert [line for line in lines if line != line.rstrip()] == []
        long = [line for line in lines if len(line) > 80 and not line.startswith(
            ("PASS", "FAIL", "ERROR", "UNVERIFIED")) and not (line[:1] == "[" and "/" in line[:8])]
        assert long == []
    results = load_results(tmp_path / "out")
    rows = {line.split()[0] + "/" + line.split()[1]: line for line in run.stdout.splitlines()
            if line.split()[:1] in (["eager"], ["piecewise"]) and "x" in line}
    for case in results.cases:
        row = rows[f"{case.graph_mode}/{case.policy}"]
        assert tables.speedup_cell(case) in row.split()
