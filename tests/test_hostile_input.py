"""Hostile input: every case ends in one stderr line, exit code 2, no traceback, and nothing
written or replaced. The inputs that used to grow without bound (memory, time, recursion, a read
that never ends) run in a subprocess under a memory and time limit, so a regression fails the test
instead of the machine; several such files share one subprocess (each is refused in its own line).
The rest run in this process (``tests.invoke``), asserting the same."""

from __future__ import annotations

import os
import resource
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests import invoke

REPO = Path(__file__).resolve().parents[1]
MEMORY_LIMIT = 3 * 1024**3  # validate needs ~100 MB; the alias bomb used to reach 6.4 GB
TIME_LIMIT_S = 60
BASE = "workload: {requests: [{prompt_len: 4}]}\n"


def _limits() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def swa_bench(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """``python -m swa_bench ARGS`` in a fresh interpreter under the memory and time limits."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "80"}
    return subprocess.run([sys.executable, "-m", "swa_bench", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=TIME_LIMIT_S,
                          preexec_fn=_limits)


def assert_one_line_exit_2(proc: subprocess.CompletedProcess | invoke.Outcome,
                           *starts: str) -> str:
    assert proc.returncode == 2, proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    for start in starts:
        assert start in lines[0], lines[0]
    return lines[0]


def alias_bomb() -> str:
    """Billion laughs: nine levels of nine aliases (9**9 strings once expanded)."""
    lines = ["name: bomb", BASE.strip(), "a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for level in range(1, 10):
        lines.append(f"a{level}: &a{level} [" + ", ".join([f"*a{level - 1}"] * 9) + "]")
    return "\n".join(lines) + "\ndescription: *a9\n"


def huge_grid() -> str:
    """A sweep whose product is 10**9 cases."""
    fields = ["seed", "halo_align", "eager_trim_threshold", "timing.iters", "timing.warmup",
              "max_capture_size", "trim_threshold", "checks.e1.rtol", "checks.e2.rtol"]
    values = {"checks.e1.rtol": [i / 10 for i in range(10)],
              "checks.e2.rtol": [i / 10 for i in range(10)],
              "trim_threshold": list(range(100, 110))}
    grid = "".join(f"    {f}: {values.get(f, list(range(1, 11)))}\n" for f in fields)
    return "name: grid\n" + BASE + "sweep:\n  grid:\n" + grid


# (file name, text, the field or words the one line must contain). BOMBS used to grow without
# bound and run under the limits; SCENARIOS are refused by a bounded check and run in-process.
BOMBS = [
    ("alias_bomb.yaml", alias_bomb(), "YAML aliases expand to more than"),
    ("huge_grid.yaml", huge_grid(), "sweep: expands to 10 x 10 x 10 x 10 x 10 x 10 x 10 x 10 x 10 "
                                    "= 1000000000 cases, above the cap of 1000"),
    ("deep.yaml", "name: d\n" + BASE + "description: " + "[" * 5000 + "]" * 5000 + "\n",
     "nested deeper than"),
    ("self_alias.yaml", "name: d\n" + BASE + "description: &a [*a]\n", "refers to a node"),
    ("huge_capture.yaml", "name: t\n" + BASE + "max_capture_size: 1000000000000\n",
     "max_capture_size: "),
    ("long_list.yaml", "name: l\n" + BASE + "sweep:\n  grid:\n    seed: ["
     + ", ".join(map(str, range(100_001))) + "]\n",
     "sweep.grid.seed: holds more than 100000 values"),
]
SCENARIOS = [
    ("seed.yaml", "name: s\nseed: 100000000000000000000000000000\n" + BASE, "seed: "),
    ("negative_seed.yaml", "name: s\nseed: -1\n" + BASE, "seed: must be >= 0"),
    ("long_name.yaml", "name: " + "n" * 300 + "\n" + BASE,
     "name: must be at most 100 characters, got 300"),
    ("huge_iters.yaml", "name: t\n" + BASE + "timing: {iters: 1000000000}\n", "timing.iters: "),
    ("huge_threads.yaml", "name: t\n" + BASE + "timing: {threads: 100000}\n", "timing.threads: "),
    ("huge_override.yaml", "name: t\nmodel: {overrides: {dim: 1" + "0" * 30 + "}}\n" + BASE,
     "model.overrides.dim: "),
    ("huge_vocab.yaml", "name: t\nmodel: {overrides: {vocab_size: 10000000000000}}\n" + BASE,
     "model.overrides.vocab_size: the weights and caches need at least"),
    ("huge_context.yaml", "name: t\nmodel: {overrides: {max_seq_len: 9000000000000000000}}\n"
     + BASE, "model.overrides.max_seq_len: the weights and caches need at least"),
    ("huge_replay_size.yaml", "name: t\ngraph_mode: piecewise\nreplay_capture_sizes: [8, "
     "1000000000000]\n" + BASE, "replay_capture_sizes: replay capture size 1000000000000 "
     "exceeds max_num_batched_tokens"),
    ("replay_sizes_down.yaml", "name: t\ngraph_mode: piecewise\nreplay_capture_sizes: [16, 8]\n"
     + BASE, "replay_capture_sizes: must be strictly increasing"),
    # The replay gates (issue 30): a bad value of each new field.
    ("context_logits.yaml", "name: t\nworkload: {requests: [{prompt_len: 4, context_logits: "
     "'yes'}]}\n", "workload.requests.0.context_logits: must be true or false"),
    ("spec_negative.yaml", "name: t\nworkload: {requests: [{prompt_len: 4, decode: true, "
     "spec_decode_tokens: -1}]}\n", "workload.requests.0.spec_decode_tokens: must be >= 0"),
    ("spec_prefill.yaml", "name: t\nworkload: {requests: [{prompt_len: 4, spec_decode_tokens: "
     "2}]}\n", "workload.requests.0.spec_decode_tokens: verify rows follow a decode row"),
    ("spec_window.yaml", "name: t\nworkload: {requests: [{prompt_len: 4, decode: true, "
     "spec_decode_tokens: 8}]}\n", "workload.requests.0.spec_decode_tokens: a decode row and "
     "8 verify rows exceed the model window W=8"),
    ("prefix_hit_type.yaml", "name: t\nworkload: {requests: [{prompt_len: 20, cached_len: 12, "
     "prefix_hit: 1}]}\n", "workload.requests.0.prefix_hit: must be true or false"),
    ("prefix_hit_cold.yaml", "name: t\nworkload: {requests: [{prompt_len: 20, prefix_hit: "
     "true}]}\n", "workload.requests.0.prefix_hit: a prefix hit is a prefill's cached_len > 0"),
    ("prefix_hit_chunk.yaml", "name: t\nworkload: {requests: [{prompt_len: 40, cached_len: 12, "
     "chunk_size: 8, prefix_hit: true}]}\n", "workload.requests.0.chunk_size: a prefix hit "
     "recomputes W=8 rows first"),
    ("block_reuse.yaml", "name: t\nengine: {kv_block_reuse: 'on'}\n" + BASE,
     "engine.kv_block_reuse: must be true or false"),
    ("lora.yaml", "name: t\nengine: {lora: 1}\n" + BASE, "engine.lora: must be true or false"),
    ("prompt_embeds.yaml", "name: t\nengine: {prompt_embeds: null}\n" + BASE,
     "engine.prompt_embeds: must be true or false"),
    ("engine_key.yaml", "name: t\nengine: {block_reuse: true}\n" + BASE,
     "engine.block_reuse: unknown key; expected one of: kv_block_reuse, lora, prompt_embeds"),
    ("lora_graphs.yaml", "name: t\ngraph_mode: piecewise\nreplay_capture_sizes: [8, 16]\n"
     "engine: {lora: true}\n" + BASE, "replay_capture_sizes: vLLM runs no replay graphs with "
     "LoRA"),
    # Task prompts in chunks: a size of nothing, and one that would chunk no prompt (the results
    # would say chunked while every prompt ran whole).
    ("tasks_chunk_zero.yaml", "name: t\n" + BASE + "checks: {tasks: {enabled: true, chunk_size: "
     "0}}\n", "checks.tasks.chunk_size: must be >= 1, got 0"),
    ("tasks_chunk_whole.yaml", "name: t\n" + BASE + "checks: {tasks: {enabled: true, windows: "
     "[1, 4], chunk_size: 32}}\n", "checks.tasks.chunk_size: 32 is not below the longest task "
     "prompt (4 windows of 8 = 32 tokens)"),
    ("binary.yaml", "name: t\n\x00\x01\n", ""),
    ("top_level_list.yaml", "- 1\n- 2\n", "the top level must be a mapping"),
]
COMMANDS = [("validate",), ("run", "--dry-run")]


def assert_one_line_per_file(proc, paths: list[str], expected: list[str]) -> None:
    """One subprocess, several files: exit 2, no traceback, nothing on stdout, and each file's
    one line in order, naming the file and its error."""
    assert proc.returncode == 2, proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr + proc.stdout and proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == len(paths), proc.stderr
    for line, path, words in zip(lines, paths, expected, strict=True):
        assert line.startswith(f"{path}: ") and words in line, line


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hostile")
    for name, text, _ in BOMBS + SCENARIOS:
        (folder / name).write_text(text)
    (folder / "huge_file.yaml").write_text("name: big\n" + BASE + "# " + "x" * 2_000_000 + "\n")
    return folder


@pytest.mark.parametrize("command", COMMANDS)
def test_the_bombs_are_one_line_each_under_the_limits(corpus, tmp_path, command):
    paths = [str(corpus / name) for name, _, _ in BOMBS]
    proc = swa_bench(*command, *paths, cwd=tmp_path)
    assert_one_line_per_file(proc, paths, [words for _, _, words in BOMBS])
    assert list(tmp_path.iterdir()) == [], "nothing is written for bad input"


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(("name", "text", "expected"), SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_hostile_scenario_is_one_line_exit_2(corpus, tmp_path, command, name, text, expected):
    proc = invoke.swa_bench(*command, str(corpus / name), cwd=tmp_path)
    assert_one_line_exit_2(proc, f"{corpus / name}: ", expected)
    assert proc.stdout == "" and list(tmp_path.iterdir()) == [], "nothing is written"


@pytest.mark.parametrize("command", [("run",), ("check",), ("check", "--json")])
def test_the_bombs_stop_run_and_check_too(corpus, tmp_path, command):
    names = ("alias_bomb.yaml", "huge_grid.yaml")
    paths = [str(corpus / name) for name in names]
    proc = swa_bench(*command, *paths, cwd=tmp_path)
    assert_one_line_per_file(proc, paths, ["", ""])
    assert list(tmp_path.iterdir()) == []


def test_kernels_tokens_is_refused_within_the_process_memory_limit(tmp_path):
    """The memory pre-check counts this process's own address-space limit, not only the
    machine's free memory: 3M rows of the tiny preset (3.8 GiB resident) fit the 24 GiB machine
    but not the 3 GiB limit, so they are refused in one line before any allocation."""
    proc = swa_bench("kernels", "-t", "3000000", cwd=tmp_path)
    assert_one_line_exit_2(proc, "--tokens: 3000000 rows need at least", "GiB free")
    assert list(tmp_path.iterdir()) == []


def test_a_huge_file_is_refused_unread(corpus):
    proc = swa_bench("validate", str(corpus / "huge_file.yaml"))
    assert_one_line_exit_2(proc, "larger than")


@pytest.mark.parametrize("command", COMMANDS)
def test_devices_and_pipes_are_refused_unread(tmp_path, command):
    """Their reported size is 0: /dev/zero used to fill memory, a FIFO to block forever."""
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    paths = ["/dev/zero", "/dev/urandom", str(fifo)]
    proc = swa_bench(*command, *paths, cwd=tmp_path)
    assert_one_line_per_file(proc, paths, ["is not a regular file"] * 3)


def test_max_cases_raises_the_cap(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text("name: s\n" + BASE + "sweep:\n  grid:\n    seed: [1, 2, 3, 4, 5]\n")
    assert_one_line_exit_2(invoke.swa_bench("validate", str(path), "--max-cases", "4"),
                           "= 5 cases, above the cap of 4", "--max-cases")
    proc = invoke.swa_bench("validate", str(path), "--max-cases", "5")
    assert proc.returncode == 0 and "(5 cases)" in proc.stdout


def test_a_file_name_longer_than_the_file_system_allows(tmp_path):
    name = "x" * 300 + ".yaml"
    for command in (("validate",), ("run", "--dry-run"), ("run",)):
        proc = invoke.swa_bench(*command, name, cwd=tmp_path)
        assert_one_line_exit_2(proc, f"{name}: cannot read")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def tiny_scenario(tmp_path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text("name: tiny\ndevice: cpu\n" + BASE + "timing: {enabled: false}\n")
    return path


@pytest.mark.parametrize("content", ["", "{not json", "[]", '{"schema_version": 1}'])
def test_a_corrupt_baseline_is_refused_before_the_run(tmp_path, tiny_scenario, content):
    baseline = tmp_path / "baseline.json"
    baseline.write_text(content)
    out = tmp_path / "out"
    proc = invoke.swa_bench("run", str(tiny_scenario), "--out", str(out), "--baseline",
                            str(baseline))
    assert_one_line_exit_2(proc, f"{baseline}: ")
    assert not out.exists()


@pytest.mark.parametrize("where", ["file", "under_file", "dangling", "proc", "sys"])
def test_an_unusable_out_is_refused_before_the_run(tmp_path, tiny_scenario, where):
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me")
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "missing")
    out = {"file": a_file, "under_file": a_file / "run", "dangling": dangling,
           "proc": Path("/proc/swa-bench-run"), "sys": Path("/sys/fs/swa-bench-run")}[where]
    if where == "sys" and not Path("/sys/fs").is_dir():
        pytest.skip("no /sys/fs")
    proc = invoke.swa_bench("run", str(tiny_scenario), "--out", str(out))
    assert_one_line_exit_2(proc, str(out))
    assert a_file.read_text() == "keep me" and not (tmp_path / "missing").exists()
    assert not out.exists() or out == a_file


@pytest.mark.parametrize(("variable", "value"), [("SWA_BENCH_KERNELS", "cuda"),
                                                 ("SWA_BENCH_MQA_TILE", "64,0,8"),
                                                 ("SWA_BENCH_TRITON_LAUNCH", "fast"),
                                                 ("SWA_BENCH_QUANTISED_GEMM", "fp9")])
@pytest.mark.parametrize("command", ["run", "check", "kernels"])
def test_a_malformed_kernel_setting_is_refused_before_anything_runs(tmp_path, tiny_scenario,
                                                                   variable, value, command):
    out = tmp_path / "out"
    args = {"run": ["run", str(tiny_scenario), "--out", str(out)],
            "check": ["check", str(tiny_scenario)], "kernels": ["kernels", "-t", "8"]}[command]
    proc = invoke.swa_bench(*args, env={variable: value})
    assert_one_line_exit_2(proc, f"environment: {variable}: ", repr(value))
    assert not out.exists()


def test_compare_on_deeply_nested_json(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    proc = swa_bench("compare", str(deep), str(deep))
    assert_one_line_exit_2(proc, f"{deep}: ")


def test_markup_in_an_error_is_printed_as_written(tmp_path):
    path = tmp_path / "[red]odd.yaml"
    path.write_text("name: x\n" + BASE + "seed: [enforce fail at alloc.cpp:12]\n")
    proc = invoke.swa_bench("validate", str(path))
    assert_one_line_exit_2(proc, "[red]odd.yaml: seed: must be an integer")


@pytest.fixture
def two_runs(tmp_path) -> tuple[Path, Path]:
    from swa_bench.results import save_results
    from tests.report.synthetic import synthetic_run

    runs = (tmp_path / "baseline", tmp_path / "current")
    for run_dir in runs:
        run_dir.mkdir()
        save_results(run_dir, synthetic_run(failing=False, error=False))
    return runs


@pytest.fixture
def dev_null_kept():
    """Fails a test that replaces the machine's /dev/null, and puts the device back first."""
    yield
    if not stat.S_ISCHR(os.stat("/dev/null").st_mode):
        os.remove("/dev/null")
        os.mknod("/dev/null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
        os.chmod("/dev/null", 0o666)
        pytest.fail("/dev/null was replaced by a regular file (restored)")


def _out_commands(runs: tuple[Path, Path], out: Path) -> list[tuple[str, ...]]:
    return [("export", str(runs[1]), "--out", str(out)),
            ("compare", str(runs[0]), str(runs[1]), "--out", str(out))]


def test_dev_null_as_out_stays_a_device(two_runs, dev_null_kept):
    """Root used to rename the temp file over /dev/null (others lacked the right to write /dev)."""
    for command in _out_commands(two_runs, Path("/dev/null")):
        proc = invoke.swa_bench(*command)
        assert proc.returncode == 0, proc.stderr
        assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_a_named_pipe_as_out_is_written_through(two_runs, tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for command, head in zip(_out_commands(two_runs, fifo), (b"[", b"# swa-bench compare"),
                             strict=True):
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        try:
            proc = invoke.swa_bench(*command)
            assert proc.returncode == 0, proc.stderr
            assert os.read(reader, 1 << 16).startswith(head)
        finally:
            os.close(reader)
        assert stat.S_ISFIFO(os.stat(fifo).st_mode)


@pytest.mark.parametrize("content", ["{not json", "[1, 2]"])
def test_resume_over_a_corrupt_shard_file_is_one_line(tmp_path, tiny_scenario, content):
    out = tmp_path / "out"
    shard = out / ".shards" / "shard-0.json"
    shard.parent.mkdir(parents=True)
    shard.write_text(content)
    proc = invoke.swa_bench("run", str(tiny_scenario), "--out", str(out), "--resume")
    assert_one_line_exit_2(proc, f"{shard}: ")
    assert shard.read_text() == content and sorted(p.name for p in out.iterdir()) == [".shards"]


def test_report_refuses_a_symlink_out_of_the_run_folder(two_runs, tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (two_runs[1] / "report.md").symlink_to(victim)
    proc = invoke.swa_bench("report", str(two_runs[1]))
    assert_one_line_exit_2(proc, "report.md", "outside its folder")
    assert victim.read_text() == "keep me"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_compare_refuses_a_symlinked_compare_md(two_runs, tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (two_runs[1] / "compare.md").symlink_to(victim)
    proc = invoke.swa_bench("compare", str(two_runs[0]), str(two_runs[1]))
    assert_one_line_exit_2(proc, "compare.md", "outside its folder")
    assert victim.read_text() == "keep me"


def test_an_oversized_results_file_is_refused_unread(tmp_path, monkeypatch):
    from swa_bench.results import files

    big = tmp_path / "results.json"
    big.write_text("{" + " " * 2048 + "}")
    monkeypatch.setattr(files, "MAX_RESULTS_BYTES", 1024)
    proc = invoke.swa_bench("compare", str(big), str(big))
    assert_one_line_exit_2(proc, f"{big}: ", "larger than")


@pytest.mark.parametrize("target", ["fifo", "results"])
def test_the_step_summary_is_only_appended_to_a_regular_file(two_runs, tmp_path, target):
    path = tmp_path / "fifo" if target == "fifo" else two_runs[1] / "results.json"
    if target == "fifo":
        os.mkfifo(path)
    before = None if target == "fifo" else path.read_bytes()
    proc = invoke.swa_bench("compare", str(two_runs[0]), str(two_runs[1]), "--out",
                            str(tmp_path / "c.md"), env={"GITHUB_STEP_SUMMARY": str(path)})
    assert proc.returncode == 0 and "GITHUB_STEP_SUMMARY" in proc.stderr, proc.stderr
    assert before is None or path.read_bytes() == before


def test_control_characters_from_results_are_written_out(tmp_path):
    from swa_bench.report import render_html, render_markdown
    from swa_bench.report.tables import printable
    from tests.report.synthetic import synthetic_run

    results = synthetic_run(failing=False, error=False)
    results.scenario_name = "evil\x1b]0;pwned\x07\x1b[2J"
    for text in (render_markdown(results), render_html(results)):
        assert "\x1b" not in text and "\x07" not in text and "\\x1b]0;pwned" in text
    assert printable("a\nb\tc\x9b\u202e") == "a\nb\tc\\x9b\\u202e"


@pytest.mark.parametrize("command", ["run_out", "run_out_below", "report", "compare", "export"])
def test_a_path_component_longer_than_the_file_system_allows(tmp_path, tiny_scenario, command):
    """OSError 36 (ENAMETOOLONG) used to escape as a traceback; ``run --out a/LONG/b`` is
    refused before ``a`` is made."""
    long = "x" * 300
    args = {"run_out": ["run", str(tiny_scenario), "--out", long],
            "run_out_below": ["run", str(tiny_scenario), "--out", f"a/{long}/b"],
            "report": ["report", long], "compare": ["compare", long, long],
            "export": ["export", long]}[command]
    proc = invoke.swa_bench(*args, cwd=tmp_path)
    line = assert_one_line_exit_2(proc, long)
    assert "too long" in line or "longer than" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.yaml"], "nothing is made"


def _checkpoint(path: Path, *, dtype=None, model_args: str | None = None) -> None:
    """The tiny preset's tensors saved with a tampered dtype or ``model_args`` metadata."""
    from safetensors.torch import save_file

    from swa_bench.model.args import PRESETS
    from swa_bench.model.model import build_model

    tensors = {k: v.clone() for k, v in build_model(PRESETS["tiny"], seed=0)[0].state_dict()
               .items()}
    if dtype is not None:
        tensors["head.weight"] = tensors["head.weight"].to(dtype)
    save_file(tensors, str(path),
              metadata=None if model_args is None else {"model_args": model_args})


@pytest.mark.parametrize(("what", "expected"), [
    ("int8", "model.weights: tensor head.weight is I8; the model loads float weights only"),
    ("not_json", "model.weights: checkpoint metadata model_args: not JSON"),
    ("list", "model.weights: checkpoint metadata model_args: must be a JSON object of model "
             "arguments, not list"),
])
def test_a_tampered_checkpoint_is_refused_naming_the_field(tmp_path, what, expected):
    import torch

    checkpoint = tmp_path / "w.safetensors"
    _checkpoint(checkpoint, dtype=torch.int8 if what == "int8" else None,
                model_args={"int8": None, "not_json": "{model", "list": "[64, 2]"}[what])
    scenario = tmp_path / "s.yaml"
    scenario.write_text("name: s\ndevice: cpu\nmodel: {preset: tiny, weights: w.safetensors}\n"
                        + BASE)
    for command in COMMANDS:
        proc = invoke.swa_bench(*command, str(scenario), cwd=tmp_path)
        assert_one_line_exit_2(proc, f"{scenario}: {expected}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.yaml", "w.safetensors"]


@pytest.mark.parametrize(("text", "env", "expected"), [
    ("model: {overrides: {dim: 65}}\n", {}, "model.overrides.dim: must be a multiple of 4 for "
                                            "the experts' grouped GEMM in float32 on cpu"),
    ("dtype: bfloat16\nmodel: {overrides: {moe_inter_dim: 36}}\n", {},
     "model.overrides.moe_inter_dim: must be a multiple of 8"),
    ("kernels: {backend: triton}\n", {"TRITON_INTERPRET": "0"},
     "kernels.backend: backend triton needs CUDA (or TRITON_INTERPRET=1)"),
    ("", {"SWA_BENCH_KERNELS": "triton", "TRITON_INTERPRET": "0"},
     "kernels.backend: backend triton (SWA_BENCH_KERNELS) needs CUDA"),
    ("kernels: {quantised_gemm: fp8}\n", {},
     "kernels.backend: quantised_gemm fp8 needs the triton backend, and auto resolves to torch"),
    ("kernels: {quantised_gemm: fp9}\n", {}, "kernels.quantised_gemm: must be one of"),
])
@pytest.mark.parametrize("command", [*COMMANDS, ("check",)])
def test_what_the_kernels_cannot_run_is_refused_up_front(tmp_path, text, env, expected,
                                                         command):
    """Each used to validate, then fail every case (``strides should be multiple of 16 bytes``,
    ``backend triton needs CUDA``)."""
    scenario = tmp_path / "s.yaml"
    scenario.write_text("name: s\ndevice: cpu\n" + text + BASE)
    proc = invoke.swa_bench(*command, str(scenario), cwd=tmp_path, env=env)
    assert_one_line_exit_2(proc, f"{scenario}: {expected}")
    assert [p.name for p in tmp_path.iterdir()] == ["s.yaml"]


def test_max_cases_cannot_be_raised_without_bound(corpus):
    """``--max-cases 2000000000`` on the 10**9-case grid used to expand for minutes and
    gigabytes: the option has a ceiling, refused as a usage error under the limits."""
    args = (str(corpus / "huge_grid.yaml"), "--max-cases", "2000000000")
    assert_one_line_exit_2(swa_bench("validate", *args), "--max-cases", "100000")
    for command in (("run", "--dry-run"), ("check",)):  # the same option: refused unparsed
        assert_one_line_exit_2(invoke.swa_bench(*command, *args), "--max-cases", "100000")
